//! A vector that grows a chunk at a time and never moves what it holds: for per-id tables
//! the store grows while it holds every lock (the virtual ids' records and flags,
//! `by_id.rs`; the compressed pages' bytes, `blobs.rs`). A `Vec` doubling there copies the
//! whole table under the lock (`blobs.rs` measured a `HashMap`'s: ~4 ms at 57,344
//! entries).

use std::ops::{Index, IndexMut};

/// Entries per chunk.
pub const CHUNK: usize = 4096;

/// `T`s at positions `0..len()`, in chunks of [`CHUNK`].
pub struct Chunked<T> {
    chunks: Vec<Box<[T]>>,
    len: usize,
}

impl<T> Default for Chunked<T> {
    fn default() -> Self {
        Self { chunks: Vec::new(), len: 0 }
    }
}

impl<T: Default> Chunked<T> {
    /// Makes positions up to `len` exist (new ones default), adding chunks as needed.
    pub fn extend_to(&mut self, len: usize) {
        while self.chunks.len() * CHUNK < len {
            self.chunks.push((0..CHUNK).map(|_| T::default()).collect());
        }
        self.len = self.len.max(len);
    }
}

impl<T> Chunked<T> {
    /// Positions that exist.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The entry at `pos`, if it exists.
    pub fn get(&self, pos: usize) -> Option<&T> {
        (pos < self.len).then(|| &self.chunks[pos / CHUNK][pos % CHUNK])
    }

    /// Every entry, by position.
    pub fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        self.chunks.iter().flat_map(|c| c.iter()).take(self.len)
    }

    /// Heap bytes: whole chunks, and the chunk list.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.chunks.len() * CHUNK * size_of::<T>() + self.chunks.capacity() * size_of::<Box<[T]>>()
    }
}

impl<T> Index<usize> for Chunked<T> {
    type Output = T;

    #[inline]
    fn index(&self, pos: usize) -> &T {
        debug_assert!(pos < self.len, "position {pos} of {}", self.len);
        &self.chunks[pos / CHUNK][pos % CHUNK]
    }
}

impl<T> IndexMut<usize> for Chunked<T> {
    #[inline]
    fn index_mut(&mut self, pos: usize) -> &mut T {
        debug_assert!(pos < self.len, "position {pos} of {}", self.len);
        &mut self.chunks[pos / CHUNK][pos % CHUNK]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_keep_their_place_as_chunks_are_added() {
        let mut c = Chunked::<u32>::default();
        c.extend_to(3);
        c[2] = 7;
        let at = &c[2] as *const u32;
        c.extend_to(2 * CHUNK + 1);
        assert_eq!((c.len(), c.chunks.len(), c[2]), (2 * CHUNK + 1, 3, 7));
        assert_eq!(&c[2] as *const u32, at, "never moved");
        c[2 * CHUNK] = 9;
        assert_eq!((c.get(2 * CHUNK), c.get(2 * CHUNK + 1)), (Some(&9), None));
        assert_eq!(c.iter().count(), 2 * CHUNK + 1);
        assert_eq!(c.iter().filter(|&&x| x != 0).count(), 2);
        c.extend_to(5);
        assert_eq!(c.len(), 2 * CHUNK + 1, "never shrinks");
    }
}
