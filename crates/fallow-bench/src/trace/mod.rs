//! Streaming readers of real block and page traces, for measuring the page pool's hit ratio on
//! workloads nobody on this team wrote (`shared/traces/README.md` lists the ones we keep).
//!
//! [`open`] picks a parser by [`TraceFormat`] and a decompressor by file suffix (`.gz`, `.xz`,
//! `.zst`, `.bz2`), and returns a [`TraceReader`]: an iterator of [`PageAccess`]es that reads
//! the file as it goes, so a trace of any length replays in constant memory.
//!
//! # Semantics
//!
//! * **Pages.** A block request covering bytes `[off, off+len)` is one access to every 4 KiB
//!   page it overlaps: pages `off/4096 ..= (off+max(len,1)-1)/4096`, in ascending order. A
//!   zero-length request therefore still touches the page its offset falls in.
//! * **Writes** are accesses (write-allocate), unless [`TraceOptions::reads_only`] is set, which
//!   drops them. Formats that record no operation (arc, lirs, lirs2) are all reads.
//! * **Volumes.** Formats with several volumes (tencent, msr, systor) fold the volume into the
//!   page key: `(volume << 40) | page`, see [`VOLUME_SHIFT`]. This is exact, not a hash: keys of
//!   distinct volumes never collide, as long as each volume number fits in 24 bits and each
//!   page number in 40 bits (4 PiB per volume); a record outside those bounds is an error.
//!   Single-volume formats (vscsi, arc, lirs, lirs2) use the page number as it is.
//! * **Errors.** Malformed input yields one [`TraceError`] that names the file, the 1-based line
//!   (text formats) or record (binary formats), and what was wrong; the reader ends after it.
//!   No input makes a parser panic, allocate without bound, or loop without reading: lines are
//!   at most [`MAX_LINE_BYTES`] long and one request at most [`MAX_REQUEST_BYTES`].
//!
//! # Components
//!
//! | format | file | what one record is |
//! |---|---|---|
//! | [`TraceFormat::Vscsi`] | `vscsi.rs` | VMware vscsi v1 (32 B) or v2 (40 B) binary record |
//! | [`TraceFormat::Arc`] | `arc.rs` | ARC `.lis` line: `start_block n_blocks ignored req_no` |
//! | [`TraceFormat::Lirs`] | `lirs.rs` | a page number per line, `*` lines skipped |
//! | [`TraceFormat::Lirs2`] | `lirs2.rs` | a little-endian `u32` page number |
//! | [`TraceFormat::Tencent`] | `tencent.rs` | Tencent CBS CSV line, 512 B sectors |
//! | [`TraceFormat::Msr`] | `msr.rs` | MSR Cambridge CSV line, bytes |
//! | [`TraceFormat::Systor`] | `systor.rs` | SYSTOR'17 CSV line, bytes |
//!
//! `decompress.rs` maps a suffix to a streaming decoder; `lines.rs` holds the bounded line
//! reader and field helpers the text formats share.

mod arc;
mod decompress;
mod lines;
mod lirs;
mod lirs2;
mod msr;
mod systor;
mod tencent;
mod vscsi;

use std::collections::HashSet;
use std::fmt;
use std::io::{self, BufRead, Read};
use std::iter::FusedIterator;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// The page size every trace is cut into, in bytes.
pub const PAGE_SIZE: u64 = 4096;

/// The largest request a trace may contain, in bytes (1 GiB, 262,144 pages). A larger length is
/// treated as corruption rather than replayed as hundreds of thousands of accesses.
pub const MAX_REQUEST_BYTES: u64 = 1 << 30;

/// The longest line a text trace may contain, in bytes, not counting the line terminator. It
/// bounds the memory a binary file passed as text can make the reader allocate.
pub const MAX_LINE_BYTES: usize = 64 * 1024;

/// Where the volume goes in a page key of a multi-volume format: `(volume << 40) | page`.
pub const VOLUME_SHIFT: u32 = 40;

/// The largest volume number a multi-volume format may use: 24 bits.
pub const MAX_VOLUME: u64 = (1 << (64 - VOLUME_SHIFT)) - 1;

/// The largest page number within one volume of a multi-volume format: 40 bits (4 PiB).
pub const MAX_VOLUME_PAGE: u64 = (1 << VOLUME_SHIFT) - 1;

