//! Opens a trace file and decompresses it on the fly, picking the decoder by file suffix:
//! `.gz` (gzip), `.xz`, `.zst` (zstd) or `.bz2` (bzip2); any other name is read as it is.
//!
//! Every decoder streams, so a trace never has to fit in memory decompressed. Each also
//! accepts concatenated members or frames (as `zcat` does), since `cat a.gz b.gz > c.gz` is a
//! common way to join trace pieces. Corrupt compressed data surfaces as an `io::Error` from
//! `read`, which the parsers report as [`TraceError::Read`].

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::Path;

use super::TraceError;

/// Read buffer size for the (decompressed) input: large enough that the line and record
/// parsers rarely reach the decoder.
const BUF_BYTES: usize = 64 * 1024;

/// The compression a trace file uses, judged by its suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compression {
    /// No recognised suffix: the file is read as it is.
    None,
    /// `.gz`
    Gzip,
    /// `.xz`
    Xz,
    /// `.zst`
    Zstd,
    /// `.bz2`
    Bzip2,
}

impl Compression {
    /// The compression `path`'s suffix names. Suffixes are matched ignoring ASCII case.
    pub(crate) fn of(path: &Path) -> Compression {
        let Some(ext) = path.extension().and_then(|e| e.to_str()) else {
            return Compression::None;
        };
        match ext.to_ascii_lowercase().as_str() {
            "gz" => Compression::Gzip,
            "xz" => Compression::Xz,
            "zst" => Compression::Zstd,
            "bz2" => Compression::Bzip2,
            _ => Compression::None,
        }
    }
}

/// Opens `path` and returns its decompressed contents as a buffered stream.
pub(crate) fn open(path: &Path) -> Result<Box<dyn BufRead + Send>, TraceError> {
    let file =
        File::open(path).map_err(|source| TraceError::Open { path: path.to_path_buf(), source })?;
    decoder(Compression::of(path), file)
        .map_err(|source| TraceError::Open { path: path.to_path_buf(), source })
}

/// Wraps `input` in the streaming decoder for `compression`, then in a read buffer.
fn decoder(
    compression: Compression,
    input: impl Read + Send + 'static,
) -> std::io::Result<Box<dyn BufRead + Send>> {
    let decoded: Box<dyn Read + Send> = match compression {
        Compression::None => Box::new(input),
        // The Multi* decoders go on past the first member or stream, like `zcat`.
        Compression::Gzip => Box::new(flate2::read::MultiGzDecoder::new(BufReader::new(input))),
        Compression::Xz => Box::new(xz2::read::XzDecoder::new_multi_decoder(BufReader::new(input))),
        // zstd reads every frame by default; it buffers its input itself.
        Compression::Zstd => Box::new(zstd::stream::read::Decoder::new(input)?),
        Compression::Bzip2 => Box::new(bzip2::read::MultiBzDecoder::new(BufReader::new(input))),
    };
    Ok(Box::new(BufReader::with_capacity(BUF_BYTES, decoded)))
}

#[cfg(test)]
mod tests {
    use std::io::Write;

    use super::*;
    use crate::trace::test_util::temp_path;
    use crate::trace::{count_distinct, open as open_trace, TraceFormat, TraceOptions};

    /// A LIRS trace of 1,000 accesses to 100 distinct pages: compresses well, so every
    /// decoder sees more than one block.
    fn sample() -> Vec<u8> {
        (0..1000u32).map(|i| format!("{}\n", (i * 7) % 100)).collect::<String>().into_bytes()
    }

    fn compress(compression: Compression, data: &[u8]) -> Vec<u8> {
        match compression {
            Compression::None => data.to_vec(),
            Compression::Gzip => {
                let mut enc =
                    flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
                enc.write_all(data).unwrap();
                enc.finish().unwrap()
            }
            Compression::Xz => {
                let mut enc = xz2::write::XzEncoder::new(Vec::new(), 6);
                enc.write_all(data).unwrap();
                enc.finish().unwrap()
            }
            Compression::Zstd => zstd::stream::encode_all(data, 3).unwrap(),
            Compression::Bzip2 => {
                let mut enc =
                    bzip2::write::BzEncoder::new(Vec::new(), bzip2::Compression::default());
                enc.write_all(data).unwrap();
                enc.finish().unwrap()
            }
        }
    }

