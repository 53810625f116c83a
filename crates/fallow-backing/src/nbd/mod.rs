//! An upstream NBD server as the backing store: fallow in front of any NBD server (a
//! storage appliance, qemu-nbd, nbdkit with its delay and error filters in tests).
//!
//! ```text
//!  read/write/… ─▶ call ─▶ conn(): the next slot, round robin; a closed one is reopened
//!    register the cookie in `pending`, queue the request in `outbox`
//!    nobody writing? write everything queued, one non-blocking writev, in this task
//!      (requests queued meanwhile by others go out in the same writev; a full socket
//!      hands the rest to a task that waits for room)
//!  reader task (one per connection): the socket in 256 KiB gulps ─▶ decode_reply_head
//!    simple reply, OFFSET_DATA ─▶ data copied (or read, when large) into the request's
//!                                  own buffer, which becomes the `Bytes` it returns
//!    OFFSET_HOLE, BLOCK_STATUS, ERROR*, NONE ─▶ parsed and applied to the request
//!    the last chunk ─▶ the request's oneshot
//! ```
//!
//! Why the caller writes rather than a writer task fed by a queue: measured both ways
//! (`bench/nbd_miss_cost.sh`, 2 CPUs), neither was cheaper: within 1.5 % in instructions
//! per read, the same system calls at QD 1, and at QD 16 one `writev` per 1.1 to 1.7 reads
//! with callers writing against 1.0 to 1.2 with a task, CPU time per read equal within the
//! machine's noise. The caller writing needs no task per connection, no wake-up at QD 1, and
//! no `.await` between queueing and writing (a request cannot be half-written by a
//! cancelled caller).
//!
//! # Negotiation
//! Fixed newstyle. `NBD_OPT_STRUCTURED_REPLY`, then `NBD_OPT_SET_META_CONTEXT` for
//! `base:allocation`, when the server has them: block status is then passed through
//! (`Capabilities::block_status`); a server without them still serves everything else, with
//! simple replies. Then `NBD_OPT_GO`, asking for `NBD_INFO_BLOCK_SIZE`.
//!
//! # Connections
//! With `CAN_MULTI_CONN`, `conns=N` in the URI connections (default
//! `DEFAULT_CONNECTIONS`), else one; any number of requests in flight on each, replies
//! matched by cookie. A connection opens on first use and is reopened after it fails, so the
//! export keeps working when the upstream server comes back.
//!
//! # Failures and retries
//! A connection is done when its socket fails or ends, when the server breaks the protocol,
//! and when the server answers `NBD_ESHUTDOWN` (it is going away): it then takes no new
//! requests, and once its last reply is in it gets `NBD_CMD_DISC`, the soft disconnect the
//! spec asks for; later requests go to a new connection. A request that failed with
//! `NBD_ESHUTDOWN`, or whose connection ended before its reply, is sent once more on another
//! connection if that is safe ([`retry_is_safe`]): READ and BLOCK_STATUS change nothing;
//! WRITE, TRIM and WRITE_ZEROES set their range to what the request alone says, so a second
//! copy is the same as the first arriving late, which the caller already allows for: the
//! request has not completed. FLUSH is not retried: on a new connection (and, without
//! `CAN_MULTI_CONN`, on any other) it would not cover the writes completed on the old one.
//! For the same reason, when a connection closes with writes acknowledged on it that no
//! FLUSH has covered since (the server may have lost them with its cache), the next FLUSH
//! fails, once, after doing what it can ([`FlushCoverage`]).
//!
//! # Locking
//! Per connection, `Conn::pending` (cookie → waiting request) and `Conn::outbox` (requests
//! not written yet) are `parking_lot` mutexes held for a map or queue operation, never
//! across `.await` or a system call; neither is taken while holding the other.
//! `Conn::state` changes only under `pending`, so a request either registers while the
//! connection is open (and is answered or failed by `close`) or sees it closing. The socket
//! is written by one writer at a time, whoever set `Outbox::writing`. `NbdStore::slots`:
//! `parking_lot` mutexes held for an `Arc` clone; a tokio mutex per slot lets one caller
//! reconnect while the others wait for it.

mod conn;
mod negotiate;
mod replies;
mod uri;

