//! An upstream NBD server as the backing store: fallow in front of any NBD server (a
//! storage appliance, qemu-nbd, nbdkit with its delay and error filters in tests).
//!
//! One or more connections (more only when the server advertises `CAN_MULTI_CONN`), each
//! with any number of requests in flight, replies matched by cookie. Simple replies only:
//! block status is not asked upstream. A connection that fails is reopened on next use, so
//! the export keeps working when the upstream server comes back.
//!
//! # Locking
//! `Conn::pending` (a `parking_lot` mutex) maps cookies to waiting requests, held for an
//! insert or remove; `Conn::writer` (a tokio mutex) serialises whole requests on the
//! socket; `NbdStore::conns` slots are `parking_lot` mutexes held for an `Arc` clone.

use std::collections::HashMap;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use fallow_proto::nbd::handshake::{decode_greeting, encode_client_flags};
use fallow_proto::nbd::*;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;

use crate::{check_range, BackingStore, Capabilities};

/// How long connecting and negotiating may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections opened when the server allows several.
const CONNECTIONS: usize = 4;

/// Where the upstream server is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdUri {
    /// `nbd://HOST:PORT/EXPORT`.
    Tcp {
        /// `HOST:PORT`.
        addr: String,
        /// The export name (may be empty).
        export: String,
    },
    /// `nbd+unix:///EXPORT?socket=PATH`.
    Unix {
        /// The socket.
        path: PathBuf,
        /// The export name (may be empty).
        export: String,
    },
}

impl NbdUri {
    /// Parses `nbd://HOST[:PORT][/EXPORT]` (port 10809 by default) or
    /// `nbd+unix:///[EXPORT]?socket=PATH`.
    pub fn parse(uri: &str) -> io::Result<NbdUri> {
        let bad = |why: &str| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("NBD URI {uri:?}: {why}"))
        };
        if let Some(rest) = uri.strip_prefix("nbd+unix://") {
            let (path_part, query) =
                rest.split_once('?').ok_or_else(|| bad("needs ?socket=PATH"))?;
            let export = path_part.strip_prefix('/').unwrap_or(path_part).to_string();
            let socket = query
                .split('&')
                .find_map(|kv| kv.strip_prefix("socket="))
                .ok_or_else(|| bad("needs ?socket=PATH"))?;
            return Ok(NbdUri::Unix { path: PathBuf::from(socket), export });
        }
        let rest =
            uri.strip_prefix("nbd://").ok_or_else(|| bad("expected nbd:// or nbd+unix://"))?;
        let (host, export) = match rest.split_once('/') {
            Some((host, export)) => (host, export.to_string()),
            None => (rest, String::new()),
        };
        if host.is_empty() {
            return Err(bad("no host"));
        }
        let has_port = host.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok())
            && !host.ends_with(']');
        let addr = if has_port { host.to_string() } else { format!("{host}:10809") };
        Ok(NbdUri::Tcp { addr, export })
    }

    fn export(&self) -> &str {
        match self {
            NbdUri::Tcp { export, .. } | NbdUri::Unix { export, .. } => export,
        }
    }
}

impl std::fmt::Display for NbdUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NbdUri::Tcp { addr, export } => write!(f, "nbd://{addr}/{export}"),
            NbdUri::Unix { path, export } => {
                write!(f, "nbd+unix:///{export}?socket={}", path.display())
            }
        }
    }
}

type Reader = Box<dyn AsyncRead + Send + Unpin>;
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// A waiting request: how many data bytes its reply carries, and where to send them.
struct Pending {
    read_len: usize,
    done: oneshot::Sender<io::Result<Bytes>>,
}

struct Conn {
    writer: tokio::sync::Mutex<Writer>,
    pending: Mutex<HashMap<u64, Pending>>,
    closed: AtomicBool,
}

impl Conn {
    fn close(&self, why: &str) {
        let mut pending = self.pending.lock();
        self.closed.store(true, Ordering::Release);
        for (_, p) in pending.drain() {
            let _ =
                p.done.send(Err(io::Error::new(io::ErrorKind::ConnectionAborted, why.to_string())));
        }
    }
}

/// What negotiation learned.
#[derive(Debug, Clone, Copy)]
struct ExportInfo {
    size: u64,
    flags: u16,
    max_payload: u32,
}

