//! Transmission replies: the 16-byte simple reply (followed by the data of a successful
//! READ) and structured reply chunks, block-status descriptors included.
//!
//! ```text
//!  simple:      0       4       8        16
//!               ├ magic ┼ error ┼ cookie ┤ READ without error: request length bytes …
//!  structured:  0       4       6      8        16       20
//!               ├ magic ┼ flags ┼ type ┼ cookie ┼ length ┤ payload (length bytes) …
//!
//!  OFFSET_DATA   u64 offset, data (length - 8 bytes, at least 1)
//!  OFFSET_HOLE   u64 offset, u32 hole size (nonzero)
//!  BLOCK_STATUS  u32 context id, then (u32 extent length, u32 status flags) × n, n ≥ 1
//!  ERROR         u32 error, u16 message length, message
//!  ERROR_OFFSET  u32 error, u16 message length, message, u64 offset
//! ```
//!
//! Without structured replies a simple reply does not say whether data follows: only the
//! request it answers does (READ, error 0), so [`decode_reply`] returns the 16-byte header
//! and the client takes the data with [`take_payload`](super::take_payload). A chunk's
//! length is in its header, so [`decode_reply`] takes whole chunks, bounded by the limit
//! the caller passes.
//!
//! A client that wants READ data to go from the socket straight into its own buffer uses
//! [`decode_reply_head`] instead: it takes only the head of a reply (the simple reply, an
//! `OFFSET_DATA` chunk's header and offset, or another chunk's header) and leaves the
//! payload for the caller, who parses a non-data payload with [`ChunkHead::parse_payload`].

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::wire::{lossy_string, peek, peek_u32, peek_u64, truncate_message, Reader};
use super::{Error, NBD_SIMPLE_REPLY_MAGIC, NBD_STRUCTURED_REPLY_MAGIC};
use super::{NBD_REPLY_FLAG_DONE, NBD_REPLY_TYPE_BLOCK_STATUS, NBD_REPLY_TYPE_ERROR};
use super::{NBD_REPLY_TYPE_ERROR_OFFSET, NBD_REPLY_TYPE_FLAG_ERROR, NBD_REPLY_TYPE_NONE};
use super::{NBD_REPLY_TYPE_OFFSET_DATA, NBD_REPLY_TYPE_OFFSET_HOLE};

/// Bytes of a simple reply (before any READ data).
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Bytes of a structured reply chunk header (before its payload).
pub const CHUNK_HEADER_LEN: usize = 20;

/// A simple reply: the only kind without structured replies, and allowed with them for
/// any reply without data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    /// 0 on success, else an `NBD_E*` value.
    pub error: u32,
    /// The cookie of the request this answers.
    pub cookie: u64,
}

impl SimpleReply {
    /// Server: appends the reply. A successful READ's data goes right after it.
    pub fn encode(&self, buf: &mut BytesMut) {
        buf.reserve(SIMPLE_REPLY_LEN);
        buf.put_u32(NBD_SIMPLE_REPLY_MAGIC);
        buf.put_u32(self.error);
        buf.put_u64(self.cookie);
    }
}

/// One block-status descriptor: `length` bytes from where the previous one ended (the first
/// starts at the request's offset) have these status flags (`NBD_STATE_*` for
/// `base:allocation`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes, never 0.
    pub length: u32,
    /// Status flags, as the context defines them.
    pub flags: u32,
}

