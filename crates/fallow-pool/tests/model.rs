//! Model-based test: random sequences of every operation on several pools, checked after
//! each step against a `BTreeMap` model and the engine's own `validate()`.
//!
//! The model allows for the documented freedoms: an ephemeral page may vanish (a miss is
//! fine, and then the model forgets it), but a hit must return exactly the last bytes put.
//! A persistent page must hit until it is invalidated or taken. A put that is not stored
//! hides the older page.

use std::collections::BTreeMap;

use fallow_core::{
    DedupScope, HashPutOutcome, PageKey, PageStore, PoolId, PoolSpec, PutOutcome, TrustDomain,
    PAGE_SIZE,
};
use fallow_pool::{Engine, EngineBuilder};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Put {
        pool: usize,
        object: u64,
        index: u64,
        content: u8,
    },
    /// A put by content hash (dedup across nodes), stored only if the content is held.
    PutByHash {
        pool: usize,
        object: u64,
        index: u64,
        content: u8,
    },
    Get {
        pool: usize,
        object: u64,
        index: u64,
    },
    Take {
        pool: usize,
        object: u64,
        index: u64,
    },
    PutMany {
        pool: usize,
        object: u64,
        contents: Vec<u8>,
    },
    GetMany {
        pool: usize,
        object: u64,
        count: u64,
    },
    TakeMany {
        pool: usize,
        object: u64,
        count: u64,
    },
    Recreate {
        pool: usize,
    },
    InvalidatePage {
        pool: usize,
        object: u64,
        index: u64,
    },
    InvalidateObject {
        pool: usize,
        object: u64,
    },
    InvalidatePool {
        pool: usize,
    },
    Compress,
    SetBudget {
        pages: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let pool = 0..POOLS;
    let object = 0u64..4;
    // Mostly the first run of 128 indexes (where the batches write), some across its end
    // and far away, so that objects cover several of the index's spans.
    let index = prop_oneof![
        4 => 0u64..12,
        2 => 124u64..132,
        1 => prop::sample::select(vec![1 << 40, (1 << 40) + 127, u64::MAX - 128, u64::MAX]),
    ];
    prop_oneof![
        8 => (pool.clone(), object.clone(), index.clone(), any::<u8>())
            .prop_map(|(pool, object, index, content)| Op::Put { pool, object, index, content }),
        3 => (pool.clone(), object.clone(), index.clone(), any::<u8>())
            .prop_map(|(pool, object, index, content)| Op::PutByHash { pool, object, index, content }),
        6 => (pool.clone(), object.clone(), index.clone())
            .prop_map(|(pool, object, index)| Op::Get { pool, object, index }),
        2 => (pool.clone(), object.clone(), index.clone())
            .prop_map(|(pool, object, index)| Op::Take { pool, object, index }),
        2 => (pool.clone(), object.clone(), prop::collection::vec(any::<u8>(), 1..8))
            .prop_map(|(pool, object, contents)| Op::PutMany { pool, object, contents }),
        2 => (pool.clone(), object.clone(), 1u64..12)
            .prop_map(|(pool, object, count)| Op::GetMany { pool, object, count }),
        1 => (pool.clone(), object.clone(), 1u64..12)
            .prop_map(|(pool, object, count)| Op::TakeMany { pool, object, count }),
        1 => pool.clone().prop_map(|pool| Op::Recreate { pool }),
        1 => (pool.clone(), object.clone(), index)
            .prop_map(|(pool, object, index)| Op::InvalidatePage { pool, object, index }),
        1 => (pool.clone(), object).prop_map(|(pool, object)| Op::InvalidateObject { pool, object }),
        1 => pool.prop_map(|pool| Op::InvalidatePool { pool }),
        1 => Just(Op::Compress),
        1 => (8usize..64).prop_map(|pages| Op::SetBudget { pages }),
    ]
}

const POOLS: usize = 4;

/// Page bytes for a content byte: a few distinct contents (so dedup happens), zero and
/// same-filled pages among them, and compressible ones.
fn bytes(content: u8) -> Vec<u8> {
    match content % 8 {
        0 => vec![0; PAGE_SIZE],
        1 => vec![content; PAGE_SIZE],
        2 | 3 => format!("text page {content} ").bytes().cycle().take(PAGE_SIZE).collect(),
        _ => (0..PAGE_SIZE)
            .map(|i| (i as u8).wrapping_mul(content).wrapping_add((i >> 8) as u8))
            .collect(),
    }
}

