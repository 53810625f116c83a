//! How long the slowest put takes while an engine fills: the engine's tables grow as
//! pages come, and a growth done all at once inside one put would show here.
//!
//! `cargo run --release -p fallow-pool --example fill_stall -- [GiB]` (default 4): fills an
//! engine of that budget with unique ephemeral pages, 1024 to an object, and prints the
//! fill's time, its longest put and how many puts took over 1 ms; then the tail of 200 000
//! gets of pages spread over the whole budget, one thread, nothing else running.

use std::time::{Duration, Instant};

use fallow_core::{PageKey, PageStore, PoolSpec, PutOutcome, PAGE_SIZE};
use fallow_pool::{Engine, EngineBuilder};

fn main() {
    let gib: usize = match std::env::args().nth(1).map(|a| a.parse()) {
        None => 4,
        Some(Ok(gib)) if gib > 0 => gib,
        Some(_) => {
            eprintln!("usage: fill_stall [GiB]   (a whole number of GiB, at least 1)");
            std::process::exit(2);
        }
    };
    let budget = gib << 30;
    let config = EngineBuilder::new(budget).compress_interval(None).build();
    let engine = Engine::new(config.expect("a valid budget"));
    let pool = engine.create_pool(&PoolSpec::ephemeral()).expect("pool created");
    let pages = (budget / PAGE_SIZE) as u64;
    let mut page = vec![0u8; PAGE_SIZE];
    let (mut longest, mut over_1ms) = (Duration::ZERO, 0u64);
    let start = Instant::now();
    for i in 0..pages {
        // Unique and not same-filled: a word at each end.
        page[..8].copy_from_slice(&i.to_le_bytes());
        page[PAGE_SIZE - 8..].copy_from_slice(&(!i).to_le_bytes());
        let put_start = Instant::now();
        let outcome = engine.put(PageKey::new(pool, i / 1024, i % 1024), &page);
        let took = put_start.elapsed();
        assert_eq!(outcome.expect("put"), PutOutcome::Stored, "page {i} not stored");
        longest = longest.max(took);
        over_1ms += u64::from(took > Duration::from_millis(1));
    }
    println!(
        "{gib} GiB, {pages} puts in {:.2?}: longest put {longest:.2?}, puts over 1 ms: {over_1ms}",
        start.elapsed()
    );
    let mut took: Vec<Duration> = (0..200_000u64)
        .map(|n| {
            // A stride prime to `pages` visits them in a scattered order.
            let i = n.wrapping_mul(2_654_435_761) % pages;
            let get_start = Instant::now();
            let found = engine.get(PageKey::new(pool, i / 1024, i % 1024), &mut page);
            let took = get_start.elapsed();
            assert!(found.expect("get").is_hit(), "page {i} missing");
            took
        })
        .collect();
    took.sort_unstable();
    let at = |q: f64| took[((took.len() - 1) as f64 * q) as usize];
    println!(
        "{} gets: p50 {:.2?}, p99 {:.2?}, p99.9 {:.2?}, max {:.2?}",
        took.len(),
        at(0.5),
        at(0.99),
        at(0.999),
        at(1.0)
    );
}
