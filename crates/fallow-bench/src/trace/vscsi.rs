//! VMware vscsi traces, as CloudPhysics collected them and libCacheSim reads them: fixed-size
//! little-endian records with no header, in one of two versions.
//!
//! ```text
//! v1, 32 B:  0      4      8       12     14     16          24          32
//!            ├─ sn ─┼─ len ┼─ nSG ─┼ cmd ─┼ ver ─┼─── lbn ───┼─── ts ────┤
//! v2, 40 B:  0      2      4      8       12     16          24          32          40
//!            ├ cmd ─┼ ver ─┼─ sn ─┼─ len ─┼─ nSG ┼─── lbn ───┼─── ts ────┼─── rt ────┤
//! ```
//!
//! `len` is the request length in bytes, `lbn` its first 512 B sector, `cmd` the SCSI
//! opcode, and the high byte of `ver` the version: 0x01 or 0x02. The version is detected from
//! the first record, as libCacheSim does: v2 if its `ver` at byte 2 says 2, else v1 if its
//! `ver` at byte 14 says 1, else the file is not a vscsi trace. Every later record must carry
//! the same version, which catches a misaligned or corrupt file early.
//!
//! READ(6/10/12/16) (0x08, 0x28, 0xa8, 0x88) are reads and WRITE(6/10/12/16) (0x0a, 0x2a,
//! 0xaa, 0x8a) writes. Other commands move no data pages and are skipped.

use std::io::{BufRead, Cursor, Read};
use std::path::PathBuf;

use super::{read_full, to_bytes, Parse, Request, TraceError};

/// Bytes per v1 record.
const V1_LEN: usize = 32;
/// Bytes per v2 record.
const V2_LEN: usize = 40;
/// Bytes per `lbn` sector.
const SECTOR: u64 = 512;

/// Which record layout a file uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Version {
    V1,
    V2,
}

impl Version {
    /// The version number kept in the high byte of the `ver` field.
    fn number(self) -> u16 {
        match self {
            Version::V1 => 1,
            Version::V2 => 2,
        }
    }
}

/// The fields of one record that replay uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    len: u32,
    cmd: u16,
    ver: u16,
    lbn: u64,
}

impl Record {
    fn v1(b: &[u8; V1_LEN]) -> Record {
        Record { len: le_u32(b, 4), cmd: le_u16(b, 12), ver: le_u16(b, 14), lbn: le_u64(b, 16) }
    }

    fn v2(b: &[u8; V2_LEN]) -> Record {
        Record { cmd: le_u16(b, 0), ver: le_u16(b, 2), len: le_u32(b, 8), lbn: le_u64(b, 16) }
    }
}

/// Parser of vscsi v1 and v2 records.
pub(crate) struct Vscsi {
    /// The input; after detection, the bytes read to detect the version chained before it.
    input: Box<dyn Read + Send>,
    path: PathBuf,
    /// `None` until the first record has been looked at.
    version: Option<Version>,
    /// Records read so far; the 1-based number of the last one.
    record: u64,
}

impl Vscsi {
    /// Reads `input`; `path` names it in errors.
    pub(crate) fn new(path: PathBuf, input: Box<dyn BufRead + Send>) -> Vscsi {
        Vscsi { input: Box::new(input), path, version: None, record: 0 }
    }

    fn record_error(&self, record: u64, what: String) -> TraceError {
        TraceError::Record { path: self.path.clone(), record, what }
    }

    /// Reads up to one v2 record's worth of bytes, decides the version from them, and puts
    /// them back in front of the input. `Ok(None)`: the input is empty.
    fn detect(&mut self) -> Result<Option<Version>, TraceError> {
        let mut head = [0u8; V2_LEN];
        let n = read_full(&mut self.input, &mut head)
            .map_err(|source| TraceError::Read { path: self.path.clone(), source })?;
        let head = head.get(..n).unwrap_or_default();
        if head.is_empty() {
            return Ok(None);
        }
        let ver_at = |at: usize| head.get(at..at + 2).map(|b| le_u16(b, 0));
        let version = match (ver_at(2), ver_at(14)) {
            (Some(v), _) if v >> 8 == 2 => Version::V2,
            (_, Some(v)) if v >> 8 == 1 => Version::V1,
            (_, Some(v1)) => {
                return Err(self.record_error(
                    1,
                    format!(
                        "not a vscsi trace: version field is 0x{v1:04x} at byte 14 (v1) and \
                         0x{:04x} at byte 2 (v2), expected 0x01xx or 0x02xx",
                        ver_at(2).unwrap_or_default()
                    ),
                ))
            }
            (_, None) => {
                return Err(self.record_error(1, format!("truncated ({n} of {V1_LEN} bytes)")))
            }
        };
        let rest = std::mem::replace(&mut self.input, Box::new(std::io::empty()));
        self.input = Box::new(Cursor::new(head.to_vec()).chain(rest));
        self.version = Some(version);
        Ok(Some(version))
    }