struct Harness {
    engine: Engine,
    specs: Vec<PoolSpec>,
    pools: Vec<(PoolId, bool)>, // (id, persistent)
    model: BTreeMap<PageKey, u8>,
}

impl Harness {
    fn new() -> Self {
        let engine = Engine::new(
            EngineBuilder::new(48 * PAGE_SIZE)
                .shards(2)
                .entries_per_frame(2)
                .compress_interval(None)
                .build()
                .unwrap(),
        );
        let specs = [
            PoolSpec::ephemeral(),
            PoolSpec::persistent().quota_pages(24),
            PoolSpec::ephemeral().compress(true).dedup(DedupScope::Domain(TrustDomain(1))),
            PoolSpec::persistent().dedup(DedupScope::Off).compress(true),
        ];
        let pools = specs
            .iter()
            .map(|s| (engine.create_pool(s).unwrap(), s.kind == fallow_core::PoolKind::Persistent))
            .collect();
        Self { engine, specs: specs.to_vec(), pools, model: BTreeMap::new() }
    }

    fn key(&self, pool: usize, object: u64, index: u64) -> PageKey {
        PageKey::new(self.pools[pool].0, object, index)
    }

    fn persistent(&self, key: PageKey) -> bool {
        self.pools.iter().any(|&(id, p)| id == key.pool && p)
    }

    fn check_read(&mut self, key: PageKey, hit: bool, out: &[u8]) {
        match self.model.get(&key) {
            Some(&content) if hit => assert_eq!(out, &bytes(content)[..], "{key:?}: wrong bytes"),
            Some(_) => {
                assert!(!self.persistent(key), "{key:?}: persistent page missing");
                self.model.remove(&key);
            }
            None => assert!(!hit, "{key:?}: hit on a page the model does not have"),
        }
    }

    fn put(&mut self, key: PageKey, content: u8, outcome: PutOutcome) {
        match outcome {
            PutOutcome::Stored => {
                self.model.insert(key, content);
            }
            PutOutcome::NotStored(_) => {
                self.model.remove(&key);
            }
        }
    }

