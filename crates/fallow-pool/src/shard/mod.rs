//! One shard of the page index: key → slot, the slots themselves, the shard's spans, and
//! the eviction policy over this shard's ephemeral pages.
//!
//! ```text
//!  index: IdTable (slot ids)  ──hash(key)──▶  slots[id] { value, span · position }
//!                                                          │      │
//!  fills: fill id ──▶ word ◀───────────────────────────────┘      │
//!  spans: (pool, object, run of 128 indexes, page bitmap) ◀───────┘
//!           heads: (pool, object) ──▶ span ⇄ span ⇄ …
//! ```
//!
//! The index is a cuckoo hash table of slot ids (4 bytes a slot, each id's control byte
//! folded into its top byte, sized to the shard's capacity: [`crate::id_table`]) hashed by
//! the page's key; the key itself is stored
//! once, split between the slot (the page's position in its run of 128 indexes) and the
//! span table (pool, object and run, shared by all of a run's pages). Each object's
//! spans form a list, so invalidating an object walks exactly its runs, and each run's
//! bitmap says which of its pages are here. Slots are dense ids, reused, so that policies
//! can keep their per-page state in flat arrays. A slot is 8 bytes: whatever can be
//! shared is kept once elsewhere (the key's pool, object, run and kind in the span
//! table, fill words in the fill table).
//!
//! # Locking
//! Each shard sits in its own mutex in the engine; every method here runs with it held.

mod fills;
mod spans;

use fallow_core::{ObjectId, PageKey, PoolId};

use crate::eviction::{Eviction, SlotId};
use crate::hashing::key_hash;
use crate::id_table::{Folded, IdTable};
use crate::store::ContentId;
use fills::Fills;
#[cfg(test)]
pub(crate) use spans::RUN_PAGES;
use spans::{position, SpanRef, Spans, NIL, RUN_BITS};

/// The most pages one shard holds, 2²⁴ − 1 (64 GiB of distinct pages): slot ids must fit
/// the policies' 24-bit links (`eviction::list::NARROW_MAX_ID`), and each page may need a
/// span of its own (span ids have 25 bits, `spans::MAX_SPANS`). The engine caps a shard's
/// entries below it, and picks enough shards for its budget
/// ([`crate::EngineBuilder::build`]).
pub const MAX_PAGES: usize = {
    let links = crate::eviction::list::NARROW_MAX_ID as usize + 1;
    if links < spans::MAX_SPANS {
        links
    } else {
        spans::MAX_SPANS
    }
};

/// What an index entry holds in place of page bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Value {
    /// Every 8-byte word of the page is this word: no frame is used.
    Fill(u64),
    /// The page's bytes are this content in the store.
    Content(ContentId),
}

/// One page in the index.
#[derive(Debug, Clone, Copy)]
pub struct Slot {
    /// The page's key.
    pub key: PageKey,
    /// Where its bytes are.
    pub value: Value,
    /// Persistent pages are never handed to the eviction policy.
    pub persistent: bool,
}

/// A [`Slot`] as stored: 8 bytes. The pool, object, run and persistence live in the span
/// table, a fill word in the fill table.
#[derive(Debug, Clone, Copy)]
struct Packed {
    /// A content id, or `FILL | fill id`.
    value: u32,
    /// `span << RUN_BITS | position`; `NIL` marks a free slot.
    loc: u32,
}

/// The bit of `Packed::value` that makes it a fill id. Content ids stay below it
/// (frame numbers below 2³⁰, then virtual ids: `store/by_id.rs`).
const FILL: u32 = 1 << 31;

impl Packed {
    fn is_free(&self) -> bool {
        self.loc == NIL
    }

    fn span(&self) -> SpanRef {
        self.loc >> RUN_BITS
    }

    fn position(&self) -> u32 {
        self.loc & ((1 << RUN_BITS) - 1)
    }
}

/// What [`Shard::walk_contents`] does after visiting an entry's content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visit {
    /// Go on to the next entry.
    Next,
    /// The entry names this content from now on; go on.
    Rename(ContentId),
    /// Stop here.
    Stop,
}