/// The payload of a structured reply chunk, by type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChunkBody {
    /// `NBD_REPLY_TYPE_NONE`: nothing more; always with `NBD_REPLY_FLAG_DONE`.
    None,
    /// `NBD_REPLY_TYPE_OFFSET_DATA`: data read at `offset` (at least one byte).
    OffsetData {
        /// Absolute offset in the export.
        offset: u64,
        /// The data.
        data: Bytes,
    },
    /// `NBD_REPLY_TYPE_OFFSET_HOLE`: `length` bytes at `offset` read as zeroes.
    OffsetHole {
        /// Absolute offset in the export.
        offset: u64,
        /// Size of the hole, never 0.
        length: u32,
    },
    /// `NBD_REPLY_TYPE_BLOCK_STATUS`: consecutive extents for one metadata context.
    BlockStatus {
        /// The id the server gave the context in SET_META_CONTEXT.
        context_id: u32,
        /// At least one extent.
        extents: Vec<Extent>,
    },
    /// `NBD_REPLY_TYPE_ERROR`: the request failed.
    Error {
        /// An `NBD_E*` value, never 0.
        error: u32,
        /// For humans (may be empty).
        message: String,
    },
    /// `NBD_REPLY_TYPE_ERROR_OFFSET`: the request failed at `offset`.
    ErrorOffset {
        /// An `NBD_E*` value, never 0.
        error: u32,
        /// For humans (may be empty).
        message: String,
        /// Where the error happened.
        offset: u64,
    },
    /// An error chunk type (bit 15 set) this crate does not know. Every error chunk starts
    /// like `NBD_REPLY_TYPE_ERROR`, so the error and message are read; the client treats the
    /// request as failed and may carry on.
    UnknownError {
        /// The chunk type.
        chunk_type: u16,
        /// The error value as sent.
        error: u32,
        /// For humans (may be empty).
        message: String,
        /// Type-specific fields after the message.
        rest: Bytes,
    },
    /// A chunk type (bit 15 clear) this crate does not know: the spec makes the client hang
    /// up.
    Unknown {
        /// The chunk type.
        chunk_type: u16,
        /// The payload.
        data: Bytes,
    },
}

impl ChunkBody {
    /// The `NBD_REPLY_TYPE_*` this body travels under.
    pub fn chunk_type(&self) -> u16 {
        match self {
            ChunkBody::None => NBD_REPLY_TYPE_NONE,
            ChunkBody::OffsetData { .. } => NBD_REPLY_TYPE_OFFSET_DATA,
            ChunkBody::OffsetHole { .. } => NBD_REPLY_TYPE_OFFSET_HOLE,
            ChunkBody::BlockStatus { .. } => NBD_REPLY_TYPE_BLOCK_STATUS,
            ChunkBody::Error { .. } => NBD_REPLY_TYPE_ERROR,
            ChunkBody::ErrorOffset { .. } => NBD_REPLY_TYPE_ERROR_OFFSET,
            ChunkBody::UnknownError { chunk_type, .. } | ChunkBody::Unknown { chunk_type, .. } => {
                *chunk_type
            }
        }
    }

    /// True for error chunks: the request they answer failed (at least in part).
    pub fn is_error(&self) -> bool {
        self.chunk_type() & NBD_REPLY_TYPE_FLAG_ERROR != 0
    }

    /// Bytes of the payload once encoded.
    fn payload_len(&self) -> usize {
        let message_len = |m: &str| truncate_message(m).len();
        match self {
            ChunkBody::None => 0,
            ChunkBody::OffsetData { data, .. } => 8 + data.len(),
            ChunkBody::OffsetHole { .. } => 12,
            ChunkBody::BlockStatus { extents, .. } => 4 + 8 * extents.len(),
            ChunkBody::Error { message, .. } => 6 + message_len(message),
            ChunkBody::ErrorOffset { message, .. } => 14 + message_len(message),
            ChunkBody::UnknownError { message, rest, .. } => 6 + message_len(message) + rest.len(),
            ChunkBody::Unknown { data, .. } => data.len(),
        }
    }
}

/// One structured reply chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chunk {
    /// Reply flags (`NBD_REPLY_FLAG_DONE`); unknown bits are kept (clients ignore them).
    pub flags: u16,
    /// The cookie of the request this answers.
    pub cookie: u64,
    /// The payload.
    pub body: ChunkBody,
}

impl Chunk {
    /// True on the last chunk of a reply.
    pub fn is_done(&self) -> bool {
        self.flags & NBD_REPLY_FLAG_DONE != 0
    }