    /// Writes `data` compressed as `compression` to a fresh file named `*suffix`, reads it
    /// back as a LIRS trace, and removes it.
    fn round_trip(compression: Compression, suffix: &str, data: &[u8]) -> Vec<u64> {
        let path = temp_path(suffix);
        std::fs::write(&path, compress(compression, data)).unwrap();
        assert_eq!(Compression::of(&path), compression);
        let got = open_trace(&path, &TraceOptions::new(TraceFormat::Lirs))
            .and_then(|r| r.map(|a| a.map(|a| a.page)).collect::<Result<Vec<_>, _>>());
        std::fs::remove_file(&path).unwrap();
        got.unwrap()
    }

    #[test]
    fn suffixes_pick_the_decoder() {
        for (name, want) in [
            ("a.trace", Compression::None),
            ("a", Compression::None),
            ("a.trace.gz", Compression::Gzip),
            ("a.lis.XZ", Compression::Xz),
            ("a.lis.zst", Compression::Zstd),
            ("tencent-sample.bz2", Compression::Bzip2),
        ] {
            assert_eq!(Compression::of(Path::new(name)), want, "{name}");
        }
    }

    #[test]
    fn every_suffix_round_trips() {
        let data = sample();
        let want: Vec<u64> = (0..1000u64).map(|i| (i * 7) % 100).collect();
        for (compression, suffix) in [
            (Compression::None, ".trace"),
            (Compression::Gzip, ".trace.gz"),
            (Compression::Xz, ".trace.xz"),
            (Compression::Zstd, ".trace.zst"),
            (Compression::Bzip2, ".trace.bz2"),
        ] {
            assert_eq!(round_trip(compression, suffix, &data), want, "{suffix}");
        }
    }

    #[test]
    fn concatenated_members_are_all_read() {
        let (a, b) = (b"1\n2\n".as_slice(), b"3\n".as_slice());
        for (compression, suffix) in [
            (Compression::Gzip, ".gz"),
            (Compression::Xz, ".xz"),
            (Compression::Zstd, ".zst"),
            (Compression::Bzip2, ".bz2"),
        ] {
            let mut joined = compress(compression, a);
            joined.extend(compress(compression, b));
            let path = temp_path(suffix);
            std::fs::write(&path, joined).unwrap();
            let summary = count_distinct(&path, &TraceOptions::new(TraceFormat::Lirs));
            std::fs::remove_file(&path).unwrap();
            assert_eq!(summary.unwrap().accesses, 3, "{suffix}");
        }
    }

    #[test]
    fn truncated_compressed_data_is_a_read_error() {
        let data = sample();
        for (compression, suffix) in [
            (Compression::Gzip, ".gz"),
            (Compression::Xz, ".xz"),
            (Compression::Zstd, ".zst"),
            (Compression::Bzip2, ".bz2"),
        ] {
            let mut packed = compress(compression, &data);
            packed.truncate(packed.len() / 2);
            let path = temp_path(suffix);
            std::fs::write(&path, packed).unwrap();
            let result = open_trace(&path, &TraceOptions::new(TraceFormat::Lirs))
                .and_then(|r| r.collect::<Result<Vec<_>, _>>());
            std::fs::remove_file(&path).unwrap();
            let err = result.unwrap_err();
            assert!(matches!(err, TraceError::Read { .. }), "{suffix}: {err}");
        }
    }

    #[test]
    fn corrupt_compressed_data_is_a_read_error() {
        for suffix in [".gz", ".xz", ".zst", ".bz2"] {
            let path = temp_path(suffix);
            std::fs::write(&path, b"this is not compressed data at all\n").unwrap();
            let result = open_trace(&path, &TraceOptions::new(TraceFormat::Lirs))
                .and_then(|r| r.collect::<Result<Vec<_>, _>>());
            std::fs::remove_file(&path).unwrap();
            let err = result.unwrap_err();
            assert!(
                matches!(err, TraceError::Read { .. } | TraceError::Open { .. }),
                "{suffix}: {err}"
            );
            assert!(err.to_string().starts_with(&path.display().to_string()), "{err}");
        }
    }
}
