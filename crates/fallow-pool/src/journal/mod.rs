//! The journal of persistent pages: what lets a node that crashed come back with every
//! page its persistent pools held (docs/operations.md, "What a restart keeps").
//!
//! Page bytes live in anonymous memory ([`crate::arena`]), which the kernel frees when the
//! process dies. Each shard therefore appends, under its own lock and in the same critical
//! section as the index change, one record per change of a persistent page to a file of
//! its own: the page put (its bytes, or its fill word), or the key, object or pool whose
//! pages went. The files belong in a tmpfs (`/run`, `/dev/shm`), where a record is in the
//! kernel's page cache, and so outlives the process, once `writev` returns: before the
//! request it belongs to is answered. After a crash, [`recover`] reads them back, in order,
//! and what each key held last is put again.
//!
//! Appending under the shard lock is what keeps the journal's order the index's order: a
//! put and an invalidation of one key, made on two connections, are journaled in the order
//! the index saw them, so a replay never brings back a page the client had invalidated.
//!
//! ```text
//!  file:   "FALLOWJ1" · 8 zero bytes · record · record · …
//!  record: crc32c u32 (of the rest of the record) · kind u8 · 3 zero bytes ·
//!          pool u32 · object u64 · index u64 · payload       (integers little-endian)
//!  kind    1 page        payload: the 4096 bytes
//!          2 fill page   payload: the word u64 repeated over the page
//!          3 key gone    (a take, an invalidation, a refused put)
//!          4 object gone (index ignored)
//!          5 pool gone   (object and index ignored)
//! ```
//!
//! A journal grows by one record per change, so when it holds more than twice the bytes of
//! the records its shard's live pages need (and at least [`COMPACT_FLOOR`]), the engine
//! writes the live pages into a new file and renames it over the old one, under the shard
//! lock ([`crate::engine`]). The journal is not in the lent budget: it is a second copy of
//! the persistent pages, the price of keeping them through a crash.

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use fallow_core::{PageKey, PoolId, PAGE_SIZE};
use memmap2::MmapRaw;

mod recover;

pub use recover::{journal_dir, recover, Recovered, RecoveryReport};

/// The first bytes of every journal file.
pub(crate) const MAGIC: &[u8; 8] = b"FALLOWJ1";
/// The file header: the magic and 8 bytes reserved (zero).
pub(crate) const FILE_HEADER: usize = 16;
/// A record's header: checksum, kind, padding and key.
pub(crate) const RECORD_HEADER: usize = 28;
/// The size of a page record: what one live page costs in a compacted journal.
pub const PAGE_RECORD: usize = RECORD_HEADER + PAGE_SIZE;
/// Journals smaller than this are never compacted: compaction copies live pages, and
/// for a few thousand pages the copy would cost more than the space it frees. (64 KiB in
/// this crate's own tests, so that they compact often.)
pub const COMPACT_FLOOR: u64 = if cfg!(test) { 64 << 10 } else { 16 << 20 };

/// What a record says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Record<'a> {
    /// `key` holds these bytes.
    Page(PageKey, &'a [u8]),
    /// `key` holds a page whose every 8-byte word is this one.
    Fill(PageKey, u64),
    /// `key` holds nothing.
    Gone(PageKey),
    /// No page of this object is held.
    ObjectGone(PoolId, u64),
    /// No page of this pool is held.
    PoolGone(PoolId),
}

impl<'a> Record<'a> {
    fn kind(&self) -> u8 {
        match self {
            Record::Page(..) => 1,
            Record::Fill(..) => 2,
            Record::Gone(_) => 3,
            Record::ObjectGone(..) => 4,
            Record::PoolGone(_) => 5,
        }
    }