    /// Reads the next `N`-byte record. `Ok(None)`: the input ended cleanly before it.
    fn read_record<const N: usize>(&mut self) -> Result<Option<[u8; N]>, TraceError> {
        let mut buf = [0u8; N];
        let n = read_full(&mut self.input, &mut buf)
            .map_err(|source| TraceError::Read { path: self.path.clone(), source })?;
        if n == 0 {
            return Ok(None);
        }
        self.record += 1;
        if n < N {
            return Err(self.record_error(self.record, format!("truncated ({n} of {N} bytes)")));
        }
        Ok(Some(buf))
    }
}

impl Parse for Vscsi {
    fn next_request(&mut self) -> Result<Option<Request>, TraceError> {
        let version = match self.version {
            Some(version) => version,
            None => match self.detect()? {
                Some(version) => version,
                None => return Ok(None),
            },
        };
        loop {
            let record = match version {
                Version::V1 => self.read_record::<V1_LEN>()?.map(|b| Record::v1(&b)),
                Version::V2 => self.read_record::<V2_LEN>()?.map(|b| Record::v2(&b)),
            };
            let Some(record) = record else {
                return Ok(None);
            };
            if record.ver >> 8 != version.number() {
                return Err(self.record_error(
                    self.record,
                    format!(
                        "version field is 0x{:04x}, but the first record's was 0x{:02x}xx",
                        record.ver,
                        version.number()
                    ),
                ));
            }
            let write = match record.cmd {
                0x08 | 0x28 | 0xa8 | 0x88 => false,
                0x0a | 0x2a | 0xaa | 0x8a => true,
                _ => continue,
            };
            let request = to_bytes(record.lbn, SECTOR, "lbn")
                .and_then(|offset| Request::bytes(offset, u64::from(record.len), write))
                .map_err(|what| self.record_error(self.record, what))?;
            return Ok(Some(request));
        }
    }
}

// Field readers. Callers pass fixed-size records and in-bounds offsets, so the fallback to
// zero is never taken; it keeps the decoder total without an `unwrap`.

fn le_u16(b: &[u8], at: usize) -> u16 {
    b.get(at..).and_then(|b| b.first_chunk()).map_or(0, |b| u16::from_le_bytes(*b))
}

fn le_u32(b: &[u8], at: usize) -> u32 {
    b.get(at..).and_then(|b| b.first_chunk()).map_or(0, |b| u32::from_le_bytes(*b))
}

