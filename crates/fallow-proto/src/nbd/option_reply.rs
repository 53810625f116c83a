//! Option replies: what a server answers during haggling, framed on the wire as
//! [`RawOptionReply`] and parsed into a typed [`OptionReply`].
//!
//! ```text
//!  0               8        12           16       20
//!  ├ NBD_REP_MAGIC ┼ option ┼ reply type ┼ length ┼ data (length bytes) …
//!
//!  NBD_REP_SERVER        u32 name length, name, description (the rest)
//!  NBD_REP_INFO          u16 info type, then: EXPORT  u64 size, u16 transmission flags
//!                                             NAME / DESCRIPTION  the string (the rest)
//!                                             BLOCK_SIZE  u32 min, preferred, max payload
//!  NBD_REP_META_CONTEXT  u32 context id, name (the rest)
//!  NBD_REP_ERR_*         an optional message (the rest)
//! ```
//!
//! One option may draw several replies (LIST: a SERVER per export; INFO/GO: INFO items;
//! the META_CONTEXT options: a META_CONTEXT per context); the last is an ACK or an error
//! ([`OptionReply::is_final`]).

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::wire::{lossy_string, peek_u32, peek_u64, put_string_u32, strict_string};
use super::wire::{truncate_message, LengthPatch, Reader};
use super::{Error, DEFAULT_MAX_PAYLOAD, MAX_OPTION_LEN, NBD_REP_MAGIC};
use super::{NBD_INFO_BLOCK_SIZE, NBD_INFO_DESCRIPTION, NBD_INFO_EXPORT, NBD_INFO_NAME};
use super::{NBD_REP_ACK, NBD_REP_INFO, NBD_REP_META_CONTEXT, NBD_REP_SERVER};
use super::{NBD_REP_ERR_BLOCK_SIZE_REQD, NBD_REP_ERR_INVALID, NBD_REP_ERR_PLATFORM};
use super::{NBD_REP_ERR_POLICY, NBD_REP_ERR_SHUTDOWN, NBD_REP_ERR_TLS_REQD};
use super::{NBD_REP_ERR_TOO_BIG, NBD_REP_ERR_UNKNOWN, NBD_REP_ERR_UNSUP, NBD_REP_FLAG_ERROR};

/// Bytes of an option reply before its data.
pub const OPTION_REPLY_HEADER_LEN: usize = 20;

/// One option reply as framed on the wire, its data not parsed yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawOptionReply {
    /// The option this answers, echoed as the client sent it.
    pub option: u32,
    /// The reply type (`NBD_REP_*`).
    pub reply_type: u32,
    /// The reply data (at most [`MAX_OPTION_LEN`] bytes when decoded).
    pub data: Bytes,
}

impl RawOptionReply {
    /// Appends this reply as it is, magic and length included.
    pub fn encode(&self, buf: &mut BytesMut) {
        buf.reserve(OPTION_REPLY_HEADER_LEN + self.data.len());
        buf.put_u64(NBD_REP_MAGIC);
        buf.put_u32(self.option);
        buf.put_u32(self.reply_type);
        buf.put_u32(self.data.len() as u32);
        buf.put_slice(&self.data);
    }
}

/// Client: takes one option reply off the front of `buf`.
///
/// `Ok(None)`: not all of it has arrived; `buf` is untouched, with room reserved for the
/// rest. `Err(BadMagic)` or `Err(TooLong)` (data over [`MAX_OPTION_LEN`]): the client hangs
/// up.
pub fn decode_option_reply(buf: &mut BytesMut) -> Result<Option<RawOptionReply>, Error> {
    if let Some(magic) = peek_u64(buf, 0) {
        if magic != NBD_REP_MAGIC {
            return Err(Error::BadMagic { what: "option reply", found: magic });
        }
    }
    let (Some(option), Some(reply_type), Some(len)) =
        (peek_u32(buf, 8), peek_u32(buf, 12), peek_u32(buf, 16))
    else {
        return Ok(None);
    };
    if len as usize > MAX_OPTION_LEN {
        let max = MAX_OPTION_LEN as u64;
        return Err(Error::TooLong { what: "option reply data", len: len.into(), max });
    }
    let total = OPTION_REPLY_HEADER_LEN + len as usize;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let mut message = buf.split_to(total);
    message.advance(OPTION_REPLY_HEADER_LEN);
    Ok(Some(RawOptionReply { option, reply_type, data: message.freeze() }))
}

