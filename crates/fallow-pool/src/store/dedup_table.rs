//! The dedup table: content ids found by their stored checksum, 4 bytes a slot.
//!
//! Content ids have up to 31 bits (frame numbers below 2³⁰, virtual ids above:
//! `by_id.rs`), too many for an [`IdTable<Folded>`], which keeps its control byte in the
//! top byte of each id's word and so holds ids of 24 bits. A table with separate control
//! bytes costs 5 bytes a slot, 1.07 B a page at the load of 15/16. So the ids are split
//! into *banks* of 2²⁴ consecutive ids, each bank a folded table of the ids' low 24 bits,
//! and a lookup probes every bank there is.
//!
//! How many there are: one for each 64 GiB of frame numbers the budget reaches (frame
//! numbers start at 0, so a budget up to 64 GiB has one), and one for each 2²⁴ virtual
//! ids a compressing engine has handed out. A lookup in an engine of usual size probes one
//! bank, or two once it compresses; its cost grows with the budget past 64 GiB, by one
//! two-group probe per bank.
//!
//! ```text
//!  id = bank << 24 | low      banks: [(bank 0, IdTable<Folded> of low ids), (bank 64, …)]
//! ```

use crate::id_table::{Folded, IdTable};

use super::ContentId;

/// log2 of the ids of one bank: what a folded table holds.
const BANK_BITS: u32 = 24;
const LOW: ContentId = (1 << BANK_BITS) - 1;

fn bank_of(id: ContentId) -> u32 {
    id >> BANK_BITS
}

/// One bank: the ids `number << 24 ..` of the table, by their low 24 bits.
struct Bank {
    number: u32,
    table: IdTable<Folded>,
}

impl Bank {
    fn base(&self) -> ContentId {
        self.number << BANK_BITS
    }
}

/// Content ids by hash, in banks of 2²⁴ ids.
#[derive(Default)]
pub(super) struct DedupTable {
    /// In the order they were made: the first frame numbers' bank comes first, so the
    /// common lookup ends in its first probe.
    banks: Vec<Bank>,
    /// Frames the budget holds ([`DedupTable::expect`]): each bank of frame numbers expects
    /// its share, so that it grows to exactly its size.
    frames: usize,
}