    /// The record's header (checksum included) and its payload. `page_crc`, when the
    /// caller knows it, is the CRC-32C of a page record's bytes (every put computes it for
    /// the store): the record's checksum is then combined from it rather than computed
    /// over the page again.
    pub(crate) fn encode<'b>(
        self,
        fill: &'b mut [u8; 8],
        page_crc: Option<u32>,
    ) -> ([u8; RECORD_HEADER], &'b [u8])
    where
        'a: 'b,
    {
        let (pool, object, index) = match self {
            Record::Page(key, _) | Record::Fill(key, _) | Record::Gone(key) => {
                (key.pool, key.object, key.index)
            }
            Record::ObjectGone(pool, object) => (pool, object, 0),
            Record::PoolGone(pool) => (pool, 0, 0),
        };
        let payload: &[u8] = match self {
            Record::Page(_, page) => page,
            Record::Fill(_, word) => {
                *fill = word.to_le_bytes();
                &fill[..]
            }
            _ => &[],
        };
        let mut header = [0u8; RECORD_HEADER];
        header[4] = self.kind();
        header[8..12].copy_from_slice(&pool.0.to_le_bytes());
        header[12..20].copy_from_slice(&object.to_le_bytes());
        header[20..28].copy_from_slice(&index.to_le_bytes());
        let head = crc32c::crc32c(&header[4..]);
        let crc = match (self, page_crc) {
            (Record::Page(..), Some(page)) => after_a_page(head) ^ page,
            _ => crc32c::crc32c_append(head, payload),
        };
        header[..4].copy_from_slice(&crc.to_le_bytes());
        (header, payload)
    }

    /// The record at the start of `bytes` and its length; `None` when it is cut short or
    /// fails its checksum (the torn end of a journal whose writer died mid-append), or is
    /// of no known kind.
    pub(crate) fn decode(bytes: &[u8]) -> Option<(Record<'_>, usize)> {
        let header = bytes.get(..RECORD_HEADER)?;
        let u64_at = |at: usize| {
            u64::from_le_bytes(header[at..at + 8].try_into().expect("8 bytes of the header"))
        };
        let pool = PoolId(u32::from_le_bytes(header[8..12].try_into().expect("4 bytes")));
        let (object, index) = (u64_at(12), u64_at(20));
        let payload_len = match header[4] {
            1 => PAGE_SIZE,
            2 => 8,
            3..=5 => 0,
            _ => return None,
        };
        let payload = bytes.get(RECORD_HEADER..RECORD_HEADER + payload_len)?;
        let stored = u32::from_le_bytes(header[..4].try_into().expect("4 bytes"));
        if crc32c::crc32c_append(crc32c::crc32c(&header[4..]), payload) != stored {
            return None;
        }
        let key = PageKey::new(pool, object, index);
        let record = match header[4] {
            1 => Record::Page(key, payload),
            2 => Record::Fill(key, u64::from_le_bytes(payload.try_into().expect("8 bytes"))),
            3 => Record::Gone(key),
            4 => Record::ObjectGone(pool, object),
            _ => Record::PoolGone(pool),
        };
        Some((record, RECORD_HEADER + payload_len))
    }
}

/// The CRC-32C of some bytes followed by a page, from the CRC-32C of those bytes (`crc`):
/// `after_a_page(crc) ^ crc32c(page)` is the CRC-32C of the two. A CRC is linear over
/// GF(2), so shifting it past 4096 bytes is a 32 × 32 bit matrix, made once from the
/// crate's general (and far slower) `crc32c_combine`: 32 conditional XORs a record.
fn after_a_page(crc: u32) -> u32 {
    static SHIFT: std::sync::OnceLock<[u32; 32]> = std::sync::OnceLock::new();
    let shift = SHIFT
        .get_or_init(|| std::array::from_fn(|bit| crc32c::crc32c_combine(1 << bit, 0, PAGE_SIZE)));
    (0..32).filter(|bit| crc >> bit & 1 == 1).fold(0, |acc, bit| acc ^ shift[bit])
}

