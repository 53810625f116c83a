//! Intrusive doubly-linked lists over per-slot arrays, shared by the list-based policies.
//!
//! A [`Links`] holds one `prev` and one `next` entry per slot id, so every list that uses it
//! costs 8 bytes per slot and no allocation per node; a slot is on at most one [`List`] of a
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

/// Per-slot `prev`/`next` links, grown to the largest slot id seen.
#[derive(Debug, Default)]
pub(crate) struct Links {
    prev: Vec<u32>,
    next: Vec<u32>,
    /// Slot ids to expect when the cache is full ([`Links::expect`]).
    expected: usize,
}

impl Links {
    /// Says how many slot ids to expect when the cache is full, so that the arrays grow to
    /// exactly that ([`crate::dense::grow`]).
    pub(crate) fn expect(&mut self, ids: usize) {
        self.expected = ids;
    }

    /// The slot ids it expects ([`Links::expect`]).
    pub(crate) fn expected(&self) -> usize {
        self.expected
    }

    /// Grows the arrays so `id` has an entry. Amortized O(1): they double (up to the
    /// expected size).
    pub(crate) fn ensure(&mut self, id: SlotId) {
        let need = id as usize + 1;
        if need > self.prev.len() {
            crate::dense::grow(&mut self.prev, need, self.expected);
            crate::dense::grow(&mut self.next, need, self.expected);
            self.prev.resize(need, NIL);
            self.next.resize(need, NIL);
        }
    }

    /// How many slots have an entry.
    pub(crate) fn slots(&self) -> usize {
        self.prev.len()
    }

    /// Heap bytes of both arrays.
    pub(crate) fn heap_bytes(&self) -> usize {
        crate::dense::resident_bytes(&self.prev) + crate::dense::resident_bytes(&self.next)
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
    pub(crate) fn push_back(&mut self, links: &mut Links, id: SlotId) {
        debug_assert!(links.prev[id as usize] == NIL && links.next[id as usize] == NIL);
        debug_assert!(self.head != id, "slot {id} is already the head");
        links.prev[id as usize] = self.tail;
        links.next[id as usize] = NIL;
        if self.tail == NIL {
            self.head = id;
        } else {
            links.next[self.tail as usize] = id;
        }
        self.tail = id;
        self.len += 1;
    }

    /// Unlinks `id`. The caller guarantees `id` is on this list.
    pub(crate) fn unlink(&mut self, links: &mut Links, id: SlotId) {
        let (p, n) = (links.prev[id as usize], links.next[id as usize]);
        if p == NIL {
            debug_assert_eq!(self.head, id, "slot {id} is not on this list");
            self.head = n;
        } else {
            links.next[p as usize] = n;
        }
        if n == NIL {
            debug_assert_eq!(self.tail, id, "slot {id} is not on this list");
            self.tail = p;
        } else {
            links.prev[n as usize] = p;
        }
        links.prev[id as usize] = NIL;
        links.next[id as usize] = NIL;
        self.len -= 1;
    }

    /// Removes and returns the front slot.
    pub(crate) fn pop_front(&mut self, links: &mut Links) -> Option<SlotId> {
        let id = self.front()?;
        self.unlink(links, id);
        Some(id)
    }

    /// Moves `id`, which is on this list, to the back.
    pub(crate) fn move_to_back(&mut self, links: &mut Links, id: SlotId) {
        if self.tail != id {
            self.unlink(links, id);
            self.push_back(links, id);
        }
    }

    /// True when `id` is linked on some list of `links` or is this list's only member.
    /// O(1); used to catch contract violations in debug builds.
    pub(crate) fn is_linked(&self, links: &Links, id: SlotId) -> bool {
        let i = id as usize;
        i < links.prev.len() && (links.prev[i] != NIL || links.next[i] != NIL || self.head == id)
    }

    /// Walks the list front to back, checking every link both ways and the length, and
    /// calls `each` on every slot. Panics on a broken list. O(len).
    pub(crate) fn validate(&self, links: &Links, mut each: impl FnMut(SlotId)) {
        let mut prev = NIL;
        let mut cur = self.head;
        let mut n = 0usize;
        while cur != NIL {
            assert!((cur as usize) < links.prev.len(), "slot {cur} has no link entry");
            assert_eq!(links.prev[cur as usize], prev, "prev link of slot {cur} is broken");
            assert!(n < self.len, "list is longer than its length {} (a cycle?)", self.len);
            each(cur);
            prev = cur;
            cur = links.next[cur as usize];
            n += 1;
        }
        assert_eq!(prev, self.tail, "tail does not end the list");
        assert_eq!(n, self.len, "list length drifted");
    }
}
