//! `fallow up`, the embedded default: it creates its image on first run, serves it over
//! NBD, stops cleanly, and a second run serves the same data. Skips without qemu-io.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_fallow");

struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn up(dir: &std::path::Path) -> (Guard, String) {
    let mut child = Command::new(BIN)
        .args(["up", "--size", "32M", "--listen", "127.0.0.1:0", "--lend", "16M", "--quiet"])
        .arg("--data-dir")
        .arg(dir)
        .env("FALLOW_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if let Some(uri) =
                line.split(" at ").nth(1).filter(|_| line.starts_with("fallow up: serving"))
            {
                let _ = tx.send(uri.to_string());
            }
        }
    });
    let uri = rx.recv_timeout(Duration::from_secs(20)).expect("fallow up prints its URI");
    (Guard(child), uri)
}

fn qemu_io(uri: &str, commands: &[&str]) -> String {
    let mut cmd = Command::new("timeout");
    cmd.args(["60", "qemu-io", "-f", "raw"]);
    for c in commands {
        cmd.args(["-c", c]);
    }
    let out = cmd.arg(uri).output().unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && !text.contains("fail") && !text.contains("error"), "{text}");
    text
}

#[test]
fn up_serves_an_image_that_survives_a_restart() {
    if Command::new("sh")
        .args(["-c", "command -v qemu-io"])
        .output()
        .map_or(true, |o| !o.status.success())
    {
        eprintln!("skipped: qemu-io is needed (Debian package qemu-utils)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("fallow-up-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (mut first, uri) = up(&dir);
    qemu_io(&uri, &["write -P 0x42 1M 256k", "flush", "read -P 0x42 1M 256k"]);
    let image = dir.join("disk.img");
    assert_eq!(std::fs::metadata(&image).unwrap().len(), 32 << 20);
    Command::new("kill").args(["-TERM", &first.0.id().to_string()]).status().unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    let exit = loop {
        if let Some(exit) = first.0.try_wait().unwrap() {
            break exit;
        }
        assert!(Instant::now() < deadline, "fallow up did not stop on SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(exit.success(), "{exit:?}");
    let (_second, uri) = up(&dir);
    qemu_io(&uri, &["read -P 0x42 1M 256k", "read -P 0 0 1M"]);
    drop(_second);
    let _ = std::fs::remove_dir_all(&dir);
}
