//! Option requests: what a client sends during haggling, framed on the wire as
//! [`OptionRequest`] and parsed into a typed [`Opt`].
//!
//! ```text
//!  0          8        12       16
//!  ├ IHAVEOPT ┼ option ┼ length ┼ data (length bytes) …
//! ```
//!
//! Framing and parsing are two steps because their failures differ: a bad magic or an
//! oversized length leaves the stream unreadable (the server hangs up), while bad data
//! inside a well-delimited option is answered with `NBD_REP_ERR_INVALID` and the server
//! reads the next option.

use bytes::{Buf, BufMut, Bytes, BytesMut};

use super::wire::{peek_u32, peek_u64, put_string_u32, strict_string, LengthPatch, Reader};
use super::{Error, IHAVEOPT, MAX_OPTION_LEN};
use super::{NBD_OPT_ABORT, NBD_OPT_EXPORT_NAME, NBD_OPT_EXTENDED_HEADERS, NBD_OPT_GO};
use super::{NBD_OPT_INFO, NBD_OPT_LIST, NBD_OPT_LIST_META_CONTEXT, NBD_OPT_PEEK_EXPORT};
use super::{NBD_OPT_SET_META_CONTEXT, NBD_OPT_STARTTLS, NBD_OPT_STRUCTURED_REPLY};

/// Bytes of an option request before its data.
pub const OPTION_HEADER_LEN: usize = 16;

/// One option request as framed on the wire, its data not parsed yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OptionRequest {
    /// The option code (`NBD_OPT_*`), kept raw: every reply echoes it, known or not.
    pub option: u32,
    /// The option data (at most [`MAX_OPTION_LEN`] bytes when decoded).
    pub data: Bytes,
}

impl OptionRequest {
    /// Appends this option as it is, magic and length included.
    pub fn encode(&self, buf: &mut BytesMut) {
        buf.reserve(OPTION_HEADER_LEN + self.data.len());
        buf.put_u64(IHAVEOPT);
        buf.put_u32(self.option);
        buf.put_u32(self.data.len() as u32);
        buf.put_slice(&self.data);
    }
}

/// Server: takes one option request off the front of `buf`.
///
/// `Ok(None)`: not all of it has arrived; `buf` is untouched, with room reserved for the
/// rest. `Err(BadMagic)` or `Err(TooLong)` (data over [`MAX_OPTION_LEN`]): the stream
/// cannot be followed any further, and the server hangs up.
pub fn decode_option(buf: &mut BytesMut) -> Result<Option<OptionRequest>, Error> {
    if let Some(magic) = peek_u64(buf, 0) {
        if magic != IHAVEOPT {
            return Err(Error::BadMagic { what: "option", found: magic });
        }
    }
    let (Some(option), Some(len)) = (peek_u32(buf, 8), peek_u32(buf, 12)) else {
        return Ok(None);
    };
    if len as usize > MAX_OPTION_LEN {
        return Err(Error::TooLong {
            what: "option data",
            len: len.into(),
            max: MAX_OPTION_LEN as u64,
        });
    }
    let total = OPTION_HEADER_LEN + len as usize;
    if buf.len() < total {
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    let mut message = buf.split_to(total);
    message.advance(OPTION_HEADER_LEN);
    Ok(Some(OptionRequest { option, data: message.freeze() }))
}

/// The data of `NBD_OPT_INFO` and `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ExportOpt {
    /// The export; empty for the default export.
    pub name: String,
    /// The `NBD_INFO_*` items the client asks for, in its order (unknown ones included:
    /// the server ignores what it does not understand).
    pub info_requests: Vec<u16>,
}

/// The data of `NBD_OPT_LIST_META_CONTEXT` and `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MetaContextOpt {
    /// The export the contexts are for.
    pub export: String,
    /// The queries (`base:allocation`, `base:`, …); their syntax past the namespace and
    /// colon is the namespace's business, so they are not checked here.
    pub queries: Vec<String>,
}

