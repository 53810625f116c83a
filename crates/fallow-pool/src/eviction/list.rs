//! Intrusive doubly-linked lists over per-slot arrays, shared by the list-based policies.
//!
//! A [`Links`] holds one `prev` and one `next` entry per slot id, side by side, so every
//! list that uses it costs 6 bytes per slot (two 24-bit ids: [`Narrow`]) or 8 ([`Wide`],
//! for ids past 2²⁴) and no allocation per node; a slot is on at most one [`List`] of a
//! given `Links` at a time. `NIL` ends a list and also marks an unlinked slot.
//!
//! ```text
//!  List { head ─┐                          ┌─ tail }     front = oldest, back = newest
//!               ▼                          ▼
//!             [ 7 ] ⇄ [ 2 ] ⇄ [ 9 ] ⇄ … ⇄ [ 4 ]          next[7] = 2, prev[2] = 7, …
//! ```

use super::SlotId;

/// End of a list; also the `prev`/`next` of a slot that is on no list.
pub(crate) const NIL: u32 = u32::MAX;

/// The largest id a [`Narrow`] link can hold: a shard's slot ids stay below it
/// (`shard::MAX_PAGES`).
pub(crate) const NARROW_MAX_ID: u32 = (1 << 24) - 2;

/// How one slot's `prev` and `next` are stored.
pub(crate) trait LinkPair: Copy + std::fmt::Debug {
    /// Both links `NIL`.
    const UNLINKED: Self;
    /// The largest id it can hold.
    const MAX_ID: u32;
    fn prev(&self) -> u32;
    fn next(&self) -> u32;
    fn set_prev(&mut self, id: u32);
    fn set_next(&mut self, id: u32);
}

/// Two 24-bit ids in 6 bytes: what a shard's slots use, 2 bytes a page less than two
/// `u32`s. `0xFF_FFFF` is `NIL`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Narrow([u8; 6]);

impl Narrow {
    fn get(&self, at: usize) -> u32 {
        let b = &self.0[at..at + 3];
        let id = u32::from_le_bytes([b[0], b[1], b[2], 0]);
        if id == 0xFF_FFFF {
            NIL
        } else {
            id
        }
    }

    fn set(&mut self, at: usize, id: u32) {
        debug_assert!(id == NIL || id <= NARROW_MAX_ID, "id {id} does not fit 24 bits");
        self.0[at..at + 3].copy_from_slice(&id.to_le_bytes()[..3]);
    }
}

impl LinkPair for Narrow {
    const UNLINKED: Self = Narrow([0xFF; 6]);
    const MAX_ID: u32 = NARROW_MAX_ID;

    fn prev(&self) -> u32 {
        self.get(0)
    }

    fn next(&self) -> u32 {
        self.get(3)
    }

    fn set_prev(&mut self, id: u32) {
        self.set(0, id);
    }

    fn set_next(&mut self, id: u32) {
        self.set(3, id);
    }
}

/// Two `u32` ids: for lists of more than 2²⁴ nodes (LIRS keeps up to three nodes a page).
/// Only the research policies use them.
#[derive(Debug, Clone, Copy)]
#[cfg_attr(not(feature = "research-policies"), allow(dead_code))]
pub(crate) struct Wide([u32; 2]);

impl LinkPair for Wide {
    const UNLINKED: Self = Wide([NIL; 2]);
    const MAX_ID: u32 = NIL - 1;

    fn prev(&self) -> u32 {
        self.0[0]
    }

    fn next(&self) -> u32 {
        self.0[1]
    }

    fn set_prev(&mut self, id: u32) {
        self.0[0] = id;
    }

    fn set_next(&mut self, id: u32) {
        self.0[1] = id;
    }
}

/// Per-slot `prev`/`next` links, grown to the largest slot id seen.
#[derive(Debug)]
pub(crate) struct Links<P: LinkPair = Narrow> {
    pairs: Vec<P>,
    /// Slot ids to expect when the cache is full ([`Links::expect`]).
    expected: usize,
}

impl<P: LinkPair> Default for Links<P> {
    fn default() -> Self {
        Self { pairs: Vec::new(), expected: 0 }
    }
}

impl<P: LinkPair> Links<P> {
    /// Says how many slot ids to expect when the cache is full, so that the array grows to
    /// exactly that ([`crate::dense::grow`]).
    pub(crate) fn expect(&mut self, ids: usize) {
        self.expected = ids;
    }

    /// The slot ids it expects ([`Links::expect`]).
    pub(crate) fn expected(&self) -> usize {
        self.expected
    }

    /// Grows the array so `id` has an entry. Amortized O(1): it doubles (up to the
    /// expected size).
    pub(crate) fn ensure(&mut self, id: SlotId) {
        assert!(id <= P::MAX_ID, "slot id {id} past the links' {}", P::MAX_ID);
        let need = id as usize + 1;
        if need > self.pairs.len() {
            crate::dense::grow(&mut self.pairs, need, self.expected);
            self.pairs.resize(need, P::UNLINKED);
        }
    }

    /// How many slots have an entry.
    pub(crate) fn slots(&self) -> usize {
        self.pairs.len()
    }

    /// Heap bytes of the array.
    pub(crate) fn heap_bytes(&self) -> usize {
        crate::dense::resident_bytes(&self.pairs)
    }

    fn prev(&self, id: u32) -> u32 {
        self.pairs[id as usize].prev()
    }

    fn next(&self, id: u32) -> u32 {
        self.pairs[id as usize].next()
    }

