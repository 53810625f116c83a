//! Reading the fixed-width little-endian fields of a body, with errors that say which
//! field was missing, so a malformed request gets a precise reply instead of a panic; and
//! cutting a string to the width of its length field.

use bytes::Bytes;

use super::Status;

/// Why a frame body does not parse. The frame itself was well delimited, so the
/// connection can go on: the node answers with [`BodyError::status`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// The op code is not one this implementation knows.
    #[error("unknown op code {0:#04x}")]
    UnknownOp(u8),
    /// The body ended before a field.
    #[error("body too short for {0}")]
    Truncated(&'static str),
    /// Bytes left over after the last field.
    #[error("{0} unexpected bytes after the body")]
    Trailing(usize),
    /// A field holds a value the protocol does not allow.
    #[error("invalid {0}")]
    Invalid(&'static str),
    /// A batch over the limit.
    #[error("batch of {count} pages, the most is {max}")]
    TooLarge {
        /// The count in the request.
        count: u64,
        /// The limit.
        max: usize,
    },
}

impl BodyError {
    /// The status a node answers this error with.
    pub fn status(&self) -> Status {
        match self {
            BodyError::UnknownOp(_) => Status::UnknownOp,
            BodyError::TooLarge { .. } => Status::TooLarge,
            BodyError::Truncated(_) | BodyError::Trailing(_) | BodyError::Invalid(_) => {
                Status::Malformed
            }
        }
    }
}

/// A cursor over a body.
pub(crate) struct Reader {
    body: Bytes,
    at: usize,
}

impl Reader {
    pub(crate) fn new(body: Bytes) -> Self {
        Self { body, at: 0 }
    }

    pub(crate) fn bytes(&mut self, n: usize, what: &'static str) -> Result<Bytes, BodyError> {
        let end = self.at.checked_add(n).ok_or(BodyError::Truncated(what))?;
        if end > self.body.len() {
            return Err(BodyError::Truncated(what));
        }
        let out = self.body.slice(self.at..end);
        self.at = end;
        Ok(out)
    }

    pub(crate) fn array<const N: usize>(
        &mut self,
        what: &'static str,
    ) -> Result<[u8; N], BodyError> {
        let bytes = self.bytes(N, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(&bytes);
        Ok(out)
    }

    pub(crate) fn u8(&mut self, what: &'static str) -> Result<u8, BodyError> {
        Ok(self.array::<1>(what)?[0])
    }

    pub(crate) fn u16(&mut self, what: &'static str) -> Result<u16, BodyError> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u32(&mut self, what: &'static str) -> Result<u32, BodyError> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u64(&mut self, what: &'static str) -> Result<u64, BodyError> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    pub(crate) fn u128(&mut self, what: &'static str) -> Result<u128, BodyError> {
        Ok(u128::from_le_bytes(self.array(what)?))
    }

    /// The bytes not read yet.
    pub(crate) fn remaining(&self) -> usize {
        self.body.len() - self.at
    }

    /// Checks that every byte was read.
    pub(crate) fn finish(self) -> Result<(), BodyError> {
        match self.remaining() {
            0 => Ok(()),
            extra => Err(BodyError::Trailing(extra)),
        }
    }
}

/// The longest prefix of `s` that fits in `max` bytes and ends on a character boundary.
pub(super) fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
