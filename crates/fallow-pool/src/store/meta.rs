//! A content's flags and reference count, kept beside the content records rather than in
//! them: one byte per content, and a map entry only for contents that more than one index
//! entry names.
//!
//! Most contents of a cache have exactly one reference (dedup finds a second copy of a
//! few pages only), so a count in every record would cost 2 bytes, and with the flags and
//! alignment 4, half again an 8-byte record, for a number that is almost always 1. Here a
//! content's references are: 0 when it is not `LIVE`, its entry in `shared` when it is
//! `SHARED`, else 1.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};

use super::by_id::ById;
use super::ContentId;

/// The content is in use (at least one reference).
pub const LIVE: u8 = 1;
/// A persistent entry refers to it: never dropped to shrink.
pub const PINNED: u8 = 2;
/// Its first pool asked for background compression.
pub const COMPRESSIBLE: u8 = 4;
/// Its tag is valid and (maybe) in the dedup table.
pub const HASHED: u8 = 8;
/// Two or more references: the count is in `Meta::shared`.
const SHARED: u8 = 16;
/// Read since the compressor last looked (its second chance). Set by gets under the
/// store's read lock, several at once, hence the atomic bytes.
const ACCESSED: u8 = 32;
/// Its bytes are not in the frame its id names: the store's exception map says where
/// (`places.rs`).
pub const EXCEPTION: u8 = 64;
/// Its bytes are gone (found corrupt, or dropped); reads miss.
pub const DEAD: u8 = 128;

/// The flags and reference counts of a store's contents, by content id.
#[derive(Default)]
pub struct Meta {
    bits: ById<AtomicU8>,
    shared: HashMap<ContentId, u16>,
}

impl Meta {
    /// Makes room for the ids of frames below `frames` ([`ById::cover_frames`]).
    pub fn cover_frames(&mut self, frames: usize, expected: usize) {
        self.bits.cover_frames(frames, expected);
    }

    /// Makes room for one more virtual id, and returns it (`None`: none is left).
    pub fn push_virtual(&mut self) -> Option<ContentId> {
        self.bits.push_virtual()
    }

    /// Caps the virtual ids at `cap` ([`ById::cap_virtual`]).
    #[cfg(test)]
    pub fn cap_virtual(&mut self, cap: usize) {
        self.bits.cap_virtual(cap);
    }

    /// Starts content `id` (free until now) with one reference and `flags`.
    pub fn start(&mut self, id: ContentId, flags: u8) {
        debug_assert_eq!(self.flags(id), 0, "content {id} started while in use");
        let kept = PINNED | COMPRESSIBLE | HASHED | ACCESSED | EXCEPTION;
        *self.bits[id].get_mut() = LIVE | (flags & kept);
    }

    /// Content `id`'s flags, read once (for a caller testing several).
    pub fn flags(&self, id: ContentId) -> u8 {
        self.bits[id].load(Ordering::Relaxed)
    }

    /// True when content `id` has `flag` (any of them, if several).
    pub fn has(&self, id: ContentId, flag: u8) -> bool {
        self.flags(id) & flag != 0
    }

    /// Gives content `id` `flag`.
    pub fn set(&mut self, id: ContentId, flag: u8) {
        *self.bits[id].get_mut() |= flag;
    }

    /// Takes `flag` from content `id`.
    pub fn clear(&mut self, id: ContentId, flag: u8) {
        *self.bits[id].get_mut() &= !flag;
    }

    /// The flags a new content starts with to be compressed once cold: compressible, and
    /// counted as just read, so that the compressor's first pass leaves it.
    pub const fn compressible() -> u8 {
        COMPRESSIBLE | ACCESSED
    }

    /// Notes a read of content `id`, for the compressor: only for compressible contents,
    /// and only when not noted yet, so that reading a hot page does not write to it.
    pub fn note_read(&self, id: ContentId) {
        let bits = &self.bits[id];
        let now = bits.load(Ordering::Relaxed);
        if now & COMPRESSIBLE != 0 && now & ACCESSED == 0 {
            bits.fetch_or(ACCESSED, Ordering::Relaxed);
        }
    }

    /// True when content `id` was read since the last call (the compressor's clock hand);
    /// clears the mark.
    pub fn take_read(&mut self, id: ContentId) -> bool {
        let bits = self.bits[id].get_mut();
        let read = *bits & ACCESSED != 0;
        *bits &= !ACCESSED;
        read
    }

    /// References to content `id`.
    pub fn refs(&self, id: ContentId) -> u16 {
        let flags = self.flags(id);
        if flags & LIVE == 0 {
            0
        } else if flags & SHARED != 0 {
            self.shared[&id]
        } else {
            1
        }
    }

