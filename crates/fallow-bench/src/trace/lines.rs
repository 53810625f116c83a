//! The line reader and field helpers that the text formats (arc, lirs, tencent, msr, systor)
//! share.
//!
//! Lines are read as bytes and checked for UTF-8 one at a time, so a stray binary byte is an
//! error on its own line rather than a failure of the whole stream. A line may be at most
//! [`MAX_LINE_BYTES`] long: without that bound, a binary file read as text would be buffered
//! whole while the reader looks for a newline.

use std::io::{BufRead, Read};
use std::path::{Path, PathBuf};

use super::{TraceError, MAX_LINE_BYTES};

/// Reads the non-blank lines of a text trace, counting every line (blank or not) so errors
/// carry the line number an editor shows.
pub(crate) struct Lines {
    input: Box<dyn BufRead + Send>,
    path: PathBuf,
    /// The 1-based number of the line in `buf`; 0 before the first.
    number: u64,
    /// The current line's bytes, terminator included.
    buf: Vec<u8>,
}

/// One line of a text trace, without its `\n` or `\r\n` terminator.
pub(crate) struct Line<'a> {
    /// The line's text.
    pub(crate) text: &'a str,
    /// Its 1-based line number.
    pub(crate) number: u64,
    path: &'a Path,
}

impl Line<'_> {
    /// An error about this line.
    pub(crate) fn error(&self, what: impl Into<String>) -> TraceError {
        TraceError::Line { path: self.path.to_path_buf(), line: self.number, what: what.into() }
    }
}

impl Lines {
    /// Reads lines from `input`; `path` names it in errors.
    pub(crate) fn new(path: PathBuf, input: Box<dyn BufRead + Send>) -> Lines {
        Lines { input, path, number: 0, buf: Vec::new() }
    }

    /// The next line that is not empty or all whitespace, or `Ok(None)` at the end of input.
    pub(crate) fn next_line(&mut self) -> Result<Option<Line<'_>>, TraceError> {
        let len = loop {
            let Some(len) = self.read_line()? else {
                return Ok(None);
            };
            let bytes = self.buf.get(..len).unwrap_or_default();
            if !bytes.iter().all(u8::is_ascii_whitespace) {
                break len;
            }
        };
        let bytes = self.buf.get(..len).unwrap_or_default();
        let text = std::str::from_utf8(bytes).map_err(|e| TraceError::Line {
            path: self.path.clone(),
            line: self.number,
            what: format!("not UTF-8 text (byte {})", e.valid_up_to() + 1),
        })?;
        Ok(Some(Line { text, number: self.number, path: &self.path }))
    }

    /// Reads the next line into `buf` and returns its length without the `\n` or `\r\n`
    /// terminator, or `Ok(None)` at the end of input.
    fn read_line(&mut self) -> Result<Option<usize>, TraceError> {
        self.buf.clear();
        // Reading two bytes past the limit tells a line of exactly MAX_LINE_BYTES (plus its
        // `\r\n`) apart from a longer one.
        let limit = MAX_LINE_BYTES as u64 + 2;
        let read = (&mut self.input).take(limit).read_until(b'\n', &mut self.buf);
        let n = read.map_err(|source| TraceError::Read { path: self.path.clone(), source })?;
        if n == 0 {
            return Ok(None);
        }
        self.number += 1;
        let mut bytes = self.buf.as_slice();
        if let Some(rest) = bytes.strip_suffix(b"\n") {
            bytes = rest.strip_suffix(b"\r").unwrap_or(rest);
        }
        if bytes.len() > MAX_LINE_BYTES {
            return Err(TraceError::Line {
                path: self.path.clone(),
                line: self.number,
                what: format!("line is longer than {MAX_LINE_BYTES} bytes"),
            });
        }
        Ok(Some(bytes.len()))
    }
}

/// Splits `fields` into exactly `N` fields; `Err` says how many there were instead.
pub(crate) fn exactly<'a, const N: usize>(
    fields: impl Iterator<Item = &'a str>,
) -> Result<[&'a str; N], String> {
    let mut out = [""; N];
    let mut found = 0usize;
    for field in fields {
        if let Some(slot) = out.get_mut(found) {
            *slot = field;
        }
        found += 1;
    }
    if found == N {
        Ok(out)
    } else {
        Err(format!("expected {N} fields, found {found}"))
    }
}

/// Splits a CSV line into exactly `N` fields, each trimmed of surrounding whitespace. Trace
/// CSVs have no quoting, so a plain split is the whole grammar.
pub(crate) fn csv<const N: usize>(text: &str) -> Result<[&str; N], String> {
    exactly(text.split(',').map(str::trim))
}

/// Parses `field` as an unsigned decimal integer; `what` names the field in the error.
pub(crate) fn number(field: &str, what: &str) -> Result<u64, String> {
    field.parse().map_err(|_| format!("{what}: expected an unsigned integer, found `{field}`"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &'static [u8]) -> Lines {
        Lines::new(PathBuf::from("f.txt"), Box::new(input))
    }

    #[test]
    fn numbers_every_line_but_skips_blank_ones() {
        let mut l = lines(b"a\n\n  \r\nb\r\nc");
        let mut got = Vec::new();
        while let Some(line) = l.next_line().unwrap() {
            got.push((line.number, line.text.to_owned()));
        }
        assert_eq!(got, [(1, "a".to_owned()), (4, "b".to_owned()), (5, "c".to_owned())]);
    }

    #[test]
    fn long_lines_are_errors_and_the_limit_is_exact() {
        let mut ok = vec![b'7'; MAX_LINE_BYTES];
        ok.extend_from_slice(b"\r\n");
        let mut l = Lines::new(PathBuf::from("f"), Box::new(std::io::Cursor::new(ok)));
        assert_eq!(l.next_line().unwrap().unwrap().text.len(), MAX_LINE_BYTES);

        let long = vec![b'7'; MAX_LINE_BYTES + 1];
        let mut l = Lines::new(PathBuf::from("f"), Box::new(std::io::Cursor::new(long)));
        let err = l.next_line().err().unwrap().to_string();
        assert_eq!(err, format!("f:1: line is longer than {MAX_LINE_BYTES} bytes"));
    }

    #[test]
    fn non_utf8_is_an_error_on_its_line() {
        let mut l = lines(b"1\n2\xff\n");
        assert_eq!(l.next_line().unwrap().unwrap().text, "1");
        let err = l.next_line().err().unwrap().to_string();
        assert_eq!(err, "f.txt:2: not UTF-8 text (byte 2)");
    }

    #[test]
    fn exactly_counts_fields() {
        assert_eq!(csv::<3>("a, b ,c").unwrap(), ["a", "b", "c"]);
        assert_eq!(csv::<3>("a,b").unwrap_err(), "expected 3 fields, found 2");
        assert_eq!(csv::<2>("a,b,c,d").unwrap_err(), "expected 2 fields, found 4");
        assert_eq!(exactly::<0>("".split_whitespace()).unwrap(), [""; 0]);
    }

    #[test]
    fn number_names_the_field() {
        assert_eq!(number("42", "offset").unwrap(), 42);
        assert_eq!(
            number("-1", "offset").unwrap_err(),
            "offset: expected an unsigned integer, found `-1`"
        );
    }
}
