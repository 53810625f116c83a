//! Fixed-newstyle negotiation: one function per option. The result is the export the
//! client chose and what it negotiated (structured replies, the `base:allocation`
//! context), or nothing if it aborted.
//!
//! ```text
//!  S: NBDMAGIC IHAVEOPT flags(FIXED_NEWSTYLE|NO_ZEROES)
//!  C: client flags ─ an unknown bit ─▶ close
//!     ├─ C_FIXED_NEWSTYLE set:   option ─▶ S: reply … (repeat)
//!     │                          STARTTLS ─▶ ACK, TLS handshake, options go on over TLS
//!     │                          GO / EXPORT_NAME ─▶ transmission   ABORT ─▶ ACK, close
//!     └─ not set (plain newstyle): EXPORT_NAME ─▶ transmission; any other option ─▶ close
//! ```
//!
//! # Clients without fixed newstyle
//!
//! The NBD spec ("Client flags") lets a server honour fixed newstyle from a client that did
//! not set `NBD_FLAG_C_FIXED_NEWSTYLE`, but advises against relying on it: such a client
//! may not understand option replies. So it gets plain newstyle, where
//! `NBD_OPT_EXPORT_NAME` is "the only valid option" and has no error reply: the first
//! option must be EXPORT_NAME naming an export, or the server hangs up without a reply.
//! Unknown client flags (or `NBD_FLAG_C_NO_ZEROES`, had we not offered it) end the
//! connection at once, as the spec says the server MUST.
//!
//! # TLS
//!
//! The spec's three server modes ("TLS support") are [`TlsPolicy`]'s: `Off` is NOTLS
//! (STARTTLS gets `NBD_REP_ERR_POLICY`); `Offered` lets the client upgrade whenever it
//! chooses and serves every export either way; `Required` is FORCEDTLS: before the
//! upgrade every option but STARTTLS and ABORT gets `NBD_REP_ERR_TLS_REQD`, and
//! EXPORT_NAME, which has no error reply, and a client without fixed newstyle, which
//! cannot upgrade, are hung up on. After the upgrade, what was negotiated in the clear
//! (structured replies, the metadata context) is forgotten: a man in the middle could
//! have added or dropped it, so only what the client asks for over TLS counts.

use std::sync::Arc;

use bytes::BytesMut;
use fallow_net::Stream;
use fallow_proto::nbd::handshake::{decode_client_flags, encode_greeting};
use fallow_proto::nbd::*;
use fallow_tls::TlsServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// Whether and how the server offers TLS (`fallow nbd --tls`).
#[derive(Debug, Clone, Default)]
pub enum TlsPolicy {
    /// No TLS (the spec's NOTLS mode).
    #[default]
    Off,
    /// TLS at the client's choice; every export is served with or without it.
    Offered(TlsServer),
    /// TLS before anything else (the spec's FORCEDTLS mode).
    Required(TlsServer),
}

impl TlsPolicy {
    fn server(&self) -> Option<&TlsServer> {
        match self {
            TlsPolicy::Off => None,
            TlsPolicy::Offered(server) | TlsPolicy::Required(server) => Some(server),
        }
    }
}

/// The outcome of a negotiation that did not fail.
pub struct Negotiated {
    /// The export chosen, or `None`: the client aborted cleanly.
    pub session: Option<Session>,
    /// The connection, inside TLS if the client upgraded.
    pub stream: Box<dyn Stream>,
    /// Bytes read past the end of negotiation (the first requests, if the client
    /// pipelined them).
    pub input: BytesMut,
    /// The client upgraded to TLS.
    pub tls: bool,
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
    /// The session ended without an export: the client aborted, or the server hung up
    /// where the protocol leaves it no reply (EXPORT_NAME with an unknown or malformed
    /// name, or an option other than EXPORT_NAME from a client without fixed newstyle).
    #[error("{0}")]
    Ended(String),
    /// TLS is required and the client went on without it where the protocol has no
    /// error reply (EXPORT_NAME, or a client without fixed newstyle).
    #[error("{0}")]
    TlsRequired(String),
    /// The TLS handshake after STARTTLS failed: a key or client certificate the server
    /// does not accept, or a client that refuses the server's certificate during the
    /// handshake (libnbd). A client that checks the certificate after its handshake
    /// (QEMU) closes the connection instead, which shows as [`HandshakeError::Io`].
    #[error("{0}")]
    Tls(std::io::Error),
}

