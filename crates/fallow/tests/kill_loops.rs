//! Kill loops (docs/reliability.md, "Kill loops"): a server is SIGKILLed at a random
//! moment under load, started again on the same address over the same store, and checked,
//! over and over, every iteration counted.
//!
//! * `fallow nbd` over a file, write-back and write-through, and `fallow nbd` with a
//!   `pool:` export on a node that stays up: a libnbd client (support::faulty's coprocess)
//!   writes generation-stamped pages, trims, flushes and reads, 16 requests in flight.
//!   After each restart every page holds a generation the history allows: one written to
//!   it (or what it held before), and none older than a write that was durable (FLUSHed,
//!   FUA, or acknowledged in write-through) — so no durable write is lost and no page
//!   holds data never written. Reads under load are checked the same way against the
//!   writes acknowledged before they began.
//! * `fallow node --state-dir` holding persistent pages: four clients with one client id
//!   put, overwrite, take and invalidate pages; after each restart the node has its id
//!   and pool ids, and every key holds its last acknowledged value (a request cut short
//!   by the kill may have happened or not; an invalidated or taken key never comes back).
//!   Some restarts are killed again while they recover.
//! * Two nodes with `--state-dir` holding a cluster client's persistent pool (two copies
//!   of every page): the killed node's pages are read from its peer while it is down, and
//!   again once it is back (restarted after the client has retired it). The ignored
//!   `a_quickly_restarted_node_costs_no_persistent_page` restarts it sooner, and shows the
//!   client losing every persistent page.
//!
//! `FALLOW_KILL_ITERATIONS` (default 10) sets the kills per loop, `FALLOW_KILL_SEED` the
//! random seed (printed with the counts, and in every failure). `scripts/kill-loops.sh`
//! runs the full count.

mod support;

// The loops, one file each (a test crate's root looks for modules beside it, where
// `cluster.rs` is another test).
#[path = "kill_loops/cluster.rs"]
mod cluster;
#[path = "kill_loops/nbd.rs"]
mod nbd;
#[path = "kill_loops/node.rs"]
mod node;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use bytes::Bytes;
use fallow_client::{BlockingClient, ClientConfig};
use fallow_core::{PageKey, PoolId, PoolSpec, PutOutcome, PAGE_SIZE};
use support::faulty::{self, Content, Op, Outcome, PAGE};
use support::{Daemon, Rng, TempDir};

/// How long a load may run on after its kill before the test gives up on it.
const LOAD_LIMIT: Duration = Duration::from_secs(30);
/// How long a start may take.
const START: Duration = Duration::from_secs(30);

/// Kills per loop: `FALLOW_KILL_ITERATIONS`, else 10.
fn iterations() -> u32 {
    std::env::var("FALLOW_KILL_ITERATIONS").map_or(10, |v| v.parse().expect("a number"))
}

/// `FALLOW_KILL_SEED`, else one from the clock; printed so that a run can be repeated
/// (as far as the kills' timing allows).
fn seed() -> u64 {
    std::env::var("FALLOW_KILL_SEED").map_or_else(
        |_| std::time::SystemTime::UNIX_EPOCH.elapsed().unwrap().as_nanos() as u64 | 1,
        |v| v.parse().expect("a number"),
    )
}

/// A SIGKILL sent to a process from a thread of its own, at a moment set in advance.
/// Dropped before it is joined (a failed assertion), it is called off and waited for, so
/// that it never signals a PID that the process's owner, dropped after it, has reaped.
struct Killer<T> {
    thread: Option<JoinHandle<Option<T>>>,
    cancel: Arc<AtomicBool>,
}

impl<T: Send + 'static> Killer<T> {
    /// Sends SIGKILL to process `pid` after `delay`, setting `killed` first; `before` runs
    /// just before the kill (a metrics scrape), and [`Killer::join`] returns what it did.
    fn after(
        pid: u32,
        delay: Duration,
        killed: Arc<AtomicBool>,
        before: impl FnOnce() -> T + Send + 'static,
    ) -> Killer<T> {
        let cancel = Arc::new(AtomicBool::new(false));
        let called_off = cancel.clone();
        let thread = std::thread::spawn(move || {
            let at = Instant::now() + delay;
            while Instant::now() < at {
                if called_off.load(Ordering::SeqCst) {
                    return None;
                }
                std::thread::sleep(Duration::from_millis(5).min(at - Instant::now()));
            }
            let seen = before();
            killed.store(true, Ordering::SeqCst);
            // By PID, like KillOnDrop::signal; the owner reaps it.
            let status = Command::new("kill").args(["-KILL", &pid.to_string()]).status().unwrap();
            assert!(status.success(), "kill -KILL {pid} failed");
            Some(seen)
        });
        Killer { thread: Some(thread), cancel }
    }

    /// Waits for the kill; what `before` returned.
    fn join(mut self) -> T {
        let thread = self.thread.take().expect("joined once");
        thread.join().unwrap().expect("not called off")
    }
}

impl<T> Drop for Killer<T> {
    fn drop(&mut self) {
        if let Some(thread) = self.thread.take() {
            self.cancel.store(true, Ordering::SeqCst);
            let _ = thread.join();
        }
    }
}

/// A scratch directory in memory (/dev/shm, where a node's `--state-dir` belongs), else in
/// the temporary directory; removed with what is in it when dropped.
struct ShmDir(PathBuf);

impl ShmDir {
    fn new(name: &str) -> ShmDir {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
        let dir = base.join(format!("fallow-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        ShmDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for ShmDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
