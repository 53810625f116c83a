//! What a page's bytes are, computed once per put before any lock is taken: a fill
//! pattern (no frame needed), or the checksum the store keeps (for integrity and dedup).
//! The functions themselves live in `fallow_core::content`: clients compute the same
//! values to dedup across nodes.

use fallow_core::DedupScope;

pub use fallow_core::content::{
    checksum, content_hash, dedup_key, domain_mask, fill_word, stored_checksum, write_fill,
};

/// Everything the store needs to know about a page to be put, computed without a lock.
#[derive(Debug, Clone, Copy)]
pub struct Digest {
    /// The checksum as stored ([`stored_checksum`]): the CRC-32C of the bytes, masked by
    /// the pool's trust domain. Also the page's key in the dedup table.
    pub sum: u32,
    /// The pool dedups: the store looks for a duplicate and enters the page in its dedup
    /// table.
    pub dedup: bool,
}

impl Digest {
    /// Digests one page for a pool with `scope`.
    pub fn of(page: &[u8], scope: DedupScope) -> Self {
        Self::of_checksum(checksum(page), scope)
    }

    /// The digest of a page whose CRC-32C is `crc` (a put by hash, whose bytes stayed with
    /// the client).
    pub fn of_checksum(crc: u32, scope: DedupScope) -> Self {
        Self { sum: stored_checksum(crc, scope), dedup: scope != DedupScope::Off }
    }

    /// Digests a page unless it is a fill page (which is never stored).
    pub fn of_unless_fill(page: &[u8], fill: Option<u64>, scope: DedupScope) -> Self {
        match fill {
            Some(_) => Self { sum: 0, dedup: false },
            None => Self::of(page, scope),
        }
    }
}
