//! A count-min sketch of 4-bit counters with periodic halving: TinyLFU's popularity
//! estimate, laid out as in Caffeine's `FrequencySketch`.
//!
//! The table has `next_pow2(capacity)` 64-bit words of sixteen 4-bit counters (8 bytes
//! per cached page). An item picks one group of four counters in each of four words (one
//! per hash function); its estimate is the smallest of the four. After `10 × capacity`
//! increments every counter is halved, so the sketch forgets old popularity ("aging"), and
//! a counter saturates at 15.

/// Seeds of the four index functions (Caffeine's).
const SEED: [u64; 4] =
    [0xc3a5_c85c_97cb_3127, 0xb492_b66f_be98_f273, 0x9ae1_6a3b_2f90_404f, 0xcbf2_9ce4_8422_2325];
/// Clears the bit each counter receives from its neighbour when a word is shifted right.
const RESET_MASK: u64 = 0x7777_7777_7777_7777;
/// The low bit of every counter.
const ONE_MASK: u64 = 0x1111_1111_1111_1111;
/// Increments per cached page between two halvings (TinyLFU's sample size W = 10 × C).
pub(crate) const SAMPLE_FACTOR: usize = 10;

/// Popularity estimates for 32-bit key fingerprints.
#[derive(Debug, Default)]
pub(crate) struct FrequencySketch {
    table: Vec<u64>,
    sample_size: usize,
    /// Increments since the last halving (corrected for truncation, as in Caffeine).
    size: usize,
}

impl FrequencySketch {
    /// Sizes the sketch for a cache of `capacity` pages. Grows (and clears) the table only
    /// when it is too small, so shrinking the cache keeps the history.
    pub(crate) fn set_capacity(&mut self, capacity: usize) {
        let words = capacity.clamp(1, 1 << 30).next_power_of_two();
        if words > self.table.len() {
            self.table = vec![0; words];
            self.size = 0;
        }
        self.sample_size = SAMPLE_FACTOR * capacity.max(1);
    }

    /// Increments between two halvings.
    pub(crate) fn sample_size(&self) -> usize {
        self.sample_size
    }

    /// Heap bytes of the table.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.table.capacity() * 8
    }

    /// The estimated number of recent occurrences of `fp`, 0..=15.
    pub(crate) fn frequency(&self, fp: u32) -> u8 {
        let hash = spread(fp);
        let start = (hash & 3) << 2;
        (0..4)
            .map(|i| {
                let word = self.table[self.index(hash, i)];
                ((word >> ((start + i) << 2)) & 0xf) as u8
            })
            .min()
            .unwrap_or(0)
    }

    /// Records one occurrence of `fp`.
    pub(crate) fn increment(&mut self, fp: u32) {
        let hash = spread(fp);
        let start = (hash & 3) << 2;
        let mut added = false;
        for i in 0..4 {
            let index = self.index(hash, i);
            let shift = (start + i) << 2;
            if (self.table[index] >> shift) & 0xf != 0xf {
                self.table[index] += 1 << shift;
                added = true;
            }
        }
        if added {
            self.size += 1;
            if self.size >= self.sample_size {
                self.halve();
            }
        }
    }

    /// Halves every counter: the aging step.
    fn halve(&mut self) {
        let mut odd = 0usize;
        for word in &mut self.table {
            odd += (*word & ONE_MASK).count_ones() as usize;
            *word = (*word >> 1) & RESET_MASK;
        }
        self.size = (self.size >> 1).saturating_sub(odd >> 2);
    }

    fn index(&self, hash: u64, i: u64) -> usize {
        let mut h = hash.wrapping_add(SEED[i as usize]).wrapping_mul(SEED[i as usize]);
        h = h.wrapping_add(h >> 32);
        (h as usize) & (self.table.len() - 1)
    }
}

/// Caffeine's `spread`: a cheap rehash of the 32-bit fingerprint.
fn spread(fp: u32) -> u64 {
    let mut x = fp;
    x = ((x >> 16) ^ x).wrapping_mul(0x045d_9f3b);
    x = ((x >> 16) ^ x).wrapping_mul(0x045d_9f3b);
    u64::from((x >> 16) ^ x)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_halves() {
        let mut s = FrequencySketch::default();
        s.set_capacity(64);
        for _ in 0..5 {
            s.increment(42);
        }
        assert!(s.frequency(42) >= 5);
        assert_eq!(s.frequency(7), 0);
        s.halve();
        assert_eq!(s.frequency(42), 2, "halving ages old counts (5 / 2)");
    }

    #[test]
    fn halves_after_the_sample() {
        let mut s = FrequencySketch::default();
        s.set_capacity(16);
        for _ in 0..10 {
            s.increment(0);
        }
        for i in 1..=s.sample_size() as u32 {
            s.increment(i);
        }
        // The sample filled up, so key 0's ten counts were halved at least once.
        assert!(s.frequency(0) < 10);
    }

    #[test]
    fn saturates_at_fifteen() {
        let mut s = FrequencySketch::default();
        s.set_capacity(16);
        for _ in 0..100 {
            s.increment(9);
        }
        assert_eq!(s.frequency(9), 15);
    }
}
