//! LIRS (Jiang and Zhang, "LIRS: an efficient low inter-reference recency set replacement
//! policy to improve buffer cache performance", SIGMETRICS 2002).
//!
//! A page's inter-reference recency (IRR) is the number of other distinct pages touched
//! between its last two accesses. LIRS keeps the pages with a low IRR (LIR pages, 99 % of the
//! capacity) for good, and lets every other page (HIR) compete for the last 1 % through a
//! FIFO queue Q. A page earns LIR status when it is touched while it is still in the recency
//! stack S, that is, when its new IRR is below the recency of the oldest LIR page; that
//! oldest LIR page then loses its status. Because S also remembers pages that were evicted
//! ("ghosts", by key fingerprint only), a page that comes back soon enough returns as LIR,
//! which is what makes LIRS good on loops longer than the cache and immune to one-touch
//! scans.
//!
//! ```text
//!  stack S (recency order)                                queue Q (resident HIR pages)
//!  top ─► [L] [h] [g] [L] [g] [L] ◄─ bottom: always LIR    front ─► [h] [h] [h] ◄─ back
//!          L: LIR page   h: resident HIR page   g: ghost (evicted page, fingerprint only)
//!
//!  touch L            → top of S; prune if it was the bottom
//!  touch h in S       → top of S, leaves Q, becomes LIR; the bottom LIR page moves to the
//!                       back of Q as HIR (leaving S), then prune
//!  touch h not in S   → top of S, back of Q, stays HIR
//!  insert, key is g   → the ghost is revived as LIR, as for a touch of h in S
//!  insert, new key    → LIR while the LIR set is below its target, else h at the top of S
//!                       and the back of Q
//!  pop_victim         → front of Q; if it is still in S it stays there as a ghost
//!  prune              → drop h and g entries from the bottom of S until an L is there
//! ```
//!
//! # Memory
//! S holds *nodes*, not slots: when a page is evicted its node stays in S as a ghost while
//! the engine hands its slot id to another page. Per node: two `u32` links for S, two for Q
//! or the ghost FIFO (a node is never on both), the key's 32-bit fingerprint, the owning
//! slot and a status byte (25 bytes); per slot, its node (4 bytes); per ghost, one entry in a
//! fingerprint → node map (9 bytes, about 10 at the map's load factor). With a full cache
//! and the ghost bound reached that is about 29 + 2 × 35 ≈ 100 bytes per page of capacity,
//! more while `Vec`s and the map sit between doublings (87–173 bytes per page measured on
//! the shared traces); fewer ghosts cost less.
//!
//! Ghosts are found by the low 32 bits of the key hash, as in `ghost.rs`: a new key
//! whose fingerprint matches a ghost's (odds about ghosts / 2^32) is taken for a
//! re-reference and starts as LIR, which costs a little hit ratio, never correctness.

use super::list::{Links, List, Wide, NIL};
use super::{Eviction, SlotId};
use crate::prehashed::PrehashedMap;

/// Share of the capacity for resident HIR pages, in percent, at least one page: the paper
/// uses 1 %, as do libCacheSim (`hirs_ratio = 0.01`) and Caffeine's simulator
/// (`lirs.percent-hot = 0.99`).
const HIR_PERCENT: usize = 1;
/// At most this many ghosts per page of capacity; the oldest ghost is forgotten first.
/// Caffeine's simulator bounds ghosts this way (`lirs.non-resident-multiplier = 2.0`); the
/// paper leaves S unbounded. libCacheSim instead bounds all of S (LIR pages included) to
/// twice the capacity, which keeps about half as many ghosts: on the shared traces that
/// reproduces its published LIRS column to 0.002, while this bound misses 0.005 less on
/// average, better on 14 rows and worse on 11 (up to ±0.12 on small caches).
const GHOSTS_PER_PAGE: usize = 2;

/// Index of a node: an entry of S, Q or the ghost FIFO.
type NodeId = u32;

/// Where a node is. Each status implies the lists it is on, which `validate` checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Status {
    /// Unused, on the free list.
    Free,
    /// Resident LIR page: in S only.
    Lir,
    /// Resident HIR page in S and in Q.
    HirInStack,
    /// Resident HIR page pruned from S: in Q only.
    HirOutOfStack,
    /// Evicted HIR page still in S: in S, the ghost FIFO and `ghosts`; it has no slot.
    Ghost,
}

