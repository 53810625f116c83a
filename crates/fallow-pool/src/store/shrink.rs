//! Giving memory back: shrinking the store to a smaller budget, a few segments at a time.
//!
//! Each step picks the mapped segments that hold the fewest pinned (persistent) pages,
//! moves those pages into free frames of segments that stay (dropping ephemeral pages
//! there if room is short), and releases the segments whole. Their ephemeral pages are not
//! visited one by one: their contents keep naming frames of a segment that is no longer
//! mapped, read as dead, and let go of it as the index drops them. So a step costs a scan
//! of the chosen segments' flag bytes (a content's id is its frame's number, mostly:
//! `places.rs`) plus the pinned pages it moves, which keep their ids. Segments are chosen
//! a whole extent (8 adjacent segments, one mapping) at a time where possible, because the
//! kernel charges per call: an emptied extent is handed back to be unmapped in one call
//! after the store lock is released.

use fallow_core::PAGE_SIZE;

use super::meta::Meta;
use super::{ContentId, Place, Store, PINNED};
use crate::arena::{Arena, Extent, FrameId, EXTENT_SEGMENTS, FRAMES_PER_SEGMENT};

/// Slabs of compressed pages a shrink step cleans at most before it drops any: each
/// is a copy of up to 64 KiB under the locks.
const CLEAN_PER_STEP: usize = 4;

/// What a shrink did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ShrinkReport {
    /// Segments returned to the OS.
    pub segments_released: usize,
    /// Pages whose bytes were dropped (their keys now miss).
    pub contents_dropped: usize,
    /// Persistent pages moved to another frame so their segment could go.
    pub frames_moved: usize,
    /// Frames the budget could not shed because persistent pages hold them.
    pub pinned_over_budget: usize,
}

impl Store {
    /// Changes the budget. Growing takes effect at once (segments are mapped on demand);
    /// shrinking is then carried out by [`Store::shrink_step`]. The dedup table is told to
    /// expect a page per frame of it, and grows to that as pages come.
    pub fn set_budget(&mut self, budget_bytes: usize) {
        self.budget_bytes = budget_bytes;
        self.dedup.expect(budget_bytes / PAGE_SIZE);
        self.refresh_frame_limit();
    }

    /// The order in which a shrink releases segments, cheapest last (so that `pop` gives
    /// the next one). Whole extents go first, the cheapest extent first (fewest persistent
    /// pages to move, then fewest pages lost), its segments in a row, so that each extent
    /// emptied is one `munmap`; within an extent, the cheapest segment first. Computed
    /// once per budget change; a step skips entries that are no longer mapped.
    pub fn shrink_plan(&self) -> Vec<usize> {
        let segments = self.arena.segments_by_use();
        let mut extent_cost = std::collections::HashMap::<usize, (u64, usize)>::new();
        for &(seg, used) in &segments {
            let cost = extent_cost.entry(seg / EXTENT_SEGMENTS).or_default();
            cost.0 += u64::from(self.pinned[seg]);
            cost.1 += used;
        }
        // Sort keys, most expensive first: (extent cost, extent, segment cost, segment).
        let key = |&(seg, used): &(usize, usize)| {
            let extent = seg / EXTENT_SEGMENTS;
            (extent_cost[&extent], extent, (self.pinned[seg], used), seg)
        };
        let mut candidates = segments;
        candidates.sort_unstable_by_key(|c| std::cmp::Reverse(key(c)));
        candidates.into_iter().map(|(seg, _)| seg).collect()
    }

    /// One bounded step toward the budget: releases at most `max_segments` segments, taken
    /// from the end of `plan`. Returns the extents it emptied, for the caller to drop
    /// (unmap) once the store lock is released, and whether another step is needed.
    pub fn shrink_step(
        &mut self,
        plan: &mut Vec<usize>,
        max_segments: usize,
        report: &mut ShrinkReport,
    ) -> (Vec<Extent>, bool) {
        let blobs_left =
            self.drop_compressed_over_budget(max_segments * FRAMES_PER_SEGMENT, report);
        let limit = self.arena.limit();
        let keep = limit.div_ceil(FRAMES_PER_SEGMENT);
        let surplus = self.arena.mapped_segments().saturating_sub(keep);
        let mut release = Vec::with_capacity(max_segments);
        while release.len() < surplus.min(max_segments) {
            match plan.pop() {
                Some(seg) if self.arena.is_mapped(seg) => release.push(seg),
                Some(_) => {}
                None => break,
            }
        }
        let mut released = Vec::with_capacity(release.len());
        for &seg in &release {
            // Most segments hold no persistent page: then nothing in them is visited.
            if self.pinned[seg] == 0 || self.evacuate_pinned(seg, &release, report) {
                let (stale, refs) = self.stale_frames_and_refs(seg);
                self.stale_entries += refs;
                report.contents_dropped += stale;
                self.dropped += stale as u64;
                released.push((seg, stale));
            }
        }
        let (count, extents) = self.arena.release_segments(&released);
        report.segments_released += count;
        if blobs_left || (surplus > release.len() && count > 0 && !plan.is_empty()) {
            return (extents, true);
        }
        // Fewer segments may still leave more frames in use than the limit allows.
        self.drop_unpinned_until(limit, report);
        // Persistent pages in frames and, compressed, in slabs: what no step can shed.
        let blob_frames = self.blobs.resident_bytes().div_ceil(PAGE_SIZE);
        report.pinned_over_budget =
            (self.arena.used() + blob_frames).saturating_sub(self.budget_bytes / PAGE_SIZE);
        (extents, false)
    }