/// Block-size constraints (`NBD_INFO_BLOCK_SIZE`), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSize {
    /// The smallest addressable length and alignment.
    pub min: u32,
    /// The size at and above which aligned requests are efficient.
    pub preferred: u32,
    /// The largest payload the server takes in one request (`u32::MAX`: no fixed limit).
    pub max: u32,
}

impl BlockSize {
    /// The constraints a server should support when it advertises none: minimum 1,
    /// preferred 4096, maximum payload 2^25.
    pub const DEFAULT: BlockSize = BlockSize { min: 1, preferred: 4096, max: DEFAULT_MAX_PAYLOAD };

    /// Whether these values obey the spec: `min` a power of two no larger than 64 KiB,
    /// `preferred` a power of two at least `max(min, 512)`, `max` at least `preferred`.
    /// The decoder returns what the server sent; a client checks this before relying on it.
    pub fn is_valid(&self) -> bool {
        self.min.is_power_of_two()
            && self.min <= 1 << 16
            && self.preferred.is_power_of_two()
            && self.preferred >= self.min.max(512)
            && self.max >= self.preferred
    }
}

/// One `NBD_REP_INFO` item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Info {
    /// `NBD_INFO_EXPORT`: required before a successful ACK.
    Export {
        /// Size of the export in bytes.
        size: u64,
        /// Transmission flags.
        flags: u16,
    },
    /// `NBD_INFO_NAME`: the canonical name of the export.
    Name(String),
    /// `NBD_INFO_DESCRIPTION`: a description for humans (invalid UTF-8 is replaced).
    Description(String),
    /// `NBD_INFO_BLOCK_SIZE`.
    BlockSize(BlockSize),
    /// An information type this crate does not know: a client ignores it.
    Unknown {
        /// The information type.
        info_type: u16,
        /// Its payload (after the type).
        data: Bytes,
    },
}

impl Info {
    /// The `NBD_INFO_*` type of this item.
    pub fn info_type(&self) -> u16 {
        match self {
            Info::Export { .. } => NBD_INFO_EXPORT,
            Info::Name(_) => NBD_INFO_NAME,
            Info::Description(_) => NBD_INFO_DESCRIPTION,
            Info::BlockSize(_) => NBD_INFO_BLOCK_SIZE,
            Info::Unknown { info_type, .. } => *info_type,
        }
    }
}

/// An option reply error (`NBD_REP_ERR_*`: reply types with bit 31 set).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RepError {
    /// `NBD_REP_ERR_UNSUP`: the option is unknown to the server.
    Unsup,
    /// `NBD_REP_ERR_POLICY`: policy forbids the option.
    Policy,
    /// `NBD_REP_ERR_INVALID`: the option is invalid.
    Invalid,
    /// `NBD_REP_ERR_PLATFORM`: not supported on this platform or build.
    Platform,
    /// `NBD_REP_ERR_TLS_REQD`: TLS first.
    TlsReqd,
    /// `NBD_REP_ERR_UNKNOWN`: the export is not available.
    UnknownExport,
    /// `NBD_REP_ERR_SHUTDOWN`: the server is shutting down.
    Shutdown,
    /// `NBD_REP_ERR_BLOCK_SIZE_REQD`: request `NBD_INFO_BLOCK_SIZE` first.
    BlockSizeReqd,
    /// `NBD_REP_ERR_TOO_BIG`: the request or reply is too large.
    TooBig,
    /// Another error code (bit 31 set), such as `NBD_REP_ERR_EXT_HEADER_REQD`.
    Other(u32),
}

impl From<RepError> for u32 {
    fn from(error: RepError) -> u32 {
        match error {
            RepError::Unsup => NBD_REP_ERR_UNSUP,
            RepError::Policy => NBD_REP_ERR_POLICY,
            RepError::Invalid => NBD_REP_ERR_INVALID,
            RepError::Platform => NBD_REP_ERR_PLATFORM,
            RepError::TlsReqd => NBD_REP_ERR_TLS_REQD,
            RepError::UnknownExport => NBD_REP_ERR_UNKNOWN,
            RepError::Shutdown => NBD_REP_ERR_SHUTDOWN,
            RepError::BlockSizeReqd => NBD_REP_ERR_BLOCK_SIZE_REQD,
            RepError::TooBig => NBD_REP_ERR_TOO_BIG,
            RepError::Other(code) => code,
        }
    }
}