/// LIRS with a 1 % HIR queue and at most 2 × capacity ghosts.
#[derive(Debug, Default)]
pub struct Lirs {
    /// Links of S.
    s_links: Links<Wide>,
    /// The recency stack: front = bottom (least recent, always LIR), back = top.
    stack: List,
    /// Links shared by Q and the ghost FIFO: Q holds resident nodes, the FIFO ghosts.
    q_links: Links<Wide>,
    /// Resident HIR pages: front = next victim.
    queue: List,
    /// Ghosts in the order they were made: front = the next to be forgotten.
    ghost_fifo: List,
    /// Per node.
    status: Vec<Status>,
    /// Per node: low 32 bits of the key hash its page was inserted with.
    fingerprint: Vec<u32>,
    /// Per node: the slot of a resident page, `NIL` for ghosts and free nodes.
    slot: Vec<SlotId>,
    /// Per slot: its node, `NIL` when the slot is not tracked.
    node: Vec<NodeId>,
    /// Free node ids.
    free: Vec<NodeId>,
    /// Fingerprint → ghost node.
    ghosts: PrehashedMap<u32, NodeId>,
    lir_count: usize,
    /// The LIR set's size when the cache is full: capacity minus the HIR share.
    lir_target: usize,
    max_ghosts: usize,
}

impl Lirs {
    /// An empty LIRS for a cache of `capacity` pages.
    pub fn new(capacity: usize) -> Self {
        let mut s = Self::default();
        s.set_capacity(capacity);
        s
    }

    fn status(&self, n: NodeId) -> Status {
        self.status[n as usize]
    }

    fn set_status(&mut self, n: NodeId, status: Status) {
        self.status[n as usize] = status;
    }

    /// The node of tracked slot `id`.
    fn node_of(&self, id: SlotId) -> NodeId {
        let n = self.node.get(id as usize).copied().unwrap_or(NIL);
        debug_assert_ne!(n, NIL, "slot {id} is not tracked");
        n
    }

    /// A node for resident slot `id`, on no list yet.
    fn alloc(&mut self, id: SlotId, fp: u32, status: Status) -> NodeId {
        let n = self.free.pop().unwrap_or_else(|| {
            let n = self.status.len() as NodeId;
            self.status.push(Status::Free);
            self.fingerprint.push(0);
            self.slot.push(NIL);
            self.s_links.ensure(n);
            self.q_links.ensure(n);
            n
        });
        self.set_status(n, status);
        self.fingerprint[n as usize] = fp;
        self.bind(id, n);
        n
    }

    /// Records that slot `id` is the page of node `n`.
    fn bind(&mut self, id: SlotId, n: NodeId) {
        if self.node.len() <= id as usize {
            self.node.resize(id as usize + 1, NIL);
        }
        self.node[id as usize] = n;
        self.slot[n as usize] = id;
    }

    /// Returns node `n`, already off every list, to the free list.
    fn release(&mut self, n: NodeId) {
        self.set_status(n, Status::Free);
        self.slot[n as usize] = NIL;
        self.free.push(n);
    }

    /// Drops non-LIR entries from the bottom of S until an LIR page (or nothing) is there:
    /// only an LIR page can mark the recency that a HIR page must beat to become LIR.
    /// Amortized O(1): each entry leaves S at most once per push.
    fn prune(&mut self) {
        while let Some(n) = self.stack.front() {
            match self.status(n) {
                Status::Lir => break,
                Status::HirInStack => {
                    self.stack.unlink(&mut self.s_links, n);
                    self.set_status(n, Status::HirOutOfStack);
                }
                Status::Ghost => self.forget_ghost(n),
                s => unreachable!("node {n} in S has status {s:?}"),
            }
        }
    }

    /// Moves the bottom LIR page to the back of Q as a HIR page, then prunes. Returns false
    /// when S is empty (no LIR page is left).
    fn demote_bottom(&mut self) -> bool {
        let Some(n) = self.stack.pop_front(&mut self.s_links) else {
            return false;
        };
        debug_assert_eq!(self.status(n), Status::Lir, "the bottom of S is not LIR");
        self.set_status(n, Status::HirOutOfStack);
        self.lir_count -= 1;
        self.queue.push_back(&mut self.q_links, n);
        self.prune();
        true
    }

    /// Demotes bottom LIR pages until the LIR set fits its target, which a promotion or a
    /// capacity shrink may have overrun.
    fn demote_excess(&mut self) {
        while self.lir_count > self.lir_target && self.demote_bottom() {}
    }

