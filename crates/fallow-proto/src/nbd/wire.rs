//! Reading the big-endian fields and strings inside one NBD message, with errors that name
//! the field, and the string rules every message shares.

use bytes::{BufMut, Bytes, BytesMut};

use super::{Error, MAX_STRING_LEN};

/// A cursor over the data of one well-delimited message (an option, an option reply, a
/// chunk payload). Every read checks the length first, so no read can run past the end.
pub(crate) struct Reader {
    data: Bytes,
    at: usize,
}

impl Reader {
    pub(crate) fn new(data: Bytes) -> Self {
        Self { data, at: 0 }
    }

    /// The next `n` bytes, sharing the message's memory.
    pub(crate) fn bytes(&mut self, n: usize, what: &'static str) -> Result<Bytes, Error> {
        if n > self.remaining() {
            return Err(Error::Truncated(what));
        }
        let out = self.data.slice(self.at..self.at + n);
        self.at += n;
        Ok(out)
    }

    fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], Error> {
        let mut out = [0u8; N];
        out.copy_from_slice(&self.bytes(N, what)?);
        Ok(out)
    }

    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16, Error> {
        Ok(u16::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, Error> {
        Ok(u32::from_be_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, Error> {
        Ok(u64::from_be_bytes(self.array(what)?))
    }

    /// A string of `len` bytes under the spec's rules (see [`strict_string`]).
    pub(crate) fn string(&mut self, len: usize, what: &'static str) -> Result<String, Error> {
        if len > MAX_STRING_LEN {
            // Checked before the bytes are read, so the error says "too long", not "truncated".
            return Err(Error::TooLong { what, len: len as u64, max: MAX_STRING_LEN as u64 });
        }
        strict_string(&self.bytes(len, what)?, what)
    }

    /// A string preceded by its 32-bit length.
    pub(crate) fn string_u32(&mut self, what: &'static str) -> Result<String, Error> {
        let len = self.u32(what)?;
        self.string(len as usize, what)
    }

    /// Everything not read yet.
    pub(crate) fn rest(&mut self) -> Bytes {
        let out = self.data.slice(self.at..);
        self.at = self.data.len();
        out
    }

    pub(crate) fn remaining(&self) -> usize {
        self.data.len() - self.at
    }

    /// Checks that every byte was read.
    pub(crate) fn finish(self, what: &'static str) -> Result<(), Error> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(Error::Trailing { what, extra }),
        }
    }
}

/// A string as the spec defines it for names: UTF-8, no NUL, at most [`MAX_STRING_LEN`]
/// bytes. Names must match byte for byte, so a bad one is an error, never repaired.
pub(crate) fn strict_string(bytes: &[u8], what: &'static str) -> Result<String, Error> {
    if bytes.len() > MAX_STRING_LEN {
        return Err(Error::TooLong { what, len: bytes.len() as u64, max: MAX_STRING_LEN as u64 });
    }
    let s = std::str::from_utf8(bytes).map_err(|_| Error::Invalid { what, why: "not UTF-8" })?;
    if s.contains('\0') {
        return Err(Error::Invalid { what, why: "contains NUL" });
    }
    Ok(s.to_owned())
}

/// Text for humans (error messages, descriptions): shown, never matched, so invalid UTF-8
/// is replaced rather than refused.
pub(crate) fn lossy_string(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// The longest prefix of `s` that fits in [`MAX_STRING_LEN`] bytes and ends on a character
/// boundary: messages for humans are cut to the spec's limit rather than refused.
pub(crate) fn truncate_message(s: &str) -> &str {
    let mut end = s.len().min(MAX_STRING_LEN);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Appends a 32-bit length and the string.
pub(crate) fn put_string_u32(buf: &mut BytesMut, s: &str) {
    buf.put_u32(s.len() as u32);
    buf.put_slice(s.as_bytes());
}

/// The first `N` bytes of `buf` as an array, if it holds that many.
pub(crate) fn peek<const N: usize>(buf: &[u8]) -> Option<[u8; N]> {
    buf.get(..N).and_then(|b| b.try_into().ok())
}

/// The big-endian `u32` at `at` in `buf`, if it holds that many bytes.
pub(crate) fn peek_u32(buf: &[u8], at: usize) -> Option<u32> {
    buf.get(at..).and_then(peek::<4>).map(u32::from_be_bytes)
}

/// The big-endian `u64` at `at` in `buf`, if it holds that many bytes.
pub(crate) fn peek_u64(buf: &[u8], at: usize) -> Option<u64> {
    buf.get(at..).and_then(peek::<8>).map(u64::from_be_bytes)
}

/// A message whose length field is patched once its data is complete: the option and
/// option-reply encoders write their data straight into the output buffer.
pub(crate) struct LengthPatch {
    at: usize,
}

impl LengthPatch {
    /// Appends a placeholder `u32` length to `buf`.
    pub(crate) fn begin(buf: &mut BytesMut) -> Self {
        let at = buf.len();
        buf.put_u32(0);
        Self { at }
    }

    /// Writes the number of bytes appended since `begin` into the placeholder.
    #[expect(clippy::indexing_slicing, reason = "the placeholder `begin` appended at `at`")]
    pub(crate) fn finish(self, buf: &mut BytesMut) {
        let len = (buf.len() - self.at - 4) as u32;
        buf[self.at..self.at + 4].copy_from_slice(&len.to_be_bytes());
    }
}
