//! The summary: for every page this client put into a private ephemeral pool and has not
//! seen leave, the node it is on; for every page of a private persistent pool, the two
//! nodes holding its copies (kept when a node is retired, until the repair replaces it). A get of a page not in the summary is a miss answered
//! here, without a round trip, and a get of a page in it goes straight to its node, even
//! after weights or membership changed where new puts of the key would go.
//!
//! # Exactness
//!
//! The summary is exact, not a filter: it stores the page index itself, per object, so
//! two keys never share an entry. That is what makes it safe: an entry always names the
//! node that took the key's latest put (or the key has no entry), so a get never reaches
//! a node holding an older copy left behind when the key moved. A fingerprint table would
//! be smaller, but two keys with equal fingerprints would route one key's get to where
//! the other was put, which may hold a stale copy of the first: wrong data, not a miss.
//!
//! # Layout and memory
//!
//! ```text
//!  objects: (pool, object) ──▶ Pages { cells: [u64], len, spill }
//!                                cell = index << 12 | slot     (0 = empty)
//! ```
//!
//! A cell packs the page index (below 2^52: every page of a 2^64-byte device) and a
//! 12-bit node slot (1..=4095) into 8 bytes; rarer larger indexes go to a small spill map.
//! A persistent page's cell packs both holders' slots and an index below 2^40 (4 PiB of
//! one object) instead, in separate tables, so it costs the same.
//! Cells are open-addressed with linear probing and backward-shift deletion (no
//! tombstones), kept between 53 % and 80 % full: a table grows 1.5 times when it passes
//! 80 % and shrinks when it falls under 20 %. So a page costs 10 to 15 bytes in a large
//! object (`BENCHMARKS.md` has the measurements), plus about 70 bytes per object.
//!
//! # Slots
//!
//! Nodes are named by slots, handed out here. When a node dies its slot is retired: its
//! entries read as absent and are dropped when next touched or when their table is
//! rebuilt, and the slot is handed out again only once no entry names it.

#![expect(
    clippy::indexing_slicing,
    reason = "cells and slots are found by the table's own probing and slot numbers"
)]

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use fallow_core::{ObjectId, PageKey, PoolId};

/// A node's number in the summary and the cluster client: 1..=[`MAX_SLOT`].
pub(crate) type Slot = u16;

const SLOT_BITS: u32 = 12;
const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
/// The largest slot: 4095 node incarnations known at once.
pub(crate) const MAX_SLOT: Slot = SLOT_MASK as Slot;
/// The smallest table.
const MIN_CELLS: usize = 2;

/// The murmur3 finalizer: spreads consecutive indexes over the table.
fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// What each slot is, and how many entries name it.
#[derive(Default)]
struct Slots {
    /// Entries per slot (index 0 unused).
    counts: Vec<u64>,
    /// Whether a slot is handed out to a live node (false: free or retired).
    active: Vec<bool>,
    /// Whether a slot was retired (its node is gone). Cleared when the slot is handed
    /// out again, which happens only once no entry names it.
    retired: Vec<bool>,
}

impl Slots {
    fn is_retired(&self, slot: Slot) -> bool {
        self.retired.get(slot as usize).copied().unwrap_or(false)
    }
}

/// The two holders of a persistent page, packed as `first | second << 12` (0: none).
fn pack(holders: [Slot; 2]) -> u32 {
    u32::from(holders[0]) | u32::from(holders[1]) << SLOT_BITS
}

/// The slots of a packed value: one slot (the second 0), or two holders.
fn unpack(value: u32) -> [Slot; 2] {
    [(value & SLOT_MASK as u32) as Slot, (value >> SLOT_BITS) as Slot]
}

/// One object's pages. Invariant: `len` counts the non-empty cells, at least one cell is
/// empty whenever any exist, and each entry sits at or after its home cell with no empty
/// cell between them (cyclically). `TWO`: cells hold two 12-bit slots (a persistent
/// page's two holders, `index << 24 | second << 12 | first`) instead of one; entries of
/// retired slots are then kept (their pages are re-created elsewhere, see [`Summary`]).
#[derive(Default)]
struct Pages<const TWO: bool> {
    cells: Box<[u64]>,
    len: usize,
    /// Entries whose index is too large for a cell (packed values). Boxed: an empty map
    /// would cost every object 48 bytes, the box costs 8.
    #[expect(clippy::box_collection, reason = "keeps the common, empty case small")]
    spill: Option<Box<HashMap<u64, u32>>>,
}

impl<const TWO: bool> Pages<TWO> {
    /// Bits of a cell below the index.
    const SHIFT: u32 = if TWO { 2 * SLOT_BITS } else { SLOT_BITS };
    const MASK: u64 = (1 << Self::SHIFT) - 1;
    /// The largest index that fits in a cell.
    const MAX_INDEX: u64 = u64::MAX >> Self::SHIFT;

