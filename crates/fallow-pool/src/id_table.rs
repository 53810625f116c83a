//! A hash table of 32-bit ids whose size can be any number of buckets, not only a power
//! of two, for the engine's per-page tables: the shard's index (key → slot id), the
//! store's dedup table (stored checksum → content id) and the shard's span tables
//! (`shard/spans.rs`: by run, and by object for the head of each object's list).
//!
//! Why not `hashbrown`: its bucket count is a power of two, so a table's load is anywhere
//! between 7/16 and 7/8 depending on where its size falls (lent budgets are often powers
//! of two themselves: 8192 pages take 16 384 buckets, 10 B a page), and a cache that keeps
//! evicting and inserting near 7/8 fills with tombstones until hashbrown doubles it. This
//! table is told the size it will have when full ([`IdTable::expect`], when the budget
//! changes), grows to exactly that, and holds a load near 15/16 whatever the churn:
//! ~5.3 B a page (RFC 0001, "Outcome").
//!
//! The scheme is bucketized cuckoo hashing. Buckets are groups of eight: eight control
//! bytes (the hash's low 7 bits and a FULL bit, or zero when empty), probed as one `u64`
//! (SWAR), beside eight ids ([`Separate`]), or each in the top byte of its id when ids
//! have 24 bits ([`Folded`]: the shard's index, and the dedup table's banks of 2²⁴
//! content ids, `store/dedup_table.rs`). A hash has two candidate groups, picked by multiplying two
//! remixes of it by the group count (`(h × groups) >> 64`, which works for any count). An
//! id is in one of its two groups, or, rarely, in a small stash. Lookups read the first
//! group and then the second; a removal just clears the byte (no tombstones); an insert
//! takes a free byte in either group, or moves ids to their other group to make one
//! (which asks the caller for their hash). Ids that no sequence of moves can place (keys
//! with identical hashes, more than two groups of them) go to the stash, searched last.
//!
//! Growing does not stop the world: the table allocates the larger arrays and then moves
//! the old ones' ids over a few groups at each insert (two groups, at most 16 ids, each
//! rehashed through the caller), searching both meanwhile. Rebuilding at once would hold
//! the caller's lock for the whole table: the dedup table of a 16 GiB budget doubling from
//! 2 to 4 million entries is ~0.3 s under the store lock, every get waiting.
//!
//! Control bytes are zero when empty, so a new table's memory comes zeroed (mapped from the
//! OS when large, [`crate::zeroed`], so that the arrays a growth lets go of are given back)
//! and is not resident until used.

use crate::zeroed::Zeroed;

/// Slots per group: one `u64` of control bytes.
const GROUP: usize = 8;
const EMPTY: u8 = 0x00;
/// A full slot's control byte: this bit, and the hash's low 7 bits.
const FULL: u8 = 0x80;
const HI: u64 = 0x8080_8080_8080_8080;
const ONES: u64 = 0x0101_0101_0101_0101;
/// A table holds at most 15/16 of its slots. Two groups of eight make room for an id
/// by moving others up to a load of about 98 %; at 15/16 an insert into a full table
/// that keeps replacing its ids moves 1.25 ids on average (0.41 at 7/8), each move one
/// hash the caller computes, and against 7/8 it saves 0.38 B a page in each of the index
/// and the dedup table (RFC 0001, "Outcome").
const LOAD_NUM: usize = 15;
const LOAD_DEN: usize = 16;
/// The fewest groups of an allocated table.
const MIN_GROUPS: usize = 2;
/// Moves an insert tries before it grows the table (or, if the table is mostly empty,
/// puts the id in the stash: its hash then collides with too many others).
const MAX_MOVES: usize = 64;
/// Old groups moved to the new arrays per insert while growing, at least: more when the
/// new arrays have little room beyond what the old ones held, so that the move always
/// ends before they fill. Growth usually doubles, and then two groups (16 slots) per
/// insert end it when the new arrays are about 60 % full.
const MIGRATE_GROUPS: usize = 2;

/// Bit 7 of each byte of the result is set where the byte of `g` is zero; also, rarely,
/// in a byte above a zero one (a borrow), never below: the lowest set byte is always a
/// zero byte, and a spurious match only costs the caller one comparison it rejects.
fn zero_bytes(g: u64) -> u64 {
    g.wrapping_sub(ONES) & !g & HI
}

/// Groups needed to hold `items` at the maximum load.
fn groups_for(items: usize) -> usize {
    (items.saturating_mul(LOAD_DEN).div_ceil(LOAD_NUM * GROUP)).max(MIN_GROUPS)
}

