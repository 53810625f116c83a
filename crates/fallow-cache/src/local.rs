//! The local tier: clean pages kept in this process, in front of the pool. A CLOCK of
//! fixed capacity (one reference bit per page): cheap, scan-tolerant enough for a first
//! tier, and it reports the page it evicts so that exclusive mode can hand it to the pool.

#![expect(
    clippy::indexing_slicing,
    reason = "slot numbers and the hand stay below the tier's fixed capacity"
)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use bytes::Bytes;
use parking_lot::Mutex;

/// A page's own copy, for a page kept past the request that brought it (the local tier,
/// the dirty set). Pages arrive as `Bytes` slices of receive buffers (a pool reply frame
/// cut from its connection's 1 MiB read buffer, an NBD write's payload), and one slice
/// keeps its whole buffer allocated: with slices kept, `fallow nbd` in the soak held about
/// 310 MiB for a 64 MiB local tier, with copies about 150 MiB (docs/reliability.md,
/// "Soak"); the copy's CPU cost did not show.
pub(crate) fn own(data: &[u8]) -> Bytes {
    Bytes::copy_from_slice(data)
}

#[derive(Debug)]
struct Slot {
    page: u64,
    data: Bytes,
    referenced: bool,
}

#[derive(Debug, Default)]
struct Clock {
    index: HashMap<u64, usize>,
    slots: Vec<Slot>,
    hand: usize,
}

impl Clock {
    /// The slot to evict (there is at least one): clears reference bits until an
    /// unreferenced page comes under the hand, which then moves past it.
    fn victim(&mut self) -> usize {
        loop {
            let hand = self.hand;
            self.hand = (hand + 1) % self.slots.len();
            if !std::mem::take(&mut self.slots[hand].referenced) {
                return hand;
            }
        }
    }
}

/// Up to `capacity` pages. Capacity 0 holds nothing.
#[derive(Debug)]
pub struct LocalTier {
    /// Changes on a reload ([`LocalTier::set_capacity`]); read under the clock's lock by
    /// inserts, so a shrink and an insert never both think there is room.
    capacity: AtomicUsize,
    /// The clock. A `parking_lot` mutex: held for a map operation and a 4 KiB `Bytes`
    /// clone (a reference count), never across `.await`.
    clock: Mutex<Clock>,
}

impl LocalTier {
    /// A tier of `capacity` pages.
    pub fn new(capacity: usize) -> Self {
        Self { capacity: AtomicUsize::new(capacity), clock: Mutex::new(Clock::default()) }
    }

    /// The capacity in pages.
    pub fn capacity(&self) -> usize {
        self.capacity.load(Relaxed)
    }

    /// Sets the capacity; when it shrinks below what the tier holds, evicts (unreferenced
    /// pages first, as inserts do) and returns the pages evicted.
    pub fn set_capacity(&self, capacity: usize) -> Vec<(u64, Bytes)> {
        let mut clock = self.clock.lock();
        self.capacity.store(capacity, Relaxed);
        let mut evicted = Vec::new();
        while clock.slots.len() > capacity {
            let victim = clock.victim();
            let old = clock.slots.swap_remove(victim);
            clock.index.remove(&old.page);
            if let Some(moved) = clock.slots.get(victim).map(|s| s.page) {
                clock.index.insert(moved, victim);
            }
            if clock.hand >= clock.slots.len() {
                clock.hand = 0;
            }
            evicted.push((old.page, old.data));
        }
        evicted
    }