    /// While the budget is exceeded, gives back compressed pages' memory: first by
    /// cleaning their slabs (no page lost), then slab by slab, dropping the pages
    /// that no persistent entry pins (the coldest there are) and moving the persistent ones
    /// to the open slab, so that each slab goes back whole. At most `max` pages
    /// dropped; true when that bound stopped it with the budget still exceeded.
    fn drop_compressed_over_budget(&mut self, max: usize, report: &mut ShrinkReport) -> bool {
        let budget_frames = self.budget_bytes / PAGE_SIZE;
        let over =
            |s: &Store| s.blobs.resident_bytes() / PAGE_SIZE + s.arena.used() > budget_frames;
        if over(self) {
            // Free memory first: the spares hold no page.
            self.blobs.release_spares();
        }
        let mut dropped = 0;
        // One round of the slabs at most: what is left over the budget is persistent.
        let mut visits = self.blobs.slabs_in_use();
        while over(self) && dropped < max && visits > 0 {
            if self.blobs.clean(CLEAN_PER_STEP) > 0 {
                continue;
            }
            visits -= 1;
            let Some((slab, ids)) = self.blobs.next_slab() else { break };
            let before = dropped;
            for id in ids {
                if !self.meta.has(id, PINNED) {
                    self.drop_bytes(id);
                    self.dropped += 1;
                    report.contents_dropped += 1;
                    dropped += 1;
                }
            }
            // A slab of persistent pages only stays as it is.
            if dropped > before && !self.blobs.evacuate(slab) {
                break;
            }
        }
        self.refresh_frame_limit();
        dropped >= max && over(self)
    }

    /// Moves the pinned pages of segment `seg` to frames outside `release`, dropping
    /// unpinned pages elsewhere to make room. False when some pinned page could not move
    /// (the segment then stays).
    fn evacuate_pinned(
        &mut self,
        seg: usize,
        release: &[usize],
        report: &mut ShrinkReport,
    ) -> bool {
        for frame in Arena::frames_of(seg) {
            let Some(id) = self.owner(frame).filter(|&id| self.meta.has(id, PINNED)) else {
                continue;
            };
            let to = match self.arena.alloc_outside(release) {
                Some(to) => to,
                None => {
                    if !self.drop_one_unpinned_outside(release, report) {
                        return false;
                    }
                    match self.arena.alloc_outside(release) {
                        Some(to) => to,
                        None => return false,
                    }
                }
            };
            self.arena.copy_frame(frame, to);
            // The content keeps its id: the index entries naming it stay as they are.
            self.set_place(id, Place::Frame(to));
            self.move_pin(id, Some(frame), Some(to));
            self.arena.free(frame);
            report.frames_moved += 1;
        }
        true
    }

    /// Drops one unpinned page in a segment that stays, to free its frame.
    fn drop_one_unpinned_outside(&mut self, release: &[usize], report: &mut ShrinkReport) -> bool {
        let n = self.arena.frame_table_len();
        for _ in 0..n {
            let f = self.cursor % n.max(1);
            self.cursor = (self.cursor + 1) % n.max(1);
            let Some(id) = self.owner(FrameId::from_raw(f as u32)) else { continue };
            if !release.contains(&(f / FRAMES_PER_SEGMENT))
                && !self.meta.has(id, PINNED)
                && self.is_live(id)
            {
                self.drop_bytes(id);
                self.dropped += 1;
                report.contents_dropped += 1;
                return true;
            }
        }
        false
    }

    /// Frames of segment `seg` still in use (by unpinned contents, after evacuation), and
    /// the references (index entries) held on their contents, about to lose their bytes.
    fn stale_frames_and_refs(&self, seg: usize) -> (usize, usize) {
        // One pass over the segment's flag bytes: most frames hold the content their
        // number names, with one reference. This runs for every segment a shrink releases.
        let first = seg * FRAMES_PER_SEGMENT;
        let last = (first + FRAMES_PER_SEGMENT - 1) as ContentId;
        if !self.meta.covers(last) {
            // Never a content in it (ids are covered when their segment is first used).
            return (0, 0);
        }
        let flags = self.meta.of_frames(first, FRAMES_PER_SEGMENT);
        let (mut frames, mut refs) = (0, 0);
        for (i, byte) in flags.iter().enumerate() {
            let id = (first + i) as ContentId;
            let own = Meta::in_own_frame(byte.load(std::sync::atomic::Ordering::Relaxed));
            let owner = if own { Some(id) } else { self.owner(FrameId::from_raw(id)) };
            if let Some(owner) = owner {
                frames += 1;
                refs += usize::from(self.meta.refs(owner));
            }
        }
        (frames, refs)
    }

    /// Drops unpinned pages until no more than `limit` frames are in use.
    fn drop_unpinned_until(&mut self, limit: usize, report: &mut ShrinkReport) {
        let mut f = 0;
        while self.arena.used() > limit && f < self.arena.frame_table_len() {
            let owner = self.owner(FrameId::from_raw(f as u32));
            if let Some(id) = owner.filter(|&id| !self.meta.has(id, PINNED) && self.is_live(id)) {
                self.drop_bytes(id);
                self.dropped += 1;
                report.contents_dropped += 1;
            }
            f += 1;
        }
    }
}