impl DedupTable {
    /// Ids in the table.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.banks.iter().map(|b| b.table.len()).sum()
    }

    /// How many ids of bank `number` a budget of `frames` frames may hold: its share of
    /// the frame numbers, or, for virtual ids, nothing known (its table doubles as it
    /// fills).
    fn expected(number: u32, frames: usize) -> usize {
        let base = (number as usize) << BANK_BITS;
        if number >= bank_of(super::VIRTUAL_BASE) {
            0
        } else {
            frames.saturating_sub(base).min(1 << BANK_BITS)
        }
    }

    /// Says how many frames the budget holds, so that the frame numbers' banks grow to
    /// their size and no further (`IdTable::expect`).
    pub(super) fn expect(&mut self, frames: usize) {
        self.frames = frames;
        for bank in &mut self.banks {
            bank.table.expect(Self::expected(bank.number, frames));
        }
    }

    /// Bank `number`, if it has been made.
    fn existing_mut(&mut self, number: u32) -> Option<&mut Bank> {
        self.banks.iter_mut().find(|b| b.number == number)
    }

    /// Bank `number`, made (empty, expecting its share) if it was not.
    fn bank_mut(&mut self, number: u32) -> &mut Bank {
        let at = match self.banks.iter().position(|b| b.number == number) {
            Some(at) => at,
            None => {
                let mut table = IdTable::default();
                table.expect(Self::expected(number, self.frames));
                self.banks.push(Bank { number, table });
                self.banks.len() - 1
            }
        };
        &mut self.banks[at]
    }

    /// The id with this hash that `eq` accepts.
    #[inline]
    pub(super) fn find(
        &self,
        hash: u64,
        mut eq: impl FnMut(ContentId) -> bool,
    ) -> Option<ContentId> {
        self.banks.iter().find_map(|bank| {
            let base = bank.base();
            bank.table.find(hash, |low| eq(base | low)).map(|low| base | low)
        })
    }

    /// Adds `id`, whose hash is `hash` and which is not in the table yet. `hasher` gives
    /// the hash of any id already in, so that ids can move within their bank.
    pub(super) fn insert_unique(
        &mut self,
        hash: u64,
        id: ContentId,
        hasher: impl Fn(ContentId) -> u64,
    ) {
        let bank = self.bank_mut(bank_of(id));
        let base = bank.base();
        bank.table.insert_unique(hash, id & LOW, |low| hasher(base | low));
    }

    /// Moves up to `groups` old groups of each bank's growth under way (`IdTable::tidy`);
    /// true while any bank still has some.
    pub(super) fn tidy(&mut self, groups: usize, hasher: impl Fn(ContentId) -> u64) -> bool {
        let mut left = false;
        for bank in &mut self.banks {
            let base = bank.base();
            left |= bank.table.tidy(groups, |low| hasher(base | low));
        }
        left
    }

    /// True while some bank's growth is under way.
    pub(super) fn growing(&self) -> bool {
        self.banks.iter().any(|bank| bank.table.growing())
    }

    /// Takes `id`, whose hash is `hash`, out of the table; false when it was not in.
    pub(super) fn remove(&mut self, hash: u64, id: ContentId) -> bool {
        self.existing_mut(bank_of(id))
            .is_some_and(|bank| bank.table.remove(hash, |low| low == id & LOW).is_some())
    }

    /// Puts `new` where `old` was, under the same hash; false (and nothing changes) when
    /// `old` was not in the table. `new`'s hash must already be what `hasher` gives.
    pub(super) fn replace(
        &mut self,
        hash: u64,
        old: ContentId,
        new: ContentId,
        hasher: impl Fn(ContentId) -> u64,
    ) -> bool {
        if bank_of(old) == bank_of(new) {
            return self
                .existing_mut(bank_of(old))
                .is_some_and(|bank| bank.table.replace(hash, |low| low == old & LOW, new & LOW));
        }
        if !self.remove(hash, old) {
            return false;
        }
        self.insert_unique(hash, new, hasher);
        true
    }

    /// Heap bytes of every bank.
    pub(super) fn heap_bytes(&self) -> usize {
        self.banks.capacity() * std::mem::size_of::<Bank>()
            + self.banks.iter().map(|b| b.table.heap_bytes()).sum::<usize>()
    }

    /// Every id in the table.
    pub(super) fn iter(&self) -> impl Iterator<Item = ContentId> + '_ {
        self.banks.iter().flat_map(|bank| {
            let base = bank.base();
            bank.table.iter().map(move |low| base | low)
        })
    }

    /// Panics unless every bank is a valid table of its ids and no bank is listed twice.
    pub(super) fn validate(&self, hasher: impl Fn(ContentId) -> u64) {
        for (i, bank) in self.banks.iter().enumerate() {
            assert!(
                bank.number <= bank_of(ContentId::MAX >> 1),
                "bank {} past 31-bit ids",
                bank.number
            );
            assert!(
                self.banks[..i].iter().all(|b| b.number != bank.number),
                "bank {} listed twice",
                bank.number
            );
            let base = bank.base();
            bank.table.validate(|low| hasher(base | low));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn hash_of(id: ContentId) -> u64 {
        fallow_core::content::dedup_key(id.wrapping_mul(0x9E37_79B9))
    }

    #[test]
    fn ids_of_every_bank_are_found_by_their_hash() {
        let mut t = DedupTable::default();
        t.expect(1000);
        let ids =
            [0, 1, LOW, LOW + 1, 5 << BANK_BITS | 7, super::super::VIRTUAL_BASE, (1 << 31) - 1];
        for &id in &ids {
            t.insert_unique(hash_of(id), id, hash_of);
        }
        t.validate(hash_of);
        assert_eq!(t.len(), ids.len());
        for &id in &ids {
            assert_eq!(t.find(hash_of(id), |x| x == id), Some(id), "id {id:#x}");
        }
        let mut all: Vec<_> = t.iter().collect();
        all.sort_unstable();
        assert_eq!(all, ids);
    }

    #[test]
    fn a_budget_within_64_gib_keeps_one_bank_of_frame_numbers() {
        let mut t = DedupTable::default();
        let frames = 1 << 20;
        t.expect(frames);
        for id in (0..frames as ContentId).step_by(97) {
            t.insert_unique(hash_of(id), id, hash_of);
        }
        assert_eq!(t.banks.len(), 1);
        // Four bytes a slot: a table of 5-byte slots at the same load would be 25 % larger.
        let slots = t.banks[0].table.heap_bytes() / 4;
        assert!(slots >= t.len(), "{slots} slots for {} ids", t.len());
    }

    #[test]
    fn the_frame_banks_expect_their_share_of_the_budget() {
        assert_eq!(DedupTable::expected(0, 1000), 1000);
        assert_eq!(DedupTable::expected(0, 3 << BANK_BITS), 1 << BANK_BITS);
        assert_eq!(DedupTable::expected(2, (2 << BANK_BITS) + 5), 5);
        assert_eq!(DedupTable::expected(3, 2 << BANK_BITS), 0);
        assert_eq!(DedupTable::expected(bank_of(super::super::VIRTUAL_BASE), usize::MAX), 0);
    }

    #[test]
    fn replacing_across_banks_moves_the_id() {
        let mut t = DedupTable::default();
        let (old, new) = (42, super::super::VIRTUAL_BASE + 3);
        // The renamed content keeps its checksum, hence its hash.
        let hash = hash_of(old);
        let hasher = |id| if id == new || id == old { hash } else { hash_of(id) };
        t.insert_unique(hash, old, hasher);
        assert!(t.replace(hash, old, new, hasher));
        assert_eq!(t.find(hash, |x| x == old), None);
        assert_eq!(t.find(hash, |_| true), Some(new));
        assert!(!t.replace(hash, old, 7, hasher), "old is no longer in");
        assert!(!t.replace(hash, 5 << BANK_BITS, (5 << BANK_BITS) + 1, hasher), "nor in bank 5");
        assert_eq!(t.banks.len(), 2, "a failed replace makes no bank");
        t.validate(hasher);
        assert_eq!(t.len(), 1);
    }

    proptest! {
        /// Against a `HashMap` of id → hash, over ids of several banks.
        #[test]
        fn agrees_with_a_map(
            ops in proptest::collection::vec((0u8..4, 0u32..64, 0u32..4), 1..400)
        ) {
            let mut t = DedupTable::default();
            t.expect(3 << BANK_BITS);
            let mut model: HashMap<ContentId, u64> = HashMap::new();
            let banks = [0, 1, 2, super::super::VIRTUAL_BASE >> BANK_BITS];
            let id_of = |n: u32, bank: u32| {
                (banks[bank as usize] << BANK_BITS) | (n * 1_000_003 % (1 << BANK_BITS))
            };
            for (op, n, bank) in ops {
                let id = id_of(n, bank);
                let found = t.find(hash_of(id), |x| x == id);
                match op {
                    0 | 1 => {
                        if let std::collections::hash_map::Entry::Vacant(e) = model.entry(id) {
                            e.insert(hash_of(id));
                            t.insert_unique(hash_of(id), id, hash_of);
                        }
                    }
                    2 => prop_assert_eq!(t.remove(hash_of(id), id), model.remove(&id).is_some()),
                    _ => prop_assert_eq!(found, model.get(&id).map(|_| id)),
                }
            }
            t.validate(hash_of);
            prop_assert_eq!(t.len(), model.len());
            for &id in model.keys() {
                prop_assert_eq!(t.find(hash_of(id), |x| x == id), Some(id));
            }
        }
    }
}