/// One shard's journal file, appended to under the shard's lock.
///
/// Appends are copies into a shared mapping of the file, not `write` calls: a record
/// written to a tmpfs page through the mapping is in the page cache, and outlives the
/// process, as soon as the copy ends, and a copy costs a fraction of a `writev` of the
/// same 4 KiB (which takes the page's lock, looks it up and marks it dirty every time).
/// The file is allocated ahead of the appends ([`RESERVE_STEP`] at a time, `fallocate`),
/// so a copy never touches a page the tmpfs has not given: a full tmpfs fails the
/// `fallocate`, where a copy into an unallocated page would kill the process (SIGBUS).
/// The allocated part past the last record is zeros, which a replay reads as the end.
pub(crate) struct Journal {
    file: File,
    path: PathBuf,
    /// The file, mapped shared over [`MAP_BYTES`] (most of it past the file's end, never
    /// touched there).
    map: MmapRaw,
    /// Bytes of records (and the header).
    len: u64,
    /// The file's size: allocated and mapped up to here.
    reserved: u64,
    /// Persistent pages the shard's index holds, as the records count them: what a
    /// compaction would keep (pages dropped as unreadable still count until then).
    live: u64,
    /// An append failed: the file was emptied and the shard journals no more.
    failed: bool,
    /// No compaction before the file passes this size (after one failed).
    compact_after: u64,
}

impl std::fmt::Debug for Journal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Journal")
            .field("path", &self.path)
            .field("len", &self.len)
            .field("live", &self.live)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

/// How far a journal file grows at a time: allocated in bulk by one `fallocate`, which
/// costs the kernel less than a page at a time.
const RESERVE_STEP: u64 = 4 << 20;

/// The address space each journal maps: more than a shard's file can reach (a shard
/// indexes at most 64 GiB of pages, and compacts at twice that), and only address space:
/// the pages are the file's.
const MAP_BYTES: usize = 1 << 38;

/// What appending did to the journal's size.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Appended {
    /// Bytes added (negative after a failure emptied the file).
    pub bytes: i64,
    /// The append failed now (and the journal stopped).
    pub failed: bool,
}

impl Journal {
    /// A new, empty journal at `path` (replacing any file there).
    pub(crate) fn create(path: PathBuf) -> io::Result<Self> {
        let mut file = create_file(&path)?;
        write_header(&mut file)?;
        Self::adopt(file, path, FILE_HEADER as u64, 0)
    }

    /// A journal over `file`, which holds `len` bytes of records (`live` of them pages).
    fn adopt(file: File, path: PathBuf, len: u64, live: u64) -> io::Result<Self> {
        let map = memmap2::MmapOptions::new().len(MAP_BYTES).map_raw(&file)?;
        Ok(Self { file, path, map, len, reserved: len, live, failed: false, compact_after: 0 })
    }

    /// The file's size.
    pub(crate) fn len(&self) -> u64 {
        self.len
    }

    /// True when the file holds more than twice what its live pages need, and is past
    /// [`COMPACT_FLOOR`].
    pub(crate) fn wants_compaction(&self) -> bool {
        !self.failed
            && self.len > self.compact_after
            && self.len > COMPACT_FLOOR.max(self.live * 2 * PAGE_RECORD as u64)
    }

    /// After a failed compaction: the next waits until the file has grown by half.
    pub(crate) fn postpone_compaction(&mut self) {
        self.compact_after = self.len + self.len / 2;
    }

    /// Appends `record`; `live_change` is what it does to the shard's count of persistent
    /// pages. An append that fails (a full tmpfs) empties the file and stops this journal:
    /// after a crash the shard's persistent pages are then lost rather than some of them
    /// replayed older than what the node served. The failure is logged once.
    /// `page_crc` is the CRC-32C of a page record's bytes, when known ([`Record::encode`]).
    pub(crate) fn append(
        &mut self,
        record: Record<'_>,
        live_change: i64,
        page_crc: Option<u32>,
    ) -> Appended {
        if self.failed {
            return Appended::default();
        }
        let mut fill = [0u8; 8];
        let (header, payload) = record.encode(&mut fill, page_crc);
        let written = (RECORD_HEADER + payload.len()) as u64;
        if self.len + written > self.reserved {
            if let Err(err) = self.grow(self.len + written) {
                let before = self.len as i64;
                self.stop(&err);
                return Appended { bytes: -before, failed: true };
            }
        }
        let at = self.len as usize;
        // SAFETY: `at + written` is within the file's allocated size (`reserved`, checked
        // above), so every byte written is a tmpfs page the file owns, inside the mapping
        // (`grow` keeps `reserved` under `MAP_BYTES`). Only this journal writes the file,
        // under its shard's lock (`&mut self`), and nothing reads the mapping meanwhile.
        unsafe {
            let dst = self.map.as_mut_ptr().add(at);
            dst.copy_from_nonoverlapping(header.as_ptr(), header.len());
            dst.add(header.len()).copy_from_nonoverlapping(payload.as_ptr(), payload.len());
        }
        self.len += written;
        self.live = self.live.saturating_add_signed(live_change);
        Appended { bytes: written as i64, failed: false }
    }

