//! The pool table: which pools exist, their specs, and their counters.
//!
//! # Locking
//! One `RwLock` around the table, taken for writing by pool creation and destruction and
//! for reading by stats. Operations do not take it: they look their pool up in a snapshot
//! of the table ([`PoolSnapshot`], an `ArcSwap` the writers replace), which costs no
//! write to memory another thread uses; taking the lock for reading and cloning the
//! pool's `Arc`, as they did, wrote four times per operation to two cache lines that
//! every thread's operations share. The counters are striped for the same reason
//! ([`PoolCounters`]). Creation and destruction never lock a shard while holding the
//! lock.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Arc;

use arc_swap::{ArcSwap, Guard};
use fallow_core::{DedupScope, PoolId, PoolKind, PoolSpec, Sharing, StoreError, TrustDomain};

use crate::content::domain_mask;

/// One pool counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Gets and takes that found the page.
    Hits,
    /// Gets and takes that did not.
    Misses,
    /// Puts that stored their page.
    PutsStored,
    /// Puts that were refused or dropped.
    PutsRefused,
    /// Pages evicted to make room or dropped to give memory back.
    Evictions,
    /// Pages removed by invalidate or take.
    Invalidations,
    /// Reads whose checksum failed (each also counts as a miss).
    Corruptions,
    /// Logical pages currently stored.
    Pages,
    /// Of those, pages stored as a fill word without a frame.
    FillPages,
}

const COUNTERS: usize = 9;
/// Stripes per pool: threads are spread over them, so that two threads rarely count in
/// the same cache line.
const STRIPES: usize = 8;

/// One stripe of a pool's counters, on cache lines of its own (128 bytes: two lines, as
/// adjacent lines are fetched together on x86).
#[derive(Debug, Default)]
#[repr(align(128))]
struct Stripe([AtomicU64; COUNTERS]);

/// Counters of one pool, striped by thread: each thread adds to its own stripe and a read
/// sums them. Relaxed atomics; a persistent pool's quota reads `Pages` (a sum of 8 loads).
/// A stripe may go below zero (a page counted in by one thread and out by another): the
/// sums wrap and come out right.
#[derive(Debug, Default)]
pub struct PoolCounters {
    stripes: [Stripe; STRIPES],
}

/// The stripe of the calling thread: threads take the next one as they first count.
fn stripe() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static STRIPE: usize = NEXT.fetch_add(1, Relaxed) % STRIPES;
    }
    STRIPE.with(|s| *s)
}

impl PoolCounters {
    /// Adds `n` to `counter`.
    pub(crate) fn add(&self, counter: Counter, n: u64) {
        self.stripes[stripe()].0[counter as usize].fetch_add(n, Relaxed);
    }

    /// Adds one to `counter`.
    pub(crate) fn bump(&self, counter: Counter) {
        self.add(counter, 1);
    }

    /// Takes one from `counter`.
    pub(crate) fn drop_one(&self, counter: Counter) {
        self.stripes[stripe()].0[counter as usize].fetch_sub(1, Relaxed);
    }

    /// The value of `counter`.
    pub fn get(&self, counter: Counter) -> u64 {
        let i = counter as usize;
        self.stripes.iter().fold(0u64, |sum, s| sum.wrapping_add(s.0[i].load(Relaxed)))
    }
}

/// Pool ids, hashed by a multiply (they are small sequential numbers).
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.0 = u64::from(n).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    }
}

/// The live pools as of the last creation or destruction, for operations to look their
/// pool up without a lock.
pub(crate) type PoolMap = HashMap<PoolId, Arc<PoolState>, BuildHasherDefault<IdHasher>>;

/// A snapshot of the pool table ([`PoolTable::snapshot`]), replaced whenever the table
/// changes.
#[derive(Default)]
pub(crate) struct PoolSnapshot(ArcSwap<PoolMap>);

impl PoolSnapshot {
    /// The pools now. Hold the guard for one operation, not longer: it pins this version.
    pub(crate) fn load(&self) -> Guard<Arc<PoolMap>> {
        self.0.load()
    }

    /// Publishes `table`'s pools.
    pub(crate) fn publish(&self, table: &PoolTable) {
        self.0.store(Arc::new(table.snapshot()));
    }
}

/// Looks `id` up in a snapshot.
pub(crate) fn find(pools: &PoolMap, id: PoolId) -> Result<&PoolState, StoreError> {
    pools.get(&id).map(|s| &**s).ok_or(StoreError::UnknownPool(id))
}

