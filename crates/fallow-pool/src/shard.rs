//! One shard of the page index: key → slot, the slots themselves, and the eviction policy
//! over this shard's ephemeral pages.
//!
//! The index is a `BTreeMap` ordered by `(pool, object, index)`, so that invalidating an
//! object or a pool is a range walk instead of a second per-object index. Slots are dense
//! ids, reused, so that policies can keep their per-page state in flat arrays.
//!
//! # Locking
//! Each shard sits in its own mutex in the engine; every method here runs with it held.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;

use fallow_core::{ObjectId, PageKey, PoolId};

use crate::eviction::{Eviction, SlotId};
use crate::store::ContentId;

/// What an index entry holds in place of page bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    /// Every 8-byte word of the page is this word: no frame is used.
    Fill(u64),
    /// The page's bytes are this content in the store.
    Content(ContentId),
}

/// One page in the index.
#[derive(Debug, Clone, Copy)]
pub struct Slot {
    /// The page's key (needed to find the index entry again when evicting).
    pub key: PageKey,
    /// Where its bytes are.
    pub value: Value,
    /// Persistent pages are never handed to the eviction policy.
    pub persistent: bool,
}

/// A [`Slot`] as stored: 32 bytes instead of the 48 an `Option<Slot>` takes, because the
/// key's pool, the value's kind and the persistence flag share one word.
#[derive(Debug, Clone, Copy, Default)]
struct Packed {
    object: u64,
    index: u64,
    /// The fill word, or the content id.
    word: u64,
    pool: u32,
    /// `TAG_FREE`, `TAG_FILL` or `TAG_CONTENT`, plus `PERSISTENT`.
    tag: u8,
}

const TAG_FREE: u8 = 0;
const TAG_FILL: u8 = 1;
const TAG_CONTENT: u8 = 2;
const TAG_KIND: u8 = 3;
const PERSISTENT: u8 = 0x80;

impl Packed {
    fn new(slot: Slot) -> Self {
        let (word, kind) = match slot.value {
            Value::Fill(w) => (w, TAG_FILL),
            Value::Content(id) => (u64::from(id), TAG_CONTENT),
        };
        let tag = kind | if slot.persistent { PERSISTENT } else { 0 };
        Self { object: slot.key.object, index: slot.key.index, word, pool: slot.key.pool.0, tag }
    }

    fn get(&self) -> Option<Slot> {
        let value = match self.tag & TAG_KIND {
            TAG_FILL => Value::Fill(self.word),
            TAG_CONTENT => Value::Content(self.word as ContentId),
            _ => return None,
        };
        let key = PageKey::new(PoolId(self.pool), self.object, self.index);
        Some(Slot { key, value, persistent: self.tag & PERSISTENT != 0 })
    }

    fn take(&mut self) -> Option<Slot> {
        let slot = self.get();
        self.tag = TAG_FREE;
        slot
    }
}

/// An index shard.
pub struct Shard {
    index: BTreeMap<PageKey, SlotId>,
    slots: Vec<Packed>,
    free_slots: Vec<SlotId>,
    policy: Box<dyn Eviction>,
}

impl Shard {
    /// An empty shard whose ephemeral pages are managed by `policy`.
    pub fn new(policy: Box<dyn Eviction>) -> Self {
        Self { index: BTreeMap::new(), slots: Vec::new(), free_slots: Vec::new(), policy }
    }

    /// Pages in this shard.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// Tells the policy how many pages this shard holds when full.
    pub fn set_capacity(&mut self, pages: usize) {
        self.policy.set_capacity(pages);
    }

    /// The slot holding `key`, if any.
    pub fn lookup(&self, key: &PageKey) -> Option<(SlotId, Slot)> {
        let &id = self.index.get(key)?;
        self.slots[id as usize].get().map(|s| (id, s))
    }

