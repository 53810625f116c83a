//! The bytes of compressed contents, by content id, in a table that grows without ever
//! moving what it holds.
//!
//! A `HashMap` doubles by rehashing every entry at once, and the compressor inserts with
//! every shard lock held: at 57,344 compressed pages the doubling held every get for ~4 ms
//! (a 256 MiB engine; `compress_cold(32)` passes, session 10), and a larger cache waits
//! longer. Most compressed contents have virtual ids (`compress.rs` renames a content that
//! one entry names), which are dense from [`VIRTUAL_BASE`]: their blobs sit in a
//! [`Chunked`] table, never moved as it grows. The few compressed contents that keep a
//! frame number as their id (several entries name them) go in a small map.

use std::collections::HashMap;

use super::by_id::VIRTUAL_BASE;
use super::chunked::Chunked;
use super::ContentId;

/// Compressed contents' bytes by content id.
#[derive(Default)]
pub struct Blobs {
    /// By `id - VIRTUAL_BASE`: a compressed content's lz4 bytes, or nothing.
    virtual_ids: Chunked<Option<Box<[u8]>>>,
    /// Blobs of contents whose id is a frame number.
    framed: HashMap<ContentId, Box<[u8]>>,
    len: usize,
}

impl Blobs {
    /// The blob of content `id`, if it has one.
    pub fn get(&self, id: ContentId) -> Option<&[u8]> {
        match virtual_pos(id) {
            Some(pos) => self.virtual_ids.get(pos)?.as_deref(),
            None => self.framed.get(&id).map(|b| &b[..]),
        }
    }

    /// True when content `id` has a blob.
    pub fn contains(&self, id: ContentId) -> bool {
        self.get(id).is_some()
    }

    /// Gives content `id` its blob (it had none).
    pub fn insert(&mut self, id: ContentId, blob: Box<[u8]>) {
        let old = match virtual_pos(id) {
            Some(pos) => {
                self.virtual_ids.extend_to(pos + 1);
                self.virtual_ids[pos].replace(blob)
            }
            None => self.framed.insert(id, blob),
        };
        debug_assert!(old.is_none(), "content {id} had a blob");
        self.len += 1;
    }

    /// Takes content `id`'s blob away.
    pub fn remove(&mut self, id: ContentId) -> Option<Box<[u8]>> {
        let blob = match virtual_pos(id) {
            Some(pos) => self.virtual_ids.get_mut(pos)?.take(),
            None => self.framed.remove(&id),
        };
        self.len -= usize::from(blob.is_some());
        blob
    }

    /// Compressed contents.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Every content with a blob, and the blob.
    pub fn iter(&self) -> impl Iterator<Item = (ContentId, &[u8])> + '_ {
        let virtual_ids = self.virtual_ids.iter().enumerate().filter_map(|(pos, blob)| {
            blob.as_deref().map(|b| (VIRTUAL_BASE + pos as ContentId, b))
        });
        self.framed.iter().map(|(&id, b)| (id, &b[..])).chain(virtual_ids)
    }

    /// Heap bytes of the tables (not of the blobs, which the budget counts).
    pub fn heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(ContentId, Box<[u8]>)>() + 1;
        self.virtual_ids.heap_bytes() + self.framed.capacity() * entry
    }
}

/// The position of virtual id `id`; `None` for a frame number.
fn virtual_pos(id: ContentId) -> Option<usize> {
    Some(id.checked_sub(VIRTUAL_BASE)? as usize)
}

#[cfg(test)]
mod tests {
    use super::super::chunked::CHUNK;
    use super::*;

    #[test]
    fn virtual_ids_and_frame_numbers_keep_their_blobs_apart() {
        let mut b = Blobs::default();
        let far = VIRTUAL_BASE + 3 * CHUNK as ContentId + 5;
        b.insert(7, vec![1].into());
        b.insert(VIRTUAL_BASE, vec![2].into());
        b.insert(far, vec![3].into());
        assert_eq!((b.len(), b.virtual_ids.len()), (3, 3 * CHUNK + 6), "up to the highest id");
        assert_eq!(
            (b.get(7), b.get(VIRTUAL_BASE), b.get(far)),
            (Some(&[1][..]), Some(&[2][..]), Some(&[3][..]))
        );
        assert!(!b.contains(8) && !b.contains(VIRTUAL_BASE + 1) && !b.contains(far + CHUNK as u32));
        let mut all: Vec<_> = b.iter().map(|(id, blob)| (id, blob[0])).collect();
        all.sort_unstable();
        assert_eq!(all, [(7, 1), (VIRTUAL_BASE, 2), (far, 3)]);
        assert_eq!(b.remove(VIRTUAL_BASE).as_deref(), Some(&[2][..]));
        assert_eq!((b.remove(VIRTUAL_BASE), b.len()), (None, 2));
        assert_eq!(b.remove(7).as_deref(), Some(&[1][..]));
        assert_eq!(b.len(), 1);
    }
}
