//! How long a compression pass holds the engine: every shard lock and the store's, so every
//! get waits that long. Fills a 256 MiB engine with compressible ephemeral pages, lets one
//! pass see them all (a new page counts as just read), then runs passes of `batch` pages
//! (default 32, the background compressor's) until nothing is left to compress, and prints
//! the median, 99th percentile and longest pass, with the compressed-page count at each
//! pass over 1 ms.
//!
//! Session 10 measured with it: passes over 1 ms at 14,336, 28,672 and 57,344 compressed
//! pages (the blob `HashMap` doubling) until the blobs moved to a table that never moves
//! what it holds (`store/blobs.rs`), and what giving each frame back to the OS costs a pass.
//!
//! `cargo run --release -p fallow-pool --example compression_passes -- [batch]`

use std::time::Instant;

use fallow_core::{PageKey, PageStore, PoolSpec, PutOutcome, PAGE_SIZE};
use fallow_pool::{Engine, EngineBuilder};

fn main() {
    let batch: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(32);
    let budget = 256usize << 20;
    let config = EngineBuilder::new(budget).compress_interval(None).build();
    let e = Engine::new(config.expect("a valid budget"));
    let pool = e.create_pool(&PoolSpec::ephemeral().compress(true)).expect("pool created");
    let mut page = vec![0u8; PAGE_SIZE];
    for i in 0..(budget / PAGE_SIZE) as u64 {
        // Two unique words in a page of zeros: lz4 shrinks it to a few dozen bytes.
        page.fill(0);
        page[..8].copy_from_slice(&i.to_le_bytes());
        page[1000..1008].copy_from_slice(&(!i).to_le_bytes());
        let stored = e.put(PageKey::new(pool, i / 1024, i % 1024), &page).expect("put");
        assert_eq!(stored, PutOutcome::Stored);
    }
    e.compress_cold(usize::MAX);
    let (mut micros, mut slow) = (Vec::new(), Vec::new());
    loop {
        let compressed = e.stats().compressed_pages;
        let start = Instant::now();
        let done = e.compress_cold(batch);
        let took = start.elapsed().as_micros() as u64;
        if took > 1000 {
            slow.push((compressed, took));
        }
        micros.push(took);
        if done == 0 {
            break;
        }
    }
    micros.sort_unstable();
    let at = |q: f64| micros[((micros.len() - 1) as f64 * q) as usize];
    println!(
        "{} passes of {batch}: median {} µs, p99 {} µs, longest {} µs; over 1 ms (compressed pages before, µs): {slow:?}",
        micros.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
}
