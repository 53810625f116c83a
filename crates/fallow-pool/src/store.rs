//! The content store: page bytes in arena frames (or compressed), their checksums, and the
//! dedup table that lets identical pages share one frame.
//!
//! Index entries name a [`ContentId`], never a frame, so compaction and compression can
//! move bytes by updating one place. A content is reference-counted by the index entries
//! that name it; it is freed when the last one goes.
//!
//! ```text
//!  index entry ──ContentId──▶ Content { place: Frame(f) | Compressed | Dead, refs, crc, hash }
//!                                          │
//!  dedup: hash(domain, bytes) ──▶ ContentId    owner[f] = ContentId (for compaction)
//! ```
//!
//! A `Dead` content lost its bytes (the budget shrank under it, or its checksum failed):
//! every get through it misses, and its slot is reused once the last entry lets go.
//!
//! # Locking
//! A `Store` is guarded by the engine's store mutex, taken after a shard mutex
//! (`docs/concurrency.md`). Every method here runs with that mutex held.

use std::collections::HashMap;

use fallow_core::PAGE_SIZE;

use crate::arena::{Arena, ArenaFull, FrameId, FRAMES_PER_SEGMENT};
use crate::content::Digest;

/// A stored page's bytes, shared by every index entry with the same content.
pub type ContentId = u32;

/// Where a content's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Frame(FrameId),
    /// lz4 bytes in `Store::blobs`.
    Compressed,
    /// The bytes are gone; reads miss.
    Dead,
}

const PINNED: u8 = 1; // a persistent entry refers to it: never dropped to shrink
const COMPRESSIBLE: u8 = 2; // its first pool asked for background compression
const ACCESSED: u8 = 4; // read since the compressor last looked (second chance)
const HASHED: u8 = 8; // `hash` is valid and (maybe) in the dedup table

struct Content {
    hash: u128,
    place: Place,
    refs: u32,
    crc: u32,
    flags: u8,
}

/// How a new content should be kept.
#[derive(Debug, Clone, Copy, Default)]
pub struct InternOptions {
    /// A persistent entry will refer to it.
    pub pinned: bool,
    /// Compress it in the background once cold.
    pub compressible: bool,
}

/// The outcome of reading a content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// The bytes were copied and their checksum matched.
    Ok,
    /// The bytes were dropped earlier (shrink or corruption).
    Dead,
    /// The checksum did not match: the content is now dead, and the read is a miss.
    Corrupt,
}

/// What a shrink did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShrinkReport {
    /// Segments returned to the OS.
    pub segments_released: usize,
    /// Contents whose bytes were dropped (their keys now miss).
    pub contents_dropped: usize,
    /// Contents moved to another frame so their segment could go.
    pub frames_moved: usize,
    /// Frames the budget could not shed because persistent pages hold them.
    pub pinned_over_budget: usize,
}

/// Page bytes, their checksums and the dedup table.
pub struct Store {
    arena: Arena,
    /// Frame index → the content in it (`u32::MAX` when free). For compaction.
    owner: Vec<ContentId>,
    contents: Vec<Content>,
    free_contents: Vec<ContentId>,
    dedup: HashMap<u128, ContentId>,
    blobs: HashMap<ContentId, Box<[u8]>>,
    blob_bytes: usize,
    budget_bytes: usize,
    /// The compressor's clock hand over `contents`.
    hand: usize,
    corruptions: u64,
    dropped: u64,
}

const NO_OWNER: ContentId = ContentId::MAX;

