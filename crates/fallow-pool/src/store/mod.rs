//! The content store: page bytes in arena frames (or compressed), their checksums, and the
//! dedup table that lets identical pages share one frame.
//!
//! Index entries name a [`ContentId`], never a frame, so compaction and compression can
//! move bytes without touching them. A content's id is the number of the frame it was
//! first stored in (so its place costs nothing), unless that number was taken; moved and
//! compressed contents become exceptions (`places.rs`): a moved one keeps its id, a
//! compressed one with a single entry takes a new one, which the compressor writes into
//! that entry, so that its frame is reused under its own number (`compress.rs`). A content is
//! reference-counted by the index entries that name it; it is freed when the last one goes.
//!
//! ```text
//!  index entry ──ContentId──▶ Content { sum }   bytes: frame `id`, exceptions[id], blob
//!                             meta[id]: flags, refs (1 unless shared; a map entry if so)
//!  dedup: sum = crc32c(bytes) ^ mask(domain) ──▶ ContentId    owner of frame f: exceptions, else id f
//! ```
//!
//! A content loses its bytes when its checksum fails (it leaves the dedup table at once, and
//! becomes `Dead` when no other entry names it) or when the budget shrinks and its segment
//! is returned to the OS (it still names a frame, but the frame's segment is no longer
//! mapped). Either way every get through it misses, and its slot is reused once the last
//! entry lets go.
//!
//! # Locking
//! A `Store` is guarded by the engine's store `RwLock`, taken after a shard mutex
//! (`docs/concurrency.md`). [`Store::locate`] runs under the read lock, several at once,
//! and the frame it finds is copied after the lock is released ([`HeldFrame`]); every
//! `&mut self` method runs under the write lock.

use std::collections::HashMap;
use std::ptr::NonNull;

use fallow_core::PAGE_SIZE;

use crate::arena::{Arena, ArenaFull, FrameId, FRAMES_PER_SEGMENT};
use crate::content::{content_hash, dedup_key, Digest};
use fallow_core::DedupScope;

mod blob_space;
mod blobs;
mod by_id;
mod chunked;
mod compress;
mod dedup_table;
mod meta;
mod places;
mod shrink;

use blobs::Blobs;
use by_id::{ById, VIRTUAL_BASE};
pub use compress::Compression;
use dedup_table::DedupTable;
use meta::{Meta, HASHED, LIVE, PINNED};
use places::Exceptions;
pub use shrink::ShrinkReport;

/// A stored page's bytes, shared by every index entry with the same content.
pub type ContentId = u32;

/// Where a content's bytes are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Place {
    Frame(FrameId),
    /// lz4 bytes in `Store::blobs` (`blobs.rs`).
    Compressed,
    /// The bytes are gone; reads miss.
    Dead,
}

/// A content may be shared by at most this many index entries; an identical page past it
/// gets a content of its own. Two bytes of count suffice: a page shared 65 535 times has
/// already saved 256 MiB.
const MAX_REFS: u16 = u16::MAX;

/// A content's record: 4 bytes. Its place is its id's frame unless an exception says
/// otherwise ([`places`]); its flags and reference count are kept beside it ([`meta`]),
/// one byte for most contents.
#[derive(Clone, Copy, Default)]
struct Content {
    /// The stored checksum (`fallow_core::content::stored_checksum`): the CRC-32C of the
    /// bytes XORed with the trust domain's mask. Every read checks it (given the reading
    /// pool's mask), and, when `HASHED` is set, the dedup table finds the content by it
    /// ([`Content::key`]). Two different pages share it with probability 2⁻³², so
    /// [`Store::intern`] compares the bytes before sharing and [`Store::share`], which has
    /// no bytes, recomputes the stored page's full content hash. One number for both jobs
    /// (rather than a separate 32-bit tag of the content hash beside it) saves 4 bytes of
    /// every page's metadata.
    sum: u32,
}

impl Content {
    /// The dedup table's hash of this content: its stored checksum spread over 64 bits.
    fn key(&self) -> u64 {
        dedup_key(self.sum)
    }
}

/// How a new content should be kept.
#[derive(Debug, Clone, Copy, Default)]
pub struct InternOptions {
    /// A persistent entry will refer to it.
    pub pinned: bool,
    /// Compress it in the background once cold.
    pub compressible: bool,
}

