//! Where a content's bytes are: in the frame its id names, unless an exception says
//! otherwise.
//!
//! A new content takes the number of its frame as its id whenever no content holds that
//! number already, so for almost every content the place is implicit and costs nothing:
//! no place field, no frame → content table. The exceptions carry the `EXCEPTION` flag:
//!
//! * a compressed content (its frame went back to the arena; its place is its blob in the
//!   store's `blobs`, which needs no entry here). If one index entry names
//!   it, it takes a new virtual id, which the compressor writes into that entry, so that
//!   its frame's number is free for the next content put there (`compress.rs`); if
//!   several do, it keeps its id;
//! * a persistent page a shrink moved to another frame (it keeps its id: the index entries
//!   naming it are not rewritten);
//! * a new content whose frame's number is still held by one of those (it takes a
//!   *virtual* id, 2³⁰ and up, from `by_id.rs`): since compressed contents named once are
//!   renamed, only a shared compressed content or a moved page holds a frame's number
//!   this way.
//!
//! The last two are in another frame than their id's: each has an entry in `by_id` (id →
//! frame) and in `by_frame` (frame → id, so that a frame's owner can be found).
//!
//! A content whose bytes are gone is marked `DEAD` instead.
//!
//! Why it is sound: a frame's number is held by at most one content at a time (the `LIVE`
//! flag of that id), and a content names another frame only through `by_id`. A released
//! segment's number is not reused while a content's bytes are in one of its frames
//! (`arena.rs`, `Draining`); a content whose *id* is in a released segment keeps its id,
//! and a new content in a frame of the reused segment then takes a virtual id.

use std::collections::HashMap;

use super::by_id::VIRTUAL_BASE;
use super::meta::{Meta, DEAD, EXCEPTION, LIVE};
use super::{ContentId, Place, Store};
use crate::arena::FrameId;

/// The contents whose place is not their id's frame.
#[derive(Default)]
pub struct Exceptions {
    /// The frame of each content whose bytes are in another frame than its id's. An
    /// `EXCEPTION` content without an entry here is compressed: its blob is the store's
    /// `blobs` entry, so it needs no second one.
    by_id: HashMap<ContentId, Place>,
    /// Frame number → the content in it, for contents in `by_id` with a frame.
    by_frame: HashMap<u32, ContentId>,
}

impl Exceptions {
    /// Heap bytes of the two maps (capacity, a control byte per bucket).
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.by_id.capacity() * (size_of::<(ContentId, Place)>() + 1)
            + self.by_frame.capacity() * (size_of::<(u32, ContentId)>() + 1)
    }
}

impl Store {
    /// Where content `id`'s bytes are.
    #[inline]
    pub(super) fn place(&self, id: ContentId) -> Place {
        let flags = self.meta.flags(id);
        if flags & DEAD != 0 {
            Place::Dead
        } else if flags & EXCEPTION != 0 {
            self.exceptions.by_id.get(&id).copied().unwrap_or(Place::Compressed)
        } else {
            Place::Frame(FrameId::from_raw(id))
        }
    }

    /// Records that content `id`'s bytes are now at `place`.
    pub(super) fn set_place(&mut self, id: ContentId, place: Place) {
        if self.meta.has(id, EXCEPTION) {
            if let Some(Place::Frame(old)) = self.exceptions.by_id.remove(&id) {
                self.exceptions.by_frame.remove(&old.raw());
            }
            self.meta.clear(id, EXCEPTION);
        }
        match place {
            Place::Dead => self.meta.set(id, DEAD),
            Place::Frame(f) if f.raw() == id => {}
            Place::Frame(f) => {
                self.exceptions.by_id.insert(id, place);
                self.exceptions.by_frame.insert(f.raw(), id);
                self.meta.set(id, EXCEPTION);
            }
            Place::Compressed => self.meta.set(id, EXCEPTION),
        }
    }

    /// The content whose bytes are in `frame`, if any.
    pub(super) fn owner(&self, frame: FrameId) -> Option<ContentId> {
        // The content with the frame's number, if its bytes are there: then no other
        // content's can be. Shrink scans call this for every frame, so the map comes second.
        let id = frame.raw();
        let own = self.meta.covers(id) && Meta::in_own_frame(self.meta.flags(id));
        if own {
            return Some(id);
        }
        if self.exceptions.by_frame.is_empty() {
            return None;
        }
        self.exceptions.by_frame.get(&id).copied()
    }