impl TryFrom<u32> for RepError {
    /// The code, when bit 31 (`NBD_REP_FLAG_ERROR`) is clear: it is not an error.
    type Error = u32;

    fn try_from(code: u32) -> Result<RepError, u32> {
        Ok(match code {
            NBD_REP_ERR_UNSUP => RepError::Unsup,
            NBD_REP_ERR_POLICY => RepError::Policy,
            NBD_REP_ERR_INVALID => RepError::Invalid,
            NBD_REP_ERR_PLATFORM => RepError::Platform,
            NBD_REP_ERR_TLS_REQD => RepError::TlsReqd,
            NBD_REP_ERR_UNKNOWN => RepError::UnknownExport,
            NBD_REP_ERR_SHUTDOWN => RepError::Shutdown,
            NBD_REP_ERR_BLOCK_SIZE_REQD => RepError::BlockSizeReqd,
            NBD_REP_ERR_TOO_BIG => RepError::TooBig,
            code if code & NBD_REP_FLAG_ERROR != 0 => RepError::Other(code),
            code => return Err(code),
        })
    }
}

/// An option reply, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionReply {
    /// `NBD_REP_ACK`: success, or the end of a list.
    Ack,
    /// `NBD_REP_SERVER`: one export, in answer to LIST.
    Server {
        /// The export name, as GO or EXPORT_NAME expect it.
        name: String,
        /// Text for humans after the name (often empty; invalid UTF-8 is replaced).
        description: String,
    },
    /// `NBD_REP_INFO`: one item about an export, in answer to INFO or GO.
    Info(Info),
    /// `NBD_REP_META_CONTEXT`: one context, in answer to LIST_META_CONTEXT (id 0) or
    /// SET_META_CONTEXT (the id BLOCK_STATUS chunks will carry).
    MetaContext {
        /// The context id.
        id: u32,
        /// The context name (`base:allocation`).
        name: String,
    },
    /// An `NBD_REP_ERR_*` reply, with its optional message (empty when there is none;
    /// invalid UTF-8 is replaced; the encoder cuts it to 4096 bytes).
    Error {
        /// Which error.
        error: RepError,
        /// For humans.
        message: String,
    },
    /// A reply type without bit 31 that this crate does not know: a client cannot follow
    /// such a server and hangs up.
    Unknown {
        /// The reply type.
        reply_type: u32,
        /// Its data.
        data: Bytes,
    },
}

impl OptionReply {
    /// The `NBD_REP_*` type this reply travels under.
    pub fn reply_type(&self) -> u32 {
        match self {
            OptionReply::Ack => NBD_REP_ACK,
            OptionReply::Server { .. } => NBD_REP_SERVER,
            OptionReply::Info(_) => NBD_REP_INFO,
            OptionReply::MetaContext { .. } => NBD_REP_META_CONTEXT,
            OptionReply::Error { error, .. } => (*error).into(),
            OptionReply::Unknown { reply_type, .. } => *reply_type,
        }
    }

    /// True for the replies that end the server's answer to an option: ACK and errors.
    pub fn is_final(&self) -> bool {
        matches!(self, OptionReply::Ack | OptionReply::Error { .. })
    }

    /// Parses a reply's data.
    ///
    /// `Err` when the data does not fit its type (an ACK with data, an INFO_EXPORT that is
    /// not 12 bytes, a name length past the end, a name that is not UTF-8): the server
    /// broke the protocol and the client hangs up. Unknown info and reply types are not
    /// errors: they parse as `Unknown` values.
    pub fn parse(raw: &RawOptionReply) -> Result<OptionReply, Error> {
        let mut r = Reader::new(raw.data.clone());
        let reply = match raw.reply_type {
            NBD_REP_ACK => OptionReply::Ack,
            NBD_REP_SERVER => {
                let name = r.string_u32("export name")?;
                OptionReply::Server { name, description: lossy_string(&r.rest()) }
            }
            NBD_REP_INFO => OptionReply::Info(parse_info(&mut r)?),
            NBD_REP_META_CONTEXT => {
                let id = r.u32("meta context id")?;
                OptionReply::MetaContext { id, name: strict_string(&r.rest(), "context name")? }
            }
            code => match RepError::try_from(code) {
                Ok(error) => OptionReply::Error { error, message: lossy_string(&r.rest()) },
                Err(reply_type) => OptionReply::Unknown { reply_type, data: r.rest() },
            },
        };
        r.finish("option reply")?;
        Ok(reply)
    }

