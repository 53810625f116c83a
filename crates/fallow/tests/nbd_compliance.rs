//! The NBD server checked by third-party clients: the scripts in `tests/compliance/nbd/`
//! (qemu-img, qemu-io, nbdinfo, nbdsh, nbdcopy, fio, ext4 over nbdfuse) run against the
//! real `fallow nbd` binary in each cache configuration worth covering.
//!
//! This file is the one place that starts and stops servers. Each test starts one server
//! on `127.0.0.1:0` with one fresh 64 MiB export per script, runs the scripts at once (so
//! the exports share the server's pool and the scripts also check that exports do not
//! see each other's data), and requires every script to pass or to skip (exit 77, with
//! its reason printed: a tool, `/dev/fuse` or root is missing). The server must then still
//! be running, must not have panicked, and must stop cleanly on SIGTERM. The read-only
//! configuration serves existing files filled with a known pattern instead, to the
//! scripts that can check a read-only export; the nbdkit configuration puts fallow in
//! front of `nbdkit memory` with the delay filter (the error filter, switched on and off
//! mid-run, is in `nbd_upstream.rs`).
//!
//! `NBD_COMPLIANCE_ONLY=fio,nbdsh cargo test -p fallow --test nbd_compliance` runs a subset.

mod support;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::{Daemon, KillOnDrop, ProcessGroup, TempDir};

/// The scripts, by the name that also names their export: `test-NAME.sh`.
const SCRIPTS: &[&str] = &["qemu-img", "qemu-io", "nbdinfo", "nbdsh", "nbdcopy", "fio", "ext4"];

/// The scripts for an upstream NBD store: nbdinfo and nbdsh also check block status
/// (`base:allocation`), which an upstream store does not offer (fallow asks it nothing
/// but simple replies), so they run on the file and memory backings only.
const UPSTREAM_SCRIPTS: &[&str] = &["qemu-img", "qemu-io", "nbdcopy", "fio", "ext4"];

/// The scripts that know how to check a read-only export (`READ_ONLY=1`).
const READ_ONLY_SCRIPTS: &[&str] = &["nbdinfo", "nbdsh", "nbdcopy"];

/// The size of each export; every script fits its work in 64 MiB.
const EXPORT_SIZE: &str = "64M";
/// [`EXPORT_SIZE`] in bytes.
const EXPORT_BYTES: usize = 64 << 20;

/// How long the server may take to start listening (a debug build on a busy machine).
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A backstop per script: each bounds its own commands to 60 s, and all of them together
/// take well under a minute on a quiet 2-core machine.
const SCRIPT_TIMEOUT: Duration = Duration::from_secs(180);

/// The exit status with which a script says it skipped.
const SKIPPED: i32 = 77;

/// What backs the exports of one configuration.
#[derive(Debug, Clone, Copy)]
enum Backing {
    /// A sparse file per export, created by the server; scripts may read it directly.
    File,
    /// `mem:` (a RAM disk).
    Mem,
    /// An existing file, given as a plain path, filled with the offset pattern (see
    /// [`write_pattern`]); the export is read-only.
    Pattern,
    /// An upstream NBD server: `nbdkit memory` behind its delay filter (1 ms per request),
    /// one per export, so fallow fronts a slow store it reaches over NBD.
    NbdkitDelay,
}

#[test]
fn file_backing_local_pool_exclusive() {
    run_suite(
        "file-exclusive",
        Backing::File,
        &["--pool", "local:32M", "--local-tier", "1M", "--mode", "exclusive"],
        SCRIPTS,
    );
}

#[test]
fn file_backing_local_pool_inclusive() {
    run_suite(
        "file-inclusive",
        Backing::File,
        &["--pool", "local:32M", "--local-tier", "1M", "--mode", "inclusive"],
        SCRIPTS,
    );
}

#[test]
fn file_backing_write_back() {
    // A small dirty limit and age, so that FLUSH, FUA, the writers' backpressure and the
    // background flusher all run; scripts that compare the backing file after a flush
    // check that FLUSH really wrote everything.
    run_suite(
        "file-write-back",
        Backing::File,
        &[
            "--pool",
            "local:32M",
            "--local-tier",
            "1M",
            "--write-policy",
            "back",
            "--max-dirty",
            "2M",
            "--max-dirty-age",
            "50",
        ],
        SCRIPTS,
    );
}

#[test]
fn nbdkit_delay_backing() {
    if !support::have("nbdkit") {
        eprintln!("skipping nbdkit-delay: nbdkit is not installed (Debian package nbdkit)");
        return;
    }
    run_suite(
        "nbdkit-delay",
        Backing::NbdkitDelay,
        &["--pool", "local:32M", "--local-tier", "1M"],
        UPSTREAM_SCRIPTS,
    );
}

#[test]
fn mem_backing_no_cache() {
    run_suite("mem-uncached", Backing::Mem, &["--pool", "none", "--local-tier", "0"], SCRIPTS);
}