/// The outcome of reading a content.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    /// The bytes were copied and their checksum matched.
    Ok,
    /// The bytes were dropped earlier (shrink or corruption).
    Dead,
    /// The checksum did not match: the content is now dead, and the read is a miss.
    Corrupt,
}

/// Where a get finds a content's bytes ([`Store::locate`]), with the CRC-32C they must
/// have.
pub enum Located {
    /// In a frame, to be copied after the store lock is released.
    Frame(HeldFrame, u32),
    /// Already in the caller's buffer (a compressed content, decompressed under the lock).
    Copied(u32),
    /// The bytes are gone.
    Dead,
}

/// A content's frame, found under the store's read lock and copied out after it is
/// released, so that a get holds the store lock for a lookup instead of a 4 KiB copy
/// from memory that is rarely in cache.
///
/// Sound because of how a frame's bytes may change: they are written once, before any
/// index entry names the content ([`Store::intern`]); freed or reused only when the
/// content's last reference goes, which needs the shard lock of the last entry naming it;
/// and moved, compressed away or unmapped only by a shrink step or a compression pass,
/// which hold every shard lock besides the store's. A get holds its shard lock, with an
/// entry naming the content, from [`Store::locate`] until the copy ends. `docs/concurrency.md`,
/// "Why a get never sees a torn or moved page".
pub struct HeldFrame {
    ptr: NonNull<u8>,
}

impl HeldFrame {
    /// Copies the frame's 4 KiB into `out`.
    ///
    /// # Safety
    /// From the [`Store::locate`] that returned this frame until this call returns, the
    /// caller holds the lock of a shard with an index entry naming the content (or borrows
    /// the store), so that nothing can free, move or unmap the frame meanwhile.
    pub unsafe fn copy_into(&self, out: &mut [u8]) {
        assert_eq!(out.len(), PAGE_SIZE, "a page buffer");
        // SAFETY: the frame is PAGE_SIZE mapped bytes (`Arena::frame_ptr`) that nobody
        // writes or unmaps until we return (the caller's contract); `out` is a distinct
        // buffer of the same length that we borrow mutably.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), out.as_mut_ptr(), PAGE_SIZE) }
    }
}

/// What [`Store::intern`] did.
pub enum Interned {
    /// An identical page is stored: this content has one more reference.
    Shared(ContentId),
    /// A new content, whose frame the caller fills and then publishes.
    New(NewContent),
}

/// A content just made by [`Store::intern`], whose frame does not hold its bytes yet.
/// Nothing else can reach it: no index entry names it, it is not in the dedup table, and
/// whatever moves frames holds every shard lock, including the putter's.
#[must_use = "a new content must be filled and published"]
pub struct NewContent {
    id: ContentId,
    frame: HeldFrame,
    hashed: bool,
}

impl NewContent {
    /// The content's id, for the index entry.
    pub fn id(&self) -> ContentId {
        self.id
    }

    /// True when the content may be shared (its pool dedups), so [`Store::publish`] has
    /// something to do.
    pub fn shareable(&self) -> bool {
        self.hashed
    }

    /// Copies the page into the content's frame.
    ///
    /// # Safety
    /// From [`Store::intern`] until this call returns, the caller holds the lock of the
    /// shard whose entry will name the content (or borrows the store), so that no shrink
    /// or compression moves the frame, and it has not published the content.
    pub unsafe fn fill(&self, page: &[u8]) {
        assert_eq!(page.len(), PAGE_SIZE, "a page");
        // SAFETY: the frame is PAGE_SIZE mapped bytes that nobody else reads, writes or
        // unmaps (the caller's contract and the paragraph above), 4 KiB-aligned; `page` is
        // another buffer of PAGE_SIZE bytes.
        unsafe { stream_page(page.as_ptr(), self.frame.ptr.as_ptr()) }
    }
}