    /// Node `n` just lost its page: remembers it as a ghost if it is in S, else frees it.
    fn evicted(&mut self, n: NodeId) {
        self.slot[n as usize] = NIL;
        if self.status(n) == Status::HirOutOfStack || self.max_ghosts == 0 {
            if self.status(n) == Status::HirInStack {
                self.stack.unlink(&mut self.s_links, n); // never the bottom: that is LIR
            }
            self.release(n);
            return;
        }
        self.set_status(n, Status::Ghost);
        self.ghost_fifo.push_back(&mut self.q_links, n);
        // Two ghosts can share a fingerprint (two keys collide, or the engine stored one key
        // twice): keep the newer one, which is higher in S.
        if let Some(older) = self.ghosts.insert(self.fingerprint[n as usize], n) {
            self.forget_ghost(older);
        }
        self.trim_ghosts();
    }

    /// Removes ghost `n` from S, the ghost FIFO and (if it is the map's entry) the map.
    fn forget_ghost(&mut self, n: NodeId) {
        debug_assert_eq!(self.status(n), Status::Ghost);
        self.stack.unlink(&mut self.s_links, n);
        self.ghost_fifo.unlink(&mut self.q_links, n);
        let fp = self.fingerprint[n as usize];
        if self.ghosts.get(&fp) == Some(&n) {
            self.ghosts.remove(&fp);
        }
        self.release(n);
    }

    /// Forgets the oldest ghosts until at most `max_ghosts` remain. A ghost is never the
    /// bottom of S, so S needs no pruning afterwards.
    fn trim_ghosts(&mut self) {
        while self.ghost_fifo.len() > self.max_ghosts {
            let Some(n) = self.ghost_fifo.front() else { break };
            self.forget_ghost(n);
        }
    }

    /// Makes the resident HIR page at node `n`, already at the top of S and off Q, an LIR
    /// page, demoting the bottom LIR page if the LIR set overflows.
    fn promote(&mut self, n: NodeId) {
        self.set_status(n, Status::Lir);
        self.lir_count += 1;
        self.demote_excess();
    }
}