    fn home(index: u64, cells: usize) -> usize {
        ((u128::from(mix(index)) * cells as u128) >> 64) as usize
    }

    /// `Ok(position)` of the entry for `index`, or `Err(position)` of the empty cell
    /// where it would go.
    fn find(&self, index: u64) -> Result<usize, usize> {
        let n = self.cells.len();
        let mut i = Self::home(index, n);
        loop {
            match self.cells[i] {
                0 => return Err(i),
                cell if cell >> Self::SHIFT == index => return Ok(i),
                _ => i = if i + 1 == n { 0 } else { i + 1 },
            }
        }
    }

    /// The packed value of `index`'s entry.
    fn get(&self, index: u64) -> Option<u32> {
        if index > Self::MAX_INDEX {
            return self.spill.as_ref()?.get(&index).copied();
        }
        if self.cells.is_empty() {
            return None;
        }
        self.find(index).ok().map(|i| (self.cells[i] & Self::MASK) as u32)
    }

    /// Sets the entry (a packed value); returns the value it had before.
    fn insert(&mut self, index: u64, value: u32, slots: &mut Slots) -> Option<u32> {
        debug_assert!(unpack(value).iter().any(|&s| (1..=MAX_SLOT).contains(&s)));
        if index > Self::MAX_INDEX {
            return self.spill.get_or_insert_with(Default::default).insert(index, value);
        }
        if (self.len + 1) * 5 > self.cells.len() * 4 {
            self.rebuild(self.len + 1, slots);
        }
        let cell = index << Self::SHIFT | u64::from(value);
        match self.find(index) {
            Ok(i) => Some((std::mem::replace(&mut self.cells[i], cell) & Self::MASK) as u32),
            Err(i) => {
                self.cells[i] = cell;
                self.len += 1;
                None
            }
        }
    }

    /// Removes the entry; returns its packed value.
    fn remove(&mut self, index: u64, slots: &mut Slots) -> Option<u32> {
        if index > Self::MAX_INDEX {
            return self.spill.as_mut()?.remove(&index);
        }
        if self.cells.is_empty() {
            return None;
        }
        let i = self.find(index).ok()?;
        let value = (self.cells[i] & Self::MASK) as u32;
        self.delete_at(i);
        if self.cells.len() > 16 && self.len * 5 < self.cells.len() {
            self.rebuild(self.len, slots);
        }
        Some(value)
    }

    /// Backward-shift deletion: entries after the hole that may move closer to their home
    /// move into it, so that no search ever stops early at the hole.
    fn delete_at(&mut self, mut hole: usize) {
        let n = self.cells.len();
        let mut j = hole;
        loop {
            j = if j + 1 == n { 0 } else { j + 1 };
            let cell = self.cells[j];
            if cell == 0 {
                break;
            }
            let home = Self::home(cell >> Self::SHIFT, n);
            // The entry at j may fill the hole unless its home lies cyclically in (hole, j].
            let stays = if hole <= j { hole < home && home <= j } else { hole < home || home <= j };
            if !stays {
                self.cells[hole] = cell;
                hole = j;
            }
        }
        self.cells[hole] = 0;
        self.len -= 1;
    }

    /// Rebuilds the cells for `room` entries at 53 % load, dropping entries of retired
    /// slots (and counting them out) unless they are persistent pages' holders.
    fn rebuild(&mut self, room: usize, slots: &mut Slots) {
        let n = (room * 15 / 8).max(MIN_CELLS);
        let old = std::mem::replace(&mut self.cells, vec![0; n].into_boxed_slice());
        self.len = 0;
        for cell in old.iter().copied().filter(|&c| c != 0) {
            let slot = (cell & SLOT_MASK) as Slot;
            if !TWO && slots.is_retired(slot) {
                slots.counts[slot as usize] -= 1;
                continue;
            }
            match self.find(cell >> Self::SHIFT) {
                Err(i) => {
                    self.cells[i] = cell;
                    self.len += 1;
                }
                Ok(_) => debug_assert!(false, "index {} twice in one table", cell >> Self::SHIFT),
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.len == 0 && self.spill.as_ref().is_none_or(|s| s.is_empty())
    }

    /// Every entry: index and packed value.
    fn entries(&self) -> impl Iterator<Item = (u64, u32)> + '_ {
        let cells = self.cells.iter().filter(|&&c| c != 0);
        let cells = cells.map(|c| (c >> Self::SHIFT, (c & Self::MASK) as u32));
        cells.chain(self.spill.iter().flat_map(|s| s.iter().map(|(i, v)| (*i, *v))))
    }

    /// Every slot the entries name (both holders of a persistent page).
    fn slots(&self) -> impl Iterator<Item = Slot> + '_ {
        self.entries().flat_map(|(_, v)| unpack(v)).filter(|&s| s != 0)
    }

    /// Entries.
    fn count(&self) -> usize {
        self.len + self.spill.as_ref().map_or(0, |s| s.len())
    }

