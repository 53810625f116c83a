//! ARC `.lis` traces, from the ARC paper (Megiddo and Modha, FAST'03): one request per line,
//!
//! ```text
//! start_block n_blocks ignored req_no      e.g.  3050771 25 0 0
//! ```
//!
//! separated by whitespace. The request covers blocks `start_block .. start_block+n_blocks`
//! of [`TraceOptions::block_size`](super::TraceOptions::block_size) bytes (512 unless set);
//! the third and fourth fields are not used, nor checked. The traces record no operation,
//! so every request is a read. P2 and P3 use 512 B blocks; in OLTP every line is one 4 KiB
//! page, so it needs a block size of 4096.

use std::io::BufRead;
use std::path::PathBuf;

use super::lines::{exactly, number, Lines};
use super::{to_bytes, Parse, Request, TraceError};

/// The block size when the options name none, in bytes.
pub(crate) const DEFAULT_BLOCK_SIZE: u32 = 512;

/// Parser of ARC `.lis` text.
pub(crate) struct Arc {
    lines: Lines,
    block_size: u64,
}

impl Arc {
    /// Reads `input` with `block_size`-byte blocks; `path` names it in errors.
    pub(crate) fn new(path: PathBuf, input: Box<dyn BufRead + Send>, block_size: u32) -> Arc {
        Arc { lines: Lines::new(path, input), block_size: u64::from(block_size) }
    }
}

impl Parse for Arc {
    fn next_request(&mut self) -> Result<Option<Request>, TraceError> {
        let block_size = self.block_size;
        let Some(line) = self.lines.next_line()? else {
            return Ok(None);
        };
        let parse = || {
            let [start, count, _, _] = exactly(line.text.split_ascii_whitespace())?;
            let start = number(start, "start block")?;
            let count = number(count, "block count")?;
            let offset = to_bytes(start, block_size, "start block")?;
            let len = to_bytes(count, block_size, "block count")?;
            Request::bytes(offset, len, false)
        };
        parse().map(Some).map_err(|what| line.error(what))
    }
}

#[cfg(test)]
mod tests {
    use crate::trace::test_util::{error, pages, read_all};
    use crate::trace::{TraceFormat, TraceOptions};

    #[test]
    fn blocks_are_512_bytes_by_default() {
        // Blocks 0..8 are page 0; blocks 7..10 straddle pages 0 and 1; block 16 is page 2.
        let input = b"0 8 0 0\n7 3 0 1\n16 1 0 2\n";
        assert_eq!(pages(TraceFormat::Arc, input), [0, 0, 1, 2]);
    }

    #[test]
    fn block_size_4096_is_one_page_per_block() {
        let opts = TraceOptions { block_size: Some(4096), ..TraceOptions::new(TraceFormat::Arc) };
        let got = read_all("OLTP.lis", b"1 1 0 0\n2 1 0 1\n\n5 2 0 2\n", &opts).unwrap();
        let got: Vec<_> = got.iter().map(|a| (a.page, a.write)).collect();
        assert_eq!(got, [(1, false), (2, false), (5, false), (6, false)]);
    }

    #[test]
    fn zero_blocks_touch_one_page() {
        assert_eq!(pages(TraceFormat::Arc, b"9 0 0 0\n"), [1]);
    }

    #[test]
    fn malformed_lines_name_file_line_and_problem() {
        let e = |input: &[u8]| error(TraceFormat::Arc, "OLTP.lis", input);
        assert_eq!(e(b"1 1 0 0\n\n4 1\n"), "OLTP.lis:3: expected 4 fields, found 2");
        assert_eq!(
            e(b"1 x 0 0\n"),
            "OLTP.lis:1: block count: expected an unsigned integer, found `x`"
        );
        assert_eq!(
            e(b"-1 1 0 0\n"),
            "OLTP.lis:1: start block: expected an unsigned integer, found `-1`"
        );
        assert!(e(b"36028797018963968 1 0 0\n").contains("overflows 64 bits"));
        assert!(e(b"0 4000000 0 0\n").contains("larger than the 1073741824-byte limit"));
    }
}