    /// An id for a new content in `frame`: the frame's number, unless a content holds it;
    /// then a virtual id, if one is left.
    pub(super) fn id_for(&mut self, frame: FrameId) -> Option<ContentId> {
        let id = frame.raw();
        if !self.meta.has(id, LIVE) {
            return Some(id);
        }
        self.virtual_id()
    }

    /// A virtual id no content holds: a freed one, else a new one; `None` when all 2³⁰ are
    /// held (`by_id::VIRTUAL_IDS`).
    pub(super) fn virtual_id(&mut self) -> Option<ContentId> {
        if let Some(id) = self.free_virtual.pop() {
            return Some(id);
        }
        let id = self.contents.push_virtual()?;
        let same = self.meta.push_virtual();
        debug_assert_eq!(Some(id), same, "content records and flags name the same ids");
        Some(id)
    }

    /// Panics unless the exception maps agree with each other and with the flags.
    pub(super) fn validate_places(&self) {
        let mut framed = 0;
        for (id, _) in self.blobs.iter() {
            assert!(self.meta.has(id, EXCEPTION), "compressed content {id} not flagged");
            assert!(!self.exceptions.by_id.contains_key(&id), "compressed content {id} framed");
        }
        for (&id, &place) in &self.exceptions.by_id {
            assert!(self.meta.has(id, LIVE), "free content {id} has an exception");
            assert!(self.meta.has(id, EXCEPTION), "content {id}: exception not flagged");
            assert!(!self.meta.has(id, DEAD), "dead content {id} has an exception");
            match place {
                Place::Frame(f) => {
                    assert_ne!(f.raw(), id, "content {id}: an exception to its own frame");
                    assert_eq!(self.exceptions.by_frame.get(&f.raw()), Some(&id));
                    framed += 1;
                }
                Place::Compressed => panic!("content {id}: compressed, but in the frame map"),
                Place::Dead => panic!("content {id}: a dead exception"),
            }
        }
        assert_eq!(framed, self.exceptions.by_frame.len(), "frame owners without exception");
        for id in self.meta.ids() {
            let flagged = self.meta.has(id, EXCEPTION);
            let listed = self.exceptions.by_id.contains_key(&id) || self.blobs.contains(id);
            assert_eq!(flagged, listed, "content {id}");
            if id >= VIRTUAL_BASE && self.meta.has(id, LIVE) {
                assert!(flagged || self.meta.has(id, DEAD), "virtual id {id} names no frame");
            }
        }
        for &id in &self.free_virtual {
            assert!(id >= VIRTUAL_BASE && !self.meta.has(id, LIVE), "free virtual id {id}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::FRAMES_PER_SEGMENT;
    use crate::content::Digest;
    use crate::store::{Compression, InternOptions, ShrinkReport};
    use fallow_core::{DedupScope, PAGE_SIZE};

    const DOMAIN: DedupScope = DedupScope::Domain(fallow_core::TrustDomain(0));

    /// A page unique to `seed` that lz4 shrinks well.
    fn page(seed: u64) -> Vec<u8> {
        let mut p = vec![(seed % 251) as u8; PAGE_SIZE];
        p[..8].copy_from_slice(&seed.to_le_bytes());
        p
    }

    fn put(store: &mut Store, seed: u64, opts: InternOptions) -> ContentId {
        let p = page(seed);
        store.intern_now(&p, Digest::of(&p, DOMAIN), opts).expect("room")
    }

    fn reads(store: &Store, id: ContentId, seed: u64) -> bool {
        let mut out = vec![0u8; PAGE_SIZE];
        store.copy_out(id, &mut out, 0).is_some() && out == page(seed)
    }

    /// Puts pages (seeds from 1000) until no resident free frame is left, so that the next
    /// put takes a frame that compression freed (those come last, `Arena::alloc`); returns
    /// their ids with one reference each, for `validate`.
    fn use_resident_frames(store: &mut Store) -> HashMap<ContentId, u32> {
        let mut ids = HashMap::new();
        for seed in 1000.. {
            if store.arena.resident_free_frames() == 0 {
                break;
            }
            ids.insert(put(store, seed, InternOptions::default()), 1);
        }
        ids
    }

    /// `fillers` and `more`, as one reference map.
    fn refs(
        fillers: &HashMap<ContentId, u32>,
        more: &[(ContentId, u32)],
    ) -> HashMap<ContentId, u32> {
        fillers.iter().map(|(&k, &v)| (k, v)).chain(more.iter().copied()).collect()
    }

    #[test]
    fn a_compressed_content_named_once_takes_a_new_id_and_its_frame_keeps_its_number() {
        let mut store = Store::new(2 * FRAMES_PER_SEGMENT * PAGE_SIZE);
        let compressible = InternOptions { pinned: false, compressible: true };
        let a = put(&mut store, 1, compressible);
        let frame = FrameId::from_raw(a);
        assert_eq!(store.compress(a), Compression::Left, "a new content counts as just read");
        let Compression::Renamed(v) = store.compress(a) else { panic!("not renamed") };
        assert!(v >= VIRTUAL_BASE, "renamed to {v}");
        assert_eq!(store.place(v), Place::Compressed);
        assert!(!store.meta.has(a, LIVE), "the old id is free");
        assert_eq!(store.arena.discarded_frames(), 1, "its frame went back to the OS");
        assert!(reads(&store, v, 1));
        let fillers = use_resident_frames(&mut store);
        let b = put(&mut store, 2, InternOptions::default());
        assert_eq!(b, a, "the frame goes back with its number free");
        assert_eq!((store.place(b), store.owner(frame)), (Place::Frame(frame), Some(b)));
        store.validate(&refs(&fillers, &[(v, 1), (b, 1)]));
        // The dedup table follows the rename: the same bytes again share the new id.
        assert_eq!(put(&mut store, 1, compressible), v);
        store.validate(&refs(&fillers, &[(v, 2), (b, 1)]));
        store.release(v);
        store.release(v);
        store.validate(&refs(&fillers, &[(b, 1)]));
        let c = put(&mut store, 3, compressible);
        assert!(c < VIRTUAL_BASE, "frame numbers first, not the freed virtual id: {c}");
        let Compression::Renamed(w) = (store.compress(c), store.compress(c)).1 else {
            panic!("not renamed")
        };
        assert_eq!(w, v, "freed virtual ids are reused");
        store.validate(&refs(&fillers, &[(b, 1), (w, 1)]));
    }

    #[test]
    fn with_every_virtual_id_held_compression_keeps_ids_and_a_displaced_put_finds_it_full() {
        let mut store = Store::new(2 * FRAMES_PER_SEGMENT * PAGE_SIZE);
        store.contents.cap_virtual(1);
        store.meta.cap_virtual(1);
        let compressible = InternOptions { pinned: false, compressible: true };
        let (a, b) = (put(&mut store, 1, compressible), put(&mut store, 2, compressible));
        let _ = (store.compress(a), store.compress(b));
        let Compression::Renamed(v) = store.compress(a) else { panic!("not renamed") };
        assert_eq!(store.compress(b), Compression::Kept, "no virtual id left: b keeps its id");
        assert!(reads(&store, v, 1) && reads(&store, b, 2));
        let fillers = use_resident_frames(&mut store);
        store.validate(&refs(&fillers, &[(v, 1), (b, 1)]));
        // The arena hands out b's frame next, whose number b holds, and no id is left:
        // full, as if the budget were spent (the engine evicts and tries again).
        let p = page(3);
        let full = store.intern_now(&p, Digest::of(&p, DOMAIN), InternOptions::default());
        assert!(full.is_err(), "a displaced page with no id left");
        assert_eq!(store.arena.discarded_frames(), 2, "the frame went back as it came");
        store.validate(&refs(&fillers, &[(v, 1), (b, 1)]));
        store.release(v);
        let c = put(&mut store, 3, InternOptions::default());
        assert_eq!(c, v, "the freed virtual id serves the displaced page");
        let d = put(&mut store, 4, InternOptions::default());
        assert_eq!(d, a, "a's frame comes next, under its own number");
        assert!(reads(&store, b, 2) && reads(&store, c, 3) && reads(&store, d, 4));
        store.validate(&refs(&fillers, &[(b, 1), (c, 1), (d, 1)]));
    }

    #[test]
    fn a_compressed_content_named_twice_keeps_its_id_and_a_page_put_in_its_frame_takes_another() {
        let mut store = Store::new(2 * FRAMES_PER_SEGMENT * PAGE_SIZE);
        let compressible = InternOptions { pinned: false, compressible: true };
        let a = put(&mut store, 1, compressible);
        assert_eq!(put(&mut store, 1, compressible), a, "shared");
        let frame = FrameId::from_raw(a);
        assert_eq!(store.place(a), Place::Frame(frame), "a new content's id is its frame");
        assert_eq!(store.compress(a), Compression::Left, "a new content counts as just read");
        assert_eq!(store.compress(a), Compression::Kept);
        assert_eq!(store.place(a), Place::Compressed);
        let fillers = use_resident_frames(&mut store);
        let b = put(&mut store, 2, InternOptions::default());
        assert!(b >= VIRTUAL_BASE, "frame {a} is free again but its number is taken: {b}");
        assert_eq!((store.place(b), store.owner(frame)), (Place::Frame(frame), Some(b)));
        assert!(reads(&store, a, 1) && reads(&store, b, 2));
        store.validate(&refs(&fillers, &[(a, 2), (b, 1)]));
        store.release(a);
        store.release(a);
        store.validate(&refs(&fillers, &[(b, 1)]));
        store.release(b);
        store.validate(&fillers);
        assert_eq!(put(&mut store, 3, InternOptions::default()), a, "the number is free again");
        let again = put(&mut store, 4, compressible);
        assert_ne!(again, b, "frame numbers first");
        store.validate(&refs(&fillers, &[(a, 1), (again, 1)]));
    }

    #[test]
    fn a_page_moved_by_a_shrink_keeps_its_id_after_its_segment_is_reused() {
        let segment = FRAMES_PER_SEGMENT as u64;
        let mut store = Store::new(2 * FRAMES_PER_SEGMENT * PAGE_SIZE);
        let pinned = InternOptions { pinned: true, compressible: false };
        // Segment 0 full, segment 1 holding a few pages, one persistent page in each: the
        // shrink releases the segment with fewer pages and moves its persistent one.
        let mut ids: Vec<(ContentId, u64)> = Vec::new();
        for seed in 0..segment + 8 {
            let persistent = seed == 3 || seed == segment + 3;
            let opts = if persistent { pinned } else { InternOptions::default() };
            ids.push((put(&mut store, seed, opts), seed));
        }
        let (moved, moved_seed) = ids[segment as usize + 3];
        assert_eq!(FrameId::from_raw(moved).segment(), 1);
        // Down to one segment: segment 1 goes, its persistent page moves into segment 0
        // (an ephemeral page there is dropped to make room), the others are dropped.
        store.set_budget(FRAMES_PER_SEGMENT * PAGE_SIZE);
        let mut plan = store.shrink_plan();
        let mut report = ShrinkReport::default();
        while store.shrink_step(&mut plan, 8, &mut report).1 {}
        assert_eq!((report.segments_released, report.frames_moved), (1, 1));
        let Place::Frame(to) = store.place(moved) else { panic!("the persistent page is kept") };
        assert_eq!((to.segment(), store.owner(to)), (0, Some(moved)));
        assert!(reads(&store, moved, moved_seed));
        let refs: HashMap<ContentId, u32> = ids.iter().map(|&(id, _)| (id, 1)).collect();
        store.validate(&refs);
        // The index lets go of the dropped pages; segment 1's number is free again.
        let mut kept = HashMap::new();
        for &(id, seed) in &ids {
            if store.is_live(id) {
                assert!(reads(&store, id, seed));
                kept.insert(id, 1);
            } else {
                store.release(id);
            }
        }
        store.validate(&kept);
        // Back to two segments: the new one reuses number 1, and the frame whose number
        // the moved page holds gets a page under another id.
        store.set_budget(2 * FRAMES_PER_SEGMENT * PAGE_SIZE);
        let mut seed = 10_000;
        while store.has_room() {
            let id = put(&mut store, seed, InternOptions::default());
            assert_ne!(id, moved, "a held number is never given again");
            kept.insert(id, 1);
            seed += 1;
        }
        assert!(kept.keys().any(|&id| id >= VIRTUAL_BASE), "frame {moved} went to a virtual id");
        assert!(reads(&store, moved, moved_seed));
        store.validate(&kept);
    }
}
