//! MSR Cambridge block traces (SNIA IOTTA, Narayanan et al., FAST'08): one request per CSV
//! line,
//!
//! ```text
//! filetime,host,disk,type,offset,size,response    e.g.  128166385295514663,hm,0,Write,9056014336,2048,2833
//! ```
//!
//! with the offset and size in bytes and `type` `Read` or `Write` (any ASCII case). Each
//! distinct `(host, disk)` pair is one volume, numbered 0, 1, 2, … in order of first
//! appearance in the file, and folded into the page key as `(volume << 40) | page` (see
//! [`VOLUME_SHIFT`](super::VOLUME_SHIFT)). A dense number rather than a hash of the name
//! keeps volumes apart with no chance of collision; the cost is that a volume's number
//! depends on the file it is read from. The timestamp and response time are not used, nor
//! checked.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::PathBuf;

use super::lines::{csv, number, Lines};
use super::{Parse, Request, TraceError, MAX_VOLUME};

/// Parser of MSR Cambridge CSV.
pub(crate) struct Msr {
    lines: Lines,
    /// Volume numbers handed out so far.
    volumes: Volumes,
}

/// `host` → `disk` → volume number: two levels so that a lookup borrows the line's fields
/// instead of allocating a key. At most [`MAX_VOLUME`] + 1 volumes are numbered; a line that
/// would need another is an error, which bounds what a hostile file can make this allocate.
#[derive(Default)]
struct Volumes {
    by_host: HashMap<String, HashMap<String, u64>>,
    count: u64,
}

impl Volumes {
    /// The number of volume `(host, disk)`, handing out the next one if it is new.
    fn number(&mut self, host: &str, disk: &str) -> Result<u64, String> {
        if let Some(&volume) = self.by_host.get(host).and_then(|disks| disks.get(disk)) {
            return Ok(volume);
        }
        let volume = self.count;
        if volume > MAX_VOLUME {
            return Err(format!("more than {} distinct (host, disk) volumes", MAX_VOLUME + 1));
        }
        self.by_host.entry(host.to_owned()).or_default().insert(disk.to_owned(), volume);
        self.count += 1;
        Ok(volume)
    }
}

impl Msr {
    /// Reads `input`; `path` names it in errors.
    pub(crate) fn new(path: PathBuf, input: Box<dyn BufRead + Send>) -> Msr {
        Msr { lines: Lines::new(path, input), volumes: Volumes::default() }
    }
}

impl Parse for Msr {
    fn next_request(&mut self) -> Result<Option<Request>, TraceError> {
        let volumes = &mut self.volumes;
        let Some(line) = self.lines.next_line()? else {
            return Ok(None);
        };
        let mut parse = || {
            let [_, host, disk, kind, offset, size, _] = csv(line.text)?;
            let write = if kind.eq_ignore_ascii_case("read") {
                false
            } else if kind.eq_ignore_ascii_case("write") {
                true
            } else {
                return Err(format!("type: expected Read or Write, found `{kind}`"));
            };
            let request = Request::bytes(number(offset, "offset")?, number(size, "size")?, write)?;
            request.in_volume(volumes.number(host, disk)?)
        };
        parse().map(Some).map_err(|what| line.error(what))
    }
}

#[cfg(test)]
mod tests {
    use crate::trace::test_util::{error, read_all};
    use crate::trace::{TraceFormat, TraceOptions, MAX_VOLUME};

    const V: u64 = 1 << 40;

    #[test]
    fn bytes_types_and_volumes_by_first_appearance() {
        let input = b"128166385295514663,hm,0,Write,9056014336,2048,2833\n\
                      1,hm,1,Read,4096,4096,0\n\
                      2,src,0,read,0,0,0\n\
                      3,hm,0,READ,4095,2,0\n";
        let got = read_all("t", input, &TraceOptions::new(TraceFormat::Msr)).unwrap();
        let got: Vec<_> = got.into_iter().map(|a| (a.page, a.write)).collect();
        let want = [(2_210_941, true), (V + 1, false), (2 * V, false), (0, false), (1, false)];
        assert_eq!(got, want);
    }

    #[test]
    fn volume_numbers_run_out_with_an_error() {
        let mut volumes = super::Volumes { count: MAX_VOLUME, ..Default::default() };
        assert_eq!(volumes.number("a", "0"), Ok(MAX_VOLUME));
        assert_eq!(volumes.number("a", "0"), Ok(MAX_VOLUME));
        assert_eq!(
            volumes.number("a", "1"),
            Err("more than 16777216 distinct (host, disk) volumes".into())
        );
    }

    #[test]
    fn malformed_lines_name_file_line_and_problem() {
        let e = |input: &[u8]| error(TraceFormat::Msr, "msr.csv", input);
        assert_eq!(e(b"0,hm,0,Read,0,512\n"), "msr.csv:1: expected 7 fields, found 6");
        assert_eq!(
            e(b"0,hm,0,Trim,0,512,0\n"),
            "msr.csv:1: type: expected Read or Write, found `Trim`"
        );
        assert_eq!(
            e(b"\n0,hm,0,Read,0,-1,0\n"),
            "msr.csv:2: size: expected an unsigned integer, found `-1`"
        );
    }
}
