//! The bytes of compressed contents, by content id: where each content's record sits in
//! the [`BlobSpace`], in a table that grows without ever moving what it holds.
//!
//! A `HashMap` doubles by rehashing every entry at once, and the compressor inserts with
//! every shard lock held: at 57,344 compressed pages the doubling held every get for ~4 ms
//! (a 256 MiB engine; `compress_cold(32)` passes), and a larger cache waits
//! longer. Most compressed contents have virtual ids (`compress.rs` renames a content that
//! one entry names), which are dense from [`VIRTUAL_BASE`]: their blobs sit in a
//! [`Chunked`] table, never moved as it grows. The few compressed contents that keep a
//! frame number as their id (several entries name them) go in a small map.
//!
//! The bytes themselves are records in the blob space's slabs (`blob_space.rs`), which
//! the table's owner cleans ([`Blobs::clean`]): a cleaner asks the table whether a record
//! is still its content's, and moves it if so.

use std::collections::HashMap;

use super::blob_space::{BlobPos, BlobSpace, HEADER};
use super::by_id::VIRTUAL_BASE;
use super::chunked::Chunked;
use super::ContentId;

/// Compressed contents' bytes by content id.
#[derive(Default)]
pub struct Blobs {
    /// By `id - VIRTUAL_BASE`: where a compressed content's record is, or nothing.
    virtual_ids: Chunked<Option<BlobPos>>,
    /// Records of contents whose id is a frame number.
    framed: HashMap<ContentId, BlobPos>,
    space: BlobSpace,
    len: usize,
}

impl Blobs {
    /// The blob of content `id`, if it has one.
    pub fn get(&self, id: ContentId) -> Option<&[u8]> {
        self.position(id).map(|pos| self.space.get(pos).1)
    }

    /// True when content `id` has a blob.
    pub fn contains(&self, id: ContentId) -> bool {
        self.position(id).is_some()
    }

    /// Gives content `id` (which has none) a copy of `blob`; false, and nothing stored,
    /// when no memory can be had for it.
    pub fn insert(&mut self, id: ContentId, blob: &[u8]) -> bool {
        debug_assert!(!self.contains(id), "content {id} had a blob");
        let Some(pos) = self.space.append(id, blob) else { return false };
        self.set_position(id, Some(pos));
        self.len += 1;
        true
    }

    /// Makes sure the next [`Blobs::insert`] of a blob of `len` bytes finds room; false
    /// when no memory can be had.
    pub fn reserve(&mut self, len: usize) -> bool {
        self.space.reserve(HEADER + len)
    }

    /// Takes content `id`'s blob away; its length, if it had one.
    pub fn remove(&mut self, id: ContentId) -> Option<usize> {
        let pos = self.position(id)?;
        self.set_position(id, None);
        self.len -= 1;
        Some(self.space.free(pos))
    }

    /// Moves the live records of sparse slabs together, at most `max_slabs` of them,
    /// while the slabs' holes exceed an eighth of the live bytes; returns the slabs
    /// cleaned. Costs a copy of each live record of each slab cleaned.
    pub fn clean(&mut self, max_slabs: usize) -> usize {
        let mut cleaned = 0;
        while cleaned < max_slabs && self.space.over_waste() {
            let Some(victim) = self.space.pick_victim() else { break };
            if !self.evacuate(victim) {
                break;
            }
            cleaned += 1;
        }
        cleaned
    }

    /// The next slab in use (the open one too) and the contents whose records live in it:
    /// dropping them, and moving the rest ([`Blobs::evacuate`]), gives the slab back.
    pub fn next_slab(&mut self) -> Option<(usize, Vec<ContentId>)> {
        let slab = self.space.next_slab()?;
        let ids = self.live_records(slab).into_iter().map(|(_, id)| id).collect();
        Some((slab, ids))
    }

    /// Gives the memory of the spare slabs back to the OS.
    pub fn release_spares(&mut self) {
        self.space.discard_spares();
    }

    /// Slabs in use.
    pub fn slabs_in_use(&self) -> usize {
        self.space.slabs_in_use()
    }

    /// Moves the records still live in slab `slab` to the open slab (another one, if
    /// `slab` is open), which lets `slab` go; false if no memory could be had for them.
    pub fn evacuate(&mut self, slab: usize) -> bool {
        for (pos, id) in self.live_records(slab) {
            let Some(new) = self.space.relocate(pos) else { return false };
            self.set_position(id, Some(new));
        }
        true
    }

    /// The records of slab `slab` that are still their content's: position, id.
    fn live_records(&self, slab: usize) -> Vec<(BlobPos, ContentId)> {
        let records = self.space.records(slab);
        records.into_iter().filter(|&(pos, id)| self.position(id) == Some(pos)).collect()
    }

