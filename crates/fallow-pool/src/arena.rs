//! Page frames: 4 KiB frames carved from 2 MiB segments, laid out in anonymous mappings of
//! eight adjacent segments ("extents").
//!
//! Memory goes back to the host a whole segment at a time. The kernel charges mostly per
//! call for that (a TLB shootdown on every CPU running the process: ~30 µs a call with a
//! sibling thread running, see BENCHMARKS.md, "What unmapping costs"), so segments are
//! laid out eight to an extent and released in runs: a run that empties its extent unmaps
//! it whole (one `munmap` for 16 MiB, after the store lock is released, so readers never
//! wait for it); a run inside an extent that stays is discarded with one
//! `madvise(MADV_DONTNEED)` (under the lock: the frames must not be handed out again
//! before their memory is gone). Each segment sits 2 MiB-aligned and the extent is advised
//! `MADV_HUGEPAGE`, so where transparent huge pages are enabled a segment costs one huge
//! page to fault in and to free. Nothing here allocates per page.
//!
//! ```text
//!  FrameId (u32) = segment number << 9 | frame number inside the segment (0..512)
//!  segment n lives in extent n / 8, at 2 MiB × (n % 8)
//!  segments: [ Mapped | Draining(stale) | Free | Mapped | .. ]
//!  extents:  [ Some(16 MiB mapping) | None (unmapped) | .. ]
//! ```
//!
//! A released segment is `Draining` while contents that lived in it are still referenced
//! by index entries (they read as dead, and let go of the segment when freed); its number is
//! reused only once it is `Free`, so a stale frame id can never reach new bytes.
//!
//! # Locking
//! The arena has no lock of its own: it lives inside the engine's store and is guarded by
//! the store's lock (see `docs/concurrency.md`).

use std::ptr::NonNull;

use memmap2::{MmapMut, MmapRaw};

use fallow_core::PAGE_SIZE;

/// Bytes per segment: the unit in which memory is obtained from and returned to the OS.
pub const SEGMENT_BYTES: usize = 2 << 20;
/// Frames per segment.
pub const FRAMES_PER_SEGMENT: usize = SEGMENT_BYTES / PAGE_SIZE;
const SEGMENT_SHIFT: u32 = FRAMES_PER_SEGMENT.trailing_zeros();
/// Segment numbers whose frame ids stay below 2³⁰: a content's id is its frame's number,
/// and ids from 2³⁰ up are the store's virtual ids (`store/by_id.rs`). 4 TiB of numbers,
/// twice the largest budget, so that released segments still draining leave room.
const MAX_SEGMENTS: usize = 1 << (30 - SEGMENT_SHIFT);

/// One 4 KiB frame: a segment number and a slot inside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct FrameId(u32);

impl FrameId {
    fn new(segment: usize, slot: usize) -> Self {
        debug_assert!(slot < FRAMES_PER_SEGMENT);
        Self(((segment as u32) << SEGMENT_SHIFT) | slot as u32)
    }

    /// The segment this frame belongs to.
    pub fn segment(self) -> usize {
        (self.0 >> SEGMENT_SHIFT) as usize
    }

    fn slot(self) -> usize {
        self.0 as usize & (FRAMES_PER_SEGMENT - 1)
    }

    /// The id as 32 bits, for packed storage.
    pub fn raw(self) -> u32 {
        self.0
    }

    /// An id from [`FrameId::raw`].
    pub fn from_raw(raw: u32) -> Self {
        Self(raw)
    }
}

/// Segments per extent (one mapping).
pub const EXTENT_SEGMENTS: usize = 8;
const EXTENT_BYTES: usize = EXTENT_SEGMENTS * SEGMENT_BYTES;

/// One anonymous mapping holding [`EXTENT_SEGMENTS`] adjacent 2 MiB-aligned segments.
/// Dropping it unmaps them all.
pub struct Extent {
    /// Raw, not `MmapMut`: frames are reached through pointers to their own 4 KiB
    /// ([`Arena::frame_ptr`]), never through a slice of the whole mapping.
    map: MmapRaw,
    /// Offset of the aligned window inside `map`.
    start: usize,
}