use std::collections::{HashMap, VecDeque};
use std::io::{self, IoSlice};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use fallow_proto::nbd::handshake::{decode_greeting, encode_client_flags};
use fallow_proto::nbd::Extent as NbdExtent;
use fallow_proto::nbd::*;
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::{tcp, unix};
use tokio::sync::{oneshot, Notify};

use crate::{check_range, BackingStore, Capabilities, Durability, Extent, Zeroing};

use conn::*;
use negotiate::*;
use replies::*;
pub use uri::{NbdUri, UpstreamTls};

/// How long connecting and negotiating may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections opened when the server allows several and the URI does not say (`conns=N`).
/// One: with 2 CPUs shared by fio, fallow and nbdkit, 2 or 4 connections gave no more IOPS
/// at QD 1 or QD 16 and cost 6 to 22 % more CPU per read, fallow and nbdkit together
/// (docs/benchmarks-history.md, "NBD export against nbdkit"): each one is another reader
/// task here and more threads in the server, and requests spread over them coalesce less.
const DEFAULT_CONNECTIONS: usize = 1;

/// The most connections `conns=N` may ask for.
const MAX_CONNECTIONS: usize = 16;

/// The reader's buffer: it reads whatever the socket holds, up to this much, in one call,
/// so that a burst of replies takes one `recv`.
const GULP: usize = 256 * 1024;

/// Payload bytes still to come from which the reader reads them from the socket straight
/// into the request's buffer rather than through its own (one copy fewer, and no gulp
/// that would also take the next replies).
const DIRECT_READ: usize = 64 * 1024;

/// The most buffers one `writev` is given (headers and WRITE payloads).
const MAX_IOVECS: usize = 64;

/// The largest reply chunk other than `OFFSET_DATA` that is buffered whole: a
/// `BLOCK_STATUS` chunk with the most descriptors the spec allows (an error chunk, with at
/// most a 64 KiB message, is far smaller).
const MAX_CHUNK: u32 = 4 + 8 * MAX_BLOCK_STATUS_EXTENTS as u32;

/// A page of the cache above: the largest minimum block size an upstream export may ask.
const PAGE: u32 = 4096;

/// What negotiation learned, about the export and about one connection.
#[derive(Debug, Clone, Copy)]
struct ExportInfo {
    size: u64,
    flags: u16,
    max_payload: u32,
    /// The export's minimum block size (1 when it did not say): writes, trims and zeroes
    /// must be aligned to it.
    min_block: u32,
    /// The export's preferred block size.
    preferred_block: u32,
    /// `base:allocation` was agreed (on the first connection: what the store offers).
    block_status: bool,
}

/// The transmission flags a reconnection must agree on with the first connection: the
/// ones this store acts on.
const FLAGS_THAT_MATTER: u16 = NBD_FLAG_READ_ONLY
    | NBD_FLAG_SEND_FLUSH
    | NBD_FLAG_SEND_FUA
    | NBD_FLAG_SEND_TRIM
    | NBD_FLAG_SEND_WRITE_ZEROES
    | NBD_FLAG_SEND_FAST_ZERO
    | NBD_FLAG_CAN_MULTI_CONN;

/// One connection slot: the connection, and a lock that lets one caller reconnect.
#[derive(Default)]
struct Slot {
    conn: Mutex<Option<Arc<Conn>>>,
    connecting: tokio::sync::Mutex<()>,
}

impl Slot {
    fn open_conn(&self) -> Option<Arc<Conn>> {
        self.conn.lock().as_ref().filter(|c| c.is_open()).cloned()
    }
}

/// An upstream NBD export.
pub struct NbdStore {
    uri: NbdUri,
    /// The TLS client of an `nbds://` URI, loaded once for every connection.
    tls: Option<fallow_tls::TlsClient>,
    info: ExportInfo,
    durability: Arc<FlushCoverage>,
    slots: Vec<Slot>,
    next: AtomicUsize,
    cookie: AtomicU64,
}

impl std::fmt::Debug for NbdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NbdStore")
            .field("uri", &self.uri.to_string())
            .field("size", &self.info.size)
            .field("connections", &self.slots.len())
            .finish()
    }
}

