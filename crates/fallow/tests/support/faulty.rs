//! Faulty stores for `fallow nbd`: nbdkit on a Unix socket with its error filter (and
//! others) in front of a file, every request it gets recorded by its log filter; the
//! `fallow nbd` in front of it, with its metrics; and a real NBD client, libnbd's Python
//! binding (`faulty_client.py`) run as a coprocess, whose requests and their outcomes
//! are values the test checks.
//!
//! Page `p` of a test image holds [`stamp`]`(p, g)` at generation `g`, so a read tells
//! which page and which write its data came from.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::time::Duration;

use super::{poll_until, Daemon, KillOnDrop};

/// A page, as the client and the image count them.
pub const PAGE: u64 = 4096;

/// How long a client batch or a process start may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(60);

/// The Python that has libnbd's binding: Debian's, not a pyenv one earlier on PATH.
const PYTHON: &str = "/usr/bin/python3";

/// Whether nbdkit and libnbd's Python binding are installed.
pub fn have_tools() -> bool {
    super::have("nbdkit") && super::command_works(PYTHON, &["-c", "import nbd"])
}

/// The 4 KiB of page `page` at generation `gen`: the two numbers, little-endian u32s, and
/// `b"fallowpg"`, repeated (`stamp` in faulty_client.py is the same function). Never
/// zeros, so that a trimmed page differs from every written one.
pub fn stamp(page: u64, gen: u32) -> Vec<u8> {
    let mut unit = (page as u32).to_le_bytes().to_vec();
    unit.extend_from_slice(&gen.to_le_bytes());
    unit.extend_from_slice(b"fallowpg");
    unit.repeat(PAGE as usize / 16)
}

/// What a page holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    /// `stamp(page, gen)`.
    Stamp(u64, u32),
    /// Zeros (trimmed).
    Zero,
    /// Anything else.
    Other,
}

impl Content {
    fn of(bytes: &[u8]) -> Content {
        if bytes.iter().all(|b| *b == 0) {
            return Content::Zero;
        }
        let number = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap());
        let (page, gen) = (u64::from(number(0)), number(4));
        if bytes == stamp(page, gen) {
            Content::Stamp(page, gen)
        } else {
            Content::Other
        }
    }
}

/// Writes an image of `pages` pages, page `p` holding `stamp(p, 0)`.
pub fn make_image(path: &Path, pages: u64) {
    let bytes: Vec<u8> = (0..pages).flat_map(|p| stamp(p, 0)).collect();
    std::fs::write(path, bytes).unwrap();
}

/// What page `page` of the image file holds now.
pub fn image_page(path: &Path, page: u64) -> Content {
    use std::os::unix::fs::FileExt;
    let mut buf = vec![0u8; PAGE as usize];
    std::fs::File::open(path).unwrap().read_exact_at(&mut buf, page * PAGE).unwrap();
    Content::of(&buf)
}

/// A file whose existence turns an error filter's injection on (`error-*-file=`).
pub struct Switch(pub PathBuf);

impl Switch {
    /// Errors on.
    pub fn on(&self) {
        std::fs::write(&self.0, b"").unwrap();
    }

    /// Errors off.
    pub fn off(&self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// nbdkit, foreground, on a Unix socket, its log filter outermost (so that it records what
/// fallow sent and what came back, injected errors included); stopped by PID when dropped.
pub struct Upstream {
    _nbdkit: KillOnDrop,
    socket: PathBuf,
    log: PathBuf,
}

impl Upstream {
    /// Starts `nbdkit --filter=log --filter=F... PLUGIN ARGS...` in `dir`, with `filters`
    /// innermost last, and waits until it accepts connections.
    pub fn start(dir: &Path, filters: &[&str], plugin_and_args: &[String]) -> Upstream {
        let socket = dir.join("nbdkit.sock");
        let log = dir.join("nbdkit.log");
        let mut cmd = Command::new("nbdkit");
        cmd.args(["-f", "--exit-with-parent", "-U"]).arg(&socket).arg("--filter=log");
        for filter in filters {
            cmd.arg(format!("--filter={filter}"));
        }
        cmd.args(plugin_and_args).arg(format!("logfile={}", log.display()));
        let nbdkit = KillOnDrop::spawn(cmd.stdout(Stdio::null()).stderr(Stdio::null()));
        let up = poll_until(Duration::from_secs(10), || UnixStream::connect(&socket).is_ok());
        assert!(up, "nbdkit did not start: {cmd:?}");
        Upstream { _nbdkit: nbdkit, socket, log }
    }

    /// The export, as `fallow nbd --export NAME=…` takes it.
    pub fn uri(&self) -> String {
        format!("nbd+unix:///?socket={}", self.socket.display())
    }

    /// The requests recorded so far.
    pub fn log(&self) -> StoreLog {
        StoreLog::parse(&std::fs::read_to_string(&self.log).unwrap_or_default())
    }
}

/// What nbdkit's log filter recorded: requests by command (`Read`, `Write`, `Trim`,
/// `Flush`, as the filter names them) and outcome (`ok`, or the errno), and connections.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreLog {
    outcomes: HashMap<(String, String), u64>,
    /// Connections fallow opened.
    pub connections: u64,
}

impl StoreLog {
    fn parse(text: &str) -> StoreLog {
        let mut log = StoreLog::default();
        for line in text.lines() {
            if line.contains(" Connect ") {
                log.connections += 1;
            }
            // "connection=1 ...Read id=4 return=-1 error=EIO", "... return=0".
            let Some((_, rest)) = line.split_once(" ...") else { continue };
            let Some(cmd) = rest.split_whitespace().next() else { continue };
            let outcome = match rest.split_once(" error=") {
                Some((_, errno)) => errno.trim().to_string(),
                None if rest.contains("return=0") => "ok".to_string(),
                None => "failed".to_string(),
            };
            *log.outcomes.entry((cmd.to_string(), outcome)).or_default() += 1;
        }
        log
    }

