//! Opening a connection: connect, then the fixed-newstyle handshake (structured replies,
//! `base:allocation`, `NBD_OPT_GO` with block sizes).

use super::*;

/// Connects, negotiates and starts the reader: a connection for slot `slot`, over TLS when
/// `tls` is given (an `nbds://` URI).
pub(super) async fn open(
    uri: &NbdUri,
    slot: usize,
    durability: &Arc<FlushCoverage>,
    tls: Option<&fallow_tls::TlsClient>,
) -> io::Result<(Arc<Conn>, ExportInfo)> {
    tokio::time::timeout(CONNECT_TIMEOUT, async {
        let cannot =
            |e: io::Error| io::Error::new(e.kind(), format!("cannot connect to {uri}: {e}"));
        let (mut reader, mut writer, greeted): (Reader, WriteHalf, bool) = match (uri, tls) {
            (NbdUri::Tcp { addr, .. }, None) => {
                let s = tokio::net::TcpStream::connect(addr.as_str()).await.map_err(cannot)?;
                s.set_nodelay(true)?;
                let (r, w) = s.into_split();
                (Box::new(r), WriteHalf::Tcp(w), false)
            }
            (NbdUri::Unix { path, .. }, None) => {
                let s = tokio::net::UnixStream::connect(path).await.map_err(cannot)?;
                let (r, w) = s.into_split();
                (Box::new(r), WriteHalf::Unix(w), false)
            }
            (_, Some(client)) => {
                let (r, w) = tls_tunnel(uri, client).await.map_err(cannot)?;
                (r, w, true)
            }
        };
        let mut input = BytesMut::with_capacity(GULP);
        let mut haggle =
            Haggle { uri, reader: &mut reader, writer: &mut writer, input: &mut input, greeted };
        let (info, structured, base_allocation) =
            haggle.negotiate().await.map_err(|e| lost_in_negotiation(uri, greeted, e))?;
        let conn = Arc::new(Conn {
            label: format!("{uri} #{slot}"),
            structured,
            base_allocation,
            writer,
            outbox: Mutex::new(Outbox::default()),
            pending: Mutex::new(HashMap::new()),
            state: AtomicU8::new(OPEN),
            stop: Notify::new(),
            durability: durability.clone(),
            unflushed: AtomicU64::new(0),
        });
        let replies = Replies { conn: conn.clone(), reader, input, max_data: info.max_payload };
        tokio::spawn(replies.run());
        Ok((conn, info))
    })
    .await
    .map_err(|_| {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("{uri}: no answer within {CONNECT_TIMEOUT:?}"),
        )
    })?
}

/// A connection lost during option haggling, said with the URI (protocol errors name it
/// already). Over TLS 1.3 a server's verdict on the client's certificate comes after the
/// client's side of the handshake is done, so a refusal shows here, as a closed
/// connection: the message says so.
fn lost_in_negotiation(uri: &NbdUri, tls: bool, err: io::Error) -> io::Error {
    if err.kind() == io::ErrorKind::InvalidData {
        return err;
    }
    let hint = if tls {
        " (over TLS, this is also how a server refuses a client certificate it does not \
         accept, or the lack of one)"
    } else {
        ""
    };
    io::Error::new(
        err.kind(),
        format!("{uri}: the connection failed during negotiation: {err}{hint}"),
    )
}

/// Opens the connection, starts TLS with `NBD_OPT_STARTTLS` as its first option, and
/// relays the TLS stream through a socket pair, whose near end it returns: the store's
/// writers write to a socket without waiting (`WriteHalf::try_write_vectored`), which a
/// TLS stream cannot offer, and an upstream store's own latency dwarfs the relay's.
async fn tls_tunnel(
    uri: &NbdUri,
    client: &fallow_tls::TlsClient,
) -> io::Result<(Reader, WriteHalf)> {
    let host = uri.tls().map_or("localhost", |t| t.host.as_str());
    match uri {
        NbdUri::Tcp { addr, .. } => {
            let mut s = tokio::net::TcpStream::connect(addr.as_str()).await?;
            s.set_nodelay(true)?;
            start_tls(uri, &mut s).await?;
            relay(client.connect(host, s).await?)
        }
        NbdUri::Unix { path, .. } => {
            let mut s = tokio::net::UnixStream::connect(path).await?;
            start_tls(uri, &mut s).await?;
            relay(client.connect(host, s).await?)
        }
    }
}