/// An option request, parsed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Opt {
    /// `NBD_OPT_EXPORT_NAME`: enter transmission with this export (empty: the default).
    /// The server cannot refuse with a reply, only hang up.
    ExportName(String),
    /// `NBD_OPT_ABORT`: the client ends the session; any data is ignored, as the spec asks.
    Abort,
    /// `NBD_OPT_LIST`: list the exports.
    List,
    /// `NBD_OPT_STARTTLS`: upgrade to TLS.
    StartTls,
    /// `NBD_OPT_INFO`: describe an export.
    Info(ExportOpt),
    /// `NBD_OPT_GO`: describe an export and enter transmission.
    Go(ExportOpt),
    /// `NBD_OPT_STRUCTURED_REPLY`: use structured replies.
    StructuredReply,
    /// `NBD_OPT_LIST_META_CONTEXT`: which contexts match these queries. The spec says it
    /// SHOULD follow a successful STRUCTURED_REPLY; that check is the server's.
    ListMetaContext(MetaContextOpt),
    /// `NBD_OPT_SET_META_CONTEXT`: select contexts for BLOCK_STATUS. It MUST follow a
    /// successful STRUCTURED_REPLY; that check is the server's.
    SetMetaContext(MetaContextOpt),
    /// An option this crate does not parse (PEEK_EXPORT, EXTENDED_HEADERS, or a code the
    /// spec does not define): a server answers `NBD_REP_ERR_UNSUP`.
    Unknown {
        /// The option code.
        option: u32,
        /// Its data.
        data: Bytes,
    },
}

impl Opt {
    /// The option code this option travels under.
    pub fn code(&self) -> u32 {
        match self {
            Opt::ExportName(_) => NBD_OPT_EXPORT_NAME,
            Opt::Abort => NBD_OPT_ABORT,
            Opt::List => NBD_OPT_LIST,
            Opt::StartTls => NBD_OPT_STARTTLS,
            Opt::Info(_) => NBD_OPT_INFO,
            Opt::Go(_) => NBD_OPT_GO,
            Opt::StructuredReply => NBD_OPT_STRUCTURED_REPLY,
            Opt::ListMetaContext(_) => NBD_OPT_LIST_META_CONTEXT,
            Opt::SetMetaContext(_) => NBD_OPT_SET_META_CONTEXT,
            Opt::Unknown { option, .. } => *option,
        }
    }

    /// Parses an option's data.
    ///
    /// `Err` means the option is malformed (a name longer than the data, trailing bytes,
    /// data on an option that takes none, a string that is not UTF-8, contains NUL or is
    /// over 4096 bytes): the server answers `NBD_REP_ERR_INVALID` with `request.option`
    /// (after EXPORT_NAME, which cannot be answered, it hangs up). Unknown codes are not
    /// errors: they parse as [`Opt::Unknown`].
    pub fn parse(request: &OptionRequest) -> Result<Opt, Error> {
        let mut r = Reader::new(request.data.clone());
        let opt = match request.option {
            NBD_OPT_EXPORT_NAME => return Ok(Opt::ExportName(parse_export_name(&request.data)?)),
            NBD_OPT_ABORT => return Ok(Opt::Abort),
            NBD_OPT_LIST => Opt::List,
            NBD_OPT_STARTTLS => Opt::StartTls,
            NBD_OPT_INFO => Opt::Info(parse_export_opt(&mut r)?),
            NBD_OPT_GO => Opt::Go(parse_export_opt(&mut r)?),
            NBD_OPT_STRUCTURED_REPLY => Opt::StructuredReply,
            NBD_OPT_LIST_META_CONTEXT => Opt::ListMetaContext(parse_meta_context_opt(&mut r)?),
            NBD_OPT_SET_META_CONTEXT => Opt::SetMetaContext(parse_meta_context_opt(&mut r)?),
            option => return Ok(Opt::Unknown { option, data: request.data.clone() }),
        };
        r.finish(option_name(request.option))?;
        Ok(opt)
    }

    /// Client: appends this option, magic and length included. Values are written as
    /// given: a name over 4096 bytes, more than 65535 info requests, or data over
    /// [`MAX_OPTION_LEN`] make an option that a server (and [`Opt::parse`]) refuses.
    pub fn encode(&self, buf: &mut BytesMut) {
        buf.put_u64(IHAVEOPT);
        buf.put_u32(self.code());
        let len = LengthPatch::begin(buf);
        match self {
            Opt::ExportName(name) => buf.put_slice(name.as_bytes()),
            Opt::Abort | Opt::List | Opt::StartTls | Opt::StructuredReply => {}
            Opt::Info(export) | Opt::Go(export) => {
                put_string_u32(buf, &export.name);
                buf.put_u16(export.info_requests.len() as u16);
                for info in &export.info_requests {
                    buf.put_u16(*info);
                }
            }
            Opt::ListMetaContext(meta) | Opt::SetMetaContext(meta) => {
                put_string_u32(buf, &meta.export);
                buf.put_u32(meta.queries.len() as u32);
                for query in &meta.queries {
                    put_string_u32(buf, query);
                }
            }
            Opt::Unknown { data, .. } => buf.put_slice(data),
        }
        len.finish(buf);
    }
}