    fn heap_bytes(&self) -> usize {
        let spill = self.spill.as_ref().map_or(0, |s| 48 + s.capacity() * 13);
        self.cells.len() * 8 + spill
    }
}

/// A fast hasher for `(pool, object)` and page keys: the keys are the caller's own, not
/// a peer's.
#[derive(Default)]
struct ObjectHasher(u64);

impl Hasher for ObjectHasher {
    fn finish(&self) -> u64 {
        mix(self.0)
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0.rotate_left(8) ^ u64::from(*b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }

    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    fn write_u64(&mut self, n: u64) {
        self.0 = mix(self.0 ^ n).wrapping_add(n);
    }
}

type ObjectMap<const TWO: bool> =
    HashMap<(PoolId, ObjectId), Pages<TWO>, BuildHasherDefault<ObjectHasher>>;

/// Where each page this client put is (see the module doc). Not thread-safe: the cluster
/// client keeps it under one mutex, held for one batch's lookups or updates.
#[derive(Default)]
pub(crate) struct Summary {
    objects: ObjectMap<false>,
    /// Persistent pages: both holders of each.
    copies: ObjectMap<true>,
    slots: Slots,
    /// Persistent pages with a put in flight, from [`Summary::put_begins`] until
    /// [`Summary::put_released`]; empty when none.
    puts: HashMap<PageKey, PutsInFlight, BuildHasherDefault<ObjectHasher>>,
}

/// The puts of one persistent page in flight.
#[derive(Debug, Default)]
struct PutsInFlight {
    /// How many have not ended ([`Summary::put_ends`]).
    count: u32,
    /// How many have not sent their last request (removing copies that no longer
    /// count; [`Summary::put_released`]): at least `count`. A put of the key waits while
    /// this is not 0, and the entry lives as long.
    writing: u32,
    /// How many of the key's puts ended stored since the first of these began.
    stored: u64,
}

/// How a put of a persistent page ended ([`Summary::put_ends`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PutEnd {
    /// Stored on both holders.
    Stored([Slot; 2]),
    /// Refused, or failed, on a holder.
    Refused,
    /// Never sent.
    Abandoned,
}

/// How big the summary is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SummaryStats {
    /// Pages recorded, ephemeral and persistent (including entries of dead nodes not yet
    /// dropped).
    pub pages: u64,
    /// Of these, pages of persistent pools (each with two holders).
    pub persistent: u64,
    /// Objects with at least one page.
    pub objects: usize,
    /// Heap bytes held: tables, cells and the slot book.
    pub heap_bytes: usize,
}

/// Persistent pages that lost a copy, found by [`Summary::at_risk`].
#[derive(Debug, Default)]
pub(crate) struct AtRisk {
    /// Pages with one live holder: the key and that holder.
    pub pages: Vec<(PageKey, Slot)>,
    /// Pages whose holders are both gone.
    pub lost: u64,
}

impl Summary {
    /// A free slot for a new node, or `None` when all [`MAX_SLOT`] are taken.
    pub(crate) fn allocate_slot(&mut self) -> Option<Slot> {
        let free = |s: &Slots| {
            (1..=MAX_SLOT as usize).find(|&i| {
                !s.active.get(i).copied().unwrap_or(false)
                    && s.counts.get(i).is_none_or(|&c| c == 0)
            })
        };
        let slot = match free(&self.slots) {
            Some(slot) => slot,
            None => {
                self.purge_retired();
                free(&self.slots)?
            }
        };
        let need = slot + 1;
        if self.slots.counts.len() < need {
            self.slots.counts.resize(need, 0);
            self.slots.active.resize(need, false);
            self.slots.retired.resize(need, false);
        }
        self.slots.active[slot] = true;
        self.slots.retired[slot] = false;
        Some(slot as Slot)
    }

    /// The node of `slot` is gone: its entries read as absent from now on.
    pub(crate) fn retire(&mut self, slot: Slot) {
        let i = slot as usize;
        if i < self.slots.active.len() {
            self.slots.active[i] = false;
            self.slots.retired[i] = self.slots.counts[i] > 0;
        }
    }

    /// Where `key` is, if this client put it there.
    pub(crate) fn get(&mut self, key: &PageKey) -> Option<Slot> {
        let pages = self.objects.get(&(key.pool, key.object))?;
        let slot = pages.get(key.index)? as Slot;
        if self.slots.is_retired(slot) {
            self.remove(key);
            return None;
        }
        Some(slot)
    }

    /// Records that `key`'s latest put is on `slot`; returns where it was before.
    pub(crate) fn insert(&mut self, key: &PageKey, slot: Slot) -> Option<Slot> {
        let pages = self.objects.entry((key.pool, key.object)).or_default();
        let old = pages.insert(key.index, u32::from(slot), &mut self.slots);
        self.slots.counts[slot as usize] += 1;
        let old = old? as Slot;
        self.slots.counts[old as usize] -= 1;
        (!self.slots.is_retired(old)).then_some(old)
    }

