//! Where compressed pages' bytes live: records packed end to end in slabs of 64 KiB,
//! carved from 16 MiB anonymous mappings, and cleaned as a log-structured store cleans.
//!
//! ```text
//!  region (16 MiB mapping) = 256 slabs of 64 KiB
//!  slab: [id u32 | len u16 | lz4 bytes …][id | len | …] … fill ▸ (unwritten)
//!           live: bytes of the records still named by their content
//! ```
//!
//! Why not a heap allocation per blob: the budget would count the blobs' bytes, but freed
//! blobs leave holes in glibc's heap that only blobs of fitting sizes can reuse. Measured
//! that way under churn, the heap held 1.57 × the blobs' bytes (`mallinfo2`: 0.90 × the
//! budget mapped in the heap for 0.57 in use, 31,000 free chunks that `malloc_trim` could
//! not return), and a compressing engine's RssAnon reached 1.11 × its budget.
//!
//! Here a new record is appended to the one open slab. Freeing a record only lowers its
//! slab's live count; a slab with nothing live is let go at once (kept resident as one of
//! [`SPARES`] for the next opens while other slabs are in use, or its memory returned with
//! `MADV_DONTNEED`), and one
//! with little live is *cleaned*: its live records are copied to the open slab and it is
//! let go. The store charges the budget with every slab in use and every spare, holes
//! included, so what the budget counts is what is resident. Cleaning keeps the holes
//! under an eighth of the live bytes ([`BlobSpace::over_waste`]); the slab cleaned is the
//! emptiest of the next [`SCAN`], and never one over 15/16 live, so at worst 15 bytes are
//! copied per byte given back (a memcpy, under the lock that already keeps every reader
//! of the blobs out). The store cleans in the compressor's passes, in a shrink, and when
//! a put finds the budget spent (`Store::intern`): there a cleaned slab gives room back
//! without evicting a page.
//!
//! A record names its content (`id`), so a cleaner can ask the blob table whether the
//! record is still the content's (`blobs.rs`); the table stores only the record's
//! position, 8 bytes.

use std::num::NonZeroU64;

use memmap2::{MmapMut, MmapRaw, UncheckedAdvice};

use fallow_core::PAGE_SIZE;

use super::ContentId;

/// Bytes of one slab: the unit of cleaning, and of the budget's charge once the slab
/// is closed. Cleaning one copies at most this much under the locks (~10 µs); a closed
/// slab's unwritten tail is shorter than the record that did not fit (at most 3.5 KiB,
/// 5 % of it).
pub const SLAB_BYTES: usize = 64 << 10;
/// Slabs per mapping: 16 MiB, so that even a 1 TiB space is 65,536 mappings at most.
const SLABS_PER_REGION: usize = 256;
const REGION_BYTES: usize = SLAB_BYTES * SLABS_PER_REGION;
/// A record's header: the content id (u32) and the blob's length (u16), little-endian.
pub const HEADER: usize = 6;
/// The longest blob a record holds.
pub const MAX_BLOB: usize = u16::MAX as usize;
/// Free slabs kept resident (and charged to the budget) for the next opens.
pub const SPARES: usize = 4;
/// Slabs a cleaner looks at to pick the emptiest.
const SCAN: usize = 64;

/// Where a record starts: its byte offset in the space, plus one, so that an
/// `Option<BlobPos>` takes 8 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobPos(NonZeroU64);

impl BlobPos {
    fn new(slab: usize, offset: usize) -> Self {
        let at = (slab * SLAB_BYTES + offset) as u64 + 1;
        Self(NonZeroU64::new(at).expect("a position plus one is never zero"))
    }

    fn slab(self) -> usize {
        (self.0.get() - 1) as usize / SLAB_BYTES
    }

