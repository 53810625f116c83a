//! Transmission requests: the 28-byte header every command starts with, and the WRITE
//! payload that follows it.
//!
//! ```text
//!  0       4       6      8        16       24       28
//!  ├ magic ┼ flags ┼ type ┼ cookie ┼ offset ┼ length ┤ WRITE: length bytes of data …
//! ```
//!
//! A server either decodes the header alone ([`decode_request`]) and then takes the WRITE
//! payload itself ([`take_payload`], or straight from the socket into a page), or waits for
//! header and payload together ([`decode_request_with_payload`]), bounded by the largest
//! payload it accepts.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::wire::{peek, peek_u32};
use super::{Error, NBD_REQUEST_MAGIC};
use super::{NBD_CMD_BLOCK_STATUS, NBD_CMD_CACHE, NBD_CMD_DISC, NBD_CMD_FLUSH, NBD_CMD_READ};
use super::{NBD_CMD_FLAG_DF, NBD_CMD_FLAG_FAST_ZERO, NBD_CMD_FLAG_FUA, NBD_CMD_FLAG_NO_HOLE};
use super::{NBD_CMD_FLAG_REQ_ONE, NBD_CMD_TRIM, NBD_CMD_WRITE, NBD_CMD_WRITE_ZEROES};

/// Bytes of a request header.
pub const REQUEST_LEN: usize = 28;

/// A command (the request's 16-bit type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Cmd {
    /// `NBD_CMD_READ`.
    Read,
    /// `NBD_CMD_WRITE`: `length` bytes of data follow the header.
    Write,
    /// `NBD_CMD_DISC`: no reply; the client sends nothing after it.
    Disc,
    /// `NBD_CMD_FLUSH`.
    Flush,
    /// `NBD_CMD_TRIM`.
    Trim,
    /// `NBD_CMD_CACHE`.
    Cache,
    /// `NBD_CMD_WRITE_ZEROES`.
    WriteZeroes,
    /// `NBD_CMD_BLOCK_STATUS`.
    BlockStatus,
    /// A type this crate does not know (RESIZE included): a server answers `NBD_EINVAL`.
    /// It carries no payload as far as this codec can tell.
    Unknown(u16),
}

impl From<u16> for Cmd {
    fn from(code: u16) -> Cmd {
        match code {
            NBD_CMD_READ => Cmd::Read,
            NBD_CMD_WRITE => Cmd::Write,
            NBD_CMD_DISC => Cmd::Disc,
            NBD_CMD_FLUSH => Cmd::Flush,
            NBD_CMD_TRIM => Cmd::Trim,
            NBD_CMD_CACHE => Cmd::Cache,
            NBD_CMD_WRITE_ZEROES => Cmd::WriteZeroes,
            NBD_CMD_BLOCK_STATUS => Cmd::BlockStatus,
            code => Cmd::Unknown(code),
        }
    }
}

impl From<Cmd> for u16 {
    fn from(cmd: Cmd) -> u16 {
        match cmd {
            Cmd::Read => NBD_CMD_READ,
            Cmd::Write => NBD_CMD_WRITE,
            Cmd::Disc => NBD_CMD_DISC,
            Cmd::Flush => NBD_CMD_FLUSH,
            Cmd::Trim => NBD_CMD_TRIM,
            Cmd::Cache => NBD_CMD_CACHE,
            Cmd::WriteZeroes => NBD_CMD_WRITE_ZEROES,
            Cmd::BlockStatus => NBD_CMD_BLOCK_STATUS,
            Cmd::Unknown(code) => code,
        }
    }
}

impl Cmd {
    /// A lower-case name for logs and metrics labels.
    pub fn name(self) -> &'static str {
        match self {
            Cmd::Read => "read",
            Cmd::Write => "write",
            Cmd::Disc => "disc",
            Cmd::Flush => "flush",
            Cmd::Trim => "trim",
            Cmd::Cache => "cache",
            Cmd::WriteZeroes => "write_zeroes",
            Cmd::BlockStatus => "block_status",
            Cmd::Unknown(_) => "unknown",
        }
    }

    /// The command flags the spec documents for this command: FUA on every command (a
    /// server that advertises `NBD_FLAG_SEND_FUA` must accept it anywhere), DF on READ,
    /// NO_HOLE and FAST_ZERO on WRITE_ZEROES, REQ_ONE on BLOCK_STATUS. A server answers
    /// `NBD_EINVAL` to any other bit; whether a documented flag was also negotiated
    /// (`NBD_FLAG_SEND_FUA`, `_DF`, `_FAST_ZERO`) is its own check.
    pub fn valid_flags(self) -> u16 {
        match self {
            Cmd::Read => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_DF,
            Cmd::WriteZeroes => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE | NBD_CMD_FLAG_FAST_ZERO,
            Cmd::BlockStatus => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_REQ_ONE,
            Cmd::Write | Cmd::Disc | Cmd::Flush | Cmd::Trim | Cmd::Cache => NBD_CMD_FLAG_FUA,
            Cmd::Unknown(_) => 0,
        }
    }
}

