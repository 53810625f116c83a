//! Zero-filled arrays of integers for the engine's hash tables ([`crate::id_table`]),
//! mapped from the OS when large, so that dropping one gives its memory back at once.
//!
//! A table that grows allocates larger arrays and frees the old ones. glibc's allocator
//! serves large arrays with a mapping of their own, but raises its threshold for doing so
//! to the size of each such array freed (up to 32 MiB), so the next arrays come from the
//! heap, where a freed block stays resident unless it sits at the heap's top. The memory
//! bench measured it: the tables' doublings left ~2–4 B a page of resident memory that no
//! table held (RFC 0001, "Outcome"). A mapping of our own goes back with `munmap` when
//! dropped, and, like `calloc`'s memory, is zero and not resident until written.

use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use memmap2::MmapMut;

/// Arrays of a page or more are mapped; smaller ones come from the heap, where a mapping
/// of their own would waste most of a page. Measured: a 64 KiB threshold left the small
/// tables' growth (a shard's index tables start small and double) in the heap, ~210 KiB
/// resident that no table held at 256 MiB, 3.3 B a page.
const MAP_BYTES: usize = 4 << 10;

/// The element types a zeroed array can hold: integers, valid as all-zero bytes and as
/// any bytes at all.
pub(crate) trait Int: Copy + Default + 'static {}
impl Int for u32 {}
impl Int for u64 {}

/// A fixed-size array of `T`, all zero when made.
pub(crate) struct Zeroed<T: Int> {
    /// The first element, and how many: read on every probe of a table, so kept apart
    /// from `owner` and used without matching on it.
    ptr: NonNull<T>,
    len: usize,
    /// What holds the memory `ptr` points into; only dropped.
    _owner: Owner<T>,
}

enum Owner<T> {
    Heap(#[allow(dead_code)] Box<[T]>),
    /// `len` elements of `T` at the start of the mapping (page-aligned, so aligned for `T`).
    Mapped(#[allow(dead_code)] MmapMut),
}

// SAFETY: a `Zeroed` owns its elements as a `Box<[T]>` does (`ptr` points only into
// `_owner`, which nothing else can reach), and `T` is a plain integer.
unsafe impl<T: Int> Send for Zeroed<T> {}
// SAFETY: as for `Send`; shared access only reads, through `&self`.
unsafe impl<T: Int> Sync for Zeroed<T> {}

impl<T: Int> Zeroed<T> {
    /// `len` zeros.
    pub(crate) fn new(len: usize) -> Self {
        let bytes = len.saturating_mul(size_of::<T>());
        if bytes >= MAP_BYTES {
            // A failed mapping falls back to the heap, which fails as it always has.
            if let Ok(mut map) = MmapMut::map_anon(bytes) {
                let ptr =
                    NonNull::new(map.as_mut_ptr().cast::<T>()).expect("a mapping is not null");
                return Self { ptr, len, _owner: Owner::Mapped(map) };
            }
        }
        Self::on_heap(vec![T::default(); len].into_boxed_slice())
    }

    fn on_heap(mut b: Box<[T]>) -> Self {
        // A box's elements stay where they are when the box moves.
        let (ptr, len) = (NonNull::from(&mut *b).cast::<T>(), b.len());
        Self { ptr, len, _owner: Owner::Heap(b) }
    }

    #[cfg(test)]
    fn is_mapped(&self) -> bool {
        matches!(self._owner, Owner::Mapped(_))
    }
}

impl<T: Int> Default for Zeroed<T> {
    fn default() -> Self {
        Self::on_heap(Box::default())
    }
}

impl<T: Int> Deref for Zeroed<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `ptr` points to `len` initialized `T`s (zero, or written through
        // `deref_mut`; every bit pattern is a valid `T`) in `_owner`, aligned (a box's, or
        // a page-aligned mapping), which lives and stays put as long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Int> DerefMut for Zeroed<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_and_large_arrays_start_zero_and_keep_what_is_written() {
        for len in [0, 1, 100, MAP_BYTES / 8 - 1, MAP_BYTES / 8, 3 * MAP_BYTES] {
            let mut a = Zeroed::<u64>::new(len);
            assert_eq!(a.len(), len);
            assert!(a.iter().all(|&x| x == 0), "{len} zeros");
            if let Some(last) = a.last_mut() {
                *last = u64::MAX;
            }
            a.iter_mut().step_by(511).for_each(|x| *x = 7);
            assert_eq!(
                a.last().copied(),
                (len > 0).then(|| if (len - 1) % 511 == 0 { 7 } else { u64::MAX })
            );
        }
        assert!(Zeroed::<u32>::new(MAP_BYTES).is_mapped(), "large arrays are mapped");
        assert!(!Zeroed::<u32>::new(8).is_mapped());
        assert!(Zeroed::<u64>::default().is_empty());
    }
}