    /// Server: appends this reply to `option` (the code the client sent, echoed).
    pub fn encode(&self, option: u32, buf: &mut BytesMut) {
        buf.put_u64(NBD_REP_MAGIC);
        buf.put_u32(option);
        buf.put_u32(self.reply_type());
        let len = LengthPatch::begin(buf);
        match self {
            OptionReply::Ack => {}
            OptionReply::Server { name, description } => {
                put_string_u32(buf, name);
                buf.put_slice(truncate_message(description).as_bytes());
            }
            OptionReply::Info(info) => encode_info(info, buf),
            OptionReply::MetaContext { id, name } => {
                buf.put_u32(*id);
                buf.put_slice(name.as_bytes());
            }
            OptionReply::Error { message, .. } => {
                buf.put_slice(truncate_message(message).as_bytes());
            }
            OptionReply::Unknown { data, .. } => buf.put_slice(data),
        }
        len.finish(buf);
    }
}

fn parse_info(r: &mut Reader) -> Result<Info, Error> {
    Ok(match r.u16("info type")? {
        NBD_INFO_EXPORT => Info::Export { size: r.u64("export size")?, flags: r.u16("flags")? },
        NBD_INFO_NAME => Info::Name(strict_string(&r.rest(), "export name")?),
        NBD_INFO_DESCRIPTION => Info::Description(lossy_string(&r.rest())),
        NBD_INFO_BLOCK_SIZE => Info::BlockSize(BlockSize {
            min: r.u32("minimum block size")?,
            preferred: r.u32("preferred block size")?,
            max: r.u32("maximum payload size")?,
        }),
        info_type => Info::Unknown { info_type, data: r.rest() },
    })
}

fn encode_info(info: &Info, buf: &mut BytesMut) {
    buf.put_u16(info.info_type());
    match info {
        Info::Export { size, flags } => {
            buf.put_u64(*size);
            buf.put_u16(*flags);
        }
        Info::Name(name) => buf.put_slice(name.as_bytes()),
        Info::Description(text) => buf.put_slice(truncate_message(text).as_bytes()),
        Info::BlockSize(sizes) => {
            buf.put_u32(sizes.min);
            buf.put_u32(sizes.preferred);
            buf.put_u32(sizes.max);
        }
        Info::Unknown { data, .. } => buf.put_slice(data),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(reply_type: u32, data: &[u8]) -> RawOptionReply {
        RawOptionReply { option: 7, reply_type, data: Bytes::copy_from_slice(data) }
    }

    #[test]
    fn info_export_must_be_exactly_ten_bytes_after_the_type() {
        let mut data = vec![0, 0];
        data.extend([0; 9]);
        assert_eq!(OptionReply::parse(&raw(NBD_REP_INFO, &data)), Err(Error::Truncated("flags")));
        data.extend([0; 2]);
        let err = OptionReply::parse(&raw(NBD_REP_INFO, &data)).unwrap_err();
        assert!(matches!(err, Error::Trailing { extra: 1, .. }), "{err:?}");
    }

    #[test]
    fn unknown_error_codes_stay_errors() {
        let reply = OptionReply::parse(&raw(NBD_REP_FLAG_ERROR | 77, b"hi")).unwrap();
        let error = RepError::Other(NBD_REP_FLAG_ERROR | 77);
        assert_eq!(reply, OptionReply::Error { error, message: "hi".into() });
        assert!(reply.is_final());
        assert_eq!(RepError::try_from(5), Err(5));
    }

    #[test]
    fn block_size_rules() {
        assert!(BlockSize::DEFAULT.is_valid());
        assert!(BlockSize { min: 4096, preferred: 65536, max: u32::MAX }.is_valid());
        assert!(!BlockSize { min: 3, preferred: 4096, max: 4096 }.is_valid());
        assert!(!BlockSize { min: 1 << 17, preferred: 1 << 17, max: 1 << 20 }.is_valid());
        assert!(!BlockSize { min: 1, preferred: 256, max: 4096 }.is_valid());
        assert!(!BlockSize { min: 512, preferred: 4096, max: 2048 }.is_valid());
    }
}