/// `x` taken as a fraction of 2⁶⁴, times `n`: a number below `n`, for any `n`.
fn scale(x: u64, n: usize) -> usize {
    ((u128::from(x) * n as u128) >> 64) as usize
}

fn tag(hash: u64) -> u8 {
    FULL | (hash as u8 & 0x7f)
}

/// How a set of groups keeps its slots: a control byte (a FULL bit and 7 bits of the
/// id's hash, or `EMPTY`) and an id each.
pub(crate) trait Layout: Default {
    /// The largest id it holds.
    const MAX_ID: u32;
    /// `groups` groups of empty slots.
    fn with_groups(groups: usize) -> Self;
    fn groups(&self) -> usize;
    fn heap_bytes(&self) -> usize;
    /// Group `g`'s control bytes as one little-endian word (byte `i`: its slot `i`).
    fn ctrl_word(&self, g: usize) -> u64;
    fn ctrl(&self, slot: usize) -> u8;
    fn id(&self, slot: usize) -> u32;
    /// Fills `slot` (`ctrl` has the FULL bit) or empties it (`ctrl` is `EMPTY`).
    fn set(&mut self, slot: usize, ctrl: u8, id: u32);
    /// Empties every slot of group `g`.
    fn clear_group(&mut self, g: usize);
}

/// Eight control bytes in a word, beside eight `u32` ids: 5 bytes a slot, for ids of
/// any size (span ids, which have 26 bits).
#[derive(Default)]
pub(crate) struct Separate {
    ctrl: Zeroed<u64>,
    ids: Zeroed<u32>,
}

impl Layout for Separate {
    const MAX_ID: u32 = u32::MAX;

    fn with_groups(groups: usize) -> Self {
        Self { ctrl: Zeroed::new(groups), ids: Zeroed::new(groups * GROUP) }
    }

    fn groups(&self) -> usize {
        self.ctrl.len()
    }

    fn heap_bytes(&self) -> usize {
        self.ctrl.len() * std::mem::size_of::<u64>() + self.ids.len() * std::mem::size_of::<u32>()
    }

    #[inline(always)]
    fn ctrl_word(&self, g: usize) -> u64 {
        self.ctrl[g]
    }

    fn ctrl(&self, slot: usize) -> u8 {
        (self.ctrl[slot / GROUP] >> ((slot % GROUP) * 8)) as u8
    }

    #[inline(always)]
    fn id(&self, slot: usize) -> u32 {
        self.ids[slot]
    }

    #[inline(always)]
    fn set(&mut self, slot: usize, ctrl: u8, id: u32) {
        let shift = (slot % GROUP) * 8;
        let word = &mut self.ctrl[slot / GROUP];
        *word = (*word & !(0xff << shift)) | (u64::from(ctrl) << shift);
        self.ids[slot] = id;
    }

    fn clear_group(&mut self, g: usize) {
        self.ctrl[g] = 0;
    }
}

/// The control byte in the top byte of each id's word: 4 bytes a slot, for ids below
/// 2²⁴ (a shard's slot ids, `shard::MAX_PAGES`). The index of a shard uses it: a byte a
/// page less than [`Separate`] (1.07 B at the load of 15/16).
#[derive(Default)]
pub(crate) struct Folded {
    words: Zeroed<u32>,
}

impl Layout for Folded {
    const MAX_ID: u32 = (1 << 24) - 1;

    fn with_groups(groups: usize) -> Self {
        Self { words: Zeroed::new(groups * GROUP) }
    }

    fn groups(&self) -> usize {
        self.words.len() / GROUP
    }

    fn heap_bytes(&self) -> usize {
        self.words.len() * std::mem::size_of::<u32>()
    }

    #[inline(always)]
    fn ctrl_word(&self, g: usize) -> u64 {
        // Gathers the eight top bytes. A miss probes two groups, so it costs a few ns more
        // than with separate control bytes (53 ns against 39 ns, measured with the
        // portable gather).
        let words = self.words[g * GROUP..].first_chunk::<GROUP>().expect("a whole group");
        gather_top_bytes(words)
    }

    fn ctrl(&self, slot: usize) -> u8 {
        (self.words[slot] >> 24) as u8
    }

    #[inline(always)]
    fn id(&self, slot: usize) -> u32 {
        self.words[slot] & Self::MAX_ID
    }

    #[inline(always)]
    fn set(&mut self, slot: usize, ctrl: u8, id: u32) {
        debug_assert!(id <= Self::MAX_ID, "id {id} does not fit 24 bits");
        self.words[slot] = u32::from(ctrl) << 24 | id;
    }

    fn clear_group(&mut self, g: usize) {
        self.words[g * GROUP..(g + 1) * GROUP].fill(0);
    }
}

