//! Instructions per engine operation, counted under valgrind: a measure of CPU cost that
//! the noise of a shared machine does not move (criterion's times on this 2-CPU VM swing by
//! 15 % between runs; instruction counts by well under 1 %).
//!
//! `instructions OP N` builds the same fixture as `benches/engine.rs` (64 MiB budget, 8192
//! unique pages under 128 objects of 64 pages, default policy and shards, compression
//! off), then runs OP N times. Running it with N = 0 and N = K under
//! `valgrind --tool=callgrind` and dividing the difference by K gives the instructions of
//! one OP, setup excluded: `bash bench/engine_instructions.sh` does exactly that.
//!
//! OP: `get_hit`, `get_miss`, `put_new` (a put of a key never stored, and the
//! `invalidate_page` that frees its frame again, so no segment is mapped inside the count),
//! `put_overwrite`, `take_put` (a take and the put that restores the page),
//! `invalidate_object` (the put of a one-page object and its `invalidate_object`).

use std::hint::black_box;

use fallow_core::{Lookup, PageKey, PageStore, PoolSpec, PutOutcome, PAGE_SIZE};
use fallow_pool::{Engine, EngineBuilder};

use fallow_testkit::pages as support;

const BUDGET: usize = 64 << 20;
const KEYS: u64 = 8192;

/// Makes `page` (unique, not same-filled) unique to `seed` too, at the cost of one store,
/// so that making the page is not counted as part of the put.
fn stamp(page: &mut [u8], seed: u64) {
    page[..8].copy_from_slice(&seed.to_le_bytes());
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes `--bench`; only a direct call with OP and N does any work.
    let (op, n) = match (args.first(), args.get(1).and_then(|n| n.parse::<u64>().ok())) {
        (Some(op), Some(n)) => (op.as_str(), n),
        _ => {
            eprintln!("usage: instructions OP N (see the file's doc); run by bench/engine_instructions.sh");
            return;
        }
    };
    let config = EngineBuilder::new(BUDGET).compress_interval(None).build().expect("config");
    let engine = Engine::new(config);
    let pool = engine.create_pool(&PoolSpec::ephemeral()).expect("pool");
    let key = |i: u64| PageKey::new(pool, i / 64, i % 64);
    let mut page = vec![0u8; PAGE_SIZE];
    for i in 0..KEYS {
        support::unique_page_into(i, &mut page);
        assert_eq!(engine.put(key(i), &page).expect("fill"), PutOutcome::Stored);
    }
    let mut out = vec![0u8; PAGE_SIZE];
    for i in 0..n {
        let k = key(i % KEYS);
        match op {
            "get_hit" => {
                assert_eq!(black_box(engine.get(k, &mut out).expect("get")), Lookup::Hit);
            }
            "get_miss" => {
                assert_eq!(
                    black_box(engine.get(key(KEYS + i), &mut out).expect("get")),
                    Lookup::Miss
                );
            }
            "put_new" => {
                let fresh = key(KEYS + i);
                stamp(&mut page, KEYS + i);
                assert_eq!(black_box(engine.put(fresh, &page).expect("put")), PutOutcome::Stored);
                engine.invalidate_page(fresh).expect("invalidate");
            }
            "put_overwrite" => {
                stamp(&mut page, KEYS + i);
                assert_eq!(black_box(engine.put(k, &page).expect("put")), PutOutcome::Stored);
            }
            "take_put" => {
                assert_eq!(black_box(engine.take(k, &mut out).expect("take")), Lookup::Hit);
                assert_eq!(black_box(engine.put(k, &out).expect("put")), PutOutcome::Stored);
            }
            "invalidate_object" => {
                let lone = PageKey::new(pool, u64::MAX - i, 0);
                stamp(&mut page, KEYS + i);
                assert_eq!(engine.put(lone, &page).expect("put"), PutOutcome::Stored);
                assert_eq!(
                    black_box(engine.invalidate_object(pool, lone.object).expect("invalidate")),
                    1
                );
            }
            other => panic!("unknown OP {other:?}"),
        }
    }
}