/// Copies a page into a frame with non-temporal stores: a cache's new page is rarely read
/// soon, so writing around the caches spares reading the frame's old lines in (the frame
/// was last used long ago) and keeps hot lines of other pages cached.
///
/// # Safety
/// `src` is PAGE_SIZE readable bytes, `dst` PAGE_SIZE writable, 16-byte-aligned bytes,
/// and they do not overlap.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_page(src: *const u8, dst: *mut u8) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    // SSE2 is part of x86_64, so these need no run-time check.
    let (src, dst) = (src.cast::<__m128i>(), dst.cast::<__m128i>());
    for i in 0..PAGE_SIZE / 16 {
        // SAFETY: in bounds of both buffers (the contract), `dst` aligned for a stream store.
        unsafe { _mm_stream_si128(dst.add(i), _mm_loadu_si128(src.add(i))) }
    }
    // Streaming stores are weakly ordered: the fence makes them visible before the stores
    // that publish the page (the index entry, the lock releases).
    // SAFETY: SSE is part of x86_64.
    unsafe { _mm_sfence() };
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn stream_page(src: *const u8, dst: *mut u8) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, PAGE_SIZE) }
}

/// Page bytes, their checksums and the dedup table.
pub struct Store {
    arena: Arena,
    /// Records by content id (frame numbers, then virtual ids: `by_id.rs`).
    contents: ById<Content>,
    /// Flags and reference counts, by content id.
    meta: Meta,
    /// Contents whose bytes are not in their id's frame.
    exceptions: Exceptions,
    /// Virtual ids no content holds, for reuse.
    free_virtual: Vec<ContentId>,
    /// Contents with at least one reference.
    live_contents: usize,
    dedup: DedupTable,
    /// Segment number → frames in it whose content is pinned (a persistent page), so a
    /// shrink can pick the segments that are cheapest to release.
    pinned: Vec<u32>,
    blobs: Blobs,
    budget_bytes: usize,
    /// Where a shrink looks next for an unpinned page to drop (a hand over frames).
    cursor: usize,
    corruptions: u64,
    dropped: u64,
    /// References (index entries) held on contents that lost their bytes: what the index
    /// still counts as pages but can only miss. The sweep (`sweep.rs`) brings it to 0.
    stale_entries: usize,
}

impl Store {
    /// An empty store that may hold `budget_bytes` of page data.
    pub fn new(budget_bytes: usize) -> Self {
        let mut dedup = DedupTable::default();
        dedup.expect(budget_bytes / PAGE_SIZE);
        Self {
            arena: Arena::new(budget_bytes / PAGE_SIZE),
            contents: ById::default(),
            meta: Meta::default(),
            exceptions: Exceptions::default(),
            free_virtual: Vec::new(),
            live_contents: 0,
            dedup,
            pinned: Vec::new(),
            blobs: Blobs::default(),
            budget_bytes,
            cursor: 0,
            corruptions: 0,
            dropped: 0,
            stale_entries: 0,
        }
    }

    fn refresh_frame_limit(&mut self) {
        let blob_frames = self.blobs.resident_bytes().div_ceil(PAGE_SIZE);
        self.arena.set_limit((self.budget_bytes / PAGE_SIZE).saturating_sub(blob_frames));
    }

    /// True when one more page fits in the budget.
    pub fn has_room(&self) -> bool {
        self.arena.has_room()
    }

    /// Finds an identical content to share, or makes a new content in a new frame, which
    /// the caller fills after releasing the store lock ([`NewContent::fill`]) and then
    /// publishes ([`Store::publish`]) so that later pages can share it. The 4 KiB copy (and
    /// the first touch of a newly mapped segment) thus happens with no store lock held.
    ///
    /// `Err` when the budget is spent: the caller evicts and calls again.
    // Inlined into the put path, as are `Shard::insert`, `ById::cover_frames` and
    // `dense::place_with`: left to itself the compiler made calls of them, ~60 instructions
    // a put (docs/benchmarks-history.md).
    #[inline]
    pub fn intern(
        &mut self,
        page: &[u8],
        digest: Digest,
        opts: InternOptions,
    ) -> Result<Interned, ArenaFull> {
        let sum = digest.sum;
        let contents = &self.contents;
        let found =
            digest.dedup.then(|| self.dedup.find(dedup_key(sum), |id| contents[id].sum == sum));
        if let Some(id) = found.flatten() {
            if self.meta.refs(id) < MAX_REFS && self.same_bytes(id, page) {
                self.meta.add_ref(id);
                if opts.pinned {
                    self.pin(id);
                }
                return Ok(Interned::Shared(id));
            }
        }
        let frame = match self.arena.alloc() {
            Ok(frame) => frame,
            // Holes that evicted compressed pages left in the blob space still count against
            // the budget: packing a slab (a copy of at most 64 KiB) gives room back
            // without evicting another page.
            Err(ArenaFull::AtLimit) if self.clean_blobs(1) > 0 => self.arena.alloc()?,
            Err(full) => return Err(full),
        };
        self.cover_frames();
        let Some(id) = self.id_for(frame) else {
            // Every virtual id is held (compressed and displaced contents, near the largest
            // budgets): as full as if the budget were spent, so the caller evicts, and
            // evicting frees an id or a frame whose number is free. The frame was not
            // written: it goes back as it came, most likely discarded.
            self.arena.free_and_discard(frame);
            return Err(ArenaFull::AtLimit);
        };
        // Not `HASHED` yet: the dedup table gets it when its bytes are there (`publish`).
        self.contents[id] = Content { sum };
        let flags = if opts.compressible { Meta::compressible() } else { 0 };
        self.meta.start(id, flags);
        self.live_contents += 1;
        self.set_place(id, Place::Frame(frame));
        if opts.pinned {
            self.pin(id);
        }
        Ok(Interned::New(NewContent {
            id,
            frame: HeldFrame { ptr: self.arena.frame_ptr(frame) },
            hashed: digest.dedup,
        }))
    }