/// A request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// Command flags (`NBD_CMD_FLAG_*`), raw: unknown bits are the server's to refuse.
    pub flags: u16,
    /// The command.
    pub cmd: Cmd,
    /// Chosen by the client (the spec's former "handle"), echoed in every reply to it.
    pub cookie: u64,
    /// Byte offset into the export.
    pub offset: u64,
    /// Length in bytes: of the payload after a WRITE, of the effect otherwise.
    pub length: u32,
}

impl Request {
    /// True for WRITE, whose header is followed by `length` bytes of data.
    pub fn has_payload(&self) -> bool {
        self.cmd == Cmd::Write
    }

    /// Client: appends the header. A WRITE's `length` bytes of data go right after it.
    pub fn encode(&self, buf: &mut BytesMut) {
        buf.put_slice(&self.to_bytes());
    }

    /// Client: the header as an array, for a client that queues headers without a buffer.
    pub fn to_bytes(&self) -> [u8; REQUEST_LEN] {
        let mut out = [0u8; REQUEST_LEN];
        let mut b = &mut out[..];
        b.put_u32(NBD_REQUEST_MAGIC);
        b.put_u16(self.flags);
        b.put_u16(self.cmd.into());
        b.put_u64(self.cookie);
        b.put_u64(self.offset);
        b.put_u32(self.length);
        out
    }
}

/// Server: takes one request header off the front of `buf`, and leaves a WRITE's payload
/// there for the caller to take (it must check `length` against its own limit first).
///
/// `Ok(None)`: fewer than 28 bytes so far; `buf` is untouched. `Err(BadMagic)`: the stream
/// lost its framing, and the server hangs up. Unknown commands are not errors.
pub fn decode_request(buf: &mut BytesMut) -> Result<Option<Request>, Error> {
    let request = peek_request(buf)?;
    if request.is_some() {
        buf.advance(REQUEST_LEN);
    }
    Ok(request)
}

/// The request header at the front of `buf`, without consuming it.
fn peek_request(buf: &[u8]) -> Result<Option<Request>, Error> {
    if let Some(magic) = peek_u32(buf, 0) {
        if magic != NBD_REQUEST_MAGIC {
            return Err(Error::BadMagic { what: "request", found: magic.into() });
        }
    }
    let Some(b) = peek::<REQUEST_LEN>(buf) else {
        return Ok(None);
    };
    let mut b = &b[4..];
    Ok(Some(Request {
        flags: b.get_u16(),
        cmd: b.get_u16().into(),
        cookie: b.get_u64(),
        offset: b.get_u64(),
        length: b.get_u32(),
    }))
}

/// Server: takes one request and, for a WRITE, its whole payload off the front of `buf`;
/// the payload is empty for every other command.
///
/// `max_write` bounds a WRITE's length (the maximum payload the server advertised, or
/// [`DEFAULT_MAX_PAYLOAD`](super::DEFAULT_MAX_PAYLOAD)): a larger one is `Err(TooLong)`
/// before a byte of it is buffered, and the server hangs up, as the spec allows for a
/// payload "deemed a denial of service". `Ok(None)`: header or payload incomplete; `buf` is
/// untouched, with room reserved for the rest.
pub fn decode_request_with_payload(
    buf: &mut BytesMut,
    max_write: u32,
) -> Result<Option<(Request, Bytes)>, Error> {
    let Some(request) = peek_request(buf)? else {
        return Ok(None);
    };
    let payload = if request.has_payload() { request.length } else { 0 };
    if payload > max_write {
        let (len, max) = (payload.into(), max_write.into());
        return Err(Error::TooLong { what: "write payload", len, max });
    }
    let total = REQUEST_LEN + payload as usize;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    buf.advance(REQUEST_LEN);
    Ok(Some((request, buf.split_to(payload as usize).freeze())))
}

/// Takes `len` bytes of payload (a WRITE's data after [`decode_request`], a simple READ
/// reply's data after [`decode_reply`](super::decode_reply)) off the front of `buf`, once
/// they have all arrived. `len` must already be checked against the caller's limit: room
/// for all of it is reserved.
pub fn take_payload(buf: &mut BytesMut, len: usize) -> Option<Bytes> {
    if buf.len() < len {
        buf.reserve(len - buf.len());
        return None;
    }
    Some(buf.split_to(len).freeze())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip() {
        for code in 0..=u16::MAX {
            assert_eq!(u16::from(Cmd::from(code)), code);
        }
        assert_eq!(Cmd::from(8), Cmd::Unknown(8));
    }

    #[test]
    fn write_payload_over_the_limit_is_refused_from_the_header() {
        let mut buf = BytesMut::new();
        let request = Request { flags: 0, cmd: Cmd::Write, cookie: 1, offset: 0, length: u32::MAX };
        request.encode(&mut buf);
        let err = decode_request_with_payload(&mut buf, 1 << 20).unwrap_err();
        assert!(matches!(err, Error::TooLong { len: 0xffff_ffff, .. }), "{err:?}");
        assert!(buf.capacity() < 1 << 20);
    }

    #[test]
    fn long_reads_carry_no_payload() {
        let mut buf = BytesMut::new();
        let read = Request { flags: 0, cmd: Cmd::Read, cookie: 1, offset: 0, length: u32::MAX };
        read.encode(&mut buf);
        let (got, payload) = decode_request_with_payload(&mut buf, 0).unwrap().unwrap();
        assert_eq!((got, payload.len(), buf.len()), (read, 0, 0));
    }
}