impl Eviction for Lirs {
    fn name(&self) -> &'static str {
        "lirs"
    }

    fn set_capacity(&mut self, pages: usize) {
        let hir = (pages * HIR_PERCENT / 100).max(1);
        // The LIR set is re-balanced lazily: by the next promotion or `pop_victim`.
        self.lir_target = pages.saturating_sub(hir);
        self.max_ghosts = pages.saturating_mul(GHOSTS_PER_PAGE);
        self.trim_ghosts();
    }

    fn insert(&mut self, id: SlotId, hash: u64) {
        debug_assert!(
            self.node.get(id as usize).is_none_or(|&n| n == NIL),
            "slot {id} is already tracked"
        );
        let fp = hash as u32;
        if let Some(n) = self.ghosts.remove(&fp) {
            // Evicted while still in S: its IRR is below the bottom LIR page's recency.
            self.ghost_fifo.unlink(&mut self.q_links, n);
            self.stack.move_to_back(&mut self.s_links, n);
            self.bind(id, n);
            self.promote(n);
        } else if self.lir_count < self.lir_target {
            // The LIR set is not full (cold start, growth): every new page is LIR.
            let n = self.alloc(id, fp, Status::Lir);
            self.stack.push_back(&mut self.s_links, n);
            self.lir_count += 1;
        } else {
            let n = self.alloc(id, fp, Status::HirInStack);
            self.stack.push_back(&mut self.s_links, n);
            self.queue.push_back(&mut self.q_links, n);
        }
        // Only matters when there is no LIR page at all (capacity below 2): S must not keep
        // a HIR page at its bottom.
        self.prune();
    }

    fn touch(&mut self, id: SlotId, _hash: u64) {
        // The fingerprint recorded at insert is the one the ghost will need; `_hash` is the
        // same hash.
        let n = self.node_of(id);
        match self.status(n) {
            Status::Lir => self.stack.move_to_back(&mut self.s_links, n),
            Status::HirInStack => {
                self.stack.move_to_back(&mut self.s_links, n);
                self.queue.unlink(&mut self.q_links, n);
                self.promote(n);
            }
            Status::HirOutOfStack => {
                self.stack.push_back(&mut self.s_links, n);
                self.queue.move_to_back(&mut self.q_links, n);
                self.set_status(n, Status::HirInStack);
            }
            s => unreachable!("slot {id} is tracked by node {n} with status {s:?}"),
        }
        // The touched page may have been the bottom of S.
        self.prune();
    }

    fn remove(&mut self, id: SlotId) {
        // A page that was taken or invalidated leaves without a ghost: its key's next put
        // is new data, not a re-reference that LIRS should reward.
        let n = self.node_of(id);
        match self.status(n) {
            Status::Lir => {
                self.stack.unlink(&mut self.s_links, n);
                self.lir_count -= 1;
            }
            Status::HirInStack => {
                self.stack.unlink(&mut self.s_links, n);
                self.queue.unlink(&mut self.q_links, n);
            }
            Status::HirOutOfStack => self.queue.unlink(&mut self.q_links, n),
            s => unreachable!("slot {id} is tracked by node {n} with status {s:?}"),
        }
        self.node[id as usize] = NIL;
        self.release(n);
        self.prune();
    }

    fn on_evicted(&mut self, id: SlotId) {
        // Another policy evicted this page: it becomes what it would be had LIRS evicted it
        // (a ghost if it is in S), so its next reference is judged by its real recency.
        let n = self.node_of(id);
        match self.status(n) {
            Status::Lir => {
                // Off the LIR set, still in S, not on Q: `evicted` turns it into a ghost.
                self.lir_count -= 1;
                self.set_status(n, Status::HirInStack);
            }
            Status::HirInStack | Status::HirOutOfStack => self.queue.unlink(&mut self.q_links, n),
            s => unreachable!("slot {id} is tracked by node {n} with status {s:?}"),
        }
        self.node[id as usize] = NIL;
        self.evicted(n);
        // The page may have been the bottom of S, which must be LIR.
        self.prune();
    }

    fn pop_victim(&mut self) -> Option<SlotId> {
        self.demote_excess();
        if self.queue.is_empty() {
            // Every tracked page is LIR (the engine may track more pages than the capacity,
            // or the capacity is tiny): the oldest LIR page goes through Q.
            self.demote_bottom();
        }
        let n = self.queue.pop_front(&mut self.q_links)?;
        let id = self.slot[n as usize];
        self.node[id as usize] = NIL;
        self.evicted(n);
        Some(id)
    }

    fn len(&self) -> usize {
        self.lir_count + self.queue.len()
    }

    fn heap_bytes(&self) -> usize {
        let map_entry = std::mem::size_of::<(u32, NodeId)>() + 1; // bucket + control byte
        self.s_links.heap_bytes()
            + self.q_links.heap_bytes()
            + self.status.capacity() * std::mem::size_of::<Status>()
            + (self.fingerprint.capacity() + self.slot.capacity()) * 4
            + (self.node.capacity() + self.free.capacity()) * 4
            + self.ghosts.capacity() * map_entry
    }

    fn validate(&self) {
        let mut on = vec![0u8; self.status.len()]; // bit 0: S, 1: Q, 2: ghost FIFO
        let mut lir = 0;
        self.stack.validate(&self.s_links, |n| {
            on[n as usize] |= 1;
            lir += usize::from(self.status(n) == Status::Lir);
        });
        if let Some(bottom) = self.stack.front() {
            assert_eq!(self.status(bottom), Status::Lir, "the bottom of S is not LIR");
        }
        assert_eq!(lir, self.lir_count, "LIR count drifted");
        self.queue.validate(&self.q_links, |n| on[n as usize] |= 2);
        self.ghost_fifo.validate(&self.q_links, |n| on[n as usize] |= 4);
        assert!(self.ghost_fifo.len() <= self.max_ghosts, "more ghosts than the bound");
        assert_eq!(self.ghost_fifo.len(), self.ghosts.len(), "ghost map and FIFO differ");
        for (&fp, &n) in &self.ghosts {
            assert_eq!(self.status(n), Status::Ghost, "ghost map entry {n} is not a ghost");
            assert_eq!(self.fingerprint[n as usize], fp, "ghost {n} is filed under another key");
        }
        let mut free = 0;
        for (n, (&status, &lists)) in self.status.iter().zip(&on).enumerate() {
            let expected = match status {
                Status::Free => 0,
                Status::Lir => 1,
                Status::HirInStack => 1 | 2,
                Status::HirOutOfStack => 2,
                Status::Ghost => 1 | 4,
            };
            assert_eq!(lists, expected, "node {n} ({status:?}) is on the wrong lists");
            let slot = self.slot[n];
            match status {
                Status::Free | Status::Ghost => {
                    assert_eq!(slot, NIL, "node {n} ({status:?}) still owns a slot");
                    free += usize::from(status == Status::Free);
                }
                _ => assert_eq!(self.node[slot as usize] as usize, n, "slot {slot} lost node {n}"),
            }
        }
        assert_eq!(free, self.free.len(), "free list drifted");
        let tracked = self.node.iter().filter(|&&n| n != NIL).count();
        assert_eq!(tracked, self.len(), "slots disagree with S and Q");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(key: u64) -> u64 {
        xxhash_rust::xxh3::xxh3_64(&key.to_le_bytes())
    }

    /// Capacity 100: 99 LIR pages (keys 0..99 in slots 0..99) and one HIR page (key 99 in
    /// slot 99), which is also in S.
    fn full_cache() -> Lirs {
        let mut p = Lirs::new(100);
        for id in 0..100 {
            p.insert(id, hash(u64::from(id)));
        }
        assert_eq!(p.lir_count, 99);
        assert_eq!(p.queue.len(), 1);
        p.validate();
        p
    }

    #[test]
    fn a_ghost_comes_back_as_lir_and_demotes_the_bottom() {
        let mut p = full_cache();
        assert_eq!(p.pop_victim(), Some(99), "the only HIR page leaves first");
        assert_eq!(p.ghosts.len(), 1, "it was in S, so it stays as a ghost");
        p.insert(99, hash(99));
        p.validate();
        assert_eq!(p.lir_count, 99, "the revived page is LIR, the bottom one was demoted");
        assert!(p.ghosts.is_empty());
        assert_eq!(p.pop_victim(), Some(0), "the demoted bottom page (key 0) is the victim");
        assert!(p.ghosts.is_empty(), "a demoted page has left S, so it leaves no ghost");
        p.validate();
    }

    #[test]
    fn touching_a_hir_page_in_s_promotes_it() {
        let mut p = full_cache();
        p.touch(99, hash(99));
        p.validate();
        assert_eq!(p.status(p.node_of(99)), Status::Lir);
        assert_eq!(p.pop_victim(), Some(0));
    }

    #[test]
    fn removed_pages_leave_no_ghost() {
        let mut p = full_cache();
        p.remove(99);
        p.validate();
        assert!(p.ghosts.is_empty());
        p.insert(99, hash(99));
        assert_eq!(p.status(p.node_of(99)), Status::HirInStack, "a new page, not a re-reference");
        p.remove(0); // the bottom LIR page
        p.validate();
        assert_eq!(p.lir_count, 98);
    }

    #[test]
    fn only_lir_pages_still_yield_victims_in_lru_order() {
        let mut p = Lirs::new(100);
        for id in 0..10 {
            p.insert(id, hash(u64::from(id)));
        }
        p.touch(0, hash(0));
        let order: Vec<SlotId> = std::iter::from_fn(|| p.pop_victim()).collect();
        assert_eq!(order, [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]);
        p.validate();
    }

    #[test]
    fn ghosts_stay_within_twice_the_capacity() {
        let mut p = Lirs::new(10);
        let mut slot_of_key = std::collections::HashMap::new();
        let mut key_of_slot = [0u64; 10];
        let mut next_slot = 0;
        // Keys with ever larger reuse distances, so S fills with ghosts above old LIR pages.
        for i in 0..10_000u64 {
            let key = if i % 3 == 0 { i % 7 } else { i };
            if let Some(&id) = slot_of_key.get(&key) {
                p.touch(id, hash(key));
                continue;
            }
            let id = if next_slot < 10 {
                next_slot += 1;
                next_slot - 1
            } else {
                let id = p.pop_victim().expect("a full cache has a victim");
                slot_of_key.remove(&key_of_slot[id as usize]);
                id
            };
            key_of_slot[id as usize] = key;
            slot_of_key.insert(key, id);
            p.insert(id, hash(key));
            assert!(p.ghosts.len() <= 20);
        }
        p.validate();
        assert_eq!(p.ghosts.len(), 20, "the bound was reached and held");
        p.set_capacity(3);
        p.validate();
        assert!(p.ghosts.len() <= 6);
    }
}