/// The top bytes of eight words, as one little-endian word (byte `i`: word `i`'s).
///
/// On x86-64, SSE2 (always there): two loads, two shifts and two packs, ~7 instructions
/// where the portable form takes ~40; a put to a dedup pool probes a folded group about six
/// times (the index, the dedup table), ~300 instructions of its ~7,700 (RFC 0001,
/// "Outcome").
#[inline(always)]
fn gather_top_bytes(words: &[u32; GROUP]) -> u64 {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{
            __m128i, _mm_cvtsi128_si64, _mm_loadu_si128, _mm_packs_epi32, _mm_packus_epi16,
            _mm_srli_epi32,
        };
        let p = words.as_ptr().cast::<__m128i>();
        // SAFETY: SSE2 is part of the x86-64 baseline; `words` is 32 readable bytes, and
        // unaligned loads are allowed. Each lane shifted right by 24 is at most 255, so the
        // saturating packs (32 → 16 bits signed, 16 → 8 unsigned) keep every value as is.
        unsafe {
            let lo = _mm_srli_epi32::<24>(_mm_loadu_si128(p));
            let hi = _mm_srli_epi32::<24>(_mm_loadu_si128(p.add(1)));
            let halves = _mm_packs_epi32(lo, hi);
            _mm_cvtsi128_si64(_mm_packus_epi16(halves, halves)) as u64
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        gather_top_bytes_portable(words)
    }
}

/// [`gather_top_bytes`] in plain Rust: eight byte loads in a row (a fixed-size chunk,
/// since over a slice the compiler kept a loop).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn gather_top_bytes_portable(words: &[u32; GROUP]) -> u64 {
    words.iter().enumerate().fold(0, |acc, (i, &w)| acc | u64::from(w >> 24) << (i * 8))
}

/// One set of groups.
#[derive(Default)]
struct Slots<L: Layout> {
    layout: L,
}

impl<L: Layout> Slots<L> {
    fn new(groups: usize) -> Self {
        Self { layout: L::with_groups(groups) }
    }

    fn groups(&self) -> usize {
        self.layout.groups()
    }

    fn is_empty(&self) -> bool {
        self.groups() == 0
    }

    /// Items these groups take at the maximum load.
    fn capacity(&self) -> usize {
        self.groups() * GROUP * LOAD_NUM / LOAD_DEN
    }

    fn heap_bytes(&self) -> usize {
        self.layout.heap_bytes()
    }

    /// The first candidate group of `hash`, where an insert puts it when there is room.
    #[inline(always)]
    fn first_home(&self, hash: u64) -> usize {
        scale(hash.wrapping_mul(0x9e37_79b9_7f4a_7c15), self.groups())
    }

    /// The second candidate group of `hash`, whose first is `first`: another one.
    fn second_home(&self, hash: u64, first: usize) -> usize {
        let second = scale(hash.rotate_left(32).wrapping_mul(0xc2b2_ae3d_27d4_eb4f), self.groups());
        if second == first {
            (first + 1) % self.groups()
        } else {
            second
        }
    }

    fn homes(&self, hash: u64) -> [usize; 2] {
        let first = self.first_home(hash);
        [first, self.second_home(hash, first)]
    }

    /// The id in group `g` whose control byte matches `wanted` (a tag in every byte) and
    /// that `eq` accepts.
    #[inline(always)]
    fn find_in(&self, g: usize, wanted: u64, eq: &mut impl FnMut(u32) -> bool) -> Option<usize> {
        let mut matches = zero_bytes(self.layout.ctrl_word(g) ^ wanted);
        while matches != 0 {
            let slot = g * GROUP + matches.trailing_zeros() as usize / 8;
            if eq(self.layout.id(slot)) {
                return Some(slot);
            }
            matches &= matches - 1;
        }
        None
    }

    /// The slot (in one of its two groups) of the id with this hash that `eq` accepts.
    /// Every lookup's path: inlined into each.
    #[inline(always)]
    fn slot_of(&self, hash: u64, eq: &mut impl FnMut(u32) -> bool) -> Option<usize> {
        if self.is_empty() {
            return None;
        }
        let wanted = u64::from(tag(hash)) * ONES;
        let first = self.first_home(hash);
        if let Some(slot) = self.find_in(first, wanted, eq) {
            return Some(slot);
        }
        self.find_in(self.second_home(hash, first), wanted, eq)
    }

