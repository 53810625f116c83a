//! The pool table: which pools exist, their specs, and their counters.
//!
//! # Locking
//! One `RwLock` around the table. Operations take it for reading, for a map lookup and an
//! `Arc` clone, before any shard lock; an eviction also takes it for reading after a shard
//! and the store, to charge the victim's pool (order: shard → store → pools). Only pool
//! creation and destruction take it for writing, and they never lock a shard while
//! holding it, so the read after a shard lock cannot deadlock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use fallow_core::{PoolId, PoolKind, PoolSpec, Sharing, StoreError};

/// Counters of one pool. Relaxed atomics: they are statistics, never used to decide.
#[derive(Debug, Default)]
pub struct PoolCounters {
    /// Gets and takes that found the page.
    pub hits: AtomicU64,
    /// Gets and takes that did not.
    pub misses: AtomicU64,
    /// Puts that stored their page.
    pub puts_stored: AtomicU64,
    /// Puts that were refused or dropped.
    pub puts_refused: AtomicU64,
    /// Pages evicted to make room or dropped to give memory back.
    pub evictions: AtomicU64,
    /// Pages removed by invalidate or take.
    pub invalidations: AtomicU64,
    /// Reads whose checksum failed (each also counts as a miss).
    pub corruptions: AtomicU64,
    /// Logical pages currently stored.
    pub pages: AtomicU64,
    /// Of those, pages stored as a fill word without a frame.
    pub fill_pages: AtomicU64,
}

impl PoolCounters {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Relaxed);
    }
}

/// A pool and its state.
#[derive(Debug)]
pub struct PoolState {
    /// The spec it was created with.
    pub spec: PoolSpec,
    /// Cleared when the pool is destroyed; checked under the shard lock before a put
    /// inserts, so no page can land in a pool after its last sweep.
    pub alive: AtomicBool,
    /// Its counters.
    pub counters: PoolCounters,
}

impl PoolState {
    /// True for persistent pools.
    pub fn persistent(&self) -> bool {
        self.spec.kind == PoolKind::Persistent
    }
}

struct Entry {
    state: Arc<PoolState>,
    /// Creates (or attaches) not yet matched by a destroy.
    users: u32,
}

/// Pool id → pool, and shared-pool UUID → pool id.
#[derive(Default)]
pub struct PoolTable {
    pools: HashMap<PoolId, Entry>,
    by_uuid: HashMap<u128, PoolId>,
    next_id: u32,
}

impl PoolTable {
    /// The pool with this id.
    pub fn get(&self, id: PoolId) -> Result<Arc<PoolState>, StoreError> {
        self.pools.get(&id).map(|e| e.state.clone()).ok_or(StoreError::UnknownPool(id))
    }

    /// Every pool, for stats.
    pub fn all(&self) -> Vec<(PoolId, Arc<PoolState>)> {
        let mut v: Vec<_> = self.pools.iter().map(|(&id, e)| (id, e.state.clone())).collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }

    /// Creates a pool, or attaches to the shared pool with the same UUID.
    pub fn create(&mut self, spec: &PoolSpec) -> Result<PoolId, StoreError> {
        if spec.quota_pages.is_some() && spec.kind == PoolKind::Ephemeral {
            return Err(StoreError::InvalidSpec(
                "a quota applies to persistent pools only; an ephemeral pool is bounded by eviction",
            ));
        }
        if let Sharing::Shared { uuid } = spec.sharing {
            if let Some(&id) = self.by_uuid.get(&uuid) {
                let entry = self.pools.get_mut(&id).ok_or(StoreError::UnknownPool(id))?;
                if entry.state.spec != *spec {
                    return Err(StoreError::SharedPoolMismatch { uuid });
                }
                entry.users += 1;
                return Ok(id);
            }
        }
        let id = PoolId(self.next_id);
        self.next_id = self.next_id.checked_add(1).ok_or(StoreError::TooManyPools)?;
        let state = Arc::new(PoolState {
            spec: *spec,
            alive: AtomicBool::new(true),
            counters: PoolCounters::default(),
        });
        self.pools.insert(id, Entry { state, users: 1 });
        if let Sharing::Shared { uuid } = spec.sharing {
            self.by_uuid.insert(uuid, id);
        }
        Ok(id)
    }

    /// Detaches one user. Returns the pool's state when this was the last user: the pool
    /// is then gone from the table and marked dead, and the caller sweeps its pages.
    pub fn detach(&mut self, id: PoolId) -> Result<Option<Arc<PoolState>>, StoreError> {
        let entry = self.pools.get_mut(&id).ok_or(StoreError::UnknownPool(id))?;
        entry.users -= 1;
        if entry.users > 0 {
            return Ok(None);
        }
        let entry = self.pools.remove(&id).ok_or(StoreError::UnknownPool(id))?;
        if let Sharing::Shared { uuid } = entry.state.spec.sharing {
            self.by_uuid.remove(&uuid);
        }
        entry.state.alive.store(false, std::sync::atomic::Ordering::Release);
        Ok(Some(entry.state))
    }
}
