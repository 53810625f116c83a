//! The objects of one shard: `(pool, object)` → a small dense id, the first page of the
//! object's list (the list itself is linked through the slots, see `mod.rs`) and how many
//! pages it has here.
//!
//! Slots name their object by this id instead of repeating the 12-byte `(pool, object)`,
//! and invalidating an object walks its list instead of the whole index. An entry lives
//! exactly as long as the object has a page in this shard.

use fallow_core::{ObjectId, PoolId};

use crate::id_table::IdTable;

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

/// An [`Object`] as stored: 20 bytes (the object number as two halves, so the entry
/// aligns to 4; the kind in the top bit of the page count). One-page objects pay this
/// for each page, so it counts.
#[derive(Debug, Clone, Copy)]
struct Packed {
    object: [u32; 2],
    pool: PoolId,
    head: u32,
    /// Pages, and `PERSISTENT`.
    pages: u32,
}

/// The bit of `Packed::pages` that marks a persistent pool's object. An object has fewer
/// pages in a shard than a shard has slots (below 2³¹: `MAX_BUDGET_BYTES`).
const PERSISTENT: u32 = 1 << 31;

impl Packed {
    fn new(o: Object) -> Self {
        debug_assert!(o.pages < PERSISTENT, "object page count over 2^31");
        let persistent = if o.persistent { PERSISTENT } else { 0 };
        let object = [o.object as u32, (o.object >> 32) as u32];
        Self { object, pool: o.pool, head: o.head, pages: o.pages | persistent }
    }

    fn get(&self) -> Object {
        Object {
            object: u64::from(self.object[0]) | (u64::from(self.object[1]) << 32),
            pool: self.pool,
            head: self.head,
            pages: self.pages & !PERSISTENT,
            persistent: self.pages & PERSISTENT != 0,
        }
    }

    fn is(&self, pool: PoolId, object: ObjectId) -> bool {
        self.object == [object as u32, (object >> 32) as u32] && self.pool == pool
    }

    fn pages(&self) -> u32 {
        self.pages & !PERSISTENT
    }
}

/// The object table of one shard.
#[derive(Default)]
pub struct Objects {
    entries: Vec<Packed>,
    free: Vec<ObjectRef>,
    by_key: IdTable,
    /// Objects to expect at most (one per page of a full shard; [`Objects::expect`]).
    expected: usize,
}

/// A well-mixed hash of `(pool, object)`.
fn object_hash(pool: PoolId, object: ObjectId) -> u64 {
    super::mix64(object ^ u64::from(pool.0).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

impl Objects {
    /// Says how many objects the shard may hold at most (as many as its pages, when each
    /// is an object of its own): the table and the entries grow to it, not past it
    /// ([`crate::dense::grow_capped`]). Shards of a few large objects never get near it.
    pub fn expect(&mut self, objects: usize) {
        self.expected = objects;
        self.by_key.expect(objects);
    }

    /// The entry `r` (live or free).
    pub fn get(&self, r: ObjectRef) -> Object {
        self.entries[r as usize].get()
    }

    /// True when entry `r` is `(pool, object)`: the lookup of every get, without
    /// unpacking the entry.
    pub fn is(&self, r: ObjectRef, pool: PoolId, object: ObjectId) -> bool {
        self.entries[r as usize].is(pool, object)
    }

    /// True when entry `r` belongs to a persistent pool.
    pub fn persistent(&self, r: ObjectRef) -> bool {
        self.entries[r as usize].pages & PERSISTENT != 0
    }

    /// Makes `head` the first slot of `r`'s list.
    pub fn set_head(&mut self, r: ObjectRef, head: u32) {
        self.entries[r as usize].head = head;
    }

    /// Counts one more page of `r`.
    pub fn add_page(&mut self, r: ObjectRef) {
        debug_assert!(self.entries[r as usize].pages() < PERSISTENT - 1, "object {r} is full");
        self.entries[r as usize].pages += 1;
    }

    /// Counts one page fewer of `r`, and forgets `r` when that was its last one.
    pub fn remove_page(&mut self, r: ObjectRef) {
        let e = &mut self.entries[r as usize];
        debug_assert!(e.pages() > 0, "object {r} has no page to remove");
        e.pages -= 1;
        if e.pages() == 0 {
            self.remove(r);
        }
    }

    /// The id of `(pool, object)`, if it has a page in this shard.
    pub fn find(&self, pool: PoolId, object: ObjectId) -> Option<ObjectRef> {
        let entries = &self.entries;
        self.by_key.find(object_hash(pool, object), |r| entries[r as usize].is(pool, object))
    }

    /// The id of `(pool, object)`, made if it has none yet (with an empty list), for a
    /// pool that is `persistent` or not.
    pub fn find_or_add(&mut self, pool: PoolId, object: ObjectId, persistent: bool) -> ObjectRef {
        if let Some(r) = self.find(pool, object) {
            debug_assert_eq!(self.persistent(r), persistent);
            return r;
        }
        let fresh = Packed::new(Object { object, pool, head: NIL, pages: 0, persistent });
        let Objects { entries, free, by_key, expected } = self;
        let r = crate::dense::place_capped(entries, free, fresh, *expected);
        by_key.insert_unique(object_hash(pool, object), r, |x| {
            let e = entries[x as usize].get();
            object_hash(e.pool, e.object)
        });
        r
    }

    /// Forgets `r`, whose list is empty.
    fn remove(&mut self, r: ObjectRef) {
        let e = self.entries[r as usize].get();
        debug_assert!(e.pages == 0 && e.head == NIL, "object {r} removed with pages");
        self.by_key.remove(object_hash(e.pool, e.object), |x| x == r);
        self.free.push(r);
    }

    /// Live entries, with their ids.
    pub fn live(&self) -> impl Iterator<Item = (ObjectRef, Object)> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| e.pages() > 0)
            .map(|(r, e)| (r as ObjectRef, e.get()))
    }

    /// Heap bytes: the entries, the free list and the hash table.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.entries.capacity() * size_of::<Packed>()
            + self.free.capacity() * size_of::<ObjectRef>()
            + self.by_key.heap_bytes()
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
            assert_eq!(self.entries[r as usize].pages(), 0, "free object {r} has pages");
        }
        let entries = &self.entries;
        self.by_key.validate(|x| {
            let e = entries[x as usize].get();
            object_hash(e.pool, e.object)
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_packs_into_20_bytes_and_round_trips() {
        assert_eq!(std::mem::size_of::<Packed>(), 20);
        for (object, persistent, pages) in [(u64::MAX, true, PERSISTENT - 1), (7, false, 0)] {
            let o = Object { object, pool: PoolId(u32::MAX), head: 3, pages, persistent };
            let back = Packed::new(o).get();
            assert_eq!(
                (back.object, back.pool, back.head, back.pages, back.persistent),
                (object, PoolId(u32::MAX), 3, pages, persistent)
            );
        }
    }

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
        t.set_head(a, 0);
        t.add_page(a);
        t.set_head(a, NIL);
        t.remove_page(a);
        assert_eq!(t.find(PoolId(1), 7), None);
        let c = t.find_or_add(PoolId(3), 9, false);
        assert_eq!(c, a, "a freed id is reused");
        assert_eq!(t.find(PoolId(2), 7), Some(b));
    }
}