/// The exchange before TLS, read exactly (nothing past the STARTTLS reply, which is where
/// the TLS handshake begins): the greeting, the client flags, STARTTLS and its ACK.
async fn start_tls<S>(uri: &NbdUri, stream: &mut S) -> io::Result<()>
where
    S: AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut greeting = [0u8; fallow_proto::nbd::handshake::GREETING_LEN];
    stream.read_exact(&mut greeting).await?;
    let flags = decode_greeting(&mut BytesMut::from(&greeting[..]))
        .map_err(|e| protocol_error(uri, e))?
        .ok_or_else(|| protocol_error(uri, "short greeting"))?;
    if flags & NBD_FLAG_FIXED_NEWSTYLE == 0 {
        return Err(protocol_error(uri, "server does not speak fixed newstyle, so no TLS"));
    }
    let mut out = BytesMut::new();
    encode_client_flags(&mut out, client_flags(flags));
    Opt::StartTls.encode(&mut out);
    stream.write_all(&out).await?;
    // An option reply: magic (8), option (4), type (4), length (4), then the data.
    let mut head = [0u8; 20];
    stream.read_exact(&mut head).await?;
    let [.., l0, l1, l2, l3] = head;
    let len = u32::from_be_bytes([l0, l1, l2, l3]);
    let mut raw = BytesMut::from(&head[..]);
    if len as usize > MAX_STRING_LEN + 4 {
        return Err(protocol_error(uri, format!("a {len}-byte reply to STARTTLS")));
    }
    let mut data = vec![0u8; len as usize];
    stream.read_exact(&mut data).await?;
    raw.extend_from_slice(&data);
    let reply = decode_option_reply(&mut raw)
        .map_err(|e| protocol_error(uri, e))?
        .ok_or_else(|| protocol_error(uri, "short reply to STARTTLS"))?;
    match OptionReply::parse(&reply).map_err(|e| protocol_error(uri, e))? {
        OptionReply::Ack => Ok(()),
        OptionReply::Error { error, message } => {
            Err(protocol_error(uri, format!("the server refused TLS ({error:?}): {message}")))
        }
        other => Err(protocol_error(uri, format!("unexpected reply to STARTTLS: {other:?}"))),
    }
}

/// Relays `tls` through a socket pair, in a task that ends when either side closes.
fn relay<S>(mut tls: fallow_tls::TlsStream<S>) -> io::Result<(Reader, WriteHalf)>
where
    S: AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (near, mut far) = tokio::net::UnixStream::pair()?;
    tokio::spawn(async move {
        if let Err(err) = tokio::io::copy_bidirectional(&mut far, &mut tls).await {
            tracing::debug!(%err, "TLS relay to the upstream NBD server ended");
        }
    });
    let (r, w) = near.into_split();
    Ok((Box::new(r), WriteHalf::Unix(w)))
}

/// The client flags we send for the server's handshake flags.
fn client_flags(server_flags: u16) -> u32 {
    let mut flags = NBD_FLAG_C_FIXED_NEWSTYLE;
    if server_flags & NBD_FLAG_NO_ZEROES != 0 {
        flags |= NBD_FLAG_C_NO_ZEROES;
    }
    flags
}

pub(super) fn protocol_error(uri: &NbdUri, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{uri}: {what}"))
}

/// Option haggling on a new connection.
pub(super) struct Haggle<'a> {
    pub(super) uri: &'a NbdUri,
    pub(super) reader: &'a mut Reader,
    pub(super) writer: &'a mut WriteHalf,
    pub(super) input: &'a mut BytesMut,
    /// The greeting and client flags were exchanged already (before STARTTLS).
    pub(super) greeted: bool,
}

