//! What a page's bytes are, as every part of fallow computes it: a fill pattern (a page
//! that needs no frame), a 128-bit content hash (for dedup, on a node and across nodes)
//! and a checksum (for integrity). Clients compute the same hash as the engine, so a
//! client can tell a node "you already hold this content" ([`ContentFilter`], the PUT_HASHES
//! request of `docs/protocol.md`) instead of sending the page.

mod filter;

pub use filter::{ContentFilter, FilterError, MAX_FILTER_HASHES};

use crate::{DedupScope, PAGE_SIZE};

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
/// different domains never meet in the dedup table: XXH3-128 of the 4096 bytes with the
/// domain as its 64-bit seed. `None` when dedup is off. Part of the wire protocol (a
/// PUT_HASHES request carries it), so it never changes within a protocol version.
pub fn content_hash(page: &[u8], scope: DedupScope) -> Option<u128> {
    match scope {
        // twox-hash picks AVX2 at run time where the CPU has it: about twice as fast on a
        // page as an SSE2 build, and the same value (the test vector below).
        DedupScope::Domain(domain) => {
            Some(twox_hash::XxHash3_128::oneshot_with_seed(domain.0, page))
        }
        DedupScope::Off => None,
    }
}

/// What a node keeps of a content hash: its low 32 bits, the *tag*. A node finds a
/// stored page that may have the same content by its tag, then compares the bytes (a put
/// with its bytes) or recomputes the stored page's full hash (a put by hash), so a tag
/// collision never shares different pages; keeping 4 bytes of the hash instead of 16
/// keeps the per-page metadata small.
pub fn hash_tag(hash: u128) -> u32 {
    hash as u32
}

/// The 64-bit key of a content hash, in a node's dedup table and in its content summary:
/// its tag ([`hash_tag`]) spread over 64 bits ([`tag_key`]).
pub fn hash_key(hash: u128) -> u64 {
    tag_key(hash_tag(hash))
}

/// [`hash_key`] from the tag alone: splitmix64's finalizer of it, a bijection, so that the
/// summary's probes (which take their key as uniform) are spread over all 64 bits.
pub fn tag_key(tag: u32) -> u64 {
    let mut z = u64::from(tag);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The checksum kept beside every stored page and checked on every read: CRC-32C.
pub fn checksum(page: &[u8]) -> u32 {
    crc32c::crc32c(page)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TrustDomain;

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

    /// Golden values: the hash and checksum travel in PUT_HASHES, so a change here breaks
    /// every client of another build.
    #[test]
    fn hash_and_checksum_are_stable() {
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i % 251) as u8).collect();
        let hash = content_hash(&page, DedupScope::Domain(TrustDomain(7))).unwrap();
        assert_eq!(format!("{hash:032x}"), GOLDEN_HASH);
        assert_eq!(checksum(&page), GOLDEN_CRC);
    }

    /// Golden values: the key is what a summary's probes are computed from.
    #[test]
    fn the_key_spreads_the_low_32_bits() {
        assert_eq!(hash_tag(7u128 << 64 | 3 << 32 | 5), 5);
        assert_eq!(hash_key(7u128 << 64 | 3 << 32 | 5), 0xb6bf_613d_bebb_45dc);
        assert_eq!(tag_key(1), 0x5692_161d_100b_05e5);
    }

    const GOLDEN_HASH: &str = "334e57890d1f0bd183cc3ece121c17c5";
    const GOLDEN_CRC: u32 = 1905293308;
}