    /// Records a hit on an ephemeral page.
    pub fn touch(&mut self, id: SlotId, hash: u64) {
        // Read the tag alone: a hit is the hot path, and unpacking the whole slot is not needed.
        let tag = self.slots[id as usize].tag;
        if tag & TAG_KIND != TAG_FREE && tag & PERSISTENT == 0 {
            self.policy.touch(id, hash);
        }
    }

    /// Adds a page. The caller guarantees `slot.key` is not in the index.
    pub fn insert(&mut self, slot: Slot, hash: u64) -> SlotId {
        let id = match self.free_slots.pop() {
            Some(id) => {
                self.slots[id as usize] = Packed::new(slot);
                id
            }
            None => {
                self.slots.push(Packed::new(slot));
                (self.slots.len() - 1) as SlotId
            }
        };
        let old = self.index.insert(slot.key, id);
        debug_assert!(old.is_none(), "{:?} inserted twice", slot.key);
        if !slot.persistent {
            self.policy.insert(id, hash);
        }
        id
    }

    /// Removes a page by slot id and returns it.
    pub fn remove(&mut self, id: SlotId) -> Slot {
        let slot = self.slots[id as usize].take().expect("remove of a free slot");
        self.index.remove(&slot.key);
        if !slot.persistent {
            self.policy.remove(id);
        }
        self.free_slots.push(id);
        slot
    }

    /// Asks the policy for a victim and removes it. `None` when no ephemeral page is left.
    pub fn evict_one(&mut self) -> Option<Slot> {
        let id = self.policy.pop_victim()?;
        let slot = self.slots[id as usize].take().expect("policy returned a free slot");
        self.index.remove(&slot.key);
        self.free_slots.push(id);
        Some(slot)
    }

    /// Slot ids of every page of `pool` whose object is in `objects`.
    pub fn range(&self, pool: PoolId, objects: RangeInclusive<ObjectId>) -> Vec<SlotId> {
        let lo = PageKey::new(pool, *objects.start(), 0);
        let hi = PageKey::new(pool, *objects.end(), u64::MAX);
        self.index.range(lo..=hi).map(|(_, &id)| id).collect()
    }

    /// Every live slot, for validation and stats.
    pub fn slots(&self) -> impl Iterator<Item = (SlotId, Slot)> + '_ {
        self.slots.iter().enumerate().filter_map(|(i, s)| s.get().map(|s| (i as SlotId, s)))
    }

    /// Heap bytes of this shard's metadata: index, slots and policy.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        // A B-tree leaf holds up to 11 entries and is at least half full; count the
        // entries at a typical two-thirds fill, plus the node headers.
        let per_entry = size_of::<(PageKey, SlotId)>();
        let index = self.index.len() * per_entry * 3 / 2;
        index
            + self.slots.capacity() * size_of::<Packed>()
            + self.free_slots.capacity() * size_of::<SlotId>()
            + self.policy.heap_bytes()
    }

    /// Panics unless the index, the slots and the policy agree.
    pub fn validate(&self) {
        let mut ephemeral = 0;
        let mut live = 0;
        for (id, slot) in self.slots() {
            live += 1;
            assert_eq!(self.index.get(&slot.key), Some(&id), "{:?} not indexed", slot.key);
            if !slot.persistent {
                ephemeral += 1;
            }
        }
        assert_eq!(live, self.index.len(), "index and slots disagree");
        assert_eq!(live + self.free_slots.len(), self.slots.len(), "slot free list drifted");
        assert_eq!(ephemeral, self.policy.len(), "policy tracks the wrong number of pages");
        self.policy.validate();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_slot_takes_32_bytes_and_round_trips() {
        assert_eq!(std::mem::size_of::<Packed>(), 32);
        let key = PageKey::new(PoolId(7), u64::MAX, 3);
        for (value, persistent) in
            [(Value::Fill(u64::MAX), true), (Value::Content(ContentId::MAX), false)]
        {
            let mut p = Packed::new(Slot { key, value, persistent });
            let back = p.take().unwrap();
            assert_eq!((back.key, back.value, back.persistent), (key, value, persistent));
            assert!(p.get().is_none(), "a taken slot is free");
        }
    }
}