/// A pool and its state.
#[derive(Debug)]
pub struct PoolState {
    /// The spec it was created with.
    pub spec: PoolSpec,
    /// How its pages are deduplicated: the spec's scope, or `Off` when its domain's
    /// checksum mask is another domain's too ([`PoolTable::create`]).
    pub dedup: DedupScope,
    /// Its domain's checksum mask ([`domain_mask`] of `dedup`): what its pages' checksums
    /// are stored XORed with.
    pub mask: u32,
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
    /// The trust domain of each checksum mask that live pools use, and how many use it.
    /// A domain leaves when its last pool is destroyed and its pages swept
    /// ([`PoolTable::release_domain`]), so that creating and destroying pools of ever new
    /// domains does not grow it.
    masks: HashMap<u32, (TrustDomain, usize)>,
}

impl PoolTable {
    /// The pool with this id.
    pub fn get(&self, id: PoolId) -> Result<Arc<PoolState>, StoreError> {
        self.pools.get(&id).map(|e| e.state.clone()).ok_or(StoreError::UnknownPool(id))
    }

    /// The live pools, for a [`PoolSnapshot`].
    fn snapshot(&self) -> PoolMap {
        self.pools.iter().map(|(&id, e)| (id, e.state.clone())).collect()
    }

    /// Every pool, for stats.
    pub fn all(&self) -> Vec<(PoolId, Arc<PoolState>)> {
        let mut v: Vec<_> = self.pools.iter().map(|(&id, e)| (id, e.state.clone())).collect();
        v.sort_by_key(|(id, _)| *id);
        v
    }

    /// Every pool with its spec and how many creates or attaches it has (a snapshot for a
    /// restart).
    pub fn with_users(&self) -> Vec<(PoolId, PoolSpec, u32)> {
        let mut v: Vec<_> = self.pools.iter().map(|(&id, e)| (id, e.state.spec, e.users)).collect();
        v.sort_by_key(|(id, _, _)| *id);
        v
    }

    /// Makes pool `id` again, as a restarted node restores it: the same id, spec and
    /// users. Fails if the id is taken; later creates get ids above it.
    pub fn restore(&mut self, id: PoolId, spec: &PoolSpec, users: u32) -> Result<(), StoreError> {
        if self.pools.contains_key(&id) {
            return Err(StoreError::InvalidSpec("a restored pool's id is taken"));
        }
        if let Sharing::Shared { uuid } = spec.sharing {
            if self.by_uuid.contains_key(&uuid) {
                return Err(StoreError::SharedPoolMismatch { uuid });
            }
            self.by_uuid.insert(uuid, id);
        }
        let state = self.new_state(spec);
        self.pools.insert(id, Entry { state, users: users.max(1) });
        self.next_id = self.next_id.max(id.0.saturating_add(1));
        Ok(())
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
        let state = self.new_state(spec);
        self.pools.insert(id, Entry { state, users: 1 });
        if let Sharing::Shared { uuid } = spec.sharing {
            self.by_uuid.insert(uuid, id);
        }
        Ok(id)
    }

    /// The state of a new pool of `spec`, its dedup scope settled.
    fn new_state(&mut self, spec: &PoolSpec) -> Arc<PoolState> {
        let dedup = self.dedup_scope(spec.dedup);
        Arc::new(PoolState {
            spec: *spec,
            dedup,
            mask: domain_mask(dedup),
            alive: AtomicBool::new(true),
            counters: PoolCounters::default(),
        })
    }

    /// The scope a new pool with `scope` dedups in. Pages of two domains are kept apart by
    /// their checksum masks (`fallow_core::content::stored_checksum`); two domains whose
    /// 32-bit masks are equal (a chance of 2⁻³² for a pair) could share pages, so while a
    /// domain has live pools, pools of another domain with its mask do not dedup on this
    /// engine. Their pages are stored and read as usual.
    fn dedup_scope(&mut self, scope: DedupScope) -> DedupScope {
        let DedupScope::Domain(domain) = scope else { return scope };
        let (first, pools) = self.masks.entry(domain_mask(scope)).or_insert((domain, 0));
        let first = *first;
        if first == domain {
            *pools += 1;
            return scope;
        }
        tracing::warn!(
            domain = domain.0,
            other = first.0,
            "trust domain {} has the checksum mask of domain {} on this engine: its pools \
             do not deduplicate here",
            domain.0,
            first.0
        );
        DedupScope::Off
    }

