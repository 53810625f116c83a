//! The node protocol checked by an independent client: `tests/compliance/protocol_check.py`
//! drives a Python client written from `docs/protocol.md` alone against the real
//! `fallow node` binary. Skipped, with a message, when python3 is missing.

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How long the node may take to start listening (a debug build on a busy machine).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the whole Python session may take; it needs about a second on a quiet machine.
const CHECK_TIMEOUT: Duration = Duration::from_secs(120);

/// A child process, killed (by its PID) and reaped when dropped, so that a failed
/// assertion never leaves a node or a script running.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A scratch directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> TempDir {
        let dir = std::env::temp_dir().join(format!("fallow-python-client-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running node: its process, its TCP address, and its log lines as they come.
struct Node {
    process: KillOnDrop,
    addr: String,
    log: Receiver<String>,
}

impl Node {
    /// Starts `fallow node` on port 0 and learns the port from its log.
    fn start(secret: &Path) -> Node {
        let child = Command::new(env!("CARGO_BIN_EXE_fallow"))
            .args(["node", "--listen", "127.0.0.1:0", "--lend", "64M", "--secret-file"])
            .arg(secret)
            .env("FALLOW_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut process = KillOnDrop(child);
        let stderr = process.0.stderr.take().unwrap();
        let (send, log) = mpsc::channel();
        // Drains stderr for the node's whole life, so that it never blocks on a full pipe.
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + START_TIMEOUT;
        let mut seen = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match log.recv_timeout(left) {
                Ok(line) => {
                    if let Some(addr) = listening_addr(&line) {
                        return Node { process, addr, log };
                    }
                    seen.push(line);
                }
                Err(RecvTimeoutError::Timeout) => {
                    let seen = seen.join("\n");
                    panic!("the node did not log its address within {START_TIMEOUT:?}:\n{seen}")
                }
                Err(RecvTimeoutError::Disconnected) => {
                    let status = process.0.wait().unwrap();
                    panic!("the node exited ({status}) before listening:\n{}", seen.join("\n"))
                }
            }
        }
    }

    /// Every log line received so far.
    fn log_so_far(&self) -> String {
        self.log.try_iter().collect::<Vec<_>>().join("\n")
    }
}

/// The address in the node's `listening on TCP addr=127.0.0.1:PORT` line.
fn listening_addr(line: &str) -> Option<String> {
    if !line.contains("listening on TCP") {
        return None;
    }
    let addr = line.split_once("addr=")?.1.split_whitespace().next()?;
    Some(addr.to_string())
}

/// Runs `cmd` with its output in files under `dir`; kills it after `timeout`.
fn run_bounded(mut cmd: Command, dir: &Path, timeout: Duration) -> (ExitStatus, String) {
    let (out, err) = (dir.join("check.out"), dir.join("check.err"));
    let child = cmd
        .stdin(Stdio::null())
        .stdout(File::create(&out).unwrap())
        .stderr(File::create(&err).unwrap())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    let deadline = Instant::now() + timeout;
    let status = loop {
        if let Some(status) = child.0.try_wait().unwrap() {
            break status;
        }
        if Instant::now() >= deadline {
            let _ = child.0.kill();
            let _ = child.0.wait();
            let output = std::fs::read_to_string(&out).unwrap_or_default();
            panic!("protocol_check.py did not finish within {timeout:?}; its output:\n{output}");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let output = std::fs::read_to_string(&out).unwrap_or_default()
        + &std::fs::read_to_string(&err).unwrap_or_default();
    (status, output)
}

fn python3_available() -> bool {
    Command::new("python3")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// 32 printable bytes, different on every run (no surrounding whitespace, which the node
/// would trim).
fn fresh_secret() -> String {
    let nanos = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_nanos() as u64;
    let pid = u64::from(std::process::id());
    format!("{nanos:016x}{:016x}", pid.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ nanos.rotate_left(17))
}

#[test]
fn python_client_written_from_the_spec_passes_against_a_real_node() {
    if !python3_available() {
        eprintln!("skipping: python3 is not installed (the check needs only its standard library)");
        return;
    }
    let dir = TempDir::new();
    let secret = dir.0.join("secret");
    let secret_text = fresh_secret();
    assert_eq!(secret_text.len(), 32);
    std::fs::write(&secret, &secret_text).unwrap();
    let mut node = Node::start(&secret);

    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/compliance/protocol_check.py");
    let mut check = Command::new("python3");
    check.arg(&script).args(["--addr", &node.addr, "--secret-file"]).arg(&secret);
    // Leaves no __pycache__ in the source tree.
    check.env("PYTHONDONTWRITEBYTECODE", "1");
    let (status, output) = run_bounded(check, &dir.0, CHECK_TIMEOUT);

    let running = node.process.0.try_wait().unwrap().is_none();
    assert!(
        status.success() && running,
        "protocol_check.py: {status}; node still running: {running}\n--- check output ---\n\
         {output}\n--- node log ---\n{}",
        node.log_so_far()
    );
    assert!(output.contains("all protocol checks passed"), "{output}");
    println!("{output}");
}

#[test]
fn the_listening_line_parses() {
    let line = "2026-01-01T00:00:00.000000Z  INFO fallow_node::server: listening on TCP \
                addr=127.0.0.1:35463";
    assert_eq!(listening_addr(line).as_deref(), Some("127.0.0.1:35463"));
    assert_eq!(listening_addr("INFO fallow::cmd::node: fallow node ready listen=x"), None);
}
