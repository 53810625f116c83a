//! What `fallow node`, `fallow nbd` and `fallow up` share about how they serve: polling the
//! connections' sockets (`--poll-us`), the CPUs of the runtime's workers (`--cpus`), and
//! the runtime those make. `fallow vhost` has flags of the same names and wording for its
//! queue threads.

use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use fallow_net::cpus::CpuList;
use fallow_net::ReadPolling;

/// `--poll-us` and `--cpus`.
#[derive(Debug, Clone, Args)]
pub struct PollingArgs {
    /// How long a connection keeps looking at its socket for the next request, in
    /// microseconds, before it sleeps until the kernel wakes it. Polling saves each request
    /// its wake-up (tens of microseconds), and burns up to a core per busy connection while
    /// it spins: it spins only while requests keep coming, and sleeps once the connection
    /// has been idle this long. A spinning connection holds its worker thread (see
    /// --cpus). At most 1000000 [default: 0, never spins].
    #[arg(long, value_name = "US")]
    pub poll_us: Option<u64>,
    /// Pin the runtime's worker threads to these CPUs, one worker to each ("2,3" or "2-3")
    /// [default: a worker per CPU, not pinned]. Best with --poll-us, on cores nothing else
    /// runs on.
    #[arg(long, value_name = "CPUS")]
    pub cpus: Option<CpuList>,
}

impl PollingArgs {
    /// The polling the flags ask for (off without `--poll-us`).
    pub fn read_polling(&self) -> anyhow::Result<ReadPolling> {
        read_polling(self.poll_us.unwrap_or(0))
    }
}

/// `--poll-us US` as a [`ReadPolling`]; more than [`fallow_net::busy_poll::MAX_WINDOW`] is
/// refused.
pub fn read_polling(micros: u64) -> anyhow::Result<ReadPolling> {
    let window = Duration::from_micros(micros);
    if window > fallow_net::busy_poll::MAX_WINDOW {
        bail!("--poll-us {micros}: at most 1000000 (a second of spinning per request)");
    }
    Ok(ReadPolling::for_window(window))
}

/// The most blocking threads a server keeps (slow node requests, file store I/O); more
/// blocking work waits for one. Tokio's default, 512, is reached by a busy server: a
/// blocking call that returns wakes its caller before its thread is idle again, so on
/// busy CPUs a caller that at once starts the next (a write-back keeps 16 writes in flight)
/// finds no idle thread and starts another; and a thread handed work at least every 10 s
/// never retires. `fallow nbd` under two fio jobs of queue depth 8 grew to 100–240
/// threads and kept them (BENCHMARKS.md, "Blocking threads"); capped, the same load runs
/// as fast. 64 is four times the write-back's 16 writes in flight, with room for the
/// reads of many clients' misses.
pub const MAX_BLOCKING_THREADS: usize = 64;

/// The multi-threaded runtime a server runs on, its threads named `name`: a worker per CPU
/// by default, or with `cpus`, one worker pinned to each CPU of the list, and at most
/// [`MAX_BLOCKING_THREADS`] blocking threads, left to the scheduler.
pub fn server_runtime(
    name: &str,
    cpus: Option<&CpuList>,
) -> anyhow::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.thread_name(name).max_blocking_threads(MAX_BLOCKING_THREADS).enable_all();
    if let Some(cpus) = cpus {
        builder.worker_threads(cpus.cpus().len().max(1));
        let (cpus, next) = (cpus.clone(), Arc::new(AtomicUsize::new(0)));
        // Only workers park (blocking threads never call this), and every worker parks
        // as soon as it has nothing to do, so each takes the next CPU when it first parks.
        builder.on_thread_park(move || pin_worker_once(&cpus, &next));
    }
    builder.build().context("starting the async runtime")
}

thread_local! {
    /// Whether this worker thread has taken its CPU.
    static PINNED: Cell<bool> = const { Cell::new(false) };
}

/// Pins the calling worker to the next CPU of `cpus`, the first time it is called on it.
fn pin_worker_once(cpus: &CpuList, next: &AtomicUsize) {
    if PINNED.with(|p| p.replace(true)) {
        return;
    }
    let worker = next.fetch_add(1, Ordering::Relaxed);
    if let Some(cpu) = cpus.for_thread(worker) {
        match CpuList::pin_current_thread(cpu) {
            Ok(()) => tracing::info!(worker, cpu, "worker thread pinned"),
            Err(err) => tracing::warn!(worker, cpu, %err, "could not pin the worker thread"),
        }
    }
}
