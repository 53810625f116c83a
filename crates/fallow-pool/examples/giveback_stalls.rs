//! Why a get stalls while memory is given back: fills a 1280 MiB engine, then shrinks it
//! to 256 MiB while one thread keeps getting pages, and prints every get over 1 ms with
//! where its time went, from the kernel's per-thread schedstat: time on a CPU, and time
//! runnable but waiting for one. A stall with neither was asleep: waiting for a lock (or
//! for a lock holder the host had descheduled).
//!
//! `cargo run --release -p fallow-pool --example giveback_stalls -- [runs] [--control]`
//! (default 5 runs). With `--control` the budget is left as it is: the same reader over
//! the same windows, to tell the stalls the give-back causes from the machine's own.
//! Linux only (it reads `/proc/thread-self/schedstat`).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Barrier;
use std::time::{Duration, Instant};

use fallow_core::{PageKey, PageStore, PoolSpec, PutOutcome, PAGE_SIZE};
use fallow_pool::{Engine, EngineBuilder};

const BIG: usize = 1280 << 20;
const SMALL: usize = 256 << 20;

/// This thread's time on a CPU and time waiting in a run queue, in ns.
fn schedstat() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap_or_default();
    let mut fields = text.split_whitespace().map(|f| f.parse::<u64>().unwrap_or(0));
    (fields.next().unwrap_or(0), fields.next().unwrap_or(0))
}

/// A stalled get: when it started (µs after the shrink began), how long it took, its time
/// on a CPU and in a run queue (µs).
type Stall = (i64, u64, u64, u64);

fn main() {
    let runs: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(5);
    let control = std::env::args().any(|a| a == "--control");
    let pages = (BIG / PAGE_SIZE) as u64;
    let key = |pool, i: u64| PageKey::new(pool, i / 1024, i % 1024);
    for run in 1..=runs {
        let config = EngineBuilder::new(BIG).compress_interval(None).build();
        let engine = Engine::new(config.expect("a valid budget"));
        let pool = engine.create_pool(&PoolSpec::ephemeral()).expect("pool created");
        let mut page = vec![0u8; PAGE_SIZE];
        for i in 0..pages {
            page[..8].copy_from_slice(&i.to_le_bytes());
            page[PAGE_SIZE - 8..].copy_from_slice(&(!i).to_le_bytes());
            let stored = engine.put(key(pool, i), &page).expect("put");
            assert_eq!(stored, PutOutcome::Stored, "page {i} not stored");
        }
        let (stop, ready) = (AtomicBool::new(false), Barrier::new(2));
        let epoch = Instant::now();
        let (shrink_start, shrink_end, stalls) = std::thread::scope(|s| {
            let reader = s.spawn(|| {
                let mut out = vec![0u8; PAGE_SIZE];
                let mut stalls: Vec<(Instant, Duration, u64, u64)> = Vec::with_capacity(1024);
                ready.wait();
                for n in 0u64.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    // A stride prime to `pages` visits them in a scattered order.
                    let i = n.wrapping_mul(2_654_435_761) % pages;
                    let (cpu0, wait0) = schedstat();
                    let start = Instant::now();
                    let _ = engine.get(key(pool, i), &mut out).expect("get");
                    let took = start.elapsed();
                    if took > Duration::from_millis(1) && stalls.len() < stalls.capacity() {
                        let (cpu1, wait1) = schedstat();
                        stalls.push((start, took, cpu1 - cpu0, wait1 - wait0));
                    }
                }
                stalls
            });
            ready.wait();
            std::thread::sleep(Duration::from_millis(20));
            let shrink_start = Instant::now();
            if control {
                // As long as a give-back takes (~5 ms), with nothing given back.
                std::thread::sleep(Duration::from_millis(5));
            } else {
                engine.set_budget(SMALL);
            }
            let shrink_end = Instant::now();
            // The index sweep runs on after `set_budget` returns: watch it too.
            std::thread::sleep(Duration::from_millis(200));
            stop.store(true, Ordering::Relaxed);
            let stalls = reader.join().expect("reader thread");
            (shrink_start, shrink_end, stalls)
        });
        let rel = |t: Instant| {
            let us = |d: Duration| d.as_micros() as i64;
            if t >= shrink_start {
                us(t - shrink_start)
            } else {
                -us(shrink_start - t)
            }
        };
        let stalls: Vec<Stall> = stalls
            .into_iter()
            .map(|(t, d, cpu, wait)| (rel(t), d.as_micros() as u64, cpu / 1000, wait / 1000))
            .collect();
        println!(
            "run {run}{}: the shrink took {} µs (the reader started {} µs before it); {} gets over 1 ms",
            if control { " (control: no shrink)" } else { "" },
            rel(shrink_end),
            rel(epoch).unsigned_abs(),
            stalls.len()
        );
        for (at, took, cpu, wait) in stalls {
            println!("  at {at} µs: {took} µs, of which {cpu} on a CPU and {wait} waiting for one");
        }
    }
}