    /// Forgets one destroyed pool of `scope` (its [`PoolState::dedup`]), once its pages are
    /// swept: the domain's mask is free again when no live pool uses it.
    pub fn release_domain(&mut self, scope: DedupScope) {
        let DedupScope::Domain(domain) = scope else { return };
        let mask = domain_mask(scope);
        if let Some((owner, pools)) = self.masks.get_mut(&mask) {
            debug_assert_eq!(*owner, domain, "a pool of a domain that does not own its mask");
            *pools -= 1;
            if *pools == 0 {
                self.masks.remove(&mask);
            }
        }
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

/// Two domains whose 32-bit checksum masks are equal, found by a birthday search: for
/// tests of what the engine does with them.
#[cfg(test)]
pub(crate) fn colliding_domains() -> (TrustDomain, TrustDomain) {
    let mut seen = HashMap::new();
    (0u64..)
        .find_map(|d| {
            let mask = domain_mask(DedupScope::Domain(TrustDomain(d)));
            seen.insert(mask, d).map(|first| (TrustDomain(first), TrustDomain(d)))
        })
        .expect("a collision within 2^32 domains")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn striped_counters_sum_across_threads_even_when_a_stripe_goes_below_zero() {
        let c = PoolCounters::default();
        std::thread::scope(|s| {
            for _ in 0..4 {
                s.spawn(|| (0..1000).for_each(|_| c.bump(Counter::Hits)));
            }
        });
        assert_eq!(c.get(Counter::Hits), 4000);
        // Counted in here, out on other threads (other stripes): the sum is right.
        c.add(Counter::Pages, 3);
        std::thread::scope(|s| {
            for _ in 0..3 {
                s.spawn(|| c.drop_one(Counter::Pages));
            }
        });
        assert_eq!(c.get(Counter::Pages), 0);
        assert_eq!(c.get(Counter::Misses), 0);
    }

    #[test]
    fn the_snapshot_follows_creation_and_destruction() {
        let mut table = PoolTable::default();
        let snapshot = PoolSnapshot::default();
        let id = table.create(&PoolSpec::ephemeral()).unwrap();
        assert!(find(&snapshot.load(), id).is_err(), "not published yet");
        snapshot.publish(&table);
        let pinned = snapshot.load();
        assert!(find(&pinned, id).is_ok());
        table.detach(id).unwrap();
        snapshot.publish(&table);
        assert!(find(&snapshot.load(), id).is_err(), "gone after the next publish");
        // A snapshot loaded before still has it (an operation in flight finishes with it).
        assert!(!find(&pinned, id).unwrap().alive.load(Relaxed), "but marked dead");
    }

    #[test]
    fn a_domain_whose_mask_another_domain_has_does_not_dedup() {
        let (first, second) = colliding_domains();
        let mut table = PoolTable::default();
        let spec = |domain| PoolSpec { dedup: DedupScope::Domain(domain), ..PoolSpec::ephemeral() };
        let mut create = |domain| {
            let id = table.create(&spec(domain)).unwrap();
            table.get(id).unwrap()
        };
        let a = create(first);
        let b = create(second);
        let again = create(first);
        assert_eq!(a.dedup, DedupScope::Domain(first));
        assert_eq!(again.dedup, DedupScope::Domain(first), "the first domain keeps its dedup");
        assert_eq!(b.dedup, DedupScope::Off);
        assert_eq!((a.mask, b.mask), (domain_mask(a.dedup), 0));
        assert_eq!(b.spec.dedup, DedupScope::Domain(second), "the spec is as asked");
    }

    #[test]
    fn a_mask_is_free_again_once_its_domains_last_pool_is_gone() {
        let (first, second) = colliding_domains();
        let mut table = PoolTable::default();
        let spec = |domain| PoolSpec { dedup: DedupScope::Domain(domain), ..PoolSpec::ephemeral() };
        let destroy = |table: &mut PoolTable, id| {
            let state = table.detach(id).unwrap().expect("the last user");
            table.release_domain(state.dedup);
        };
        let a = table.create(&spec(first)).unwrap();
        let a2 = table.create(&spec(first)).unwrap();
        let b = table.create(&spec(second)).unwrap();
        assert_eq!(table.get(b).unwrap().dedup, DedupScope::Off);
        destroy(&mut table, b);
        destroy(&mut table, a);
        let b = table.create(&spec(second)).unwrap();
        assert_eq!(table.get(b).unwrap().dedup, DedupScope::Off, "the first domain has a pool");
        destroy(&mut table, a2);
        destroy(&mut table, b);
        assert!(table.masks.is_empty(), "{:?}", table.masks);
        let b = table.create(&spec(second)).unwrap();
        assert_eq!(table.get(b).unwrap().dedup, DedupScope::Domain(second));
    }
}
