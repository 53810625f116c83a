//! What each request asks for: get or put ([`Workload`]), which keys, and what a put
//! stores ([`ValueMode`]); and how a reply's page is checked.
//!
//! # Page contents
//!
//! ```text
//!  0             8             16                                  4096
//!  ├── key id ───┼── counter ──┼──── random bytes (one set per worker) ───┤   unique pages
//!  ├─ DUP_MARK|i ┼──────────── random bytes, fixed seed, page i ─────────┤   dup pages
//! ```
//!
//! A unique page starts with its key id, so a get can tell the right page from another
//! key's. A dup page `i` (the one every key `k` with `k % distinct == i` gets) is the same
//! bytes in every worker and every run, so it dedups across both, and its first word
//! cannot be a key id (key ids are below 2^61). Neither kind is zero- or same-filled, which
//! a node stores without a frame.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use bytes::BufMut;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

use super::keys::KeyGen;

/// The size of every page.
pub const PAGE: usize = 4096;

/// Gets, puts or a mix.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Workload {
    /// Every request is a get.
    Get,
    /// Every request is a put.
    Put,
    /// A request is a get with probability `read`, else a put.
    Mix {
        /// The read fraction, in 0..=1.
        read: f64,
    },
}

impl FromStr for Workload {
    type Err = String;

    /// `get`, `put`, or `mix:R` with R the read fraction (`mix` alone: 0.9).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            None if s == "get" => Ok(Workload::Get),
            None if s == "put" => Ok(Workload::Put),
            None if s == "mix" => Ok(Workload::Mix { read: 0.9 }),
            Some(("mix", r)) => match r.parse::<f64>() {
                Ok(read) if (0.0..=1.0).contains(&read) => Ok(Workload::Mix { read }),
                _ => Err(format!("mix read fraction must be in 0..=1, not {r:?}")),
            },
            _ => Err(format!("expected get, put or mix:R, not {s:?}")),
        }
    }
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Workload::Get => f.write_str("get"),
            Workload::Put => f.write_str("put"),
            Workload::Mix { read } => write!(f, "mix:{read}"),
        }
    }
}

/// What a put stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueMode {
    /// Every put stores a page no other put stores.
    Random,
    /// Every put stores one of `distinct` fixed pages, so a deduplicating server keeps
    /// `distinct` frames for any number of keys.
    Dup {
        /// How many different pages there are.
        distinct: u32,
    },
}

impl FromStr for ValueMode {
    type Err = String;

    /// `random`, or `dup:N` (`dup` alone: 16 distinct pages).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            None if s == "random" => Ok(ValueMode::Random),
            None if s == "dup" => Ok(ValueMode::Dup { distinct: 16 }),
            Some(("dup", n)) => match n.parse::<u32>() {
                Ok(distinct) if (1..=MAX_DUP).contains(&distinct) => {
                    Ok(ValueMode::Dup { distinct })
                }
                _ => Err(format!("dup needs 1 to {MAX_DUP} distinct pages, not {n:?}")),
            },
            _ => Err(format!("expected random or dup:N, not {s:?}")),
        }
    }
}

impl fmt::Display for ValueMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ValueMode::Random => f.write_str("random"),
            ValueMode::Dup { distinct } => write!(f, "dup:{distinct}"),
        }
    }
}

/// The most distinct pages `dup:N` accepts (they are all held in memory by every run).
const MAX_DUP: u32 = 4096;
/// Top bits of a dup page's first word; a key id never has them (ids are below 2^61).
const DUP_MARK: u64 = 0xFD00_0000_0000_0000;
/// The seed of the dup pages: fixed, so that every worker and every run agree on them.
const DUP_SEED: u64 = 0x0fa1_10d0;

/// The page contents a worker writes and checks.
#[derive(Debug, Clone)]
pub(crate) struct Values {
    mode: ValueMode,
    /// The worker's own random tail for unique pages.
    base: Box<[u8]>,
    /// The fixed dup pages, shared by every worker.
    dup: Arc<Vec<Box<[u8]>>>,
    /// Puts so far, so that two puts of one key differ too.
    counter: u64,
}

impl Values {
    pub(crate) fn new(mode: ValueMode, rng: &mut SmallRng, dup: Arc<Vec<Box<[u8]>>>) -> Self {
        let mut base = vec![0u8; PAGE].into_boxed_slice();
        rng.fill_bytes(&mut base);
        Self { mode, base, dup, counter: 0 }
    }