    /// How many `cmd` requests ended with `outcome` ("ok", "EIO", ...).
    pub fn count(&self, cmd: &str, outcome: &str) -> u64 {
        self.outcomes.get(&(cmd.to_string(), outcome.to_string())).copied().unwrap_or(0)
    }

    /// How many `cmd` requests failed, whatever the errno.
    pub fn failed(&self, cmd: &str) -> u64 {
        self.outcomes.iter().filter(|((c, o), _)| c == cmd && o != "ok").map(|(_, n)| n).sum()
    }

    /// How many `cmd` requests there were.
    pub fn total(&self, cmd: &str) -> u64 {
        self.count(cmd, "ok") + self.failed(cmd)
    }

    /// What was recorded since `earlier`: a `StoreLog` of the differences.
    pub fn since(&self, earlier: &StoreLog) -> StoreLog {
        let mut outcomes = self.outcomes.clone();
        for (key, n) in &earlier.outcomes {
            *outcomes.entry(key.clone()).or_default() -= n;
        }
        StoreLog { outcomes, connections: self.connections - earlier.connections }
    }
}

/// `fallow nbd` with one export, `d`, in front of an upstream, serving on a Unix socket
/// in `dir` with metrics on a port of its own.
pub struct Fallow {
    /// The process (its log, signals).
    pub daemon: Daemon,
    /// The export's URI.
    pub uri: String,
    /// The metrics endpoint, HOST:PORT.
    pub metrics: String,
}

impl Fallow {
    /// Starts it over `upstream`, with `args` besides.
    pub fn start(dir: &Path, upstream: &str, args: &[&str]) -> Fallow {
        let socket = dir.join("fallow.sock");
        let (daemon, uri) = Daemon::start(
            "fallow nbd",
            super::fallow()
                .arg("nbd")
                .args(["--export", &format!("d={upstream}"), "--metrics", "127.0.0.1:0"])
                .arg("--listen")
                .arg(format!("unix:{}", socket.display()))
                .args(args)
                .env("FALLOW_LOG", "info"),
            "URI",
            PATIENCE,
            super::nbd_serving_uri,
        );
        let metrics = daemon.log_lines().iter().find_map(|l| super::metrics_addr(l));
        Fallow { uri, metrics: metrics.expect("no metrics address in the log"), daemon }
    }

    /// The current metrics.
    pub fn metrics(&self) -> Metrics {
        Metrics(super::scrape(&self.metrics))
    }
}

/// One scrape of `/metrics`.
pub struct Metrics(pub String);

impl Metrics {
    /// The export's `name` (with `labels` besides `export="d"`), 0 if absent.
    pub fn export(&self, name: &str, labels: &str) -> f64 {
        let labels = if labels.is_empty() {
            "export=\"d\"".to_string()
        } else {
            format!("export=\"d\",{labels}")
        };
        super::metric(&self.0, name, &labels).unwrap_or(0.0)
    }

    /// The server's `fallow_nbd_requests_total` for `cmd` with `result` (ok, error).
    pub fn requests(&self, cmd: &str, result: &str) -> f64 {
        let labels = format!("cmd=\"{cmd}\",result=\"{result}\"");
        super::metric(&self.0, "fallow_nbd_requests_total", &labels).unwrap_or(0.0)
    }

    /// Bytes acknowledged but not in the store yet.
    pub fn dirty_bytes(&self) -> u64 {
        self.export("fallow_nbd_dirty_bytes", "") as u64
    }

    /// Pages written back so far.
    pub fn written_back(&self) -> u64 {
        self.export("fallow_nbd_written_back_pages_total", "") as u64
    }

    /// Write-back writes the store failed so far.
    pub fn write_back_errors(&self) -> u64 {
        self.export("fallow_nbd_write_back_errors_total", "") as u64
    }

    /// Reads sent to the store so far (those that succeeded).
    pub fn backing_reads(&self) -> u64 {
        self.export("fallow_nbd_backing_reads_total", "") as u64
    }

