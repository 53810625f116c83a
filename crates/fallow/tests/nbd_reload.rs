//! `fallow nbd --config`: the file's settings and per-export sections, and SIGHUP: each
//! export's local tier and write-back limits change while it serves, what cannot change is
//! named, and a broken file changes nothing.

mod support;

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use support::{Daemon, TempDir};

fn write_config(path: &Path, image: &Path, export: &str) {
    let text = format!(
        "listen = [\"127.0.0.1:0\"]\nmetrics = \"127.0.0.1:0\"\npool = \"local:64M\"\n\
         write_policy = \"back\"\nlocal_tier = \"8M\"\n\n[exports.d]\nbacking = \"file:{}\"\n{export}",
        image.display()
    );
    std::fs::write(path, text).unwrap();
}

fn gauge(metrics: &str, name: &str) -> f64 {
    let text = support::scrape(metrics);
    support::metric(&text, name, "export=\"d\"").unwrap_or_else(|| panic!("no {name}:\n{text}"))
}

#[test]
fn sighup_resizes_the_local_tier_and_the_dirty_limits_of_a_serving_export() {
    if !support::command_works("qemu-io", &["--version"]) {
        eprintln!("skipping: qemu-io is not installed (Debian package qemu-utils)");
        return;
    }
    let dir = TempDir::new("nbd-reload");
    let image = dir.path().join("disk.img");
    std::fs::write(&image, vec![0x3c; 8 << 20]).unwrap();
    let config = dir.path().join("nbd.toml");
    write_config(&config, &image, "max_dirty = \"16M\"\n");
    let (mut server, uri) = Daemon::start(
        "fallow nbd",
        support::fallow()
            .args(["nbd", "--config"])
            .arg(&config)
            .env("FALLOW_LOG", "info")
            .stdin(Stdio::null()),
        "serving URI",
        Duration::from_secs(20),
        support::nbd_serving_uri,
    );
    let metrics = server.log_lines().iter().find_map(|l| support::metrics_addr(l)).unwrap();
    // The export's own section set 16M; the file's default local tier is 8M (2048 pages).
    assert_eq!(gauge(&metrics, "fallow_nbd_dirty_limit_bytes"), (16 << 20) as f64);
    let reads: Vec<String> = (0..96).map(|i| format!("read -P 0x3c {} 64k", i * 65536)).collect();
    let reads: Vec<&str> = reads.iter().map(String::as_str).collect();
    let (ok, text) = support::qemu_io(&uri, &reads);
    assert!(ok && !text.contains("Pattern"), "{text}");
    assert_eq!(gauge(&metrics, "fallow_nbd_local_tier_pages"), 1536.0);

    // Smaller tier and limits, and a mode change, which has to wait.
    write_config(
        &config,
        &image,
        "local_tier = \"1M\"\nmax_dirty = \"4M\"\nmax_dirty_age_ms = 200\nmode = \"inclusive\"\n",
    );
    server.signal("HUP");
    server.wait_for_line("the reload", Duration::from_secs(10), |l| {
        l.contains("config reloaded").then(|| {
            assert!(
                l.contains("d: local tier 256 pages") && l.contains("max_dirty 4194304 B"),
                "{l}"
            );
        })
    });
    assert_eq!(gauge(&metrics, "fallow_nbd_local_tier_pages"), 256.0);
    assert_eq!(gauge(&metrics, "fallow_nbd_dirty_limit_bytes"), (4 << 20) as f64);
    assert_eq!(gauge(&metrics, "fallow_nbd_dirty_age_limit_seconds"), 0.2);
    let log = server.log_so_far();
    assert!(
        log.lines().any(|l| l.contains("when the server restarts") && l.contains("d: mode")),
        "{log}"
    );

    // Still serving, the data intact; writes go through the new limits.
    let (ok, text) =
        support::qemu_io(&uri, &["write -P 0x11 0 1M", "read -P 0x11 0 1M", "read -P 0x3c 1M 1M"]);
    assert!(ok && !text.contains("Pattern") && !text.contains("failed"), "{text}");

    // A broken file changes nothing.
    std::fs::write(&config, "[exports.d]\nbacking = 3\n").unwrap();
    server.signal("HUP");
    server.wait_for_line("the failed reload", Duration::from_secs(10), |l| {
        l.contains("reload failed").then_some(())
    });
    assert_eq!(gauge(&metrics, "fallow_nbd_dirty_limit_bytes"), (4 << 20) as f64);
    server.signal("TERM");
    assert!(server.wait_timeout(Duration::from_secs(20)).is_some_and(|s| s.success()));
    // The write-back data reached the file.
    let bytes = std::fs::read(&image).unwrap();
    assert!(bytes[..1 << 20].iter().all(|b| *b == 0x11));
}

#[test]
fn a_config_file_with_an_unknown_key_or_no_export_is_refused() {
    let dir = TempDir::new("nbd-config-bad");
    let config = dir.path().join("nbd.toml");
    for (text, why) in [
        ("lcoal_tier = \"1G\"\n[exports.d]\nbacking = \"mem:1M\"\n", "unknown field"),
        ("local_tier = \"1G\"\n", "no export"),
        ("[exports.d]\nbacking = \"mem:1M\"\nmax_dirty = \"lots\"\n", "[exports.d] max-dirty"),
    ] {
        std::fs::write(&config, text).unwrap();
        let out = support::fallow().args(["nbd", "--config"]).arg(&config).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.contains(why), "{text:?}: {err}");
    }
}