/// The layout of a trace file. Names (for [`FromStr`] and [`Display`](fmt::Display)) are the
/// lowercase variant names: `vscsi`, `arc`, `lirs`, `lirs2`, `tencent`, `msr`, `systor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TraceFormat {
    /// VMware vscsi binary trace, v1 (32 B records) or v2 (40 B records), told apart by the
    /// version field of the first record. Sectors are 512 B.
    Vscsi,
    /// ARC paper `.lis` text: `start_block n_blocks ignored req_no` per line, with
    /// [`TraceOptions::block_size`]-byte blocks (512 B unless set).
    Arc,
    /// LIRS paper text: one page number per line; lines containing `*` are skipped.
    Lirs,
    /// Binary LIRS-style trace: little-endian `u32` page numbers.
    Lirs2,
    /// Tencent CBS CSV: `timestamp_s,offset_sectors,size_sectors,io_type,volume_id`.
    Tencent,
    /// MSR Cambridge CSV: `filetime,host,disk,Read|Write,offset,size,response`.
    Msr,
    /// SYSTOR'17 CSV: `Timestamp,Response,IOType,LUN,Offset,Size`, with a header line.
    Systor,
}

impl TraceFormat {
    /// Every format, in the order of the variants.
    pub const ALL: [TraceFormat; 7] = [
        TraceFormat::Vscsi,
        TraceFormat::Arc,
        TraceFormat::Lirs,
        TraceFormat::Lirs2,
        TraceFormat::Tencent,
        TraceFormat::Msr,
        TraceFormat::Systor,
    ];

    /// The format's name, as [`FromStr`] accepts it.
    pub fn name(self) -> &'static str {
        match self {
            TraceFormat::Vscsi => "vscsi",
            TraceFormat::Arc => "arc",
            TraceFormat::Lirs => "lirs",
            TraceFormat::Lirs2 => "lirs2",
            TraceFormat::Tencent => "tencent",
            TraceFormat::Msr => "msr",
            TraceFormat::Systor => "systor",
        }
    }
}

impl fmt::Display for TraceFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TraceFormat {
    type Err = TraceError;

    /// Parses a format name, ignoring ASCII case.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        TraceFormat::ALL
            .into_iter()
            .find(|f| f.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| TraceError::UnknownFormat(s.to_owned()))
    }
}

/// How to read a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceOptions {
    /// The file's layout.
    pub format: TraceFormat,
    /// Bytes per block, for [`TraceFormat::Arc`] only (default 512). `Some(4096)` makes each
    /// block one page, which is what the OLTP trace needs. Setting it for another format, or
    /// to 0, is an error.
    pub block_size: Option<u32>,
    /// Drop writes and replay reads only.
    pub reads_only: bool,
}

impl TraceOptions {
    /// Options for `format` with the defaults: the format's own block size, reads and writes.
    pub fn new(format: TraceFormat) -> Self {
        TraceOptions { format, block_size: None, reads_only: false }
    }
}

/// One access to one 4 KiB page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct PageAccess {
    /// The page key: the page number, with the volume folded in for multi-volume formats
    /// (`(volume << 40) | page`, see the module docs).
    pub page: u64,
    /// The request that touched the page was a write.
    pub write: bool,
}

/// What [`count_distinct`] found in a trace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TraceSummary {
    /// Page accesses, after splitting requests into pages and dropping writes if asked to.
    pub accesses: u64,
    /// Distinct page keys among those accesses: the working set a cache size is a share of.
    pub distinct_pages: u64,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// A format name that no [`TraceFormat`] has.
    #[error(
        "unknown trace format `{0}` (expected one of vscsi, arc, lirs, lirs2, tencent, msr, systor)"
    )]
    UnknownFormat(String),
    /// [`TraceOptions`] that make no sense for the format, such as a block size for lirs.
    #[error("{format} traces: {what}")]
    InvalidOptions {
        /// The format the options were given for.
        format: TraceFormat,
        /// What is wrong with them.
        what: String,
    },
    /// The file could not be opened.
    #[error("{}: cannot open: {source}", path.display())]
    Open {
        /// The trace file.
        path: PathBuf,
        /// The operating system's reason.
        source: io::Error,
    },
    /// Reading or decompressing the file failed (includes corrupt compressed data).
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        /// The trace file.
        path: PathBuf,
        /// The reason, from the file system or the decompressor.
        source: io::Error,
    },
    /// A line of a text trace is malformed.
    #[error("{}:{line}: {what}", path.display())]
    Line {
        /// The trace file.
        path: PathBuf,
        /// The 1-based line number.
        line: u64,
        /// What is wrong with the line.
        what: String,
    },
    /// A record of a binary trace is malformed or truncated.
    #[error("{}: record {record}: {what}", path.display())]
    Record {
        /// The trace file.
        path: PathBuf,
        /// The 1-based record number.
        record: u64,
        /// What is wrong with the record.
        what: String,
    },
}