impl Store {
    /// An empty store that may hold `budget_bytes` of page data.
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            arena: Arena::new(budget_bytes / PAGE_SIZE),
            owner: Vec::new(),
            contents: Vec::new(),
            free_contents: Vec::new(),
            dedup: HashMap::new(),
            blobs: HashMap::new(),
            blob_bytes: 0,
            budget_bytes,
            hand: 0,
            corruptions: 0,
            dropped: 0,
        }
    }

    fn refresh_frame_limit(&mut self) {
        let blob_frames = self.blob_bytes.div_ceil(PAGE_SIZE);
        self.arena.set_limit((self.budget_bytes / PAGE_SIZE).saturating_sub(blob_frames));
    }

    /// True when one more page fits in the budget.
    pub fn has_room(&self) -> bool {
        self.arena.has_room()
    }

    /// Finds an identical content to share, or copies `page` into a new frame.
    ///
    /// `Err` when the budget is spent: the caller evicts and calls again.
    pub fn intern(
        &mut self,
        page: &[u8],
        digest: Digest,
        opts: InternOptions,
    ) -> Result<ContentId, ArenaFull> {
        if let Some(hash) = digest.hash {
            if let Some(&id) = self.dedup.get(&hash) {
                if self.same_bytes(id, page) {
                    let c = &mut self.contents[id as usize];
                    c.refs += 1;
                    if opts.pinned {
                        c.flags |= PINNED;
                    }
                    return Ok(id);
                }
            }
        }
        let frame = self.arena.alloc()?;
        self.arena.bytes_mut(frame).copy_from_slice(page);
        let mut flags = 0;
        if opts.pinned {
            flags |= PINNED;
        }
        if opts.compressible {
            flags |= COMPRESSIBLE | ACCESSED;
        }
        let mut content =
            Content { hash: 0, place: Place::Frame(frame), refs: 1, crc: digest.crc, flags };
        if let Some(hash) = digest.hash {
            content.hash = hash;
            content.flags |= HASHED;
        }
        let id = match self.free_contents.pop() {
            Some(id) => {
                self.contents[id as usize] = content;
                id
            }
            None => {
                self.contents.push(content);
                (self.contents.len() - 1) as ContentId
            }
        };
        if let Some(hash) = digest.hash {
            // A hash collision with different bytes keeps the first content in the table;
            // the new one is simply not shared.
            self.dedup.entry(hash).or_insert(id);
        }
        self.set_owner(frame, id);
        Ok(id)
    }

    fn set_owner(&mut self, frame: FrameId, id: ContentId) {
        if self.owner.len() < self.arena.frame_table_len() {
            self.owner.resize(self.arena.frame_table_len(), NO_OWNER);
        }
        self.owner[frame.index()] = id;
    }

    fn same_bytes(&self, id: ContentId, page: &[u8]) -> bool {
        match self.contents[id as usize].place {
            Place::Frame(f) => self.arena.bytes(f) == page,
            Place::Compressed => {
                let mut buf = [0u8; PAGE_SIZE];
                self.decompress(id, &mut buf) && buf[..] == *page
            }
            Place::Dead => false,
        }
    }

    /// Drops one reference; the last one frees the bytes and the slot.
    pub fn release(&mut self, id: ContentId) {
        let c = &mut self.contents[id as usize];
        debug_assert!(c.refs > 0, "release of free content {id}");
        c.refs -= 1;
        if c.refs == 0 {
            self.drop_bytes(id);
            self.free_contents.push(id);
        }
    }

    /// Frees a content's bytes and takes it out of the dedup table; its slot stays until
    /// the last reference goes.
    fn drop_bytes(&mut self, id: ContentId) {
        let c = &mut self.contents[id as usize];
        let place = std::mem::replace(&mut c.place, Place::Dead);
        if c.flags & HASHED != 0 {
            c.flags &= !HASHED;
            let hash = c.hash;
            if self.dedup.get(&hash) == Some(&id) {
                self.dedup.remove(&hash);
            }
        }
        match place {
            Place::Frame(f) => {
                self.owner[f.index()] = NO_OWNER;
                self.arena.free(f);
            }
            Place::Compressed => {
                if let Some(blob) = self.blobs.remove(&id) {
                    self.blob_bytes -= blob.len();
                    self.refresh_frame_limit();
                }
            }
            Place::Dead => {}
        }
    }

    /// Copies a content's bytes into `out` and checks them.
    pub fn read(&mut self, id: ContentId, out: &mut [u8]) -> Read {
        let c = &self.contents[id as usize];
        let ok = match c.place {
            Place::Frame(f) => {
                out.copy_from_slice(self.arena.bytes(f));
                true
            }
            Place::Compressed => self.decompress(id, out),
            Place::Dead => return Read::Dead,
        };
        if ok && crate::content::checksum(out) == c.crc {
            self.contents[id as usize].flags |= ACCESSED;
            return Read::Ok;
        }
        self.corruptions += 1;
        tracing::warn!(content = id, "page failed its checksum; dropped and reported as a miss");
        self.drop_bytes(id);
        Read::Corrupt
    }

    fn decompress(&self, id: ContentId, out: &mut [u8]) -> bool {
        let Some(blob) = self.blobs.get(&id) else { return false };
        matches!(lz4_flex::block::decompress_into(blob, out), Ok(n) if n == PAGE_SIZE)
    }

    /// Compresses up to `max` contents that were not read since the last pass (a clock
    /// with one reference bit). Returns how many were compressed.
    pub fn compress_pass(&mut self, max: usize) -> usize {
        let n = self.contents.len();
        let mut done = 0;
        for _ in 0..n.min(max.saturating_mul(4)) {
            if done == max {
                break;
            }
            let id = (self.hand % n) as ContentId;
            self.hand = (self.hand + 1) % n;
            let c = &mut self.contents[id as usize];
            let Place::Frame(frame) = c.place else { continue };
            if c.refs == 0 || c.flags & COMPRESSIBLE == 0 {
                continue;
            }
            if c.flags & ACCESSED != 0 {
                c.flags &= !ACCESSED;
                continue;
            }
            let packed = lz4_flex::block::compress(self.arena.bytes(frame));
            // Worth it only if it frees at least an eighth of a frame.
            if packed.len() > PAGE_SIZE - PAGE_SIZE / 8 {
                c.flags &= !COMPRESSIBLE;
                continue;
            }
            c.place = Place::Compressed;
            self.owner[frame.index()] = NO_OWNER;
            self.arena.free(frame);
            self.blob_bytes += packed.len();
            self.blobs.insert(id, packed.into_boxed_slice());
            self.refresh_frame_limit();
            done += 1;
        }
        done
    }

    /// Changes the budget. Growing only raises the limit (segments are mapped on demand).
    /// Shrinking drops compressed and then in-frame pages that no persistent entry pins,
    /// moves pinned pages out of the segments to be released, and unmaps those segments.
    pub fn set_budget(&mut self, budget_bytes: usize) -> ShrinkReport {
        self.budget_bytes = budget_bytes;
        let mut report = ShrinkReport::default();
        // Compressed pages first: they are the coldest.
        let ids: Vec<ContentId> = self.blobs.keys().copied().collect();
        for id in ids {
            if self.blob_bytes.div_ceil(PAGE_SIZE) + self.arena.used()
                <= budget_bytes / PAGE_SIZE
            {
                break;
            }
            if self.contents[id as usize].flags & PINNED == 0 {
                self.drop_bytes(id);
                report.contents_dropped += 1;
            }
        }
        self.refresh_frame_limit();
        let limit = self.arena.limit();
        let keep_segments = limit.div_ceil(FRAMES_PER_SEGMENT);
        let mut by_pinned = self.pinned_per_segment();
        if by_pinned.len() > keep_segments {
            // Keep the segments with the most pinned pages: fewest moves.
            by_pinned.sort_by_key(|&(seg, pinned, used)| std::cmp::Reverse((pinned, used, seg)));
            let release: Vec<usize> = by_pinned[keep_segments..].iter().map(|s| s.0).collect();
            let must_move: usize = by_pinned[keep_segments..].iter().map(|s| s.1).sum();
            self.evacuate(&release, must_move, &mut report);
        }
        // Fewer segments may still leave more frames in use than the limit allows.
        self.drop_unpinned_until(limit, &mut report);
        report.segments_released += self.arena.unmap_empty_segments();
        report.pinned_over_budget = self.arena.used().saturating_sub(limit);
        self.dropped += report.contents_dropped as u64;
        report
    }

    /// `(segment, pinned frames, used frames)` for every mapped segment.
    fn pinned_per_segment(&self) -> Vec<(usize, usize, usize)> {
        let mut pinned = vec![0usize; self.arena.frame_table_len() / FRAMES_PER_SEGMENT];
        for (f, &id) in self.owner.iter().enumerate() {
            if id != NO_OWNER && self.contents[id as usize].flags & PINNED != 0 {
                pinned[f / FRAMES_PER_SEGMENT] += 1;
            }
        }
        self.arena.segments_by_use().into_iter().map(|(seg, used)| (seg, pinned[seg], used)).collect()
    }

    /// Empties the segments in `release`: their unpinned pages are dropped; their
    /// `must_move` pinned pages move to frames elsewhere, and unpinned pages elsewhere are
    /// dropped to make room for them. Pinned pages with nowhere to go stay (and are
    /// reported by the caller as over budget).
    fn evacuate(&mut self, release: &[usize], must_move: usize, report: &mut ShrinkReport) {
        let mut pinned = Vec::with_capacity(must_move);
        for &seg in release {
            for frame in Arena::frames_of(seg) {
                let id = self.owner.get(frame.index()).copied().unwrap_or(NO_OWNER);
                if id == NO_OWNER {
                    continue;
                }
                if self.contents[id as usize].flags & PINNED == 0 {
                    self.drop_bytes(id);
                    report.contents_dropped += 1;
                } else {
                    pinned.push(frame);
                }
            }
        }
        // Make room in the kept segments for the pinned pages that must move.
        let kept_free = (self.arena.mapped_segments() - release.len())
            * FRAMES_PER_SEGMENT;
        let kept_used = self.arena.used() - pinned.len();
        let mut short = pinned.len().saturating_sub(kept_free.saturating_sub(kept_used));
        let mut f = 0;
        while short > 0 && f < self.owner.len() {
            let id = self.owner[f];
            if id != NO_OWNER
                && !release.contains(&(f / FRAMES_PER_SEGMENT))
                && self.contents[id as usize].flags & PINNED == 0
            {
                self.drop_bytes(id);
                report.contents_dropped += 1;
                short -= 1;
            }
            f += 1;
        }
        for frame in pinned {
            let Some(to) = self.arena.alloc_outside(release) else { break };
            let id = self.owner[frame.index()];
            self.arena.copy_frame(frame, to);
            self.contents[id as usize].place = Place::Frame(to);
            self.set_owner(to, id);
            self.owner[frame.index()] = NO_OWNER;
            self.arena.free(frame);
            report.frames_moved += 1;
        }
    }

    fn drop_unpinned_until(&mut self, limit: usize, report: &mut ShrinkReport) {
        let mut f = 0;
        while self.arena.used() > limit && f < self.owner.len() {
            let id = self.owner[f];
            if id != NO_OWNER && self.contents[id as usize].flags & PINNED == 0 {
                self.drop_bytes(id);
                report.contents_dropped += 1;
            }
            f += 1;
        }
    }

    /// Current numbers, for stats.
    pub fn usage(&self) -> StoreUsage {
        StoreUsage {
            frames_used: self.arena.used(),
            mapped_bytes: self.arena.mapped_bytes(),
            budget_bytes: self.budget_bytes,
            compressed_pages: self.blobs.len(),
            compressed_bytes: self.blob_bytes,
            contents: self.contents.len() - self.free_contents.len(),
            corruptions: self.corruptions,
            dropped_by_shrink: self.dropped,
            heap_bytes: self.heap_bytes(),
        }
    }

    fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        // hashbrown: one control byte per bucket beside each (key, value) pair.
        let dedup = self.dedup.capacity() * (size_of::<(u128, ContentId)>() + 1);
        let blobs = self.blobs.capacity() * (size_of::<(ContentId, Box<[u8]>)>() + 1);
        self.arena.heap_bytes()
            + self.owner.capacity() * size_of::<ContentId>()
            + self.contents.capacity() * size_of::<Content>()
            + self.free_contents.capacity() * size_of::<ContentId>()
            + dedup
            + blobs
    }

    /// Panics unless every content's reference count equals `refs[id]` (as counted from
    /// the index) and the arena, owner table and dedup table agree.
    pub fn validate(&self, refs: &HashMap<ContentId, u32>) {
        self.arena.validate();
        let mut live = 0;
        for (id, c) in self.contents.iter().enumerate() {
            let id = id as ContentId;
            let expected = refs.get(&id).copied().unwrap_or(0);
            assert_eq!(c.refs, expected, "content {id}: refs {} but {expected} entries", c.refs);
            if c.refs == 0 {
                continue;
            }
            live += 1;
            match c.place {
                Place::Frame(f) => {
                    assert_eq!(self.owner[f.index()], id, "frame {f:?} owner mismatch");
                    assert!(!self.arena.is_free(f), "content {id} in free frame {f:?}");
                }
                Place::Compressed => assert!(self.blobs.contains_key(&id), "blob missing"),
                Place::Dead => {}
            }
        }
        assert_eq!(live, self.contents.len() - self.free_contents.len(), "free list drifted");
        for (f, &id) in self.owner.iter().enumerate() {
            if id != NO_OWNER {
                let c = &self.contents[id as usize];
                assert!(matches!(c.place, Place::Frame(x) if x.index() == f), "stale owner");
            }
        }
        for (&hash, &id) in &self.dedup {
            let c = &self.contents[id as usize];
            assert!(c.refs > 0 && c.flags & HASHED != 0 && c.hash == hash, "stale dedup entry");
        }
        let blob_bytes: usize = self.blobs.values().map(|b| b.len()).sum();
        assert_eq!(blob_bytes, self.blob_bytes, "compressed byte count drifted");
    }

    /// Flips one byte of a content's stored bytes, for integrity tests.
    #[cfg(test)]
    pub fn corrupt(&mut self, id: ContentId) {
        if let Place::Frame(f) = self.contents[id as usize].place {
            self.arena.bytes_mut(f)[100] ^= 0xff;
        }
    }
}

/// A snapshot of the store's use of memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreUsage {
    /// Frames holding page bytes.
    pub frames_used: usize,
    /// Bytes mapped from the OS for frames.
    pub mapped_bytes: usize,
    /// The lent budget.
    pub budget_bytes: usize,
    /// Pages held compressed.
    pub compressed_pages: usize,
    /// Bytes of compressed page data.
    pub compressed_bytes: usize,
    /// Distinct contents (after dedup).
    pub contents: usize,
    /// Reads whose checksum failed.
    pub corruptions: u64,
    /// Contents dropped to give memory back.
    pub dropped_by_shrink: u64,
    /// Heap held by the store's tables.
    pub heap_bytes: usize,
}