/// An upstream NBD export.
pub struct NbdStore {
    uri: NbdUri,
    info: ExportInfo,
    conns: Vec<Mutex<Option<Arc<Conn>>>>,
    connecting: Vec<tokio::sync::Mutex<()>>,
    next: AtomicUsize,
    cookie: AtomicU64,
}

impl std::fmt::Debug for NbdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdStore")
            .field("uri", &self.uri.to_string())
            .field("size", &self.info.size)
            .finish()
    }
}

impl NbdStore {
    /// Connects to `uri` and negotiates (the first connection; others open on use).
    pub async fn connect(uri: &str) -> io::Result<NbdStore> {
        let uri = NbdUri::parse(uri)?;
        let (conn, info) = open(&uri).await?;
        let n = if info.flags & NBD_FLAG_CAN_MULTI_CONN != 0 { CONNECTIONS } else { 1 };
        let conns: Vec<Mutex<Option<Arc<Conn>>>> = (0..n).map(|_| Mutex::new(None)).collect();
        *conns[0].lock() = Some(conn);
        tracing::info!(uri = %uri, size = info.size, flags = format_args!("{:#x}", info.flags), connections = n, "upstream NBD export opened");
        Ok(NbdStore {
            uri,
            info,
            conns,
            connecting: (0..n).map(|_| tokio::sync::Mutex::new(())).collect(),
            next: AtomicUsize::new(0),
            cookie: AtomicU64::new(1),
        })
    }

    async fn conn(&self) -> io::Result<Arc<Conn>> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        if let Some(c) = self.conns[i].lock().as_ref().filter(|c| !c.closed.load(Ordering::Acquire))
        {
            return Ok(c.clone());
        }
        let _one = self.connecting[i].lock().await;
        if let Some(c) = self.conns[i].lock().as_ref().filter(|c| !c.closed.load(Ordering::Acquire))
        {
            return Ok(c.clone());
        }
        let (conn, info) = open(&self.uri).await?;
        if info.size != self.info.size {
            conn.close("size changed");
            return Err(io::Error::other(format!(
                "upstream export {} changed size from {} to {}",
                self.uri, self.info.size, info.size
            )));
        }
        tracing::info!(uri = %self.uri, slot = i, "connected to the upstream NBD server");
        *self.conns[i].lock() = Some(conn.clone());
        Ok(conn)
    }

    /// Sends one request (with `payload` after a WRITE) and waits for its reply.
    async fn call(
        &self,
        cmd: Cmd,
        flags: u16,
        offset: u64,
        length: u32,
        payload: Option<Bytes>,
    ) -> io::Result<Bytes> {
        let conn = self.conn().await?;
        let cookie = self.cookie.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = conn.pending.lock();
            if conn.closed.load(Ordering::Acquire) {
                return Err(io::Error::new(
                    io::ErrorKind::ConnectionAborted,
                    "upstream connection closed",
                ));
            }
            let read_len = if cmd == Cmd::Read { length as usize } else { 0 };
            pending.insert(cookie, Pending { read_len, done: tx });
        }
        let mut header = BytesMut::with_capacity(28);
        Request { flags, cmd, cookie, offset, length }.encode(&mut header);
        let written = async {
            let mut writer = conn.writer.lock().await;
            writer.write_all(&header).await?;
            if let Some(payload) = &payload {
                writer.write_all(payload).await?;
            }
            writer.flush().await
        }
        .await;
        if let Err(err) = written {
            conn.close(&err.to_string());
            return Err(err);
        }
        rx.await.unwrap_or_else(|_| {
            Err(io::Error::new(io::ErrorKind::ConnectionAborted, "upstream connection closed"))
        })
    }
}

