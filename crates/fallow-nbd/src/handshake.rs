//! Fixed-newstyle negotiation: one function per option. The result is the export the
//! client chose and what it negotiated (structured replies, the `base:allocation`
//! context), or nothing if it aborted.
//!
//! ```text
//!  S: NBDMAGIC IHAVEOPT flags(FIXED_NEWSTYLE|NO_ZEROES)
//!  C: client flags
//!  C: option ─▶ S: reply … (repeat)
//!     GO / EXPORT_NAME ─▶ transmission        ABORT ─▶ ACK, close
//! ```

use std::sync::Arc;

use bytes::BytesMut;
use fallow_proto::nbd::handshake::{decode_client_flags, encode_greeting};
use fallow_proto::nbd::*;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::export::Export;

/// The id our one metadata context gets.
pub const BASE_ALLOCATION_ID: u32 = 1;

/// What the client chose.
#[derive(Debug)]
pub struct Session {
    /// The export.
    pub export: Arc<Export>,
    /// Structured replies were negotiated.
    pub structured: bool,
    /// `base:allocation` was selected (its id is [`BASE_ALLOCATION_ID`]).
    pub base_allocation: bool,
}

/// Why negotiation ended without a session.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    /// Socket error or end of stream.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// The client broke the protocol (the connection is dropped).
    #[error("protocol error: {0}")]
    Protocol(#[from] Error),
    /// The client aborted or asked for an export that does not exist with EXPORT_NAME.
    #[error("{0}")]
    Ended(String),
}

struct Negotiation<'a, S> {
    stream: &'a mut S,
    input: BytesMut,
    out: BytesMut,
    exports: &'a [Arc<Export>],
    client_flags: u32,
    structured: bool,
    base_allocation: bool,
}

