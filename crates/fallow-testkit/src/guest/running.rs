//! A running guest: QEMU started with the image, the spec's disks and a run's own
//! initramfs archive (the script), its serial console read line by line on a thread, and
//! every wait bounded by the guest's deadline. Dropping a [`Guest`] kills QEMU by its PID.

use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::machine::accel;
use super::{Accel, Cpio, GuestError, GuestSpec, MinimalImage};

/// How long a guest that reported its exit has to power off before QEMU is killed.
const POWER_OFF_LIMIT: Duration = Duration::from_secs(15);

/// How many console lines an error message quotes.
const CONSOLE_TAIL: usize = 80;

/// A guest that is running (or has just stopped).
pub struct Guest {
    qemu: Child,
    /// Console lines not looked at yet.
    unread: Receiver<String>,
    /// Every console line and every line QEMU wrote to its stderr (prefixed `qemu: `).
    log: Arc<Mutex<Vec<String>>>,
    started: Instant,
    deadline: Instant,
    limit: Duration,
    accel: Accel,
    /// The run's initramfs, removed when the guest is dropped.
    run_dir: PathBuf,
    /// The status the guest reported, once it has.
    exit_code: Option<i32>,
}

/// What a finished guest reported.
#[derive(Debug, Clone)]
pub struct GuestOutput {
    /// The script's exit status, as the guest reported it (`FALLOW-EXIT`).
    pub exit_code: i32,
    /// Every console line, and QEMU's own messages prefixed `qemu: `.
    pub console: Vec<String>,
    /// From QEMU's start to the guest's exit report.
    pub elapsed: Duration,
    /// The accelerator the guest ran on.
    pub accel: Accel,
}

impl GuestOutput {
    /// The `FALLOW-RESULT KEY VALUE` lines, in order, as `(KEY, VALUE)`.
    pub fn results(&self) -> Vec<(String, String)> {
        self.marked("FALLOW-RESULT")
            .filter_map(|rest| {
                let (key, value) = rest.split_once(' ').unwrap_or((rest, ""));
                (!key.is_empty()).then(|| (key.to_string(), value.trim().to_string()))
            })
            .collect()
    }

    /// The value of the last `FALLOW-RESULT KEY …` line for `key`.
    pub fn result(&self, key: &str) -> Option<String> {
        self.results().into_iter().rev().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// What follows `MARKER ` on each console line that carries it.
    pub fn marked<'a>(&'a self, marker: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.console.iter().filter_map(move |line| after_marker(line, marker))
    }

    /// The console, one string.
    pub fn console_text(&self) -> String {
        self.console.join("\n")
    }
}

/// What follows `MARKER ` in `line` (a marker may follow garbage the firmware left on
/// the same line), or `None`.
fn after_marker<'a>(line: &'a str, marker: &str) -> Option<&'a str> {
    let at = line.find(marker)?;
    let rest = &line[at + marker.len()..];
    if rest.is_empty() {
        return Some(rest);
    }
    rest.strip_prefix(' ').map(str::trim_end)
}

impl Guest {
    /// Boots `spec` on `image` with the accelerator this host supports ([`accel`]).
    pub fn boot(image: &MinimalImage, spec: &GuestSpec) -> Result<Guest, GuestError> {
        Guest::boot_with(image, spec, accel(image))
    }

