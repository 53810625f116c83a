//! LIRS traces, from the LIRS paper (Jiang and Zhang, SIGMETRICS'02) as the caffeine
//! simulator ships them: one page number per line. A line containing `*` marks a checkpoint
//! between phases and is skipped, as are blank lines. Every access is a read.

use std::io::BufRead;
use std::path::PathBuf;

use super::lines::{number, Lines};
use super::{Parse, Request, TraceError};

/// Parser of LIRS text.
pub(crate) struct Lirs {
    lines: Lines,
}

impl Lirs {
    /// Reads `input`; `path` names it in errors.
    pub(crate) fn new(path: PathBuf, input: Box<dyn BufRead + Send>) -> Lirs {
        Lirs { lines: Lines::new(path, input) }
    }
}

impl Parse for Lirs {
    fn next_request(&mut self) -> Result<Option<Request>, TraceError> {
        loop {
            let Some(line) = self.lines.next_line()? else {
                return Ok(None);
            };
            if line.text.contains('*') {
                continue;
            }
            let page = number(line.text.trim(), "page").map_err(|what| line.error(what))?;
            return Ok(Some(Request::page(page)));
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::trace::test_util::{error, pages, read_all};
    use crate::trace::{TraceFormat, TraceOptions};

    #[test]
    fn one_page_per_line_skipping_checkpoints_and_blanks() {
        let input = b"2819\n85\n*\n\n 560 \r\n* checkpoint\n2\n18446744073709551615";
        assert_eq!(pages(TraceFormat::Lirs, input), [2819, 85, 560, 2, u64::MAX]);
    }

    #[test]
    fn every_access_is_a_read() {
        let opts = TraceOptions { reads_only: true, ..TraceOptions::new(TraceFormat::Lirs) };
        assert_eq!(read_all("t", b"1\n2\n", &opts).unwrap().len(), 2);
    }

    #[test]
    fn malformed_lines_name_file_line_and_problem() {
        let e = |input: &[u8]| error(TraceFormat::Lirs, "cs.trace", input);
        assert_eq!(
            e(b"1\n*\n1 2\n"),
            "cs.trace:3: page: expected an unsigned integer, found `1 2`"
        );
        assert_eq!(e(b"-4\n"), "cs.trace:1: page: expected an unsigned integer, found `-4`");
        assert_eq!(
            e(b"18446744073709551616\n"),
            "cs.trace:1: page: expected an unsigned integer, found `18446744073709551616`"
        );
    }
}
