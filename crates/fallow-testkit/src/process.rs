//! Child processes for tests and benchmarks: killed by their PID (or their process group)
//! when dropped, so that a failed assertion never leaves one running; a long-running
//! process whose stderr is read on a thread and searched, with a bounded wait, for the line
//! that names its address; scratch directories removed when dropped; "is this tool
//! installed" checks, free ports, bounded polling and a process's CPU time.

use std::io::{BufRead, BufReader};
use std::net::{TcpListener, TcpStream};
use std::ops::{Deref, DerefMut};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long the bounded waits here sleep between two looks.
const POLL: Duration = Duration::from_millis(20);

/// Makes `cmd` start its program with `socket` as file descriptor 3 and `LISTEN_FDS=1`,
/// `LISTEN_PID` its own PID: systemd's socket activation, as a test emulates it to keep
/// one listening socket open across restarts of a server. The program is run through
/// `sh -c 'LISTEN_PID=$$ … exec PROGRAM ARGS…'` because the PID is known only in the
/// child; give the program and its arguments with [`Command::arg`] after this call.
pub fn socket_activated(program: &Path, socket: &impl std::os::fd::AsRawFd) -> Command {
    let fd = socket.as_raw_fd();
    let mut cmd = Command::new("sh");
    cmd.args(["-c", "LISTEN_PID=$$ LISTEN_FDS=1 exec \"$0\" \"$@\""]).arg(program);
    // SAFETY: between fork and exec only async-signal-safe calls are made: dup2 and fcntl
    // on descriptors this process owns, and errno is read through std.
    unsafe {
        cmd.pre_exec(move || {
            if fd == 3 {
                // dup2 onto itself would leave close-on-exec set.
                if libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            } else if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// Whether `tool` is installed: `command -v TOOL` finds it.
pub fn have(tool: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {tool}"))
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Whether `program ARGS` runs and exits with status 0 (its output is discarded).
pub fn command_works(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A TCP port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Calls `done` until it returns true (then true) or `timeout` has passed (then false),
/// sleeping a little between calls. `done` may itself assert, to fail early.
pub fn poll_until(timeout: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(POLL);
    }
}

/// The CPU time (user + system, all threads) process `pid` has used so far, from
/// `/proc/PID/stat`; zero once the process is gone.
pub fn cpu_time(pid: u32) -> Duration {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return Duration::ZERO;
    };
    // The command name (field 2) may hold spaces and parentheses; the fields after its
    // last ')' are plain. utime and stime (fields 14 and 15) are the 12th and 13th of those.
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let ticks: u64 =
        after_name.split_whitespace().skip(11).take(2).map(|t| t.parse::<u64>().unwrap()).sum();
    let per_second = rustix::param::clock_ticks_per_second().max(1);
    Duration::from_nanos(ticks * 1_000_000_000 / per_second)
}

/// Whether something accepts TCP connections on `127.0.0.1:PORT` within `timeout`.
pub fn port_opens(port: u16, timeout: Duration) -> bool {
    poll_until(timeout, || TcpStream::connect(("127.0.0.1", port)).is_ok())
}

/// A child process, killed (by its PID) and reaped when dropped, so that a failed
/// assertion never leaves it running.
pub struct KillOnDrop(Child);

impl KillOnDrop {
    /// Takes charge of `child`.
    pub fn new(child: Child) -> KillOnDrop {
        KillOnDrop(child)
    }

    /// Spawns `cmd` (panics if it cannot be started).
    pub fn spawn(cmd: &mut Command) -> KillOnDrop {
        KillOnDrop(cmd.spawn().unwrap())
    }

    /// The process ID.
    pub fn pid(&self) -> u32 {
        self.0.id()
    }

    /// The child itself, for its pipes.
    pub fn child(&mut self) -> &mut Child {
        &mut self.0
    }

    /// The exit status if it has exited, without waiting.
    pub fn try_wait(&mut self) -> Option<ExitStatus> {
        self.0.try_wait().unwrap()
    }

    /// Whether it has not exited yet.
    pub fn is_running(&mut self) -> bool {
        self.try_wait().is_none()
    }

    /// Sends `kill -SIGNAL PID` (`signal` as `kill` names it: `"TERM"`, `"KILL"`) and
    /// returns the status of `kill`.
    pub fn signal(&self, signal: &str) -> ExitStatus {
        let pid = self.pid().to_string();
        Command::new("kill").args([&format!("-{signal}"), &pid]).status().unwrap()
    }

    /// Waits for it to exit, without a bound.
    pub fn wait(&mut self) -> ExitStatus {
        self.0.wait().unwrap()
    }

    /// Its exit status, or `None` if `deadline` passed first (it is then left running).
    pub fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        let mut status = None;
        poll_until(deadline.saturating_duration_since(Instant::now()), || {
            status = self.try_wait();
            status.is_some()
        });
        status
    }

    /// Its exit status, or `None` if it is still running after `timeout`.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Option<ExitStatus> {
        self.wait_until(Instant::now() + timeout)
    }

    /// Kills it (SIGKILL) and reaps it now rather than when dropped.
    pub fn kill(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A child process and everything it starts, in a process group of their own. Dropping
/// it (a timeout, a panic) signals the whole group: SIGTERM first, so that a script's EXIT
/// trap can undo what it set up, then, after a grace period, SIGKILL.
pub struct ProcessGroup(Child);

impl ProcessGroup {
    /// How long the group has between SIGTERM and SIGKILL.
    pub const GRACE: Duration = Duration::from_secs(10);

    /// Spawns `cmd` as the leader of a new process group (panics if it cannot be started).
    pub fn spawn(cmd: &mut Command) -> ProcessGroup {
        ProcessGroup(cmd.process_group(0).spawn().unwrap())
    }

    /// The exit status of the leader, or `None` if `deadline` passed first (the group is
    /// then stopped).
    pub fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                return Some(status);
            }
            if Instant::now() >= deadline {
                self.stop();
                return None;
            }
            std::thread::sleep(POLL);
        }
    }

    /// SIGTERM to the group, up to [`Self::GRACE`] for the leader to exit, SIGKILL to the
    /// group, and the leader reaped.
    pub fn stop(&mut self) {
        let group = format!("-{}", self.0.id());
        let _ = Command::new("kill").args(["-TERM", "--", &group]).status();
        let grace = Instant::now() + Self::GRACE;
        while Instant::now() < grace && matches!(self.0.try_wait(), Ok(None)) {
            std::thread::sleep(POLL);
        }
        let _ = Command::new("kill").args(["-KILL", "--", &group]).stderr(Stdio::null()).status();
        let _ = self.0.wait();
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            self.stop();
        }
    }
}