async fn open(uri: &NbdUri) -> io::Result<(Arc<Conn>, ExportInfo)> {
    tokio::time::timeout(CONNECT_TIMEOUT, async {
        let (mut reader, mut writer): (Reader, Writer) = match uri {
            NbdUri::Tcp { addr, .. } => {
                let s = tokio::net::TcpStream::connect(addr.as_str()).await.map_err(|e| {
                    io::Error::new(e.kind(), format!("cannot connect to {uri}: {e}"))
                })?;
                s.set_nodelay(true)?;
                let (r, w) = s.into_split();
                (Box::new(r), Box::new(w))
            }
            NbdUri::Unix { path, .. } => {
                let s = tokio::net::UnixStream::connect(path).await.map_err(|e| {
                    io::Error::new(e.kind(), format!("cannot connect to {uri}: {e}"))
                })?;
                let (r, w) = s.into_split();
                (Box::new(r), Box::new(w))
            }
        };
        let mut input = BytesMut::with_capacity(4096);
        let info = negotiate(uri, &mut reader, &mut writer, &mut input).await?;
        let conn = Arc::new(Conn {
            writer: tokio::sync::Mutex::new(writer),
            pending: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
        });
        tokio::spawn(read_replies(conn.clone(), reader, input, info.max_payload));
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

fn protocol_error(uri: &NbdUri, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{uri}: {what}"))
}

/// Fixed newstyle with NBD_OPT_GO; falls back to nothing: a server without GO is too old.
async fn negotiate(
    uri: &NbdUri,
    reader: &mut Reader,
    writer: &mut Writer,
    input: &mut BytesMut,
) -> io::Result<ExportInfo> {
    async fn fill(reader: &mut Reader, input: &mut BytesMut) -> io::Result<()> {
        if reader.read_buf(input).await? == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "server closed during negotiation",
            ));
        }
        Ok(())
    }
    let flags = loop {
        if let Some(flags) = decode_greeting(input).map_err(|e| protocol_error(uri, e))? {
            break flags;
        }
        fill(reader, input).await?;
    };
    if flags & NBD_FLAG_FIXED_NEWSTYLE == 0 {
        return Err(protocol_error(uri, "server does not speak fixed newstyle"));
    }
    let mut client_flags = NBD_FLAG_C_FIXED_NEWSTYLE;
    if flags & NBD_FLAG_NO_ZEROES != 0 {
        client_flags |= NBD_FLAG_C_NO_ZEROES;
    }
    let mut out = BytesMut::new();
    encode_client_flags(&mut out, client_flags);
    let go = ExportOpt { name: uri.export().to_string(), info_requests: vec![NBD_INFO_BLOCK_SIZE] };
    Opt::Go(go).encode(&mut out);
    writer.write_all(&out).await?;
    let (mut size, mut tflags, mut max_payload) = (None, 0u16, DEFAULT_MAX_PAYLOAD);
    loop {
        let raw = loop {
            if let Some(raw) = decode_option_reply(input).map_err(|e| protocol_error(uri, e))? {
                break raw;
            }
            fill(reader, input).await?;
        };
        match OptionReply::parse(&raw).map_err(|e| protocol_error(uri, e))? {
            OptionReply::Info(Info::Export { size: s, flags: f }) => {
                size = Some(s);
                tflags = f;
            }
            OptionReply::Info(Info::BlockSize(b)) => {
                max_payload = b.max.clamp(4096, DEFAULT_MAX_PAYLOAD)
            }
            OptionReply::Info(_) => {}
            OptionReply::Ack => break,
            OptionReply::Error { error, message } => {
                return Err(protocol_error(uri, format!("export refused ({error:?}): {message}")));
            }
            other => return Err(protocol_error(uri, format!("unexpected reply to GO: {other:?}"))),
        }
    }
    let size = size.ok_or_else(|| protocol_error(uri, "GO succeeded without the export's size"))?;
    Ok(ExportInfo { size, flags: tflags, max_payload })
}

/// Hands each reply to its waiting request until the connection ends.
async fn read_replies(conn: Arc<Conn>, mut reader: Reader, mut input: BytesMut, max_payload: u32) {
    let ended: Result<std::convert::Infallible, String> = async {
        loop {
            while let Some(reply) = decode_reply(&mut input, max_payload.saturating_add(8))
                .map_err(|e| e.to_string())?
            {
                let Reply::Simple(SimpleReply { error, cookie }) = reply else {
                    return Err(
                        "structured reply from a server that was not asked for them".to_string()
                    );
                };
                let Some(pending) = conn.pending.lock().remove(&cookie) else {
                    return Err(format!("reply to unknown cookie {cookie}"));
                };
                let result = if error != 0 {
                    // A failed READ carries no data.
                    Err(io::Error::new(kind_of(error), format!("upstream NBD error {error}")))
                } else if pending.read_len > 0 {
                    loop {
                        if let Some(data) = take_payload(&mut input, pending.read_len) {
                            break Ok(data);
                        }
                        if reader.read_buf(&mut input).await.map_err(|e| e.to_string())? == 0 {
                            return Err("server closed mid-reply".to_string());
                        }
                    }
                } else {
                    Ok(Bytes::new())
                };
                let _ = pending.done.send(result);
            }
            if reader.read_buf(&mut input).await.map_err(|e| e.to_string())? == 0 {
                return Err("server closed the connection".to_string());
            }
        }
    }
    .await;
    let Err(why) = ended;
    if !conn.closed.load(Ordering::Acquire) {
        tracing::warn!(reason = %why, "upstream NBD connection lost");
    }
    conn.close(&why);
}

