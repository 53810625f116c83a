//! Compression of cold contents, one at a time, as the compressor's walk over the index
//! entries finds them (`Inner::compress_pass`).
//!
//! A content compressed under its own id would keep its frame's number after the frame
//! went back to the arena, so every page later put in that frame would take a *virtual*
//! id and become an exception: ~40 B more a page and a map lookup on every get, for as long
//! as the compressed page lives (measured: a get of such pages 840–900 ns against 520 ns).
//! So a content that one entry names, in its own frame, is compressed under a new virtual
//! id instead, which the walk writes into that entry: the compressed content is the
//! exception (it is one anyway, its bytes being in a blob), and its frame is reused under
//! its own number. A content that several entries name keeps its id: the walk cannot
//! rewrite entries it has not reached, and such contents are few.

use fallow_core::PAGE_SIZE;

use super::by_id::VIRTUAL_BASE;
use super::meta::{COMPRESSIBLE, HASHED, LIVE};
use super::{ContentId, Place, Store};

/// What [`Store::compress`] did with a content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Nothing: not live, not compressible, not in a frame, read since the walk last came
    /// by, or its bytes do not shrink enough.
    Left,
    /// Compressed under its own id.
    Kept,
    /// Compressed under this new id, which the one entry naming the content must name from
    /// now on (the old id is free: its frame is back in the arena).
    Renamed(ContentId),
}

impl Store {
    /// Compresses content `id` if it stayed cold: not read since the last call for it (a
    /// clock with one reference bit; a new content counts as just read). The caller holds
    /// every shard lock (no get is copying the frame) and passes the id of an index entry,
    /// which it rewrites when the content is [`Compression::Renamed`].
    pub fn compress(&mut self, id: ContentId) -> Compression {
        if !self.meta.has(id, LIVE) || !self.meta.has(id, COMPRESSIBLE) {
            return Compression::Left;
        }
        let Place::Frame(frame) = self.place(id) else { return Compression::Left };
        if !self.arena.is_live(frame) || self.meta.take_read(id) {
            return Compression::Left;
        }
        let packed = lz4_flex::block::compress(self.arena.bytes(frame));
        // Worth it only if it frees at least an eighth of a frame.
        if packed.len() > PAGE_SIZE - PAGE_SIZE / 8 {
            self.meta.clear(id, COMPRESSIBLE);
            return Compression::Left;
        }
        // Room for the blob first: past this point nothing can fail.
        if !self.blobs.reserve(packed.len()) {
            return Compression::Left;
        }
        self.move_pin(id, Some(frame), None);
        self.arena.free_and_discard(frame);
        let alone = frame.raw() == id && self.meta.refs(id) == 1;
        let kept = if alone { self.rename(id) } else { id };
        self.set_place(kept, Place::Compressed);
        let stored = self.blobs.insert(kept, &packed);
        debug_assert!(stored, "the blob's room was reserved");
        self.refresh_frame_limit();
        if kept != id {
            Compression::Renamed(kept)
        } else {
            Compression::Kept
        }
    }

    /// Moves content `id` (one reference, its bytes already out of its frame) to a new
    /// virtual id with the same record and flags, frees `id`, and returns the new id; or
    /// keeps `id` when no virtual id is left.
    fn rename(&mut self, id: ContentId) -> ContentId {
        let Some(new) = self.virtual_id() else { return id };
        debug_assert!(new >= VIRTUAL_BASE, "renamed to frame number {new}");
        self.contents[new] = self.contents[id];
        self.meta.start(new, self.meta.flags(id));
        if self.meta.has(id, HASHED) {
            let key = self.contents[id].key();
            let contents = &self.contents;
            if !self.dedup.replace(key, id, new, |i| contents[i].key()) {
                // Not the table's entry for its hash (an identical page took it): neither is
                // the new id.
                self.meta.clear(new, HASHED);
            }
        }
        self.meta.drop_ref(id);
        self.meta.forget(id);
        new
    }

    /// Packs the compressed pages' records together where freed ones left holes (at most
    /// `max_slabs` slabs copied; see `blob_space.rs`), so that the budget they are
    /// charged stays close to their bytes. The caller holds the store's write lock, which
    /// keeps every reader of the blobs out.
    pub fn clean_blobs(&mut self, max_slabs: usize) -> usize {
        let cleaned = self.blobs.clean(max_slabs);
        if cleaned > 0 {
            self.refresh_frame_limit();
        }
        cleaned
    }

    /// Decompresses content `id`'s blob into `out`; false if it has none or it is corrupt.
    pub(super) fn decompress(&self, id: ContentId, out: &mut [u8]) -> bool {
        let Some(blob) = self.blobs.get(id) else { return false };
        matches!(lz4_flex::block::decompress_into(blob, out), Ok(n) if n == PAGE_SIZE)
    }
}