    /// True while the dedup table's growth is under way ([`Store::tidy`] has work).
    pub fn growing(&self) -> bool {
        self.dedup.growing()
    }

    /// Moves up to `groups` old groups of the dedup table's growth under way
    /// (`IdTable::tidy`); true while some are left.
    pub fn tidy(&mut self, groups: usize) -> bool {
        let contents = &self.contents;
        self.dedup.tidy(groups, |i| contents[i].key())
    }

    /// Puts a new content, now filled, in the dedup table, so that later identical pages
    /// share it. A checksum shared with a different page keeps the first content in the table
    /// and this one is simply not shared, unless the first has lost its bytes; so does an
    /// identical page put meanwhile through another shard (the two keep a frame each).
    pub fn publish(&mut self, new: NewContent) {
        if !new.hashed {
            return;
        }
        let id = new.id;
        let c = &self.contents[id];
        let (sum, key) = (c.sum, c.key());
        let contents = &self.contents;
        match self.dedup.find(key, |i| contents[i].sum == sum) {
            None => {
                let contents = &self.contents;
                self.dedup.insert_unique(key, id, |i| contents[i].key());
            }
            Some(old) if !self.is_live(old) => {
                // The old content keeps its HASHED flag but is no longer the entry, so its
                // release will not remove ours.
                self.dedup.replace(key, old, id, |i| contents[i].key());
            }
            Some(_) => return,
        }
        self.meta.set(id, HASHED);
    }

    /// [`Store::intern`], filled and published at once: for tests, which hold the store
    /// alone.
    #[cfg(test)]
    fn intern_now(
        &mut self,
        page: &[u8],
        digest: Digest,
        opts: InternOptions,
    ) -> Result<ContentId, ArenaFull> {
        Ok(match self.intern(page, digest, opts)? {
            Interned::Shared(id) => id,
            Interned::New(new) => {
                // SAFETY: `&mut self`: nothing else can reach the store, or the frame.
                unsafe { new.fill(page) };
                let id = new.id();
                self.publish(new);
                id
            }
        })
    }

    /// Shares the live content with this content hash and stored checksum (`sum`, the
    /// client's CRC-32C masked by the pool's domain), as [`Store::intern`] would if it had
    /// the bytes: for a put by hash, whose bytes stayed with the client. The content is
    /// found by its stored checksum; then its full hash is recomputed from its bytes (in
    /// `scope`, the pool's trust domain) and must be `hash`, all 128 bits: a client's hash
    /// of a page that merely has the same checksum (or a wrong hash) gets `None`. The
    /// recomputation costs a hash of one page (~0.2 µs), paid only by a put by hash, which
    /// saved a 4 KiB transfer.
    pub fn share(
        &mut self,
        hash: u128,
        sum: u32,
        scope: DedupScope,
        opts: InternOptions,
    ) -> Option<ContentId> {
        let contents = &self.contents;
        let id = self.dedup.find(dedup_key(sum), |id| contents[id].sum == sum)?;
        if !self.is_live(id) || self.meta.refs(id) == MAX_REFS {
            return None;
        }
        if !self.hashes_to(id, hash, scope) {
            return None;
        }
        self.meta.add_ref(id);
        if opts.pinned {
            self.pin(id);
        }
        Some(id)
    }

