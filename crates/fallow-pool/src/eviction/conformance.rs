//! The one conformance suite every [`Eviction`] policy passes. A new policy is a new file
//! plus one line in `conformance_suite!` below (and in `scan_resistance!` if it claims to
//! resist scans); `by_name_policies_follow_the_contract` covers every name in
//! [`POLICY_NAMES`].

use std::collections::HashSet;

use proptest::prelude::*;

use super::{by_name, Eviction, Lru, S3FifoLean, SlotId, POLICY_NAMES};
#[cfg(feature = "research-policies")]
use super::{Adaptive, Lirs, S3Fifo, WTinyLfu};

/// How the suite builds a policy for a cache of `capacity` pages.
trait Build: Eviction + Sized {
    fn build(capacity: usize) -> Self;
}

impl Build for Lru {
    fn build(capacity: usize) -> Self {
        let mut lru = Lru::new();
        lru.set_capacity(capacity);
        lru
    }
}

#[cfg(feature = "research-policies")]
impl Build for S3Fifo {
    fn build(capacity: usize) -> Self {
        S3Fifo::new(capacity)
    }
}

#[cfg(feature = "research-policies")]
impl Build for WTinyLfu {
    fn build(capacity: usize) -> Self {
        WTinyLfu::new(capacity)
    }
}

#[cfg(feature = "research-policies")]
impl Build for Adaptive {
    fn build(capacity: usize) -> Self {
        Adaptive::new(capacity)
    }
}

impl Build for S3FifoLean {
    fn build(capacity: usize) -> Self {
        S3FifoLean::new(capacity)
    }
}

#[cfg(feature = "research-policies")]
impl Build for Lirs {
    fn build(capacity: usize) -> Self {
        Lirs::new(capacity)
    }
}

/// A well-mixed stand-in for the engine's key hash.
fn hash(key: u64) -> u64 {
    xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes())
}

/// Pops every tracked id and checks each comes back exactly once, then `None`.
fn drain(p: &mut dyn Eviction, model: &mut HashSet<SlotId>) {
    while let Some(id) = p.pop_victim() {
        assert!(model.remove(&id), "popped {id}, which is not tracked (or popped twice)");
        assert_eq!(p.len(), model.len());
        p.validate();
    }
    assert!(model.is_empty(), "pop_victim returned None while {model:?} are tracked");
    assert!(p.is_empty());
}

fn insert_then_pop_returns_each_once(p: &mut dyn Eviction) {
    let mut model = HashSet::new();
    assert_eq!(p.pop_victim(), None, "an empty policy has no victim");
    for id in 0..100 {
        p.insert(id, hash(u64::from(id)));
        model.insert(id);
        assert_eq!(p.len(), model.len());
        p.validate();
    }
    for id in (0..100).step_by(3) {
        p.touch(id, hash(u64::from(id)));
        p.validate();
    }
    drain(p, &mut model);
}

fn remove_stops_tracking(p: &mut dyn Eviction) {
    let mut model = HashSet::new();
    for id in 0..50 {
        p.insert(id, hash(u64::from(id)));
        model.insert(id);
    }
    for id in (0..50).filter(|id| id % 2 == 0) {
        p.remove(id);
        model.remove(&id);
        assert_eq!(p.len(), model.len());
        p.validate();
    }
    // Ids are reused by the engine: a removed id may come back for another key.
    for id in (0..50).filter(|id| id % 4 == 0) {
        p.insert(id, hash(1000 + u64::from(id)));
        model.insert(id);
        p.validate();
    }
    drain(p, &mut model);
}

