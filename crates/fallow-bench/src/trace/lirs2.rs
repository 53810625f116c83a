//! Binary LIRS-style traces: a flat array of little-endian `u32` page numbers, one 4 KiB page
//! per record, with no header. Every access is a read.
//!
//! ```text
//!  0        4        8
//!  ├─ page ─┼─ page ─┼ …     u32, little-endian
//! ```

use std::io::{BufRead, Read};
use std::path::PathBuf;

use super::{read_full, Parse, Request, TraceError};

/// Bytes per record.
const RECORD_LEN: usize = 4;

/// Parser of binary `u32` page numbers.
pub(crate) struct Lirs2 {
    input: Box<dyn BufRead + Send>,
    path: PathBuf,
    /// Records read so far; the 1-based number of the last one.
    record: u64,
}

impl Lirs2 {
    /// Reads `input`; `path` names it in errors.
    pub(crate) fn new(path: PathBuf, input: Box<dyn BufRead + Send>) -> Lirs2 {
        Lirs2 { input, path, record: 0 }
    }
}

impl Parse for Lirs2 {
    fn next_request(&mut self) -> Result<Option<Request>, TraceError> {
        let mut buf = [0u8; RECORD_LEN];
        let input: &mut dyn Read = &mut self.input;
        let n = read_full(input, &mut buf)
            .map_err(|source| TraceError::Read { path: self.path.clone(), source })?;
        if n == 0 {
            return Ok(None);
        }
        self.record += 1;
        if n < RECORD_LEN {
            return Err(TraceError::Record {
                path: self.path.clone(),
                record: self.record,
                what: format!("truncated ({n} of {RECORD_LEN} bytes)"),
            });
        }
        Ok(Some(Request::page(u64::from(u32::from_le_bytes(buf)))))
    }
}

#[cfg(test)]
mod tests {
    use crate::trace::test_util::{error, pages};
    use crate::trace::TraceFormat;

    #[test]
    fn little_endian_u32_pages() {
        let input = [1, 0, 0, 0, 0x34, 0x12, 0, 0, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(pages(TraceFormat::Lirs2, &input), [1, 0x1234, u64::from(u32::MAX)]);
        assert_eq!(pages(TraceFormat::Lirs2, &[]), [0u64; 0]);
    }

    #[test]
    fn trailing_bytes_are_a_truncated_record() {
        let input = [1, 0, 0, 0, 2, 0, 0, 0, 3, 0];
        assert_eq!(
            error(TraceFormat::Lirs2, "x.bin", &input),
            "x.bin: record 3: truncated (2 of 4 bytes)"
        );
    }
}
