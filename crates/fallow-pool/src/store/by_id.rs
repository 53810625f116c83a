//! Per-content arrays indexed by content id.
//!
//! A content's id is the number of the frame it was first stored in, whenever that number
//! is not still taken by an older content (see `places.rs`); so ids below [`VIRTUAL_BASE`]
//! are frame numbers and index one vector, sized like a per-frame table, and the others
//! (2³⁰ and up) index chunks of [`CHUNK`] entries, added as ids are and never moved: a
//! vector doubling would copy them all under the store lock (a compressing engine's
//! virtual ids number its compressed pages).

use std::ops::{Index, IndexMut};

use super::ContentId;

/// The first id that is not a frame number. Frame numbers stay below it
/// (`arena::MAX_SEGMENTS`), and every id below 2³¹, the slot's fill bit.
pub const VIRTUAL_BASE: ContentId = 1 << 30;

/// How many virtual ids there are: from [`VIRTUAL_BASE`] up to 2³¹, the slot's fill bit.
pub const VIRTUAL_IDS: usize = 1 << 30;

/// Virtual ids per chunk.
const CHUNK: usize = 4096;

/// A `T` per content id.
pub struct ById<T> {
    frames: Vec<T>,
    /// Entries of virtual ids, `CHUNK` to a chunk.
    virtual_chunks: Vec<Box<[T]>>,
    /// Virtual ids with an entry.
    virtual_len: usize,
    /// The most virtual ids: [`VIRTUAL_IDS`], less in tests.
    virtual_cap: usize,
}

impl<T> Default for ById<T> {
    fn default() -> Self {
        Self {
            frames: Vec::new(),
            virtual_chunks: Vec::new(),
            virtual_len: 0,
            virtual_cap: VIRTUAL_IDS,
        }
    }
}

impl<T: Default> ById<T> {
    /// Makes room for every frame number below `frames`, for a store expected to hold
    /// `expected` frames (reserved once, [`crate::dense::grow`]).
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
        let n = self.virtual_len;
        if n >= self.virtual_cap {
            return None;
        }
        if n == self.virtual_chunks.len() * CHUNK {
            self.virtual_chunks.push((0..CHUNK).map(|_| T::default()).collect());
        }
        self.virtual_len += 1;
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
        self.frames.len() + self.virtual_len
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
            ((id - VIRTUAL_BASE) as usize) < self.virtual_len
        }
    }

    /// Every id with an entry.
    pub fn ids(&self) -> impl Iterator<Item = ContentId> + '_ {
        (0..self.len()).map(|pos| self.id_at(pos))
    }

    /// Heap bytes, by length: the frame table's reservation past it is address space.
    pub fn resident_bytes(&self) -> usize {
        use std::mem::size_of;
        crate::dense::resident_bytes(&self.frames)
            + self.virtual_chunks.len() * CHUNK * size_of::<T>()
            + self.virtual_chunks.capacity() * size_of::<Box<[T]>>()
    }
}

impl<T> Index<ContentId> for ById<T> {
    type Output = T;

    #[inline]
    fn index(&self, id: ContentId) -> &T {
        if id < VIRTUAL_BASE {
            &self.frames[id as usize]
        } else {
            let n = (id - VIRTUAL_BASE) as usize;
            debug_assert!(n < self.virtual_len, "virtual id {id} has no entry");
            &self.virtual_chunks[n / CHUNK][n % CHUNK]
        }
    }
}

impl<T> IndexMut<ContentId> for ById<T> {
    #[inline]
    fn index_mut(&mut self, id: ContentId) -> &mut T {
        if id < VIRTUAL_BASE {
            &mut self.frames[id as usize]
        } else {
            let n = (id - VIRTUAL_BASE) as usize;
            debug_assert!(n < self.virtual_len, "virtual id {id} has no entry");
            &mut self.virtual_chunks[n / CHUNK][n % CHUNK]
        }
    }
}

#[cfg(test)]
mod tests {
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
        assert_eq!((v[past], v[b], v.virtual_chunks.len()), (7, 9, 2));
        assert_eq!(v.ids().last(), Some(VIRTUAL_BASE + CHUNK as ContentId + 2));
        v.cap_virtual(CHUNK + 4);
        assert_eq!(v.push_virtual(), Some(VIRTUAL_BASE + CHUNK as ContentId + 3));
        assert_eq!(v.push_virtual(), None, "no id past the cap");
        assert_eq!(VIRTUAL_BASE as usize + VIRTUAL_IDS, 1 << 31, "virtual ids end at the fill bit");
    }
}