    /// Pages held.
    pub fn len(&self) -> usize {
        self.clock.lock().slots.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The page, if held (and marks it referenced).
    pub fn get(&self, page: u64) -> Option<Bytes> {
        let mut clock = self.clock.lock();
        let slot = *clock.index.get(&page)?;
        let s = &mut clock.slots[slot];
        s.referenced = true;
        Some(s.data.clone())
    }

    /// Inserts or replaces a page (a copy of it: [`own`]); returns the page evicted to
    /// make room, if any.
    pub fn insert(&self, page: u64, data: Bytes) -> Option<(u64, Bytes)> {
        let data = own(&data);
        let mut clock = self.clock.lock();
        let capacity = self.capacity.load(Relaxed);
        if capacity == 0 {
            return Some((page, data));
        }
        if let Some(&slot) = clock.index.get(&page) {
            clock.slots[slot] = Slot { page, data, referenced: true };
            return None;
        }
        if clock.slots.len() < capacity {
            let slot = clock.slots.len();
            clock.slots.push(Slot { page, data, referenced: false });
            clock.index.insert(page, slot);
            return None;
        }
        let hand = clock.victim();
        let old = std::mem::replace(&mut clock.slots[hand], Slot { page, data, referenced: false });
        clock.index.remove(&old.page);
        clock.index.insert(page, hand);
        Some((old.page, old.data))
    }

    /// Removes and returns every page.
    pub fn drain(&self) -> Vec<(u64, Bytes)> {
        let mut clock = self.clock.lock();
        clock.index.clear();
        clock.hand = 0;
        std::mem::take(&mut clock.slots).into_iter().map(|s| (s.page, s.data)).collect()
    }

    /// Removes a page (invalidation, or a take in exclusive mode); returns it.
    pub fn remove(&self, page: u64) -> Option<Bytes> {
        let mut clock = self.clock.lock();
        let slot = clock.index.remove(&page)?;
        let last = clock.slots.len() - 1;
        let removed = clock.slots.swap_remove(slot);
        if slot != last {
            let moved = clock.slots[slot].page;
            clock.index.insert(moved, slot);
        }
        if clock.hand >= clock.slots.len() {
            clock.hand = 0;
        }
        Some(removed.data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(x: u8) -> Bytes {
        Bytes::from(vec![x; 8])
    }

    #[test]
    fn shrinking_evicts_down_to_the_new_capacity_and_growing_makes_room() {
        let tier = LocalTier::new(4);
        for p in 0..4 {
            tier.insert(p, b(p as u8));
        }
        assert!(tier.get(2).is_some()); // referenced: kept over the others
        let evicted = tier.set_capacity(1);
        assert_eq!(evicted.len(), 3);
        assert_eq!(tier.len(), 1);
        assert!(tier.get(2).is_some(), "the referenced page stays");
        for (page, data) in &evicted {
            assert_eq!(data, &b(*page as u8));
            assert!(tier.get(*page).is_none());
        }
        tier.set_capacity(3);
        assert_eq!(tier.insert(7, b(7)), None);
        assert_eq!(tier.insert(8, b(8)), None);
        assert_eq!(tier.len(), 3);
        assert!(tier.insert(9, b(9)).is_some(), "full again at 3");
    }

    #[test]
    fn holds_capacity_and_evicts_unreferenced_first() {
        let tier = LocalTier::new(3);
        for p in 0..3 {
            assert_eq!(tier.insert(p, b(p as u8)), None);
        }
        assert!(tier.get(0).is_some()); // referenced: survives one sweep
        let (evicted, _) = tier.insert(3, b(3)).unwrap();
        assert_eq!(evicted, 1);
        assert_eq!(tier.len(), 3);
        assert!(tier.get(1).is_none());
        assert_eq!(tier.get(3).unwrap(), b(3));
    }

    #[test]
    fn remove_and_replace_keep_the_index_right() {
        let tier = LocalTier::new(4);
        for p in 0..4 {
            let _ = tier.insert(p, b(p as u8));
        }
        assert_eq!(tier.remove(1).unwrap(), b(1));
        assert_eq!(tier.remove(1), None);
        assert_eq!(tier.get(3).unwrap(), b(3), "the moved slot is still found");
        assert_eq!(tier.insert(0, b(9)), None, "a replace, not an insert");
        assert_eq!(tier.get(0).unwrap(), b(9));
        assert_eq!(tier.len(), 3);
    }

    #[test]
    fn capacity_zero_passes_everything_through() {
        let tier = LocalTier::new(0);
        assert_eq!(tier.insert(5, b(5)), Some((5, b(5))));
        assert!(tier.get(5).is_none());
    }
}