/// The engine's loop: a miss at capacity pops a victim, then inserts.
fn replay(p: &mut dyn Eviction, capacity: usize, keys: impl IntoIterator<Item = u64>) -> usize {
    let mut cached: std::collections::HashMap<u64, SlotId> = Default::default();
    let mut key_of: Vec<u64> = Vec::new();
    let mut free: Vec<SlotId> = Vec::new();
    let mut hits = 0;
    for key in keys {
        if let Some(&id) = cached.get(&key) {
            p.touch(id, hash(key));
            hits += 1;
            continue;
        }
        while cached.len() >= capacity {
            let victim = p.pop_victim().expect("a full cache has a victim");
            cached.remove(&key_of[victim as usize]).expect("victim was tracked");
            free.push(victim);
        }
        let id = free.pop().unwrap_or_else(|| {
            key_of.push(0);
            (key_of.len() - 1) as SlotId
        });
        key_of[id as usize] = key;
        cached.insert(key, id);
        p.insert(id, hash(key));
        assert_eq!(p.len(), cached.len());
    }
    p.validate();
    hits
}

fn capacity_changes_mid_run(p: &mut dyn Eviction) {
    let keys = |n: u64, seed: u64| (0..n).map(move |i| (i * 7 + seed) % 97);
    replay(p, 40, keys(500, 1));
    p.set_capacity(10);
    p.validate();
    let mut model: HashSet<SlotId> = HashSet::new();
    // Shrink: the engine pops until it fits.
    while p.len() > 10 {
        let id = p.pop_victim().expect("over capacity, so a victim exists");
        assert!(model.insert(id), "{id} popped twice");
        p.validate();
    }
    p.set_capacity(200);
    p.validate();
    for id in 1000..1300 {
        p.insert(id, hash(u64::from(id)));
    }
    p.validate();
    assert_eq!(p.len(), 310);
    p.set_capacity(1);
    while p.pop_victim().is_some() {}
    assert!(p.is_empty());
    p.validate();
}

/// A small hot set, touched between the pages of a long one-touch scan, must mostly survive.
fn hot_set_survives_scan(p: &mut dyn Eviction) {
    let capacity = 100;
    let hot = 0..20u64;
    let mut keys: Vec<u64> = (0..50).flat_map(|_| hot.clone()).collect();
    for i in 0..5_000u64 {
        keys.push(1_000_000 + i); // scanned once
        if i % 5 == 0 {
            keys.push(i / 5 % 20); // the hot set: each page once per 100 scanned pages
        }
    }
    let hits = replay(p, capacity, keys);
    // Warm-up: 50 rounds of 20 pages, 20 cold misses. During the scan: 1000 hot touches,
    // of which at least 90 % must hit.
    assert!(hits >= 980 + 900, "{} hit only {hits}", p.name());
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u64),
    Touch(usize),
    Remove(usize),
    Pop,
    SetCapacity(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..64u64).prop_map(Op::Insert),
        4 => any::<usize>().prop_map(Op::Touch),
        1 => any::<usize>().prop_map(Op::Remove),
        2 => Just(Op::Pop),
        1 => (1..40usize).prop_map(Op::SetCapacity),
    ]
}

/// Random operations against a `HashSet` model of the tracked ids; `validate()` after each.
fn random_ops_match_model(p: &mut dyn Eviction, ops: &[Op]) {
    let mut tracked: Vec<SlotId> = Vec::new(); // ordered, so indexes pick deterministically
    let mut free: Vec<SlotId> = Vec::new();
    let mut next_id: SlotId = 0;
    let mut key_of = std::collections::HashMap::new();
    for op in ops {
        match *op {
            Op::Insert(key) => {
                let id = free.pop().unwrap_or_else(|| {
                    next_id += 1;
                    next_id - 1
                });
                p.insert(id, hash(key));
                key_of.insert(id, key);
                tracked.push(id);
            }
            Op::Touch(i) if !tracked.is_empty() => {
                let id = tracked[i % tracked.len()];
                p.touch(id, hash(u64::from(id)));
            }
            Op::Remove(i) if !tracked.is_empty() => {
                let id = tracked.swap_remove(i % tracked.len());
                p.remove(id);
                free.push(id);
            }
            Op::Pop => match p.pop_victim() {
                Some(id) => {
                    let at = tracked.iter().position(|t| *t == id);
                    let at = at.unwrap_or_else(|| panic!("popped untracked {id}"));
                    tracked.swap_remove(at);
                    free.push(id);
                    // As the engine does: the victim's key hash, right after the pop.
                    p.evicted(hash(key_of[&id]));
                }
                None => assert!(tracked.is_empty(), "None while {} tracked", tracked.len()),
            },
            Op::SetCapacity(c) => p.set_capacity(c),
            Op::Touch(_) | Op::Remove(_) => {}
        }
        assert_eq!(p.len(), tracked.len());
        p.validate();
    }
    let mut model: HashSet<SlotId> = tracked.into_iter().collect();
    drain(p, &mut model);
}

