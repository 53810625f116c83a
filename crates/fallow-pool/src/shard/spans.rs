//! The spans of one shard: runs of 128 consecutive page indexes of one object, each
//! with a bitmap of the pages this shard holds in it.
//!
//! A slot names its page by a span and a position (4 bytes) instead of repeating the
//! pool, the object and the 8-byte index, and the spans of an object form a list, so
//! invalidating an object walks its spans instead of the whole index. The objects fallow
//! is built for (volumes, files, 4 MiB backing objects) are dense: their pages share
//! spans, and a span's 44 bytes cost each of them well under a byte. A page alone in
//! its run pays the whole span, which is still less than the 24-byte slot and 20-byte
//! object entry it replaces for a one-page object.
//!
//! # Why runs of 128
//! A cache rarely holds every page of a run: it keeps what was read, and evicts page by
//! page. A span is shared by the run's pages *cached here*, so the longer the run, the
//! more of them share it. Runs of 64 with a 64-bit bitmap (36-byte spans) cost a cache of
//! random keys in its steady state, holding a third of each run, 32.5 B
//! a page at 256 MiB, and a cache holding a tenth of a volume's pages 36.5 B. Runs of 128
//! (a 128-bit bitmap, 8 bytes more a span) cost 31.7 B and 33.6 B, and a dense object 0.3 B
//! less. A page alone in its run pays the 8 bytes: one page per object 68.8 → 76.8 B, the
//! layout `docs/semantics.md` already advises against. Runs of 256 would save less again
//! (most pages already pay under a byte or two for their span) for 16 bytes more on a
//! lone page. A 4 MiB object is now 8 runs, fewer than a large engine's shards:
//! `hashing::shard_of` places consecutive objects so that this costs nothing when they are
//! numbered in order (RFC 0001, "Outcome").
//!
//! Two tables find spans: `by_key` by `(pool, object, run)`, for a put; `heads` by
//! `(pool, object)`, the first span of each object's list, for an invalidation. An object
//! exists in this shard exactly while it has a span here.

use fallow_core::{ObjectId, PoolId};

use crate::hashing::{object_hash, span_hash};
use crate::id_table::IdTable;

/// A dense id for one span of a shard; reused once the span has no page left.
pub type SpanRef = u32;

/// The end of a list, and "no span".
pub const NIL: u32 = u32::MAX;

/// log2 of the pages of one span (the run a key falls in is `hashing::run`).
pub use crate::hashing::{run, RUN_BITS};

/// The pages of one span, 128.
pub const RUN_PAGES: u64 = 1 << RUN_BITS;

/// A span's page bitmap: bit `p` for the page at position `p`.
pub type Bits = u128;

const _: () = assert!(Bits::BITS as u64 == RUN_PAGES, "a bit for each page of a run");

/// The position of page `index` within its span.
pub const fn position(index: u64) -> u32 {
    (index & ((1 << RUN_BITS) - 1)) as u32
}

/// Span ids stay below this, so that `span << RUN_BITS | position` never reaches
/// [`NIL`] (`shard::Packed::loc`). A live span holds at least one page, so a shard holds
/// at most this many pages ([`super::MAX_PAGES`]).
pub const MAX_SPANS: usize = (NIL >> RUN_BITS) as usize;

/// The least worst case the entries reserve at once. A smaller reservation comes from the
/// heap, where its untouched room shares pages with other arrays and is resident all the
/// same: a shard of 256 pages reserved 12 KiB for the 4 spans of its dense objects, and the
/// 256 shards of a 256 MiB engine (the default for 64 CPUs until [`MIN_SHARD_PAGES`]) were
/// resident for 16.6 B a page more than with the entries doubling as they fill, as they
/// now do below this. glibc maps blocks of 128 KiB or more apart.
///
/// [`MIN_SHARD_PAGES`]: crate::MIN_SHARD_PAGES
const RESERVE_BYTES: usize = 128 << 10;

/// One span, unpacked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    /// Its pool.
    pub pool: PoolId,
    /// Its object.
    pub object: ObjectId,
    /// Which run of [`RUN_PAGES`] indexes it covers ([`run`]).
    pub run: u64,
    /// Bit `p` set: the page at position `p` is in this shard.
    pub pages: Bits,
    /// The next span of the same object (`NIL` at the end).
    pub next: SpanRef,
    /// The pool is persistent (its pages are never evicted). Kept here rather than in
    /// each slot: every page of an object shares its pool, hence its kind.
    pub persistent: bool,
}