/// Opens the trace at `path`, decompressing it on the fly if its name ends in `.gz`, `.xz`,
/// `.zst` or `.bz2`. Nothing is parsed yet: errors in the contents come from the iterator.
pub fn open(path: &Path, opts: &TraceOptions) -> Result<TraceReader, TraceError> {
    let input = decompress::open(path)?;
    TraceReader::from_reader(path, input, opts)
}

/// Reads the whole trace at `path` and counts its page accesses and distinct pages, to size
/// caches as a share of the working set. Memory grows with the number of distinct pages.
pub fn count_distinct(path: &Path, opts: &TraceOptions) -> Result<TraceSummary, TraceError> {
    let mut seen = HashSet::new();
    let mut accesses = 0u64;
    for access in open(path, opts)? {
        seen.insert(access?.page);
        accesses += 1;
    }
    Ok(TraceSummary { accesses, distinct_pages: seen.len() as u64 })
}

/// An iterator of the page accesses in one trace, read as it goes.
///
/// It yields `Ok` accesses until the input ends, or one `Err` at the first malformed record,
/// after which it yields nothing more.
pub struct TraceReader {
    /// The format's parser; yields whole requests.
    parser: Box<dyn Parse>,
    /// The rest of the request being split into pages: `first..=last` are still to come.
    pending: Option<Request>,
    /// Drop write requests.
    reads_only: bool,
    /// The parser reported the end of input or an error; it is not called again.
    done: bool,
}

impl TraceReader {
    /// Reads a trace from `input`, which must already be decompressed. `name` is only used in
    /// error messages, as the file name.
    pub fn from_reader(
        name: impl Into<PathBuf>,
        input: impl BufRead + Send + 'static,
        opts: &TraceOptions,
    ) -> Result<TraceReader, TraceError> {
        let path = name.into();
        let input: Box<dyn BufRead + Send> = Box::new(input);
        let format = opts.format;
        let block_size = match (format, opts.block_size) {
            (_, Some(0)) => {
                return Err(TraceError::InvalidOptions {
                    format,
                    what: "the block size must be at least 1 byte".to_owned(),
                })
            }
            (TraceFormat::Arc, size) => size.unwrap_or(arc::DEFAULT_BLOCK_SIZE),
            (_, None) => 0,
            (_, Some(_)) => {
                return Err(TraceError::InvalidOptions {
                    format,
                    what: "a block size applies to arc traces only".to_owned(),
                })
            }
        };
        let parser: Box<dyn Parse> = match format {
            TraceFormat::Vscsi => Box::new(vscsi::Vscsi::new(path, input)),
            TraceFormat::Arc => Box::new(arc::Arc::new(path, input, block_size)),
            TraceFormat::Lirs => Box::new(lirs::Lirs::new(path, input)),
            TraceFormat::Lirs2 => Box::new(lirs2::Lirs2::new(path, input)),
            TraceFormat::Tencent => Box::new(tencent::Tencent::new(path, input)),
            TraceFormat::Msr => Box::new(msr::Msr::new(path, input)),
            TraceFormat::Systor => Box::new(systor::Systor::new(path, input)),
        };
        Ok(TraceReader { parser, pending: None, reads_only: opts.reads_only, done: false })
    }
}

impl Iterator for TraceReader {
    type Item = Result<PageAccess, TraceError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if let Some(req) = &mut self.pending {
                let access = PageAccess { page: req.first, write: req.write };
                if req.first < req.last {
                    req.first += 1;
                } else {
                    self.pending = None;
                }
                return Some(Ok(access));
            }
            if self.done {
                return None;
            }
            match self.parser.next_request() {
                Ok(Some(req)) if self.reads_only && req.write => {}
                Ok(Some(req)) => self.pending = Some(req),
                Ok(None) => {
                    self.done = true;
                    return None;
                }
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
    }
}