/// An index shard.
pub struct Shard {
    index: IdTable<Folded>,
    slots: Vec<Packed>,
    free_slots: Vec<SlotId>,
    spans: Spans,
    fills: Fills,
    policy: Box<dyn Eviction>,
    /// Slots to expect when the shard is full ([`Shard::expect`]).
    expected: usize,
    /// Where the compressor's walk goes on ([`Shard::walk_contents`]).
    compress_hand: usize,
    /// This shard's journal of persistent pages, when the engine keeps one
    /// (`crate::journal`): appended to under this shard's lock.
    pub(crate) journal: Option<crate::journal::Journal>,
}

/// The key of live slot `id`.
fn key_of(slots: &[Packed], spans: &Spans, id: SlotId) -> PageKey {
    let s = &slots[id as usize];
    let e = spans.get(s.span());
    PageKey::new(e.pool, e.object, e.run << RUN_BITS | u64::from(s.position()))
}

impl Shard {
    /// An empty shard whose ephemeral pages are managed by `policy`.
    pub fn new(policy: Box<dyn Eviction>) -> Self {
        Self {
            index: IdTable::default(),
            slots: Vec::new(),
            free_slots: Vec::new(),
            spans: Spans::default(),
            fills: Fills::default(),
            policy,
            expected: 0,
            compress_hand: 0,
            journal: None,
        }
    }

    /// Pages in this shard.
    pub fn len(&self) -> usize {
        self.index.len()
    }

