//! How long the index sweep after a give-back holds the store's write lock, which every
//! get of every shard waits for: fills a 1280 MiB engine with ephemeral pages, gives back
//! 1 GiB, sweeps the dropped pages' index entries at once (`Engine::sweep_dropped`; the
//! background sweeper that the give-back starts shares the work), and prints the steps
//! that held the store lock, their mean and longest hold.
//!
//! Session 11 moved the entries' removal out of that hold (only their contents'
//! releases need the store): a temporary timer in the old build gave a mean of 109 µs a
//! step, longest 1.25 ms.
//!
//! `cargo run --release -p fallow-pool --example sweep_holds -- [runs]` (default 3).

use fallow_core::{PageKey, PageStore, PoolSpec, PAGE_SIZE};
use fallow_pool::{Engine, EngineBuilder};

const BIG: usize = 1280 << 20;
const SMALL: usize = 256 << 20;

fn main() {
    let runs: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(3);
    let pages = (BIG / PAGE_SIZE) as u64;
    let mut page = vec![0u8; PAGE_SIZE];
    for run in 1..=runs {
        let config = EngineBuilder::new(BIG).compress_interval(None).build();
        let engine = Engine::new(config.expect("a valid budget"));
        let pool = engine.create_pool(&PoolSpec::ephemeral()).expect("pool created");
        for i in 0..pages {
            page[..8].copy_from_slice(&i.to_le_bytes());
            page[PAGE_SIZE - 8..].copy_from_slice(&(!i).to_le_bytes());
            let _ = engine.put(PageKey::new(pool, i / 1024, i % 1024), &page).expect("put");
        }
        engine.set_budget(SMALL);
        let r = engine.sweep_dropped();
        let mean = r.store_held.as_secs_f64() * 1e6 / r.store_holds.max(1) as f64;
        println!(
            "run {run}: {} entries removed in {} store holds: mean {mean:.1} µs, longest {} µs",
            r.entries_removed,
            r.store_holds,
            r.longest_store_hold.as_micros()
        );
    }
}
