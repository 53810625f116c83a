//! The background compressor: a thread that periodically runs the engine's background
//! pass, which compresses pages that stayed cold (not read since its previous look), so
//! compression never runs on a put or a get, and moves a step of every hash table's
//! growth under way (`Engine::finish_growth`), which inserts alone might never finish.
//! The thread knows nothing of the engine: the engine hands it the pass to run.

use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

/// A running compressor thread; dropping it stops and joins the thread.
pub struct Compressor {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Compressor {
    /// Starts a thread that runs `pass` every `every`; `pass` returns how many pages it
    /// compressed.
    pub(crate) fn start(every: Duration, pass: impl Fn() -> usize + Send + 'static) -> Self {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("fallow-compress".into())
            .spawn(move || {
                let (lock, cvar) = &*flag;
                let mut stopped = lock.lock();
                while !*stopped {
                    cvar.wait_for(&mut stopped, every);
                    if *stopped {
                        break;
                    }
                    // The engine's locks are taken without holding `stopped`'s mutex: a
                    // pass of `batch` pages holds every shard and the store for ~batch × 5 µs.
                    drop(stopped);
                    let done = pass();
                    if done > 0 {
                        tracing::trace!(done, "compressed cold pages");
                    }
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