    /// Forgets `key`; returns where it was (`None` if nowhere, or on a retired node).
    pub(crate) fn remove(&mut self, key: &PageKey) -> Option<Slot> {
        let object = (key.pool, key.object);
        let pages = self.objects.get_mut(&object)?;
        let slot = pages.remove(key.index, &mut self.slots)? as Slot;
        if pages.is_empty() {
            self.objects.remove(&object);
        }
        self.slots.counts[slot as usize] -= 1;
        (!self.slots.is_retired(slot)).then_some(slot)
    }

    /// Forgets `key` if it is recorded on `slot` (a miss there shows it left).
    pub(crate) fn remove_if(&mut self, key: &PageKey, slot: Slot) {
        let on = self.objects.get(&(key.pool, key.object)).and_then(|p| p.get(key.index));
        if on == Some(u32::from(slot)) {
            self.remove(key);
        }
    }

    /// Forgets every page of one object; returns how many persistent pages it had.
    pub(crate) fn forget_object(&mut self, pool: PoolId, object: ObjectId) -> u64 {
        if let Some(pages) = self.objects.remove(&(pool, object)) {
            Self::count_out(&mut self.slots, pages.slots());
        }
        match self.copies.remove(&(pool, object)) {
            Some(pages) => {
                Self::count_out(&mut self.slots, pages.slots());
                pages.count() as u64
            }
            None => 0,
        }
    }

    /// Forgets every page of one pool; returns how many persistent pages it had.
    pub(crate) fn forget_pool(&mut self, pool: PoolId) -> u64 {
        let mut objects: Vec<_> = self.objects.keys().filter(|(p, _)| *p == pool).collect();
        objects.extend(self.copies.keys().filter(|(p, _)| *p == pool));
        let objects: Vec<_> = objects.into_iter().copied().collect();
        objects.into_iter().map(|(pool, object)| self.forget_object(pool, object)).sum()
    }

    fn count_out(slots: &mut Slots, named: impl Iterator<Item = Slot>) {
        for slot in named {
            slots.counts[slot as usize] -= 1;
        }
    }

    /// A holder as readers see it: 0 if none or retired.
    fn live(&self, slot: Slot) -> Slot {
        match slot != 0 && !self.slots.is_retired(slot) {
            true => slot,
            false => 0,
        }
    }

    /// The holders of persistent page `key`, retired ones as 0; `None` if this client
    /// holds no such page. `Some([0, 0])`: both copies are gone.
    pub(crate) fn copies(&self, key: &PageKey) -> Option<[Slot; 2]> {
        let value = self.copies.get(&(key.pool, key.object))?.get(key.index)?;
        Some(unpack(value).map(|s| self.live(s)))
    }

    /// Records that persistent page `key` is on both `holders` (two different slots).
    pub(crate) fn insert_copies(&mut self, key: &PageKey, holders: [Slot; 2]) {
        debug_assert!(holders[0] != holders[1] && !holders.contains(&0));
        let pages = self.copies.entry((key.pool, key.object)).or_default();
        let old = pages.insert(key.index, pack(holders), &mut self.slots);
        for slot in holders {
            self.slots.counts[slot as usize] += 1;
        }
        Self::count_out(&mut self.slots, old.into_iter().flat_map(unpack).filter(|&s| s != 0));
    }

    /// Whether a put of persistent page `key` is still writing (it began and was not
    /// released).
    pub(crate) fn put_writing(&self, key: &PageKey) -> bool {
        !self.puts.is_empty() && self.puts.contains_key(key)
    }

    /// A put of `key` that began (and ended) has sent its last request.
    pub(crate) fn put_released(&mut self, key: &PageKey) {
        let Some(puts) = self.puts.get_mut(key) else {
            debug_assert!(false, "a put was released that did not begin");
            return;
        };
        puts.writing -= 1;
        if puts.writing == 0 {
            self.puts.remove(key);
        }
    }

    /// A put of persistent page `key` begins; returns its ticket for
    /// [`Summary::put_ends`]. Its older copies stay recorded until it ends, so that a get
    /// meanwhile reads the older page rather than missing.
    pub(crate) fn put_begins(&mut self, key: &PageKey) -> u64 {
        let puts = self.puts.entry(*key).or_default();
        puts.count += 1;
        puts.writing += 1;
        puts.stored
    }