    /// True when the bytes of content `id` hash to `hash` in `scope`.
    fn hashes_to(&self, id: ContentId, hash: u128, scope: DedupScope) -> bool {
        let check = |page: &[u8]| content_hash(page, scope) == Some(hash);
        match self.place(id) {
            Place::Frame(f) => self.arena.is_live(f) && check(self.arena.bytes(f)),
            Place::Compressed => {
                let mut buf = [0u8; PAGE_SIZE];
                self.decompress(id, &mut buf) && check(&buf)
            }
            Place::Dead => false,
        }
    }

    /// Calls `visit` with the dedup key (`dedup_key`: the stored checksum spread over 64
    /// bits) of every live, shareable content among the next `max` content positions from
    /// `from` ([`ById::id_at`]); returns where to go on, or `None` at the end. Lets a caller
    /// walk every hash in steps, taking the store lock once per step. Positions are stable
    /// but for virtual ids, which move up when a new segment adds frame numbers between
    /// steps: such a walk may then miss or repeat a few of them, which the summary it
    /// builds allows (a missing hash costs a page sent instead of its hash).
    pub fn visit_dedup_keys(
        &self,
        from: usize,
        max: usize,
        visit: &mut impl FnMut(u64),
    ) -> Option<usize> {
        let end = from.saturating_add(max).min(self.contents.len());
        for pos in from..end {
            let id = self.contents.id_at(pos);
            if self.meta.has(id, HASHED) && self.meta.has(id, LIVE) && self.is_live(id) {
                visit(self.contents[id].key());
            }
        }
        (end < self.contents.len()).then_some(end)
    }

    /// Gives every frame number the arena can hand out an entry in the per-id tables.
    fn cover_frames(&mut self) {
        let frames = self.arena.frame_table_len();
        let expected = self.budget_bytes / PAGE_SIZE;
        self.contents.cover_frames(frames, expected);
        self.meta.cover_frames(frames, expected);
        if self.pinned.len() < frames / FRAMES_PER_SEGMENT {
            self.pinned.resize(frames / FRAMES_PER_SEGMENT, 0);
        }
    }

    /// Marks a content pinned (a persistent entry refers to it), once.
    fn pin(&mut self, id: ContentId) {
        if !self.meta.has(id, PINNED) {
            self.meta.set(id, PINNED);
            if let Place::Frame(f) = self.place(id) {
                self.pinned[f.segment()] += 1;
            }
        }
    }

    /// Records that a content's frame changes from `from` to `to` (either may be none).
    fn move_pin(&mut self, id: ContentId, from: Option<FrameId>, to: Option<FrameId>) {
        if self.meta.has(id, PINNED) {
            if let Some(f) = from {
                self.pinned[f.segment()] -= 1;
            }
            if let Some(t) = to {
                self.pinned[t.segment()] += 1;
            }
        }
    }

    /// True when a content still has its bytes (in a mapped frame, or compressed).
    pub fn is_live(&self, id: ContentId) -> bool {
        match self.place(id) {
            Place::Frame(f) => self.arena.is_live(f),
            Place::Compressed => true,
            Place::Dead => false,
        }
    }

    fn same_bytes(&self, id: ContentId, page: &[u8]) -> bool {
        match self.place(id) {
            Place::Frame(f) => self.arena.is_live(f) && self.arena.bytes(f) == page,
            Place::Compressed => {
                let mut buf = [0u8; PAGE_SIZE];
                self.decompress(id, &mut buf) && buf[..] == *page
            }
            Place::Dead => false,
        }
    }

    /// Index entries that name a content without bytes (dropped by a shrink, or found
    /// corrupt): they count as pages until a read or the sweep removes them.
    pub fn stale_entries(&self) -> usize {
        self.stale_entries
    }

    /// Drops one reference; the last one frees the bytes and the slot.
    pub fn release(&mut self, id: ContentId) {
        if !self.is_live(id) {
            debug_assert!(self.stale_entries > 0, "stale entry of content {id} not counted");
            self.stale_entries = self.stale_entries.saturating_sub(1);
        }
        if self.meta.drop_ref(id) == 0 {
            self.drop_bytes(id);
            self.meta.forget(id);
            self.live_contents -= 1;
            if id >= VIRTUAL_BASE {
                self.free_virtual.push(id);
            }
        }
    }