    fn apply(&mut self, op: Op) {
        let mut out = vec![0u8; PAGE_SIZE];
        match op {
            Op::Put { pool, object, index, content } => {
                let key = self.key(pool, object, index);
                let outcome = self.engine.put(key, &bytes(content)).unwrap();
                self.put(key, content, outcome);
            }
            Op::PutByHash { pool, object, index, content } => {
                let key = self.key(pool, object, index);
                let page = bytes(content);
                // A pool without dedup is asked with domain 0's hash: it must say not held.
                let scope = match self.specs[pool].dedup {
                    DedupScope::Off => DedupScope::Domain(TrustDomain(0)),
                    scope => scope,
                };
                let hash = fallow_core::content::content_hash(&page, scope).unwrap();
                let crc = fallow_core::content::checksum(&page);
                let outcome = self.engine.put_many_by_hash(&[key], &[(hash, crc)]).unwrap()[0];
                match outcome {
                    HashPutOutcome::Stored => {
                        assert_ne!(self.specs[pool].dedup, DedupScope::Off, "{key:?}");
                        self.model.insert(key, content);
                    }
                    // Not held: the key is left as it was.
                    HashPutOutcome::NotHeld => {}
                    HashPutOutcome::NotStored(_) => {
                        self.model.remove(&key);
                    }
                }
            }
            Op::Get { pool, object, index } => {
                let key = self.key(pool, object, index);
                let hit = self.engine.get(key, &mut out).unwrap().is_hit();
                self.check_read(key, hit, &out);
            }
            Op::Take { pool, object, index } => {
                let key = self.key(pool, object, index);
                let hit = self.engine.take(key, &mut out).unwrap().is_hit();
                self.check_read(key, hit, &out);
                self.model.remove(&key);
            }
            Op::PutMany { pool, object, contents } => {
                let keys: Vec<_> =
                    (0..contents.len() as u64).map(|i| self.key(pool, object, i)).collect();
                let pages: Vec<u8> = contents.iter().flat_map(|&c| bytes(c)).collect();
                let outcomes = self.engine.put_many(&keys, &pages).unwrap();
                for ((key, content), outcome) in keys.into_iter().zip(contents).zip(outcomes) {
                    self.put(key, content, outcome);
                }
            }
            Op::GetMany { pool, object, count } => {
                let keys: Vec<_> = (0..count).map(|i| self.key(pool, object, i)).collect();
                let mut out = vec![0u8; keys.len() * PAGE_SIZE];
                let found = self.engine.get_many(&keys, &mut out).unwrap();
                for (i, key) in keys.into_iter().enumerate() {
                    self.check_read(key, found[i].is_hit(), &out[i * PAGE_SIZE..][..PAGE_SIZE]);
                }
            }
            Op::TakeMany { pool, object, count } => {
                let keys: Vec<_> = (0..count).map(|i| self.key(pool, object, i)).collect();
                let mut out = vec![0u8; keys.len() * PAGE_SIZE];
                let found = self.engine.take_many(&keys, &mut out).unwrap();
                for (i, key) in keys.into_iter().enumerate() {
                    self.check_read(key, found[i].is_hit(), &out[i * PAGE_SIZE..][..PAGE_SIZE]);
                    self.model.remove(&key);
                }
            }
            Op::Recreate { pool } => {
                let old = self.pools[pool].0;
                self.engine.destroy_pool(old).unwrap();
                let mut out = vec![0u8; PAGE_SIZE];
                let gone = self.engine.get(PageKey::new(old, 0, 0), &mut out);
                assert_eq!(gone, Err(fallow_core::StoreError::UnknownPool(old)));
                self.model.retain(|k, _| k.pool != old);
                let new = self.engine.create_pool(&self.specs[pool]).unwrap();
                assert_ne!(new, old, "pool ids are never reused");
                self.pools[pool].0 = new;
            }
            Op::InvalidatePage { pool, object, index } => {
                let key = self.key(pool, object, index);
                self.engine.invalidate_page(key).unwrap();
                self.model.remove(&key);
            }
            Op::InvalidateObject { pool, object } => {
                let id = self.pools[pool].0;
                let removed = self.engine.invalidate_object(id, object).unwrap() as usize;
                let before = self.model.len();
                self.model.retain(|k, _| !(k.pool == id && k.object == object));
                let expected = before - self.model.len();
                if self.pools[pool].1 {
                    assert_eq!(removed, expected, "persistent pages of {object} removed");
                } else {
                    // Ephemeral pages may have vanished already: the engine holds a subset.
                    assert!(removed <= expected, "{removed} removed, model had {expected}");
                }
            }
            Op::InvalidatePool { pool } => {
                let id = self.pools[pool].0;
                self.engine.invalidate_pool(id).unwrap();
                self.model.retain(|k, _| k.pool != id);
            }
            Op::Compress => {
                self.engine.compress_cold(8);
            }
            Op::SetBudget { pages } => {
                self.engine.set_budget(pages * PAGE_SIZE);
            }
        }
        self.engine.validate();
        // Every persistent page of the model is still there, with its bytes.
        let persistent: Vec<_> = self
            .model
            .iter()
            .filter(|(k, _)| self.persistent(**k))
            .map(|(k, c)| (*k, *c))
            .collect();
        for (key, content) in persistent {
            let mut out = vec![0u8; PAGE_SIZE];
            assert!(self.engine.get(key, &mut out).unwrap().is_hit(), "{key:?} lost");
            assert_eq!(out, bytes(content));
        }
    }
}

/// A number from the environment variable `name`, else `default`: `FALLOW_MODEL_CASES` and
/// `FALLOW_MODEL_OPS` make a longer soak than CI's run, e.g.
/// `FALLOW_MODEL_CASES=20000 FALLOW_MODEL_OPS=600 cargo test --release -p fallow-pool --test model`.
fn from_env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: from_env("FALLOW_MODEL_CASES", 64) as u32,
        ..ProptestConfig::default()
    })]

    #[test]
    fn engine_matches_the_model(ops in prop::collection::vec(op(), 1..from_env("FALLOW_MODEL_OPS", 120))) {
        let mut h = Harness::new();
        for op in ops {
            h.apply(op);
        }
    }
}
