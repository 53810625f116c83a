//! What a page's bytes are, computed once per put before any lock is taken: a fill
//! pattern (no frame needed), or a content hash and checksum (for dedup and integrity).

use fallow_core::{DedupScope, PAGE_SIZE};

/// A page whose every 8-byte word is the same costs no frame: the word is kept in the
/// index entry (zero-filled pages are the common case, as in zswap's same-filled pages).
pub fn fill_word(page: &[u8]) -> Option<u64> {
    debug_assert_eq!(page.len(), PAGE_SIZE);
    let (first, rest) = page.split_at(8);
    // Comparing each 8-byte chunk with the first is what the CPU does well: no branch per
    // byte, and the loop stops at the first difference, which for real data is early.
    rest.chunks_exact(8).all(|c| c == first).then(|| u64::from_ne_bytes(first_word(first)))
}

fn first_word(b: &[u8]) -> [u8; 8] {
    let mut w = [0u8; 8];
    w.copy_from_slice(b);
    w
}

/// Writes a fill pattern back into a page buffer.
pub fn write_fill(word: u64, out: &mut [u8]) {
    let w = word.to_ne_bytes();
    out.chunks_exact_mut(8).for_each(|c| c.copy_from_slice(&w));
}

/// A page's 128-bit content hash, seeded with its trust domain so that identical pages in
/// different domains never meet in the dedup table. `None` when dedup is off.
pub fn content_hash(page: &[u8], scope: DedupScope) -> Option<u128> {
    match scope {
        DedupScope::Domain(domain) => Some(xxhash_rust::xxh3::xxh3_128_with_seed(page, domain.0)),
        DedupScope::Off => None,
    }
}

/// The checksum kept beside every stored page and checked on every read.
pub fn checksum(page: &[u8]) -> u32 {
    crc32c::crc32c(page)
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use fallow_core::TrustDomain;

    #[test]
    fn fill_words_are_found_and_restored() {
        let mut page = vec![0u8; PAGE_SIZE];
        assert_eq!(fill_word(&page), Some(0));
        write_fill(0x0102_0304_0506_0708, &mut page);
        let w = fill_word(&page).unwrap();
        let mut back = vec![0u8; PAGE_SIZE];
        write_fill(w, &mut back);
        assert_eq!(page, back);
        page[4095] ^= 1;
        assert_eq!(fill_word(&page), None);
    }

    #[test]
    fn domains_change_the_hash() {
        let page = vec![9u8; PAGE_SIZE];
        let a = content_hash(&page, DedupScope::Domain(TrustDomain(1)));
        let b = content_hash(&page, DedupScope::Domain(TrustDomain(2)));
        assert_ne!(a, b);
        assert_eq!(content_hash(&page, DedupScope::Off), None);
    }
}
