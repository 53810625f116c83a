//! Per-content arrays indexed by content id.
//!
//! A content's id is the number of the frame it was first stored in, whenever that number
//! is not still taken by an older content (see `places.rs`); so ids below [`VIRTUAL_BASE`]
//! are frame numbers and index one vector, sized like a per-frame table, and the others
//! (2³⁰ and up) index a [`Chunked`] table, never moved as it grows (a compressing engine's
//! virtual ids number its compressed pages).

use std::ops::{Index, IndexMut};

use super::chunked::Chunked;
use super::ContentId;

/// The first id that is not a frame number. Frame numbers stay below it
/// (`arena::MAX_SEGMENTS`), and every id below 2³¹, the slot's fill bit.
pub const VIRTUAL_BASE: ContentId = 1 << 30;

/// How many virtual ids there are: from [`VIRTUAL_BASE`] up to 2³¹, the slot's fill bit.
pub const VIRTUAL_IDS: usize = 1 << 30;

/// A `T` per content id.
pub struct ById<T> {
    frames: Vec<T>,
    /// Entries of virtual ids, by `id - VIRTUAL_BASE`.
    virtual_ids: Chunked<T>,
    /// The most virtual ids: [`VIRTUAL_IDS`], less in tests.
    virtual_cap: usize,
}

impl<T> Default for ById<T> {
    fn default() -> Self {
        Self { frames: Vec::new(), virtual_ids: Chunked::default(), virtual_cap: VIRTUAL_IDS }
    }
}

impl<T: Default> ById<T> {
    /// Makes room for every frame number below `frames`, for a store expected to hold
    /// `expected` frames (reserved once, [`crate::dense::grow`]).
    #[inline]
    pub fn cover_frames(&mut self, frames: usize, expected: usize) {
        if self.frames.len() < frames {
            crate::dense::grow(&mut self.frames, frames, expected);
            self.frames.resize_with(frames, T::default);
        }
    }

    /// Adds an entry for the next id above [`VIRTUAL_BASE`], and returns that id; `None`
    /// when every virtual id has one (reachable only near the largest budgets, with most
    /// pages compressed: the caller does without).
    pub fn push_virtual(&mut self) -> Option<ContentId> {
        let n = self.virtual_ids.len();
        if n >= self.virtual_cap {
            return None;
        }
        self.virtual_ids.extend_to(n + 1);
        Some(VIRTUAL_BASE + n as ContentId)
    }

    /// Caps the virtual ids at `cap`, for tests of running out of them.
    #[cfg(test)]
    pub fn cap_virtual(&mut self, cap: usize) {
        self.virtual_cap = cap;
    }
}

impl<T> ById<T> {
    /// Entries: frame numbers covered, then virtual ids.
    pub fn len(&self) -> usize {
        self.frames.len() + self.virtual_ids.len()
    }

    /// The id of the `pos`-th entry (`pos < len()`): a position for clock hands and steps.
    pub fn id_at(&self, pos: usize) -> ContentId {
        if pos < self.frames.len() {
            pos as ContentId
        } else {
            VIRTUAL_BASE + (pos - self.frames.len()) as ContentId
        }
    }

    /// The entries of frame numbers `first..first + n` (all covered).
    pub fn frames(&self, first: usize, n: usize) -> &[T] {
        &self.frames[first..first + n]
    }

    /// True when `id` has an entry.
    pub fn covers(&self, id: ContentId) -> bool {
        if id < VIRTUAL_BASE {
            (id as usize) < self.frames.len()
        } else {
            ((id - VIRTUAL_BASE) as usize) < self.virtual_ids.len()
        }
    }

    /// Every id with an entry.
    pub fn ids(&self) -> impl Iterator<Item = ContentId> + '_ {
        (0..self.len()).map(|pos| self.id_at(pos))
    }

    /// Heap bytes, by length: the frame table's reservation past it is address space.
    pub fn resident_bytes(&self) -> usize {
        crate::dense::resident_bytes(&self.frames) + self.virtual_ids.heap_bytes()
    }
}

impl<T> Index<ContentId> for ById<T> {
    type Output = T;

    #[inline]
    fn index(&self, id: ContentId) -> &T {
        if id < VIRTUAL_BASE {
            &self.frames[id as usize]
        } else {
            &self.virtual_ids[(id - VIRTUAL_BASE) as usize]
        }
    }
}

impl<T> IndexMut<ContentId> for ById<T> {
    #[inline]
    fn index_mut(&mut self, id: ContentId) -> &mut T {
        if id < VIRTUAL_BASE {
            &mut self.frames[id as usize]
        } else {
            &mut self.virtual_ids[(id - VIRTUAL_BASE) as usize]
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::chunked::CHUNK;
    use super::*;

    #[test]
    fn frame_numbers_and_virtual_ids_index_their_own_vectors() {
        let mut v = ById::<u8>::default();
        v.cover_frames(4, 8);
        let (a, b) = (v.push_virtual().unwrap(), v.push_virtual().unwrap());
        assert_eq!((a, b), (VIRTUAL_BASE, VIRTUAL_BASE + 1));
        v[3] = 3;
        v[b] = 9;
        assert_eq!(v.ids().collect::<Vec<_>>(), [0, 1, 2, 3, VIRTUAL_BASE, VIRTUAL_BASE + 1]);
        assert_eq!((v[3], v[a], v[b]), (3, 0, 9));
        v.cover_frames(6, 8);
        assert_eq!((v.len(), v[3], v[b]), (8, 3, 9), "covering more frames keeps entries");
        for n in 2..CHUNK as ContentId + 3 {
            assert_eq!(v.push_virtual(), Some(VIRTUAL_BASE + n), "past a chunk's end too");
        }
        let past = VIRTUAL_BASE + CHUNK as ContentId + 1;
        v[past] = 7;
        assert_eq!((v[past], v[b]), (7, 9), "an entry past a chunk's end, and one before");
        assert_eq!(v.ids().last(), Some(VIRTUAL_BASE + CHUNK as ContentId + 2));
        v.cap_virtual(CHUNK + 4);
        assert_eq!(v.push_virtual(), Some(VIRTUAL_BASE + CHUNK as ContentId + 3));
        assert_eq!(v.push_virtual(), None, "no id past the cap");
        assert_eq!(VIRTUAL_BASE as usize + VIRTUAL_IDS, 1 << 31, "virtual ids end at the fill bit");
    }
}