    /// Grows the file, allocated, to hold `need` bytes (rounded up to [`RESERVE_STEP`]).
    fn grow(&mut self, need: u64) -> io::Result<()> {
        use rustix::fs::{fallocate, FallocateFlags};
        let size = need.next_multiple_of(RESERVE_STEP);
        if size > MAP_BYTES as u64 {
            return Err(io::Error::other("the journal file reached the most it may map"));
        }
        fallocate(&self.file, FallocateFlags::empty(), self.reserved, size - self.reserved)?;
        // The page tables of the new part in one call, rather than a fault at each page's
        // first copy. Best effort: an older kernel faults them in one by one.
        let _ = self.map.advise_range(
            memmap2::Advice::PopulateWrite,
            self.reserved as usize,
            (size - self.reserved) as usize,
        );
        self.reserved = size;
        Ok(())
    }

    /// Empties the file and stops journaling: see [`Journal::append`].
    fn stop(&mut self, err: &io::Error) {
        self.failed = true;
        // Emptied, or else removed: records left behind would replay pages older than what
        // the shard serves from now on.
        let emptied = self.file.set_len(0).or_else(|_| std::fs::remove_file(&self.path));
        self.len = 0;
        self.reserved = 0;
        tracing::error!(
            journal = %self.path.display(),
            %err,
            emptied = emptied.is_ok(),
            "a persistent page could not be journaled: this shard's persistent pages will \
             not survive a crash of this node (a clean stop still keeps them)"
        );
    }

    /// Replaces the file with `compacted`, which holds `live` page records written by
    /// a compaction at `tmp`; `tmp` is renamed over the journal's path.
    pub(crate) fn replace(&mut self, compacted: File, tmp: &Path, live: u64) -> io::Result<()> {
        let len = compacted.metadata()?.len();
        let adopted = Self::adopt(compacted, self.path.clone(), len, live)?;
        std::fs::rename(tmp, &self.path)?;
        *self = adopted;
        Ok(())
    }

    /// Where a compaction writes the new file before renaming it.
    pub(crate) fn compaction_path(&self) -> PathBuf {
        self.path.with_extension("compacting")
    }
}

/// Creates (or empties) a journal file at `path`, open for reading too: a shared
/// writable mapping needs both.
pub(crate) fn create_file(path: &Path) -> io::Result<File> {
    File::options().read(true).write(true).create(true).truncate(true).open(path)
}

/// The file name of shard `shard`'s journal.
pub(crate) fn shard_file(dir: &Path, shard: usize) -> PathBuf {
    dir.join(format!("shard-{shard:04}"))
}

/// Writes a journal file's header and then `records` to `out`: a compaction's new file.
pub(crate) fn write_header(out: &mut impl Write) -> io::Result<()> {
    out.write_all(MAGIC)?;
    out.write_all(&[0u8; FILE_HEADER - MAGIC.len()])
}