impl FusedIterator for TraceReader {}

impl fmt::Debug for TraceReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TraceReader")
            .field("pending", &self.pending)
            .field("reads_only", &self.reads_only)
            .field("done", &self.done)
            .finish_non_exhaustive()
    }
}

/// A format's parser: turns its input into whole requests, one record at a time.
trait Parse: Send {
    /// The next request, or `Ok(None)` at the end of the input. After an `Err` the caller
    /// does not call again.
    fn next_request(&mut self) -> Result<Option<Request>, TraceError>;
}

/// One request, already cut into its page range `first..=last` (page keys, volume folded in).
/// Invariant: `first <= last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Request {
    first: u64,
    last: u64,
    write: bool,
}

impl Request {
    /// The request for bytes `[offset, offset+len)`. `Err` says why it cannot be one.
    fn bytes(offset: u64, len: u64, write: bool) -> Result<Request, String> {
        if len > MAX_REQUEST_BYTES {
            return Err(format!(
                "request of {len} bytes is larger than the {MAX_REQUEST_BYTES}-byte limit"
            ));
        }
        // `len.max(1)`: a zero-length request still touches the page its offset is in.
        let end = offset
            .checked_add(len.max(1) - 1)
            .ok_or_else(|| format!("request of {len} bytes at byte {offset} ends past 2^64"))?;
        Ok(Request { first: offset / PAGE_SIZE, last: end / PAGE_SIZE, write })
    }

    /// A read of one page.
    fn page(page: u64) -> Request {
        Request { first: page, last: page, write: false }
    }

    /// The same request with `volume` folded into its page keys, see [`VOLUME_SHIFT`].
    fn in_volume(self, volume: u64) -> Result<Request, String> {
        if volume > MAX_VOLUME {
            return Err(format!("volume {volume} is larger than the limit of {MAX_VOLUME}"));
        }
        if self.last > MAX_VOLUME_PAGE {
            return Err(format!(
                "page {} is past the 2^40-page (4 PiB) limit of one volume",
                self.last
            ));
        }
        let base = volume << VOLUME_SHIFT;
        Ok(Request { first: base | self.first, last: base | self.last, write: self.write })
    }
}

/// Multiplies a count of `unit`-byte blocks or sectors into bytes; `what` names the field.
fn to_bytes(count: u64, unit: u64, what: &str) -> Result<u64, String> {
    count.checked_mul(unit).ok_or_else(|| format!("{what} {count} × {unit} B overflows 64 bits"))
}