macro_rules! conformance_suite {
    ($($name:ident: $policy:ty),+ $(,)?) => {$(
        mod $name {
            use super::*;

            fn make(capacity: usize) -> $policy {
                <$policy as Build>::build(capacity)
            }

            #[test]
            fn insert_then_pop_returns_each_once() {
                for capacity in [1, 12, 100, 1000] {
                    super::insert_then_pop_returns_each_once(&mut make(capacity));
                }
            }

            #[test]
            fn remove_stops_tracking() {
                super::remove_stops_tracking(&mut make(20));
            }

            #[test]
            fn capacity_changes_mid_run() {
                super::capacity_changes_mid_run(&mut make(40));
            }

            #[test]
            fn tiny_cache_still_cycles() {
                let mut p = make(2);
                let hits = replay(&mut p, 2, (0..1000).map(|i| i % 3));
                assert!(hits < 1000);
                p.validate();
            }

            #[test]
            fn heap_bytes_grow_with_slots() {
                let mut p = make(64);
                let before = p.heap_bytes();
                for id in 0..64 {
                    p.insert(id, hash(u64::from(id)));
                }
                assert!(p.heap_bytes() > before || before > 0);
            }

            proptest! {
                #[test]
                fn random_ops_match_model(
                    capacity in 1..40usize,
                    ops in proptest::collection::vec(op(), 1..300),
                ) {
                    super::random_ops_match_model(&mut make(capacity), &ops);
                }
            }
        }
    )+};
}

conformance_suite!(lru: Lru, s3fifo_lean: S3FifoLean);

#[cfg(feature = "research-policies")]
mod research {
    use super::*;

    conformance_suite!(s3fifo: S3Fifo, wtinylfu: WTinyLfu, lirs: Lirs, adaptive: Adaptive);
}

macro_rules! scan_resistance {
    ($($name:ident: $policy:ty),+ $(,)?) => {$(
        #[test]
        fn $name() {
            hot_set_survives_scan(&mut <$policy as Build>::build(100));
        }
    )+};
}

mod scan_resistance {
    use super::*;

    scan_resistance!(s3fifo_lean: S3FifoLean);
    #[cfg(feature = "research-policies")]
    scan_resistance!(s3fifo: S3Fifo, wtinylfu: WTinyLfu, lirs: Lirs, adaptive: Adaptive);
}

#[test]
fn lru_is_flushed_by_a_scan() {
    // The check above is meaningful: plain LRU fails it.
    let result = std::panic::catch_unwind(|| hot_set_survives_scan(&mut Lru::build(100)));
    assert!(result.is_err());
}

#[test]
fn by_name_policies_follow_the_contract() {
    for name in POLICY_NAMES {
        let mut p = by_name(name, 16).unwrap_or_else(|| panic!("{name} is listed but unknown"));
        assert_eq!(p.name(), *name);
        insert_then_pop_returns_each_once(p.as_mut());
        capacity_changes_mid_run(by_name(name, 40).unwrap().as_mut());
        let ops: Vec<Op> = (0..2000u64)
            .map(|i| match i % 7 {
                0 | 3 => Op::Insert(i % 50),
                1 | 4 => Op::Touch(i as usize * 31),
                2 => Op::Pop,
                5 => Op::Remove(i as usize),
                _ => Op::SetCapacity(1 + (i as usize % 30)),
            })
            .collect();
        random_ops_match_model(by_name(name, 16).unwrap().as_mut(), &ops);
    }
    assert!(by_name("no-such-policy", 16).is_none());
    assert!(POLICY_NAMES.contains(&super::DEFAULT_POLICY));
}