impl Extent {
    fn new() -> std::io::Result<Self> {
        // One segment more than the window, so that a 2 MiB-aligned window always fits:
        // only the window is ever touched, so the rest costs address space, not memory.
        let map = MmapRaw::from(MmapMut::map_anon(EXTENT_BYTES + SEGMENT_BYTES)?);
        let addr = map.as_ptr() as usize;
        let start = addr.next_multiple_of(SEGMENT_BYTES) - addr;
        // Best effort: without transparent huge pages the segments work the same, only
        // slower to fault in and to free.
        let _ = map.advise_range(memmap2::Advice::HugePage, start, EXTENT_BYTES);
        Ok(Self { map, start })
    }

    fn offset(&self, segment: usize, slot: usize) -> usize {
        self.start + (segment % EXTENT_SEGMENTS) * SEGMENT_BYTES + slot * PAGE_SIZE
    }

    /// Gives the memory of `count` adjacent segments, from `first`, back to the OS; the
    /// mapping stays, and reads as zeros if used again.
    fn discard(&mut self, first: usize, count: usize) {
        self.discard_bytes(self.offset(first, 0), count * SEGMENT_BYTES, "released segments");
    }

    /// [`Extent::discard`] for one frame, which stays mapped and free.
    fn discard_frame(&mut self, segment: usize, slot: usize) {
        self.discard_bytes(self.offset(segment, slot), PAGE_SIZE, "a compressed page's frame");
    }

    fn discard_bytes(&mut self, offset: usize, len: usize, what: &str) {
        // SAFETY: `&mut self` proves that no slice into the mapping is alive (the arena
        // hands them out borrowing itself; a `HeldFrame` never names a frame of a released
        // segment, nor a frame whose page was compressed away, see `docs/concurrency.md`),
        // and the range lies inside the window (the caller passes segments or a frame of
        // this extent). The only effect of MADV_DONTNEED on a private anonymous mapping is
        // that the range reads as zeros afterwards; its frames are free and hold nothing
        // anyone reads.
        let result = unsafe {
            self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, len)
        };
        if let Err(err) = result {
            // The memory stays resident until it is written again or the extent is
            // unmapped; nothing is lost.
            tracing::warn!(%err, offset, len, "could not discard {what}");
        }
    }
}

/// The state of one segment number.
enum Segment {
    /// Mapped (its extent is), with this many frames in use.
    Mapped { used: usize },
    /// Returned to the OS; this many contents still name frames in it.
    Draining { stale: usize },
    /// Unused: the number may be given to a new mapping.
    Free,
}

/// Why the arena could not hand out a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArenaFull {
    /// Every frame the limit allows is in use.
    AtLimit,
    /// The OS refused to map another segment.
    MapFailed,
}

/// The frames of one engine.
pub struct Arena {
    segments: Vec<Segment>,
    /// Extent `e` holds segments `8e..8e+8`; `None` when none of them is mapped.
    extents: Vec<Option<Extent>>,
    /// Frames of mapped segments that hold no page.
    free: Vec<FrameId>,
    /// Free frames whose memory went back to the OS ([`Arena::free_and_discard`]): handed
    /// out after `free`, so that a put writes resident memory when it can.
    discarded: Vec<FrameId>,
    /// The most frames that may be in use at once (the lent budget, in frames).
    limit: usize,
    used: usize,
    mapped: usize,
}

impl Arena {
    /// An arena that may use up to `limit` frames; nothing is mapped until first use.
    pub fn new(limit: usize) -> Self {
        Self {
            segments: Vec::new(),
            extents: Vec::new(),
            free: Vec::new(),
            discarded: Vec::new(),
            limit,
            used: 0,
            mapped: 0,
        }
    }

    /// Frames in use.
    pub fn used(&self) -> usize {
        self.used
    }

    /// The frame limit.
    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Changes the frame limit. Shrinking below [`Arena::used`] is the caller's to resolve
    /// (see `Store::shrink_step`); this only records the number.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// Segments currently mapped.
    pub fn mapped_segments(&self) -> usize {
        self.mapped
    }

    /// True when segment `number` is mapped.
    pub fn is_mapped(&self, number: usize) -> bool {
        matches!(self.segments.get(number), Some(Segment::Mapped { .. }))
    }

