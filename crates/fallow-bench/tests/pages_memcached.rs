//! `fallow bench pages` against a real memcached on 127.0.0.1, started and stopped by each
//! test (skipped, with a message, when the `memcached` binary is missing), and against
//! fake servers that misbehave.

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use fallow_bench::pages::{
    self, KeyDist, PagesError, PagesOptions, Phase, Target, ValueMode, Workload,
};

/// A memcached child process, killed (by its PID) when dropped.
struct Memcached {
    child: Child,
    port: u16,
}

impl Drop for Memcached {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn running_as_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines().any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

/// Starts memcached on a free port, or returns `None` (and says so) if it is not installed.
fn start_memcached() -> Option<Memcached> {
    let port = free_port();
    let mut cmd = Command::new("memcached");
    cmd.args(["-l", "127.0.0.1", "-U", "0", "-m", "64", "-t", "2", "-I", "2m"]);
    cmd.args(["-p", &port.to_string()]);
    if running_as_root() {
        cmd.args(["-u", "root"]);
    }
    let child = match cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn() {
        Ok(child) => child,
        Err(e) => {
            eprintln!("skipping: cannot start memcached ({e}); apt-get install memcached");
            return None;
        }
    };
    let server = Memcached { child, port };
    let deadline = Instant::now() + Duration::from_secs(5);
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "memcached did not listen on {port} within 5 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    Some(server)
}

fn options(port: u16) -> PagesOptions {
    let mut opts = PagesOptions::new(Target::Memcached { addr: format!("127.0.0.1:{port}") });
    opts.keys = 2_000;
    opts.duration = Duration::from_millis(800);
    opts
}

#[test]
fn warm_pipelined_batched_gets_all_hit() {
    let Some(mc) = start_memcached() else { return };
    let mut opts = options(mc.port);
    opts.warmup = true;
    opts.connections = 2;
    opts.queue_depth = 4;
    opts.batch = 8;
    let mut ticks = Vec::new();
    let r = pages::run(&opts, |t| ticks.push(*t)).unwrap();
    assert_eq!(r.warmup_pages, 2_000);
    assert!(r.hits > 100, "{r}");
    assert_eq!(r.misses, 0, "every key was put by the warm-up: {r}");
    assert_eq!(r.wrong, 0, "{r}");
    assert_eq!(r.pages, r.hits);
    assert_eq!(r.pages, r.requests * 8);
    assert!(r.seconds >= 0.8 && r.seconds < 5.0, "{r}");
    assert!(r.pages_per_s > 1_000.0, "{r}");
    let l = r.latency_us;
    assert!(l.p50 > 1.0 && l.p50 <= l.p99 && l.p99 <= l.p999 && l.p999 <= l.max, "{l:?}");
    assert!(ticks.iter().all(|t| t.phase == Phase::Warmup || t.elapsed <= Duration::from_secs(2)));
}

#[test]
fn mixed_zipf_dup_load_stores_and_reads_back() {
    let Some(mc) = start_memcached() else { return };
    let mut opts = options(mc.port);
    opts.workload = Workload::Mix { read: 0.5 };
    opts.dist = KeyDist::Zipf { theta: 0.99 };
    opts.value = ValueMode::Dup { distinct: 4 };
    opts.queue_depth = 8;
    opts.threads = 2;
    let r = pages::run(&opts, |_| {}).unwrap();
    assert!(r.stored > 50 && r.hits > 10, "{r}");
    assert_eq!(r.not_stored, 0, "{r}");
    assert_eq!(r.wrong, 0, "{r}");
    assert_eq!(r.hits + r.misses + r.stored, r.pages);
    // The JSON form carries the same figures.
    let json = serde_json::to_value(&r).unwrap();
    assert_eq!(json["stored"], r.stored);
    assert_eq!(json["latency_us"]["p999"], r.latency_us.p999);
}

#[test]
fn a_closed_port_is_a_connect_error() {
    let opts = options(free_port());
    match pages::run(&opts, |_| {}) {
        Err(PagesError::Connect { target, .. }) => assert!(target.starts_with("memcached://")),
        other => panic!("{other:?}"),
    }
}

/// A fake server that reads one request line and answers `reply`, then closes.
fn fake_server(reply: &'static [u8]) -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        if let Ok((stream, _)) = listener.accept() {
            let mut line = String::new();
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let _ = reader.read_line(&mut line);
            let _ = (&stream).write_all(reply);
        }
    });
    port
}

#[test]
fn garbage_from_the_server_is_a_clear_error() {
    for (reply, want) in [
        (&b"HTTP/1.1 400 Bad Request\r\n"[..], "unknown reply line"),
        (b"VALUE p7 0 1\r\nx\r\nEND\r\n", "did not ask for"),
        (b"STORED\r\n", "STORED in reply to a get"),
        (b"VALUE p1 0 5\r\nabc", "connection closed"),
        (b"ERROR\r\n", "unknown command"),
    ] {
        let mut opts = options(fake_server(reply));
        opts.keys = 1;
        let err = pages::run(&opts, |_| {}).unwrap_err();
        assert!(matches!(err, PagesError::Memcached(_)), "{err:?}");
        assert!(err.to_string().contains(want), "{err} should say {want:?}");
    }
}
