//! The fill words of one shard's same-filled pages, interned: a slot names its word by a
//! 4-byte id instead of holding the 8-byte word, which keeps a slot at 8 bytes.
//!
//! Few distinct words exist in practice (zero above all, then all-ones and repeated bytes),
//! so the table stays tiny; it is still exact for any number of them. An entry lives as
//! long as some slot names it.

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;

/// A dense id for one fill word of a shard; reused once no slot names it.
pub type FillId = u32;

#[derive(Debug, Clone, Copy)]
struct Fill {
    word: u64,
    /// Slots naming this word (0 for a free entry).
    refs: u32,
}

/// The fill-word table of one shard.
#[derive(Default)]
pub struct Fills {
    entries: Vec<Fill>,
    free: Vec<FillId>,
    by_word: HashTable<FillId>,
}

/// A well-mixed hash of a fill word.
fn word_hash(word: u64) -> u64 {
    crate::hashing::mix64(word.wrapping_add(0x9E37_79B9_7F4A_7C15))
}

impl Fills {
    /// The id of `word`, made if needed, with one more reference.
    pub fn add(&mut self, word: u64) -> FillId {
        let Fills { entries, free, by_word } = self;
        let eq = |&id: &FillId| entries[id as usize].word == word;
        let rehash = |&id: &FillId| word_hash(entries[id as usize].word);
        let id = match by_word.entry(word_hash(word), eq, rehash) {
            Entry::Occupied(found) => *found.get(),
            Entry::Vacant(slot) => {
                let fresh = Fill { word, refs: 0 };
                let id = crate::dense::place(entries, free, fresh);
                slot.insert(id);
                id
            }
        };
        self.entries[id as usize].refs += 1;
        id
    }

    /// The word of live entry `id`.
    pub fn word(&self, id: FillId) -> u64 {
        self.entries[id as usize].word
    }

    /// Drops one reference; the last one frees the entry.
    pub fn release(&mut self, id: FillId) {
        let e = &mut self.entries[id as usize];
        debug_assert!(e.refs > 0, "release of free fill {id}");
        e.refs -= 1;
        if e.refs == 0 {
            let hash = word_hash(e.word);
            if let Ok(found) = self.by_word.find_entry(hash, |&x| x == id) {
                found.remove();
            }
            self.free.push(id);
        }
    }

    /// Heap bytes: entries, free list and hash table (4-byte ids plus a control byte per
    /// bucket; buckets are capacity × 8/7).
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.entries.capacity() * size_of::<Fill>()
            + self.free.capacity() * size_of::<FillId>()
            + self.by_word.capacity() * 8 / 7 * (size_of::<FillId>() + 1)
    }

    /// Panics unless every entry's count equals `refs[id]` (counted from the slots) and the
    /// table, entries and free list agree.
    pub fn validate(&self, refs: &std::collections::HashMap<FillId, u32>) {
        let mut live = 0;
        for (id, e) in self.entries.iter().enumerate() {
            let id = id as FillId;
            let want = refs.get(&id).copied().unwrap_or(0);
            assert_eq!(e.refs, want, "fill {id}: {} references but {want} slots", e.refs);
            if e.refs > 0 {
                live += 1;
                let found = self.by_word.find(word_hash(e.word), |&x| x == id);
                assert_eq!(found, Some(&id), "fill {id} is not in the table");
            }
        }
        assert_eq!(live, self.by_word.len(), "fill table and entries disagree");
        assert_eq!(live + self.free.len(), self.entries.len(), "fill free list drifted");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_entry_per_word_freed_with_its_last_reference() {
        let mut t = Fills::default();
        let zero = t.add(0);
        assert_eq!(t.add(0), zero, "the same word shares its entry");
        let ones = t.add(u64::MAX);
        assert_ne!(ones, zero);
        assert_eq!((t.word(zero), t.word(ones)), (0, u64::MAX));
        t.release(zero);
        assert_eq!(t.word(zero), 0, "one reference is left");
        t.release(zero);
        t.validate(&[(ones, 1)].into());
        let other = t.add(0x4141_4141_4141_4141);
        assert_eq!(other, zero, "a freed id is reused");
        assert_eq!(t.word(other), 0x4141_4141_4141_4141);
        t.validate(&[(ones, 1), (other, 1)].into());
    }
}