/// The `io::ErrorKind` for an NBD error code.
fn kind_of(error: u32) -> io::ErrorKind {
    match error {
        NBD_EPERM => io::ErrorKind::PermissionDenied,
        NBD_EINVAL => io::ErrorKind::InvalidInput,
        NBD_ENOSPC => io::ErrorKind::StorageFull,
        NBD_ENOMEM => io::ErrorKind::OutOfMemory,
        NBD_ENOTSUP => io::ErrorKind::Unsupported,
        _ => io::ErrorKind::Other,
    }
}

#[async_trait]
impl BackingStore for NbdStore {
    fn size(&self) -> u64 {
        self.info.size
    }

    fn capabilities(&self) -> Capabilities {
        let f = self.info.flags;
        Capabilities {
            read_only: f & NBD_FLAG_READ_ONLY != 0,
            flush: f & NBD_FLAG_SEND_FLUSH != 0,
            fua: f & NBD_FLAG_SEND_FUA != 0,
            trim: f & NBD_FLAG_SEND_TRIM != 0,
            // A trim upstream may leave the old data readable.
            trim_zeroes: false,
            fast_zero: f & NBD_FLAG_SEND_FAST_ZERO != 0,
            block_status: false,
            multi_conn: f & NBD_FLAG_CAN_MULTI_CONN != 0,
        }
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        check_range(offset, len as u64, self.info.size)?;
        let mut out = BytesMut::with_capacity(len as usize);
        let mut at = 0u32;
        while at < len {
            let n = (len - at).min(self.info.max_payload);
            let data = self.call(Cmd::Read, 0, offset + at as u64, n, None).await?;
            out.extend_from_slice(&data);
            at += n;
        }
        Ok(out.freeze())
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
        check_range(offset, data.len() as u64, self.info.size)?;
        let caps = self.capabilities();
        let flags = if fua && caps.fua { NBD_CMD_FLAG_FUA } else { 0 };
        let mut at = 0usize;
        while at < data.len() {
            let n = (data.len() - at).min(self.info.max_payload as usize);
            self.call(
                Cmd::Write,
                flags,
                offset + at as u64,
                n as u32,
                Some(data.slice(at..at + n)),
            )
            .await?;
            at += n;
        }
        if fua && !caps.fua && caps.flush {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&self) -> io::Result<()> {
        if self.capabilities().flush {
            self.call(Cmd::Flush, 0, 0, 0, None).await?;
        }
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u32) -> io::Result<()> {
        check_range(offset, len as u64, self.info.size)?;
        if self.capabilities().trim {
            self.call(Cmd::Trim, 0, offset, len, None).await?;
        }
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u32, may_trim: bool) -> io::Result<()> {
        check_range(offset, len as u64, self.info.size)?;
        if self.info.flags & NBD_FLAG_SEND_WRITE_ZEROES != 0 {
            let flags = if may_trim { 0 } else { NBD_CMD_FLAG_NO_HOLE };
            self.call(Cmd::WriteZeroes, flags, offset, len, None).await?;
            return Ok(());
        }
        let zeros = Bytes::from(vec![0u8; (len as usize).min(1 << 20)]);
        let mut at = 0u64;
        while at < len as u64 {
            let n = (len as u64 - at).min(zeros.len() as u64) as usize;
            self.write(offset + at, zeros.slice(..n), false).await?;
            at += n as u64;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        assert_eq!(
            NbdUri::parse("nbd://127.0.0.1:10810/disk").unwrap(),
            NbdUri::Tcp { addr: "127.0.0.1:10810".into(), export: "disk".into() }
        );
        assert_eq!(
            NbdUri::parse("nbd://host").unwrap(),
            NbdUri::Tcp { addr: "host:10809".into(), export: "".into() }
        );
        assert_eq!(
            NbdUri::parse("nbd+unix:///e?socket=/tmp/s").unwrap(),
            NbdUri::Unix { path: "/tmp/s".into(), export: "e".into() }
        );
        for bad in ["http://x", "nbd://", "nbd+unix:///e", "nbd+unix:///e?sock=1"] {
            assert!(NbdUri::parse(bad).is_err(), "{bad}");
        }
    }
}