    /// Compressed contents.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes of the slabs that hold the blobs: what the budget is charged for them.
    pub fn resident_bytes(&self) -> usize {
        self.space.resident_bytes()
    }

    /// Bytes of the blobs themselves.
    pub fn payload_bytes(&self) -> usize {
        self.space.live_bytes() - self.len * HEADER
    }

    /// Every content with a blob, and the blob.
    pub fn iter(&self) -> impl Iterator<Item = (ContentId, &[u8])> + '_ {
        let virtual_ids = self
            .virtual_ids
            .iter()
            .enumerate()
            .filter_map(|(pos, at)| at.map(|at| (VIRTUAL_BASE + pos as ContentId, at)));
        self.framed
            .iter()
            .map(|(&id, &at)| (id, at))
            .chain(virtual_ids)
            .map(|(id, at)| (id, self.space.get(at).1))
    }

    /// Heap bytes of the tables (not of the blobs' slabs, which the budget counts).
    pub fn heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(ContentId, BlobPos)>() + 1;
        self.virtual_ids.heap_bytes() + self.framed.capacity() * entry + self.space.heap_bytes()
    }

    /// Panics unless every record the table names is its content's, and the space's counts
    /// agree with the records named.
    pub fn validate(&self) {
        let mut live = Vec::with_capacity(self.len);
        let virtual_ids = self
            .virtual_ids
            .iter()
            .enumerate()
            .filter_map(|(pos, at)| at.map(|at| (VIRTUAL_BASE + pos as ContentId, at)));
        for (id, pos) in self.framed.iter().map(|(&id, &at)| (id, at)).chain(virtual_ids) {
            let (named, blob) = self.space.get(pos);
            assert_eq!(named, id, "the record at {pos:?} is not content {id}'s");
            live.push((pos, blob.len()));
        }
        assert_eq!(live.len(), self.len, "compressed contents counted");
        self.space.validate(&live);
    }

    fn position(&self, id: ContentId) -> Option<BlobPos> {
        match virtual_pos(id) {
            Some(pos) => *self.virtual_ids.get(pos)?,
            None => self.framed.get(&id).copied(),
        }
    }

    fn set_position(&mut self, id: ContentId, at: Option<BlobPos>) {
        match (virtual_pos(id), at) {
            (Some(pos), _) => {
                self.virtual_ids.extend_to(pos + 1);
                self.virtual_ids[pos] = at;
            }
            (None, Some(at)) => {
                self.framed.insert(id, at);
            }
            (None, None) => {
                self.framed.remove(&id);
            }
        }
    }
}

/// The position of virtual id `id`; `None` for a frame number.
fn virtual_pos(id: ContentId) -> Option<usize> {
    Some(id.checked_sub(VIRTUAL_BASE)? as usize)
}

#[cfg(test)]
mod tests {
    use super::super::chunked::CHUNK;
    use super::*;

    #[test]
    fn virtual_ids_and_frame_numbers_keep_their_blobs_apart() {
        let mut b = Blobs::default();
        let far = VIRTUAL_BASE + 3 * CHUNK as ContentId + 5;
        assert!(b.insert(7, &[1]) && b.insert(VIRTUAL_BASE, &[2]) && b.insert(far, &[3]));
        assert_eq!((b.len(), b.virtual_ids.len()), (3, 3 * CHUNK + 6), "up to the highest id");
        assert_eq!(
            (b.get(7), b.get(VIRTUAL_BASE), b.get(far)),
            (Some(&[1][..]), Some(&[2][..]), Some(&[3][..]))
        );
        assert!(!b.contains(8) && !b.contains(VIRTUAL_BASE + 1) && !b.contains(far + CHUNK as u32));
        let mut all: Vec<_> = b.iter().map(|(id, blob)| (id, blob[0])).collect();
        all.sort_unstable();
        assert_eq!(all, [(7, 1), (VIRTUAL_BASE, 2), (far, 3)]);
        b.validate();
        assert_eq!(b.remove(VIRTUAL_BASE), Some(1));
        assert_eq!((b.remove(VIRTUAL_BASE), b.len()), (None, 2));
        assert_eq!(b.remove(7), Some(1));
        assert_eq!((b.len(), b.payload_bytes(), b.get(far)), (1, 1, Some(&[3][..])));
        b.validate();
    }

