//! What a page's bytes are, as every part of fallow computes it: a fill pattern (a page
//! that needs no frame), a 128-bit content hash (what a client sends in place of a page a
//! node already holds) and a checksum (for integrity, and, masked by the page's trust
//! domain, what a node finds duplicates by: [`stored_checksum`]). Clients compute the same
//! values as the engine, so a client can tell a node "you already hold this content"
//! ([`ContentFilter`], the PUT_HASHES request of `docs/protocol.md`) instead of sending the
//! page.

mod filter;

pub use filter::{ContentFilter, FilterError, MAX_FILTER_HASHES};

use crate::{DedupScope, TrustDomain, PAGE_SIZE};

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
        DedupScope::Domain(domain) => Some(domain_content_hash(page, domain)),
        DedupScope::Off => None,
    }
}

/// [`content_hash`] in a trust domain.
pub fn domain_content_hash(page: &[u8], domain: TrustDomain) -> u128 {
    // twox-hash picks AVX2 at run time where the CPU has it: about twice as fast on a page
    // as an SSE2 build, and the same value (the test vector below).
    twox_hash::XxHash3_128::oneshot_with_seed(domain.0, page)
}

/// What a node stores beside a page in place of its checksum: the page's CRC-32C
/// ([`checksum`]) XORed with a mask drawn from its trust domain ([`domain_mask`]). The
/// stored checksum is also what a node finds a page's duplicates by (its key in the dedup
/// table and in the content summary: [`dedup_key`]), so that a page costs 4 bytes for
/// both its integrity and its dedup, not 4 for a checksum and 4 for a piece of its content
/// hash. Masking by domain keeps domains apart: identical pages of two domains have
/// different stored checksums (unless the two masks are equal, which a node checks when
/// it creates a pool), so they never match. A stored checksum that matches is a
/// candidate only: a node compares the bytes (a put with its bytes) or recomputes the
/// stored page's full content hash (a put by hash) before sharing a page. Part of the
/// wire protocol (the content summary is built from it), so it never changes within a
/// protocol version.
pub fn stored_checksum(crc: u32, scope: DedupScope) -> u32 {
    crc ^ domain_mask(scope)
}

/// A trust domain's checksum mask ([`stored_checksum`]): the low 32 bits of splitmix64's
/// finalizer of the domain. 0 when dedup is off (such pages are never looked up).
pub fn domain_mask(scope: DedupScope) -> u32 {
    match scope {
        DedupScope::Domain(domain) => spread(domain.0) as u32,
        DedupScope::Off => 0,
    }
}

/// The 64-bit key of a stored checksum ([`stored_checksum`]), in a node's dedup table
/// and in its content summary ([`ContentFilter`]): the checksum spread over 64 bits, so
/// that the summary's probes (which take their key as uniform) use all of them.
pub fn dedup_key(stored: u32) -> u64 {
    spread(u64::from(stored))
}

/// The key a page of a pool with `scope` has in a node's content summary: `None` when
/// its pool does not dedup. What a client computes to ask whether a node holds a page.
pub fn page_dedup_key(crc: u32, scope: DedupScope) -> Option<u64> {
    match scope {
        DedupScope::Domain(_) => Some(dedup_key(stored_checksum(crc, scope))),
        DedupScope::Off => None,
    }
}

/// splitmix64's finalizer: a bijection of 64-bit values that spreads every input bit
/// over all output bits.
fn spread(mut z: u64) -> u64 {
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

    /// Golden values: the key is what a summary's probes are computed from, and the mask
    /// what a node stores; a change here breaks every client of another build.
    #[test]
    fn the_stored_checksum_and_its_key_are_stable() {
        let domain = DedupScope::Domain(TrustDomain(7));
        assert_eq!(domain_mask(domain), 0x7b17_df14);
        assert_eq!(domain_mask(DedupScope::Off), 0);
        assert_eq!(stored_checksum(GOLDEN_CRC, domain), GOLDEN_CRC ^ 0x7b17_df14);
        assert_eq!(dedup_key(1), 0x5692_161d_100b_05e5);
        assert_eq!(page_dedup_key(5, domain), Some(dedup_key(5 ^ 0x7b17_df14)));
        assert_eq!(page_dedup_key(5, DedupScope::Off), None);
    }

    #[test]
    fn domains_store_one_page_under_different_checksums() {
        let crc = 0x1234_5678;
        let (a, b) = (DedupScope::Domain(TrustDomain(1)), DedupScope::Domain(TrustDomain(2)));
        assert_ne!(stored_checksum(crc, a), stored_checksum(crc, b));
        assert_ne!(page_dedup_key(crc, a), page_dedup_key(crc, b));
    }

    const GOLDEN_HASH: &str = "334e57890d1f0bd183cc3ece121c17c5";
    const GOLDEN_CRC: u32 = 1905293308;
}