/// A [`Span`] as stored: 44 bytes, aligned to 4 (the 64- and 128-bit fields as 32-bit
/// words, low first). A free entry has no page.
#[derive(Debug, Clone, Copy)]
struct Packed {
    object: [u32; 2],
    /// The run, and `PERSISTENT` in the top bit (a run has at most 57 bits).
    run: [u32; 2],
    pages: [u32; 4],
    pool: PoolId,
    next: SpanRef,
    prev: SpanRef,
}

/// The bit of the run's high half that marks a persistent pool's span.
const PERSISTENT: u32 = 1 << 31;

fn split(x: u64) -> [u32; 2] {
    [x as u32, (x >> 32) as u32]
}

fn join(x: [u32; 2]) -> u64 {
    u64::from(x[0]) | (u64::from(x[1]) << 32)
}

fn split_bits(x: Bits) -> [u32; 4] {
    std::array::from_fn(|i| (x >> (32 * i)) as u32)
}

fn join_bits(x: [u32; 4]) -> Bits {
    x.iter().rev().fold(0, |acc, &w| (acc << 32) | Bits::from(w))
}

impl Packed {
    fn get(&self) -> Span {
        Span {
            pool: self.pool,
            object: join(self.object),
            run: join([self.run[0], self.run[1] & !PERSISTENT]),
            pages: join_bits(self.pages),
            next: self.next,
            persistent: self.run[1] & PERSISTENT != 0,
        }
    }

    fn is_free(&self) -> bool {
        self.pages == [0; 4]
    }

    fn is_object(&self, pool: PoolId, object: ObjectId) -> bool {
        self.object == split(object) && self.pool == pool
    }

    fn run(&self) -> u64 {
        join([self.run[0], self.run[1] & !PERSISTENT])
    }

    fn key_hash(&self) -> u64 {
        span_hash(self.pool, join(self.object), self.run())
    }

    fn object_hash(&self) -> u64 {
        object_hash(self.pool, join(self.object))
    }
}

/// The span table of one shard.
#[derive(Default)]
pub struct Spans {
    entries: Vec<Packed>,
    free: Vec<SpanRef>,
    by_key: IdTable,
    heads: IdTable,
    /// Spans to expect at most (one per page of a full shard; [`Spans::expect`]).
    expected: usize,
}

impl Spans {
    /// Says how many spans the shard may hold at most (as many as its pages, when no
    /// two share a run): the tables grow to it, not past it, and the entries reserve it
    /// at their first growth ([`crate::dense::grow`]: address space, resident only as far
    /// as span ids are used) when that reservation is large enough to be a mapping of its
    /// own ([`RESERVE_BYTES`]). Shards of dense objects never get near it. Entries that
    /// doubled up to it would be a page's metadata's largest slack: 1 B a page of a cache
    /// in its steady state, 3.4 B for a tenth of a volume.
    pub fn expect(&mut self, spans: usize) {
        self.expected = spans;
        self.by_key.expect(spans);
        self.heads.expect(spans);
    }

    /// Moves up to `groups` old groups of each table's growth under way
    /// ([`IdTable::tidy`]); true while either still has some.
    pub fn tidy(&mut self, groups: usize) -> bool {
        let Spans { entries, by_key, heads, .. } = self;
        let by_key_left = by_key.tidy(groups, |x| entries[x as usize].key_hash());
        let heads_left = heads.tidy(groups, |x| entries[x as usize].object_hash());
        by_key_left || heads_left
    }

    /// Live spans.
    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    /// The live span `r`.
    pub fn get(&self, r: SpanRef) -> Span {
        self.entries[r as usize].get()
    }

    /// True when live span `r` covers page `index` of `(pool, object)`: the lookup of
    /// every get, without unpacking the entry.
    #[inline]
    pub fn covers(&self, r: SpanRef, pool: PoolId, object: ObjectId, index: u64) -> bool {
        let e = &self.entries[r as usize];
        e.run() == run(index) && e.is_object(pool, object)
    }

    /// True when span `r` belongs to a persistent pool.
    pub fn persistent(&self, r: SpanRef) -> bool {
        self.entries[r as usize].run[1] & PERSISTENT != 0
    }

    /// The span covering page `index` of `(pool, object)`, if it has a page here.
    pub fn find(&self, pool: PoolId, object: ObjectId, index: u64) -> Option<SpanRef> {
        let entries = &self.entries;
        let hash = span_hash(pool, object, run(index));
        self.by_key.find(hash, |r| {
            let e = &entries[r as usize];
            e.run() == run(index) && e.is_object(pool, object)
        })
    }

    /// The first span of `(pool, object)`'s list, if it has one here.
    pub fn head(&self, pool: PoolId, object: ObjectId) -> Option<SpanRef> {
        let entries = &self.entries;
        self.heads.find(object_hash(pool, object), |r| entries[r as usize].is_object(pool, object))
    }