    /// Puts `id` in a free slot of group `g`, if it has one.
    #[inline(always)]
    fn try_put(&mut self, g: usize, hash: u64, id: u32) -> bool {
        let free = zero_bytes(self.layout.ctrl_word(g));
        if free == 0 {
            return false;
        }
        let i = free.trailing_zeros() as usize / 8;
        self.layout.set(g * GROUP + i, tag(hash), id);
        true
    }

    /// Puts `id` in a free slot of one of its groups, moving other ids to their other
    /// group if both are full (`moves` picks which). Returns the id left without a slot
    /// (the one given, or one moved out) when `MAX_MOVES` moves did not find room.
    #[inline(never)]
    fn place(
        &mut self,
        hash: u64,
        id: u32,
        moves: &mut usize,
        hasher: &impl Fn(u32) -> u64,
    ) -> Option<(u64, u32)> {
        let (mut hash, mut id) = (hash, id);
        let mut from = usize::MAX;
        for _ in 0..MAX_MOVES {
            let first = self.first_home(hash);
            if self.try_put(first, hash, id) {
                return None;
            }
            let homes = [first, self.second_home(hash, first)];
            if self.try_put(homes[1], hash, id) {
                return None;
            }
            // Both full: take the place of one of the ids of a group (not the one this id
            // was just moved out of), and carry that one to its other group.
            let g = if homes[0] == from { homes[1] } else { homes[0] };
            *moves = moves.wrapping_add(1);
            let slot = g * GROUP + *moves % GROUP;
            let out = self.layout.id(slot);
            self.layout.set(slot, tag(hash), id);
            (hash, id, from) = (hasher(out), out, g);
        }
        Some((hash, id))
    }

    /// The full slots of group `g`, with their ids.
    fn full_in(&self, g: usize) -> impl Iterator<Item = (usize, u32)> + '_ {
        (g * GROUP..(g + 1) * GROUP)
            .filter(|&s| self.layout.ctrl(s) & FULL != 0)
            .map(|s| (s, self.layout.id(s)))
    }

    fn full(&self) -> impl Iterator<Item = (usize, u32)> + '_ {
        (0..self.groups()).flat_map(|g| self.full_in(g))
    }
}

/// Old groups still being moved to the new ones, the next one to move, and how many to
/// move per insert.
struct Migration<L: Layout> {
    old: Slots<L>,
    next: usize,
    per_insert: usize,
}

/// A table of `u32` ids (below `L::MAX_ID`) found by a 64-bit hash the caller computes.
pub(crate) struct IdTable<L: Layout = Separate> {
    cur: Slots<L>,
    /// While growing: the smaller groups, emptied a few at a time into `cur`.
    migration: Option<Migration<L>>,
    /// Ids (with their hashes) that neither of their groups could take.
    stash: Vec<(u64, u32)>,
    items: usize,
    /// Items the table is expected to hold when full ([`IdTable::expect`]).
    expected: usize,
    /// Picks which of a full group's ids an insert moves, so that moves do not cycle.
    moves: usize,
}

impl<L: Layout> Default for IdTable<L> {
    fn default() -> Self {
        Self {
            cur: Slots::default(),
            migration: None,
            stash: Vec::new(),
            items: 0,
            expected: 0,
            moves: 0,
        }
    }
}

impl<L: Layout> IdTable<L> {
    /// Ids in the table.
    pub(crate) fn len(&self) -> usize {
        self.items
    }

    #[cfg(test)]
    fn groups(&self) -> usize {
        self.cur.groups()
    }

