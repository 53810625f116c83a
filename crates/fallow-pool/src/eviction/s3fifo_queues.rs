//! The two queues of S3-FIFO, shared by `s3fifo` and `s3fifo-lean`: a small probationary
//! queue and a main queue, threaded through per-slot links, with one state byte per slot
//! (the queue in bits 0–1, a 2-bit frequency in bits 2–3). The policies differ in what
//! they put around it: where an insertion goes (ghost, room), whether a hit in small
//! moves the page (`s3fifo-lean`'s small queue is LRU), whether small may promote at all
//! (not when it is the whole cache), and what a page leaving small leaves behind (a
//! ghost entry).

use super::list::{Links, List};
use super::SlotId;

/// Frequencies saturate here (2 bits).
pub(super) const MAX_FREQ: u8 = 3;
/// Hits a page needs while in the small queue to move to main. libCacheSim's current
/// S3-FIFO uses 2 (the paper's first version used 1); with 2, our miss ratios match its
/// reference column on the ARC traces, and on the shared traces as a whole it is better.
pub(super) const MOVE_TO_MAIN: u8 = 2;

/// Which queue a slot is on, in the low two bits of its state byte.
pub(super) const Q_NONE: u8 = 0;
pub(super) const Q_SMALL: u8 = 1;
pub(super) const Q_MAIN: u8 = 2;
const Q_MASK: u8 = 0b11;
/// The 2-bit frequency sits above the queue bits.
const FREQ_SHIFT: u32 = 2;

/// The small and main queues and the per-slot state they need: 9 bytes per slot.
#[derive(Debug, Default)]
pub(super) struct Queues {
    links: Links,
    /// Per slot: queue (bits 0–1) and frequency (bits 2–3).
    state: Vec<u8>,
    small: List,
    main: List,
}

impl Queues {
    /// Says how many slot ids to expect when the cache (`pages` pages) is full, so that
    /// the per-slot arrays grow to exactly that.
    pub(super) fn expect(&mut self, pages: usize) {
        self.links.expect(crate::dense::with_headroom(pages));
    }

    /// The queue slot `id` is on (`Q_NONE` for an untracked slot).
    pub(super) fn queue(&self, id: SlotId) -> u8 {
        self.state.get(id as usize).map_or(Q_NONE, |s| s & Q_MASK)
    }

    fn freq(&self, id: SlotId) -> u8 {
        self.state[id as usize] >> FREQ_SHIFT
    }

    fn set(&mut self, id: SlotId, queue: u8, freq: u8) {
        self.state[id as usize] = queue | (freq << FREQ_SHIFT);
    }

    /// Pages on the small queue.
    pub(super) fn small_len(&self) -> usize {
        self.small.len()
    }

    /// Pages on both queues.
    pub(super) fn len(&self) -> usize {
        self.small.len() + self.main.len()
    }

    /// Puts untracked slot `id` at the back of `queue` (`Q_SMALL` or `Q_MAIN`), with no
    /// hits.
    pub(super) fn insert(&mut self, id: SlotId, queue: u8) {
        self.links.ensure(id);
        if self.state.len() <= id as usize {
            let expected = self.links.expected();
            crate::dense::grow(&mut self.state, id as usize + 1, expected);
            self.state.resize(id as usize + 1, Q_NONE);
        }
        debug_assert_eq!(self.queue(id), Q_NONE, "slot {id} is already tracked");
        let list = if queue == Q_MAIN { &mut self.main } else { &mut self.small };
        list.push_back(&mut self.links, id);
        self.set(id, queue, 0);
    }

    /// Records a hit: one more frequency, and with `small_is_lru` a page in small moves to
    /// its back.
    pub(super) fn touch(&mut self, id: SlotId, small_is_lru: bool) {
        let queue = self.queue(id);
        debug_assert_ne!(queue, Q_NONE, "slot {id} is not tracked");
        let freq = (self.freq(id) + 1).min(MAX_FREQ);
        self.set(id, queue, freq);
        if small_is_lru && queue == Q_SMALL {
            self.small.move_to_back(&mut self.links, id);
        }
    }

    /// Takes slot `id` off its queue.
    pub(super) fn remove(&mut self, id: SlotId) {
        match self.queue(id) {
            Q_SMALL => self.small.unlink(&mut self.links, id),
            Q_MAIN => self.main.unlink(&mut self.links, id),
            q => debug_assert!(false, "slot {id} is not tracked (queue {q})"),
        }
        self.set(id, Q_NONE, 0);
    }

    /// Chooses a victim and takes it off its queue: from small while it holds at least
    /// `small_target` pages (or main is empty), else from main. Each pass evicts, or
    /// moves a page that spends a hit (promotion from small, when `may_promote`, clears
    /// the frequency; re-insertion into main lowers it), so this is amortized O(1).
    /// Returns the victim and whether it left from small.
    pub(super) fn pop_victim(
        &mut self,
        small_target: usize,
        may_promote: bool,
    ) -> Option<(SlotId, bool)> {
        loop {
            if self.small.len() >= small_target || self.main.is_empty() {
                let id = self.small.pop_front(&mut self.links)?;
                if may_promote && self.freq(id) >= MOVE_TO_MAIN {
                    self.main.push_back(&mut self.links, id);
                    self.set(id, Q_MAIN, 0);
                } else {
                    self.set(id, Q_NONE, 0);
                    return Some((id, true));
                }
            } else {
                let id = self.main.pop_front(&mut self.links)?;
                let freq = self.freq(id);
                if freq > 0 {
                    self.main.push_back(&mut self.links, id);
                    self.set(id, Q_MAIN, freq - 1);
                } else {
                    self.set(id, Q_NONE, 0);
                    return Some((id, false));
                }
            }
        }
    }

    /// Heap bytes of the links and state bytes.
    pub(super) fn heap_bytes(&self) -> usize {
        self.links.heap_bytes() + crate::dense::resident_bytes(&self.state)
    }

    /// Heap bytes of the links alone (what an index entry would hold).
    #[cfg(test)]
    pub(super) fn links_heap_bytes(&self) -> usize {
        self.links.heap_bytes()
    }

    /// Panics unless the lists and the state bytes agree.
    pub(super) fn validate(&self) {
        for (list, queue) in [(&self.small, Q_SMALL), (&self.main, Q_MAIN)] {
            list.validate(&self.links, |id| {
                assert_eq!(self.queue(id), queue, "slot {id} is on the wrong queue");
                assert!(self.freq(id) <= MAX_FREQ);
            });
        }
        let tracked = self.state.iter().filter(|s| *s & Q_MASK != Q_NONE).count();
        assert_eq!(tracked, self.len(), "state bytes disagree with the queues");
    }
}
