//! Page frames: 4 KiB frames carved from 2 MiB anonymous mappings ("segments").
//!
//! Memory goes back to the host a whole segment at a time (the mapping is dropped, which
//! `munmap`s it), so the arena never holds more than its frame limit rounded up to one
//! segment. Nothing here allocates per page: frames are found on a free list and the
//! per-frame owner table grows a segment at a time.
//!
//! ```text
//!  FrameId (u32) = segment number << 9 | frame number inside the segment (0..512)
//!  segments: [ Some(2 MiB mapping) | None (returned to the OS) | Some(..) | .. ]
//! ```
//!
//! # Locking
//! The arena has no lock of its own: it lives inside the engine's store and is guarded by
//! the store's mutex (see `docs/concurrency.md`).

use memmap2::MmapMut;

use fallow_core::PAGE_SIZE;

/// Bytes per segment: the unit in which memory is obtained from and returned to the OS.
pub const SEGMENT_BYTES: usize = 2 << 20;
/// Frames per segment.
pub const FRAMES_PER_SEGMENT: usize = SEGMENT_BYTES / PAGE_SIZE;
const SEGMENT_SHIFT: u32 = FRAMES_PER_SEGMENT.trailing_zeros();

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

    /// The frame's position in per-frame tables.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// One 2 MiB mapping and how many of its frames are in use.
struct Segment {
    map: MmapMut,
    used: usize,
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
    /// Segment number → mapping; `None` once returned to the OS (the number is reused).
    segments: Vec<Option<Segment>>,
    /// Frames of mapped segments that hold no page.
    free: Vec<FrameId>,
    /// The most frames that may be in use at once (the lent budget, in frames).
    limit: usize,
    used: usize,
}

