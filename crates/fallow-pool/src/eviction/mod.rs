//! Eviction policies for ephemeral pages: which resident page leaves when the budget is
//! spent. One file per policy, one shared conformance suite (`conformance.rs`).
//!
//! A policy sees only slot ids (small dense integers handed out by the engine's index) and
//! a 64-bit hash of each page's key; it never sees keys or page bytes. Persistent pages
//! are never given to a policy.

/// A dense id for one tracked page. The engine reuses ids of pages that have left, so a
/// policy may size its per-slot arrays by the largest id it has seen.
pub type SlotId = u32;

/// Chooses which tracked page leaves next.
///
/// Contract (checked by `conformance.rs` for every policy):
/// * The caller never inserts an id that is tracked, and only touches or removes ids that
///   are tracked.
/// * The policy MUST track an inserted id until it is returned by [`Eviction::pop_victim`]
///   or passed to [`Eviction::remove`], and MUST NOT return an id it does not track.
/// * [`Eviction::pop_victim`] returns `None` only when nothing is tracked.
/// * The caller may follow a [`Eviction::pop_victim`] with [`Eviction::evicted`] and the
///   victim's key hash (the engine always does; the conformance suite does too), and a
///   policy must stay correct when it does not.
/// * Every method is O(1) amortized.
pub trait Eviction: Send + 'static {
    /// A short, stable name (`lru`, `s3fifo`, ...), as accepted by `--policy`.
    fn name(&self) -> &'static str;

    /// Tells the policy how many pages the cache holds when full; sizes internal queues and
    /// sketches. May be called at any time (the budget changes while running).
    fn set_capacity(&mut self, pages: usize);

    /// Starts tracking a page that was just stored. `hash` is a well-mixed hash of its key,
    /// stable across inserts of the same key (so ghost and frequency history can use it).
    fn insert(&mut self, id: SlotId, hash: u64);

    /// Records a hit on a tracked page.
    fn touch(&mut self, id: SlotId, hash: u64);

    /// Stops tracking a page that left for another reason (take, invalidate, overwrite).
    fn remove(&mut self, id: SlotId);

    /// Stops tracking a page that was evicted, but not by this policy (another policy chose
    /// it: see `adaptive.rs`). A policy that keeps a history of its victims (a ghost queue,
    /// non-resident LIRS entries) records this page as it would its own victim; the default
    /// just removes it.
    fn on_evicted(&mut self, id: SlotId) {
        self.remove(id);
    }

    /// Chooses a victim, stops tracking it and returns it; `None` only when nothing is
    /// tracked.
    fn pop_victim(&mut self) -> Option<SlotId>;

    /// Tells the policy the key hash of the victim its last [`Eviction::pop_victim`]
    /// returned. The caller knows the victim's key, so a policy that remembers its victims
    /// (a ghost) need not keep a hash per page to learn it. Called at most once per victim,
    /// before any other call; the default ignores it.
    fn evicted(&mut self, _hash: u64) {}

    /// The small (probationary) queue's share of the capacity, for a policy that chooses it
    /// while running (`s3fifo-lean`: 0.01, 0.1 or 1.0, which is LRU); `None` for the others.
    /// For stats and metrics: what the policy has learned of the workload.
    fn small_share(&self) -> Option<f64> {
        None
    }

    /// How many pages are tracked.
    fn len(&self) -> usize;

    /// True when nothing is tracked.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of heap the policy holds (queues, sketches, ghosts), for the metadata report.
    fn heap_bytes(&self) -> usize;

    /// Panics if an internal invariant is broken. For tests and fuzzing; O(n).
    fn validate(&self);
}

// The product: the default policy, its parts, and LRU, the reference.
mod fixed_share;
pub(crate) mod list;
mod lru;
mod mini_sim;
mod s3fifo_lean;
mod s3fifo_queues;
mod share_chooser;

// Research policies, compared with the default on the shared traces (`fallow trace`, the
// conformance suite): behind the cargo feature `research-policies`, which the `fallow`
// binary turns on for `fallow trace`; a pool can use them only in such a build.
#[cfg(feature = "research-policies")]
mod adaptive;
#[cfg(feature = "research-policies")]
mod ghost;
#[cfg(feature = "research-policies")]
mod lirs;
#[cfg(feature = "research-policies")]
mod s3fifo;
#[cfg(feature = "research-policies")]
mod sketch;
#[cfg(feature = "research-policies")]
mod wtinylfu;