    /// Takes a content out of the dedup table: no new page will share it.
    fn unhash(&mut self, id: ContentId) {
        if self.meta.has(id, HASHED) {
            self.meta.clear(id, HASHED);
            self.dedup.remove(self.contents[id].key(), id);
        }
    }

    /// Frees a content's bytes and takes it out of the dedup table; its slot stays until
    /// the last reference goes.
    fn drop_bytes(&mut self, id: ContentId) {
        if self.is_live(id) {
            self.stale_entries += usize::from(self.meta.refs(id));
        }
        self.unhash(id);
        let place = self.place(id);
        self.set_place(id, Place::Dead);
        match place {
            Place::Frame(f) => {
                self.move_pin(id, Some(f), None);
                // A frame in a released segment only lets go of the segment.
                self.arena.free(f);
            }
            Place::Compressed => {
                if self.blobs.remove(id).is_some() {
                    self.refresh_frame_limit();
                }
            }
            Place::Dead => {}
        }
    }

    /// Where a get finds a content's bytes, looked up under the store's read lock and
    /// copied after it is released (see [`HeldFrame`]); a compressed content is
    /// decompressed into `out` here, under the lock. The CRC-32C comes back with it (the
    /// stored checksum unmasked by `mask`, the reading pool's [`domain_mask`]), for the
    /// caller to check on its copy; on a mismatch it calls [`Store::read`].
    ///
    /// [`domain_mask`]: crate::content::domain_mask
    pub fn locate(&self, id: ContentId, out: &mut [u8], mask: u32) -> Located {
        let crc = self.contents[id].sum ^ mask;
        let located = match self.place(id) {
            Place::Frame(f) if self.arena.is_live(f) => {
                Located::Frame(HeldFrame { ptr: self.arena.frame_ptr(f) }, crc)
            }
            Place::Frame(_) | Place::Dead => return Located::Dead,
            // A corrupt blob fails the caller's checksum check like a corrupt frame.
            Place::Compressed => {
                let _ = self.decompress(id, out);
                Located::Copied(crc)
            }
        };
        self.meta.note_read(id);
        located
    }

    /// Copies a content's bytes into `out` under the lock and returns the CRC-32C they
    /// must have (`mask` as in [`Store::locate`]). `None`: the bytes are gone.
    fn copy_out(&self, id: ContentId, out: &mut [u8], mask: u32) -> Option<u32> {
        match self.locate(id, out, mask) {
            Located::Frame(frame, crc) => {
                // SAFETY: the caller borrows the store, so nothing can free, move or unmap
                // the frame during the copy.
                unsafe { frame.copy_into(out) };
                Some(crc)
            }
            Located::Copied(crc) => Some(crc),
            Located::Dead => None,
        }
    }

    /// Copies a content's bytes into `out` and checks them, all under the lock: for a get
    /// whose own copy failed its checksum. A corrupt content is taken out of the dedup
    /// table at once, so no new page shares it; its bytes are dropped when no other index
    /// entry names it. Until then each entry that reads it finds the mismatch itself: an
    /// entry in another shard may be copying those bytes right now, with no store lock
    /// (see [`HeldFrame`]), so the frame must not be freed under it.
    ///
    /// `mask` is the reading pool's checksum mask, as for [`Store::locate`].
    pub fn read(&mut self, id: ContentId, out: &mut [u8], mask: u32) -> Read {
        let Some(crc) = self.copy_out(id, out, mask) else { return Read::Dead };
        if crate::content::checksum(out) == crc {
            return Read::Ok;
        }
        self.corruptions += 1;
        tracing::warn!(content = id, "page failed its checksum; reported as a miss");
        if self.meta.refs(id) == 1 {
            self.drop_bytes(id);
        } else {
            self.unhash(id);
        }
        Read::Corrupt
    }

    /// Current numbers, for stats.
    pub fn usage(&self) -> StoreUsage {
        StoreUsage {
            frames_used: self.arena.used(),
            mapped_bytes: self.arena.mapped_bytes(),
            discarded_bytes: self.arena.discarded_frames() * PAGE_SIZE,
            budget_bytes: self.budget_bytes,
            compressed_pages: self.blobs.len(),
            compressed_bytes: self.blobs.payload_bytes(),
            compressed_space_bytes: self.blobs.resident_bytes(),
            contents: self.live_contents,
            corruptions: self.corruptions,
            dropped_by_shrink: self.dropped,
            heap_bytes: self.heap_bytes(),
        }
    }

    fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        let dedup = self.dedup.heap_bytes();
        self.arena.heap_bytes()
            + self.contents.resident_bytes()
            + self.meta.heap_bytes()
            + self.exceptions.heap_bytes()
            + self.free_virtual.capacity() * size_of::<ContentId>()
            + self.pinned.capacity() * size_of::<u32>()
            + dedup
            + self.blobs.heap_bytes()
    }

    /// Panics unless every content's reference count equals `refs[id]` (as counted from
    /// the index) and the arena, the places (each frame's owner) and the dedup table agree.
    pub fn validate(&self, refs: &HashMap<ContentId, u32>) {
        self.arena.validate();
        let mut pinned = vec![0u32; self.pinned.len()];
        let mut stale = HashMap::<usize, usize>::new();
        let mut live = 0;
        let mut stale_refs = 0;
        for id in self.contents.ids() {
            let expected = refs.get(&id).copied().unwrap_or(0);
            let refs = u32::from(self.meta.refs(id));
            assert_eq!(refs, expected, "content {id}: refs {refs} but {expected} entries");
            if refs == 0 {
                continue;
            }
            live += 1;
            if !self.is_live(id) {
                stale_refs += refs as usize;
            }
            match self.place(id) {
                Place::Frame(f) => {
                    assert_eq!(self.owner(f), Some(id), "frame {f:?} owner mismatch");
                    if self.arena.is_live(f) {
                        assert!(!self.arena.is_free(f), "content {id} in free frame {f:?}");
                        if self.meta.has(id, PINNED) {
                            pinned[f.segment()] += 1;
                        }
                    } else {
                        *stale.entry(f.segment()).or_insert(0) += 1;
                    }
                }
                Place::Compressed => assert!(self.blobs.contains(id), "blob missing"),
                Place::Dead => {}
            }
        }
        assert_eq!(live, self.live_contents, "live content count drifted");
        assert_eq!(stale_refs, self.stale_entries, "stale entry count drifted");
        self.meta.validate();
        self.validate_places();
        for raw in 0..self.arena.frame_table_len() as u32 {
            let f = FrameId::from_raw(raw);
            if let Some(id) = self.owner(f) {
                assert_eq!(self.place(id), Place::Frame(f), "frame {raw}: stale owner {id}");
            }
        }
        let mut sums = std::collections::HashSet::new();
        for id in self.dedup.iter() {
            let c = &self.contents[id];
            assert!(self.meta.has(id, LIVE) && self.meta.has(id, HASHED), "stale dedup entry {id}");
            assert!(sums.insert(c.sum), "two dedup entries for one stored checksum");
            let found = self.dedup.find(c.key(), |o| self.contents[o].sum == c.sum);
            assert_eq!(found, Some(id), "dedup entry {id} cannot be found by its hash");
        }
        self.dedup.validate(|i| self.contents[i].key());
        assert_eq!(pinned, self.pinned, "pinned frame counts per segment drifted");
        let mut draining: Vec<(usize, usize)> = stale.into_iter().collect();
        draining.sort_unstable();
        assert_eq!(draining, self.arena.draining(), "stale frames of released segments drifted");
        self.blobs.validate();
    }

    /// Flips one byte of a content's stored bytes, for integrity tests.
    #[cfg(test)]
    pub fn corrupt(&mut self, id: ContentId) {
        if let Place::Frame(f) = self.place(id) {
            self.arena.bytes_mut(f)[100] ^= 0xff;
        }
    }
}