/// A long-running child (a node, a server) whose stderr a thread reads for the child's
/// whole life, so that it never blocks on a full pipe, and keeps line by line. Killed by
/// its PID when dropped; it is a [`KillOnDrop`] for everything else.
pub struct Daemon {
    process: KillOnDrop,
    /// What the messages call it, e.g. `fallow nbd`.
    name: String,
    /// Every stderr line so far.
    log: Arc<Mutex<Vec<String>>>,
    /// The stderr lines that [`Daemon::wait_for_line`] has not looked at yet.
    unread: Receiver<String>,
}

impl Daemon {
    /// Spawns `cmd` with stdout discarded and stderr read as described on [`Daemon`];
    /// `name` names it in failure messages.
    pub fn spawn(name: &str, cmd: &mut Command) -> Daemon {
        let mut process = KillOnDrop::spawn(cmd.stdout(Stdio::null()).stderr(Stdio::piped()));
        let stderr = process.child().stderr.take().unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (send, unread) = mpsc::channel();
        let keep = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                keep.lock().unwrap().push(line.clone());
                let _ = send.send(line);
            }
        });
        Daemon { process, name: name.to_string(), log, unread }
    }

    /// [`Daemon::spawn`], then [`Daemon::wait_for_line`]: the running child, and what
    /// `find` found in its stderr (its address, its URI).
    pub fn start<T>(
        name: &str,
        cmd: &mut Command,
        what: &str,
        timeout: Duration,
        find: impl FnMut(&str) -> Option<T>,
    ) -> (Daemon, T) {
        let mut daemon = Daemon::spawn(name, cmd);
        let found = daemon.wait_for_line(what, timeout, find);
        (daemon, found)
    }

    /// Reads stderr lines until `find` returns something for one of them, and returns
    /// that. Panics, with the stderr so far, if `timeout` passes first or the child closes
    /// its stderr (exits) first; `what` names what was awaited, in that message.
    pub fn wait_for_line<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut find: impl FnMut(&str) -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            let line = self.next_line(what, timeout, deadline);
            if let Some(found) = find(&line) {
                return found;
            }
        }
    }

    /// Like [`Daemon::wait_for_line`], but also looks at the lines an earlier wait read
    /// past: for a line that may come before the one an earlier wait awaited, such as a
    /// client connecting to a socket that was listening before the daemon said so. Every
    /// line so far counts as read once it returns.
    pub fn wait_for_logged<T>(
        &mut self,
        what: &str,
        timeout: Duration,
        mut find: impl FnMut(&str) -> Option<T>,
    ) -> T {
        let deadline = Instant::now() + timeout;
        loop {
            // Every line is in the log before it is sent, so the log holds every line
            // received so far and the unread ones can be dropped once it is searched.
            while self.unread.try_recv().is_ok() {}
            if let Some(found) = self.log.lock().unwrap().iter().find_map(|l| find(l)) {
                return found;
            }
            self.next_line(what, timeout, deadline);
        }
    }

    /// The next stderr line not read yet; panics as [`Daemon::wait_for_line`] describes.
    fn next_line(&mut self, what: &str, timeout: Duration, deadline: Instant) -> String {
        match self.unread.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => panic!(
                "{}: no {what} within {timeout:?}; its stderr so far:\n{}",
                self.name,
                self.log_so_far()
            ),
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.process.wait_until(deadline);
                panic!(
                    "{} exited ({}) before its {what}; its stderr:\n{}",
                    self.name,
                    status.map_or("still running, stderr closed".to_string(), |s| s.to_string()),
                    self.log_so_far()
                )
            }
        }
    }

    /// Every stderr line so far.
    pub fn log_lines(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }

    /// Every stderr line so far, one string.
    pub fn log_so_far(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }
}

