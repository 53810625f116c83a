//! Restarting `fallow nbd` under its clients: with the listening socket held across the
//! restart (socket activation, as systemd does it), a QEMU client with `reconnect-delay`
//! sees a pause, never an error, and write-back data acknowledged before the restart is
//! read back after it.

mod support;

use std::net::TcpListener;
use std::process::Stdio;
use std::time::{Duration, Instant};

use support::{Daemon, TempDir};

/// Pattern writes, each followed by a read of the one before, with a pause between.
const ROUNDS: usize = 150;
const SLOTS: usize = 32;

fn start(listener: &TcpListener, image: &std::path::Path) -> Daemon {
    let export = format!("d=file:{},size=16M", image.display());
    let mut cmd = fallow_testkit::process::socket_activated(support::BIN.as_ref(), listener);
    cmd.args(["nbd", "--export", &export, "--write-policy", "back", "--pool", "local:32M"])
        .env("FALLOW_LOG", "info")
        .stdin(Stdio::null());
    Daemon::start("fallow nbd", &mut cmd, "serving URI", Duration::from_secs(20), |line| {
        support::nbd_serving_uri(line)
    })
    .0
}

/// The longest `NN.NN sec` qemu-io reports for one command.
fn longest_op(output: &str) -> f64 {
    output
        .lines()
        .filter_map(|l| l.split("; ").nth(1)?.strip_suffix(" sec").map(str::to_string))
        .filter_map(|t| t.split_whitespace().next()?.parse::<f64>().ok())
        .fold(0.0, f64::max)
}

#[test]
fn qemu_rides_out_restarts_of_a_socket_activated_export_without_an_error() {
    if !support::command_works("qemu-io", &["--version"]) {
        eprintln!("skipping: qemu-io is not installed (Debian package qemu-utils)");
        return;
    }
    let dir = TempDir::new("nbd-restart");
    let image = dir.path().join("disk.img");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut server = start(&listener, &image);

    let mut commands = Vec::new();
    for i in 0..ROUNDS {
        let pattern = |i: usize| i % 250 + 1;
        let offset = |i: usize| (i % SLOTS) * 65536;
        commands.push(format!("write -P {} {} 64k", pattern(i), offset(i)));
        if i > 0 {
            commands.push(format!("read -P {} {} 64k", pattern(i - 1), offset(i - 1)));
        }
        commands.push("sleep 20".to_string());
    }
    let mut qemu_io = std::process::Command::new("timeout");
    qemu_io.args(["120", "qemu-io"]);
    for c in &commands {
        qemu_io.args(["-c", c]);
    }
    let opts = format!("driver=nbd,host=127.0.0.1,port={port},export=d,reconnect-delay=20");
    let client = qemu_io
        .args(["--image-opts", &opts])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();

    // Three restarts while the client runs: each SIGTERM drains, writes the dirty pages
    // out, and exits; the next process takes up the same socket.
    for restart in 0..3 {
        // The client is connected to this process (after a restart: it reconnected).
        server.wait_for_line("a client", Duration::from_secs(10), |l| {
            l.contains("NBD client connected").then_some(())
        });
        std::thread::sleep(Duration::from_millis(300));
        let stopping = Instant::now();
        server.signal("TERM");
        let status = server.wait_timeout(Duration::from_secs(20));
        assert!(
            status.is_some_and(|s| s.success()),
            "restart {restart}: the server did not stop cleanly ({status:?}):\n{}",
            server.log_so_far()
        );
        server = start(&listener, &image);
        println!("restart {restart}: {:?} from SIGTERM to serving", stopping.elapsed());
    }
    server.wait_for_line("the client, reconnected", Duration::from_secs(10), |l| {
        l.contains("NBD client connected").then_some(())
    });

    let out = client.wait_with_output().unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "qemu-io failed:\n{text}");
    for bad in ["failed", "error", "Error", "Pattern verification"] {
        assert!(!text.contains(bad), "qemu-io reported {bad:?}:\n{text}");
    }
    assert_eq!(text.matches("wrote 65536/65536").count(), ROUNDS, "{text}");
    assert_eq!(text.matches("read 65536/65536").count(), ROUNDS - 1, "{text}");
    let longest = longest_op(&text);
    println!("longest single request: {longest:.2} s");
    // Far above the pause a restart costs (BENCHMARKS.md measures it); a client that
    // waited for its 20 s reconnect-delay to run out would show here.
    assert!(longest < 10.0, "a request waited {longest} s:\n{text}");
    let served = server.log_so_far();
    assert!(served.contains("socket handed over by the service manager"), "{served}");
    server.signal("TERM");
    assert!(server.wait_timeout(Duration::from_secs(20)).is_some_and(|s| s.success()));
}

/// Connects, reads the 18-byte NBD greeting, and hangs up: whether the server answered.
fn greeted(port: u16) -> Result<(), String> {
    use std::io::Read;
    let mut stream =
        std::net::TcpStream::connect(("127.0.0.1", port)).map_err(|e| format!("connect: {e}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).map_err(|e| format!("greeting: {e}"))?;
    if &greeting[..8] != b"NBDMAGIC" {
        return Err(format!("not a greeting: {greeting:?}"));
    }
    Ok(())
}

/// The upgrade path: while one process stops and the next starts on the same socket, no
/// connection is refused; those that come meanwhile wait in the socket's backlog.
#[test]
fn no_connection_is_refused_while_a_socket_activated_export_restarts() {
    let dir = TempDir::new("nbd-restart-connect");
    let image = dir.path().join("disk.img");
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let mut server = start(&listener, &image);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let connecting = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let (mut ok, mut failed, mut longest) = (0, Vec::new(), Duration::ZERO);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && ok < 100_000 {
                let started = Instant::now();
                match greeted(port) {
                    Ok(()) => ok += 1,
                    Err(e) => failed.push(e),
                }
                longest = longest.max(started.elapsed());
            }
            (ok, failed, longest)
        })
    };
    for _ in 0..3 {
        std::thread::sleep(Duration::from_millis(300));
        server.signal("TERM");
        assert!(server.wait_timeout(Duration::from_secs(20)).is_some_and(|s| s.success()));
        server = start(&listener, &image);
    }
    std::thread::sleep(Duration::from_millis(300));
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (ok, failed, longest) = connecting.join().unwrap();
    println!("{ok} connections greeted across 3 restarts; the longest wait {longest:?}");
    assert!(
        failed.is_empty(),
        "{} connections failed: {:?}",
        failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(ok > 10, "only {ok} connections");
    server.signal("TERM");
    assert!(server.wait_timeout(Duration::from_secs(20)).is_some_and(|s| s.success()));
}
