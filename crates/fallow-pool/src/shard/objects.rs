//! The objects of one shard: `(pool, object)` → a small dense id, the first page of the
//! object's list (the list itself is linked through the slots, see `mod.rs`) and how many
//! pages it has here.
//!
//! Slots name their object by this id instead of repeating the 12-byte `(pool, object)`,
//! and invalidating an object walks its list instead of the whole index. An entry lives
//! exactly as long as the object has a page in this shard.

use fallow_core::{ObjectId, PoolId};
use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

/// A dense id for one `(pool, object)` of a shard; reused once the object has no page left.
pub type ObjectRef = u32;

/// The end of a list, and "no slot".
pub const NIL: u32 = u32::MAX;

/// One object of a shard.
#[derive(Debug, Clone, Copy)]
pub struct Object {
    /// The object's number.
    pub object: ObjectId,
    /// Its pool.
    pub pool: PoolId,
    /// The first slot of its page list (`NIL` for a free entry).
    pub head: u32,
    /// Pages in its list (0 for a free entry).
    pub pages: u32,
    /// Its pool is persistent (its pages are never evicted). Kept here rather than in each
    /// slot: every page of an object shares its pool, hence its kind.
    pub persistent: bool,
}

/// The object table of one shard.
#[derive(Default)]
pub struct Objects {
    entries: Vec<Object>,
    free: Vec<ObjectRef>,
    by_key: HashTable<ObjectRef>,
}

/// A well-mixed hash of `(pool, object)`.
fn object_hash(pool: PoolId, object: ObjectId) -> u64 {
    super::mix64(object ^ u64::from(pool.0).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

impl Objects {
    /// The entry `r` (live or free).
    pub fn get(&self, r: ObjectRef) -> &Object {
        &self.entries[r as usize]
    }

    /// The entry `r`, to change its list.
    pub fn get_mut(&mut self, r: ObjectRef) -> &mut Object {
        &mut self.entries[r as usize]
    }

    /// The id of `(pool, object)`, if it has a page in this shard.
    pub fn find(&self, pool: PoolId, object: ObjectId) -> Option<ObjectRef> {
        let entries = &self.entries;
        self.by_key
            .find(object_hash(pool, object), |&r| {
                let e = &entries[r as usize];
                e.object == object && e.pool == pool
            })
            .copied()
    }

    /// The id of `(pool, object)`, made if it has none yet (with an empty list), for a
    /// pool that is `persistent` or not.
    pub fn find_or_add(&mut self, pool: PoolId, object: ObjectId, persistent: bool) -> ObjectRef {
        let Objects { entries, free, by_key } = self;
        let eq = |&r: &ObjectRef| {
            let e = &entries[r as usize];
            e.object == object && e.pool == pool
        };
        let rehash = |&r: &ObjectRef| {
            let e = &entries[r as usize];
            object_hash(e.pool, e.object)
        };
        match by_key.entry(object_hash(pool, object), eq, rehash) {
            Entry::Occupied(found) => {
                debug_assert_eq!(entries[*found.get() as usize].persistent, persistent);
                *found.get()
            }
            Entry::Vacant(slot) => {
                let fresh = Object { object, pool, head: NIL, pages: 0, persistent };
                let r = crate::dense::place(entries, free, fresh);
                slot.insert(r);
                r
            }
        }
    }

    /// Forgets `r`, whose list is empty.
    pub fn remove(&mut self, r: ObjectRef) {
        let e = self.entries[r as usize];
        debug_assert!(e.pages == 0 && e.head == NIL, "object {r} removed with pages");
        if let Ok(found) = self.by_key.find_entry(object_hash(e.pool, e.object), |&x| x == r) {
            found.remove();
        }
        self.free.push(r);
    }

    /// Live entries, with their ids.
    pub fn live(&self) -> impl Iterator<Item = (ObjectRef, &Object)> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.pages > 0)
            .map(|(r, e)| (r as ObjectRef, e))
    }

    /// Heap bytes: the entries, the free list and the hash table (4-byte ids plus one
    /// control byte per bucket; buckets are capacity × 8/7).
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.entries.capacity() * size_of::<Object>()
            + self.free.capacity() * size_of::<ObjectRef>()
            + self.by_key.capacity() * 8 / 7 * (size_of::<ObjectRef>() + 1)
    }

    /// Panics unless the hash table, the entries and the free list agree.
    pub fn validate(&self) {
        let live = self.live().count();
        assert_eq!(live, self.by_key.len(), "object table and entries disagree");
        assert_eq!(live + self.free.len(), self.entries.len(), "object free list drifted");
        for (r, e) in self.live() {
            assert_eq!(self.find(e.pool, e.object), Some(r), "object {r} not indexed");
            assert_ne!(e.head, NIL, "object {r} has pages but no list");
        }
        for &r in &self.free {
            assert_eq!(self.entries[r as usize].pages, 0, "free object {r} has pages");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_found_again_and_reused_after_removal() {
        let mut t = Objects::default();
        let a = t.find_or_add(PoolId(1), 7, false);
        let b = t.find_or_add(PoolId(2), 7, true);
        assert_ne!(a, b, "same object number in two pools");
        assert_eq!(t.find_or_add(PoolId(1), 7, false), a);
        assert!(t.get(b).persistent && !t.get(a).persistent);
        assert_eq!(t.find(PoolId(1), 7), Some(a));
        assert_eq!(t.find(PoolId(1), 8), None);
        t.remove(a);
        assert_eq!(t.find(PoolId(1), 7), None);
        let c = t.find_or_add(PoolId(3), 9, false);
        assert_eq!(c, a, "a freed id is reused");
        assert_eq!(t.find(PoolId(2), 7), Some(b));
    }
}