    /// Records page `index` of `(pool, object)`, of a pool that is `persistent` or not, and
    /// returns its span, made if the page is the first of its run. The page must not be
    /// recorded yet. `None` when the shard has [`MAX_SPANS`] already.
    pub fn add_page(
        &mut self,
        pool: PoolId,
        object: ObjectId,
        index: u64,
        persistent: bool,
    ) -> Option<SpanRef> {
        let r = match self.find(pool, object, index) {
            Some(r) => r,
            None => self.add(pool, object, run(index), persistent)?,
        };
        let e = &mut self.entries[r as usize];
        debug_assert_eq!(e.run[1] & PERSISTENT != 0, persistent, "an object changed kind");
        let pages = join_bits(e.pages);
        let bit: Bits = 1 << position(index);
        debug_assert!(pages & bit == 0, "page {index} recorded twice");
        e.pages = split_bits(pages | bit);
        Some(r)
    }

    /// A new span, with no page yet, second in its object's list (or first, and so in
    /// `heads`, if the object has none here): the head stays, so `heads` need not change.
    fn add(
        &mut self,
        pool: PoolId,
        object: ObjectId,
        run: u64,
        persistent: bool,
    ) -> Option<SpanRef> {
        if self.free.is_empty() && self.entries.len() >= MAX_SPANS {
            return None;
        }
        let head = self.head(pool, object);
        let mut high = split(run);
        debug_assert!(high[1] & PERSISTENT == 0, "a run has at most 57 bits");
        if persistent {
            high[1] |= PERSISTENT;
        }
        let fresh =
            Packed { object: split(object), run: high, pages: [0; 4], pool, next: NIL, prev: NIL };
        let Spans { entries, free, by_key, heads, expected } = self;
        let reserve = if *expected * size_of::<Packed>() >= RESERVE_BYTES { *expected } else { 0 };
        let r = crate::dense::place_expecting(entries, free, fresh, reserve);
        by_key.insert_unique(entries[r as usize].key_hash(), r, |x| entries[x as usize].key_hash());
        match head {
            None => heads
                .insert_unique(object_hash(pool, object), r, |x| entries[x as usize].object_hash()),
            Some(h) => {
                let after = entries[h as usize].next;
                entries[r as usize].prev = h;
                entries[r as usize].next = after;
                entries[h as usize].next = r;
                if after != NIL {
                    entries[after as usize].prev = r;
                }
            }
        }
        Some(r)
    }

    /// Forgets the page at `position` of span `r`, and the span with its last page.
    pub fn remove_page(&mut self, r: SpanRef, position: u32) {
        let e = &mut self.entries[r as usize];
        let pages = join_bits(e.pages);
        let bit: Bits = 1 << position;
        debug_assert!(pages & bit != 0, "span {r} has no page at {position}");
        e.pages = split_bits(pages & !bit);
        if pages == bit {
            self.remove(r);
        }
    }

    /// Takes empty span `r` out of its object's list and the tables, and frees it.
    fn remove(&mut self, r: SpanRef) {
        let e = self.entries[r as usize];
        debug_assert!(e.is_free(), "span {r} removed with pages");
        self.by_key.remove(e.key_hash(), |x| x == r).expect("a live span is in by_key");
        if e.prev == NIL {
            // The head: its successor, if any, takes its place in `heads`.
            if e.next != NIL {
                let replaced = self.heads.replace(e.object_hash(), |x| x == r, e.next);
                assert!(replaced, "the first span of an object is in heads");
            } else {
                self.heads.remove(e.object_hash(), |x| x == r).expect("the head is in heads");
            }
        } else {
            self.entries[e.prev as usize].next = e.next;
        }
        if e.next != NIL {
            self.entries[e.next as usize].prev = e.prev;
        }
        self.free.push(r);
    }