    /// The put of `key` with `ticket` ended: stored on `holders`, or refused (`None`:
    /// a refused put leaves no older page, so the page is forgotten, unless another put
    /// of the key ended stored after this one began, whose copies are then the page), or
    /// abandoned before anything was sent (`Abandoned`).
    pub(crate) fn put_ends(&mut self, key: &PageKey, ticket: u64, end: PutEnd) {
        let Some(puts) = self.puts.get_mut(key) else {
            debug_assert!(false, "a put ended that did not begin");
            return;
        };
        let stored_meanwhile = puts.stored > ticket;
        if matches!(end, PutEnd::Stored(_)) {
            puts.stored += 1;
        }
        puts.count -= 1;
        match end {
            PutEnd::Stored(holders) => self.insert_copies(key, holders),
            PutEnd::Refused if !stored_meanwhile => {
                self.remove_copies(key);
            }
            PutEnd::Refused | PutEnd::Abandoned => {}
        }
    }

    /// Forgets persistent page `key`; returns its holders (retired ones as 0).
    pub(crate) fn remove_copies(&mut self, key: &PageKey) -> Option<[Slot; 2]> {
        let object = (key.pool, key.object);
        let pages = self.copies.get_mut(&object)?;
        let value = pages.remove(key.index, &mut self.slots)?;
        if pages.is_empty() {
            self.copies.remove(&object);
        }
        let holders = unpack(value);
        Self::count_out(&mut self.slots, holders.into_iter().filter(|&s| s != 0));
        Some(holders.map(|s| self.live(s)))
    }

    /// Replaces the lost holder of `key` by `new`, if `key` is still held by `survivor`
    /// and a holder that is retired or in `gone` (a repair); returns whether it did.
    pub(crate) fn replace_lost(
        &mut self,
        key: &PageKey,
        survivor: Slot,
        new: Slot,
        gone: &[Slot],
    ) -> bool {
        let Some(holders) = self.copies(key) else { return false };
        let ok = match holders.map(|s| if gone.contains(&s) { 0 } else { s }) {
            [a, 0] | [0, a] => a == survivor && new != survivor,
            _ => false,
        };
        if ok {
            self.insert_copies(key, [survivor, new]);
        }
        ok
    }

    /// Every persistent page with fewer than two live holders (a full pass); holders in
    /// `gone` count as lost, as retired ones do.
    pub(crate) fn at_risk(&self, gone: &[Slot]) -> AtRisk {
        let mut found = AtRisk::default();
        let live = |s: Slot| if gone.contains(&s) { 0 } else { self.live(s) };
        for (&(pool, object), pages) in &self.copies {
            for (index, value) in pages.entries() {
                match unpack(value).map(live) {
                    [0, 0] => found.lost += 1,
                    [a, 0] | [0, a] => found.pages.push((PageKey::new(pool, object, index), a)),
                    _ => {}
                }
            }
        }
        found
    }

    /// Drops every entry of a retired slot (a full pass; needed only when slots run out).
    /// Persistent pages keep theirs until a repair replaces them.
    fn purge_retired(&mut self) {
        let objects: Vec<_> = self.objects.keys().copied().collect();
        for object in objects {
            let Some(pages) = self.objects.get_mut(&object) else { continue };
            pages.rebuild(pages.len, &mut self.slots);
            if let Some(spill) = &mut pages.spill {
                let retired = &self.slots.retired;
                let counts = &mut self.slots.counts;
                spill.retain(|_, slot| {
                    let keep = !retired[*slot as usize];
                    if !keep {
                        counts[*slot as usize] -= 1;
                    }
                    keep
                });
            }
            if pages.is_empty() {
                self.objects.remove(&object);
            }
        }
    }

    /// Entries naming `slot`.
    pub(crate) fn pages_on(&self, slot: Slot) -> u64 {
        self.slots.counts.get(slot as usize).copied().unwrap_or(0)
    }

    /// Size and memory.
    pub(crate) fn stats(&self) -> SummaryStats {
        // hashbrown: buckets are a power of two holding up to 7/8 of them, one control
        // byte each plus a group's worth.
        let entry = std::mem::size_of::<((PoolId, ObjectId), Pages<false>)>() + 1;
        let outer = |cap: usize| {
            let buckets = if cap == 0 {
                0
            } else if cap < 8 {
                cap + 1
            } else {
                (cap * 8 / 7).next_power_of_two()
            };
            if buckets == 0 {
                0
            } else {
                buckets * entry + 16
            }
        };
        let inner: usize = self.objects.values().map(Pages::heap_bytes).sum::<usize>()
            + self.copies.values().map(Pages::heap_bytes).sum::<usize>();
        let book = self.slots.counts.capacity() * 8 + self.slots.active.capacity() * 2;
        let persistent: usize = self.copies.values().map(Pages::count).sum();
        let ephemeral: usize = self.objects.values().map(Pages::count).sum();
        SummaryStats {
            pages: (ephemeral + persistent) as u64,
            persistent: persistent as u64,
            objects: self.objects.len() + self.copies.len(),
            heap_bytes: outer(self.objects.capacity())
                + outer(self.copies.capacity())
                + inner
                + book,
        }
    }