/// A snapshot of the store's use of memory.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreUsage {
    /// Frames holding page bytes.
    pub frames_used: usize,
    /// Bytes mapped from the OS for frames.
    pub mapped_bytes: usize,
    /// Of those, free frames whose memory went back to the OS (a compressed page's).
    pub discarded_bytes: usize,
    /// The lent budget.
    pub budget_bytes: usize,
    /// Pages held compressed.
    pub compressed_pages: usize,
    /// Bytes of compressed page data.
    pub compressed_bytes: usize,
    /// Bytes of the slabs that hold it, holes included: what the budget is charged.
    pub compressed_space_bytes: usize,
    /// Distinct contents (after dedup).
    pub contents: usize,
    /// Reads whose checksum failed.
    pub corruptions: u64,
    /// Contents dropped to give memory back.
    pub dropped_by_shrink: u64,
    /// Heap held by the store's tables.
    pub heap_bytes: usize,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::content::checksum;

    const DOMAIN: DedupScope = DedupScope::Domain(fallow_core::TrustDomain(0));

    #[test]
    fn a_content_takes_4_bytes() {
        assert_eq!(std::mem::size_of::<Content>(), 4);
    }

    #[test]
    fn a_put_by_hash_needs_all_128_bits_of_the_hash_and_the_checksum() {
        let mut store = Store::new(16 * PAGE_SIZE);
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i % 253) as u8).collect();
        let digest = Digest::of(&page, DOMAIN);
        let id = store.intern_now(&page, digest, InternOptions::default()).unwrap();
        let hash = content_hash(&page, DOMAIN).unwrap();
        let opts = InternOptions::default();
        // The same checksum, another hash: the stored page's hash is recomputed, so this is
        // not held.
        for wrong in [hash ^ 1, hash ^ (1 << 32), hash ^ (1 << 127)] {
            assert_eq!(store.share(wrong, digest.sum, DOMAIN, opts), None, "{wrong:x}");
        }
        assert_eq!(store.share(hash, digest.sum ^ 1, DOMAIN, opts), None, "checksum differs");
        let other = DedupScope::Domain(fallow_core::TrustDomain(1));
        let theirs = Digest::of(&page, other).sum;
        assert_eq!(store.share(hash, theirs, other, opts), None, "another domain's checksum");
        assert_eq!(store.share(hash, digest.sum, other, opts), None, "another domain's hash");
        assert_eq!(store.share(hash, digest.sum, DOMAIN, opts), Some(id));
        let mut refs = HashMap::new();
        refs.insert(id, 2);
        store.validate(&refs);
    }

    #[test]
    fn pages_whose_checksums_collide_are_kept_apart() {
        // Two different pages with one stored checksum (a CRC-32C collision, made here by
        // choosing each one's domain mask): the second is not shared with the first (the
        // bytes differ) and is not in the dedup table; both read back their own bytes.
        let mut store = Store::new(16 * PAGE_SIZE);
        let (a, b) = (vec![1u8; PAGE_SIZE], vec![2u8; PAGE_SIZE]);
        let sum = 0xdead_beef;
        let (mask_a, mask_b) = (sum ^ checksum(&a), sum ^ checksum(&b));
        let digest = Digest { sum, dedup: true };
        let ia = store.intern_now(&a, digest, InternOptions::default()).unwrap();
        let ib = store.intern_now(&b, digest, InternOptions::default()).unwrap();
        assert_ne!(ia, ib);
        let mut out = vec![0u8; PAGE_SIZE];
        assert_eq!(store.read(ib, &mut out, mask_b), Read::Ok);
        assert_eq!(out, b);
        assert_eq!(store.read(ia, &mut out, mask_a), Read::Ok);
        assert_eq!(out, a);
        store.validate(&HashMap::from([(ia, 1), (ib, 1)]));
    }

    #[test]
    fn a_content_shared_to_its_limit_makes_the_next_copy_its_own() {
        let mut store = Store::new(16 * PAGE_SIZE);
        let page = vec![0x5au8; PAGE_SIZE];
        let digest = Digest::of(&page, DOMAIN);
        let first = store.intern_now(&page, digest, InternOptions::default()).unwrap();
        for _ in 1..MAX_REFS {
            assert_eq!(store.intern_now(&page, digest, InternOptions::default()), Ok(first));
        }
        let own = store.intern_now(&page, digest, InternOptions::default()).unwrap();
        assert_ne!(own, first, "a 65 536th reference must not overflow the count");
        let opts = InternOptions::default();
        let hash = content_hash(&page, DOMAIN).unwrap();
        assert_eq!(store.share(hash, digest.sum, DOMAIN, opts), None);
        let mut refs = HashMap::new();
        refs.insert(first, u32::from(MAX_REFS));
        refs.insert(own, 1);
        store.validate(&refs);
        // Once a reference goes, the first content takes new ones again.
        store.release(first);
        assert_eq!(store.intern_now(&page, digest, InternOptions::default()), Ok(first));
        store.validate(&refs);
    }
}