    /// Pages read from `tier` (dirty, local, pool, backing) so far.
    pub fn pages_read(&self, tier: &str) -> u64 {
        self.export("fallow_nbd_cache_pages_read_total", &format!("tier=\"{tier}\"")) as u64
    }
}

/// One request of the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Read a page.
    Read(u64),
    /// Write a page at a generation.
    Write(u64, u32),
    /// Write bytes `offset..offset + len` of the image at a generation (pieces of pages).
    WriteBytes(u64, u64, u32),
    /// Write a page at a generation, with FUA.
    WriteFua(u64, u32),
    /// Trim a page.
    Trim(u64),
    /// Flush.
    Flush,
}

impl Op {
    fn json(&self) -> serde_json::Value {
        use serde_json::json;
        match *self {
            Op::Read(p) => json!(["r", p]),
            Op::Write(p, g) => json!(["w", p * PAGE, PAGE, g]),
            Op::WriteBytes(offset, len, g) => json!(["w", offset, len, g]),
            Op::WriteFua(p, g) => json!(["wf", p * PAGE, PAGE, g]),
            Op::Trim(p) => json!(["t", p]),
            Op::Flush => json!(["f"]),
        }
    }
}

/// A torn page: 16-byte units of stamps (part of one write, part of another) and zeros.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Torn {
    /// Each stamp's page and generation, and how many units hold it.
    pub stamps: Vec<(u64, u32, u32)>,
    /// Units of zeros.
    pub zeros: u32,
}

/// How one request ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// The errno it failed with ("EIO", ...), if it failed.
    pub error: Option<String>,
    /// A read's data.
    pub data: Option<Content>,
    /// A read of `Other` data made of 16-byte units of stamps and zeros.
    pub torn: Option<Torn>,
    /// When it was submitted and seen complete (concurrent batches only; nanoseconds).
    pub t0: u64,
    /// See `t0`.
    pub t1: u64,
}

impl Outcome {
    fn parse(v: &serde_json::Value) -> Outcome {
        let data = v.get("d").map(|d| match d {
            serde_json::Value::Array(a) => {
                Content::Stamp(a[0].as_u64().unwrap(), a[1].as_u64().unwrap() as u32)
            }
            d if d == "zero" => Content::Zero,
            _ => Content::Other,
        });
        let number = |v: &serde_json::Value| v.as_u64().unwrap();
        let torn = v.get("u").and_then(|u| u.as_array()).map(|units| Torn {
            stamps: units
                .iter()
                .map(|u| (number(&u[0]), number(&u[1]) as u32, number(&u[2]) as u32))
                .collect(),
            zeros: v.get("z").map_or(0, number) as u32,
        });
        Outcome {
            error: v.get("e").and_then(|e| e.as_str()).map(str::to_string),
            data,
            torn,
            t0: v.get("t0").and_then(|t| t.as_u64()).unwrap_or(0),
            t1: v.get("t1").and_then(|t| t.as_u64()).unwrap_or(0),
        }
    }

    /// Whether it succeeded.
    pub fn ok(&self) -> bool {
        self.error.is_none()
    }
}

/// `faulty_client.py` connected to an export: batches of requests in, outcomes out.
pub struct Client {
    process: KillOnDrop,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl Client {
    /// Connects to `uri`.
    pub fn connect(uri: &str) -> Client {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/support/faulty_client.py");
        let mut process = KillOnDrop::spawn(
            Command::new(PYTHON)
                .args([script, uri])
                .env("PYTHONDONTWRITEBYTECODE", "1")
                .stdin(Stdio::piped())
                .stdout(Stdio::piped()),
        );
        let stdin = process.child().stdin.take();
        let stdout = process.child().stdout.take().unwrap();
        let (send, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = send.send(line);
            }
        });
        Client { process, stdin, lines }
    }

    /// Runs `ops` one after another.
    pub fn run(&mut self, ops: &[Op]) -> Vec<Outcome> {
        self.batch(ops, 1)
    }

    /// Runs `ops` with up to `in_flight` of them in flight at once.
    pub fn batch(&mut self, ops: &[Op], in_flight: usize) -> Vec<Outcome> {
        let ops: Vec<serde_json::Value> = ops.iter().map(Op::json).collect();
        let line = serde_json::json!({ "ops": ops, "in_flight": in_flight });
        let stdin = self.stdin.as_mut().unwrap();
        writeln!(stdin, "{line}").unwrap();
        stdin.flush().unwrap();
        let answer = match self.lines.recv_timeout(PATIENCE) {
            Ok(answer) => answer,
            Err(err) => {
                let status = self.process.try_wait();
                panic!("the NBD client gave no answer ({err}; exit status {status:?})")
            }
        };
        let outcomes: Vec<serde_json::Value> = serde_json::from_str(&answer).unwrap();
        assert_eq!(outcomes.len(), ops.len());
        outcomes.iter().map(Outcome::parse).collect()
    }

    /// Disconnects (NBD_CMD_DISC) and waits for the client to exit.
    pub fn close(mut self) {
        drop(self.stdin.take());
        let status = self.process.wait_timeout(PATIENCE);
        assert!(status.is_some_and(|s| s.success()), "the NBD client ended with {status:?}");
    }
}
