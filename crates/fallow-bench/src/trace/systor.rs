//! SYSTOR'17 block traces (SNIA IOTTA, Lee et al., SYSTOR'17): CSV with a header line,
//!
//! ```text
//! Timestamp,Response,IOType,LUN,Offset,Size        e.g.  1455591804.310701000,0.006475000,R,0,203468398592,32768
//! ```
//!
//! with the offset and size in bytes and `IOType` `R` or `W` (any ASCII case). The LUN is the
//! volume, folded into the page key as `(lun << 40) | page` (see
//! [`VOLUME_SHIFT`](super::VOLUME_SHIFT)). The first non-blank line is skipped if it is the
//! header (it starts with `Timestamp`); a file without one is read too. The timestamp and
//! response time are not used, nor checked.

use std::io::BufRead;
use std::path::PathBuf;

use super::lines::{csv, number, Lines};
use super::{Parse, Request, TraceError};

/// Parser of SYSTOR'17 CSV.
pub(crate) struct Systor {
    lines: Lines,
    /// No line has been read yet, so the next one may be the header.
    at_start: bool,
}

impl Systor {
    /// Reads `input`; `path` names it in errors.
    pub(crate) fn new(path: PathBuf, input: Box<dyn BufRead + Send>) -> Systor {
        Systor { lines: Lines::new(path, input), at_start: true }
    }
}

impl Parse for Systor {
    fn next_request(&mut self) -> Result<Option<Request>, TraceError> {
        loop {
            let at_start = std::mem::replace(&mut self.at_start, false);
            let Some(line) = self.lines.next_line()? else {
                return Ok(None);
            };
            let is_header = line
                .text
                .trim_start()
                .get(..9)
                .is_some_and(|w| w.eq_ignore_ascii_case("timestamp"));
            if at_start && is_header {
                continue;
            }
            let parse = || {
                let [_, _, kind, lun, offset, size] = csv(line.text)?;
                let write = if kind.eq_ignore_ascii_case("r") {
                    false
                } else if kind.eq_ignore_ascii_case("w") {
                    true
                } else {
                    return Err(format!("IOType: expected R or W, found `{kind}`"));
                };
                let request =
                    Request::bytes(number(offset, "Offset")?, number(size, "Size")?, write)?;
                request.in_volume(number(lun, "LUN")?)
            };
            return parse().map(Some).map_err(|what| line.error(what));
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::trace::test_util::{error, pages, read_all};
    use crate::trace::{TraceFormat, TraceOptions};

    const V: u64 = 1 << 40;
    const HEADER: &str = "Timestamp,Response,IOType,LUN,Offset,Size\n";

    #[test]
    fn header_bytes_types_and_luns() {
        let input = format!(
            "{HEADER}1455591804.310701000,0.006475000,R,0,203468398592,32768\n\
             1455591804.318699000,0.005276000,W,3,4096,1\n"
        );
        let got = read_all("t", input.as_bytes(), &TraceOptions::new(TraceFormat::Systor)).unwrap();
        let got: Vec<_> = got.into_iter().map(|a| (a.page, a.write)).collect();
        let mut want: Vec<_> = (49_674_902..49_674_910).map(|p| (p, false)).collect();
        want.push((3 * V + 1, true));
        assert_eq!(got, want);
    }

    #[test]
    fn header_is_optional_but_only_first() {
        assert_eq!(pages(TraceFormat::Systor, b"0,0,r,1,0,4096\n"), [V]);
        let input = format!("0,0,R,0,0,1\n{HEADER}");
        assert_eq!(
            error(TraceFormat::Systor, "s.csv", input.as_bytes()),
            "s.csv:2: IOType: expected R or W, found `IOType`"
        );
    }

    #[test]
    fn malformed_lines_name_file_line_and_problem() {
        let e = |input: String| error(TraceFormat::Systor, "s.csv", input.as_bytes());
        assert_eq!(e(format!("{HEADER}1,2,R,0,0\n")), "s.csv:2: expected 6 fields, found 5");
        assert_eq!(
            e(format!("{HEADER}1,2,X,0,0,1\n")),
            "s.csv:2: IOType: expected R or W, found `X`"
        );
        assert_eq!(
            e(format!("{HEADER}1,2,R,lun,0,1\n")),
            "s.csv:2: LUN: expected an unsigned integer, found `lun`"
        );
        assert_eq!(
            e(format!("{HEADER}\n1,2,R,0,0,1.5\n")),
            "s.csv:3: Size: expected an unsigned integer, found `1.5`"
        );
    }
}