    /// The spans of `(pool, object)` here.
    pub fn of_object(
        &self,
        pool: PoolId,
        object: ObjectId,
    ) -> impl Iterator<Item = (SpanRef, Span)> + '_ {
        let mut r = self.head(pool, object).unwrap_or(NIL);
        std::iter::from_fn(move || {
            if r == NIL {
                return None;
            }
            let (this, e) = (r, self.get(r));
            r = e.next;
            Some((this, e))
        })
    }

    /// Live spans, with their ids.
    pub fn live(&self) -> impl Iterator<Item = (SpanRef, Span)> + '_ {
        self.entries
            .iter()
            .enumerate()
            .filter(|(_, e)| !e.is_free())
            .map(|(r, e)| (r as SpanRef, e.get()))
    }

    /// Heap bytes: the entries (as many as were ever live at once, the rest of their
    /// reservation untouched: [`crate::dense::resident_bytes`]), the free list and the
    /// two tables.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        crate::dense::resident_bytes(&self.entries)
            + self.free.capacity() * size_of::<SpanRef>()
            + self.by_key.heap_bytes()
            + self.heads.heap_bytes()
    }

    /// Panics unless the tables, the entries, the lists and the free list agree.
    pub fn validate(&self) {
        let live = self.live().count();
        assert_eq!(live, self.by_key.len(), "span table and entries disagree");
        assert_eq!(live + self.free.len(), self.entries.len(), "span free list drifted");
        let mut listed = 0;
        for (r, e) in self.live() {
            assert_eq!(self.find(e.pool, e.object, e.run << RUN_BITS), Some(r), "span {r}");
            let p = self.entries[r as usize].prev;
            if p == NIL {
                assert_eq!(self.head(e.pool, e.object), Some(r), "span {r}: a head not in heads");
                let mut at = r;
                let mut prev = NIL;
                while at != NIL {
                    let x = &self.entries[at as usize];
                    assert!(!x.is_free(), "free span {at} in the list of {r}");
                    assert!(x.is_object(e.pool, e.object), "span {at} in another object's list");
                    assert_eq!(x.prev, prev, "span {at}: broken back link");
                    listed += 1;
                    assert!(listed <= live, "a cycle in the list of span {r}");
                    prev = at;
                    at = x.next;
                }
            }
        }
        assert_eq!(listed, live, "object lists and spans disagree");
        for &r in &self.free {
            assert!(self.entries[r as usize].is_free(), "free span {r} has pages");
        }
        let entries = &self.entries;
        self.by_key.validate(|x| entries[x as usize].key_hash());
        self.heads.validate(|x| entries[x as usize].object_hash());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_span_packs_into_44_bytes_and_round_trips() {
        assert_eq!(std::mem::size_of::<Packed>(), 44);
        let mut t = Spans::default();
        for (pool, object, index, persistent) in [
            (u32::MAX, u64::MAX, u64::MAX, true),
            (7, 0, 0, false),
            (7, 1, 65, false),
            (7, 2, 127, false),
            (7, 3, 128 + 96, false),
        ] {
            let r = t.add_page(PoolId(pool), object, index, persistent).unwrap();
            let e = t.get(r);
            assert_eq!((e.pool, e.object, e.run), (PoolId(pool), object, run(index)));
            assert_eq!(e.pages, 1 << position(index));
            assert_eq!(e.persistent, persistent);
            assert!(t.covers(r, PoolId(pool), object, index));
            assert!(!t.covers(r, PoolId(pool), object, index ^ RUN_PAGES));
        }
        t.validate();
    }

    #[test]
    fn pages_of_one_run_share_a_span_and_its_last_page_frees_it() {
        let mut t = Spans::default();
        let a = t.add_page(PoolId(1), 9, 256, false).unwrap();
        let b = t.add_page(PoolId(1), 9, 383, false).unwrap();
        assert_eq!(a, b, "one run, one span");
        assert_eq!(t.get(a).pages, 1 | 1 << 127, "the bitmap's first and last bits");
        let c = t.add_page(PoolId(1), 9, 384, false).unwrap();
        assert_ne!(a, c, "the next run has its own");
        assert_eq!(t.len(), 2);
        t.validate();
        t.remove_page(a, position(256));
        assert_eq!(t.len(), 2, "a page is left");
        t.remove_page(a, position(383));
        assert_eq!(t.len(), 1);
        assert_eq!(t.find(PoolId(1), 9, 130), None);
        t.validate();
        assert_eq!(t.add_page(PoolId(2), 9, 0, true), Some(a), "a freed id is reused");
        t.validate();
    }

    #[test]
    fn an_object_lists_exactly_its_spans_whichever_goes_first() {
        // Remove the head, a middle span and the tail of one object's list, with another
        // object's spans in between, and check the lists and `heads` after each.
        for order in [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [2, 0, 3, 1]] {
            let mut t = Spans::default();
            let mut refs = Vec::new();
            for i in 0..4u64 {
                refs.push(t.add_page(PoolId(1), 5, i * RUN_PAGES, false).unwrap());
                t.add_page(PoolId(1), 6, i * RUN_PAGES, false).unwrap();
            }
            t.validate();
            let mut left: Vec<u64> = (0..4).collect();
            for k in order {
                t.remove_page(refs[k], 0);
                left.retain(|&x| x != k as u64);
                t.validate();
                let mut runs: Vec<u64> = t.of_object(PoolId(1), 5).map(|(_, e)| e.run).collect();
                runs.sort_unstable();
                assert_eq!(runs, left);
                assert_eq!(t.of_object(PoolId(1), 6).count(), 4, "the other object is intact");
            }
            assert_eq!(t.head(PoolId(1), 5), None);
        }
    }
}