#[test]
fn read_only_file_local_pool() {
    run_suite(
        "read-only",
        Backing::Pattern,
        &["--read-only", "--pool", "local:32M", "--local-tier", "1M"],
        READ_ONLY_SCRIPTS,
    );
}

/// Starts a server with one export per script and `args`, runs the scripts against it,
/// and fails with every failing script's output.
fn run_suite(config: &str, backing: Backing, args: &[&str], scripts: &[&'static str]) {
    if !support::command_works("bash", &["--version"]) {
        eprintln!("skipping {config}: bash is not installed");
        return;
    }
    let scripts = selected_scripts(scripts);
    if scripts.is_empty() {
        println!("{config}: no script selected");
        return;
    }
    let dir = TempDir::new(&format!("nbd-compliance-{config}"));
    // Upstream servers live as long as the suite.
    let mut upstreams: Vec<KillOnDrop> = Vec::new();
    let exports: Vec<(String, Option<PathBuf>)> = scripts
        .iter()
        .map(|name| match backing {
            Backing::File => {
                let image = dir.path().join(format!("{name}.img"));
                (format!("{name}=file:{},size={EXPORT_SIZE}", image.display()), Some(image))
            }
            Backing::Mem => (format!("{name}=mem:{EXPORT_SIZE}"), None),
            Backing::Pattern => {
                let image = dir.path().join(format!("{name}.img"));
                write_pattern(&image, EXPORT_BYTES);
                (format!("{name}={}", image.display()), Some(image))
            }
            Backing::NbdkitDelay => {
                let port = support::free_port();
                upstreams.push(KillOnDrop::spawn(
                    Command::new("nbdkit")
                        .args(["-f", "-i", "127.0.0.1", "-p", &port.to_string()])
                        .args(["--exit-with-parent", "--filter=delay", "memory", EXPORT_SIZE])
                        .args(["rdelay=1ms", "wdelay=1ms"])
                        .stdout(Stdio::null())
                        .stderr(Stdio::null()),
                ));
                assert!(support::port_opens(port, START_TIMEOUT), "nbdkit did not start");
                (format!("{name}=nbd://127.0.0.1:{port}"), None)
            }
        })
        .collect();
    let mut server_args = vec!["--listen", "127.0.0.1:0"];
    for (spec, _) in &exports {
        server_args.extend(["--export", spec]);
    }
    server_args.extend(args);
    let mut server = Server::start(&server_args);
    println!("{config}: {}", server.base_uri);

    // Every script at once, each in its own thread and scratch directory.
    let started = Instant::now();
    let runs: Vec<_> = scripts
        .iter()
        .zip(&exports)
        .map(|(name, (_, image))| {
            let uri = format!("{}{name}", server.base_uri);
            let scratch = dir.path().join(format!("{name}.run"));
            std::fs::create_dir_all(&scratch).unwrap();
            let image = image.clone();
            let name = name.to_string();
            let read_only = matches!(backing, Backing::Pattern);
            std::thread::spawn(move || {
                run_script(&name, &uri, image.as_deref(), read_only, &scratch)
            })
        })
        .collect();
    let outcomes: Vec<Outcome> = runs.into_iter().map(|run| run.join().unwrap()).collect();

    let mut failures = Vec::new();
    for outcome in &outcomes {
        match &outcome.result {
            Ok(Verdict::Passed) => {
                println!("{config}: {} passed in {:?}", outcome.name, outcome.took)
            }
            Ok(Verdict::Skipped(why)) => println!("{config}: {} SKIPPED: {why}", outcome.name),
            Err(why) => {
                println!("{config}: {} FAILED ({why})", outcome.name);
                failures.push(format!(
                    "=== {config}: test-{}.sh {why} ===\n{}",
                    outcome.name, outcome.output
                ));
            }
        }
    }
    println!("{config}: all scripts done in {:?}", started.elapsed());
    let log = server.daemon.log_so_far();
    let alive = server.daemon.is_running();
    assert!(
        failures.is_empty() && alive && !log.contains("panicked"),
        "{config}: {} of {} scripts failed; server still running: {alive}\n{}\n\
         === server log (last 60 lines) ===\n{}",
        failures.len(),
        outcomes.len(),
        failures.join("\n"),
        tail(&log, 60)
    );
    server.stop_cleanly();
}

/// `NBD_COMPLIANCE_ONLY=a,b` picks some of `scripts` by name; unset, all of them.
fn selected_scripts(scripts: &[&'static str]) -> Vec<&'static str> {
    let Ok(only) = std::env::var("NBD_COMPLIANCE_ONLY") else {
        return scripts.to_vec();
    };
    let wanted: Vec<&str> = only.split(',').map(str::trim).collect();
    for name in &wanted {
        assert!(SCRIPTS.contains(name), "NBD_COMPLIANCE_ONLY: no script named {name:?}");
    }
    scripts.iter().copied().filter(|s| wanted.contains(s)).collect()
}

/// Fills `path` with `len` bytes of the offset pattern: each 8-byte-aligned word holds
/// its own offset, big-endian (`pattern` in `nbdsh_checks.py` is the same function).
fn write_pattern(path: &Path, len: usize) {
    let words = (0..len as u64 / 8).map(|w| (w * 8).to_be_bytes());
    let bytes: Vec<u8> = words.flatten().collect();
    std::fs::write(path, bytes).unwrap();
}

/// How a script ended.
enum Verdict {
    Passed,
    Skipped(String),
}

struct Outcome {
    name: String,
    /// `Err` says how it failed (exit status or timeout).
    result: Result<Verdict, String>,
    /// Its stdout and stderr.
    output: String,
    took: Duration,
}

/// Runs `test-NAME.sh URI` in its own process group, bounded by [`SCRIPT_TIMEOUT`].
fn run_script(
    name: &str,
    uri: &str,
    image: Option<&Path>,
    read_only: bool,
    scratch: &Path,
) -> Outcome {
    let script = scripts_dir().join(format!("test-{name}.sh"));
    let out = scratch.join("output");
    let started = Instant::now();
    File::create(&out).unwrap();
    // stdout and stderr interleave in one file: two handles, both appending.
    let append = || File::options().append(true).open(&out).unwrap();
    let mut cmd = Command::new("bash");
    cmd.arg(&script)
        .arg(uri)
        .env("TMPDIR", scratch)
        .env("READ_ONLY", if read_only { "1" } else { "0" })
        .current_dir(scratch)
        .stdin(Stdio::null())
        .stdout(append())
        .stderr(append());
    match image {
        Some(image) => cmd.env("BACKING_FILE", image),
        None => cmd.env_remove("BACKING_FILE"),
    };
    // Its own process group, so that a timeout stops the tools it started too.
    let mut child = ProcessGroup::spawn(&mut cmd);
    let status = child.wait_until(started + SCRIPT_TIMEOUT);
    let output = std::fs::read_to_string(&out).unwrap_or_default();
    let result = match status {
        None => Err(format!("timed out after {SCRIPT_TIMEOUT:?}")),
        Some(status) if status.success() => Ok(Verdict::Passed),
        Some(status) if status.code() == Some(SKIPPED) => {
            let why = output.lines().rev().find(|l| l.starts_with("SKIP:")).unwrap_or("SKIP:");
            Ok(Verdict::Skipped(why.trim_start_matches("SKIP:").trim().to_string()))
        }
        Some(status) => Err(status.to_string()),
    };
    Outcome { name: name.to_string(), result, output, took: started.elapsed() }
}

fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/compliance/nbd")
}

/// A running `fallow nbd` (killed by its PID when dropped).
struct Server {
    daemon: Daemon,
    /// `nbd://127.0.0.1:PORT/`, to which an export name is appended.
    base_uri: String,
}

impl Server {
    /// Starts `fallow nbd ARGS` and learns its address from its `serving` lines.
    fn start(args: &[&str]) -> Server {
        let (daemon, base_uri) = Daemon::start(
            "fallow nbd",
            support::fallow().arg("nbd").args(args).env("FALLOW_LOG", "info").stdin(Stdio::null()),
            "`serving` line",
            START_TIMEOUT,
            serving_base_uri,
        );
        Server { daemon, base_uri }
    }

    /// SIGTERM; the server must exit with status 0 within a few seconds.
    fn stop_cleanly(mut self) {
        let pid = self.daemon.pid();
        assert!(self.daemon.signal("TERM").success(), "kill -TERM {pid}");
        let status = self
            .daemon
            .wait_timeout(Duration::from_secs(15))
            .expect("fallow nbd did not stop on SIGTERM");
        assert!(status.success(), "fallow nbd exited with {status}:\n{}", self.daemon.log_so_far());
    }
}

/// `nbd://ADDR/` from a `fallow nbd: serving nbd://ADDR/NAME` line.
fn serving_base_uri(line: &str) -> Option<String> {
    let uri = line.strip_prefix("fallow nbd: serving ")?.trim();
    let rest = uri.strip_prefix("nbd://")?;
    let (addr, _name) = rest.split_once('/')?;
    Some(format!("nbd://{addr}/"))
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

#[test]
fn the_serving_line_parses() {
    let line = "fallow nbd: serving nbd://127.0.0.1:40207/disk";
    assert_eq!(serving_base_uri(line).as_deref(), Some("nbd://127.0.0.1:40207/"));
    assert_eq!(serving_base_uri("fallow nbd: serving nbd+unix:///disk?socket=/s"), None);
    assert_eq!(serving_base_uri("INFO fallow::cmd::nbd: export ready"), None);
}