impl Arena {
    /// An arena that may use up to `limit` frames; nothing is mapped until first use.
    pub fn new(limit: usize) -> Self {
        Self { segments: Vec::new(), free: Vec::new(), limit, used: 0 }
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
    /// (see `Store::shrink`); this only records the number.
    pub fn set_limit(&mut self, limit: usize) {
        self.limit = limit;
    }

    /// Segments currently mapped.
    pub fn mapped_segments(&self) -> usize {
        self.segments.iter().filter(|s| s.is_some()).count()
    }

    /// Bytes currently mapped from the OS.
    pub fn mapped_bytes(&self) -> usize {
        self.mapped_segments() * SEGMENT_BYTES
    }

    /// Length of per-frame tables: one past the highest frame index that can exist.
    pub fn frame_table_len(&self) -> usize {
        self.segments.len() * FRAMES_PER_SEGMENT
    }

    /// True when a frame can be handed out without going over the limit.
    pub fn has_room(&self) -> bool {
        self.used < self.limit
    }

    /// Hands out a free frame, mapping a new segment if needed.
    pub fn alloc(&mut self) -> Result<FrameId, ArenaFull> {
        if self.used >= self.limit {
            return Err(ArenaFull::AtLimit);
        }
        if self.free.is_empty() {
            self.map_segment()?;
        }
        let frame = self.free.pop().ok_or(ArenaFull::MapFailed)?;
        self.used += 1;
        if let Some(Some(seg)) = self.segments.get_mut(frame.segment()) {
            seg.used += 1;
        }
        Ok(frame)
    }

    /// Returns a frame to the free list. The caller guarantees it was allocated and is no
    /// longer referenced.
    pub fn free(&mut self, frame: FrameId) {
        debug_assert!(self.used > 0);
        self.used -= 1;
        if let Some(Some(seg)) = self.segments.get_mut(frame.segment()) {
            seg.used -= 1;
        }
        self.free.push(frame);
    }

    fn map_segment(&mut self) -> Result<(), ArenaFull> {
        let map = MmapMut::map_anon(SEGMENT_BYTES).map_err(|err| {
            tracing::warn!(%err, "could not map a 2 MiB segment");
            ArenaFull::MapFailed
        })?;
        let number = match self.segments.iter().position(Option::is_none) {
            Some(n) => n,
            None => {
                self.segments.push(None);
                self.segments.len() - 1
            }
        };
        self.segments[number] = Some(Segment { map, used: 0 });
        // Reverse order so that frames are handed out from the start of the segment.
        self.free.extend((0..FRAMES_PER_SEGMENT).rev().map(|slot| FrameId::new(number, slot)));
        Ok(())
    }

    /// The bytes of an allocated frame.
    pub fn bytes(&self, frame: FrameId) -> &[u8] {
        match &self.segments[frame.segment()] {
            Some(seg) => &seg.map[frame.slot() * PAGE_SIZE..][..PAGE_SIZE],
            None => panic!("frame {frame:?} is in an unmapped segment"),
        }
    }

    /// The bytes of an allocated frame, for writing.
    pub fn bytes_mut(&mut self, frame: FrameId) -> &mut [u8] {
        match &mut self.segments[frame.segment()] {
            Some(seg) => &mut seg.map[frame.slot() * PAGE_SIZE..][..PAGE_SIZE],
            None => panic!("frame {frame:?} is in an unmapped segment"),
        }
    }

    /// Copies frame `from` into frame `to` (both allocated), for compaction.
    pub fn copy_frame(&mut self, from: FrameId, to: FrameId) {
        let mut page = [0u8; PAGE_SIZE];
        page.copy_from_slice(self.bytes(from));
        self.bytes_mut(to).copy_from_slice(&page);
    }

    /// Mapped segments with their number of frames in use, fullest last.
    pub fn segments_by_use(&self) -> Vec<(usize, usize)> {
        let mut v: Vec<(usize, usize)> = self
            .segments
            .iter()
            .enumerate()
            .filter_map(|(n, s)| s.as_ref().map(|s| (n, s.used)))
            .collect();
        v.sort_by_key(|&(n, used)| (used, n));
        v
    }

    /// All frames of segment `number`.
    pub fn frames_of(number: usize) -> impl Iterator<Item = FrameId> {
        (0..FRAMES_PER_SEGMENT).map(move |slot| FrameId::new(number, slot))
    }

    /// Unmaps every segment that holds no page. Returns how many were unmapped.
    pub fn unmap_empty_segments(&mut self) -> usize {
        let empty: Vec<usize> = self
            .segments
            .iter()
            .enumerate()
            .filter_map(|(n, s)| s.as_ref().filter(|s| s.used == 0).map(|_| n))
            .collect();
        if !empty.is_empty() {
            self.segments.iter_mut().enumerate().for_each(|(n, s)| {
                if empty.binary_search(&n).is_ok() {
                    *s = None;
                }
            });
            self.free.retain(|f| empty.binary_search(&f.segment()).is_err());
        }
        empty.len()
    }

    /// True when `frame` is on the free list. O(free frames): for `validate` only.
    pub fn is_free(&self, frame: FrameId) -> bool {
        self.free.contains(&frame)
    }

    /// Takes a free frame that is not in any of `avoid` (segments about to be unmapped).
    pub fn alloc_outside(&mut self, avoid: &[usize]) -> Option<FrameId> {
        let pos = self.free.iter().rposition(|f| !avoid.contains(&f.segment()))?;
        let frame = self.free.swap_remove(pos);
        self.used += 1;
        if let Some(Some(seg)) = self.segments.get_mut(frame.segment()) {
            seg.used += 1;
        }
        Some(frame)
    }

    /// Bytes of heap the arena's bookkeeping holds (not the frames themselves).
    pub fn heap_bytes(&self) -> usize {
        self.free.capacity() * std::mem::size_of::<FrameId>()
            + self.segments.capacity() * std::mem::size_of::<Option<Segment>>()
    }

    /// Panics if the arena's counters disagree with its free list.
    pub fn validate(&self) {
        let mapped = self.mapped_segments() * FRAMES_PER_SEGMENT;
        assert_eq!(self.used + self.free.len(), mapped, "used + free != mapped frames");
        let seg_used: usize = self.segments.iter().flatten().map(|s| s.used).sum();
        assert_eq!(seg_used, self.used, "segment use counts drifted");
        for f in &self.free {
            assert!(self.segments[f.segment()].is_some(), "free frame {f:?} is unmapped");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_maps_lazily_and_respects_the_limit() {
        let mut a = Arena::new(3);
        assert_eq!(a.mapped_segments(), 0);
        let f: Vec<_> = (0..3).map(|_| a.alloc().unwrap()).collect();
        assert_eq!(a.mapped_segments(), 1);
        assert_eq!(a.alloc(), Err(ArenaFull::AtLimit));
        a.bytes_mut(f[0]).fill(7);
        a.copy_frame(f[0], f[1]);
        assert!(a.bytes(f[1]).iter().all(|&b| b == 7));
        a.validate();
        f.into_iter().for_each(|x| a.free(x));
        assert_eq!(a.unmap_empty_segments(), 1);
        assert_eq!(a.mapped_bytes(), 0);
        a.validate();
    }

    #[test]
    fn frame_ids_round_trip() {
        let f = FrameId::new(5, 511);
        assert_eq!((f.segment(), f.slot()), (5, 511));
    }
}