    /// Boots `spec` on `image` with `accel`.
    pub(super) fn boot_with(
        image: &MinimalImage,
        spec: &GuestSpec,
        accel: Accel,
    ) -> Result<Guest, GuestError> {
        let run_dir = new_run_dir()?;
        let initramfs = run_dir.join("initramfs.cpio");
        let mut bytes = std::fs::read(image.initramfs())
            .map_err(|e| GuestError::Start(format!("reading the initramfs: {e}")))?;
        let mut run = Cpio::new();
        run.file("fallow/script", 0o755, spec.script.as_bytes().to_vec());
        bytes.extend(run.to_bytes()?);
        std::fs::write(&initramfs, bytes)
            .map_err(|e| GuestError::Start(format!("writing {}: {e}", initramfs.display())))?;

        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args(spec.qemu_args(accel))
            .arg("-kernel")
            .arg(image.kernel())
            .arg("-initrd")
            .arg(&initramfs)
            .arg("-append")
            .arg(spec.kernel_args())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // QEMU dies with the process that started it, even one killed with SIGKILL (whose
        // `Drop` never runs): a guest is never left running.
        // SAFETY: the closure runs in the child between fork and exec and only makes one
        // system call (prctl), which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                rustix::process::set_parent_process_death_signal(Some(
                    rustix::process::Signal::KILL,
                ))
                .map_err(std::io::Error::from)
            });
        }
        let mut qemu = cmd.spawn().map_err(|e| {
            let _ = std::fs::remove_dir_all(&run_dir);
            GuestError::Start(format!("qemu-system-x86_64 (Debian qemu-system-x86): {e}"))
        })?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let (send, unread) = mpsc::channel();
        if let Some(stdout) = qemu.stdout.take() {
            let log = log.clone();
            std::thread::spawn(move || {
                read_lines(stdout, |line| {
                    log.lock().unwrap_or_else(|e| e.into_inner()).push(line.clone());
                    let _ = send.send(line);
                })
            });
        }
        if let Some(stderr) = qemu.stderr.take() {
            let log = log.clone();
            std::thread::spawn(move || {
                read_lines(stderr, |line| {
                    log.lock().unwrap_or_else(|e| e.into_inner()).push(format!("qemu: {line}"));
                })
            });
        }
        let started = Instant::now();
        Ok(Guest {
            qemu,
            unread,
            log,
            started,
            deadline: started + spec.time_limit,
            limit: spec.time_limit,
            accel,
            run_dir,
            exit_code: None,
        })
    }

    /// The accelerator it runs on.
    pub fn accel(&self) -> Accel {
        self.accel
    }

    /// QEMU's process ID.
    pub fn pid(&self) -> u32 {
        self.qemu.id()
    }

    /// Reads console lines until one satisfies `find` and returns it. `what` names the
    /// awaited line in the error if the guest's deadline passes first (the guest is then
    /// killed), or if the guest exits or reports its exit first.
    pub fn wait_for(
        &mut self,
        what: &str,
        mut find: impl FnMut(&str) -> bool,
    ) -> Result<String, GuestError> {
        loop {
            let line = self.next_line(what)?;
            if find(&line) {
                return Ok(line);
            }
            if let Some(code) = after_marker(&line, "FALLOW-EXIT") {
                self.exit_code = code.trim().parse().ok();
                return Err(GuestError::Died {
                    what: what.to_string(),
                    status: format!("still running; the guest's script exited with {code}"),
                    console: self.console_tail(),
                });
            }
        }
    }

    /// Waits for the guest to report its script's exit status and power off, and returns
    /// what it reported. The exit status is the caller's to judge.
    pub fn finish(mut self) -> Result<GuestOutput, GuestError> {
        const WHAT: &str = "report its exit status";
        while self.exit_code.is_none() {
            let line = self.next_line(WHAT)?;
            if let Some(code) = after_marker(&line, "FALLOW-EXIT") {
                self.exit_code = Some(code.trim().parse().unwrap_or(-1));
            }
        }
        let elapsed = self.started.elapsed();
        let off_by = Instant::now() + POWER_OFF_LIMIT;
        while Instant::now() < off_by {
            if matches!(self.qemu.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.kill(); // a no-op if it powered off
        Ok(GuestOutput {
            exit_code: self.exit_code.unwrap_or(-1),
            console: self.log.lock().unwrap_or_else(|e| e.into_inner()).clone(),
            elapsed,
            accel: self.accel,
        })
    }

    /// Kills QEMU (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        let _ = self.qemu.kill();
        let _ = self.qemu.wait();
    }

    /// The next console line, within the deadline.
    fn next_line(&mut self, what: &str) -> Result<String, GuestError> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        match self.unread.recv_timeout(left) {
            Ok(line) => Ok(line),
            Err(RecvTimeoutError::Timeout) => {
                self.kill();
                Err(GuestError::TimedOut {
                    what: what.to_string(),
                    limit: self.limit,
                    console: self.console_tail(),
                })
            }
            Err(RecvTimeoutError::Disconnected) => {
                // The console closed: QEMU is exiting. Give its stderr a moment to arrive.
                let status = match self.qemu.wait() {
                    Ok(status) => status.to_string(),
                    Err(e) => e.to_string(),
                };
                std::thread::sleep(Duration::from_millis(100));
                Err(GuestError::Died {
                    what: what.to_string(),
                    status,
                    console: self.console_tail(),
                })
            }
        }
    }

    /// The last lines of the console and of QEMU's messages.
    fn console_tail(&self) -> String {
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        log[log.len().saturating_sub(CONSOLE_TAIL)..].join("\n")
    }
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.run_dir);
    }
}

/// A new, empty directory for one run's files.
fn new_run_dir() -> Result<PathBuf, GuestError> {
    static RUNS: AtomicU64 = AtomicU64::new(0);
    let run = RUNS.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("fallow-guest-{}-{run}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)
        .map_err(|e| GuestError::Start(format!("creating {}: {e}", dir.display())))?;
    Ok(dir)
}

/// Calls `each` with every line of `from` (carriage returns removed, bytes that are not
/// UTF-8 replaced), until it closes.
fn read_lines(from: impl Read, mut each: impl FnMut(String)) {
    let mut reader = BufReader::new(from);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let line = String::from_utf8_lossy(&buf);
                each(line.trim_end_matches(['\n', '\r']).replace('\r', ""));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn markers_are_found_after_firmware_garbage_and_results_parse() {
        assert_eq!(after_marker("\u{1b}[2JFALLOW-EXIT 0", "FALLOW-EXIT"), Some("0"));
        assert_eq!(after_marker("FALLOW-EXITED 0", "FALLOW-EXIT"), None);
        assert_eq!(after_marker("nothing here", "FALLOW-EXIT"), None);
        let out = GuestOutput {
            exit_code: 0,
            console: vec![
                "FALLOW-RESULT seconds 1.5".into(),
                "[  1.0] kernel noise".into(),
                "FALLOW-RESULT name two words".into(),
                "FALLOW-RESULT seconds 2.5".into(),
            ],
            elapsed: Duration::ZERO,
            accel: Accel::Tcg,
        };
        assert_eq!(out.result("seconds").as_deref(), Some("2.5"));
        assert_eq!(out.result("name").as_deref(), Some("two words"));
        assert_eq!(out.result("missing"), None);
        assert_eq!(out.results().len(), 3);
    }
}