    /// The fixed pages of [`ValueMode::Dup`] (all 16 of `dup`; none for `random`, whose
    /// checks still recognise them).
    #[expect(clippy::indexing_slicing, reason = "pages of PAGE bytes")]
    pub(crate) fn dup_pages(mode: ValueMode) -> Arc<Vec<Box<[u8]>>> {
        let distinct = match mode {
            ValueMode::Dup { distinct } => distinct,
            ValueMode::Random => 0,
        };
        let mut rng = SmallRng::seed_from_u64(DUP_SEED);
        let pages = (0..u64::from(distinct))
            .map(|i| {
                let mut page = vec![0u8; PAGE].into_boxed_slice();
                rng.fill_bytes(&mut page);
                page[..8].copy_from_slice(&(DUP_MARK | i).to_le_bytes());
                page
            })
            .collect();
        Arc::new(pages)
    }

    /// Appends the page a put of `key` stores to `out`.
    #[expect(clippy::indexing_slicing, reason = "the base page has PAGE bytes")]
    pub(crate) fn write(&mut self, key: u64, out: &mut impl BufMut) {
        match self.mode {
            ValueMode::Random => {
                self.counter = self.counter.wrapping_add(1);
                out.put_u64_le(key);
                out.put_u64_le(self.counter);
                out.put_slice(&self.base[16..]);
            }
            ValueMode::Dup { distinct } => {
                // `dup` holds `distinct` pages, so the index is in range; `get` keeps a
                // mismatch from ever panicking anyway.
                let i = (key % u64::from(distinct)) as usize;
                out.put_slice(self.dup.get(i).map_or(&self.base[..], |p| &p[..]));
            }
        }
    }

    /// Whether `page`, read back under `key`, is a page that some put of `key` in either
    /// mode could have stored (a server may hold pages from an earlier run).
    pub(crate) fn check(&self, key: u64, page: &[u8]) -> bool {
        let Some(first) = page.get(..8).filter(|_| page.len() == PAGE) else {
            return false;
        };
        let mut word = [0u8; 8];
        word.copy_from_slice(first);
        let word = u64::from_le_bytes(word);
        if word == key {
            return true;
        }
        // A dup page: only the mode of this run is known, so accept page `i` of this run's
        // set; a dup page of another `distinct` counts as wrong.
        let i = word ^ DUP_MARK;
        word & DUP_MARK == DUP_MARK
            && (i as usize) < self.dup.len()
            && key % self.dup.len() as u64 == i
            && self.dup.get(i as usize).is_some_and(|p| p[..] == *page)
    }
}

/// Get or put.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Read `keys`.
    Get,
    /// Write `keys`.
    Put,
}

/// Where a worker's keys come from.
#[derive(Debug, Clone)]
enum KeySource {
    /// Drawn from the distribution, forever.
    Random(KeyGen),
    /// `next..end` in order, then done: the warm-up.
    Sequential { next: u64, end: u64 },
}

/// One worker's stream of requests.
#[derive(Debug)]
pub(crate) struct RequestGen {
    rng: SmallRng,
    keys: KeySource,
    workload: Workload,
    batch: usize,
    pub(crate) values: Values,
}

impl RequestGen {
    /// Requests of `batch` keys drawn by `keys`, forever.
    pub(crate) fn random(
        seed: u64,
        keys: KeyGen,
        workload: Workload,
        batch: usize,
        values: ValueMode,
    ) -> Self {
        Self::with(seed, KeySource::Random(keys), workload, batch, values)
    }

    /// Puts of `batch` keys covering `range` once, in order.
    pub(crate) fn fill(
        seed: u64,
        range: std::ops::Range<u64>,
        batch: usize,
        values: ValueMode,
    ) -> Self {
        let keys = KeySource::Sequential { next: range.start, end: range.end };
        Self::with(seed, keys, Workload::Put, batch, values)
    }

