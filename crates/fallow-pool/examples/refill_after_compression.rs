//! What pages put in frames that compression freed cost: fills half of an engine's budget
//! with compressible persistent pages, compresses them all, then puts as many new
//! (incompressible) pages, and prints the metadata per page of the first ones (compressed
//! or not), what the new pages added, and the median time of a get of them (five rounds
//! over all of them).
//!
//! Until session 10 a compressed page kept its frame's number as its content id, so every
//! new page put in such a frame took a virtual id: more metadata and a map lookup per get.
//! `--no-compress` skips the compression (the baseline); `--reverse` gets the new pages in
//! the reverse order of their keys. The order matters on its own: the arena hands freed
//! frames back last-freed first, so after compression the new pages' keys ascend while
//! their frames descend, and a get of each key in turn is ~40 % slower in that order than
//! in the other, with or without exceptions. Compare builds in the same order.
//!
//! `cargo run --release -p fallow-pool --example refill_after_compression -- [MiB]
//! [--no-compress] [--reverse]` (default 256 MiB).

use std::time::Instant;

use fallow_core::{PageKey, PageStore, PoolSpec, PutOutcome, PAGE_SIZE};
use fallow_pool::{Engine, EngineBuilder};

#[path = "../tests/support/mod.rs"]
mod support;

/// A page unique to `seed`: random bytes, then zeros from `random_bytes` on (lz4 shrinks
/// it to about that many bytes).
fn page(seed: u64, out: &mut [u8], random_bytes: usize) {
    out.fill(0);
    support::unique_page_into(seed, &mut out[..random_bytes]);
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mib: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(256);
    let compress = !args.iter().any(|a| a == "--no-compress");
    let reverse = args.iter().any(|a| a == "--reverse");
    let budget = mib << 20;
    let config = EngineBuilder::new(budget).compress_interval(None).build();
    let e = Engine::new(config.expect("a valid budget"));
    let pool = e.create_pool(&PoolSpec::persistent().compress(true)).expect("pool created");
    let half = (budget / PAGE_SIZE / 2) as u64;
    let cold = |i: u64| PageKey::new(pool, i / 1024, i % 1024);
    let new = |i: u64| PageKey::new(pool, (1 << 32) + i / 1024, i % 1024);
    let mut buf = vec![0u8; PAGE_SIZE];
    for i in 0..half {
        page(i, &mut buf, PAGE_SIZE / 4);
        assert_eq!(e.put(cold(i), &buf).expect("put"), PutOutcome::Stored);
    }
    if compress {
        // The first pass sees every page as just written; the next ones compress.
        while e.compress_cold(1 << 16) > 0 || e.stats().compressed_pages == 0 {}
    }
    let before = e.stats();
    for i in 0..half {
        page(1 << 40 | i, &mut buf, PAGE_SIZE);
        assert_eq!(e.put(new(i), &buf).expect("put"), PutOutcome::Stored);
    }
    let after = e.stats();
    let added = (after.metadata_bytes - before.metadata_bytes) as f64 / half as f64;
    let mut rounds = Vec::new();
    for _ in 0..5 {
        let start = Instant::now();
        for j in 0..half {
            let i = if reverse { half - 1 - j } else { j };
            assert!(e.get(new(i), &mut buf).expect("get").is_hit());
        }
        rounds.push(start.elapsed().as_nanos() as f64 / half as f64);
    }
    rounds.sort_by(f64::total_cmp);
    println!(
        "{mib} MiB: {} compressed pages, {:.1} B of metadata each (blob not counted); \
         {half} new pages, {added:.1} B each; get {:.0} ns (median of 5 rounds{})",
        before.compressed_pages,
        before.metadata_bytes as f64 / before.pages as f64,
        rounds[2],
        if reverse { ", keys in reverse" } else { "" }
    );
}