    /// Checks every invariant (tests).
    #[cfg(test)]
    pub(crate) fn validate(&self) {
        fn check<const TWO: bool>(map: &ObjectMap<TWO>, counts: &mut [u64]) -> u64 {
            let mut pages = 0;
            for pages_of in map.values() {
                assert!(!pages_of.is_empty(), "an empty object is kept");
                let n = pages_of.cells.len();
                let live = pages_of.cells.iter().filter(|&&c| c != 0).count();
                assert_eq!(live, pages_of.len);
                assert!(live < n || n == 0, "no empty cell");
                for (i, &cell) in pages_of.cells.iter().enumerate().filter(|(_, c)| **c != 0) {
                    let index = cell >> Pages::<TWO>::SHIFT;
                    assert_eq!(pages_of.find(index), Ok(i), "index {index} unreachable");
                }
                for slot in pages_of.slots() {
                    counts[slot as usize] += 1;
                }
                pages += pages_of.count() as u64;
            }
            pages
        }
        let mut counts = vec![0u64; self.slots.counts.len()];
        let pages = check(&self.objects, &mut counts) + check(&self.copies, &mut counts);
        assert_eq!(counts, self.slots.counts);
        assert_eq!(pages, self.stats().pages);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use rand::{Rng, SeedableRng};

    fn key(object: u64, index: u64) -> PageKey {
        PageKey::new(PoolId(1), object, index)
    }

    #[test]
    fn agrees_with_a_map_through_random_operations() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut summary = Summary::default();
        let slots: Vec<Slot> = (0..4).map(|_| summary.allocate_slot().unwrap()).collect();
        let mut model: HashMap<PageKey, Slot> = HashMap::new();
        for step in 0..60_000 {
            // Few objects, indexes clustered, some past what a cell holds.
            let index = match rng.gen_range(0..20) {
                0 => u64::MAX - rng.gen_range(0..4),
                _ => rng.gen_range(0..3000),
            };
            let k = key(rng.gen_range(0..3), index);
            match rng.gen_range(0..10) {
                0..=4 => {
                    let slot = slots[rng.gen_range(0..slots.len())];
                    assert_eq!(summary.insert(&k, slot), model.insert(k, slot), "step {step}");
                }
                5..=7 => assert_eq!(summary.remove(&k), model.remove(&k), "step {step}"),
                8 => {
                    let slot = slots[rng.gen_range(0..slots.len())];
                    summary.remove_if(&k, slot);
                    if model.get(&k) == Some(&slot) {
                        model.remove(&k);
                    }
                }
                _ => assert_eq!(summary.get(&k), model.get(&k).copied(), "step {step}"),
            }
            if step % 5000 == 0 {
                summary.validate();
            }
        }
        summary.validate();
        assert_eq!(summary.stats().pages, model.len() as u64);
        for (k, slot) in &model {
            assert_eq!(summary.get(k), Some(*slot));
        }
    }

    #[test]
    fn a_retired_slot_reads_as_absent_and_is_reused_once_unnamed() {
        let mut summary = Summary::default();
        let a = summary.allocate_slot().unwrap();
        let b = summary.allocate_slot().unwrap();
        for i in 0..100 {
            summary.insert(&key(0, i), if i % 2 == 0 { a } else { b });
        }
        summary.retire(b);
        assert_eq!(summary.get(&key(0, 1)), None);
        assert_eq!(summary.get(&key(0, 2)), Some(a));
        // Its entries still exist, so a new node does not get slot b yet.
        let c = summary.allocate_slot().unwrap();
        assert_ne!(c, b);
        // Overwriting an entry of a retired slot reports no earlier location.
        assert_eq!(summary.insert(&key(0, 3), a), None);
        summary.validate();
        // Growing the table drops the rest of b's entries; then b is free again.
        for i in 100..400 {
            summary.insert(&key(0, i), a);
        }
        summary.validate();
        assert_eq!(summary.pages_on(b), 0);
        assert_eq!(summary.stats().pages, 351); // a's 50 + 1 overwritten + 300
        assert_eq!(summary.allocate_slot(), Some(b));
    }

    #[test]
    fn objects_and_pools_are_forgotten_whole() {
        let mut summary = Summary::default();
        let a = summary.allocate_slot().unwrap();
        for object in 0..3 {
            for i in 0..50 {
                summary.insert(&key(object, i), a);
                summary.insert(&PageKey::new(PoolId(2), object, i), a);
            }
        }
        summary.forget_object(PoolId(1), 1);
        assert_eq!(summary.get(&key(1, 7)), None);
        assert_eq!(summary.get(&key(2, 7)), Some(a));
        summary.forget_pool(PoolId(2));
        assert_eq!(summary.stats().pages, 100);
        assert_eq!(summary.stats().objects, 2);
        summary.validate();
    }

