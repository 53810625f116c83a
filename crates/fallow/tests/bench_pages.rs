//! The `fallow bench pages` command, run as a user would: a real memcached on 127.0.0.1
//! (skipped, with a message, when the binary is missing), a real process, exit codes.

mod support;

use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::Duration;

use support::{fallow, free_port, KillOnDrop};

/// Starts memcached on a free port, or returns `None` (and says so) if it is not installed.
fn start_memcached() -> Option<(KillOnDrop, u16)> {
    let port = free_port();
    let root = std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
    });
    let mut cmd = Command::new("memcached");
    cmd.args(["-l", "127.0.0.1", "-U", "0", "-m", "64", "-p", &port.to_string()]);
    if root {
        cmd.args(["-u", "root"]);
    }
    let child = match cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn() {
        Ok(child) => KillOnDrop::new(child),
        Err(e) => {
            eprintln!("skipping: cannot start memcached ({e}); apt-get install memcached");
            return None;
        }
    };
    assert!(
        support::port_opens(port, Duration::from_secs(5)),
        "memcached did not listen on {port} within 5 s"
    );
    Some((child, port))
}

#[test]
fn json_report_against_memcached() {
    let Some((mc, port)) = start_memcached() else { return };
    let out = fallow()
        .args(["bench", "pages", "--target", &format!("memcached://127.0.0.1:{port}")])
        .args(["--keys", "500", "--warmup", "-q", "4", "-b", "4", "-d", "1200ms", "--json"])
        .args(["--server-pid", &mc.pid().to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["server"], "memcached");
    assert_eq!(v["warmup_pages"], 500);
    assert_eq!(v["batch"], 4);
    assert_eq!(v["misses"], 0);
    assert_eq!(v["wrong"], 0);
    assert!(v["hits"].as_u64().unwrap() > 0);
    assert!(v["pages_per_s"].as_f64().unwrap() > 0.0);
    for q in ["p50", "p99", "p999"] {
        assert!(v["latency_us"][q].as_f64().unwrap() > 0.0, "{q}");
    }
    // memcached's CPU time over the measured 1.2 s: counted in 10 ms ticks, so possibly
    // zero, and never more than the host's CPUs could give it.
    let cpu = &v["server_cpu"];
    assert_eq!(cpu["pid"], mc.pid(), "{v}");
    let host = std::thread::available_parallelism().unwrap().get() as f64;
    let (seconds, cpus) = (cpu["seconds"].as_f64().unwrap(), cpu["cpus"].as_f64().unwrap());
    assert!(seconds >= 0.0 && (0.0..host + 0.1).contains(&cpus), "{cpu}");
    let per_page = cpu["us_per_page"].as_f64().unwrap();
    let pages = v["pages"].as_f64().unwrap();
    assert!((per_page - seconds * 1e6 / pages).abs() < 1e-6, "{cpu}");
    // One progress line a second on stderr.
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.lines().any(|l| l.starts_with("measure") && l.contains("pages/s")), "{stderr}");
}

#[test]
fn bad_arguments_fail_with_a_clear_message() {
    let cases: &[(&[&str], &str)] = &[
        (&["--target", "redis://127.0.0.1:1"], "unknown scheme"),
        (&["--target", "memcached://127.0.0.1:1", "--workload", "mix:2"], "read fraction"),
        (&["--target", "memcached://127.0.0.1:1", "--dist", "zipf:-1"], "theta"),
        (&["--target", "fallow://127.0.0.1:1"], "--secret-file"),
        (&["--target", "memcached://127.0.0.1:1", "-q", "0"], "queue depth"),
        (&["--target", "memcached://127.0.0.1:1", "--server-pid", "4294967295"], "server PID"),
    ];
    for (args, want) in cases {
        let out = fallow().args(["bench", "pages", "-d", "100ms"]).args(*args).output().unwrap();
        assert!(!out.status.success(), "{args:?} succeeded");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(want), "{args:?}: {stderr:?} should say {want:?}");
    }
}

#[test]
fn an_unreachable_server_fails_and_names_it() {
    let target = format!("memcached://127.0.0.1:{}", free_port());
    let out =
        fallow().args(["bench", "pages", "--target", &target, "-d", "100ms"]).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("cannot connect to") && stderr.contains(&target), "{stderr}");
}

#[test]
fn json_report_against_a_fallow_node() {
    let dir = std::env::temp_dir().join(format!("fallow-bench-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "0123456789abcdef0123456789abcdef\n").unwrap();
    let port = free_port();
    let mut node = KillOnDrop::spawn(
        fallow()
            .args(["node", "--listen", &format!("127.0.0.1:{port}"), "--lend", "64M"])
            .arg("--secret-file")
            .arg(&secret)
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
    );
    let listening = support::poll_until(Duration::from_secs(10), || {
        let up = TcpStream::connect(("127.0.0.1", port)).is_ok();
        assert!(up || node.is_running(), "the node exited");
        up
    });
    assert!(listening, "the node did not listen on {port} within 10 s");
    let out = fallow()
        .args(["bench", "pages", "--target", &format!("fallow://127.0.0.1:{port}")])
        .arg("--secret-file")
        .arg(&secret)
        .args(["--keys", "500", "--warmup", "-q", "4", "-b", "4", "-d", "1s", "--json", "--quiet"])
        .args(["--value", "dup", "--dedup", "on"])
        .output()
        .unwrap();
    drop(node);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["server"], "fallow");
    assert_eq!(v["dedup"], true);
    assert_eq!(v["value"], "dup:16");
    assert_eq!(v["misses"], 0);
    assert_eq!(v["wrong"], 0);
    assert!(v["hits"].as_u64().unwrap() > 0);
    assert!(
        out.stderr.is_empty(),
        "--quiet prints nothing: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