#[cfg(test)]
mod conformance;

#[cfg(feature = "research-policies")]
pub use adaptive::Adaptive;
#[cfg(feature = "research-policies")]
pub use lirs::Lirs;
pub use lru::Lru;
#[cfg(feature = "research-policies")]
pub use s3fifo::S3Fifo;
pub use s3fifo_lean::S3FifoLean;
pub use share_chooser::ShareChooser;
#[cfg(feature = "research-policies")]
pub use wtinylfu::{WTinyLfu, WindowSizing};

/// Every name [`by_name`] accepts: `s3fifo-lean` and `lru`, and in a build with the
/// feature `research-policies` the others. `s3fifo-lean-1`, `-10` and `-100` are
/// `s3fifo-lean` with its small-queue share held at 1 %, 10 % or 100 % (LRU): the
/// policies its simulations compare.
#[cfg(feature = "research-policies")]
pub const POLICY_NAMES: &[&str] = &[
    "adaptive",
    "lru",
    "s3fifo",
    "wtinylfu",
    "lirs",
    "s3fifo-lean",
    "s3fifo-lean-1",
    "s3fifo-lean-10",
    "s3fifo-lean-100",
];

/// Every name [`by_name`] accepts (a build without the feature `research-policies`).
#[cfg(not(feature = "research-policies"))]
pub const POLICY_NAMES: &[&str] = &["lru", "s3fifo-lean"];

/// The policy a pool uses unless configured otherwise: `s3fifo-lean`, S3-FIFO in 2 bytes
/// of state per page whose small-queue share (1 %, 10 % or 100 %, i.e. LRU) miniature
/// simulations choose (see `s3fifo_lean.rs` and the trace results in `BENCHMARKS.md`).
pub const DEFAULT_POLICY: &str = "s3fifo-lean";

/// Builds the policies called `name` for the `shards` shards of one engine, each a cache of
/// `per_shard` pages; `None` for an unknown name. Policies that learn from the workload as
/// a whole (`s3fifo-lean`'s share) share that learning across the shards.
pub fn for_shards(name: &str, per_shard: usize, shards: usize) -> Option<Vec<Box<dyn Eviction>>> {
    if name == "s3fifo-lean" {
        let chooser = std::sync::Arc::new(ShareChooser::new(per_shard.saturating_mul(shards)));
        let policies = (0..shards)
            .map(|_| {
                Box::new(S3FifoLean::with_chooser(per_shard, chooser.clone())) as Box<dyn Eviction>
            })
            .collect();
        return Some(policies);
    }
    (0..shards).map(|_| by_name(name, per_shard)).collect()
}

/// Builds the policy called `name` for a cache of `capacity` pages; `None` for an unknown
/// name.
pub fn by_name(name: &str, capacity: usize) -> Option<Box<dyn Eviction>> {
    let policy: Box<dyn Eviction> = match name {
        "lru" => Box::new(Lru::new()),
        "s3fifo-lean" => Box::new(S3FifoLean::new(capacity)),
        #[cfg(feature = "research-policies")]
        _ => research_policy(name, capacity)?,
        #[cfg(not(feature = "research-policies"))]
        _ => return None,
    };
    Some(policy)
}

/// The research policies by name.
#[cfg(feature = "research-policies")]
fn research_policy(name: &str, capacity: usize) -> Option<Box<dyn Eviction>> {
    Some(match name {
        "adaptive" => Box::new(Adaptive::new(capacity)),
        "s3fifo" => Box::new(S3Fifo::new(capacity)),
        "wtinylfu" => Box::new(WTinyLfu::new(capacity)),
        "lirs" => Box::new(Lirs::new(capacity)),
        _ => {
            let share = fixed_share::FIXED_NAMES.iter().position(|&n| n == name)?;
            Box::new(fixed_share::FixedShare::new(capacity, fixed_share::SHARES[share]))
        }
    })
}