    /// Server: appends the chunk. Messages are cut to 4096 bytes; the caller keeps to the
    /// rest of the rules (at least one extent, nonzero lengths and errors, DONE on NONE).
    ///
    /// # Panics
    /// If the payload does not fit the 32-bit length field (over 4 GiB of data): a caller
    /// splits reads long before that.
    #[expect(clippy::expect_used, reason = "an encoder's bound on its caller, not on input")]
    pub fn encode(&self, buf: &mut BytesMut) {
        let len = u32::try_from(self.body.payload_len()).expect("chunk payload over 4 GiB");
        buf.reserve(CHUNK_HEADER_LEN + len as usize);
        encode_chunk_header(buf, self.flags, self.body.chunk_type(), self.cookie, len);
        match &self.body {
            ChunkBody::None => {}
            ChunkBody::OffsetData { offset, data } => {
                buf.put_u64(*offset);
                buf.put_slice(data);
            }
            ChunkBody::OffsetHole { offset, length } => {
                buf.put_u64(*offset);
                buf.put_u32(*length);
            }
            ChunkBody::BlockStatus { context_id, extents } => {
                buf.put_u32(*context_id);
                for extent in extents {
                    buf.put_u32(extent.length);
                    buf.put_u32(extent.flags);
                }
            }
            ChunkBody::Error { error, message } => put_error(buf, *error, message),
            ChunkBody::ErrorOffset { error, message, offset } => {
                put_error(buf, *error, message);
                buf.put_u64(*offset);
            }
            ChunkBody::UnknownError { error, message, rest, .. } => {
                put_error(buf, *error, message);
                buf.put_slice(rest);
            }
            ChunkBody::Unknown { data, .. } => buf.put_slice(data),
        }
    }
}

/// Server: appends a chunk header alone; `length` payload bytes must follow.
pub fn encode_chunk_header(
    buf: &mut BytesMut,
    flags: u16,
    chunk_type: u16,
    cookie: u64,
    length: u32,
) {
    buf.reserve(CHUNK_HEADER_LEN);
    buf.put_u32(NBD_STRUCTURED_REPLY_MAGIC);
    buf.put_u16(flags);
    buf.put_u16(chunk_type);
    buf.put_u64(cookie);
    buf.put_u32(length);
}

/// Server: appends the header and offset of an `NBD_REPLY_TYPE_OFFSET_DATA` chunk, so that
/// the caller can copy `data_len` bytes of data straight after it (from its cache, without
/// building a [`Chunk`]).
///
/// # Panics
/// If `data_len` is over `u32::MAX - 8`: the spec makes a server split such a read.
#[expect(clippy::expect_used, reason = "an encoder's bound on its caller, not on input")]
pub fn encode_offset_data_header(
    buf: &mut BytesMut,
    flags: u16,
    cookie: u64,
    offset: u64,
    data_len: u32,
) {
    let length = data_len.checked_add(8).expect("OFFSET_DATA chunk over 4 GiB");
    encode_chunk_header(buf, flags, NBD_REPLY_TYPE_OFFSET_DATA, cookie, length);
    buf.put_u64(offset);
}

fn put_error(buf: &mut BytesMut, error: u32, message: &str) {
    let message = truncate_message(message);
    buf.put_u32(error);
    buf.put_u16(message.len() as u16);
    buf.put_slice(message.as_bytes());
}

/// One reply message from a server in transmission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    /// A simple reply (a READ's data, if any, is still in the buffer).
    Simple(SimpleReply),
    /// A structured reply chunk, payload included.
    Chunk(Chunk),
}

impl Reply {
    /// The cookie of the request this answers.
    pub fn cookie(&self) -> u64 {
        match self {
            Reply::Simple(reply) => reply.cookie,
            Reply::Chunk(chunk) => chunk.cookie,
        }
    }
}

/// Client: takes one simple reply header or one whole structured chunk off the front of
/// `buf`.
///
/// `max_chunk_len` bounds a chunk's payload length: the largest READ the client sends plus
/// 8 (the OFFSET_DATA offset), and no less than the block-status chunks it accepts
/// (4 + 8 × extents). A longer chunk is `Err(TooLong)` before a byte of it is buffered.
///
/// `Ok(None)`: incomplete; `buf` is untouched, with room reserved for the rest of a chunk.
/// `Err`: a bad magic, an oversized chunk, or a payload that breaks its type's rules (wrong
/// length, zero extent length or hole size, zero error, NONE without DONE, a message
/// longer than its chunk); the client hangs up, and what is left in `buf` does not matter.
pub fn decode_reply(buf: &mut BytesMut, max_chunk_len: u32) -> Result<Option<Reply>, Error> {
    let Some(magic) = peek_u32(buf, 0) else {
        return Ok(None);
    };
    match magic {
        NBD_SIMPLE_REPLY_MAGIC => {
            let reply = peek_simple(buf);
            if reply.is_some() {
                buf.advance(SIMPLE_REPLY_LEN);
            }
            Ok(reply.map(Reply::Simple))
        }
        NBD_STRUCTURED_REPLY_MAGIC => decode_chunk(buf, max_chunk_len),
        found => Err(Error::BadMagic { what: "reply", found: found.into() }),
    }
}

