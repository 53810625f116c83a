//! What a page's bytes are, computed once per put before any lock is taken: a fill
//! pattern (no frame needed), or a content hash and checksum (for dedup and integrity).
//! The functions themselves live in `fallow_core::content`: clients compute the same hash
//! to dedup across nodes.

use fallow_core::DedupScope;

pub use fallow_core::content::{checksum, content_hash, fill_word, hash_tag, tag_key, write_fill};

/// Everything the store needs to know about a page to be put, computed without a lock.
#[derive(Debug, Clone, Copy)]
pub struct Digest {
    /// Dedup hash, or `None` when the pool does not dedup.
    pub hash: Option<u128>,
    /// crc32c of the bytes.
    pub crc: u32,
}

impl Digest {
    /// Digests one page for a pool with `scope`.
    pub fn of(page: &[u8], scope: DedupScope) -> Self {
        Self { hash: content_hash(page, scope), crc: checksum(page) }
    }

    /// Digests a page unless it is a fill page (which is never hashed nor stored).
    pub fn of_unless_fill(page: &[u8], fill: Option<u64>, scope: DedupScope) -> Self {
        match fill {
            Some(_) => Self { hash: None, crc: 0 },
            None => Self::of(page, scope),
        }
    }
}