impl NbdStore {
    /// Connects to `uri` and negotiates (the first connection; others open on use).
    pub async fn connect(uri: &str) -> io::Result<NbdStore> {
        let uri = NbdUri::parse(uri)?;
        let tls = uri.tls().map(|tls| tls.client()).transpose()?;
        let durability = Arc::new(FlushCoverage::default());
        let (conn, info) = open(&uri, 0, &durability, tls.as_ref()).await?;
        let multi = info.flags & NBD_FLAG_CAN_MULTI_CONN != 0;
        let wanted = uri.connections().unwrap_or(DEFAULT_CONNECTIONS);
        if wanted > 1 && !multi {
            tracing::info!(uri = %uri, "the server does not allow several connections; using one");
        }
        let n = if multi { wanted } else { 1 };
        let slots: Vec<Slot> = (0..n).map(|_| Slot::default()).collect();
        if let Some(first) = slots.first() {
            *first.conn.lock() = Some(conn);
        }
        tracing::info!(uri = %uri, size = info.size, flags = format_args!("{:#x}", info.flags), connections = n, block_status = info.block_status, "upstream NBD export opened");
        let (next, cookie) = (AtomicUsize::new(0), AtomicU64::new(1));
        Ok(NbdStore { uri, tls, info, durability, slots, next, cookie })
    }

    /// The next slot's connection, opened if it is not.
    async fn conn(&self) -> io::Result<Arc<Conn>> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        #[expect(clippy::indexing_slicing, reason = "`i` is taken modulo the slots' count")]
        let slot = &self.slots[i];
        if let Some(conn) = slot.open_conn() {
            return Ok(conn);
        }
        let _one = slot.connecting.lock().await;
        if let Some(conn) = slot.open_conn() {
            return Ok(conn);
        }
        let (conn, info) = open(&self.uri, i, &self.durability, self.tls.as_ref()).await?;
        let (was, now) = (self.info, info);
        if now.size != was.size || (now.flags ^ was.flags) & FLAGS_THAT_MATTER != 0 {
            conn.shut();
            return Err(io::Error::other(format!(
                "upstream export {} changed: size {} → {}, flags {:#x} → {:#x}",
                self.uri, was.size, now.size, was.flags, now.flags
            )));
        }
        tracing::info!(uri = %self.uri, slot = i, "connected to the upstream NBD server");
        *slot.conn.lock() = Some(conn.clone());
        Ok(conn)
    }

    /// Sends one request and waits for its reply, once more on another connection if it
    /// failed in a way that allows it (see the module documentation).
    async fn call(
        &self,
        cmd: Cmd,
        flags: u16,
        offset: u64,
        length: u32,
        payload: Bytes,
    ) -> io::Result<Answer> {
        let mut retried = false;
        loop {
            let conn = self.conn().await?;
            let cookie = self.cookie.fetch_add(1, Ordering::Relaxed);
            let head = Request { flags, cmd, cookie, offset, length };
            let failure = match conn.request(cookie, head, payload.clone()).await {
                Ok(answer) => return Ok(answer),
                Err(failure) => failure,
            };
            if retried || !failure.retryable() || !retry_is_safe(cmd) {
                return Err(failure.into_io(&self.uri));
            }
            tracing::debug!(conn = %conn.label, cmd = cmd.name(), offset, length, ?failure, "retrying on another connection");
            retried = true;
        }
    }

    /// One READ of at most the maximum payload: its buffer is the answer.
    async fn read_one(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        match self.call(Cmd::Read, 0, offset, len, Bytes::new()).await? {
            Answer::Data(data) => Ok(data),
            _ => Err(io::Error::other("a READ answered without data")),
        }
    }
}

impl Drop for NbdStore {
    fn drop(&mut self) {
        for slot in &self.slots {
            if let Some(conn) = slot.conn.lock().take() {
                conn.shut();
            }
        }
    }
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

    fn min_block_size(&self) -> u32 {
        self.info.min_block
    }

