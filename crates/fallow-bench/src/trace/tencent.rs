//! Tencent CBS block traces (SNIA IOTTA, OSCA paper, USENIX ATC'20): one request per CSV line,
//!
//! ```text
//! timestamp_s,offset_sectors,size_sectors,io_type,volume_id    e.g.  1538323200,4247200,128,1,1058
//! ```
//!
//! with 512 B sectors and `io_type` 0 for a read, 1 for a write. The volume id is folded into
//! the page key as `(volume_id << 40) | page` (see [`VOLUME_SHIFT`](super::VOLUME_SHIFT)).
//! The timestamp is not used, nor checked.

use std::io::BufRead;
use std::path::PathBuf;

use super::lines::{csv, number, Lines};
use super::{to_bytes, Parse, Request, TraceError};

/// Bytes per sector.
const SECTOR: u64 = 512;

/// Parser of Tencent CBS CSV.
pub(crate) struct Tencent {
    lines: Lines,
}

impl Tencent {
    /// Reads `input`; `path` names it in errors.
    pub(crate) fn new(path: PathBuf, input: Box<dyn BufRead + Send>) -> Tencent {
        Tencent { lines: Lines::new(path, input) }
    }
}

impl Parse for Tencent {
    fn next_request(&mut self) -> Result<Option<Request>, TraceError> {
        let Some(line) = self.lines.next_line()? else {
            return Ok(None);
        };
        let parse = || {
            let [_, offset, size, io_type, volume] = csv(line.text)?;
            let offset = to_bytes(number(offset, "offset")?, SECTOR, "offset")?;
            let size = to_bytes(number(size, "size")?, SECTOR, "size")?;
            let write = match io_type {
                "0" => false,
                "1" => true,
                other => {
                    return Err(format!("io type: expected 0 (read) or 1 (write), found `{other}`"))
                }
            };
            Request::bytes(offset, size, write)?.in_volume(number(volume, "volume")?)
        };
        parse().map(Some).map_err(|what| line.error(what))
    }
}

#[cfg(test)]
mod tests {
    use crate::trace::test_util::{error, read_all};
    use crate::trace::{TraceFormat, TraceOptions};

    const V: u64 = 1 << 40;

    #[test]
    fn sectors_types_and_volumes() {
        let input = b"1538323200,4247200,128,1,1058\n1538323199,9,8,0,3\n1538323199,9,8,0,4\n";
        let got = read_all("t", input, &TraceOptions::new(TraceFormat::Tencent)).unwrap();
        let got: Vec<_> = got.into_iter().map(|a| (a.page, a.write)).collect();
        // 4247200 sectors = page 530900 exactly; 128 sectors = 16 pages.
        let mut want: Vec<_> = (530_900..530_916).map(|p| (1058 * V + p, true)).collect();
        // Sectors [9, 17) are bytes [4608, 8704): pages 1 and 2.
        want.extend([
            (3 * V + 1, false),
            (3 * V + 2, false),
            (4 * V + 1, false),
            (4 * V + 2, false),
        ]);
        assert_eq!(got, want);
    }

    #[test]
    fn reads_only_keeps_io_type_0() {
        let opts = TraceOptions { reads_only: true, ..TraceOptions::new(TraceFormat::Tencent) };
        let got = read_all("t", b"0,0,8,1,1\n0,8,8,0,1\n", &opts).unwrap();
        assert_eq!(got.iter().map(|a| a.page).collect::<Vec<_>>(), [V + 1]);
    }

    #[test]
    fn malformed_lines_name_file_line_and_problem() {
        let e = |input: &[u8]| error(TraceFormat::Tencent, "cbs.csv", input);
        assert_eq!(e(b"0,0,8,0,1\n0,0,8\n"), "cbs.csv:2: expected 5 fields, found 3");
        assert_eq!(
            e(b"0,0,8,2,1\n"),
            "cbs.csv:1: io type: expected 0 (read) or 1 (write), found `2`"
        );
        assert_eq!(e(b"0,a,8,0,1\n"), "cbs.csv:1: offset: expected an unsigned integer, found `a`");
        assert_eq!(
            e(b"0,0,8,0,16777216\n"),
            "cbs.csv:1: volume 16777216 is larger than the limit of 16777215"
        );
        assert!(e(b"0,36028797018963968,8,0,1\n").contains("overflows 64 bits"));
        assert!(e(b"0,9007199254740992,8,0,1\n").contains("past the 2^40-page (4 PiB) limit"));
    }
}