fn decode_chunk(buf: &mut BytesMut, max_chunk_len: u32) -> Result<Option<Reply>, Error> {
    let Some(head) = peek_chunk_head(buf) else {
        return Ok(None);
    };
    if head.length > max_chunk_len {
        let (len, max) = (head.length.into(), max_chunk_len.into());
        return Err(Error::TooLong { what: "reply chunk", len, max });
    }
    let total = CHUNK_HEADER_LEN + head.length as usize;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    buf.advance(CHUNK_HEADER_LEN);
    let payload = buf.split_to(head.length as usize).freeze();
    let body = parse_body(head.chunk_type, head.flags, Reader::new(payload))?;
    Ok(Some(Reply::Chunk(Chunk { flags: head.flags, cookie: head.cookie, body })))
}

/// The simple reply at the front of `buf` (whose magic the caller checked), unconsumed.
fn peek_simple(buf: &[u8]) -> Option<SimpleReply> {
    let b = peek::<SIMPLE_REPLY_LEN>(buf)?;
    let mut b = &b[4..];
    Some(SimpleReply { error: b.get_u32(), cookie: b.get_u64() })
}

/// The chunk header at the front of `buf` (whose magic the caller checked), unconsumed.
fn peek_chunk_head(buf: &[u8]) -> Option<ChunkHead> {
    let b = peek::<CHUNK_HEADER_LEN>(buf)?;
    let mut b = &b[4..];
    Some(ChunkHead {
        flags: b.get_u16(),
        chunk_type: b.get_u16(),
        cookie: b.get_u64(),
        length: b.get_u32(),
    })
}

/// The 20-byte header of a structured reply chunk, without its payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkHead {
    /// Reply flags (`NBD_REPLY_FLAG_DONE`); unknown bits are kept (clients ignore them).
    pub flags: u16,
    /// The chunk type (`NBD_REPLY_TYPE_*`).
    pub chunk_type: u16,
    /// The cookie of the request this answers.
    pub cookie: u64,
    /// Bytes of payload after the header.
    pub length: u32,
}

impl ChunkHead {
    /// True on the last chunk of a reply.
    pub fn is_done(&self) -> bool {
        self.flags & NBD_REPLY_FLAG_DONE != 0
    }

    /// Client: parses the payload that followed this header, under the rules of
    /// [`decode_reply`]. `Err` also when `payload` is not `length` bytes long.
    pub fn parse_payload(&self, payload: Bytes) -> Result<ChunkBody, Error> {
        if payload.len() != self.length as usize {
            let why = "not as long as the chunk header says";
            return Err(Error::Invalid { what: "chunk payload", why });
        }
        parse_body(self.chunk_type, self.flags, Reader::new(payload))
    }
}

/// What a client decodes of a reply before its payload (see [`decode_reply_head`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHead {
    /// A simple reply; a successful READ's data (the request's length) follows.
    Simple(SimpleReply),
    /// The header and offset of an `NBD_REPLY_TYPE_OFFSET_DATA` chunk: `data_len` bytes of
    /// data (at least one) follow.
    Data {
        /// Reply flags (`NBD_REPLY_FLAG_DONE`).
        flags: u16,
        /// The cookie of the request this answers.
        cookie: u64,
        /// Absolute offset in the export of the first data byte.
        offset: u64,
        /// Bytes of data that follow.
        data_len: u32,
    },
    /// The header of any other chunk: its `length` bytes of payload follow, for
    /// [`ChunkHead::parse_payload`].
    Chunk(ChunkHead),
}

