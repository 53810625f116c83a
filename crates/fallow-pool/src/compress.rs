//! The background compressor: a thread that periodically runs the engine's background
//! pass, which compresses pages that stayed cold (not read since its previous look), so
//! compression never runs on a put or a get. A pass that stopped at its limit (more pages
//! to look at, or to compress, than one pass takes) is followed by the next one sooner
//! ([`CATCH_UP`] of the period), so a pool that received a disk image's worth of pages at
//! once gets through them in minutes rather than hours, each pass still holding the locks
//! for one batch only; and moves a step of every hash table's
//! growth under way (`Engine::finish_growth`), which inserts alone might never finish.
//! The thread knows nothing of the engine: the engine hands it the pass to run.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// How much sooner the next pass runs after one that stopped at its limit: a tenth of the
/// period. At the default period (100 ms) and batch (32 pages, looking at 128), up to
/// 3,200 pages compressed a second instead of 320, for a few percent of a core.
const CATCH_UP: u32 = 10;

/// A running compressor thread; dropping it stops and joins the thread.
pub struct Compressor {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Compressor {
    /// Starts a thread that runs `pass` every `every`, or sooner after a pass that returns
    /// true (it stopped at its limit: more may be waiting).
    pub(crate) fn start(every: Duration, pass: impl Fn() -> bool + Send + 'static) -> Self {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("fallow-compress".into())
            .spawn(move || {
                let (lock, cvar) = &*flag;
                let mut stopped = lock.lock();
                let mut wait = every;
                while !*stopped {
                    cvar.wait_for(&mut stopped, wait);
                    if *stopped {
                        break;
                    }
                    // The engine's locks are taken without holding `stopped`'s mutex: a
                    // pass of `batch` pages holds every shard and the store for ~batch × 5 µs.
                    drop(stopped);
                    let more = pass();
                    wait = match more {
                        true => (every / CATCH_UP).max(Duration::from_millis(1)),
                        false => every,
                    };
                    stopped = lock.lock();
                }
            })
            .ok();
        if thread.is_none() {
            tracing::warn!("could not start the compressor thread; compression stays off");
        }
        Self { stop, thread }
    }
}

impl Drop for Compressor {
    fn drop(&mut self) {
        *self.stop.0.lock() = true;
        self.stop.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// Passes a compressor runs in `run` when each pass says `more`.
    fn passes_in(run: Duration, more: bool) -> usize {
        let passes = Arc::new(AtomicUsize::new(0));
        let counted = passes.clone();
        let compressor = Compressor::start(Duration::from_millis(200), move || {
            counted.fetch_add(1, Ordering::Relaxed);
            more
        });
        std::thread::sleep(run);
        drop(compressor);
        passes.load(Ordering::Relaxed)
    }

    #[test]
    fn passes_that_stop_at_their_limit_come_sooner() {
        // Idle: one pass per 200 ms period, two in 500 ms (three on a late wake-up).
        let idle = passes_in(Duration::from_millis(500), false);
        assert!((1..=3).contains(&idle), "{idle} idle passes");
        // Busy: the first after 200 ms, then one every 20 ms, about 15 in 500 ms.
        let busy = passes_in(Duration::from_millis(500), true);
        assert!(busy >= 5, "{busy} busy passes");
    }
}
