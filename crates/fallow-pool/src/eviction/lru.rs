//! Exact LRU: the reference every other policy is measured against.
//!
//! One intrusive list over per-slot `prev`/`next` arrays ([`Links`]): a hit moves the slot
//! to the back, the victim is the front. Every operation is O(1) and there is no hash map;
//! the policy keeps 6 bytes per slot (two 24-bit links) and ignores key hashes.

use super::list::{Links, List};
use super::{Eviction, SlotId};

/// Least recently used first.
#[derive(Debug, Default)]
pub struct Lru {
    links: Links,
    /// Front = least recently used.
    list: List,
}

impl Lru {
    /// An empty LRU. Capacity does not matter to LRU; [`Eviction::set_capacity`] is a no-op.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Eviction for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }

    fn set_capacity(&mut self, _pages: usize) {}

    fn insert(&mut self, id: SlotId, _hash: u64) {
        self.links.ensure(id);
        debug_assert!(!self.list.is_linked(&self.links, id), "slot {id} is already tracked");
        self.list.push_back(&mut self.links, id);
    }

    fn touch(&mut self, id: SlotId, _hash: u64) {
        debug_assert!(self.list.is_linked(&self.links, id), "slot {id} is not tracked");
        self.list.move_to_back(&mut self.links, id);
    }

    fn remove(&mut self, id: SlotId) {
        debug_assert!(self.list.is_linked(&self.links, id), "slot {id} is not tracked");
        self.list.unlink(&mut self.links, id);
    }

    fn pop_victim(&mut self) -> Option<SlotId> {
        self.list.pop_front(&mut self.links)
    }

    fn len(&self) -> usize {
        self.list.len()
    }

    fn heap_bytes(&self) -> usize {
        self.links.heap_bytes()
    }

    fn validate(&self) {
        let mut seen = vec![false; self.links.slots()];
        self.list.validate(&self.links, |id| {
            assert!(!std::mem::replace(&mut seen[id as usize], true), "slot {id} listed twice");
        });
    }
}