impl Deref for Daemon {
    type Target = KillOnDrop;

    fn deref(&self) -> &KillOnDrop {
        &self.process
    }
}

impl DerefMut for Daemon {
    fn deref_mut(&mut self) -> &mut KillOnDrop {
        &mut self.process
    }
}

/// A scratch directory, `$TMPDIR/fallow-NAME-PID`, removed (with what is in it) when
/// dropped.
pub struct TempDir(PathBuf);

impl TempDir {
    /// Removes what an earlier run may have left at the path, and creates the directory.
    pub fn new(name: &str) -> TempDir {
        let dir = TempDir::uncreated(name);
        std::fs::create_dir_all(&dir.0).unwrap();
        dir
    }

    /// Removes what an earlier run may have left at the path, but leaves creating the
    /// directory to the program under test.
    pub fn uncreated(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("fallow-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        TempDir(dir)
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn echoes(lines: &str) -> Daemon {
        // `exec`, so that the PID killed on drop is the sleep's.
        let script = format!("for l in {lines}; do echo $l >&2; done; exec sleep 30");
        Daemon::spawn("sh", Command::new("sh").args(["-c", &script]))
    }

    #[test]
    fn a_line_an_earlier_wait_read_past_is_found_by_wait_for_logged_only() {
        let mut daemon = echoes("connected serving");
        daemon
            .wait_for_line("serving", Duration::from_secs(10), |l| (l == "serving").then_some(()));
        daemon.wait_for_logged("connected", Duration::from_secs(10), |l| {
            (l == "connected").then_some(())
        });
        let missed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            daemon.wait_for_line("connected", Duration::from_millis(200), |l| {
                (l == "connected").then_some(())
            })
        }));
        assert!(missed.is_err(), "wait_for_line looks only at lines not read yet");
    }

    #[test]
    fn wait_for_logged_waits_for_a_line_still_to_come() {
        let mut daemon = Daemon::spawn(
            "sh",
            Command::new("sh").args(["-c", "sleep 0.3; echo late >&2; exec sleep 30"]),
        );
        let began = Instant::now();
        daemon.wait_for_logged("late", Duration::from_secs(10), |l| (l == "late").then_some(()));
        assert!(began.elapsed() >= Duration::from_millis(250));
    }
}