    #[test]
    fn slots_run_out_only_when_every_one_is_named_or_active() {
        let mut summary = Summary::default();
        let all: Vec<Slot> = std::iter::from_fn(|| summary.allocate_slot()).collect();
        assert_eq!(all.len(), MAX_SLOT as usize);
        summary.insert(&key(0, 0), all[7]);
        summary.retire(all[7]);
        summary.retire(all[8]);
        // Slot 8 was named by nothing: free at once. Slot 7 is freed by a purge.
        assert_eq!(summary.allocate_slot(), Some(all[8]));
        assert_eq!(summary.allocate_slot(), Some(all[7]));
        assert_eq!(summary.stats().pages, 0);
        assert_eq!(summary.allocate_slot(), None);
        summary.validate();
    }

    #[test]
    fn a_put_in_flight_keeps_the_older_copies_and_a_refusal_forgets_only_what_it_replaced() {
        let mut summary = Summary::default();
        let (a, b, c) = (
            summary.allocate_slot().unwrap(),
            summary.allocate_slot().unwrap(),
            summary.allocate_slot().unwrap(),
        );
        let k = key(1, 7);
        summary.insert_copies(&k, [a, b]);
        // Stored: the older copies are read until the new ones replace them. The key stays
        // written (a later put of it waits) until the put is released, after it ended.
        let ticket = summary.put_begins(&k);
        assert_eq!(summary.copies(&k), Some([a, b]));
        assert!(summary.put_writing(&k));
        summary.put_ends(&k, ticket, PutEnd::Stored([b, c]));
        assert_eq!(summary.copies(&k), Some([b, c]));
        assert!(summary.put_writing(&k), "released before its last request");
        summary.put_released(&k);
        assert!(!summary.put_writing(&k));
        // Refused alone: the page is forgotten (a refused put leaves no older page).
        let ticket = summary.put_begins(&k);
        summary.put_ends(&k, ticket, PutEnd::Refused);
        summary.put_released(&k);
        assert_eq!(summary.copies(&k), None);
        // Two at once (a batch may hold a key twice), the later one stored first: the
        // earlier one's refusal keeps it.
        summary.insert_copies(&k, [a, b]);
        let first = summary.put_begins(&k);
        let second = summary.put_begins(&k);
        summary.put_ends(&k, second, PutEnd::Stored([a, c]));
        summary.put_ends(&k, first, PutEnd::Refused);
        assert_eq!(summary.copies(&k), Some([a, c]));
        summary.put_released(&k);
        assert!(summary.put_writing(&k), "one of the two is still writing");
        summary.put_released(&k);
        // A put that began after that store and is refused forgets the page again.
        let third = summary.put_begins(&k);
        summary.put_ends(&k, third, PutEnd::Refused);
        summary.put_released(&k);
        assert_eq!(summary.copies(&k), None);
        // Abandoned: nothing changes; and no bookkeeping is left behind.
        summary.insert_copies(&k, [a, b]);
        let ticket = summary.put_begins(&k);
        summary.put_ends(&k, ticket, PutEnd::Abandoned);
        summary.put_released(&k);
        assert_eq!(summary.copies(&k), Some([a, b]));
        assert!(summary.puts.is_empty());
        summary.validate();
    }

    #[test]
    fn copies_agree_with_a_map_and_survive_retirement() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let mut summary = Summary::default();
        let slots: Vec<Slot> = (0..4).map(|_| summary.allocate_slot().unwrap()).collect();
        let mut model: HashMap<PageKey, [Slot; 2]> = HashMap::new();
        let pair = |rng: &mut rand::rngs::StdRng| {
            let a = rng.gen_range(0..slots.len());
            let b = (a + rng.gen_range(1..slots.len())) % slots.len();
            [slots[a], slots[b]]
        };
        for step in 0..40_000 {
            let index = match rng.gen_range(0..20) {
                0 => u64::MAX - rng.gen_range(0..4),
                _ => rng.gen_range(0..3000),
            };
            let k = key(rng.gen_range(0..3), index);
            match rng.gen_range(0..10) {
                0..=4 => {
                    let holders = pair(&mut rng);
                    summary.insert_copies(&k, holders);
                    model.insert(k, holders);
                }
                5..=6 => assert_eq!(summary.remove_copies(&k), model.remove(&k), "step {step}"),
                // An ephemeral entry under the same key space never disturbs the copies.
                7 => {
                    summary.insert(&PageKey::new(PoolId(9), k.object, k.index), slots[0]);
                }
                _ => assert_eq!(summary.copies(&k), model.get(&k).copied(), "step {step}"),
            }
            if step % 5000 == 0 {
                summary.validate();
            }
        }
        summary.validate();
        assert_eq!(summary.stats().persistent, model.len() as u64);
        assert!(summary.at_risk(&[]).pages.is_empty());

