//! The trace readers (`fallow_bench::trace::TraceReader`), every format, on any file.
//!
//! The first input byte picks the format (low 3 bits, modulo 7) and, for arc, the block
//! size (bit 3: 4096 bytes instead of the default 512); the rest is the (decompressed)
//! file.
//!
//! Checked, over the first `CAP` items of each reading:
//! * the file read one byte per `read` call gives the same accesses and errors as read in
//!   one piece (the line reader and the binary record reader cross buffer boundaries);
//! * `reads_only` gives the same stream with the writes left out, errors included;
//! * an error is the last item (the reader is fused after it), and formats that record no
//!   operation yield no writes.

#![no_main]

use std::io::{BufReader, Cursor, Read};

use fallow_bench::trace::{PageAccess, TraceFormat, TraceOptions, TraceReader};
use libfuzzer_sys::fuzz_target;

/// Items read per pass: enough for many lines, and a bound on a request of 1 GiB (262,144
/// pages) so that one input cannot run for seconds.
const CAP: usize = 1 << 16;

type Item = Result<PageAccess, String>;

fuzz_target!(|input: &[u8]| {
    let Some((&choice, file)) = input.split_first() else { return };
    let format = TraceFormat::ALL[usize::from(choice & 7) % TraceFormat::ALL.len()];
    let block_size = (format == TraceFormat::Arc && choice & 8 != 0).then_some(4096);
    let opts = TraceOptions { format, block_size, reads_only: false };

    let whole = read(BufReader::new(Cursor::new(file.to_vec())), &opts);
    let trickled = read(BufReader::with_capacity(1, OneByte(Cursor::new(file.to_vec()))), &opts);
    assert_eq!(whole, trickled, "reading one byte at a time changed the trace");

    let reads = read(
        BufReader::new(Cursor::new(file.to_vec())),
        &TraceOptions { reads_only: true, ..opts },
    );
    let filtered: Vec<Item> =
        whole.iter().filter(|item| !matches!(item, Ok(a) if a.write)).cloned().collect();
    if whole.len() < CAP {
        assert_eq!(reads, filtered, "reads_only is not the same trace without its writes");
    } else {
        let n = reads.len().min(filtered.len());
        assert_eq!(
            reads[..n],
            filtered[..n],
            "reads_only is not the same trace without its writes"
        );
    }

    let no_ops = matches!(format, TraceFormat::Arc | TraceFormat::Lirs | TraceFormat::Lirs2);
    for access in whole.iter().flatten() {
        assert!(!(no_ops && access.write), "a write in a {format} trace");
    }
});

/// Up to `CAP` items, errors as their messages; checks that nothing follows an error.
fn read(input: impl std::io::BufRead + Send + 'static, opts: &TraceOptions) -> Vec<Item> {
    let mut reader = TraceReader::from_reader("fuzz", input, opts).expect("options are valid");
    let mut items = Vec::new();
    while items.len() < CAP {
        match reader.next() {
            Some(Ok(access)) => items.push(Ok(access)),
            Some(Err(e)) => {
                items.push(Err(e.to_string()));
                assert!(reader.next().is_none(), "an item after an error");
                break;
            }
            None => {
                assert!(reader.next().is_none(), "an item after the end");
                break;
            }
        }
    }
    items
}

/// A reader that returns at most one byte per call.
struct OneByte<R>(R);

impl<R: Read> Read for OneByte<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = buf.len().min(1);
        self.0.read(&mut buf[..n])
    }
}