    fn offset(self) -> usize {
        (self.0.get() - 1) as usize % SLAB_BYTES
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Slab {
    /// Bytes written from the slab's start (0: free).
    fill: u32,
    /// Bytes of records still named by their content.
    live: u32,
    in_use: bool,
}

/// Slabs of records, see the module comment.
#[derive(Default)]
pub struct BlobSpace {
    regions: Vec<MmapRaw>,
    slabs: Vec<Slab>,
    /// Free slab numbers, their memory with the OS; the last freed is taken first.
    free: Vec<u32>,
    /// Free slabs kept resident for the next opens (at most [`SPARES`]): a slab
    /// discarded and opened again costs a `madvise` and a fault per page.
    spare: Vec<u32>,
    /// The slab taking appends.
    open: Option<usize>,
    /// It was a spare: resident whole, not only as far as written.
    open_was_spare: bool,
    used_slabs: usize,
    /// Bytes of live records, headers included.
    live_bytes: usize,
    /// Where the cleaner looks next.
    hand: usize,
}

impl BlobSpace {
    /// Appends a record of `blob` for content `id`; `None` when the OS gives no memory
    /// (the caller leaves the page uncompressed).
    pub fn append(&mut self, id: ContentId, blob: &[u8]) -> Option<BlobPos> {
        assert!(blob.len() <= MAX_BLOB, "a blob of {} bytes", blob.len());
        let len = HEADER + blob.len();
        let (slab, offset) = self.take_room(len)?;
        let dst = &mut self.bytes_mut(slab)[offset..offset + len];
        dst[..4].copy_from_slice(&id.to_le_bytes());
        dst[4..HEADER].copy_from_slice(&(blob.len() as u16).to_le_bytes());
        dst[HEADER..].copy_from_slice(blob);
        Some(BlobPos::new(slab, offset))
    }

    /// Makes sure a record of `len` bytes (header included) fits in the open slab,
    /// opening one if needed; false when the OS gives no memory.
    pub fn reserve(&mut self, len: usize) -> bool {
        self.open_with_room(len).is_some()
    }

    /// The open slab if `len` more bytes fit in it, else a newly opened one; `None` when
    /// the OS gives no memory.
    fn open_with_room(&mut self, len: usize) -> Option<usize> {
        match self.open {
            Some(slab) if self.slabs[slab].fill as usize + len <= SLAB_BYTES => Some(slab),
            _ => self.open_slab(),
        }
    }

    /// Claims `len` bytes at the end of the open slab (opening one if needed) for a record
    /// the caller writes there, counted live from now: its slab and offset.
    fn take_room(&mut self, len: usize) -> Option<(usize, usize)> {
        let slab = self.open_with_room(len)?;
        let s = &mut self.slabs[slab];
        let offset = s.fill as usize;
        s.fill += len as u32;
        s.live += len as u32;
        self.live_bytes += len;
        Some((slab, offset))
    }

    /// The record at `pos`: its content id and blob.
    pub fn get(&self, pos: BlobPos) -> (ContentId, &[u8]) {
        let (slab, offset) = (pos.slab(), pos.offset());
        let bytes = &self.bytes(slab)[..self.slabs[slab].fill as usize];
        record_at(bytes, offset)
    }

    /// Lets go of the record at `pos` and returns its blob's length; a slab left with
    /// nothing live goes back to the OS (the open one too: the next append opens another).
    pub fn free(&mut self, pos: BlobPos) -> usize {
        let blob_len = self.get(pos).1.len();
        let len = HEADER + blob_len;
        let slab = pos.slab();
        let s = &mut self.slabs[slab];
        debug_assert!(s.in_use && s.live as usize >= len, "slab {slab} freed past its live");
        s.live -= len as u32;
        self.live_bytes -= len;
        if s.live == 0 {
            self.release(slab);
        }
        blob_len
    }

    /// Bytes of the slabs in use: what the budget is charged for compressed pages. The
    /// open slab counts up to its last written page: the rest of it was never touched
    /// since it was mapped or discarded, so it is not resident (and a small engine is not
    /// charged a whole slab for its first few compressed pages).
    pub fn resident_bytes(&self) -> usize {
        self.used_bytes() + self.spare.len() * SLAB_BYTES
    }

    /// [`Self::resident_bytes`] of the slabs in use, spares left out.
    fn used_bytes(&self) -> usize {
        match self.open {
            Some(slab) if !self.open_was_spare => {
                let written = (self.slabs[slab].fill as usize).next_multiple_of(PAGE_SIZE);
                (self.used_slabs - 1) * SLAB_BYTES + written
            }
            _ => self.used_slabs * SLAB_BYTES,
        }
    }

    /// Bytes of live records, headers included.
    pub fn live_bytes(&self) -> usize {
        self.live_bytes
    }

    /// True while the holes in the slabs exceed what cleaning lets be: an eighth of the
    /// live bytes, plus the open slab's unwritten tail and one more slab.
    pub fn over_waste(&self) -> bool {
        let waste = self.used_bytes() - self.live_bytes;
        waste > 2 * SLAB_BYTES + self.live_bytes / 8
    }

    /// The emptiest of the next [`SCAN`] slabs in use (not the open one), if it is worth
    /// cleaning (at most 15/16 live); the cleaner's hand moves past the ones looked at.
    pub fn pick_victim(&mut self) -> Option<usize> {
        let best = self.scan()?;
        ((self.slabs[best].live as usize) < SLAB_BYTES / 16 * 15).then_some(best)
    }

    /// The next slab in use after the hand, the open one included: a shrink visits them
    /// in turn (the emptiest would be the same slab of persistent pages each time).
    pub fn next_slab(&mut self) -> Option<usize> {
        let n = self.slabs.len();
        for _ in 0..n {
            let slab = self.hand % n;
            self.hand = (self.hand + 1) % n;
            if self.slabs[slab].in_use {
                return Some(slab);
            }
        }
        None
    }

    /// Gives the spare slabs' memory back (a shrink wants it before any page goes).
    pub fn discard_spares(&mut self) {
        while let Some(spare) = self.spare.pop() {
            self.discard(spare as usize);
        }
    }

    /// Slabs in use.
    pub fn slabs_in_use(&self) -> usize {
        self.used_slabs
    }

    /// Moves the hand past the next [`SCAN`] slabs in use but not open (free ones are
    /// stepped over, at most `16 × SCAN` slabs looked at) and returns the one with the
    /// fewest live bytes.
    fn scan(&mut self) -> Option<usize> {
        let n = self.slabs.len();
        let (mut best, mut seen): (Option<usize>, usize) = (None, 0);
        // Free slabs are stepped over, but not without end: after a large drop most of a
        // big space may be free, and this runs under the store lock (a put's included).
        for _ in 0..n.min(16 * SCAN) {
            if seen == SCAN {
                break;
            }
            let slab = self.hand % n;
            self.hand = (self.hand + 1) % n;
            let s = self.slabs[slab];
            if !s.in_use || self.open == Some(slab) {
                continue;
            }
            seen += 1;
            if best.is_none_or(|b| s.live < self.slabs[b].live) {
                best = Some(slab);
            }
        }
        best
    }

    /// Every record written in slab `slab`, live or not: position, id.
    pub fn records(&self, slab: usize) -> Vec<(BlobPos, ContentId)> {
        let bytes = &self.bytes(slab)[..self.slabs[slab].fill as usize];
        let mut out = Vec::new();
        let mut offset = 0;
        while offset < bytes.len() {
            let (id, blob) = record_at(bytes, offset);
            out.push((BlobPos::new(slab, offset), id));
            offset += HEADER + blob.len();
        }
        out
    }

    /// Stops appending to slab `slab` if it is the open one (the next append opens
    /// another): a slab being emptied must not take the records moved out of it.
    fn close(&mut self, slab: usize) {
        if self.open == Some(slab) {
            self.open = None;
            self.open_was_spare = false;
        }
    }

    /// Copies the record at `pos` to the open slab (another one, if `pos` is in the open
    /// slab) and frees it where it was; the new position, or `None` (nothing moved) when
    /// no slab can be had.
    pub fn relocate(&mut self, pos: BlobPos) -> Option<BlobPos> {
        let from = pos.slab();
        self.close(from);
        let len = HEADER + self.get(pos).1.len();
        let (to, offset) = self.take_room(len)?;
        assert_ne!(to, from, "a record moved within its own slab");
        // SAFETY: both ranges lie inside their slabs (the record was written within its
        // slab's fill, the room was claimed within the other's), two slabs never overlap,
        // and `&mut self` keeps every other reference out.
        unsafe {
            let src = self.slab_ptr(from).add(pos.offset());
            std::ptr::copy_nonoverlapping(src, self.slab_ptr(to).add(offset), len);
        }
        self.free(pos);
        Some(BlobPos::new(to, offset))
    }

    /// Heap bytes of the bookkeeping (the slabs themselves are the budget's).
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        self.regions.capacity() * size_of::<MmapRaw>()
            + self.slabs.capacity() * size_of::<Slab>()
            + (self.free.capacity() + self.spare.capacity()) * size_of::<u32>()
    }

    /// Panics unless the counts agree with the slabs' records and `live` (position,
    /// length) are exactly the live records.
    pub fn validate(&self, live: &[(BlobPos, usize)]) {
        let mut per_slab = vec![0usize; self.slabs.len()];
        for &(pos, len) in live {
            assert!(self.slabs[pos.slab()].in_use, "a live record in a free slab");
            assert_eq!(self.get(pos).1.len(), len, "a record's length");
            per_slab[pos.slab()] += HEADER + len;
        }
        let mut listed = vec![false; self.slabs.len()];
        for &slab in self.free.iter().chain(&self.spare) {
            assert!(!listed[slab as usize], "slab {slab} listed free twice");
            listed[slab as usize] = true;
        }
        let mut used = 0;
        for (slab, s) in self.slabs.iter().enumerate() {
            assert_eq!(s.live as usize, per_slab[slab], "slab {slab}'s live bytes");
            assert!(s.fill as usize <= SLAB_BYTES && s.live <= s.fill, "slab {slab} fill");
            used += usize::from(s.in_use);
            assert_eq!(!s.in_use, listed[slab], "slab {slab} is free exactly when listed free");
            if !s.in_use {
                assert_eq!(s.fill, 0, "free slab {slab} written");
            } else {
                let just_opened = self.open == Some(slab) && s.fill == 0;
                assert!(s.live > 0 || just_opened, "slab {slab} kept with nothing live");
            }
        }
        assert_eq!(used, self.used_slabs, "slabs in use");
        assert!(self.spare.len() <= SPARES, "spares");
        assert_eq!(used + self.free.len() + self.spare.len(), self.slabs.len(), "free lists");
        assert_eq!(per_slab.iter().sum::<usize>(), self.live_bytes, "live bytes");
    }

    /// Closes the open slab (letting it go if nothing in it is live) and opens a free
    /// one, mapping a new region when none is free.
    fn open_slab(&mut self) -> Option<usize> {
        if self.free.is_empty() && self.spare.is_empty() {
            self.map_region()?;
        }
        // The old open slab, if any, holds live records (one with none was let go).
        self.open = None;
        self.open_was_spare = !self.spare.is_empty();
        let slab = self.spare.pop().or_else(|| self.free.pop())? as usize;
        self.slabs[slab].in_use = true;
        self.used_slabs += 1;
        self.open = Some(slab);
        Some(slab)
    }

    fn map_region(&mut self) -> Option<()> {
        let map = match MmapMut::map_anon(REGION_BYTES) {
            Ok(map) => MmapRaw::from(map),
            Err(e) => {
                tracing::warn!(error = %e, "could not map memory for compressed pages");
                return None;
            }
        };
        let first = self.slabs.len();
        self.regions.push(map);
        self.slabs.resize(first + SLABS_PER_REGION, Slab::default());
        // Popped from the end: the lowest number first.
        self.free.extend((first..first + SLABS_PER_REGION).rev().map(|s| s as u32));
        Some(())
    }

    /// Takes slab `slab` out of use: kept resident as a spare if there are fewer than
    /// [`SPARES`] and other slabs are in use, else its memory goes back to the OS. The last
    /// slab in use takes the spares with it: an engine whose compressed pages all went
    /// keeps no memory for them.
    fn release(&mut self, slab: usize) {
        self.slabs[slab] = Slab::default();
        self.used_slabs -= 1;
        if self.open == Some(slab) {
            self.open = None;
        }
        if self.used_slabs > 0 && self.spare.len() < SPARES {
            self.spare.push(slab as u32);
            return;
        }
        self.discard(slab);
        if self.used_slabs == 0 {
            self.discard_spares();
        }
    }

    /// Gives free slab `slab`'s memory back to the OS and puts it on the free list.
    fn discard(&mut self, slab: usize) {
        let (region, offset) = (slab / SLABS_PER_REGION, slab % SLABS_PER_REGION);
        // SAFETY: no reference into the slab outlives `&mut self`, and its records are
        // all dead: nothing reads these bytes again before they are written.
        let result = unsafe {
            self.regions[region].unchecked_advise_range(
                UncheckedAdvice::DontNeed,
                offset * SLAB_BYTES,
                SLAB_BYTES,
            )
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "madvise(DONTNEED) failed; the slab stays resident");
        }
        self.free.push(slab as u32);
    }