        // A node dies: its copies read as 0, its pages are at risk, and nothing is dropped
        // when tables are rebuilt.
        let dead = slots[1];
        summary.retire(dead);
        let held = model.values().filter(|h| h.contains(&dead)).count();
        for i in 0..2000 {
            summary.insert_copies(&key(7, i), [slots[0], slots[2]]);
        }
        let risk = summary.at_risk(&[]);
        assert_eq!(risk.pages.len(), held);
        assert_eq!(risk.lost, 0);
        summary.validate();
        assert_eq!(summary.allocate_slot().map(|s| s == dead), Some(false), "slot reused");
        for (k, survivor) in &risk.pages {
            let want = model[k].map(|s| if s == dead { 0 } else { s });
            assert_eq!(summary.copies(k), Some(want));
            assert!(want.contains(survivor));
            // Repaired onto slot 4 (or 3 if the survivor is 4).
            let new = if *survivor == slots[3] { slots[2] } else { slots[3] };
            assert!(!summary.replace_lost(k, new, *survivor, &[]), "the wrong survivor");
            assert!(summary.replace_lost(k, *survivor, new, &[]));
            assert_eq!(summary.copies(k), Some([*survivor, new]));
        }
        assert!(summary.at_risk(&[]).pages.is_empty());
        assert_eq!(summary.pages_on(dead), 0);
        summary.validate();

        // Both holders gone: lost, not at risk.
        summary.insert_copies(&key(8, 0), [slots[0], slots[2]]);
        summary.retire(slots[0]);
        summary.retire(slots[2]);
        let risk = summary.at_risk(&[]);
        assert!(risk.lost >= 1);
        assert_eq!(summary.copies(&key(8, 0)), Some([0, 0]));
        assert_eq!(summary.forget_pool(PoolId(1)), model.len() as u64 + 2001);
        summary.validate();
    }

    /// Bytes per persistent page (two holders in one 8-byte cell), as
    /// [`summary_bytes_per_page`] measures them for ephemeral pages.
    #[test]
    fn summary_bytes_per_persistent_page() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(10);
        let mut summary = Summary::default();
        let slots: Vec<Slot> = (0..3).map(|_| summary.allocate_slot().unwrap()).collect();
        let (mut worst, mut sum, mut samples): (f64, f64, u32) = (0.0, 0.0, 0);
        let mut n = 0u64;
        while n < 1_000_000 {
            let index = rng.gen_range(0..1u64 << 24);
            if summary.copies(&key(0, index)).is_none() {
                let a = (index % 3) as usize;
                summary.insert_copies(&key(0, index), [slots[a], slots[(a + 1) % 3]]);
                n += 1;
            }
            if n.is_multiple_of(997) && n >= 10_000 {
                let stats = summary.stats();
                let per_page = stats.heap_bytes as f64 / stats.pages as f64;
                worst = worst.max(per_page);
                sum += per_page;
                samples += 1;
            }
        }
        let mean = sum / f64::from(samples);
        println!(
            "summary: 10k..1M persistent pages (two holders) in one object: mean {mean:.1}, \
             worst {worst:.1} B/page"
        );
        assert!(worst <= 16.0, "worst {worst:.1} B/page");
    }

    /// Bytes per page for one large object (an NBD export) at several sizes, and for the
    /// worst case of one page per object. `cargo test -p fallow-client --release
    /// summary_bytes_per_page -- --nocapture` prints the table quoted in BENCHMARKS.md.
    #[test]
    fn summary_bytes_per_page() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let mut summary = Summary::default();
        let slots: Vec<Slot> = (0..3).map(|_| summary.allocate_slot().unwrap()).collect();
        let mut worst: f64 = 0.0;
        let mut sum = 0.0;
        let mut samples = 0;
        let mut report = Vec::new();
        let mut n = 0u64;
        // Random pages of a 64 GiB device (16 Mi pages), as an NBD export would place them.
        while n < 1_000_000 {
            let index = rng.gen_range(0..1u64 << 24);
            if summary.get(&key(0, index)).is_none() {
                summary.insert(&key(0, index), slots[(index % 3) as usize]);
                n += 1;
            }
            if n.is_multiple_of(997) {
                let stats = summary.stats();
                let per_page = stats.heap_bytes as f64 / stats.pages as f64;
                if n >= 10_000 {
                    worst = worst.max(per_page);
                    sum += per_page;
                    samples += 1;
                }
                if [997, 9970, 99_700, 997_000].contains(&n) {
                    report.push((n, per_page));
                }
            }
        }
        for (n, per_page) in &report {
            println!("summary: {n} pages in one object: {per_page:.1} B/page");
        }
        let mean = sum / samples as f64;
        println!("summary: 10k..1M pages in one object: mean {mean:.1}, worst {worst:.1} B/page");
        assert!(worst <= 16.0, "worst {worst:.1} B/page");

        let mut small = Summary::default();
        let a = small.allocate_slot().unwrap();
        for object in 0..100_000 {
            small.insert(&key(object, 0), a);
        }
        let stats = small.stats();
        println!(
            "summary: 100k objects of one page each: {:.1} B/page",
            stats.heap_bytes as f64 / stats.pages as f64
        );
    }
}
