//! A Bloom filter over stored pages: a node's summary of the pages it holds, fetched by
//! clients (CONTENT_SUMMARY) so that they send a page's hash instead of its bytes when the
//! node probably holds it already.
//!
//! The items are dedup keys ([`super::dedup_key`]: a page's stored checksum, its CRC-32C
//! masked by its trust domain, spread over 64 bits), already uniform, so nothing is hashed
//! again: the i-th probe of key `k` is bit `(lo + i × hi) mod m` (Kirsch and
//! Mitzenmacher's double hashing), where `lo = k`, `hi` is `k` rotated by 32 bits with its
//! lowest bit set, and `m` the filter's size in bits. Bit `b` is bit `b mod 8` (least
//! significant first) of byte `b / 8`.
//! `docs/protocol.md` gives the same rule for other implementations.
//!
//! A false positive costs one extra round trip (the node answers "not held" and the client
//! sends the page); a false negative cannot happen for content held when the filter was
//! built. Content that arrived later is simply not in it until the next build.

/// The most probes per item a filter may use; more buys nothing at any useful size.
pub const MAX_FILTER_HASHES: u8 = 16;

/// Why filter bytes from the wire were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FilterError {
    /// The bit array is not a whole number of 8-byte words.
    #[error("filter of {0} bytes is not a multiple of 8")]
    Length(usize),
    /// A non-empty filter with no probes, or over [`MAX_FILTER_HASHES`].
    #[error("filter with {0} hash functions (1 to 16 allowed, 0 only when empty)")]
    Hashes(u8),
}

/// A Bloom filter of content hashes.
#[derive(Clone, PartialEq, Eq)]
pub struct ContentFilter {
    words: Vec<u64>,
    hashes: u8,
    entries: u64,
}

impl std::fmt::Debug for ContentFilter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContentFilter")
            .field("bytes", &self.len_bytes())
            .field("hashes", &self.hashes)
            .field("entries", &self.entries)
            .finish()
    }
}

impl ContentFilter {
    /// A filter that holds nothing and answers no to everything.
    pub fn empty() -> Self {
        Self { words: Vec::new(), hashes: 0, entries: 0 }
    }

    /// A filter sized for `entries` items at `false_positive_rate` (clamped to
    /// 10⁻⁶..0.5), but never over `max_bytes` (at least 8): a cap raises the rate, which
    /// [`ContentFilter::false_positive_rate`] then reports. No entries: the empty filter.
    pub fn sized(entries: u64, false_positive_rate: f64, max_bytes: usize) -> Self {
        if entries == 0 {
            return Self::empty();
        }
        let p = false_positive_rate.clamp(1e-6, 0.5);
        let ln2 = std::f64::consts::LN_2;
        let bits = (entries as f64) * -p.ln() / (ln2 * ln2);
        let max_words = (max_bytes / 8).max(1);
        let words = ((bits / 64.0).ceil() as usize).clamp(1, max_words);
        let per_item = (words * 64) as f64 / entries as f64;
        let hashes = (per_item * ln2).round().clamp(1.0, MAX_FILTER_HASHES as f64) as u8;
        Self { words: vec![0; words], hashes, entries: 0 }
    }