impl ReplyHead {
    /// The cookie of the request this answers.
    pub fn cookie(&self) -> u64 {
        match self {
            ReplyHead::Simple(reply) => reply.cookie,
            ReplyHead::Data { cookie, .. } => *cookie,
            ReplyHead::Chunk(head) => head.cookie,
        }
    }
}

/// Bytes of an `OFFSET_DATA` chunk before its data: the header and the 64-bit offset.
pub const DATA_HEAD_LEN: usize = CHUNK_HEADER_LEN + 8;

/// Client: takes the head of one reply off the front of `buf` and leaves its payload there
/// (see [`ReplyHead`]): 16 bytes for a simple reply, [`DATA_HEAD_LEN`] for an
/// `OFFSET_DATA` chunk, 20 for any other chunk.
///
/// `max_data_len` bounds the data of an `OFFSET_DATA` chunk (the largest READ the client
/// sends), `max_chunk_len` the payload of any other chunk (the largest the client will
/// buffer whole: block-status descriptors, error messages). A longer claim is
/// `Err(TooLong)` at once, before the caller buffers anything for it.
///
/// `Ok(None)`: the head is incomplete; `buf` is untouched and nothing is reserved (the
/// caller sizes its own buffer). `Err`: a bad magic, a length over its limit, or an
/// `OFFSET_DATA` chunk too short for its offset and one byte of data; the client hangs up.
pub fn decode_reply_head(
    buf: &mut BytesMut,
    max_data_len: u32,
    max_chunk_len: u32,
) -> Result<Option<ReplyHead>, Error> {
    let Some(magic) = peek_u32(buf, 0) else {
        return Ok(None);
    };
    match magic {
        NBD_SIMPLE_REPLY_MAGIC => {
            let reply = peek_simple(buf);
            if reply.is_some() {
                buf.advance(SIMPLE_REPLY_LEN);
            }
            Ok(reply.map(ReplyHead::Simple))
        }
        NBD_STRUCTURED_REPLY_MAGIC => {
            let Some(head) = peek_chunk_head(buf) else {
                return Ok(None);
            };
            if head.chunk_type != NBD_REPLY_TYPE_OFFSET_DATA {
                if head.length > max_chunk_len {
                    let (len, max) = (head.length.into(), max_chunk_len.into());
                    return Err(Error::TooLong { what: "reply chunk", len, max });
                }
                buf.advance(CHUNK_HEADER_LEN);
                return Ok(Some(ReplyHead::Chunk(head)));
            }
            let data_len = match head.length.checked_sub(8) {
                None => return Err(Error::Truncated("data offset")),
                Some(0) => {
                    return Err(Error::Invalid { what: "OFFSET_DATA chunk", why: "no data" })
                }
                Some(n) if n > max_data_len => {
                    let (len, max) = (n.into(), max_data_len.into());
                    return Err(Error::TooLong { what: "reply data", len, max });
                }
                Some(n) => n,
            };
            let Some(offset) = peek_u64(buf, CHUNK_HEADER_LEN) else {
                return Ok(None);
            };
            buf.advance(DATA_HEAD_LEN);
            let (flags, cookie) = (head.flags, head.cookie);
            Ok(Some(ReplyHead::Data { flags, cookie, offset, data_len }))
        }
        found => Err(Error::BadMagic { what: "reply", found: found.into() }),
    }
}