/// Writes one record to `out` (a compaction's buffered file); `page_crc` as for
/// [`Record::encode`].
pub(crate) fn write_record(
    out: &mut impl Write,
    record: Record<'_>,
    page_crc: Option<u32>,
) -> io::Result<()> {
    let mut fill = [0u8; 8];
    let (header, payload) = record.encode(&mut fill, page_crc);
    out.write_all(&header)?;
    out.write_all(payload)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> PageKey {
        PageKey::new(PoolId(3), 0x0102_0304_0506_0708, 9)
    }

    /// The record layout, byte for byte: a change here breaks the journals a running
    /// version leaves for the next start.
    #[test]
    fn golden_bytes_of_each_record_kind() {
        let mut fill = [0u8; 8];
        let (header, payload) = Record::Fill(key(), 0xaabb_ccdd_eeff_0011).encode(&mut fill, None);
        assert_eq!(
            header[4..],
            [
                2, 0, 0, 0, // kind, padding
                3, 0, 0, 0, // pool
                8, 7, 6, 5, 4, 3, 2, 1, // object
                9, 0, 0, 0, 0, 0, 0, 0, // index
            ]
        );
        assert_eq!(payload, [0x11, 0, 0xff, 0xee, 0xdd, 0xcc, 0xbb, 0xaa]);
        let crc = crc32c::crc32c_append(crc32c::crc32c(&header[4..]), payload);
        assert_eq!(header[..4], crc.to_le_bytes());
        let (header, payload) = Record::PoolGone(PoolId(7)).encode(&mut fill, None);
        assert_eq!(header[4..12], [5, 0, 0, 0, 7, 0, 0, 0]);
        assert_eq!(header[12..], [0; 16]);
        assert!(payload.is_empty());
        assert_eq!(Record::ObjectGone(PoolId(1), 2).encode(&mut fill, None).0[4], 4);
        assert_eq!(Record::Gone(key()).encode(&mut fill, None).0[4], 3);
        let page = vec![5u8; PAGE_SIZE];
        let (header, payload) = Record::Page(key(), &page).encode(&mut fill, None);
        assert_eq!((header[4], payload.len()), (1, PAGE_SIZE));
    }

    #[test]
    fn a_page_records_checksum_combined_from_the_pages_crc_is_the_one_computed() {
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i * 29 + 3) as u8).collect();
        let mut fill = [0u8; 8];
        let computed = Record::Page(key(), &page).encode(&mut fill, None).0;
        let combined = Record::Page(key(), &page).encode(&mut fill, Some(crc32c::crc32c(&page))).0;
        assert_eq!(computed, combined);
    }

    #[test]
    fn every_kind_round_trips_and_any_flipped_bit_is_refused() {
        let page: Vec<u8> = (0..PAGE_SIZE).map(|i| (i * 13) as u8).collect();
        let records = [
            Record::Page(key(), &page),
            Record::Fill(key(), u64::MAX),
            Record::Gone(key()),
            Record::ObjectGone(PoolId(4), 5),
            Record::PoolGone(PoolId(6)),
        ];
        for record in records {
            let mut bytes = Vec::new();
            write_record(&mut bytes, record, None).unwrap();
            assert_eq!(Record::decode(&bytes), Some((record, bytes.len())));
            assert_eq!(Record::decode(&bytes[..bytes.len() - 1]), None, "cut short");
            for bit in [0, 37, 8 * bytes.len() - 1] {
                let mut bad = bytes.clone();
                bad[bit / 8] ^= 1 << (bit % 8);
                assert_eq!(Record::decode(&bad), None, "{record:?} with bit {bit} flipped");
            }
        }
    }

    #[test]
    fn a_failed_append_empties_the_file_and_stops_the_journal() {
        let dir = std::env::temp_dir().join(format!("fallow-journal-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("shard-0000");
        let mut journal = Journal::create(path.clone()).unwrap();
        let appended = journal.append(Record::Gone(key()), 0, None);
        assert_eq!(appended.bytes, RECORD_HEADER as i64);
        // A read-only handle in place of the file, and no room left: growing it fails.
        journal.file = File::open(&path).unwrap();
        journal.reserved = journal.len;
        let appended = journal.append(Record::Fill(key(), 1), 1, None);
        assert!(appended.failed && journal.failed);
        assert_eq!(appended.bytes, -((FILE_HEADER + RECORD_HEADER) as i64));
        assert_eq!(journal.append(Record::Gone(key()), 0, None).bytes, 0, "stopped");
        let left = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        assert_eq!(left, 0, "no record is left to replay");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