/// Fills `buf` from `input` as far as the input goes, retrying interrupted reads. Returns how
/// many bytes were read: `buf.len()` unless the input ended first.
fn read_full(input: &mut dyn Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while let Some(rest) = buf.get_mut(filled..) {
        if rest.is_empty() {
            break;
        }
        match input.read(rest) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

#[cfg(test)]
pub(crate) mod test_util {
    //! Helpers shared by the format tests.

    use std::io::Cursor;
    use std::path::PathBuf;
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::{PageAccess, TraceError, TraceFormat, TraceOptions, TraceReader};

    /// Every access in `input` read as `opts`, or the first error.
    pub(crate) fn read_all(
        name: &str,
        input: &[u8],
        opts: &TraceOptions,
    ) -> Result<Vec<PageAccess>, TraceError> {
        TraceReader::from_reader(name, Cursor::new(input.to_vec()), opts)?.collect()
    }

    /// The page keys in `input` read as `format` with default options; panics on an error.
    pub(crate) fn pages(format: TraceFormat, input: &[u8]) -> Vec<u64> {
        read_all("t", input, &TraceOptions::new(format))
            .unwrap()
            .into_iter()
            .map(|a| a.page)
            .collect()
    }

    /// The message of the error that reading `input` as `format` ends in; panics if none.
    pub(crate) fn error(format: TraceFormat, name: &str, input: &[u8]) -> String {
        let reader =
            TraceReader::from_reader(name, Cursor::new(input.to_vec()), &TraceOptions::new(format))
                .unwrap();
        let errors: Vec<_> = reader.filter_map(Result::err).collect();
        assert_eq!(errors.len(), 1, "expected exactly one error, got {errors:?}");
        errors[0].to_string()
    }

    /// A path in the temporary directory that no other test (or test process) uses.
    pub(crate) fn temp_path(suffix: &str) -> PathBuf {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        std::env::temp_dir().join(format!("fallow-bench-{}-{n}{suffix}", std::process::id()))
    }
}

#[cfg(test)]
mod tests {
    use super::test_util::{pages, read_all};
    use super::*;

    #[test]
    fn format_names_round_trip() {
        for format in TraceFormat::ALL {
            assert_eq!(format.to_string().parse::<TraceFormat>().unwrap(), format);
        }
        assert_eq!("LIRS2".parse::<TraceFormat>().unwrap(), TraceFormat::Lirs2);
        let err = "csv".parse::<TraceFormat>().unwrap_err().to_string();
        assert!(err.starts_with("unknown trace format `csv`"), "{err}");
    }

    #[test]
    fn aligned_request_touches_its_pages() {
        let r = Request::bytes(8192, 8192, true).unwrap();
        assert_eq!(r, Request { first: 2, last: 3, write: true });
    }

    #[test]
    fn unaligned_request_touches_every_overlapped_page() {
        // Bytes [4095, 4097) straddle pages 0 and 1.
        assert_eq!(Request::bytes(4095, 2, false).unwrap(), Request::page(0).through(1));
        // Bytes [100, 8292) reach one byte into page 2.
        assert_eq!(Request::bytes(100, 8192, false).unwrap(), Request::page(0).through(2));
        // A zero-length request touches the page its offset is in.
        assert_eq!(Request::bytes(4096 * 7 + 5, 0, false).unwrap(), Request::page(7));
    }

    #[test]
    fn oversized_or_overflowing_requests_are_errors() {
        assert!(Request::bytes(0, MAX_REQUEST_BYTES, false).is_ok());
        let err = Request::bytes(0, MAX_REQUEST_BYTES + 1, false).unwrap_err();
        assert!(err.contains("larger than"), "{err}");
        let err = Request::bytes(u64::MAX, 2, false).unwrap_err();
        assert!(err.contains("ends past 2^64"), "{err}");
        assert_eq!(Request::bytes(u64::MAX, 1, false).unwrap().last, u64::MAX / PAGE_SIZE);
    }

    #[test]
    fn volumes_fold_into_distinct_keys() {
        let a = Request::page(5).in_volume(1).unwrap();
        let b = Request::page(5).in_volume(2).unwrap();
        assert_eq!(a.first, (1 << 40) | 5);
        assert_ne!(a.first, b.first);
        assert!(Request::page(MAX_VOLUME_PAGE).in_volume(MAX_VOLUME).is_ok());
        assert!(Request::page(MAX_VOLUME_PAGE + 1).in_volume(0).is_err());
        assert!(Request::page(0).in_volume(MAX_VOLUME + 1).is_err());
    }

    #[test]
    fn reader_splits_requests_in_ascending_order() {
        // MSR offsets and sizes are in bytes: [6144, 6144 + 8192) covers pages 1, 2 and 3.
        let input = b"0,h,0,Read,6144,8192,0\n0,h,0,Write,0,1,0\n";
        let got = read_all("t", input, &TraceOptions::new(TraceFormat::Msr)).unwrap();
        let want = [(1, false), (2, false), (3, false), (0, true)]
            .map(|(page, write)| PageAccess { page, write });
        assert_eq!(got, want);
    }

    #[test]
    fn reads_only_drops_writes() {
        let input = b"0,h,0,Read,0,4096,0\n0,h,0,Write,4096,4096,0\n0,h,0,Read,8192,1,0\n";
        let opts = TraceOptions { reads_only: true, ..TraceOptions::new(TraceFormat::Msr) };
        let got: Vec<_> =
            read_all("t", input, &opts).unwrap().into_iter().map(|a| a.page).collect();
        assert_eq!(got, [0, 2]);
        assert_eq!(pages(TraceFormat::Msr, input), [0, 1, 2]);
    }

    #[test]
    fn block_size_is_for_arc_only_and_nonzero() {
        let opts = TraceOptions { block_size: Some(4096), ..TraceOptions::new(TraceFormat::Lirs) };
        let err = read_all("t", b"1\n", &opts).unwrap_err().to_string();
        assert_eq!(err, "lirs traces: a block size applies to arc traces only");
        let opts = TraceOptions { block_size: Some(0), ..TraceOptions::new(TraceFormat::Arc) };
        assert!(read_all("t", b"1 1 0 0\n", &opts).is_err());
    }

    #[test]
    fn reader_stops_after_the_first_error() {
        let mut reader =
            TraceReader::from_reader("t", &b"1\nx\n2\n"[..], &TraceOptions::new(TraceFormat::Lirs))
                .unwrap();
        assert_eq!(reader.next().unwrap().unwrap().page, 1);
        assert!(reader.next().unwrap().is_err());
        assert!(reader.next().is_none());
        assert!(reader.next().is_none());
    }

    #[test]
    fn count_distinct_counts_accesses_and_pages() {
        let path = test_util::temp_path(".trace");
        std::fs::write(&path, "1\n2\n1\n*\n3\n2\n").unwrap();
        let summary = count_distinct(&path, &TraceOptions::new(TraceFormat::Lirs));
        std::fs::remove_file(&path).unwrap();
        assert_eq!(summary.unwrap(), TraceSummary { accesses: 5, distinct_pages: 3 });
    }

    #[test]
    fn missing_file_names_the_path() {
        let path = test_util::temp_path(".missing");
        let err = open(&path, &TraceOptions::new(TraceFormat::Lirs)).unwrap_err().to_string();
        assert!(err.starts_with(&format!("{}: cannot open:", path.display())), "{err}");
    }

    /// Reads `input` as `format` to the end (or to a generous cap on accesses), checking the
    /// reader's contract on the way: errors end the stream and every access is well formed.
    fn drain(format: TraceFormat, input: &[u8], reads_only: bool) {
        let opts = TraceOptions { reads_only, ..TraceOptions::new(format) };
        let reader = TraceReader::from_reader("fuzz", std::io::Cursor::new(input.to_vec()), &opts);
        let mut reader = reader.unwrap();
        for item in reader.by_ref().take(1 << 20) {
            match item {
                Ok(access) => assert!(!(reads_only && access.write)),
                Err(e) => assert!(!e.to_string().is_empty()),
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn random_bytes_never_panic(input in proptest::collection::vec(proptest::num::u8::ANY, 0..600)) {
            for format in TraceFormat::ALL {
                drain(format, &input, false);
            }
        }

        #[test]
        fn random_trace_like_text_never_panics(
            input in "([0-9*, RWrw.\\-]{0,40}(Read|Write|hm|Timestamp)?[0-9 ,]{0,30}\r?\n){0,12}",
            reads_only in proptest::bool::ANY,
        ) {
            for format in TraceFormat::ALL {
                drain(format, input.as_bytes(), reads_only);
            }
        }

        #[test]
        fn random_vscsi_records_never_panic(
            records in proptest::collection::vec(
                (proptest::num::u32::ANY, 0u16..0x100, proptest::num::u64::ANY), 0..20),
            version in 1u16..=2,
            cut in 0usize..40,
        ) {
            // Records with a valid version, so the parser gets past detection.
            let mut input = Vec::new();
            for (len, cmd, lbn) in records {
                let ver = (version << 8).to_le_bytes();
                if version == 1 {
                    input.extend([0; 4]);
                    input.extend(len.to_le_bytes());
                    input.extend([0; 4]);
                    input.extend(cmd.to_le_bytes());
                    input.extend(ver);
                    input.extend((lbn >> 20).to_le_bytes());
                    input.extend([0; 8]);
                } else {
                    input.extend(cmd.to_le_bytes());
                    input.extend(ver);
                    input.extend([0; 4]);
                    input.extend(len.to_le_bytes());
                    input.extend([0; 4]);
                    input.extend(lbn.to_le_bytes());
                    input.extend([0; 16]);
                }
            }
            input.truncate(input.len().saturating_sub(cut));
            drain(TraceFormat::Vscsi, &input, false);
        }
    }

    impl Request {
        /// This request extended to end at page `last` (tests only).
        fn through(self, last: u64) -> Request {
            Request { last, ..self }
        }
    }
}