    /// Items the table takes before it must grow.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.cur.capacity()
    }

    /// Heap bytes: a control byte and an id per slot (of both sets while growing), and the
    /// stash.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.cur.heap_bytes()
            + self.migration.as_ref().map_or(0, |m| m.old.heap_bytes())
            + self.stash.capacity() * std::mem::size_of::<(u64, u32)>()
    }

    /// Where the id with this hash that `eq` accepts is.
    #[inline(always)]
    fn locate(&self, hash: u64, eq: &mut impl FnMut(u32) -> bool) -> Option<Found> {
        if let Some(slot) = self.cur.slot_of(hash, eq) {
            return Some(Found::Cur(slot));
        }
        if let Some(slot) = self.migration.as_ref().and_then(|m| m.old.slot_of(hash, eq)) {
            return Some(Found::Old(slot));
        }
        self.stash.iter().position(|&(h, id)| h == hash && eq(id)).map(Found::Stash)
    }

    /// The id with this hash that `eq` accepts.
    #[inline]
    pub(crate) fn find(&self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        Some(match self.locate(hash, &mut eq)? {
            Found::Cur(slot) => self.cur.layout.id(slot),
            Found::Old(slot) => self.migration.as_ref().expect("found there").old.layout.id(slot),
            Found::Stash(i) => self.stash[i].1,
        })
    }

    /// Replaces the id with this hash that `eq` accepts by `new`, whose hash is the same.
    /// False when there is no such id.
    pub(crate) fn replace(&mut self, hash: u64, mut eq: impl FnMut(u32) -> bool, new: u32) -> bool {
        debug_assert!(new <= L::MAX_ID, "id {new} past the layout's {}", L::MAX_ID);
        let Some(found) = self.locate(hash, &mut eq) else { return false };
        match found {
            Found::Cur(slot) => self.cur.layout.set(slot, tag(hash), new),
            Found::Old(slot) => {
                let old = &mut self.migration.as_mut().expect("found there").old;
                old.layout.set(slot, tag(hash), new);
            }
            Found::Stash(i) => self.stash[i].1 = new,
        }
        true
    }

    /// Takes out the id with this hash that `eq` accepts.
    pub(crate) fn remove(&mut self, hash: u64, mut eq: impl FnMut(u32) -> bool) -> Option<u32> {
        let id = match self.locate(hash, &mut eq)? {
            Found::Cur(slot) => {
                let id = self.cur.layout.id(slot);
                self.cur.layout.set(slot, EMPTY, 0);
                id
            }
            Found::Old(slot) => {
                let old = &mut self.migration.as_mut().expect("found there").old;
                let id = old.layout.id(slot);
                old.layout.set(slot, EMPTY, 0);
                id
            }
            Found::Stash(i) => self.stash.swap_remove(i).1,
        };
        self.items -= 1;
        Some(id)
    }

    /// Adds `id`, whose hash is `hash` and which is not in the table yet. `hasher` gives
    /// the hash of any id already in, to move it or to grow the table.
    pub(crate) fn insert_unique(&mut self, hash: u64, id: u32, hasher: impl Fn(u32) -> u64) {
        debug_assert!(id <= L::MAX_ID, "id {id} past the layout's {}", L::MAX_ID);
        if self.items >= self.cur.capacity() {
            self.grow(&hasher);
        }
        // Most inserts find room in the first group; the rest goes through `place`.
        if !self.cur.try_put(self.cur.first_home(hash), hash, id) {
            let mut carried = (hash, id);
            while let Some(left) = self.cur.place(carried.0, carried.1, &mut self.moves, &hasher) {
                if self.items * 2 < self.cur.capacity() {
                    // A mostly empty table that cannot place an id: its hash collides with
                    // a full two groups' worth of others. Growing would not help.
                    self.stash.push(left);
                    break;
                }
                carried = left;
                self.grow(&hasher);
            }
        }
        self.items += 1;
        if let Some(m) = &self.migration {
            let per_insert = m.per_insert;
            self.migrate(per_insert, &hasher);
        }
    }

    /// Moves up to `groups` more old groups of a growth under way, between inserts, and
    /// says whether one is still under way. Inserts move the old groups at the pace that
    /// empties them as the new room fills, so a table whose inserts stop (a cache filled,
    /// then read) would hold both sets of groups for good: the engine's background work
    /// calls this (`Engine::finish_growth`).
    pub(crate) fn tidy(&mut self, groups: usize, hasher: impl Fn(u32) -> u64) -> bool {
        self.migrate(groups, &hasher);
        self.growing()
    }

    /// True while a growth is under way: old groups are left to move.
    pub(crate) fn growing(&self) -> bool {
        self.migration.is_some()
    }

    /// Starts moving to larger groups (after finishing any move under way).
    fn grow(&mut self, hasher: &impl Fn(u32) -> u64) {
        self.migrate(usize::MAX, hasher);
        let groups = groups_for(self.next_capacity());
        let old = std::mem::replace(&mut self.cur, Slots::new(groups));
        if old.groups() > 0 {
            // Room for this many more inserts before the new groups are full: move the
            // old ones well within it.
            let room = self.cur.capacity().saturating_sub(self.items).max(1);
            let per_insert = (2 * old.groups()).div_ceil(room).max(MIGRATE_GROUPS);
            self.migration = Some(Migration { old, next: 0, per_insert });
        }
    }

    /// Moves up to `groups` old groups' ids into the current ones.
    #[inline(never)]
    fn migrate(&mut self, groups: usize, hasher: &impl Fn(u32) -> u64) {
        // Taken out while its ids move, so that the old groups can be read while the new
        // ones are written; put back unless this emptied the last old group.
        let Some(mut m) = self.migration.take() else { return };
        let end = m.next.saturating_add(groups).min(m.old.groups());
        for g in m.next..end {
            for (_, id) in m.old.full_in(g) {
                let hash = hasher(id);
                if let Some(left) = self.cur.place(hash, id, &mut self.moves, hasher) {
                    // The new groups are larger than the old ones held: only ids whose
                    // hashes collide beyond two groups land here.
                    self.stash.push(left);
                }
            }
            m.old.layout.clear_group(g);
        }
        m.next = end;
        if end < m.old.groups() {
            self.migration = Some(m);
        }
    }

    /// How many items the table should take after its next growth. Below the expected
    /// size (or with none) it doubles, cheap amortized, but never past the expected size:
    /// the doubling that reaches it lands on it exactly. Past it, it grows by a quarter,
    /// for the overflow is expected to be small.
    fn next_capacity(&self) -> usize {
        let capacity = self.cur.capacity();
        if capacity < self.expected {
            // The smallest of expected, expected / 2, expected / 4, … above the capacity
            // (and at least two groups' worth): the doublings end on it exactly.
            let mut next = self.expected;
            while next / 2 > capacity && next / 2 >= MIN_GROUPS * GROUP {
                next /= 2;
            }
            next
        } else if self.expected == 0 {
            (capacity * 2).max(MIN_GROUPS * GROUP)
        } else {
            capacity + capacity / 4 + GROUP
        }
    }

    /// Says how many ids the table will hold when full, so that it grows to exactly that
    /// (and a load near 15/16) instead of past it. Allocates nothing: the table grows to it
    /// as ids come. A table larger already keeps its size.
    pub(crate) fn expect(&mut self, items: usize) {
        self.expected = items;
    }

    /// Every id in the table.
    pub(crate) fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let old = self.migration.iter().flat_map(|m| m.old.full().map(|(_, id)| id));
        self.cur.full().map(|(_, id)| id).chain(old).chain(self.stash.iter().map(|&(_, id)| id))
    }

    /// Panics unless the count agrees with the control bytes and every id sits in one of
    /// its two groups (or the stash) under its hash's tag.
    pub(crate) fn validate(&self, hasher: impl Fn(u32) -> u64) {
        assert_eq!(self.iter().count(), self.items, "id table count drifted");
        let sets = std::iter::once(&self.cur).chain(self.migration.iter().map(|m| &m.old));
        for slots in sets {
            for (slot, id) in slots.full() {
                let hash = hasher(id);
                assert!(id <= L::MAX_ID, "id {id} past the layout's {}", L::MAX_ID);
                assert_eq!(slots.layout.ctrl(slot), tag(hash), "id {id} has a stale tag");
                assert!(slots.homes(hash).contains(&(slot / GROUP)), "id {id} outside its groups");
            }
        }
        if let Some(m) = &self.migration {
            let empty = |g| m.old.layout.ctrl_word(g) == 0;
            assert!((0..m.next).all(empty), "a moved old group is not empty");
        }
        for &(hash, id) in &self.stash {
            assert_eq!(hash, hasher(id), "stashed id {id} has a stale hash");
        }
    }
}