    /// One more reference to live content `id`; the caller keeps the count below
    /// `u16::MAX`.
    pub fn add_ref(&mut self, id: ContentId) {
        debug_assert!(self.has(id, LIVE), "a reference to free content {id}");
        if self.has(id, SHARED) {
            let n = self.shared.get_mut(&id).expect("a shared content is counted");
            *n += 1;
        } else {
            self.set(id, SHARED);
            self.shared.insert(id, 2);
        }
    }

    /// One reference fewer to live content `id`; returns how many are left. At 0 the
    /// content is no longer `LIVE` but keeps its other flags, for the caller to undo what
    /// they stand for (the dedup entry, the pinned count) before [`Meta::forget`].
    pub fn drop_ref(&mut self, id: ContentId) -> u16 {
        debug_assert!(self.has(id, LIVE), "release of free content {id}");
        if !self.has(id, SHARED) {
            self.clear(id, LIVE);
            return 0;
        }
        let n = self.shared.get_mut(&id).expect("a shared content is counted");
        *n -= 1;
        let left = *n;
        if left == 1 {
            self.shared.remove(&id);
            self.clear(id, SHARED);
        }
        left
    }

    /// Clears the flags of content `id`, which has no reference left.
    pub fn forget(&mut self, id: ContentId) {
        debug_assert!(!self.has(id, LIVE | SHARED), "content {id} forgotten while in use");
        *self.bits[id].get_mut() = 0;
    }

    /// Heap bytes: a byte per content and the shared counts' map.
    pub fn heap_bytes(&self) -> usize {
        let entry = std::mem::size_of::<(ContentId, u16)>() + 1;
        self.bits.resident_bytes() + self.shared.capacity() * entry
    }

    /// The flag bytes of frame numbers `first..first + n`, for a scan of a segment.
    pub fn of_frames(&self, first: usize, n: usize) -> &[AtomicU8] {
        self.bits.frames(first, n)
    }

    /// True when `flags` (a byte of [`Meta::flags`] or [`Meta::of_frames`]) say the
    /// content's bytes are in the frame its id names: live, no exception, not dead.
    pub const fn in_own_frame(flags: u8) -> bool {
        flags & (LIVE | EXCEPTION | DEAD) == LIVE
    }

    /// True when `id` has a flag byte.
    pub fn covers(&self, id: ContentId) -> bool {
        self.bits.covers(id)
    }

    /// Every id with a flag byte.
    pub fn ids(&self) -> impl Iterator<Item = ContentId> + '_ {
        self.bits.ids()
    }

    /// Panics unless the shared counts are exactly those of the `SHARED` contents, each at
    /// least 2, and only live contents have flags.
    pub fn validate(&self) {
        let shared = self.ids().filter(|&id| self.has(id, SHARED)).count();
        for id in self.ids() {
            let flags = self.flags(id);
            assert!(flags == 0 || flags & LIVE != 0, "free content {id} has flags {flags:#x}");
        }
        assert_eq!(shared, self.shared.len(), "shared counts and SHARED flags disagree");
        for (&id, &n) in &self.shared {
            assert!(n >= 2 && self.has(id, SHARED | LIVE), "content {id}: shared count {n}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_go_to_the_map_only_while_shared() {
        let mut m = Meta::default();
        m.cover_frames(2, 8);
        m.start(0, PINNED);
        m.start(1, 0);
        assert_eq!((m.refs(0), m.refs(1)), (1, 1));
        assert!(m.has(0, PINNED) && !m.has(1, PINNED));
        m.add_ref(0);
        m.add_ref(0);
        assert_eq!(m.refs(0), 3);
        assert_eq!(m.shared.len(), 1);
        m.validate();
        assert_eq!(m.drop_ref(0), 2);
        assert_eq!(m.drop_ref(0), 1);
        assert!(m.shared.is_empty(), "back to one reference: no map entry");
        assert_eq!(m.drop_ref(0), 0);
        assert_eq!(m.refs(0), 0);
        assert!(m.has(0, PINNED), "kept for the caller to unpin");
        m.forget(0);
        assert!(!m.has(0, LIVE | PINNED), "a free content has no flag");
        m.validate();
        m.start(0, HASHED);
        assert_eq!(m.refs(0), 1);
        assert!(m.has(0, HASHED));
    }

    #[test]
    fn a_read_is_noted_once_and_only_for_compressible_contents() {
        let mut m = Meta::default();
        m.cover_frames(2, 2);
        m.start(0, Meta::compressible());
        m.start(1, 0);
        assert!(m.take_read(0), "a new compressible content counts as read");
        assert!(!m.take_read(0));
        m.note_read(0);
        m.note_read(1);
        assert!(m.take_read(0));
        assert!(!m.take_read(1), "not compressible: not noted");
    }
}