impl HandshakeError {
    /// A short name of the kind of failure, for the metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            HandshakeError::Io(_) => "io",
            HandshakeError::Protocol(_) => "protocol",
            HandshakeError::Ended(_) => "ended",
            HandshakeError::TlsRequired(_) => "tls_required",
            HandshakeError::Tls(_) => "tls_handshake",
        }
    }
}

struct Negotiation<'a> {
    stream: Box<dyn Stream>,
    input: BytesMut,
    out: BytesMut,
    exports: &'a [Arc<Export>],
    tls_policy: &'a TlsPolicy,
    tls: bool,
    client_flags: u32,
    structured: bool,
    base_allocation: bool,
}

/// Runs the handshake on a fresh connection.
pub async fn negotiate(
    stream: Box<dyn Stream>,
    exports: &[Arc<Export>],
    tls_policy: &TlsPolicy,
) -> Result<Negotiated, HandshakeError> {
    let mut n = Negotiation {
        stream,
        input: BytesMut::with_capacity(4096),
        out: BytesMut::with_capacity(4096),
        exports,
        tls_policy,
        tls: false,
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
        if matches!(tls_policy, TlsPolicy::Required(_)) {
            return Err(HandshakeError::TlsRequired(
                "TLS is required, and a client without fixed newstyle cannot start it".into(),
            ));
        }
        return n.plain_newstyle().await;
    }
    loop {
        let request = n.next_option().await?;
        let opt = match Opt::parse(&request) {
            Ok(opt) => opt,
            // EXPORT_NAME has no error reply: the only refusal is to hang up.
            Err(err) if request.option == NBD_OPT_EXPORT_NAME => {
                return Err(malformed_export_name(err));
            }
            Err(err) => {
                n.reply(request.option, rep_error(RepError::Invalid, &err.to_string()));
                n.flush().await?;
                continue;
            }
        };
        let code = request.option;
        if n.tls_required_first(&opt) {
            if let Opt::ExportName(_) = opt {
                return Err(HandshakeError::TlsRequired(
                    "NBD_OPT_EXPORT_NAME before STARTTLS, and TLS is required".into(),
                ));
            }
            n.reply(code, rep_error(RepError::TlsReqd, "this server requires TLS: STARTTLS first"));
            n.flush().await?;
            continue;
        }
        let done = match opt {
            Opt::Abort => {
                n.reply(code, OptionReply::Ack);
                let _ = n.flush().await;
                return Ok(n.finish(None));
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
            Opt::ExportName(name) => Some(n.export_name(&name)?),
            Opt::StartTls => {
                n.start_tls(code).await?;
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
            return Ok(n.finish(Some(session)));
        }
    }
}

impl Negotiation<'_> {
    fn finish(self, session: Option<Session>) -> Negotiated {
        Negotiated { session, stream: self.stream, input: self.input, tls: self.tls }
    }

    /// True if TLS is required, not yet on, and `opt` is not one of the two options
    /// FORCEDTLS lets through.
    fn tls_required_first(&self, opt: &Opt) -> bool {
        matches!(self.tls_policy, TlsPolicy::Required(_))
            && !self.tls
            && !matches!(opt, Opt::StartTls | Opt::Abort)
    }

    /// STARTTLS: refused when TLS is off or already on; otherwise ACK, then the TLS
    /// handshake, after which options go on over TLS with nothing negotiated before it.
    async fn start_tls(&mut self, code: u32) -> Result<(), HandshakeError> {
        let server = match (self.tls, self.tls_policy.server()) {
            (true, _) => {
                self.reply(code, rep_error(RepError::Invalid, "TLS is already on"));
                return Ok(());
            }
            (false, None) => {
                self.reply(code, rep_error(RepError::Policy, "TLS is not offered"));
                return Ok(());
            }
            (false, Some(server)) => server.clone(),
        };
        self.reply(code, OptionReply::Ack);
        self.flush().await?;
        // The client may send nothing between STARTTLS and its TLS hello but waits for the
        // ACK; bytes already here were sent in the clear after it and cannot be trusted.
        if !self.input.is_empty() {
            return Err(HandshakeError::Ended(
                "the client sent data after NBD_OPT_STARTTLS before the TLS handshake".into(),
            ));
        }
        let plain = std::mem::replace(&mut self.stream, Box::new(tokio::io::empty()));
        self.stream = Box::new(server.accept(plain).await.map_err(HandshakeError::Tls)?);
        self.tls = true;
        self.structured = false;
        self.base_allocation = false;
        Ok(())
    }

    /// Plain (not fixed) newstyle: one option, which must be EXPORT_NAME. Nothing but the
    /// EXPORT_NAME reply may be sent to such a client, so every refusal is a hang-up.
    async fn plain_newstyle(mut self) -> Result<Negotiated, HandshakeError> {
        tracing::info!(
            client_flags = self.client_flags,
            "client did not set NBD_FLAG_C_FIXED_NEWSTYLE: serving NBD_OPT_EXPORT_NAME only"
        );
        let request = self.next_option().await?;
        let name = match (request.option, Opt::parse(&request)) {
            (_, Ok(Opt::ExportName(name))) => name,
            (NBD_OPT_EXPORT_NAME, Err(err)) => return Err(malformed_export_name(err)),
            (option, _) => {
                return Err(HandshakeError::Ended(format!(
                    "{} from a client without fixed newstyle, where only \
                     NBD_OPT_EXPORT_NAME is valid",
                    option_name(option)
                )))
            }
        };
        let export = self.export_name(&name)?;
        self.flush().await?;
        let session = Session { export, structured: false, base_allocation: false };
        Ok(self.finish(Some(session)))
    }

    /// The next whole option request.
    async fn next_option(&mut self) -> Result<OptionRequest, HandshakeError> {
        loop {
            if let Some(request) = decode_option(&mut self.input)? {
                return Ok(request);
            }
            self.fill().await?;
        }
    }

    /// EXPORT_NAME: queues the reply (size, flags, and the zeroes unless the client sent
    /// `NBD_FLAG_C_NO_ZEROES`) for an export that exists. For one that does not, the spec
    /// leaves no reply: the server MUST end the session.
    fn export_name(&mut self, name: &str) -> Result<Arc<Export>, HandshakeError> {
        let Some(export) = self.find(name) else {
            return Err(HandshakeError::Ended(format!("no export named {name:?}")));
        };
        let reply = ExportNameReply { size: export.size(), flags: export.transmission_flags() };
        reply.encode(&mut self.out, self.client_flags);
        Ok(export)
    }

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

/// EXPORT_NAME with a name that does not parse: it has no error reply, so the server
/// hangs up.
fn malformed_export_name(err: Error) -> HandshakeError {
    HandshakeError::Ended(format!("malformed NBD_OPT_EXPORT_NAME: {err}"))
}

fn rep_error(error: RepError, message: &str) -> OptionReply {
    OptionReply::Error { error, message: message.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fallow_backing::MemStore;
    use fallow_cache::{CacheConfig, CacheLayer};
    use fallow_proto::nbd::handshake::{encode_client_flags, GREETING_LEN};

    const SIZE: u64 = 1 << 20;

    fn exports() -> Vec<Arc<Export>> {
        let cache = CacheLayer::new(Arc::new(MemStore::new(SIZE)), None, CacheConfig::default());
        let export =
            Export { name: "d".into(), description: String::new(), cache, read_only: false };
        vec![Arc::new(export)]
    }

    /// The client flags, then these options, all sent before the server speaks.
    fn client(flags: u32, options: &[Opt]) -> BytesMut {
        let mut buf = BytesMut::new();
        encode_client_flags(&mut buf, flags);
        for opt in options {
            opt.encode(&mut buf);
        }
        buf
    }

    /// Runs the server's side of the handshake against `input`; returns its outcome and
    /// every byte the server sent, up to the point where it returned (and dropped its end).
    async fn negotiate_with(input: &[u8]) -> (Result<Option<Session>, HandshakeError>, Vec<u8>) {
        let (mut peer, server) = tokio::io::duplex(1 << 16);
        peer.write_all(input).await.unwrap();
        let exports = exports();
        let result = negotiate(Box::new(server), &exports, &TlsPolicy::Off)
            .await
            .map(|negotiated| negotiated.session);
        let mut sent = Vec::new();
        peer.read_to_end(&mut sent).await.unwrap();
        (result, sent)
    }

    fn export_name(name: &str) -> Opt {
        Opt::ExportName(name.into())
    }

    #[tokio::test]
    async fn plain_newstyle_client_gets_export_name_with_zeroes() {
        let (result, sent) = negotiate_with(&client(0, &[export_name("d")])).await;
        let session = result.unwrap().expect("a session");
        assert_eq!(session.export.name, "d");
        assert!(!session.structured && !session.base_allocation);
        // Greeting, then size, transmission flags and the 124 reserved zero bytes.
        assert_eq!(sent.len(), GREETING_LEN + 8 + 2 + 124);
        assert_eq!(sent[GREETING_LEN..GREETING_LEN + 8], SIZE.to_be_bytes());
        assert!(sent[GREETING_LEN + 10..].iter().all(|b| *b == 0));
    }

    #[tokio::test]
    async fn plain_newstyle_client_may_still_ask_for_no_zeroes() {
        let (result, sent) =
            negotiate_with(&client(NBD_FLAG_C_NO_ZEROES, &[export_name("")])).await;
        assert_eq!(result.unwrap().expect("the default export").export.name, "d");
        assert_eq!(sent.len(), GREETING_LEN + 10);
    }

    /// A client without fixed newstyle cannot read option replies, so anything but
    /// EXPORT_NAME of an export that exists ends the session with nothing sent.
    #[tokio::test]
    async fn plain_newstyle_client_is_hung_up_on_for_anything_else() {
        let go = Opt::Go(ExportOpt { name: "d".into(), info_requests: vec![] });
        for options in [vec![Opt::List], vec![go], vec![Opt::StructuredReply, export_name("d")]] {
            let (result, sent) = negotiate_with(&client(0, &options)).await;
            match result {
                Err(HandshakeError::Ended(why)) => assert!(why.contains("fixed newstyle"), "{why}"),
                other => panic!("{options:?}: {other:?}"),
            }
            assert_eq!(sent.len(), GREETING_LEN, "{options:?}: no option reply");
        }
        let (result, sent) = negotiate_with(&client(0, &[export_name("nope")])).await;
        assert!(matches!(result, Err(HandshakeError::Ended(_))), "{result:?}");
        assert_eq!(sent.len(), GREETING_LEN);
    }

    #[tokio::test]
    async fn unknown_client_flags_close_the_connection() {
        for flags in [1 << 2, NBD_FLAG_C_FIXED_NEWSTYLE | 1 << 31] {
            let (result, sent) = negotiate_with(&client(flags, &[export_name("d")])).await;
            assert!(
                matches!(result, Err(HandshakeError::Protocol(Error::BadClientFlags { flags: f })) if f == flags),
                "{flags:#x}: {result:?}"
            );
            assert_eq!(sent.len(), GREETING_LEN, "{flags:#x}: nothing after the greeting");
        }
    }

    /// EXPORT_NAME has no error reply: a malformed name (here with a NUL) is a hang-up,
    /// never an option reply the client would read as the export's size.
    #[tokio::test]
    async fn malformed_export_name_is_a_hang_up_not_an_option_reply() {
        let flags = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;
        let (result, sent) = negotiate_with(&client(flags, &[export_name("d\0")])).await;
        match result {
            Err(HandshakeError::Ended(why)) => assert!(why.contains("malformed"), "{why}"),
            other => panic!("{other:?}"),
        }
        assert_eq!(sent.len(), GREETING_LEN);
    }

    #[tokio::test]
    async fn fixed_newstyle_client_haggles_then_goes() {
        let flags = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;
        let go = Opt::Go(ExportOpt { name: "d".into(), info_requests: vec![] });
        let (result, sent) =
            negotiate_with(&client(flags, &[Opt::List, Opt::StructuredReply, go])).await;
        let session = result.unwrap().expect("a session");
        assert!(session.structured);
        let mut replies = BytesMut::from(&sent[GREETING_LEN..]);
        let mut last = None;
        while let Some(raw) = decode_option_reply(&mut replies).unwrap() {
            last = Some(OptionReply::parse(&raw).unwrap());
        }
        assert!(replies.is_empty());
        assert_eq!(last, Some(OptionReply::Ack));
    }

    // TLS (the spec's FORCEDTLS and SELECTIVETLS modes), with a pre-shared key so that no
    // certificate is needed.

    /// A server half with a pre-shared key in a scratch file, and the matching client.
    fn psk_pair(tag: &str) -> (TlsServer, fallow_tls::TlsClient) {
        let dir = std::env::temp_dir().join(format!("fallow-nbd-tls-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("keys.psk");
        std::fs::write(&file, format!("fallow:{}\n", "5a".repeat(32))).unwrap();
        let server = TlsServer::new(&fallow_tls::ServerOptions {
            psk: Some(file.clone()),
            ..Default::default()
        })
        .unwrap();
        let client = fallow_tls::TlsClient::new(&fallow_tls::ClientOptions {
            psk: Some((file, None)),
            ..Default::default()
        })
        .unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        (server, client)
    }

    /// Every option reply in `bytes` (after the greeting), parsed.
    fn replies(bytes: &[u8]) -> Vec<(u32, OptionReply)> {
        let mut buf = BytesMut::from(bytes);
        let mut all = Vec::new();
        while let Some(raw) = decode_option_reply(&mut buf).unwrap() {
            all.push((raw.option, OptionReply::parse(&raw).unwrap()));
        }
        assert!(buf.is_empty(), "a partial reply is left");
        all
    }

    async fn negotiate_under(
        input: &[u8],
        policy: &TlsPolicy,
    ) -> (Result<Option<Session>, HandshakeError>, Vec<u8>) {
        let (mut peer, server) = tokio::io::duplex(1 << 16);
        peer.write_all(input).await.unwrap();
        let exports = exports();
        let result = negotiate(Box::new(server), &exports, policy).await.map(|n| n.session);
        let mut sent = Vec::new();
        peer.read_to_end(&mut sent).await.unwrap();
        (result, sent)
    }

    #[tokio::test]
    async fn required_tls_answers_every_option_but_starttls_and_abort_with_tls_reqd() {
        let policy = TlsPolicy::Required(psk_pair("reqd").0);
        let flags = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;
        let go = Opt::Go(ExportOpt { name: "d".into(), info_requests: vec![] });
        let input = client(flags, &[Opt::List, Opt::StructuredReply, go, Opt::Abort]);
        let (result, sent) = negotiate_under(&input, &policy).await;
        assert!(result.unwrap().is_none(), "the client aborted");
        let got = replies(&sent[GREETING_LEN..]);
        let tls_reqd =
            |r: &OptionReply| matches!(r, OptionReply::Error { error: RepError::TlsReqd, .. });
        assert_eq!(got.len(), 4, "{got:?}");
        assert!(got[..3].iter().all(|(_, r)| tls_reqd(r)), "{got:?}");
        assert_eq!(got[3], (NBD_OPT_ABORT, OptionReply::Ack));
    }

    /// EXPORT_NAME has no error reply, and a client without fixed newstyle cannot start
    /// TLS: under FORCEDTLS both are hung up on, with nothing sent after the greeting.
    #[tokio::test]
    async fn required_tls_hangs_up_on_export_name_and_on_plain_newstyle() {
        let policy = TlsPolicy::Required(psk_pair("hangup").0);
        for flags in [NBD_FLAG_C_FIXED_NEWSTYLE, 0] {
            let (result, sent) =
                negotiate_under(&client(flags, &[export_name("d")]), &policy).await;
            assert!(matches!(result, Err(HandshakeError::TlsRequired(_))), "{flags}: {result:?}");
            assert_eq!(sent.len(), GREETING_LEN, "{flags}: no reply");
        }
    }

    #[tokio::test]
    async fn starttls_is_refused_by_policy_when_tls_is_off() {
        let flags = NBD_FLAG_C_FIXED_NEWSTYLE;
        let input = client(flags, &[Opt::StartTls, export_name("d")]);
        let (result, sent) = negotiate_under(&input, &TlsPolicy::Off).await;
        assert_eq!(result.unwrap().unwrap().export.name, "d", "served in the clear");
        let got = replies(&sent[GREETING_LEN..sent.len() - (8 + 2 + 124)]);
        assert!(
            matches!(
                got[..],
                [(NBD_OPT_STARTTLS, OptionReply::Error { error: RepError::Policy, .. })]
            ),
            "{got:?}"
        );
    }

    /// Bytes after STARTTLS that the client sent before reading the ACK would be read as
    /// the start of the TLS handshake; the server refuses them instead.
    #[tokio::test]
    async fn bytes_sent_after_starttls_before_its_ack_end_the_session() {
        let policy = TlsPolicy::Required(psk_pair("early").0);
        let input = client(NBD_FLAG_C_FIXED_NEWSTYLE, &[Opt::StartTls, Opt::List]);
        let (result, _) = negotiate_under(&input, &policy).await;
        match result {
            Err(HandshakeError::Ended(why)) => assert!(why.contains("STARTTLS"), "{why}"),
            other => panic!("{other:?}"),
        }
    }

    /// After STARTTLS the options go on over TLS; what was negotiated in the clear
    /// (structured replies here) is forgotten, and a second STARTTLS is invalid.
    #[tokio::test]
    async fn after_starttls_options_run_over_tls_and_nothing_from_the_clear_is_kept() {
        let (server, tls_client) = psk_pair("upgrade");
        let policy = TlsPolicy::Offered(server);
        let (mut peer, stream) = tokio::io::duplex(1 << 16);
        let serving = tokio::spawn(async move {
            let exports = exports();
            negotiate(Box::new(stream), &exports, &policy).await.map(|n| (n.session, n.tls))
        });
        let flags = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;
        peer.write_all(&client(flags, &[Opt::StructuredReply, Opt::StartTls])).await.unwrap();
        // The greeting, then the two replies (ACK, ACK): read exactly, nothing more is due.
        let mut clear = vec![0u8; GREETING_LEN + 2 * 20];
        peer.read_exact(&mut clear).await.unwrap();
        let got = replies(&clear[GREETING_LEN..]);
        assert_eq!(
            got,
            [(NBD_OPT_STRUCTURED_REPLY, OptionReply::Ack), (NBD_OPT_STARTTLS, OptionReply::Ack)]
        );
        let mut tls = tls_client.connect("localhost", peer).await.unwrap();
        let mut out = BytesMut::new();
        Opt::StartTls.encode(&mut out);
        Opt::Go(ExportOpt { name: "d".into(), info_requests: vec![] }).encode(&mut out);
        tls.write_all(&out).await.unwrap();
        tls.flush().await.unwrap();
        let (session, upgraded) = serving.await.unwrap().unwrap();
        let session = session.expect("a session");
        assert!(upgraded);
        assert!(!session.structured, "structured replies were agreed in the clear only");
        let mut over_tls = Vec::new();
        let mut buf = [0u8; 4096];
        // The server's side is done; read what it sent until its replies are all here.
        while !matches!(replies_tail(&over_tls), Some((NBD_OPT_GO, OptionReply::Ack))) {
            let n = tls.read(&mut buf).await.unwrap();
            assert!(n > 0, "the server closed before its GO reply");
            over_tls.extend_from_slice(&buf[..n]);
        }
        let got = replies(&over_tls);
        assert!(
            matches!(
                got[0],
                (NBD_OPT_STARTTLS, OptionReply::Error { error: RepError::Invalid, .. })
            ),
            "{got:?}"
        );
    }

    /// The last whole reply in `bytes`, if they end on a reply boundary.
    fn replies_tail(bytes: &[u8]) -> Option<(u32, OptionReply)> {
        let mut buf = BytesMut::from(bytes);
        let mut last = None;
        while let Ok(Some(raw)) = decode_option_reply(&mut buf) {
            last = Some((raw.option, OptionReply::parse(&raw).unwrap()));
        }
        buf.is_empty().then_some(last).flatten()
    }
}
