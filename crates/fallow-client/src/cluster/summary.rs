//! The summary: for every page this client put into a private ephemeral pool and has not
//! seen leave, the node it is on. A get of a page not in the summary is a miss answered
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

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

use fallow_core::{ObjectId, PageKey, PoolId};

/// A node's number in the summary and the cluster client: 1..=[`MAX_SLOT`].
pub(crate) type Slot = u16;

const SLOT_BITS: u32 = 12;
const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
/// The largest slot: 4095 node incarnations known at once.
pub(crate) const MAX_SLOT: Slot = SLOT_MASK as Slot;
/// The largest index that fits in a cell.
const MAX_CELL_INDEX: u64 = u64::MAX >> SLOT_BITS;
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

/// One object's pages. Invariant: `len` counts the non-empty cells, at least one cell is
/// empty whenever any exist, and each entry sits at or after its home cell with no empty
/// cell between them (cyclically).
#[derive(Default)]
struct Pages {
    cells: Box<[u64]>,
    len: usize,
    /// Entries whose index is too large for a cell. Boxed: an empty map would cost every
    /// object 48 bytes, the box costs 8.
    #[expect(clippy::box_collection, reason = "keeps the common, empty case small")]
    spill: Option<Box<HashMap<u64, Slot>>>,
}

impl Pages {
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
                cell if cell >> SLOT_BITS == index => return Ok(i),
                _ => i = if i + 1 == n { 0 } else { i + 1 },
            }
        }
    }

    fn get(&self, index: u64) -> Option<Slot> {
        if index > MAX_CELL_INDEX {
            return self.spill.as_ref()?.get(&index).copied();
        }
        if self.cells.is_empty() {
            return None;
        }
        self.find(index).ok().map(|i| (self.cells[i] & SLOT_MASK) as Slot)
    }

    /// Sets the entry; returns the slot it named before.
    fn insert(&mut self, index: u64, slot: Slot, slots: &mut Slots) -> Option<Slot> {
        debug_assert!((1..=MAX_SLOT).contains(&slot));
        if index > MAX_CELL_INDEX {
            return self.spill.get_or_insert_with(Default::default).insert(index, slot);
        }
        if (self.len + 1) * 5 > self.cells.len() * 4 {
            self.rebuild(self.len + 1, slots);
        }
        let cell = index << SLOT_BITS | u64::from(slot);
        match self.find(index) {
            Ok(i) => Some((std::mem::replace(&mut self.cells[i], cell) & SLOT_MASK) as Slot),
            Err(i) => {
                self.cells[i] = cell;
                self.len += 1;
                None
            }
        }
    }

    /// Removes the entry; returns the slot it named.
    fn remove(&mut self, index: u64, slots: &mut Slots) -> Option<Slot> {
        if index > MAX_CELL_INDEX {
            return self.spill.as_mut()?.remove(&index);
        }
        if self.cells.is_empty() {
            return None;
        }
        let i = self.find(index).ok()?;
        let slot = (self.cells[i] & SLOT_MASK) as Slot;
        self.delete_at(i);
        if self.cells.len() > 16 && self.len * 5 < self.cells.len() {
            self.rebuild(self.len, slots);
        }
        Some(slot)
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
            let home = Self::home(cell >> SLOT_BITS, n);
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
    /// slots (and counting them out).
    fn rebuild(&mut self, room: usize, slots: &mut Slots) {
        let n = (room * 15 / 8).max(MIN_CELLS);
        let old = std::mem::replace(&mut self.cells, vec![0; n].into_boxed_slice());
        self.len = 0;
        for cell in old.iter().copied().filter(|&c| c != 0) {
            let slot = (cell & SLOT_MASK) as Slot;
            if slots.is_retired(slot) {
                slots.counts[slot as usize] -= 1;
                continue;
            }
            match self.find(cell >> SLOT_BITS) {
                Err(i) => {
                    self.cells[i] = cell;
                    self.len += 1;
                }
                Ok(_) => debug_assert!(false, "index {} twice in one table", cell >> SLOT_BITS),
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.len == 0 && self.spill.as_ref().is_none_or(|s| s.is_empty())
    }

    /// Every entry's slot.
    fn slots(&self) -> impl Iterator<Item = Slot> + '_ {
        let cells = self.cells.iter().filter(|&&c| c != 0).map(|c| (c & SLOT_MASK) as Slot);
        cells.chain(self.spill.iter().flat_map(|s| s.values().copied()))
    }

    fn heap_bytes(&self) -> usize {
        let spill = self.spill.as_ref().map_or(0, |s| 48 + s.capacity() * 17);
        self.cells.len() * 8 + spill
    }
}

/// A fast hasher for `(pool, object)`: the keys are the caller's own, not a peer's.
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

type ObjectMap = HashMap<(PoolId, ObjectId), Pages, BuildHasherDefault<ObjectHasher>>;

/// Where each page this client put is (see the module doc). Not thread-safe: the cluster
/// client keeps it under one mutex, held for one batch's lookups or updates.
#[derive(Default)]
pub(crate) struct Summary {
    objects: ObjectMap,
    slots: Slots,
}

/// How big the summary is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SummaryStats {
    /// Pages recorded (including entries of dead nodes not yet dropped).
    pub pages: u64,
    /// Objects with at least one page.
    pub objects: usize,
    /// Heap bytes held: tables, cells and the slot book.
    pub heap_bytes: usize,
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
        let slot = pages.get(key.index)?;
        if self.slots.is_retired(slot) {
            self.remove(key);
            return None;
        }
        Some(slot)
    }

    /// Records that `key`'s latest put is on `slot`; returns where it was before.
    pub(crate) fn insert(&mut self, key: &PageKey, slot: Slot) -> Option<Slot> {
        let pages = self.objects.entry((key.pool, key.object)).or_default();
        let old = pages.insert(key.index, slot, &mut self.slots);
        self.slots.counts[slot as usize] += 1;
        let old = old?;
        self.slots.counts[old as usize] -= 1;
        (!self.slots.is_retired(old)).then_some(old)
    }

    /// Forgets `key`; returns where it was (`None` if nowhere, or on a retired node).
    pub(crate) fn remove(&mut self, key: &PageKey) -> Option<Slot> {
        let object = (key.pool, key.object);
        let pages = self.objects.get_mut(&object)?;
        let slot = pages.remove(key.index, &mut self.slots)?;
        if pages.is_empty() {
            self.objects.remove(&object);
        }
        self.slots.counts[slot as usize] -= 1;
        (!self.slots.is_retired(slot)).then_some(slot)
    }

    /// Forgets `key` if it is recorded on `slot` (a miss there shows it left).
    pub(crate) fn remove_if(&mut self, key: &PageKey, slot: Slot) {
        let on = self.objects.get(&(key.pool, key.object)).and_then(|p| p.get(key.index));
        if on == Some(slot) {
            self.remove(key);
        }
    }

    /// Forgets every page of one object.
    pub(crate) fn forget_object(&mut self, pool: PoolId, object: ObjectId) {
        if let Some(pages) = self.objects.remove(&(pool, object)) {
            self.count_out(&pages);
        }
    }

    /// Forgets every page of one pool.
    pub(crate) fn forget_pool(&mut self, pool: PoolId) {
        let objects: Vec<_> = self.objects.keys().filter(|(p, _)| *p == pool).copied().collect();
        for (pool, object) in objects {
            self.forget_object(pool, object);
        }
    }

    fn count_out(&mut self, pages: &Pages) {
        for slot in pages.slots() {
            self.slots.counts[slot as usize] -= 1;
        }
    }

    /// Drops every entry of a retired slot (a full pass; needed only when slots run out).
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
        let cap = self.objects.capacity();
        let buckets = if cap == 0 {
            0
        } else if cap < 8 {
            cap + 1
        } else {
            (cap * 8 / 7).next_power_of_two()
        };
        let entry = std::mem::size_of::<((PoolId, ObjectId), Pages)>() + 1;
        let outer = if buckets == 0 { 0 } else { buckets * entry + 16 };
        let inner: usize = self.objects.values().map(Pages::heap_bytes).sum();
        let book = self.slots.counts.capacity() * 8 + self.slots.active.capacity() * 2;
        SummaryStats {
            pages: self.slots.counts.iter().sum(),
            objects: self.objects.len(),
            heap_bytes: outer + inner + book,
        }
    }

    /// Checks every invariant (tests).
    #[cfg(test)]
    pub(crate) fn validate(&self) {
        let mut counts = vec![0u64; self.slots.counts.len()];
        let mut pages = 0;
        for pages_of in self.objects.values() {
            assert!(!pages_of.is_empty(), "an empty object is kept");
            let n = pages_of.cells.len();
            let live = pages_of.cells.iter().filter(|&&c| c != 0).count();
            assert_eq!(live, pages_of.len);
            assert!(live < n || n == 0, "no empty cell");
            for (i, &cell) in pages_of.cells.iter().enumerate().filter(|(_, c)| **c != 0) {
                let index = cell >> SLOT_BITS;
                assert_eq!(pages_of.find(index), Ok(i), "index {index} unreachable");
            }
            for slot in pages_of.slots() {
                counts[slot as usize] += 1;
                pages += 1;
            }
        }
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