/// Where [`IdTable::locate`] found an id.
enum Found {
    Cur(usize),
    Old(usize),
    Stash(usize),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn the_gather_of_top_bytes_agrees_with_the_portable_one(words: [u32; GROUP]) {
            prop_assert_eq!(gather_top_bytes(&words), gather_top_bytes_portable(&words));
        }
    }

    #[test]
    fn the_gather_puts_word_i_in_byte_i() {
        let words = [
            0xFF00_0001,
            0x8012_3456,
            0x7FFF_FFFF,
            0,
            0x0100_0000,
            0xC0FF_EE00,
            0x0A00_0000,
            0xFFFF_FFFF,
        ];
        assert_eq!(gather_top_bytes(&words), 0xFF0A_C001_007F_80FF);
    }
    use std::collections::HashMap;

    /// Ids hash to themselves, spread; `collide` makes many share their low bits and home.
    fn hash_of(id: u32, collide: bool) -> u64 {
        if collide {
            u64::from(id % 3)
        } else {
            crate::hashing::mix64(u64::from(id))
        }
    }

    #[test]
    fn a_table_grows_to_its_expected_size_and_sits_near_fifteen_sixteenths() {
        let mut t = IdTable::<Separate>::default();
        t.expect(8192);
        assert_eq!(t.heap_bytes(), 0, "expecting allocates nothing");
        for id in 0..8192 {
            t.insert_unique(hash_of(id, false), id, |id| hash_of(id, false));
        }
        assert_eq!(t.groups(), groups_for(8192), "the last doubling lands on the expected size");
        let load = 8192.0 / (t.groups() * GROUP) as f64;
        assert!(load > 0.93, "load {load}");
        // hashbrown would hold 8192 items in 16 384 buckets: 10 B an item, not 5.3.
        assert!(t.heap_bytes() * 10 < 8192 * 54, "{} B", t.heap_bytes());
        t.validate(|id| hash_of(id, false));
    }

    #[test]
    fn growing_past_the_expected_size_adds_a_quarter() {
        let mut t = IdTable::<Separate>::default();
        t.expect(1000);
        for id in 0..1000 {
            t.insert_unique(hash_of(id, false), id, |id| hash_of(id, false));
        }
        let cap = t.capacity();
        for id in 1000..=cap as u32 {
            t.insert_unique(hash_of(id, false), id, |id| hash_of(id, false));
        }
        assert!(t.capacity() >= cap + cap / 4 && t.capacity() < cap * 3 / 2);
        t.validate(|id| hash_of(id, false));
    }

    #[test]
    fn a_growth_that_inserts_left_half_done_is_finished_by_tidy_steps() {
        let h = |id: u32| hash_of(id, false);
        let mut t = IdTable::<Folded>::default();
        t.expect(1000);
        (0..1000).for_each(|id| t.insert_unique(h(id), id, h));
        let cap = t.capacity() as u32;
        // A few inserts past the capacity: the table grows, and stops moving old groups
        // when the inserts stop.
        (1000..cap + 3).for_each(|id| t.insert_unique(h(id), id, h));
        assert!(t.migration.is_some(), "a growth is under way");
        let both = t.heap_bytes();
        let mut steps = 0;
        while t.tidy(4, h) {
            steps += 1;
            assert!(steps < 1000, "tidy steps never finished");
        }
        assert!(steps > 1, "a step moves at most 4 groups");
        assert!(t.migration.is_none());
        assert!(t.heap_bytes() < both, "the old groups are freed");
        assert_eq!(t.len(), cap as usize + 3);
        for id in 0..cap + 3 {
            assert_eq!(t.find(h(id), |x| x == id), Some(id), "id {id} lost");
        }
        t.validate(h);
        assert!(!t.tidy(4, h), "nothing left to move");
    }

    #[test]
    fn a_full_table_that_keeps_replacing_its_ids_keeps_its_size() {
        // A cache at its expected size, evicting a random page for every new one: the
        // table sits at 15/16 without growing and without stashing (hashbrown, at that
        // load, fills with tombstones and doubles).
        let mut t = IdTable::<Separate>::default();
        let h = |id: u32| hash_of(id, false);
        t.expect(1000);
        let mut live: Vec<u32> = (0..1000).collect();
        live.iter().for_each(|&id| t.insert_unique(h(id), id, h));
        let groups = t.groups();
        let moves = t.moves;
        let mut rng = 0x2545_f491_4f6c_dd1d_u64;
        for fresh in 1000..50_000u32 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let i = (rng % 1000) as usize;
            assert_eq!(t.remove(h(live[i]), |x| x == live[i]), Some(live[i]));
            t.insert_unique(h(fresh), fresh, h);
            live[i] = fresh;
        }
        assert_eq!(t.len(), 1000);
        assert_eq!(t.groups(), groups, "churn at a steady size does not grow the table");
        assert!(t.stash.is_empty(), "{} ids stashed", t.stash.len());
        assert!(1000.0 / (groups * GROUP) as f64 > 0.92);
        // Cuckoo moves per insert at 15/16 (each asks the caller for a hash): 1.25 measured
        // (0.41 at 7/8).
        let per_insert = t.moves.wrapping_sub(moves) as f64 / 49_000.0;
        assert!(per_insert < 1.6, "{per_insert:.2} moves per insert");
        t.validate(h);
    }

    #[test]
    fn growing_moves_a_few_groups_per_insert_and_loses_nothing() {
        // No insert pays for rehashing the whole table: each moves at most a few groups
        // of the old one (and its own cuckoo moves), whatever the table's size.
        let calls = std::cell::Cell::new(0usize);
        let h = |id: u32| hash_of(id, false);
        let counted = |id: u32| {
            calls.set(calls.get() + 1);
            h(id)
        };
        for expected in [0, 50_000] {
            let mut t = IdTable::<Separate>::default();
            t.expect(expected);
            let mut worst = 0;
            for id in 0..60_000u32 {
                calls.set(0);
                t.insert_unique(h(id), id, counted);
                worst = worst.max(calls.get());
                if id % 997 == 0 {
                    assert!((0..=id).step_by(13).all(|x| t.find(h(x), |y| y == x) == Some(x)));
                }
            }
            assert!(worst <= 2 * MIGRATE_GROUPS * GROUP + MAX_MOVES, "an insert rehashed {worst}");
            assert_eq!(t.len(), 60_000);
            t.validate(h);
        }
    }

    #[test]
    fn ids_whose_hashes_all_collide_are_kept_and_found() {
        // As a client could make keys whose 64-bit hashes agree: more than two groups'
        // worth of them go to the stash, and the table does not grow without end.
        let mut t = IdTable::<Separate>::default();
        let same = |_: u32| 42u64;
        for id in 0..100 {
            t.insert_unique(42, id, same);
        }
        assert_eq!(t.len(), 100);
        assert!(t.groups() < 64, "grew to {} groups for 100 ids", t.groups());
        for id in (0..100).step_by(3) {
            assert_eq!(t.remove(42, |x| x == id), Some(id));
        }
        for id in 0..100 {
            let want = (id % 3 != 0).then_some(id);
            assert_eq!(t.find(42, |x| x == id), want);
        }
        t.validate(same);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u32),
        Remove(u32),
        Replace(u32, u32),
        Expect(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0u32..300).prop_map(Op::Insert),
            3 => (0u32..300).prop_map(Op::Remove),
            1 => (0u32..300, 300u32..600).prop_map(|(a, b)| Op::Replace(a, b)),
            1 => (0usize..400).prop_map(Op::Expect),
        ]
    }

    /// Against a `HashMap` from hash-identity to id: the table finds exactly what the model
    /// holds, with spread hashes and with hashes that all collide.
    fn agrees_with_a_map<L: Layout>(ops: Vec<Op>, collide: bool) -> Result<(), TestCaseError> {
        // Each id is its own key here; `key` maps an id to the model's key (replaced ids
        // keep the key of the id they replaced).
        let mut t = IdTable::<L>::default();
        let mut model: HashMap<u32, u32> = HashMap::new(); // key → id
        let mut key_of: HashMap<u32, u32> = HashMap::new(); // id → key
        for op in ops {
            let hash = |k: u32| hash_of(k, collide);
            match op {
                Op::Insert(k) if !model.contains_key(&k) => {
                    key_of.insert(k, k);
                    let rehash = |id: u32| hash(*key_of.get(&id).expect("id has a key"));
                    t.insert_unique(hash(k), k, rehash);
                    model.insert(k, k);
                }
                Op::Insert(_) => {}
                Op::Remove(k) => {
                    let want = model.remove(&k);
                    let got = t.remove(hash(k), |id| key_of.get(&id) == Some(&k));
                    prop_assert_eq!(got, want);
                }
                Op::Replace(k, new) => {
                    if let (Some(&old), false) = (model.get(&k), key_of.contains_key(&new)) {
                        prop_assert!(t.replace(hash(k), |id| id == old, new), "present");
                        key_of.insert(new, k);
                        model.insert(k, new);
                    }
                }
                Op::Expect(n) => t.expect(n),
            }
            prop_assert_eq!(t.len(), model.len());
            let rehash = |id: u32| hash(*key_of.get(&id).expect("id has a key"));
            t.validate(rehash);
        }
        for k in 0..600u32 {
            let found = t.find(hash_of(k, collide), |id| key_of.get(&id) == Some(&k));
            prop_assert_eq!(found, model.get(&k).copied());
        }
        prop_assert!(!t.replace(hash_of(9999, collide), |_| false, 1), "no such id");
        Ok(())
    }

    proptest! {
        #[test]
        fn separate_control_bytes_agree_with_a_map(
            ops in prop::collection::vec(op(), 1..400),
            collide: bool,
        ) {
            agrees_with_a_map::<Separate>(ops, collide)?;
        }

        #[test]
        fn folded_control_bytes_agree_with_a_map(
            ops in prop::collection::vec(op(), 1..400),
            collide: bool,
        ) {
            agrees_with_a_map::<Folded>(ops, collide)?;
        }
    }

    #[test]
    fn a_folded_slot_keeps_its_control_byte_and_a_24_bit_id_apart() {
        let mut t = IdTable::<Folded>::default();
        let top = Folded::MAX_ID;
        let h = |id: u32| hash_of(id, false);
        for id in [0, 1, top, top - 1] {
            t.insert_unique(h(id), id, h);
        }
        for id in [0, 1, top, top - 1] {
            assert_eq!(t.find(h(id), |x| x == id), Some(id));
        }
        assert_eq!(t.remove(h(top), |x| x == top), Some(top));
        assert_eq!(t.find(h(top), |x| x == top), None);
        t.validate(h);
        // A slot of id 0 is not taken for an empty one.
        assert_eq!(t.heap_bytes(), t.groups() * GROUP * 4);
    }
}