/// Runs the handshake on a fresh connection. `Ok(None)`: the client aborted cleanly.
pub async fn negotiate<S>(
    stream: &mut S,
    exports: &[Arc<Export>],
) -> Result<(Option<Session>, BytesMut), HandshakeError>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let mut n = Negotiation {
        stream,
        input: BytesMut::with_capacity(4096),
        out: BytesMut::with_capacity(4096),
        exports,
        client_flags: 0,
        structured: false,
        base_allocation: false,
    };
    let advertised = NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES;
    encode_greeting(&mut n.out, advertised);
    n.flush().await?;
    n.client_flags = loop {
        if let Some(flags) = decode_client_flags(&mut n.input, advertised)? {
            break flags;
        }
        n.fill().await?;
    };
    if n.client_flags & NBD_FLAG_C_FIXED_NEWSTYLE == 0 {
        return Err(HandshakeError::Ended("client does not speak fixed newstyle".into()));
    }
    loop {
        let request = loop {
            if let Some(request) = decode_option(&mut n.input)? {
                break request;
            }
            n.fill().await?;
        };
        let opt = match Opt::parse(&request) {
            Ok(opt) => opt,
            Err(err) => {
                n.reply(request.option, rep_error(RepError::Invalid, &err.to_string()));
                n.flush().await?;
                continue;
            }
        };
        let code = request.option;
        let done = match opt {
            Opt::Abort => {
                n.reply(code, OptionReply::Ack);
                let _ = n.flush().await;
                return Ok((None, n.input));
            }
            Opt::List => {
                for export in n.exports {
                    let name = export.name.clone();
                    n.reply(
                        code,
                        OptionReply::Server { name, description: export.description.clone() },
                    );
                }
                n.reply(code, OptionReply::Ack);
                None
            }
            Opt::StructuredReply => {
                n.structured = true;
                n.reply(code, OptionReply::Ack);
                None
            }
            Opt::ListMetaContext(meta) | Opt::SetMetaContext(meta) => {
                let set = code == NBD_OPT_SET_META_CONTEXT;
                n.meta_context(code, &meta, set);
                None
            }
            Opt::Info(opt) | Opt::Go(opt) => n.info(code, &opt),
            Opt::ExportName(name) => {
                let Some(export) = n.find(&name) else {
                    return Err(HandshakeError::Ended(format!("no export named {name:?}")));
                };
                let reply =
                    ExportNameReply { size: export.size(), flags: export.transmission_flags() };
                reply.encode(&mut n.out, n.client_flags);
                Some(export)
            }
            Opt::StartTls => {
                n.reply(code, rep_error(RepError::Policy, "TLS is not offered"));
                None
            }
            Opt::Unknown { option, .. } => {
                let message = format!("option {} is not supported", option_name(option));
                n.reply(option, rep_error(RepError::Unsup, &message));
                None
            }
        };
        n.flush().await?;
        if let Some(export) = done {
            let session =
                Session { export, structured: n.structured, base_allocation: n.base_allocation };
            return Ok((Some(session), n.input));
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Negotiation<'_, S> {
    async fn fill(&mut self) -> Result<(), HandshakeError> {
        if self.stream.read_buf(&mut self.input).await? == 0 {
            return Err(HandshakeError::Ended("client closed during negotiation".into()));
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), HandshakeError> {
        self.stream.write_all(&self.out).await?;
        self.out.clear();
        Ok(())
    }

    fn reply(&mut self, option: u32, reply: OptionReply) {
        reply.encode(option, &mut self.out);
    }

    /// The export by name; the empty name is the first export.
    fn find(&self, name: &str) -> Option<Arc<Export>> {
        if name.is_empty() {
            return self.exports.first().cloned();
        }
        self.exports.iter().find(|e| e.name == name).cloned()
    }

    /// INFO and GO: the export's size and flags, its name, description and block sizes
    /// when asked (block sizes always: we have no alignment requirement to hide).
    fn info(&mut self, code: u32, opt: &ExportOpt) -> Option<Arc<Export>> {
        let Some(export) = self.find(&opt.name) else {
            let message = format!("no export named {:?}", opt.name);
            self.reply(code, rep_error(RepError::UnknownExport, &message));
            return None;
        };
        self.reply(
            code,
            OptionReply::Info(Info::Export {
                size: export.size(),
                flags: export.transmission_flags(),
            }),
        );
        if opt.info_requests.contains(&NBD_INFO_NAME) {
            self.reply(code, OptionReply::Info(Info::Name(export.name.clone())));
        }
        if opt.info_requests.contains(&NBD_INFO_DESCRIPTION) && !export.description.is_empty() {
            self.reply(code, OptionReply::Info(Info::Description(export.description.clone())));
        }
        self.reply(code, OptionReply::Info(Info::BlockSize(export.block_size())));
        self.reply(code, OptionReply::Ack);
        (code == NBD_OPT_GO).then_some(export)
    }

    /// LIST_META_CONTEXT and SET_META_CONTEXT: we know one context, `base:allocation`.
    fn meta_context(&mut self, code: u32, meta: &MetaContextOpt, set: bool) {
        if !self.structured {
            self.reply(code, rep_error(RepError::Invalid, "negotiate structured replies first"));
            return;
        }
        let Some(export) = self.find(&meta.export) else {
            let message = format!("no export named {:?}", meta.export);
            self.reply(code, rep_error(RepError::UnknownExport, &message));
            return;
        };
        let wanted = if meta.queries.is_empty() {
            !set // LIST with no query lists everything; SET with none selects nothing
        } else {
            meta.queries.iter().any(|q| q == BASE_ALLOCATION || (!set && q == "base:"))
        };
        let available = export.has_block_status();
        if set {
            self.base_allocation = wanted && available;
        }
        if wanted && available {
            let id = if set { BASE_ALLOCATION_ID } else { 0 };
            self.reply(code, OptionReply::MetaContext { id, name: BASE_ALLOCATION.to_string() });
        }
        self.reply(code, OptionReply::Ack);
    }
}

fn rep_error(error: RepError, message: &str) -> OptionReply {
    OptionReply::Error { error, message: message.to_string() }
}