    fn preferred_block_size(&self) -> u32 {
        self.info.preferred_block.max(PAGE)
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
            block_status: self.info.block_status,
            multi_conn: f & NBD_FLAG_CAN_MULTI_CONN != 0,
        }
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        check_range(offset, len as u64, self.info.size)?;
        if len == 0 {
            return Ok(Bytes::new());
        }
        if len <= self.info.max_payload {
            return self.read_one(offset, len).await;
        }
        let mut out = BytesMut::with_capacity(len as usize);
        let mut at = 0u32;
        while at < len {
            let n = (len - at).min(self.info.max_payload);
            out.extend_from_slice(&self.read_one(offset + at as u64, n).await?);
            at += n;
        }
        Ok(out.freeze())
    }

    async fn write(&self, offset: u64, data: Bytes, durability: Durability) -> io::Result<()> {
        let fua = durability == Durability::Immediate;
        check_range(offset, data.len() as u64, self.info.size)?;
        let caps = self.capabilities();
        let flags = if fua && caps.fua { NBD_CMD_FLAG_FUA } else { 0 };
        let mut at = 0usize;
        while at < data.len() {
            let n = (data.len() - at).min(self.info.max_payload as usize);
            let piece = data.slice(at..at + n);
            self.call(Cmd::Write, flags, offset + at as u64, n as u32, piece).await?;
            at += n;
        }
        if fua && !caps.fua && caps.flush {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&self) -> io::Result<()> {
        if !self.capabilities().flush {
            return Ok(());
        }
        let d = &self.durability;
        let lost = d.lost.swap(false, Ordering::AcqRel);
        let epoch = d.epoch.fetch_add(1, Ordering::AcqRel) + 1;
        self.call(Cmd::Flush, 0, 0, 0, Bytes::new()).await?;
        d.covered.fetch_max(epoch, Ordering::AcqRel);
        if lost {
            let why = format!(
                "{}: a connection closed with writes no FLUSH had covered; they may be lost",
                self.uri
            );
            return Err(io::Error::other(why));
        }
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u32) -> io::Result<()> {
        check_range(offset, len as u64, self.info.size)?;
        if self.capabilities().trim {
            self.call(Cmd::Trim, 0, offset, len, Bytes::new()).await?;
        }
        Ok(())
    }

    async fn write_zeroes(&self, offset: u64, len: u32, zeroing: Zeroing) -> io::Result<()> {
        check_range(offset, len as u64, self.info.size)?;
        if self.info.flags & NBD_FLAG_SEND_WRITE_ZEROES != 0 {
            let flags = match zeroing {
                Zeroing::MayDeallocate => 0,
                Zeroing::KeepAllocated => NBD_CMD_FLAG_NO_HOLE,
            };
            self.call(Cmd::WriteZeroes, flags, offset, len, Bytes::new()).await?;
            return Ok(());
        }
        let zeros = Bytes::from(vec![0u8; (len as usize).min(1 << 20)]);
        let mut at = 0u64;
        while at < len as u64 {
            let n = (len as u64 - at).min(zeros.len() as u64) as usize;
            self.write(offset + at, zeros.slice(..n), Durability::AtFlush).await?;
            at += n as u64;
        }
        Ok(())
    }

    /// The upstream's own `base:allocation` answer, passed through.
    async fn block_status(&self, offset: u64, len: u32) -> io::Result<Vec<Extent>> {
        check_range(offset, len as u64, self.info.size)?;
        if !self.info.block_status {
            let why = format!("{} does not offer {BASE_ALLOCATION}", self.uri);
            return Err(io::Error::new(io::ErrorKind::Unsupported, why));
        }
        if len == 0 {
            return Ok(Vec::new());
        }
        let Answer::Extents(got) =
            self.call(Cmd::BlockStatus, 0, offset, len, Bytes::new()).await?
        else {
            return Err(io::Error::other("BLOCK_STATUS answered without extents"));
        };
        let total: u64 = got.iter().map(|e| e.length as u64).sum();
        if got.is_empty() || total > len as u64 {
            let why = format!("{}: block status of {total} bytes for {len}", self.uri);
            return Err(io::Error::new(io::ErrorKind::InvalidData, why));
        }
        Ok(got
            .into_iter()
            .map(|e| Extent {
                length: e.length as u64,
                hole: e.flags & NBD_STATE_HOLE != 0,
                zero: e.flags & NBD_STATE_ZERO != 0,
            })
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uris() {
        assert_eq!(
            NbdUri::parse("nbd://127.0.0.1:10810/disk").unwrap(),
            NbdUri::Tcp {
                addr: "127.0.0.1:10810".into(),
                export: "disk".into(),
                connections: None,
                tls: None,
            }
        );
        assert_eq!(
            NbdUri::parse("nbd://host").unwrap(),
            NbdUri::Tcp {
                addr: "host:10809".into(),
                export: "".into(),
                connections: None,
                tls: None
            }
        );
        assert_eq!(
            NbdUri::parse("nbd+unix:///e?socket=/tmp/s").unwrap(),
            NbdUri::Unix {
                path: "/tmp/s".into(),
                export: "e".into(),
                connections: None,
                tls: None
            }
        );
        for bad in ["http://x", "nbd://", "nbd+unix:///e", "nbd+unix:///e?sock=1"] {
            assert!(NbdUri::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tls_uris() {
        let uri = NbdUri::parse("nbds://alice@[::1]:10810/disk?tls-psk-file=/k.psk").unwrap();
        let tls = uri.tls().unwrap();
        assert_eq!(tls.username.as_deref(), Some("alice"));
        assert_eq!(tls.psk_file, Some("/k.psk".into()));
        assert_eq!(tls.host, "::1");
        assert_eq!(uri.to_string(), "nbds://[::1]:10810/disk");
        let uri = NbdUri::parse("nbds://h.example/d?tls-certificates=/etc/pki").unwrap();
        assert_eq!(uri.tls().unwrap().host, "h.example");
        assert_eq!(uri.tls().unwrap().certificates, Some("/etc/pki".into()));
        let unix = NbdUri::parse("nbds+unix:///e?socket=/s&tls-certificates=/c").unwrap();
        assert_eq!(unix.tls().unwrap().host, "localhost");
        for (bad, why) in [
            ("nbds://h/d", "tls-certificates=DIR or tls-psk-file"),
            ("nbd://h/d?tls-certificates=/c", "needs nbds://"),
            ("nbd://alice@h/d", "user name"),
            ("nbds+unix://h/e?socket=/s&tls-certificates=/c", "no host"),
        ] {
            let err = NbdUri::parse(bad).unwrap_err().to_string();
            assert!(err.contains(why), "{bad}: {err}");
        }
    }

    #[test]
    fn uris_with_a_connection_count() {
        let tcp = NbdUri::parse("nbd://h:1/d?conns=2").unwrap();
        let expected =
            NbdUri::Tcp { addr: "h:1".into(), export: "d".into(), connections: Some(2), tls: None };
        assert_eq!(tcp, expected);
        assert_eq!(tcp.to_string(), "nbd://h:1/d?conns=2");
        assert_eq!(NbdUri::parse("nbd://h?conns=3").unwrap().connections(), Some(3));
        let unix = NbdUri::parse("nbd+unix:///e?conns=4&socket=/s").unwrap();
        assert_eq!(unix.connections(), Some(4));
        assert_eq!(unix.to_string(), "nbd+unix:///e?socket=/s&conns=4");
        assert_eq!(NbdUri::parse(&unix.to_string()).unwrap(), unix);
        for bad in
            ["nbd://h/d?conns=0", "nbd://h/d?conns=17", "nbd://h/d?conns=x", "nbd://h?socket=/s"]
        {
            assert!(NbdUri::parse(bad).is_err(), "{bad}");
        }
    }

    fn frame(payload: &'static [u8]) -> Frame {
        Frame { head: [7; REQUEST_LEN], payload: Bytes::from_static(payload) }
    }

    #[test]
    fn a_batch_drops_what_was_written_across_frames() {
        let mut batch = Batch::default();
        batch.frames.extend([frame(b""), frame(b"abcd"), frame(b"")]);
        batch.consume(10);
        assert_eq!((batch.frames.len(), batch.sent), (3, 10));
        batch.consume(REQUEST_LEN - 10 + REQUEST_LEN + 3);
        assert_eq!((batch.frames.len(), batch.sent), (2, REQUEST_LEN + 3));
        batch.consume(1);
        assert_eq!((batch.frames.len(), batch.sent), (1, 0));
        batch.consume(REQUEST_LEN);
        assert!(batch.frames.is_empty());
    }

    #[test]
    fn only_requests_that_can_run_twice_are_retried() {
        for cmd in [Cmd::Read, Cmd::BlockStatus, Cmd::Write, Cmd::Trim, Cmd::WriteZeroes] {
            assert!(retry_is_safe(cmd), "{cmd:?}");
        }
        assert!(!retry_is_safe(Cmd::Flush));
        let shutdown = Failure::Nbd { error: NBD_ESHUTDOWN, message: String::new() };
        assert!(shutdown.retryable() && Failure::Lost(String::new()).retryable());
        assert!(!Failure::Nbd { error: NBD_EIO, message: String::new() }.retryable());
        assert!(!Failure::Bad(String::new()).retryable());
    }
}