    fn with(seed: u64, keys: KeySource, workload: Workload, batch: usize, mode: ValueMode) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        let values = Values::new(mode, &mut rng, Values::dup_pages(mode));
        Self { rng, keys, workload, batch, values }
    }

    /// The next request's operation, with its keys written into `keys` (cleared first);
    /// `None` when a sequential source is used up.
    pub(crate) fn next(&mut self, keys: &mut Vec<u64>) -> Option<Op> {
        keys.clear();
        match &mut self.keys {
            KeySource::Random(gen) => keys.extend((0..self.batch).map(|_| gen.next(&mut self.rng))),
            KeySource::Sequential { next, end } => {
                let n = (*end - *next).min(self.batch as u64);
                keys.extend(*next..*next + n);
                *next += n;
            }
        }
        if keys.is_empty() {
            return None;
        }
        Some(match self.workload {
            Workload::Get => Op::Get,
            Workload::Put => Op::Put,
            Workload::Mix { read } => {
                if self.rng.gen_bool(read) {
                    Op::Get
                } else {
                    Op::Put
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pages::KeyDist;

    #[test]
    fn parses_workloads_and_values() {
        assert_eq!("get".parse(), Ok(Workload::Get));
        assert_eq!("put".parse(), Ok(Workload::Put));
        assert_eq!("mix:0.5".parse(), Ok(Workload::Mix { read: 0.5 }));
        assert_eq!(Workload::Mix { read: 0.25 }.to_string(), "mix:0.25");
        for bad in ["mix:1.5", "mix:-0.1", "mix:x", "GET", "read"] {
            assert!(bad.parse::<Workload>().is_err(), "{bad:?} parsed");
        }
        assert_eq!("random".parse(), Ok(ValueMode::Random));
        assert_eq!("dup".parse(), Ok(ValueMode::Dup { distinct: 16 }));
        assert_eq!("dup:3".parse(), Ok(ValueMode::Dup { distinct: 3 }));
        assert_eq!(ValueMode::Dup { distinct: 3 }.to_string(), "dup:3");
        for bad in ["dup:0", "dup:100000", "zero"] {
            assert!(bad.parse::<ValueMode>().is_err(), "{bad:?} parsed");
        }
    }

    fn page_of(values: &mut Values, key: u64) -> Vec<u8> {
        let mut out = Vec::new();
        values.write(key, &mut out);
        out
    }

    #[test]
    fn unique_pages_differ_and_check_by_key() {
        let mode = ValueMode::Random;
        let mut rng = SmallRng::seed_from_u64(1);
        let mut v = Values::new(mode, &mut rng, Values::dup_pages(mode));
        let (a, b) = (page_of(&mut v, 5), page_of(&mut v, 5));
        assert_eq!(a.len(), PAGE);
        assert_ne!(a, b, "two puts of one key store different pages");
        assert!(v.check(5, &a));
        assert!(!v.check(6, &a), "another key's page is wrong");
        assert!(!v.check(5, &a[..100]), "a short page is wrong");
    }

    #[test]
    fn dup_pages_repeat_and_are_shared_by_every_worker() {
        let mode = ValueMode::Dup { distinct: 4 };
        let mut r1 = SmallRng::seed_from_u64(1);
        let mut r2 = SmallRng::seed_from_u64(2);
        let mut v1 = Values::new(mode, &mut r1, Values::dup_pages(mode));
        let mut v2 = Values::new(mode, &mut r2, Values::dup_pages(mode));
        let pages: Vec<Vec<u8>> = (0..8).map(|k| page_of(&mut v1, k)).collect();
        assert_eq!(pages[1], pages[5]);
        assert_ne!(pages[1], pages[2]);
        assert_eq!(pages[3], page_of(&mut v2, 3), "every worker writes the same dup pages");
        assert!(pages[0].windows(2).any(|w| w[0] != w[1]), "not a same-filled page");
        assert!(v1.check(5, &pages[1]));
        assert!(!v1.check(6, &pages[1]), "dup page of another residue is wrong");
        // A reader in random mode knows no dup pages, so it calls one wrong.
        let mut rr = SmallRng::seed_from_u64(3);
        let random = Values::new(ValueMode::Random, &mut rr, Values::dup_pages(ValueMode::Random));
        assert!(!random.check(5, &pages[1]));
    }

    #[test]
    fn sequential_fill_covers_the_range_once() {
        let mut gen = RequestGen::fill(1, 10..25, 4, ValueMode::Random);
        let mut keys = Vec::new();
        let mut seen = Vec::new();
        while let Some(op) = gen.next(&mut keys) {
            assert_eq!(op, Op::Put);
            assert!(keys.len() <= 4);
            seen.extend_from_slice(&keys);
        }
        assert_eq!(seen, (10..25).collect::<Vec<_>>());
    }

    #[test]
    fn mix_follows_the_read_fraction() {
        let keys = KeyGen::new(100, KeyDist::Uniform).unwrap();
        let mut gen =
            RequestGen::random(9, keys, Workload::Mix { read: 0.8 }, 2, ValueMode::Random);
        let mut buf = Vec::new();
        let gets = (0..10_000).filter(|_| gen.next(&mut buf) == Some(Op::Get)).count();
        assert!((7_600..8_400).contains(&gets), "{gets} gets of 10,000");
        assert_eq!(buf.len(), 2);
    }
}