    #[test]
    fn cleaning_packs_the_survivors_of_churn_and_gives_the_rest_back() {
        use super::super::blob_space::{SLAB_BYTES, SPARES};
        let blob = |id: ContentId| vec![id as u8; 500 + (id as usize * 37) % 3000];
        let mut b = Blobs::default();
        let ids: Vec<ContentId> = (0..4000).map(|i| VIRTUAL_BASE + i).collect();
        ids.iter().for_each(|&id| assert!(b.insert(id, &blob(id))));
        let full = b.resident_bytes();
        // Seven in eight go, scattered over every slab: no slab empties by itself.
        let kept: Vec<ContentId> = ids.iter().copied().filter(|id| id % 8 == 0).collect();
        ids.iter().filter(|id| *id % 8 != 0).for_each(|&id| assert!(b.remove(id).is_some()));
        assert_eq!(b.resident_bytes(), full, "every slab still holds a survivor");
        let cleaned = b.clean(usize::MAX);
        assert!(cleaned > 0);
        b.validate();
        for &id in &kept {
            assert_eq!(b.get(id), Some(&blob(id)[..]), "content {id} after cleaning");
        }
        let live = b.payload_bytes() + kept.len() * HEADER;
        assert!(
            b.resident_bytes() <= live + live / 8 + (2 + SPARES) * SLAB_BYTES,
            "{} bytes held for {live} live after cleaning (from {full})",
            b.resident_bytes()
        );
        assert_eq!(b.clean(usize::MAX), 0, "nothing more to clean");
    }

    mod model {
        use std::collections::HashMap;

        use proptest::prelude::*;

        use super::super::super::blob_space::{HEADER, SLAB_BYTES};
        use super::*;

        #[derive(Debug, Clone)]
        enum Op {
            /// A blob of this length for this id (a frame number below 64, else virtual).
            Insert(u32, usize),
            Remove(u32),
            Clean(usize),
            /// The next slab in turn: its records dropped or, with `true`, moved out.
            GiveBack(bool),
        }

        fn id(n: u32) -> ContentId {
            if n < 64 {
                n
            } else {
                VIRTUAL_BASE + n
            }
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                6 => (0u32..400, 1usize..3600).prop_map(|(n, len)| Op::Insert(n, len)),
                4 => (0u32..400).prop_map(Op::Remove),
                1 => (0usize..4).prop_map(Op::Clean),
                1 => any::<bool>().prop_map(Op::GiveBack),
            ]
        }

        /// A blob's bytes, from its id and an insertion count, so that a stale copy shows.
        fn bytes(id: ContentId, nth: u32, len: usize) -> Vec<u8> {
            (0..len).map(|i| (i as u32 ^ id ^ nth.wrapping_mul(0x9e37)) as u8).collect()
        }

        proptest! {
            /// Against a `HashMap` of id → bytes: every blob reads back as last inserted,
            /// through appends, frees, cleaning and slabs given back; the space never holds
            /// more than the live records, their holes within the cleaning's allowance
            /// after a clean, and what the spares and open slab add.
            #[test]
            fn agrees_with_a_map(ops in prop::collection::vec(op(), 1..300)) {
                let mut b = Blobs::default();
                let mut model: HashMap<ContentId, Vec<u8>> = HashMap::new();
                let mut nth = 0u32;
                for op in ops {
                    match op {
                        Op::Insert(n, len) => {
                            let id = id(n);
                            if let std::collections::hash_map::Entry::Vacant(slot) = model.entry(id) {
                                nth += 1;
                                let blob = bytes(id, nth, len);
                                prop_assert!(b.reserve(len) && b.insert(id, &blob));
                                slot.insert(blob);
                            }
                        }
                        Op::Remove(n) => {
                            let id = id(n);
                            prop_assert_eq!(b.remove(id), model.remove(&id).map(|v| v.len()));
                        }
                        Op::Clean(max) => {
                            b.clean(max);
                        }
                        Op::GiveBack(evacuate) => {
                            if let Some((slab, ids)) = b.next_slab() {
                                if evacuate {
                                    prop_assert!(b.evacuate(slab));
                                } else {
                                    for id in ids {
                                        prop_assert!(b.remove(id).is_some());
                                        model.remove(&id);
                                    }
                                }
                                prop_assert!(b.live_records(slab).is_empty());
                            }
                        }
                    }
                    b.validate();
                    prop_assert_eq!(b.len(), model.len());
                    let live: usize = model.values().map(|v| HEADER + v.len()).sum();
                    prop_assert_eq!(b.payload_bytes() + b.len() * HEADER, live);
                }
                for (id, blob) in &model {
                    prop_assert_eq!(b.get(*id), Some(&blob[..]));
                }
                b.clean(usize::MAX);
                let live: usize = model.values().map(|v| HEADER + v.len()).sum();
                let allowed = live + live / 8 + (2 + super::super::super::blob_space::SPARES) * SLAB_BYTES;
                prop_assert!(b.resident_bytes() <= allowed, "{} for {live}", b.resident_bytes());
                for (id, blob) in &model {
                    prop_assert_eq!(b.get(*id), Some(&blob[..]));
                }
            }
        }
    }
}