fn parse_body(chunk_type: u16, flags: u16, mut r: Reader) -> Result<ChunkBody, Error> {
    let body = match chunk_type {
        NBD_REPLY_TYPE_NONE => {
            if flags & NBD_REPLY_FLAG_DONE == 0 {
                return Err(Error::Invalid { what: "NONE chunk", why: "DONE flag clear" });
            }
            ChunkBody::None
        }
        NBD_REPLY_TYPE_OFFSET_DATA => {
            let offset = r.u64("data offset")?;
            if r.remaining() == 0 {
                return Err(Error::Invalid { what: "OFFSET_DATA chunk", why: "no data" });
            }
            ChunkBody::OffsetData { offset, data: r.rest() }
        }
        NBD_REPLY_TYPE_OFFSET_HOLE => {
            let offset = r.u64("hole offset")?;
            let length = r.u32("hole size")?;
            if length == 0 {
                return Err(Error::Invalid { what: "hole size", why: "zero" });
            }
            ChunkBody::OffsetHole { offset, length }
        }
        NBD_REPLY_TYPE_BLOCK_STATUS => parse_block_status(&mut r)?,
        NBD_REPLY_TYPE_ERROR => {
            let (error, message) = parse_error(&mut r, true)?;
            ChunkBody::Error { error, message }
        }
        NBD_REPLY_TYPE_ERROR_OFFSET => {
            let (error, message) = parse_error(&mut r, true)?;
            ChunkBody::ErrorOffset { error, message, offset: r.u64("error offset")? }
        }
        chunk_type if chunk_type & NBD_REPLY_TYPE_FLAG_ERROR != 0 => {
            let (error, message) = parse_error(&mut r, false)?;
            ChunkBody::UnknownError { chunk_type, error, message, rest: r.rest() }
        }
        chunk_type => ChunkBody::Unknown { chunk_type, data: r.rest() },
    };
    r.finish("reply chunk")?;
    Ok(body)
}

/// BLOCK_STATUS: u32 context id, then whole 8-byte descriptors, at least one. The
/// descriptors are counted from bytes already received, so the vector is never larger than
/// the chunk the caller agreed to buffer.
fn parse_block_status(r: &mut Reader) -> Result<ChunkBody, Error> {
    let context_id = r.u32("context id")?;
    let count = r.remaining() / 8;
    if count == 0 || !r.remaining().is_multiple_of(8) {
        let why = "payload is not 4 + a positive multiple of 8 bytes";
        return Err(Error::Invalid { what: "BLOCK_STATUS chunk", why });
    }
    let mut extents = Vec::with_capacity(count);
    for _ in 0..count {
        let extent = Extent { length: r.u32("extent length")?, flags: r.u32("extent flags")? };
        if extent.length == 0 {
            return Err(Error::Invalid { what: "extent length", why: "zero" });
        }
        extents.push(extent);
    }
    Ok(ChunkBody::BlockStatus { context_id, extents })
}

/// The fields every error chunk starts with: u32 error, u16 message length, message.
fn parse_error(r: &mut Reader, nonzero: bool) -> Result<(u32, String), Error> {
    let error = r.u32("error value")?;
    if nonzero && error == 0 {
        return Err(Error::Invalid { what: "error chunk", why: "error value 0" });
    }
    let len = r.u16("message length")? as usize;
    Ok((error, lossy_string(&r.bytes(len, "error message")?)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk_bytes(flags: u16, chunk_type: u16, payload: &[u8]) -> BytesMut {
        let mut buf = BytesMut::new();
        encode_chunk_header(&mut buf, flags, chunk_type, 9, payload.len() as u32);
        buf.put_slice(payload);
        buf
    }

    #[test]
    fn zero_length_extents_are_refused() {
        let mut payload = 1u32.to_be_bytes().to_vec();
        payload.extend([0; 8]);
        let mut buf = chunk_bytes(1, NBD_REPLY_TYPE_BLOCK_STATUS, &payload);
        let err = decode_reply(&mut buf, 1024).unwrap_err();
        assert_eq!(err, Error::Invalid { what: "extent length", why: "zero" });
    }

    #[test]
    fn message_length_past_the_chunk_is_truncated() {
        let mut payload = 5u32.to_be_bytes().to_vec();
        payload.extend(10u16.to_be_bytes());
        payload.extend(b"short");
        let mut buf = chunk_bytes(1, NBD_REPLY_TYPE_ERROR, &payload);
        assert_eq!(decode_reply(&mut buf, 1024), Err(Error::Truncated("error message")));
    }

    #[test]
    fn oversized_chunk_is_refused_from_its_header() {
        let mut buf = BytesMut::new();
        encode_chunk_header(&mut buf, 0, NBD_REPLY_TYPE_OFFSET_DATA, 1, u32::MAX);
        assert!(matches!(decode_reply(&mut buf, 1 << 20), Err(Error::TooLong { .. })));
        assert!(buf.capacity() < 1 << 20);
    }
}
