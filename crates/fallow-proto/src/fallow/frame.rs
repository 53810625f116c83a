//! Splitting a byte stream into frames, and writing frame headers.
//!
//! A frame is a little-endian `u32` length (the bytes after it), then op, status, two
//! reserved bytes and a `u64` request id, then the body. [`decode`] takes one whole frame
//! off the front of a buffer without copying its body; [`FrameWriter`] writes a header
//! whose length is patched in when the body is complete, so a reply's pages can be copied
//! straight from the pool into the output buffer.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::{HEADER_LEN, MAX_FRAME_LEN};

/// The length field counts the header bytes after it, so it is never below this.
const MIN_LEN: usize = HEADER_LEN - 4;

/// One frame, with its body still in wire form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The op code (kept raw, so an unknown op can still be answered).
    pub op: u8,
    /// The status code: 0 in requests.
    pub status: u8,
    /// The request id, chosen by the client and echoed by the node.
    pub id: u64,
    /// The body bytes (shares the read buffer's memory).
    pub body: Bytes,
}

/// Why a byte stream cannot be split into frames. After this error the stream cannot be
/// resynchronised: the connection must be closed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The length field is below the header size or above [`MAX_FRAME_LEN`].
    #[error("frame length {len} is outside {min}..={max}")]
    BadLength {
        /// The length field as received.
        len: u64,
        /// The smallest valid length.
        min: usize,
        /// The largest valid length.
        max: usize,
    },
}

/// Takes one whole frame off the front of `buf`. Returns `Ok(None)` when `buf` does not
/// yet hold a whole frame: that is the normal state of a stream between reads, not an
/// error, and `buf` is left untouched (with room reserved for the rest of the frame).
pub fn decode(buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
    decode_limited(buf, MAX_FRAME_LEN)
}

/// Like [`decode`], with a smaller bound on the length field: a node accepts only short
/// frames before a peer has authenticated, so a stranger cannot make it buffer a megabyte.
pub fn decode_limited(buf: &mut BytesMut, max_len: usize) -> Result<Option<Frame>, FrameError> {
    let Some(field) = buf.first_chunk::<4>() else {
        return Ok(None);
    };
    let max = max_len.min(MAX_FRAME_LEN);
    let len = u32::from_le_bytes(*field) as usize;
    if !(MIN_LEN..=max).contains(&len) {
        return Err(FrameError::BadLength { len: len as u64, min: MIN_LEN, max });
    }
    let total = 4 + len;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let mut frame = buf.split_to(total);
    frame.advance(4);
    let op = frame.get_u8();
    let status = frame.get_u8();
    let _reserved = frame.get_u16_le();
    let id = frame.get_u64_le();
    Ok(Some(Frame { op, status, id, body: frame.freeze() }))
}

/// Encodes a whole frame whose body is already in one piece.
pub fn encode(buf: &mut BytesMut, op: u8, status: u8, id: u64, body: &[u8]) {
    let writer = FrameWriter::begin(buf, op, status, id);
    buf.put_slice(body);
    writer.finish(buf);
}

/// A frame being written: the header is in the buffer, the body is appended by the
/// caller, and [`FrameWriter::finish`] patches the length.
#[must_use = "a frame is not valid until finish() patches its length"]
#[derive(Debug)]
pub struct FrameWriter {
    start: usize,
}

impl FrameWriter {
    /// Appends a frame header to `buf`, with a length to be patched by `finish`.
    pub fn begin(buf: &mut BytesMut, op: u8, status: u8, id: u64) -> Self {
        let start = buf.len();
        buf.reserve(HEADER_LEN);
        buf.put_u32_le(0);
        buf.put_u8(op);
        buf.put_u8(status);
        buf.put_u16_le(0);
        buf.put_u64_le(id);
        Self { start }
    }

    /// The buffer offset where this frame's body starts.
    pub fn body_start(&self) -> usize {
        self.start + HEADER_LEN
    }

    /// Patches the length field now that the body is complete.
    ///
    /// # Panics
    /// If the body makes the frame longer than [`MAX_FRAME_LEN`]: encoders bound their
    /// batches, so this is a bug in the caller, never a reaction to input.
    #[expect(clippy::indexing_slicing, reason = "the length field `begin` appended at `start`")]
    pub fn finish(self, buf: &mut BytesMut) {
        let len = buf.len() - self.start - 4;
        assert!(len <= MAX_FRAME_LEN, "encoded a frame of {len} bytes");
        buf[self.start..self.start + 4].copy_from_slice(&(len as u32).to_le_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_golden_bytes() {
        let mut buf = BytesMut::new();
        encode(&mut buf, 0x21, 0, 0x0102_0304_0506_0708, &[0xaa, 0xbb]);
        assert_eq!(
            &buf[..],
            &[
                14, 0, 0, 0, // length: 12 header bytes after it + 2 body bytes
                0x21, 0, 0, 0, // op, status, reserved
                8, 7, 6, 5, 4, 3, 2, 1, // request id
                0xaa, 0xbb,
            ]
        );
    }

    #[test]
    fn decode_waits_for_a_whole_frame_then_takes_exactly_it() {
        let mut wire = BytesMut::new();
        encode(&mut wire, 3, 0, 7, b"xyz");
        encode(&mut wire, 3, 0, 8, b"");
        let whole = wire.clone();
        for cut in 0..whole.len() {
            let mut part = BytesMut::from(&whole[..cut]);
            let first_len = HEADER_LEN + 3;
            let got = decode(&mut part).unwrap();
            if cut < first_len {
                assert_eq!(got, None, "cut at {cut}");
                assert_eq!(part.len(), cut, "a partial frame is left in place");
            } else {
                assert_eq!(got.unwrap().id, 7);
            }
        }
        let first = decode(&mut wire).unwrap().unwrap();
        assert_eq!((first.op, first.id, &first.body[..]), (3, 7, &b"xyz"[..]));
        let second = decode(&mut wire).unwrap().unwrap();
        assert_eq!((second.id, second.body.len()), (8, 0));
        assert!(wire.is_empty());
    }

    #[test]
    fn out_of_range_lengths_are_errors() {
        for len in [0u32, 11, (MAX_FRAME_LEN + 1) as u32, u32::MAX] {
            let mut buf = BytesMut::from(&len.to_le_bytes()[..]);
            assert!(matches!(decode(&mut buf), Err(FrameError::BadLength { .. })), "{len}");
        }
        let mut ok = BytesMut::from(&12u32.to_le_bytes()[..]);
        assert_eq!(decode(&mut ok).unwrap(), None);
    }
}