    /// Bytes currently mapped from the OS for frames.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped * SEGMENT_BYTES
    }

    /// Length of per-frame tables: one past the highest frame index that can exist.
    pub fn frame_table_len(&self) -> usize {
        self.segments.len() * FRAMES_PER_SEGMENT
    }

    /// True when a frame can be handed out without going over the limit.
    pub fn has_room(&self) -> bool {
        self.used < self.limit
    }

    /// True when `frame` is in a mapped segment (else its bytes are gone).
    pub fn is_live(&self, frame: FrameId) -> bool {
        matches!(self.segments.get(frame.segment()), Some(Segment::Mapped { .. }))
    }

    /// Hands out a free frame, mapping a new segment if needed.
    pub fn alloc(&mut self) -> Result<FrameId, ArenaFull> {
        if self.used >= self.limit {
            return Err(ArenaFull::AtLimit);
        }
        if let Some(frame) = self.free.pop().or_else(|| self.discarded.pop()) {
            self.take(frame);
            return Ok(frame);
        }
        self.map_segment()?;
        let frame = self.free.pop().ok_or(ArenaFull::MapFailed)?;
        self.take(frame);
        Ok(frame)
    }

    fn take(&mut self, frame: FrameId) {
        self.used += 1;
        if let Some(Segment::Mapped { used, .. }) = self.segments.get_mut(frame.segment()) {
            *used += 1;
        }
    }

    /// [`Arena::free`], and the frame's memory goes back to the OS until the frame is
    /// written again: for a frame whose page was compressed, so that the process holds
    /// the budget's bytes, not the budget's plus the compressed pages' (the budget counts
    /// those as blobs already, `Store::refresh_frame_limit`). A frame of a segment being
    /// released is only freed: the segment goes whole.
    pub fn free_and_discard(&mut self, frame: FrameId) {
        if self.untake(frame) {
            let segment = frame.segment();
            if let Some(extent) = self.extents[segment / EXTENT_SEGMENTS].as_mut() {
                extent.discard_frame(segment, frame.slot());
            }
            self.discarded.push(frame);
        }
    }

    /// Free frames of mapped segments whose memory is back with the OS.
    pub fn discarded_frames(&self) -> usize {
        self.discarded.len()
    }

    /// Free frames still resident, which [`Arena::alloc`] hands out first.
    #[cfg(test)]
    pub fn resident_free_frames(&self) -> usize {
        self.free.len()
    }

    /// Returns a frame to the free list, or, if its segment was released meanwhile, lets go
    /// of the segment. The caller guarantees the frame was allocated and is no longer
    /// referenced.
    pub fn free(&mut self, frame: FrameId) {
        if self.untake(frame) {
            self.free.push(frame);
        }
    }

    /// Undoes [`Arena::take`] for a frame no longer referenced: true when its segment is
    /// mapped, so the caller lists it free; a draining segment's frame only lets go of it.
    fn untake(&mut self, frame: FrameId) -> bool {
        match self.segments.get_mut(frame.segment()) {
            Some(Segment::Mapped { used, .. }) => {
                *used -= 1;
                self.used -= 1;
                true
            }
            Some(seg @ Segment::Draining { .. }) => {
                if let Segment::Draining { stale } = seg {
                    *stale -= 1;
                    if *stale == 0 {
                        *seg = Segment::Free;
                    }
                }
                false
            }
            _ => {
                debug_assert!(false, "free of {frame:?} in a free segment");
                false
            }
        }
    }

    fn map_segment(&mut self) -> Result<(), ArenaFull> {
        let is_free = |s: &Segment| matches!(s, Segment::Free);
        // A free number in an extent that is still mapped needs no system call; then any
        // free number; then a new one.
        let in_mapped_extent = self
            .segments
            .iter()
            .enumerate()
            .position(|(n, s)| is_free(s) && self.extents[n / EXTENT_SEGMENTS].is_some());
        let number = match in_mapped_extent.or_else(|| self.segments.iter().position(is_free)) {
            Some(n) => n,
            // Frame ids are 32 bits: no segment number past this one can be named.
            None if self.segments.len() >= MAX_SEGMENTS => {
                tracing::warn!("every segment number is mapped or still draining");
                return Err(ArenaFull::MapFailed);
            }
            None => {
                self.segments.push(Segment::Free);
                let n = self.segments.len() - 1;
                if n / EXTENT_SEGMENTS == self.extents.len() {
                    self.extents.push(None);
                }
                n
            }
        };
        let extent = &mut self.extents[number / EXTENT_SEGMENTS];
        if extent.is_none() {
            *extent = Some(Extent::new().map_err(|err| {
                tracing::warn!(%err, "could not map a 16 MiB extent");
                ArenaFull::MapFailed
            })?);
        }
        self.segments[number] = Segment::Mapped { used: 0 };
        self.mapped += 1;
        // Reverse order so that frames are handed out from the start of the segment.
        self.free.extend((0..FRAMES_PER_SEGMENT).rev().map(|slot| FrameId::new(number, slot)));
        Ok(())
    }

    fn extent(&self, frame: FrameId) -> &Extent {
        match (&self.segments[frame.segment()], &self.extents[frame.segment() / EXTENT_SEGMENTS]) {
            (Segment::Mapped { .. }, Some(extent)) => extent,
            _ => panic!("frame {frame:?} is not in a mapped segment"),
        }
    }

    /// The first byte of an allocated frame in a mapped segment. Every access to frame
    /// bytes goes through a pointer to its own 4 KiB, never through a slice of the whole
    /// mapping, so that a frame written under the store's write lock never overlaps a frame
    /// another thread reads with no store lock (`store::HeldFrame`).
    pub fn frame_ptr(&self, frame: FrameId) -> NonNull<u8> {
        let extent = self.extent(frame);
        let offset = extent.offset(frame.segment(), frame.slot());
        assert!(offset + PAGE_SIZE <= extent.map.len(), "frame {frame:?} outside its mapping");
        // SAFETY: the offset is inside the mapping (asserted above), so the result is in
        // bounds of the same allocation and not null (the mapping's address is not).
        unsafe { NonNull::new_unchecked(extent.map.as_mut_ptr().add(offset)) }
    }

    /// The bytes of an allocated frame in a mapped segment.
    pub fn bytes(&self, frame: FrameId) -> &[u8] {
        let ptr = self.frame_ptr(frame);
        // SAFETY: `frame_ptr` points at PAGE_SIZE mapped bytes that stay mapped while the
        // arena is borrowed (only `&mut self` unmaps or discards); they are written only
        // through `bytes_mut`, which needs `&mut self`.
        unsafe { std::slice::from_raw_parts(ptr.as_ptr(), PAGE_SIZE) }
    }

    /// The bytes of an allocated frame in a mapped segment, for writing.
    pub fn bytes_mut(&mut self, frame: FrameId) -> &mut [u8] {
        let ptr = self.frame_ptr(frame);
        // SAFETY: as in `bytes`; `&mut self` excludes every other borrow of the arena, and
        // a reader holding a `HeldFrame` reads a different frame (the store never writes
        // the frame of a content that an index entry names).
        unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr(), PAGE_SIZE) }
    }

    /// Copies frame `from` into frame `to` (both allocated), for compaction.
    pub fn copy_frame(&mut self, from: FrameId, to: FrameId) {
        let mut page = [0u8; PAGE_SIZE];
        page.copy_from_slice(self.bytes(from));
        self.bytes_mut(to).copy_from_slice(&page);
    }

    /// Mapped segments with their number of frames in use.
    pub fn segments_by_use(&self) -> Vec<(usize, usize)> {
        self.segments
            .iter()
            .enumerate()
            .filter_map(|(n, s)| match s {
                Segment::Mapped { used, .. } => Some((n, *used)),
                _ => None,
            })
            .collect()
    }

    /// All frames of segment `number`.
    pub fn frames_of(number: usize) -> impl Iterator<Item = FrameId> {
        (0..FRAMES_PER_SEGMENT).map(move |slot| FrameId::new(number, slot))
    }

    /// Releases mapped segments, each `(number, stale)` with its `stale` in-use frames
    /// abandoned (their contents read as dead from now on, and each lets go when freed).
    /// Returns how many were released, and the extents they emptied, for the caller to
    /// drop (unmap) once it holds no lock. The memory of a released segment whose extent
    /// stays mapped is discarded here, one call per run of adjacent segments.
    pub fn release_segments(&mut self, segments: &[(usize, usize)]) -> (usize, Vec<Extent>) {
        let mut released: Vec<usize> = Vec::with_capacity(segments.len());
        for &(number, stale) in segments {
            let state = if stale == 0 { Segment::Free } else { Segment::Draining { stale } };
            match std::mem::replace(&mut self.segments[number], state) {
                Segment::Mapped { used } => {
                    debug_assert_eq!(used, stale, "segment {number}: {used} used, {stale} stale");
                    self.used -= used;
                    self.mapped -= 1;
                    released.push(number);
                }
                other => self.segments[number] = other,
            }
        }
        released.sort_unstable();
        self.free.retain(|f| released.binary_search(&f.segment()).is_err());
        self.discarded.retain(|f| released.binary_search(&f.segment()).is_err());
        let mut emptied = Vec::new();
        for run in released.chunk_by(|a, b| a / EXTENT_SEGMENTS == b / EXTENT_SEGMENTS) {
            let e = run[0] / EXTENT_SEGMENTS;
            let first = e * EXTENT_SEGMENTS;
            let still_mapped = (first..(first + EXTENT_SEGMENTS).min(self.segments.len()))
                .any(|n| matches!(self.segments[n], Segment::Mapped { .. }));
            if !still_mapped {
                emptied.extend(self.extents[e].take());
                continue;
            }
            let Some(extent) = self.extents[e].as_mut() else { continue };
            for adjacent in run.chunk_by(|a, b| a + 1 == *b) {
                extent.discard(adjacent[0], adjacent.len());
            }
        }
        (released.len(), emptied)
    }

    /// Takes a free frame that is not in any of `avoid` (segments about to be released).
    pub fn alloc_outside(&mut self, avoid: &[usize]) -> Option<FrameId> {
        let outside =
            |list: &Vec<FrameId>| list.iter().rposition(|f| !avoid.contains(&f.segment()));
        let frame = match outside(&self.free) {
            Some(pos) => self.free.swap_remove(pos),
            None => {
                let pos = outside(&self.discarded)?;
                self.discarded.swap_remove(pos)
            }
        };
        self.take(frame);
        Some(frame)
    }

    /// True when `frame` is on a free list. O(free frames): for `validate` only.
    pub fn is_free(&self, frame: FrameId) -> bool {
        self.free.contains(&frame) || self.discarded.contains(&frame)
    }

    /// Bytes of heap the arena's bookkeeping holds (not the frames themselves).
    pub fn heap_bytes(&self) -> usize {
        (self.free.capacity() + self.discarded.capacity()) * std::mem::size_of::<FrameId>()
            + self.segments.capacity() * std::mem::size_of::<Segment>()
    }

    /// Draining segments and how many stale frames each still has, for `validate`.
    pub fn draining(&self) -> Vec<(usize, usize)> {
        self.segments
            .iter()
            .enumerate()
            .filter_map(|(n, s)| match s {
                Segment::Draining { stale } => Some((n, *stale)),
                _ => None,
            })
            .collect()
    }

    /// Panics if the arena's counters disagree with its free list.
    pub fn validate(&self) {
        let mapped = self.segments.iter().filter(|s| matches!(s, Segment::Mapped { .. })).count();
        assert_eq!(mapped, self.mapped, "mapped segment count drifted");
        let free = self.free.len() + self.discarded.len();
        assert_eq!(self.used + free, mapped * FRAMES_PER_SEGMENT, "frames leak");
        let seg_used: usize = self.segments_by_use().iter().map(|s| s.1).sum();
        assert_eq!(seg_used, self.used, "segment use counts drifted");
        for f in self.free.iter().chain(&self.discarded) {
            assert!(self.is_live(*f), "free frame {f:?} is not mapped");
        }
        for (n, stale) in self.draining() {
            assert!(stale > 0, "segment {n} drains nothing");
        }
        assert_eq!(self.extents.len(), self.segments.len().div_ceil(EXTENT_SEGMENTS));
        for (e, extent) in self.extents.iter().enumerate() {
            let first = e * EXTENT_SEGMENTS;
            let last = (first + EXTENT_SEGMENTS).min(self.segments.len());
            let mapped = (first..last).any(|n| matches!(self.segments[n], Segment::Mapped { .. }));
            assert_eq!(extent.is_some(), mapped, "extent {e}: mapping and segment states disagree");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_maps_lazily_and_respects_the_limit() {
        let mut a = Arena::new(3);
        assert_eq!(a.mapped_bytes(), 0);
        let f: Vec<_> = (0..3).map(|_| a.alloc().unwrap()).collect();
        assert_eq!(a.mapped_bytes(), SEGMENT_BYTES);
        assert_eq!(a.alloc(), Err(ArenaFull::AtLimit));
        a.bytes_mut(f[0]).fill(7);
        a.copy_frame(f[0], f[1]);
        assert!(a.bytes(f[1]).iter().all(|&b| b == 7));
        a.validate();
        f.into_iter().for_each(|x| a.free(x));
        let (released, emptied) = a.release_segments(&[(0, 0)]);
        assert_eq!((released, emptied.len()), (1, 1), "the only segment empties its extent");
        assert_eq!(a.mapped_bytes(), 0);
        a.validate();
    }

    #[test]
    fn segments_are_2mib_aligned() {
        let mut a = Arena::new(1);
        let f = a.alloc().unwrap();
        assert_eq!(a.bytes(f).as_ptr() as usize % SEGMENT_BYTES, 0);
    }

    #[test]
    fn a_released_segment_drains_before_its_number_is_reused() {
        let mut a = Arena::new(2 * FRAMES_PER_SEGMENT);
        let f = a.alloc().unwrap();
        let g = a.alloc().unwrap();
        drop(a.release_segments(&[(f.segment(), 2)]));
        assert!(!a.is_live(f) && a.used() == 0);
        a.validate();
        // A new segment must not take the draining number.
        let h = a.alloc().unwrap();
        assert_ne!(h.segment(), f.segment());
        a.free(f);
        a.free(g);
        assert!(a.draining().is_empty());
        a.validate();
    }

    #[test]
    fn a_discarded_frame_reads_as_zeros_and_is_handed_out_after_resident_ones() {
        let mut a = Arena::new(FRAMES_PER_SEGMENT);
        let (f, g) = (a.alloc().unwrap(), a.alloc().unwrap());
        a.bytes_mut(f).fill(0xAB);
        a.bytes_mut(g).fill(0xCD);
        a.free_and_discard(f);
        assert_eq!((a.used(), a.discarded_frames()), (1, 1));
        a.validate();
        assert!(a.bytes(f).iter().all(|&b| b == 0), "its memory went back to the OS");
        assert!(a.bytes(g).iter().all(|&b| b == 0xCD), "its neighbour kept its bytes");
        // Every resident free frame goes first; then the discarded one.
        let resident = FRAMES_PER_SEGMENT - 2;
        let taken: Vec<_> = (0..resident).map(|_| a.alloc().unwrap()).collect();
        assert!(!taken.contains(&f));
        assert_eq!(a.alloc().unwrap(), f);
        assert_eq!(a.discarded_frames(), 0);
        a.bytes_mut(f).fill(1);
        a.validate();
    }

    #[test]
    fn segments_share_extents_and_a_partial_release_keeps_the_rest_readable() {
        let frames = 3 * FRAMES_PER_SEGMENT;
        let mut a = Arena::new(frames);
        let all: Vec<_> = (0..frames).map(|_| a.alloc().unwrap()).collect();
        let segments: Vec<usize> = {
            let mut s: Vec<_> = all.iter().map(|f| f.segment()).collect();
            s.dedup();
            s
        };
        assert_eq!(segments, vec![0, 1, 2], "numbers are handed out densely");
        for (i, &f) in all.iter().enumerate() {
            a.bytes_mut(f)[..8].copy_from_slice(&(i as u64).to_le_bytes());
        }
        // Release the middle segment: its extent stays, so its memory is discarded.
        for &f in all.iter().filter(|f| f.segment() == 1) {
            a.free(f);
        }
        let (released, emptied) = a.release_segments(&[(1, 0)]);
        assert_eq!((released, emptied.len()), (1, 0));
        a.validate();
        for (i, &f) in all.iter().enumerate().filter(|(_, f)| f.segment() != 1) {
            assert_eq!(a.bytes(f)[..8], (i as u64).to_le_bytes(), "{f:?} survived");
        }
        // The freed number is reused without a new mapping, and reads as zeros.
        assert!(a.free.is_empty());
        let g = a.alloc().unwrap();
        assert_eq!(g.segment(), 1);
        assert_eq!(a.extents.iter().filter(|e| e.is_some()).count(), 1, "no second mapping");
        assert!(a.bytes(g).iter().all(|&b| b == 0), "discarded memory reads as zeros");
        a.validate();
    }

    #[test]
    fn frame_ids_round_trip() {
        let f = FrameId::new(5, 511);
        assert_eq!((f.segment(), f.slot()), (5, 511));
    }
}