/// A name for an option code, for logs and metrics labels: `"go"`, `"list"`, … or
/// `"unknown"`.
pub fn option_name(option: u32) -> &'static str {
    match option {
        NBD_OPT_EXPORT_NAME => "export_name",
        NBD_OPT_ABORT => "abort",
        NBD_OPT_LIST => "list",
        NBD_OPT_PEEK_EXPORT => "peek_export",
        NBD_OPT_STARTTLS => "starttls",
        NBD_OPT_INFO => "info",
        NBD_OPT_GO => "go",
        NBD_OPT_STRUCTURED_REPLY => "structured_reply",
        NBD_OPT_LIST_META_CONTEXT => "list_meta_context",
        NBD_OPT_SET_META_CONTEXT => "set_meta_context",
        NBD_OPT_EXTENDED_HEADERS => "extended_headers",
        _ => "unknown",
    }
}

/// EXPORT_NAME: the whole data is the name.
fn parse_export_name(data: &[u8]) -> Result<String, Error> {
    strict_string(data, "export name")
}

/// INFO and GO: u32 name length, name, u16 count, count × u16 info types.
fn parse_export_opt(r: &mut Reader) -> Result<ExportOpt, Error> {
    let name = r.string_u32("export name")?;
    let count = r.u16("info request count")? as usize;
    // Checked before allocating, though the count is 16-bit and the data capped anyway.
    if count * 2 > r.remaining() {
        return Err(Error::Truncated("info requests"));
    }
    let mut info_requests = Vec::with_capacity(count);
    for _ in 0..count {
        info_requests.push(r.u16("info request")?);
    }
    Ok(ExportOpt { name, info_requests })
}

/// LIST_META_CONTEXT and SET_META_CONTEXT: u32 export length, export, u32 count, then
/// count × (u32 length, query).
fn parse_meta_context_opt(r: &mut Reader) -> Result<MetaContextOpt, Error> {
    let export = r.string_u32("export name")?;
    let count = r.u32("query count")? as usize;
    // Each query takes at least its 4-byte length: a count beyond that is a lie, refused
    // before it can size an allocation.
    if count > r.remaining() / 4 {
        return Err(Error::Truncated("meta context queries"));
    }
    let mut queries = Vec::with_capacity(count);
    for _ in 0..count {
        queries.push(r.string_u32("meta context query")?);
    }
    Ok(MetaContextOpt { export, queries })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(option: u32, data: &[u8]) -> OptionRequest {
        OptionRequest { option, data: Bytes::copy_from_slice(data) }
    }

    #[test]
    fn go_name_longer_than_the_data_is_truncated() {
        let mut data = 10u32.to_be_bytes().to_vec();
        data.extend(b"abc\0\0");
        let err = Opt::parse(&request(NBD_OPT_GO, &data)).unwrap_err();
        assert_eq!(err, Error::Truncated("export name"));
    }

    #[test]
    fn list_with_data_is_malformed_abort_with_data_is_not() {
        let err = Opt::parse(&request(NBD_OPT_LIST, b"x")).unwrap_err();
        assert!(matches!(err, Error::Trailing { extra: 1, .. }), "{err:?}");
        assert_eq!(Opt::parse(&request(NBD_OPT_ABORT, b"x")), Ok(Opt::Abort));
    }

    #[test]
    fn a_huge_query_count_is_refused_before_allocating() {
        let mut data = 0u32.to_be_bytes().to_vec();
        data.extend(u32::MAX.to_be_bytes());
        let err = Opt::parse(&request(NBD_OPT_SET_META_CONTEXT, &data)).unwrap_err();
        assert_eq!(err, Error::Truncated("meta context queries"));
    }

    #[test]
    fn oversized_option_is_refused_from_its_header() {
        let mut buf = BytesMut::new();
        buf.put_u64(IHAVEOPT);
        buf.put_u32(NBD_OPT_GO);
        buf.put_u32(MAX_OPTION_LEN as u32 + 1);
        assert!(matches!(decode_option(&mut buf), Err(Error::TooLong { .. })));
        assert!(buf.capacity() < 1024, "nothing reserved for a refused length");
    }
}