    /// Where slab `slab` starts.
    fn slab_ptr(&self, slab: usize) -> *mut u8 {
        let (region, offset) = (slab / SLABS_PER_REGION, slab % SLABS_PER_REGION);
        // SAFETY: the region maps `REGION_BYTES`, so the slab is inside it.
        unsafe { self.regions[region].as_mut_ptr().add(offset * SLAB_BYTES) }
    }

    fn bytes(&self, slab: usize) -> &[u8] {
        // SAFETY: the slab is mapped for `SLAB_BYTES`; writes go through `&mut self`, so no
        // `&mut` aliases this slice.
        unsafe { std::slice::from_raw_parts(self.slab_ptr(slab), SLAB_BYTES) }
    }

    fn bytes_mut(&mut self, slab: usize) -> &mut [u8] {
        // SAFETY: as in `bytes`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.slab_ptr(slab), SLAB_BYTES) }
    }
}

/// The record starting at `offset` of a slab's written bytes.
fn record_at(bytes: &[u8], offset: usize) -> (ContentId, &[u8]) {
    let id = u32::from_le_bytes(bytes[offset..offset + 4].try_into().expect("4 bytes"));
    let len = u16::from_le_bytes(bytes[offset + 4..offset + HEADER].try_into().expect("2 bytes"));
    (id, &bytes[offset + HEADER..offset + HEADER + len as usize])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blob(id: u32, len: usize) -> Vec<u8> {
        (0..len).map(|i| (i as u32 ^ id.wrapping_mul(31)) as u8).collect()
    }

    /// Appends `slabs` slabs' worth of `len`-byte records, ids from 0; records per slab,
    /// and their positions.
    fn fill(s: &mut BlobSpace, slabs: usize, len: usize) -> (usize, Vec<BlobPos>) {
        let per = SLAB_BYTES / (HEADER + len);
        let pos = (0..(slabs * per) as u32).map(|id| s.append(id, &blob(id, len)).unwrap());
        (per, pos.collect())
    }

    #[test]
    fn records_read_back_and_a_slab_with_nothing_live_goes_back() {
        let mut s = BlobSpace::default();
        let (per, pos) = fill(&mut s, 3, 3000);
        let open_written = (SLAB_BYTES - SLAB_BYTES % (HEADER + 3000)).next_multiple_of(PAGE_SIZE);
        assert_eq!(s.resident_bytes(), 2 * SLAB_BYTES + open_written, "the open one as written");
        for (id, &p) in pos.iter().enumerate() {
            assert_eq!(s.get(p), (id as u32, &blob(id as u32, 3000)[..]));
        }
        let live = |pos: &[BlobPos]| pos.iter().map(|&p| (p, 3000)).collect::<Vec<_>>();
        s.validate(&live(&pos));
        // The first slab's records all go: it is let go, kept as a spare.
        pos[..per].iter().for_each(|&p| assert_eq!(s.free(p), 3000));
        assert_eq!((s.used_bytes(), s.spare.len()), (SLAB_BYTES + open_written, 1));
        assert_eq!(s.resident_bytes(), 2 * SLAB_BYTES + open_written, "a spare is charged");
        s.validate(&live(&pos[per..]));
        pos[2 * per..].iter().for_each(|&p| assert_eq!(s.free(p), 3000));
        assert_eq!((s.used_bytes(), s.spare.len()), (SLAB_BYTES, 2), "the open one went too");
        s.validate(&live(&pos[per..2 * per]));
        // Spares are opened before free slabs, and charged whole.
        let again = s.append(9, &blob(9, 100)).unwrap();
        assert_eq!(s.get(again), (9, &blob(9, 100)[..]));
        assert_eq!((s.used_bytes(), s.spare.len()), (2 * SLAB_BYTES, 1));
        assert_eq!(s.slabs.len(), SLABS_PER_REGION, "one region");
    }

    #[test]
    fn past_the_spares_a_freed_slab_goes_back_to_the_os_and_the_last_takes_the_spares() {
        let mut s = BlobSpace::default();
        let (per, pos) = fill(&mut s, SPARES + 4, 3000);
        // All but the last slab's records go: spares first, then back to the OS.
        pos[..(SPARES + 3) * per].iter().for_each(|&p| assert_eq!(s.free(p), 3000));
        assert_eq!((s.used_slabs, s.spare.len()), (1, SPARES));
        assert_eq!(s.free.len(), SLABS_PER_REGION - SPARES - 1);
        s.validate(&pos[(SPARES + 3) * per..].iter().map(|&p| (p, 3000)).collect::<Vec<_>>());
        // A discarded slab reads as zeros: its memory went back.
        let discarded = *s.free.last().unwrap() as usize;
        assert!(discarded < SPARES + 4, "a slab that was written");
        assert!(s.bytes(discarded).iter().all(|&b| b == 0), "slab {discarded} was not discarded");
        // The last slab in use goes, and the spares with it.
        pos[(SPARES + 3) * per..].iter().for_each(|&p| assert_eq!(s.free(p), 3000));
        assert_eq!((s.resident_bytes(), s.spare.len()), (0, 0));
        assert_eq!(s.free.len(), SLABS_PER_REGION);
        s.validate(&[]);
    }

    #[test]
    fn relocating_the_live_records_of_a_sparse_slab_frees_it() {
        let mut s = BlobSpace::default();
        let (per, pos) = fill(&mut s, 2, 1000);
        // Keep every 8th record of the first slab.
        let mut live: Vec<(BlobPos, usize)> = Vec::new();
        for (i, &p) in pos.iter().enumerate() {
            if i < per && i % 8 != 0 {
                assert_eq!(s.free(p), 1000);
            } else {
                live.push((p, 1000));
            }
        }
        assert!(!s.over_waste(), "one sparse slab is within what cleaning lets be");
        let victim = s.pick_victim().expect("the sparse first slab");
        assert_eq!(victim, 0);
        for (p, id) in s.records(victim) {
            if let Some(entry) = live.iter_mut().find(|(q, _)| *q == p) {
                let new = s.relocate(p).unwrap();
                assert_eq!(s.get(new), (id, &blob(id, 1000)[..]));
                entry.0 = new;
            }
        }
        assert!(!s.slabs[0].in_use, "the cleaned slab is free");
        s.validate(&live);
        assert_eq!(s.pick_victim(), None, "nothing sparse left");
    }
}