fn le_u64(b: &[u8], at: usize) -> u64 {
    b.get(at..).and_then(|b| b.first_chunk()).map_or(0, |b| u64::from_le_bytes(*b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::test_util::{error, read_all};
    use crate::trace::{TraceFormat, TraceOptions};

    fn v1(len: u32, cmd: u16, lbn: u64) -> Vec<u8> {
        let mut r = Vec::with_capacity(V1_LEN);
        r.extend(0x8000_00f4u32.to_le_bytes()); // sn
        r.extend(len.to_le_bytes());
        r.extend(1u32.to_le_bytes()); // nSG
        r.extend(cmd.to_le_bytes());
        r.extend(0x0100u16.to_le_bytes()); // ver
        r.extend(lbn.to_le_bytes());
        r.extend(0x51f_be82_cf22u64.to_le_bytes()); // ts
        r
    }

    fn v2(len: u32, cmd: u16, lbn: u64) -> Vec<u8> {
        let mut r = Vec::with_capacity(V2_LEN);
        r.extend(cmd.to_le_bytes());
        r.extend(0x0200u16.to_le_bytes()); // ver
        r.extend(7u32.to_le_bytes()); // sn
        r.extend(len.to_le_bytes());
        r.extend(1u32.to_le_bytes()); // nSG
        r.extend(lbn.to_le_bytes());
        r.extend(1234u64.to_le_bytes()); // ts
        r.extend(56u64.to_le_bytes()); // rt
        r
    }

    fn accesses(input: &[u8], reads_only: bool) -> Vec<(u64, bool)> {
        let opts = TraceOptions { reads_only, ..TraceOptions::new(TraceFormat::Vscsi) };
        let got = read_all("x.vscsi", input, &opts).unwrap();
        got.into_iter().map(|a| (a.page, a.write)).collect()
    }

    #[test]
    fn v1_records_decode_like_the_sample_trace() {
        // The first record of cloudPhysicsIO.vscsi: a 512 B WRITE(10) at sector 0x028f1a09.
        let first = hex("f4000080 00020000 01000000 2a000001 091a8f02 00000000 22cf82be 1f050000");
        assert_eq!(first, v1(512, 0x2a, 0x028f_1a09));
        let page = 0x028f_1a09u64 * 512 / 4096;
        assert_eq!(accesses(&first, false), [(page, true)]);
    }

    #[test]
    fn v1_reads_writes_and_unaligned_lengths() {
        let mut input = v1(4096, 0x28, 1); // bytes [512, 4608): pages 0 and 1
        input.extend(v1(0, 0x2a, 16)); // zero length: page 2
        input.extend(v1(4096, 0x35, 0)); // SYNCHRONIZE CACHE: no pages
        input.extend(v1(8192, 0x88, 24)); // READ(16) at page 3: pages 3 and 4
        assert_eq!(
            accesses(&input, false),
            [(0, false), (1, false), (2, true), (3, false), (4, false)]
        );
        assert_eq!(accesses(&input, true), [(0, false), (1, false), (3, false), (4, false)]);
    }

    #[test]
    fn v2_records_are_detected_and_decoded() {
        let mut input = v2(4096, 0x2a, 8);
        input.extend(v2(1, 0x28, 9));
        assert_eq!(accesses(&input, false), [(1, true), (1, false)]);
        assert_eq!(Record::v2(&input[..V2_LEN].try_into().unwrap()).len, 4096);
    }

    #[test]
    fn empty_file_has_no_accesses() {
        assert_eq!(accesses(&[], false), []);
    }

    #[test]
    fn truncated_records_name_the_record() {
        let mut input = v1(512, 0x28, 0).repeat(11);
        input.extend(&v1(512, 0x28, 0)[..20]);
        assert_eq!(
            error(TraceFormat::Vscsi, "x.vscsi", &input),
            "x.vscsi: record 12: truncated (20 of 32 bytes)"
        );
        let mut input = v2(512, 0x28, 0);
        input.extend(&v2(512, 0x28, 0)[..39]);
        assert_eq!(
            error(TraceFormat::Vscsi, "y", &input),
            "y: record 2: truncated (39 of 40 bytes)"
        );
        assert_eq!(
            error(TraceFormat::Vscsi, "z", &[1, 2, 3]),
            "z: record 1: truncated (3 of 32 bytes)"
        );
        assert_eq!(
            error(TraceFormat::Vscsi, "z", &v1(1, 0x28, 0)[..31]),
            "z: record 1: truncated (31 of 32 bytes)"
        );
    }

    #[test]
    fn unknown_or_changing_versions_are_errors() {
        let err = error(TraceFormat::Vscsi, "x", &[0u8; 64]);
        assert!(
            err.starts_with("x: record 1: not a vscsi trace: version field is 0x0000"),
            "{err}"
        );
        let mut input = v1(512, 0x28, 0).repeat(2);
        let mut bad = v1(512, 0x28, 0);
        bad[15] = 0x03;
        input.extend(bad);
        assert_eq!(
            error(TraceFormat::Vscsi, "x", &input),
            "x: record 3: version field is 0x0300, but the first record's was 0x01xx"
        );
    }

    #[test]
    fn huge_lbn_or_length_is_an_error() {
        let err = error(TraceFormat::Vscsi, "x", &v1(512, 0x28, u64::MAX));
        assert_eq!(err, "x: record 1: lbn 18446744073709551615 × 512 B overflows 64 bits");
        let err = error(TraceFormat::Vscsi, "x", &v1(u32::MAX, 0x28, 0));
        assert!(err.contains("larger than the 1073741824-byte limit"), "{err}");
    }

    fn hex(s: &str) -> Vec<u8> {
        let digits: Vec<u8> = s.bytes().filter(u8::is_ascii_hexdigit).collect();
        digits
            .chunks(2)
            .map(|p| u8::from_str_radix(std::str::from_utf8(p).unwrap(), 16).unwrap())
            .collect()
    }
}