    fn set_prev(&mut self, id: u32, to: u32) {
        self.pairs[id as usize].set_prev(to);
    }

    fn set_next(&mut self, id: u32, to: u32) {
        self.pairs[id as usize].set_next(to);
    }
}

/// One list threaded through a [`Links`]: its ends and its length.
#[derive(Debug, Clone, Copy)]
pub(crate) struct List {
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for List {
    fn default() -> Self {
        Self { head: NIL, tail: NIL, len: 0 }
    }
}

impl List {
    /// Number of slots on the list.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// True when the list is empty.
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The oldest slot (the next to leave a FIFO or LRU list).
    pub(crate) fn front(&self) -> Option<SlotId> {
        (self.head != NIL).then_some(self.head)
    }

    /// Appends `id` at the back. The caller guarantees `id` is on no list of `links` and
    /// that `links.ensure(id)` was called.
    pub(crate) fn push_back<P: LinkPair>(&mut self, links: &mut Links<P>, id: SlotId) {
        debug_assert!(links.prev(id) == NIL && links.next(id) == NIL);
        debug_assert!(self.head != id, "slot {id} is already the head");
        links.set_prev(id, self.tail);
        links.set_next(id, NIL);
        if self.tail == NIL {
            self.head = id;
        } else {
            links.set_next(self.tail, id);
        }
        self.tail = id;
        self.len += 1;
    }

    /// Unlinks `id`. The caller guarantees `id` is on this list.
    pub(crate) fn unlink<P: LinkPair>(&mut self, links: &mut Links<P>, id: SlotId) {
        let (p, n) = (links.prev(id), links.next(id));
        if p == NIL {
            debug_assert_eq!(self.head, id, "slot {id} is not on this list");
            self.head = n;
        } else {
            links.set_next(p, n);
        }
        if n == NIL {
            debug_assert_eq!(self.tail, id, "slot {id} is not on this list");
            self.tail = p;
        } else {
            links.set_prev(n, p);
        }
        links.pairs[id as usize] = P::UNLINKED;
        self.len -= 1;
    }

    /// Removes and returns the front slot.
    pub(crate) fn pop_front<P: LinkPair>(&mut self, links: &mut Links<P>) -> Option<SlotId> {
        let id = self.front()?;
        self.unlink(links, id);
        Some(id)
    }

    /// Moves `id`, which is on this list, to the back.
    pub(crate) fn move_to_back<P: LinkPair>(&mut self, links: &mut Links<P>, id: SlotId) {
        if self.tail != id {
            self.unlink(links, id);
            self.push_back(links, id);
        }
    }

    /// True when `id` is linked on some list of `links` or is this list's only member.
    /// O(1); used to catch contract violations in debug builds.
    pub(crate) fn is_linked<P: LinkPair>(&self, links: &Links<P>, id: SlotId) -> bool {
        (id as usize) < links.slots()
            && (links.prev(id) != NIL || links.next(id) != NIL || self.head == id)
    }

    /// Walks the list front to back, checking every link both ways and the length, and
    /// calls `each` on every slot. Panics on a broken list. O(len).
    pub(crate) fn validate<P: LinkPair>(&self, links: &Links<P>, mut each: impl FnMut(SlotId)) {
        let mut prev = NIL;
        let mut cur = self.head;
        let mut n = 0usize;
        while cur != NIL {
            assert!((cur as usize) < links.slots(), "slot {cur} has no link entry");
            assert_eq!(links.prev(cur), prev, "prev link of slot {cur} is broken");
            assert!(n < self.len, "list is longer than its length {} (a cycle?)", self.len);
            each(cur);
            prev = cur;
            cur = links.next(cur);
            n += 1;
        }
        assert_eq!(prev, self.tail, "tail does not end the list");
        assert_eq!(n, self.len, "list length drifted");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_narrow_pair_holds_every_24_bit_id_and_nil() {
        let mut pair = Narrow::UNLINKED;
        assert_eq!((pair.prev(), pair.next()), (NIL, NIL));
        for (p, n) in [(0, NARROW_MAX_ID), (NARROW_MAX_ID, 0), (0x12_3456, NIL), (NIL, 1)] {
            pair.set_prev(p);
            pair.set_next(n);
            assert_eq!((pair.prev(), pair.next()), (p, n));
        }
        assert_eq!(std::mem::size_of::<Narrow>(), 6);
    }

    /// The same operations on both widths.
    fn lists_keep_their_order<P: LinkPair>() {
        const TOP: u32 = 1000;
        let mut links = Links::<P>::default();
        let ids = [TOP, 0, TOP - 1, 5];
        ids.iter().for_each(|&id| links.ensure(id));
        let mut list = List::default();
        ids.iter().for_each(|&id| list.push_back(&mut links, id));
        list.move_to_back(&mut links, 0);
        list.unlink(&mut links, TOP - 1);
        let mut order = Vec::new();
        list.validate(&links, |id| order.push(id));
        assert_eq!(order, [TOP, 5, 0]);
        assert!(!list.is_linked(&links, TOP - 1));
        assert_eq!(list.pop_front(&mut links), Some(TOP));
        assert_eq!(list.len(), 2);
    }

    #[test]
    fn lists_keep_their_order_over_narrow_and_wide_links() {
        lists_keep_their_order::<Narrow>();
        lists_keep_their_order::<Wide>();
    }

    #[test]
    #[should_panic(expected = "past the links")]
    fn a_narrow_link_refuses_an_id_past_24_bits() {
        Links::<Narrow>::default().ensure(NARROW_MAX_ID + 1);
    }
}