    /// The policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.policy.name()
    }

    /// The policy's small-queue share, if it chooses one (`Eviction::small_share`).
    pub fn small_share(&self) -> Option<f64> {
        self.policy.small_share()
    }

    /// Tells the policy how many pages this shard holds when full, and the index how large
    /// to grow (with room for the shards' uneven shares of the keys), so that a full
    /// shard's index sits near its highest load instead of wherever a power of two puts it.
    ///
    /// The index keeps the capacity it grew to: shrinking it would rehash every entry under
    /// this lock while gets wait, to save 5 bytes per page of the peak.
    pub fn set_capacity(&mut self, pages: usize) {
        self.policy.set_capacity(pages);
        self.expect(pages);
    }

    /// Tells the index and the slot array how many pages a full shard holds (see
    /// [`Shard::set_capacity`]); the policy is left as it is.
    pub fn expect(&mut self, pages: usize) {
        self.expected = crate::dense::with_headroom(pages);
        self.index.expect(self.expected);
        self.spans.expect(self.expected.min(MAX_PAGES));
    }

    /// Moves up to `groups` old groups of each table's growth under way (the index's and
    /// the spans'; `IdTable::tidy`); true while any still has some.
    pub fn tidy(&mut self, groups: usize) -> bool {
        let Shard { index, slots, spans, .. } = self;
        let index_left = index.tidy(groups, |x| key_hash(&key_of(slots, spans, x)));
        spans.tidy(groups) || index_left
    }

    /// The live slot `id`, unpacked.
    fn slot(&self, id: SlotId) -> Slot {
        let s = &self.slots[id as usize];
        debug_assert!(!s.is_free(), "slot {id} is free");
        let e = self.spans.get(s.span());
        let value = match s.value & FILL {
            0 => Value::Content(s.value),
            _ => Value::Fill(self.fills.word(s.value & !FILL)),
        };
        let index = e.run << RUN_BITS | u64::from(s.position());
        Slot { key: PageKey::new(e.pool, e.object, index), value, persistent: e.persistent }
    }

    /// The slot holding `key`, whose [`key_hash`] is `hash`, if any.
    pub fn lookup(&self, key: &PageKey, hash: u64) -> Option<(SlotId, Slot)> {
        let (slots, spans) = (&self.slots, &self.spans);
        let at = position(key.index);
        let id = self.index.find(hash, |id| {
            let s = &slots[id as usize];
            s.position() == at && spans.covers(s.span(), key.pool, key.object, key.index)
        })?;
        Some((id, self.slot(id)))
    }

    /// Records a hit on an ephemeral page.
    pub fn touch(&mut self, id: SlotId, hash: u64) {
        // Read the span's kind alone: a hit is the hot path, and unpacking the whole slot
        // is not needed (its span was just read by the lookup).
        let s = self.slots[id as usize];
        if !s.is_free() && !self.spans.persistent(s.span()) {
            self.policy.touch(id, hash);
        }
    }

    /// Adds a page. The caller guarantees `slot.key` is not in the index, that `hash` is
    /// its [`key_hash`], and that the shard holds fewer than [`MAX_PAGES`] pages.
    #[inline]
    pub fn insert(&mut self, slot: Slot, hash: u64) -> SlotId {
        debug_assert_eq!(hash, key_hash(&slot.key));
        let PageKey { pool, object, index } = slot.key;
        let span = self.spans.add_page(pool, object, index, slot.persistent);
        let span = span.expect("the engine keeps a shard below MAX_PAGES");
        let value = match slot.value {
            Value::Fill(word) => FILL | self.fills.add(word),
            Value::Content(id) => {
                debug_assert!(id & FILL == 0, "content id {id} over the limit");
                id
            }
        };
        let packed = Packed { value, loc: span << RUN_BITS | position(index) };
        let (slots, free) = (&mut self.slots, &mut self.free_slots);
        let id = crate::dense::place_expecting(slots, free, packed, self.expected);
        let Shard { index, slots, spans, .. } = self;
        index.insert_unique(hash, id, |x| key_hash(&key_of(slots, spans, x)));
        if !slot.persistent {
            self.policy.insert(id, hash);
        }
        id
    }

    /// Takes live slot `id` out of the index and its span, frees it, and returns it with
    /// its key's hash.
    fn detach(&mut self, id: SlotId) -> (Slot, u64) {
        let slot = self.slot(id);
        let hash = key_hash(&slot.key);
        let found = self.index.remove(hash, |x| x == id);
        found.expect("a live slot is indexed");
        let s = &mut self.slots[id as usize];
        let (span, at) = (s.span(), s.position());
        if s.value & FILL != 0 {
            self.fills.release(s.value & !FILL);
        }
        s.loc = NIL;
        self.spans.remove_page(span, at);
        self.free_slots.push(id);
        (slot, hash)
    }

    /// Removes a page by slot id and returns it.
    pub fn remove(&mut self, id: SlotId) -> Slot {
        assert!(!self.slots[id as usize].is_free(), "remove of free slot {id}");
        let (slot, _) = self.detach(id);
        if !slot.persistent {
            self.policy.remove(id);
        }
        slot
    }

    /// Asks the policy for a victim and removes it. `None` when no ephemeral page is left.
    pub fn evict_one(&mut self) -> Option<Slot> {
        let id = self.policy.pop_victim()?;
        assert!(!self.slots[id as usize].is_free(), "policy returned free slot {id}");
        let (slot, hash) = self.detach(id);
        self.policy.evicted(hash);
        Some(slot)
    }

    /// Slot ids of every page of `object` in `pool`.
    pub fn object_pages(&self, pool: PoolId, object: ObjectId) -> Vec<SlotId> {
        let mut ids = Vec::new();
        for (r, e) in self.spans.of_object(pool, object) {
            self.collect_span(r, &e, &mut ids);
        }
        ids
    }

    /// Slot ids of every page of `pool`.
    pub fn pool_pages(&self, pool: PoolId) -> Vec<SlotId> {
        let mut ids = Vec::new();
        for (r, e) in self.spans.live() {
            if e.pool == pool {
                self.collect_span(r, &e, &mut ids);
            }
        }
        ids
    }

    /// Pushes the slot id of each page of span `e`, found through the index: a slot
    /// keeps no link to its neighbours, which would cost 8 bytes a page to save a hash
    /// per page of an invalidation.
    fn collect_span(&self, r: SpanRef, e: &spans::Span, ids: &mut Vec<SlotId>) {
        let mut bits = e.pages;
        while bits != 0 {
            let at = bits.trailing_zeros();
            bits &= bits - 1;
            let key = PageKey::new(e.pool, e.object, e.run << RUN_BITS | u64::from(at));
            let loc = r << RUN_BITS | at;
            let slots = &self.slots;
            let id = self.index.find(key_hash(&key), |id| slots[id as usize].loc == loc);
            ids.push(id.expect("a span's page is indexed"));
        }
    }

    /// Visits the contents this shard's entries name, one turn of the slots at most, from
    /// where the last walk stopped (the compressor's clock hand). `visit` says whether to
    /// go on, and may give the entry a new content id (`Visit::Rename`: the store moved the
    /// content to it). The entry it stops at is the first of the next walk.
    pub fn walk_contents(&mut self, mut visit: impl FnMut(ContentId) -> Visit) {
        let n = self.slots.len();
        for _ in 0..n {
            let at = self.compress_hand % n;
            let s = &mut self.slots[at];
            if !s.is_free() && s.value & FILL == 0 {
                match visit(s.value) {
                    Visit::Stop => return,
                    Visit::Next => {}
                    Visit::Rename(id) => {
                        debug_assert!(id & FILL == 0, "content id {id} over the limit");
                        s.value = id;
                    }
                }
            }
            self.compress_hand = (at + 1) % n;
        }
    }

    /// Of the slots `from..from + max_slots`, the live ones whose value is a content that
    /// `pick` chooses, at most `max_picked` of them; and where to go on (`None` after the
    /// last slot). Lets a caller visit every slot in steps, letting go of the shard's lock
    /// between them.
    pub fn content_slots_where(
        &self,
        from: usize,
        max_slots: usize,
        max_picked: usize,
        mut pick: impl FnMut(ContentId) -> bool,
    ) -> (Vec<SlotId>, Option<usize>) {
        let end = from.saturating_add(max_slots).min(self.slots.len());
        let mut picked = Vec::new();
        for i in from..end {
            let s = &self.slots[i];
            if !s.is_free() && s.value & FILL == 0 && pick(s.value) {
                picked.push(i as SlotId);
                if picked.len() == max_picked {
                    let next = i + 1;
                    return (picked, (next < self.slots.len()).then_some(next));
                }
            }
        }
        (picked, (end < self.slots.len()).then_some(end))
    }

    /// Every live slot, for validation and stats.
    pub fn slots(&self) -> impl Iterator<Item = (SlotId, Slot)> + '_ {
        (0..self.slots.len() as SlotId)
            .filter(|&id| !self.slots[id as usize].is_free())
            .map(|id| (id, self.slot(id)))
    }

    /// Heap bytes of this shard's metadata: index, slots, spans and policy.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.index.heap_bytes()
            + crate::dense::resident_bytes(&self.slots)
            + self.free_slots.capacity() * size_of::<SlotId>()
            + self.spans.heap_bytes()
            + self.fills.heap_bytes()
            + self.policy.heap_bytes()
    }

    /// Panics unless the index, the slots, the spans and the policy agree.
    pub fn validate(&self) {
        let mut ephemeral = 0;
        let mut live = 0;
        let mut fills = std::collections::HashMap::new();
        let mut bits = std::collections::HashMap::<SpanRef, spans::Bits>::new();
        for (id, slot) in self.slots() {
            live += 1;
            let s = self.slots[id as usize];
            if s.value & FILL != 0 {
                *fills.entry(s.value & !FILL).or_insert(0) += 1;
            }
            *bits.entry(s.span()).or_default() |= 1 << s.position();
            let hash = key_hash(&slot.key);
            assert_eq!(self.lookup(&slot.key, hash).map(|(i, _)| i), Some(id), "{:?}", slot.key);
            if !slot.persistent {
                ephemeral += 1;
            }
        }
        assert_eq!(live, self.index.len(), "index and slots disagree");
        let (slots, spans) = (&self.slots, &self.spans);
        self.index.validate(|x| key_hash(&key_of(slots, spans, x)));
        assert_eq!(live + self.free_slots.len(), self.slots.len(), "slot free list drifted");
        self.spans.validate();
        self.fills.validate(&fills);
        assert_eq!(bits.len(), self.spans.len(), "spans without a slot");
        for (r, pages) in bits {
            assert_eq!(self.spans.get(r).pages, pages, "span {r}: bitmap and slots disagree");
        }
        assert_eq!(ephemeral, self.policy.len(), "policy tracks the wrong number of pages");
        self.policy.validate();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eviction::Lru;

    fn slot(pool: u32, object: u64, index: u64, value: Value) -> Slot {
        Slot { key: PageKey::new(PoolId(pool), object, index), value, persistent: false }
    }

    #[test]
    fn a_stored_slot_takes_8_bytes_and_round_trips() {
        assert_eq!(std::mem::size_of::<Packed>(), 8);
        let mut shard = Shard::new(Box::new(Lru::new()));
        let key = PageKey::new(PoolId(7), u64::MAX, 3);
        for (value, persistent) in
            [(Value::Fill(u64::MAX), true), (Value::Content(FILL - 1), false)]
        {
            let hash = key_hash(&key);
            let id = shard.insert(Slot { key, value, persistent }, hash);
            let (found, back) = shard.lookup(&key, hash).unwrap();
            assert_eq!(found, id);
            assert_eq!((back.key, back.value, back.persistent), (key, value, persistent));
            shard.validate();
            let gone = shard.remove(id);
            assert_eq!(gone.key, key);
            assert!(shard.lookup(&key, hash).is_none(), "a removed slot is gone");
            shard.validate();
        }
    }

    #[test]
    fn a_full_shard_pays_under_five_bytes_of_index_per_page_whatever_its_size() {
        // hashbrown gave 8192 pages 16 384 buckets (10 B a page); 7000 pages sat at 5.7 B
        // until evictions left tombstones and it doubled too. Now 4 bytes a slot at a load
        // of 15/16, and the headroom of `dense::with_headroom`.
        for pages in [8192usize, 7000, 100] {
            let mut shard = Shard::new(Box::new(Lru::new()));
            shard.set_capacity(pages);
            for round in 0..3u64 {
                for i in 0..pages as u64 {
                    let s = slot(1, i / 64, i % 64 + round * 1000, Value::Content(i as u32));
                    shard.insert(s, key_hash(&s.key));
                    if round > 0 {
                        let old = shard.evict_one().expect("a page to evict");
                        assert_eq!(old.key.index / 1000, round - 1, "LRU evicts the oldest");
                    }
                }
            }
            shard.validate();
            let per_page = shard.index.heap_bytes() as f64 / pages as f64;
            let bound = if pages >= 1000 { 4.8 } else { 10.0 };
            assert!(per_page < bound, "{pages} pages: {per_page:.2} B of index a page");
        }
    }

    #[test]
    fn scattered_pages_share_spans_and_the_last_one_out_leaves_none() {
        // Pages of two pools' objects, dense and scattered, removed in an order unrelated to
        // the order they came in, with evictions between.
        let mut shard = Shard::new(Box::new(Lru::new()));
        let mut keys = Vec::new();
        for i in 0..3000u64 {
            let (object, index) = match i % 3 {
                0 => (i % 5, i),
                1 => (7, i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20),
                _ => (u64::MAX - i % 2, u64::MAX - i),
            };
            let s = slot(1 + (i % 2) as u32, object, index, Value::Content(i as u32));
            if shard.lookup(&s.key, key_hash(&s.key)).is_none() {
                shard.insert(s, key_hash(&s.key));
                keys.push(s.key);
            }
        }
        shard.validate();
        assert!(shard.spans.len() < keys.len(), "dense runs share spans");
        for _ in 0..500 {
            let gone = shard.evict_one().expect("pages to evict");
            keys.retain(|k| *k != gone.key);
        }
        shard.validate();
        keys.sort_by_key(key_hash);
        for (n, key) in keys.iter().enumerate() {
            let (id, _) = shard.lookup(key, key_hash(key)).expect("a page still here");
            shard.remove(id);
            if n % 500 == 0 {
                shard.validate();
            }
        }
        shard.validate();
        assert_eq!((shard.len(), shard.spans.len()), (0, 0), "nothing left behind");
    }

    #[test]
    fn object_and_pool_walks_find_exactly_their_pages() {
        let mut shard = Shard::new(Box::new(Lru::new()));
        let mut ids = std::collections::HashMap::new();
        for (pool, object, index) in [(1, 1, 0), (1, 1, 5), (1, 2, 0), (2, 1, 0), (1, 1, 9)] {
            let s = slot(pool, object, index, Value::Fill(0));
            ids.insert((pool, object, index), shard.insert(s, key_hash(&s.key)));
        }
        shard.validate();
        let mut object: Vec<_> = shard.object_pages(PoolId(1), 1);
        object.sort_unstable();
        let mut want = vec![ids[&(1, 1, 0)], ids[&(1, 1, 5)], ids[&(1, 1, 9)]];
        want.sort_unstable();
        assert_eq!(object, want);
        assert_eq!(shard.pool_pages(PoolId(1)).len(), 4);
        assert_eq!(shard.pool_pages(PoolId(2)), vec![ids[&(2, 1, 0)]]);
        // Unlink from the middle, the head and the tail of a list.
        for k in [(1, 1, 5), (1, 1, 9), (1, 1, 0)] {
            shard.remove(ids[&k]);
            shard.validate();
        }
        assert!(shard.object_pages(PoolId(1), 1).is_empty());
        assert_eq!(shard.pool_pages(PoolId(1)), vec![ids[&(1, 2, 0)]]);
    }
}