    /// Rebuilds a filter received in pieces: `bytes` is the whole bit array.
    pub fn from_parts(bytes: &[u8], hashes: u8, entries: u64) -> Result<Self, FilterError> {
        if !bytes.len().is_multiple_of(8) {
            return Err(FilterError::Length(bytes.len()));
        }
        let valid = match bytes.is_empty() {
            true => hashes == 0,
            false => (1..=MAX_FILTER_HASHES).contains(&hashes),
        };
        if !valid {
            return Err(FilterError::Hashes(hashes));
        }
        let words = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("chunks of 8")))
            .collect();
        Ok(Self { words, hashes, entries })
    }

    fn probes(&self, key: u64) -> impl Iterator<Item = usize> {
        let bits = (self.words.len() * 64) as u64;
        let (lo, hi) = (key, key.rotate_right(32) | 1);
        (0..self.hashes as u64).map(move |i| (lo.wrapping_add(i.wrapping_mul(hi)) % bits) as usize)
    }

    /// Adds a page by its dedup key ([`super::dedup_key`]). Does nothing on the empty
    /// filter.
    pub fn insert(&mut self, key: u64) {
        if self.words.is_empty() {
            return;
        }
        for bit in self.probes(key) {
            self.words[bit / 64] |= 1 << (bit % 64);
        }
        self.entries += 1;
    }

    /// True when the content with this hash key was probably inserted; false when it
    /// certainly was not.
    pub fn contains(&self, key: u64) -> bool {
        !self.words.is_empty()
            && self.probes(key).all(|bit| self.words[bit / 64] >> (bit % 64) & 1 == 1)
    }

    /// How many hashes were inserted.
    pub fn entries(&self) -> u64 {
        self.entries
    }

    /// Probes per item.
    pub fn hashes(&self) -> u8 {
        self.hashes
    }

    /// The size of the bit array in bytes (a multiple of 8).
    pub fn len_bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// True for a filter with no bits (it answers no to everything).
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// The expected false-positive rate for its entries: (1 − e^(−k·n/m))^k.
    pub fn false_positive_rate(&self) -> f64 {
        if self.words.is_empty() {
            return 0.0;
        }
        let (k, n, m) = (self.hashes as f64, self.entries as f64, (self.words.len() * 64) as f64);
        (1.0 - (-k * n / m).exp()).powf(k)
    }

    /// `len` bytes of the bit array from byte `offset` (both clamped to the array), as
    /// they travel on the wire.
    pub fn bytes(&self, offset: usize, len: usize) -> Vec<u8> {
        let end = offset.saturating_add(len).min(self.len_bytes());
        let start = offset.min(end);
        let mut out = Vec::with_capacity(end - start);
        for at in start..end {
            out.push((self.words[at / 8] >> (8 * (at % 8))) as u8);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash(i: u64) -> u64 {
        // Uniform like real hash keys: splitmix64.
        let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    #[test]
    fn inserted_hashes_are_always_found() {
        let mut f = ContentFilter::sized(10_000, 0.01, usize::MAX);
        (0..10_000).for_each(|i| f.insert(hash(i)));
        assert!((0..10_000).all(|i| f.contains(hash(i))));
        assert_eq!(f.entries(), 10_000);
    }

    #[test]
    fn false_positives_are_near_the_rate_asked() {
        let mut f = ContentFilter::sized(20_000, 0.01, usize::MAX);
        (0..20_000).for_each(|i| f.insert(hash(i)));
        let false_hits = (1_000_000..1_100_000).filter(|&i| f.contains(hash(i))).count();
        let rate = false_hits as f64 / 100_000.0;
        assert!((0.005..0.02).contains(&rate), "false-positive rate {rate}");
        assert!((f.false_positive_rate() - 0.01).abs() < 0.003, "{}", f.false_positive_rate());
        // About 9.6 bits per item at 1 %.
        assert!((23_000..25_000).contains(&f.len_bytes()), "{} bytes", f.len_bytes());
        assert_eq!(f.hashes(), 7);
    }

    #[test]
    fn a_size_cap_is_kept_and_raises_the_rate() {
        let f = ContentFilter::sized(1_000_000, 0.001, 4096);
        assert_eq!(f.len_bytes(), 4096);
        assert_eq!(f.hashes(), 1);
        assert!(ContentFilter::sized(1, 0.5, 0).len_bytes() == 8);
    }

    #[test]
    fn the_empty_filter_holds_nothing() {
        let mut f = ContentFilter::sized(0, 0.01, 1 << 20);
        assert!(f.is_empty());
        f.insert(hash(1));
        assert!(!f.contains(hash(1)));
        assert_eq!(f.false_positive_rate(), 0.0);
        assert_eq!(ContentFilter::from_parts(&[], 0, 0).unwrap(), ContentFilter::empty());
    }

    #[test]
    fn bytes_round_trip_in_pieces() {
        let mut f = ContentFilter::sized(5_000, 0.02, usize::MAX);
        (0..5_000).for_each(|i| f.insert(hash(i)));
        let mut wire = Vec::new();
        let mut at = 0;
        while at < f.len_bytes() {
            wire.extend(f.bytes(at, 1000));
            at += 1000;
        }
        let back = ContentFilter::from_parts(&wire, f.hashes(), f.entries()).unwrap();
        assert_eq!(back, f);
        assert!(f.bytes(f.len_bytes() + 5, 10).is_empty());
    }

    #[test]
    fn bad_wire_filters_are_refused() {
        assert_eq!(ContentFilter::from_parts(&[0; 12], 3, 1), Err(FilterError::Length(12)));
        assert_eq!(ContentFilter::from_parts(&[0; 16], 0, 1), Err(FilterError::Hashes(0)));
        assert_eq!(ContentFilter::from_parts(&[0; 16], 17, 1), Err(FilterError::Hashes(17)));
        assert_eq!(ContentFilter::from_parts(&[], 2, 0), Err(FilterError::Hashes(2)));
    }

    /// The bit layout is part of the protocol: one known hash sets known bits.
    #[test]
    fn probe_positions_follow_the_documented_rule() {
        let mut f = ContentFilter::from_parts(&[0; 16], 3, 0).unwrap();
        // The stored checksum 5 has the key 0xb6bf613dbebb45dc, so lo mod 128 = 92 and
        // hi = key rotated by 32, | 1, mod 128 = 61; m = 128 divides 2⁶⁴, so bit i is
        // (92 + 61 i) mod 128: bits 92, 25, 86.
        f.insert(super::super::dedup_key(5));
        assert_eq!(f.bytes(0, 16), [0, 0, 0, 0x02, 0, 0, 0, 0, 0, 0, 0x40, 0x10, 0, 0, 0, 0]);
    }
}
