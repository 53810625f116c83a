//! The node protocol checked by an independent client: `tests/compliance/protocol_check.py`
//! drives a Python client written from `docs/protocol.md` alone against the real
//! `fallow node` binary, gossiping on its own (so MEMBERS lists it). Skipped, with a
//! message, when python3 is missing.

mod support;

use std::fs::File;
use std::path::Path;
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use support::{KillOnDrop, TempDir};

/// How long the node may take to start listening (a debug build on a busy machine).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the whole Python session may take; it needs about a second on a quiet machine.
const CHECK_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs `cmd` with its output in files under `dir`; kills it after `timeout`.
fn run_bounded(mut cmd: Command, dir: &Path, timeout: Duration) -> (ExitStatus, String) {
    let (out, err) = (dir.join("check.out"), dir.join("check.err"));
    let mut child = KillOnDrop::spawn(
        cmd.stdin(Stdio::null())
            .stdout(File::create(&out).unwrap())
            .stderr(File::create(&err).unwrap()),
    );
    let Some(status) = child.wait_timeout(timeout) else {
        child.kill();
        let output = std::fs::read_to_string(&out).unwrap_or_default();
        panic!("protocol_check.py did not finish within {timeout:?}; its output:\n{output}");
    };
    let output = std::fs::read_to_string(&out).unwrap_or_default()
        + &std::fs::read_to_string(&err).unwrap_or_default();
    (status, output)
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
    if !support::command_works("python3", &["--version"]) {
        eprintln!("skipping: python3 is not installed (the check needs only its standard library)");
        return;
    }
    let dir = TempDir::new("python-client");
    let secret = dir.path().join("secret");
    let secret_text = fresh_secret();
    assert_eq!(secret_text.len(), 32);
    std::fs::write(&secret, &secret_text).unwrap();
    let (mut node, addr) = support::start_node(
        &[
            "--listen",
            "127.0.0.1:0",
            "--gossip",
            "127.0.0.1:0",
            "--lend",
            "64M",
            "--secret-file",
            secret.to_str().unwrap(),
        ],
        START_TIMEOUT,
    );

    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/compliance/protocol_check.py");
    let mut check = Command::new("python3");
    check.arg(&script).args(["--addr", &addr, "--members", "1", "--secret-file"]).arg(&secret);
    // Leaves no __pycache__ in the source tree.
    check.env("PYTHONDONTWRITEBYTECODE", "1");
    let (status, output) = run_bounded(check, dir.path(), CHECK_TIMEOUT);

    let running = node.is_running();
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
    assert_eq!(support::node_tcp_addr(line).as_deref(), Some("127.0.0.1:35463"));
    assert_eq!(support::node_tcp_addr("INFO fallow::cmd::node: fallow node ready listen=x"), None);
}
