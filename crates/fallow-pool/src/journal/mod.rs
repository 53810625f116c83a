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
use std::io::{self, IoSlice, Write};
use std::path::{Path, PathBuf};

use fallow_core::{PageKey, PoolId, PAGE_SIZE};

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

    /// The record's header (checksum included) and its payload.
    pub(crate) fn encode<'b>(self, fill: &'b mut [u8; 8]) -> ([u8; RECORD_HEADER], &'b [u8])
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
        let crc = crc32c::crc32c_append(crc32c::crc32c(&header[4..]), payload);
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

/// One shard's journal file, appended to under the shard's lock.
#[derive(Debug)]
pub(crate) struct Journal {
    file: File,
    path: PathBuf,
    /// Bytes in the file.
    len: u64,
    /// Persistent pages the shard's index holds, as the records count them: what a
    /// compaction would keep (pages dropped as unreadable still count until then).
    live: u64,
    /// An append failed: the file was emptied and the shard journals no more.
    failed: bool,
    /// No compaction before the file passes this size (after one failed).
    compact_after: u64,
    /// The file's memory is allocated up to here ([`RESERVE_STEP`]).
    reserved: u64,
}

/// Memory a journal file takes from its tmpfs ahead of its appends, a step at a time
/// (`fallocate`, the file's size unchanged): allocating a page costs the kernel more
/// than copying into it, and costs it less in bulk than one page per `writev`.
const RESERVE_STEP: u64 = 4 << 20;

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
        let mut file = File::create(&path)?;
        file.write_all(MAGIC)?;
        file.write_all(&[0u8; FILE_HEADER - MAGIC.len()])?;
        let len = FILE_HEADER as u64;
        Ok(Self { file, path, len, live: 0, failed: false, compact_after: 0, reserved: len })
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
    /// pages. A write that fails (a full tmpfs) empties the file and stops this journal:
    /// after a crash the shard's persistent pages are then lost rather than some of them
    /// replayed older than what the node served. The failure is logged once.
    pub(crate) fn append(&mut self, record: Record<'_>, live_change: i64) -> Appended {
        if self.failed {
            return Appended::default();
        }
        let mut fill = [0u8; 8];
        let (header, payload) = record.encode(&mut fill);
        let written = RECORD_HEADER + payload.len();
        if self.len + written as u64 > self.reserved {
            self.reserve();
        }
        match write_all_vectored(
            &mut self.file,
            &mut [IoSlice::new(&header), IoSlice::new(payload)],
        ) {
            Ok(()) => {
                self.len += written as u64;
                self.live = self.live.saturating_add_signed(live_change);
                Appended { bytes: written as i64, failed: false }
            }
            Err(err) => {
                let before = self.len as i64;
                self.stop(&err);
                Appended { bytes: -before, failed: true }
            }
        }
    }

    /// Allocates the file's next [`RESERVE_STEP`]. Best effort: where it fails (a full
    /// tmpfs, a file system without `fallocate`), the append that follows allocates its
    /// own pages, or fails itself.
    fn reserve(&mut self) {
        use rustix::fs::{fallocate, FallocateFlags};
        let at = self.reserved.max(self.len);
        // Tried again a step later either way, not at every append.
        let _ = fallocate(&self.file, FallocateFlags::KEEP_SIZE, at, RESERVE_STEP);
        self.reserved = at + RESERVE_STEP;
    }

    /// Empties the file and stops journaling: see [`Journal::append`].
    fn stop(&mut self, err: &io::Error) {
        self.failed = true;
        // Emptied, or else removed: records left behind would replay pages older than what
        // the shard serves from now on.
        let emptied = self.file.set_len(0).or_else(|_| std::fs::remove_file(&self.path));
        self.len = 0;
        tracing::error!(
            journal = %self.path.display(),
            %err,
            emptied = emptied.is_ok(),
            "a persistent page could not be journaled: this shard's persistent pages will \
             not survive a crash of this node (a clean stop still keeps them)"
        );
    }

    /// Replaces the file with `compacted`, which holds `live` page records written by
    /// [`write_compacted`] at `tmp`; `tmp` is renamed over the journal's path.
    pub(crate) fn replace(&mut self, compacted: File, tmp: &Path, live: u64) -> io::Result<()> {
        let len = compacted.metadata()?.len();
        std::fs::rename(tmp, &self.path)?;
        self.file = compacted;
        self.len = len;
        self.live = live;
        self.compact_after = 0;
        self.reserved = len;
        Ok(())
    }

    /// Where a compaction writes the new file before renaming it.
    pub(crate) fn compaction_path(&self) -> PathBuf {
        self.path.with_extension("compacting")
    }
}

/// Writes every byte of `slices`, in as few `writev` calls as the kernel allows.
fn write_all_vectored(file: &mut File, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        match file.write_vectored(slices) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(err) if err.kind() == io::ErrorKind::Interrupted => {}
            Err(err) => return Err(err),
        }
    }
    Ok(())
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

/// Writes one record to `out` (a compaction's buffered file).
pub(crate) fn write_record(out: &mut impl Write, record: Record<'_>) -> io::Result<()> {
    let mut fill = [0u8; 8];
    let (header, payload) = record.encode(&mut fill);
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
        let (header, payload) = Record::Fill(key(), 0xaabb_ccdd_eeff_0011).encode(&mut fill);
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
        let (header, payload) = Record::PoolGone(PoolId(7)).encode(&mut fill);
        assert_eq!(header[4..12], [5, 0, 0, 0, 7, 0, 0, 0]);
        assert_eq!(header[12..], [0; 16]);
        assert!(payload.is_empty());
        assert_eq!(Record::ObjectGone(PoolId(1), 2).encode(&mut fill).0[4], 4);
        assert_eq!(Record::Gone(key()).encode(&mut fill).0[4], 3);
        let page = vec![5u8; PAGE_SIZE];
        let (header, payload) = Record::Page(key(), &page).encode(&mut fill);
        assert_eq!((header[4], payload.len()), (1, PAGE_SIZE));
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
            write_record(&mut bytes, record).unwrap();
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
        let appended = journal.append(Record::Gone(key()), 0);
        assert_eq!(appended.bytes, RECORD_HEADER as i64);
        // A read-only handle in place of the file: every write fails.
        journal.file = File::open(&path).unwrap();
        let appended = journal.append(Record::Fill(key(), 1), 1);
        assert!(appended.failed && journal.failed);
        assert_eq!(appended.bytes, -((FILE_HEADER + RECORD_HEADER) as i64));
        assert_eq!(journal.append(Record::Gone(key()), 0).bytes, 0, "stopped");
        let left = std::fs::metadata(&path).map(|m| m.len()).unwrap_or(0);
        assert_eq!(left, 0, "no record is left to replay");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