impl Haggle<'_> {
    /// Fixed newstyle; structured replies and `base:allocation` if the server has them;
    /// then GO (a server without GO is too old).
    /// Returns what the export is, whether structured replies were agreed, and the id of
    /// `base:allocation`.
    pub(super) async fn negotiate(&mut self) -> io::Result<(ExportInfo, bool, Option<u32>)> {
        let mut out = BytesMut::new();
        if !self.greeted {
            let flags = loop {
                let greeting = decode_greeting(self.input);
                if let Some(flags) = greeting.map_err(|e| protocol_error(self.uri, e))? {
                    break flags;
                }
                self.fill().await?;
            };
            if flags & NBD_FLAG_FIXED_NEWSTYLE == 0 {
                return Err(protocol_error(self.uri, "server does not speak fixed newstyle"));
            }
            encode_client_flags(&mut out, client_flags(flags));
        }
        Opt::StructuredReply.encode(&mut out);
        self.writer.write_all(&out).await?;
        let structured = match self.reply(NBD_OPT_STRUCTURED_REPLY).await? {
            OptionReply::Ack => true,
            OptionReply::Error { .. } => false,
            other => return Err(self.unexpected("STRUCTURED_REPLY", &other)),
        };
        let base_allocation = if structured { self.base_allocation().await? } else { None };
        let (size, flags, blocks) = self.go().await?;
        let block_status = base_allocation.is_some();
        let info = ExportInfo {
            size,
            flags,
            max_payload: blocks.max,
            min_block: blocks.min,
            preferred_block: blocks.preferred,
            block_status,
        };
        Ok((info, structured, base_allocation))
    }

    /// SET_META_CONTEXT `base:allocation`: the id the server gives it, if it does.
    pub(super) async fn base_allocation(&mut self) -> io::Result<Option<u32>> {
        let query = MetaContextOpt {
            export: self.uri.export().to_string(),
            queries: vec![BASE_ALLOCATION.to_string()],
        };
        self.send(Opt::SetMetaContext(query)).await?;
        let mut id = None;
        loop {
            match self.reply(NBD_OPT_SET_META_CONTEXT).await? {
                OptionReply::MetaContext { id: got, name } if name == BASE_ALLOCATION => {
                    id = Some(got);
                }
                // Not asked for; a client ignores what it does not use.
                OptionReply::MetaContext { .. } => {}
                OptionReply::Ack => return Ok(id),
                OptionReply::Error { .. } => return Ok(None),
                other => return Err(self.unexpected("SET_META_CONTEXT", &other)),
            }
        }
    }

    /// GO with a request for the block sizes: (size, transmission flags, block sizes, the
    /// maximum clamped to what this store sends at once).
    pub(super) async fn go(&mut self) -> io::Result<(u64, u16, BlockSize)> {
        let name = self.uri.export().to_string();
        self.send(Opt::Go(ExportOpt { name, info_requests: vec![NBD_INFO_BLOCK_SIZE] })).await?;
        let (mut size, mut flags) = (None, 0u16);
        let mut blocks = BlockSize::DEFAULT;
        loop {
            match self.reply(NBD_OPT_GO).await? {
                OptionReply::Info(Info::Export { size: s, flags: f }) => {
                    size = Some(s);
                    flags = f;
                }
                OptionReply::Info(Info::BlockSize(b)) => {
                    // The cache above reads and writes whole 4 KiB pages where it can, and
                    // passes clients' writes through: an export that needs larger blocks
                    // than a page cannot be served, one that needs smaller ones can.
                    if !b.min.is_power_of_two() || b.min > PAGE {
                        let _ = self.send(Opt::Abort).await;
                        let why = format!(
                            "the export's minimum block size is {} bytes; fallow serves \
                             exports whose minimum is a power of two up to {PAGE}",
                            b.min
                        );
                        return Err(protocol_error(self.uri, why));
                    }
                    blocks = BlockSize {
                        min: b.min,
                        preferred: b.preferred.max(b.min),
                        max: b.max.clamp(PAGE, DEFAULT_MAX_PAYLOAD),
                    };
                }
                OptionReply::Info(_) => {}
                OptionReply::Ack => break,
                OptionReply::Error { error, message } => {
                    // A soft disconnect, as the spec asks (after NBD_REP_ERR_SHUTDOWN it
                    // must); the connection is dropped either way.
                    let _ = self.send(Opt::Abort).await;
                    let why = match error {
                        RepError::TlsReqd => format!(
                            "the server requires TLS{}: use nbds:// with \
                             tls-certificates=DIR or tls-psk-file=FILE",
                            if message.is_empty() {
                                String::new()
                            } else {
                                format!(" ({message})")
                            }
                        ),
                        _ => format!("export refused ({error:?}): {message}"),
                    };
                    return Err(protocol_error(self.uri, why));
                }
                other => return Err(self.unexpected("GO", &other)),
            }
        }
        let size = size.ok_or_else(|| protocol_error(self.uri, "GO succeeded without a size"))?;
        Ok((size, flags, blocks))
    }

    pub(super) async fn send(&mut self, opt: Opt) -> io::Result<()> {
        let mut out = BytesMut::new();
        opt.encode(&mut out);
        self.writer.write_all(&out).await
    }

    /// The next option reply, which must answer `option`.
    pub(super) async fn reply(&mut self, option: u32) -> io::Result<OptionReply> {
        let raw = loop {
            let decoded = decode_option_reply(self.input);
            if let Some(raw) = decoded.map_err(|e| protocol_error(self.uri, e))? {
                break raw;
            }
            self.fill().await?;
        };
        if raw.option != option {
            let why = format!("a reply to option {} while {} was asked", raw.option, option);
            return Err(protocol_error(self.uri, why));
        }
        OptionReply::parse(&raw).map_err(|e| protocol_error(self.uri, e))
    }

    pub(super) fn unexpected(&self, option: &str, reply: &OptionReply) -> io::Error {
        protocol_error(self.uri, format!("unexpected reply to {option}: {reply:?}"))
    }

    pub(super) async fn fill(&mut self) -> io::Result<()> {
        if self.reader.read_buf(self.input).await? == 0 {
            let why = "server closed during negotiation";
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, why));
        }
        Ok(())
    }
}
