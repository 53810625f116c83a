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
//! fails, once, after doing what it can ([`Durability`]).
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

use crate::{check_range, BackingStore, Capabilities, Extent};

/// How long connecting and negotiating may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections opened when the server allows several and the URI does not say (`conns=N`).
/// One: with 2 CPUs shared by fio, fallow and nbdkit, 2 or 4 connections gave no more IOPS
/// at QD 1 or QD 16 and cost 6 to 22 % more CPU per read, fallow and nbdkit together
/// (BENCHMARKS.md, "NBD export against nbdkit"): each one is another reader task here and
/// more threads in the server, and requests spread over them coalesce less.
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

/// Where the upstream server is, and how to use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdUri {
    /// `nbd://HOST:PORT/EXPORT[?conns=N]`.
    Tcp {
        /// `HOST:PORT`.
        addr: String,
        /// The export name (may be empty).
        export: String,
        /// `conns=N`: connections to open if the server allows several.
        connections: Option<usize>,
    },
    /// `nbd+unix:///EXPORT?socket=PATH[&conns=N]`.
    Unix {
        /// The socket.
        path: PathBuf,
        /// The export name (may be empty).
        export: String,
        /// `conns=N`: connections to open if the server allows several.
        connections: Option<usize>,
    },
}

impl NbdUri {
    /// Parses `nbd://HOST[:PORT][/EXPORT]` (port 10809 by default) or
    /// `nbd+unix:///[EXPORT]?socket=PATH`, either with `conns=N` (1 to 16) among its query
    /// parameters.
    pub fn parse(uri: &str) -> io::Result<NbdUri> {
        let bad = |why: &str| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("NBD URI {uri:?}: {why}"))
        };
        let (unix, rest) = if let Some(rest) = uri.strip_prefix("nbd+unix://") {
            (true, rest)
        } else if let Some(rest) = uri.strip_prefix("nbd://") {
            (false, rest)
        } else {
            return Err(bad("expected nbd:// or nbd+unix://"));
        };
        let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (mut socket, mut connections) = (None, None);
        for param in query.split('&').filter(|p| !p.is_empty()) {
            match param.split_once('=') {
                Some(("socket", path)) if unix => socket = Some(PathBuf::from(path)),
                Some(("conns", n)) => {
                    let n = n.parse().ok().filter(|n| (1..=MAX_CONNECTIONS).contains(n));
                    let why = format!("conns must be 1 to {MAX_CONNECTIONS}");
                    connections = Some(n.ok_or_else(|| bad(&why))?);
                }
                _ => return Err(bad(&format!("unknown parameter {param:?}"))),
            }
        }
        if unix {
            let export = rest.strip_prefix('/').unwrap_or(rest).to_string();
            let path = socket.ok_or_else(|| bad("needs ?socket=PATH"))?;
            return Ok(NbdUri::Unix { path, export, connections });
        }
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
        Ok(NbdUri::Tcp { addr, export, connections })
    }

    fn export(&self) -> &str {
        match self {
            NbdUri::Tcp { export, .. } | NbdUri::Unix { export, .. } => export,
        }
    }

    /// The connections the URI asks for (`conns=N`), if it says.
    pub fn connections(&self) -> Option<usize> {
        match self {
            NbdUri::Tcp { connections, .. } | NbdUri::Unix { connections, .. } => *connections,
        }
    }
}

impl std::fmt::Display for NbdUri {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let sep = match self {
            NbdUri::Tcp { addr, export, .. } => {
                write!(f, "nbd://{addr}/{export}")?;
                '?'
            }
            NbdUri::Unix { path, export, .. } => {
                write!(f, "nbd+unix:///{export}?socket={}", path.display())?;
                '&'
            }
        };
        match self.connections() {
            Some(n) => write!(f, "{sep}conns={n}"),
            None => Ok(()),
        }
    }
}

type Reader = Box<dyn AsyncRead + Send + Unpin>;

/// The write half of a connection, as tokio's own type: a request is written with one
/// non-blocking `writev` from whichever task has it, with no `.await` in between.
enum WriteHalf {
    Tcp(tcp::OwnedWriteHalf),
    Unix(unix::OwnedWriteHalf),
}

impl WriteHalf {
    fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            WriteHalf::Tcp(w) => w.try_write_vectored(bufs),
            WriteHalf::Unix(w) => w.try_write_vectored(bufs),
        }
    }

    async fn writable(&self) -> io::Result<()> {
        match self {
            WriteHalf::Tcp(w) => w.writable().await,
            WriteHalf::Unix(w) => w.writable().await,
        }
    }

    async fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            WriteHalf::Tcp(w) => w.write_all(buf).await,
            WriteHalf::Unix(w) => w.write_all(buf).await,
        }
    }
}

/// A request not written yet: its header, and for a WRITE its data.
struct Frame {
    head: [u8; REQUEST_LEN],
    payload: Bytes,
}

/// The requests waiting to be written.
#[derive(Default)]
struct Outbox {
    queue: VecDeque<Frame>,
    /// Someone is writing (a caller, or the task that waits for room): whoever queues a
    /// frame meanwhile leaves it to them, and they take it before they stop.
    writing: bool,
    /// The writer's emptied queue, kept for its capacity.
    spare: VecDeque<Frame>,
}

/// The frames one writer took off the queue, and how much of the first is written.
#[derive(Default)]
struct Batch {
    frames: VecDeque<Frame>,
    sent: usize,
}

impl Batch {
    /// Writes as much as the socket takes without waiting: `Ok(true)` once all is written,
    /// `Ok(false)` when the socket is full.
    fn write(&mut self, writer: &WriteHalf) -> io::Result<bool> {
        while !self.frames.is_empty() {
            let written = {
                // Sized for the usual batch, one request alone; grown for more.
                let parts = (2 * self.frames.len()).min(MAX_IOVECS);
                let mut small = [IoSlice::new(&[]); 2];
                let mut large;
                let iov: &mut [IoSlice<'_>] = if parts <= 2 {
                    &mut small
                } else {
                    large = [IoSlice::new(&[]); MAX_IOVECS];
                    &mut large
                };
                let (mut n, mut skip) = (0, self.sent);
                'fill: for frame in &self.frames {
                    for part in [&frame.head[..], &frame.payload[..]] {
                        if skip >= part.len() {
                            skip -= part.len();
                            continue;
                        }
                        iov[n] = IoSlice::new(&part[skip..]);
                        (n, skip) = (n + 1, 0);
                        if n == iov.len() {
                            break 'fill;
                        }
                    }
                }
                match writer.try_write_vectored(&iov[..n]) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(written) => written,
                    Err(err) if err.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                    Err(err) => return Err(err),
                }
            };
            self.consume(written);
        }
        Ok(true)
    }

    /// Drops the first `n` bytes of the batch.
    fn consume(&mut self, mut n: usize) {
        while let Some(frame) = self.frames.front() {
            let left = REQUEST_LEN + frame.payload.len() - self.sent;
            if n < left {
                self.sent += n;
                return;
            }
            n -= left;
            self.sent = 0;
            self.frames.pop_front();
        }
    }
}

/// Why a request failed, as far as retrying it goes.
#[derive(Debug)]
enum Failure {
    /// The server answered with this NBD error.
    Nbd { error: u32, message: String },
    /// The connection ended (or was closing) before the reply.
    Lost(String),
    /// The reply broke the protocol in a way that fails this request only (a READ without
    /// all its data, a BLOCK_STATUS without its context).
    Bad(String),
}

impl Failure {
    fn retryable(&self) -> bool {
        matches!(self, Failure::Lost(_) | Failure::Nbd { error: NBD_ESHUTDOWN, .. })
    }

    fn into_io(self, uri: &NbdUri) -> io::Error {
        match self {
            Failure::Nbd { error, message } if message.is_empty() => {
                io::Error::new(kind_of(error), format!("{uri}: upstream NBD error {error}"))
            }
            Failure::Nbd { error, message } => io::Error::new(
                kind_of(error),
                format!("{uri}: upstream NBD error {error}: {message}"),
            ),
            Failure::Lost(why) => io::Error::new(io::ErrorKind::ConnectionAborted, why),
            Failure::Bad(why) => io::Error::new(io::ErrorKind::InvalidData, why),
        }
    }
}

/// Whether a request may be sent again after an `NBD_ESHUTDOWN` or a lost connection (see
/// the module documentation).
fn retry_is_safe(cmd: Cmd) -> bool {
    matches!(cmd, Cmd::Read | Cmd::BlockStatus | Cmd::Write | Cmd::Trim | Cmd::WriteZeroes)
}

/// A successful reply.
enum Answer {
    /// A READ's data.
    Data(Bytes),
    /// A BLOCK_STATUS's `base:allocation` descriptors.
    Extents(Vec<NbdExtent>),
    /// Anything else.
    Done,
}

/// A request waiting for its reply.
struct Pending {
    cmd: Cmd,
    /// Sent with FUA: durable once answered.
    fua: bool,
    offset: u64,
    length: u32,
    /// A READ's data (see [`Pending::place`]), and how many of its bytes chunks covered.
    data: BytesMut,
    covered: u64,
    /// A BLOCK_STATUS's descriptors for `base:allocation`.
    extents: Option<Vec<NbdExtent>>,
    /// The first error the server reported.
    error: Option<(u32, String)>,
    done: oneshot::Sender<Result<Answer, Failure>>,
}

impl Pending {
    fn fail(self, why: &str) {
        let _ = self.done.send(Err(Failure::Lost(why.to_string())));
    }

    /// Where `len` bytes of a READ's data at `offset` go, or `None` when they are outside
    /// the request. Data that continues what came before (a simple reply, the usual single
    /// chunk, chunks in order) is appended; anything else is written in place, in a buffer
    /// zero-filled to its full length the first time, which also makes holes read as zeros.
    fn place(&mut self, offset: u64, len: u32) -> Option<Place> {
        let start = offset.checked_sub(self.offset)?;
        if self.cmd != Cmd::Read || start + len as u64 > self.length as u64 {
            return None;
        }
        if start == self.data.len() as u64 {
            return Some(Place::Append);
        }
        self.data.resize(self.length as usize, 0);
        Some(Place::At(start as usize))
    }
}

/// See [`Pending::place`].
enum Place {
    Append,
    At(usize),
}

/// Which acknowledged writes a FLUSH has covered, shared by the store and its connections.
///
/// Every FLUSH takes the next epoch as it starts; a write acknowledged without FUA marks
/// its connection with the epoch it would need (the next one). A connection that closes
/// with a mark above `covered` had writes no successful FLUSH covered, and sets `lost`; the
/// next FLUSH reports it. Marks are taken after the reply is in and epochs before the FLUSH
/// is sent, so a write counts as covered only if the server answered it first; a race can
/// only make a FLUSH report a loss that did not happen, never hide one.
#[derive(Debug, Default)]
struct Durability {
    epoch: AtomicU64,
    /// The epoch of the latest FLUSH that succeeded.
    covered: AtomicU64,
    lost: AtomicBool,
}

/// [`Conn::state`]: open for requests.
const OPEN: u8 = 0;
/// The server said `NBD_ESHUTDOWN`: no new requests; DISC once the last reply is in.
const CLOSING: u8 = 1;
/// DISC is sent; the reader waits for the server to close.
const DISCONNECTED: u8 = 2;
/// Done: every request failed or answered.
const CLOSED: u8 = 3;

/// One connection to the upstream server.
struct Conn {
    /// `URI #slot`, for logs.
    label: String,
    /// Structured replies were agreed: a READ is answered with chunks.
    structured: bool,
    /// The id the server gave `base:allocation` on this connection, if it gave one.
    base_allocation: Option<u32>,
    /// Written only by whoever set `Outbox::writing`.
    writer: WriteHalf,
    outbox: Mutex<Outbox>,
    /// Cookie → the request waiting for its reply.
    pending: Mutex<HashMap<u64, Pending>>,
    /// `OPEN`, `CLOSING`, `DISCONNECTED` or `CLOSED`; changed only under `pending`.
    state: AtomicU8,
    /// Notified when the store is dropped: the reader stops.
    stop: Notify,
    durability: Arc<Durability>,
    /// The epoch a FLUSH needs to cover the writes acknowledged here (0: none).
    unflushed: AtomicU64,
}

impl Conn {
    fn is_open(&self) -> bool {
        self.state.load(Ordering::Acquire) == OPEN
    }

    /// Sends one request and waits for its reply.
    async fn request(
        self: &Arc<Self>,
        cookie: u64,
        head: Request,
        payload: Bytes,
    ) -> Result<Answer, Failure> {
        let Request { cmd, offset, length, flags, .. } = head;
        if cmd == Cmd::BlockStatus && self.base_allocation.is_none() {
            // A reconnection to a server that no longer offers the context: "no
            // information" is always a correct answer, and asking would break the protocol.
            return Ok(Answer::Extents(vec![NbdExtent { length, flags: 0 }]));
        }
        let (done, answer) = oneshot::channel();
        let data = if cmd == Cmd::Read {
            BytesMut::with_capacity(length as usize)
        } else {
            BytesMut::new()
        };
        let fua = flags & NBD_CMD_FLAG_FUA != 0;
        let (covered, extents, error) = (0, None, None);
        let pending = Pending { cmd, fua, offset, length, data, covered, extents, error, done };
        {
            let mut map = self.pending.lock();
            if self.state.load(Ordering::Acquire) != OPEN {
                return Err(Failure::Lost(format!("{}: the connection is closing", self.label)));
            }
            map.insert(cookie, pending);
        }
        self.submit(Frame { head: head.to_bytes(), payload });
        answer.await.unwrap_or_else(|_| {
            Err(Failure::Lost(format!("{}: the connection closed", self.label)))
        })
    }

    /// Queues a frame and, if nobody is writing, writes everything queued.
    fn submit(self: &Arc<Self>, frame: Frame) {
        {
            let mut out = self.outbox.lock();
            out.queue.push_back(frame);
            if out.writing {
                return;
            }
            out.writing = true;
        }
        let mut batch = Batch::default();
        loop {
            if !self.take_queued(&mut batch) {
                return;
            }
            match batch.write(&self.writer) {
                Ok(true) => {}
                Ok(false) => {
                    // The socket is full: a task waits for room (we may not: our caller
                    // could be cancelled between two halves of a request).
                    match tokio::runtime::Handle::try_current() {
                        Ok(runtime) => drop(runtime.spawn(self.clone().write_rest(batch))),
                        Err(_) => self.write_failed("no runtime to wait for the socket in"),
                    }
                    return;
                }
                Err(err) => return self.write_failed(&format!("writing to the server: {err}")),
            }
        }
    }

    /// Moves what is queued into `batch` (empty): false when nothing is, and then this
    /// writer is done and `writing` is cleared.
    fn take_queued(&self, batch: &mut Batch) -> bool {
        let mut out = self.outbox.lock();
        if out.queue.is_empty() {
            out.writing = false;
            if batch.frames.capacity() > 0 {
                out.spare = std::mem::take(&mut batch.frames);
            }
            return false;
        }
        if batch.frames.capacity() == 0 {
            batch.frames = std::mem::take(&mut out.spare);
        }
        std::mem::swap(&mut out.queue, &mut batch.frames);
        batch.sent = 0;
        true
    }

    /// Writes `batch` and whatever is queued behind it, waiting for room in the socket.
    async fn write_rest(self: Arc<Self>, mut batch: Batch) {
        let written: io::Result<()> = async {
            loop {
                if batch.frames.is_empty() && !self.take_queued(&mut batch) {
                    return Ok(());
                }
                if !batch.write(&self.writer)? {
                    self.writer.writable().await?;
                }
            }
        }
        .await;
        if let Err(err) = written {
            self.write_failed(&format!("writing to the server: {err}"));
        }
    }

    fn write_failed(&self, why: &str) {
        {
            let mut out = self.outbox.lock();
            out.queue.clear();
            out.writing = false;
        }
        self.close(why);
    }

    /// The server said `NBD_ESHUTDOWN`: take no new requests.
    fn begin_closing(&self) {
        let _map = self.pending.lock();
        if self.state.load(Ordering::Acquire) == OPEN {
            self.state.store(CLOSING, Ordering::Release);
            tracing::info!(conn = %self.label, "the upstream NBD server is shutting down; later requests go to a new connection");
        }
    }

    /// Sends DISC once a closing connection has no request left in flight.
    fn disconnect_if_idle(self: &Arc<Self>) {
        if self.state.load(Ordering::Acquire) != CLOSING {
            return;
        }
        {
            let map = self.pending.lock();
            if !map.is_empty() || self.state.load(Ordering::Acquire) != CLOSING {
                return;
            }
            self.state.store(DISCONNECTED, Ordering::Release);
        }
        self.send_disc();
    }

    fn send_disc(self: &Arc<Self>) {
        let disc = Request { flags: 0, cmd: Cmd::Disc, cookie: 0, offset: 0, length: 0 };
        self.submit(Frame { head: disc.to_bytes(), payload: Bytes::new() });
    }

    /// The store is going away: a soft disconnect, then the reader stops.
    fn shut(self: &Arc<Self>) {
        let was = {
            let _map = self.pending.lock();
            let was = self.state.load(Ordering::Acquire);
            if was < DISCONNECTED {
                self.state.store(DISCONNECTED, Ordering::Release);
            }
            was
        };
        if was < DISCONNECTED {
            self.send_disc();
        }
        self.stop.notify_one();
    }

    /// Fails every waiting request; the connection takes no more.
    fn close(&self, why: &str) {
        let mut map = self.pending.lock();
        if self.state.swap(CLOSED, Ordering::AcqRel) != CLOSED {
            let d = &self.durability;
            if self.unflushed.load(Ordering::Acquire) > d.covered.load(Ordering::Acquire) {
                d.lost.store(true, Ordering::Release);
                tracing::debug!(conn = %self.label, "closed with writes no FLUSH covered");
            }
        }
        for (_, pending) in map.drain() {
            pending.fail(why);
        }
    }
}

/// What negotiation learned, about the export and about one connection.
#[derive(Debug, Clone, Copy)]
struct ExportInfo {
    size: u64,
    flags: u16,
    max_payload: u32,
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
    info: ExportInfo,
    durability: Arc<Durability>,
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
        let durability = Arc::new(Durability::default());
        let (conn, info) = open(&uri, 0, &durability).await?;
        let multi = info.flags & NBD_FLAG_CAN_MULTI_CONN != 0;
        let wanted = uri.connections().unwrap_or(DEFAULT_CONNECTIONS);
        if wanted > 1 && !multi {
            tracing::info!(uri = %uri, "the server does not allow several connections; using one");
        }
        let n = if multi { wanted } else { 1 };
        let slots: Vec<Slot> = (0..n).map(|_| Slot::default()).collect();
        *slots[0].conn.lock() = Some(conn);
        tracing::info!(uri = %uri, size = info.size, flags = format_args!("{:#x}", info.flags), connections = n, block_status = info.block_status, "upstream NBD export opened");
        let (next, cookie) = (AtomicUsize::new(0), AtomicU64::new(1));
        Ok(NbdStore { uri, info, durability, slots, next, cookie })
    }

    /// The next slot's connection, opened if it is not.
    async fn conn(&self) -> io::Result<Arc<Conn>> {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.slots.len();
        let slot = &self.slots[i];
        if let Some(conn) = slot.open_conn() {
            return Ok(conn);
        }
        let _one = slot.connecting.lock().await;
        if let Some(conn) = slot.open_conn() {
            return Ok(conn);
        }
        let (conn, info) = open(&self.uri, i, &self.durability).await?;
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

/// Connects, negotiates and starts the reader: a connection for slot `slot`.
async fn open(
    uri: &NbdUri,
    slot: usize,
    durability: &Arc<Durability>,
) -> io::Result<(Arc<Conn>, ExportInfo)> {
    tokio::time::timeout(CONNECT_TIMEOUT, async {
        let cannot =
            |e: io::Error| io::Error::new(e.kind(), format!("cannot connect to {uri}: {e}"));
        let (mut reader, mut writer): (Reader, WriteHalf) = match uri {
            NbdUri::Tcp { addr, .. } => {
                let s = tokio::net::TcpStream::connect(addr.as_str()).await.map_err(cannot)?;
                s.set_nodelay(true)?;
                let (r, w) = s.into_split();
                (Box::new(r), WriteHalf::Tcp(w))
            }
            NbdUri::Unix { path, .. } => {
                let s = tokio::net::UnixStream::connect(path).await.map_err(cannot)?;
                let (r, w) = s.into_split();
                (Box::new(r), WriteHalf::Unix(w))
            }
        };
        let mut input = BytesMut::with_capacity(GULP);
        let mut haggle =
            Haggle { uri, reader: &mut reader, writer: &mut writer, input: &mut input };
        let (info, structured, base_allocation) = haggle.negotiate().await?;
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

fn protocol_error(uri: &NbdUri, what: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("{uri}: {what}"))
}

/// Option haggling on a new connection.
struct Haggle<'a> {
    uri: &'a NbdUri,
    reader: &'a mut Reader,
    writer: &'a mut WriteHalf,
    input: &'a mut BytesMut,
}

impl Haggle<'_> {
    /// Fixed newstyle; structured replies and `base:allocation` if the server has them;
    /// then GO (a server without GO is too old).
    /// Returns what the export is, whether structured replies were agreed, and the id of
    /// `base:allocation`.
    async fn negotiate(&mut self) -> io::Result<(ExportInfo, bool, Option<u32>)> {
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
        let mut client_flags = NBD_FLAG_C_FIXED_NEWSTYLE;
        if flags & NBD_FLAG_NO_ZEROES != 0 {
            client_flags |= NBD_FLAG_C_NO_ZEROES;
        }
        let mut out = BytesMut::new();
        encode_client_flags(&mut out, client_flags);
        Opt::StructuredReply.encode(&mut out);
        self.writer.write_all(&out).await?;
        let structured = match self.reply(NBD_OPT_STRUCTURED_REPLY).await? {
            OptionReply::Ack => true,
            OptionReply::Error { .. } => false,
            other => return Err(self.unexpected("STRUCTURED_REPLY", &other)),
        };
        let base_allocation = if structured { self.base_allocation().await? } else { None };
        let (size, flags, max_payload) = self.go().await?;
        let block_status = base_allocation.is_some();
        Ok((ExportInfo { size, flags, max_payload, block_status }, structured, base_allocation))
    }

    /// SET_META_CONTEXT `base:allocation`: the id the server gives it, if it does.
    async fn base_allocation(&mut self) -> io::Result<Option<u32>> {
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

    /// GO with a request for the block sizes: (size, transmission flags, max payload).
    async fn go(&mut self) -> io::Result<(u64, u16, u32)> {
        let name = self.uri.export().to_string();
        self.send(Opt::Go(ExportOpt { name, info_requests: vec![NBD_INFO_BLOCK_SIZE] })).await?;
        let (mut size, mut flags, mut max_payload) = (None, 0u16, DEFAULT_MAX_PAYLOAD);
        loop {
            match self.reply(NBD_OPT_GO).await? {
                OptionReply::Info(Info::Export { size: s, flags: f }) => {
                    size = Some(s);
                    flags = f;
                }
                OptionReply::Info(Info::BlockSize(b)) => {
                    max_payload = b.max.clamp(4096, DEFAULT_MAX_PAYLOAD)
                }
                OptionReply::Info(_) => {}
                OptionReply::Ack => break,
                OptionReply::Error { error, message } => {
                    // A soft disconnect, as the spec asks (after NBD_REP_ERR_SHUTDOWN it
                    // must); the connection is dropped either way.
                    let _ = self.send(Opt::Abort).await;
                    let why = format!("export refused ({error:?}): {message}");
                    return Err(protocol_error(self.uri, why));
                }
                other => return Err(self.unexpected("GO", &other)),
            }
        }
        let size = size.ok_or_else(|| protocol_error(self.uri, "GO succeeded without a size"))?;
        Ok((size, flags, max_payload))
    }

    async fn send(&mut self, opt: Opt) -> io::Result<()> {
        let mut out = BytesMut::new();
        opt.encode(&mut out);
        self.writer.write_all(&out).await
    }

    /// The next option reply, which must answer `option`.
    async fn reply(&mut self, option: u32) -> io::Result<OptionReply> {
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

    fn unexpected(&self, option: &str, reply: &OptionReply) -> io::Error {
        protocol_error(self.uri, format!("unexpected reply to {option}: {reply:?}"))
    }

    async fn fill(&mut self) -> io::Result<()> {
        if self.reader.read_buf(self.input).await? == 0 {
            let why = "server closed during negotiation";
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, why));
        }
        Ok(())
    }
}

/// The reader of one connection: hands each reply to its waiting request.
struct Replies {
    conn: Arc<Conn>,
    reader: Reader,
    /// What was read and not yet used; at least `GULP / 4` free before each read.
    input: BytesMut,
    /// The largest READ this store sends: a longer data chunk is a protocol error.
    max_data: u32,
}

impl Replies {
    async fn run(mut self) {
        let conn = self.conn.clone();
        let ended = tokio::select! {
            biased;
            ended = self.serve() => ended,
            _ = conn.stop.notified() => Err("the store was dropped".to_string()),
        };
        let Err(why) = ended;
        if conn.is_open() {
            tracing::warn!(conn = %conn.label, reason = %why, "upstream NBD connection lost");
        } else {
            tracing::debug!(conn = %conn.label, reason = %why, "upstream NBD connection ended");
        }
        conn.close(&why);
    }

    async fn serve(&mut self) -> Result<std::convert::Infallible, String> {
        loop {
            let head = loop {
                match decode_reply_head(&mut self.input, self.max_data, MAX_CHUNK) {
                    Ok(Some(head)) => break head,
                    Ok(None) => fill(&mut self.reader, &mut self.input, 0).await?,
                    Err(err) => return Err(format!("bad reply: {err}")),
                }
            };
            match head {
                ReplyHead::Simple(reply) => self.simple(reply).await?,
                ReplyHead::Data { flags, cookie, offset, data_len } => {
                    self.data(flags, cookie, offset, data_len).await?
                }
                ReplyHead::Chunk(head) => self.chunk(head).await?,
            }
        }
    }

    /// The request `cookie` answers, out of the map while its reply is handled: whoever
    /// takes it answers it, puts it back or fails it.
    fn take(&self, cookie: u64) -> Result<Pending, String> {
        let pending = self.conn.pending.lock().remove(&cookie);
        pending.ok_or_else(|| format!("a reply to unknown cookie {cookie}"))
    }

    async fn simple(&mut self, reply: SimpleReply) -> Result<(), String> {
        let mut pending = self.take(reply.cookie)?;
        if reply.error != 0 {
            pending.error = Some((reply.error, String::new()));
        } else if pending.cmd == Cmd::Read {
            if self.conn.structured {
                // Structured replies forbid a simple reply with data to a READ: what
                // follows cannot be framed.
                let why = "a simple reply with data to a READ".to_string();
                return self.broken(pending, why);
            }
            let len = pending.length as usize;
            let read = read_append(&mut self.reader, &mut self.input, &mut pending.data, len).await;
            if let Err(why) = read {
                return self.broken(pending, why);
            }
            pending.covered = pending.length as u64;
        }
        self.finish(pending);
        Ok(())
    }

    async fn data(&mut self, flags: u16, cookie: u64, offset: u64, len: u32) -> Result<(), String> {
        let mut pending = self.take(cookie)?;
        let (input, reader) = (&mut self.input, &mut self.reader);
        let read = match pending.place(offset, len) {
            None => Err(format!("data at {offset}+{len} outside its request")),
            Some(Place::Append) => {
                read_append(reader, input, &mut pending.data, len as usize).await
            }
            Some(Place::At(at)) => {
                read_exact(reader, input, &mut pending.data[at..at + len as usize]).await
            }
        };
        if let Err(why) = read {
            return self.broken(pending, why);
        }
        pending.covered += len as u64;
        self.done_or_back(flags & NBD_REPLY_FLAG_DONE != 0, cookie, pending);
        Ok(())
    }

    async fn chunk(&mut self, head: ChunkHead) -> Result<(), String> {
        let len = head.length as usize;
        while self.input.len() < len {
            fill(&mut self.reader, &mut self.input, len).await?;
        }
        // A copy, so that the gulp buffer stays unshared and is reused in place.
        let payload = Bytes::copy_from_slice(&self.input[..len]);
        self.input.advance(len);
        let body = head.parse_payload(payload).map_err(|e| format!("bad reply chunk: {e}"))?;
        let mut pending = self.take(head.cookie)?;
        let broken = match body {
            ChunkBody::None => None,
            ChunkBody::OffsetHole { offset, length } => match pending.place(offset, length) {
                Some(Place::Append) => {
                    let end = pending.data.len() + length as usize;
                    pending.data.resize(end, 0);
                    pending.covered += length as u64;
                    None
                }
                // Zeroed already.
                Some(Place::At(_)) => {
                    pending.covered += length as u64;
                    None
                }
                None => Some(format!("a hole at {offset}+{length} outside its request")),
            },
            ChunkBody::BlockStatus { context_id, extents } => {
                if pending.cmd != Cmd::BlockStatus {
                    Some("block status in reply to another command".to_string())
                } else if Some(context_id) != self.conn.base_allocation {
                    None // a context not asked for: ignored
                } else if pending.extents.replace(extents).is_some() {
                    Some("two block-status chunks for one context".to_string())
                } else {
                    None
                }
            }
            ChunkBody::Error { error, message }
            | ChunkBody::ErrorOffset { error, message, .. }
            | ChunkBody::UnknownError { error, message, .. } => {
                let error = if error == 0 { NBD_EIO } else { error };
                pending.error.get_or_insert((error, message));
                None
            }
            ChunkBody::OffsetData { .. } => Some("data where a header was expected".to_string()),
            ChunkBody::Unknown { chunk_type, .. } => {
                // The spec makes the client hang up on a chunk type it does not know.
                Some(format!("a reply chunk of unknown type {chunk_type}"))
            }
        };
        if let Some(why) = broken {
            return self.broken(pending, why);
        }
        self.done_or_back(head.is_done(), head.cookie, pending);
        Ok(())
    }

    /// The connection cannot go on: closed first, so that the failed request's retry
    /// does not find it open.
    fn broken(&self, pending: Pending, why: String) -> Result<(), String> {
        tracing::warn!(conn = %self.conn.label, reason = %why, "upstream NBD connection closed");
        self.conn.close(&why);
        pending.fail(&why);
        Err(why)
    }

    fn done_or_back(&self, done: bool, cookie: u64, pending: Pending) {
        if done {
            self.finish(pending);
        } else {
            self.conn.pending.lock().insert(cookie, pending);
        }
    }

    /// Answers a request whose last reply chunk (or simple reply) is in.
    fn finish(&self, pending: Pending) {
        let result = match pending.error {
            Some((error, message)) => {
                if error == NBD_ESHUTDOWN {
                    self.conn.begin_closing();
                }
                Err(Failure::Nbd { error, message })
            }
            None => match pending.cmd {
                Cmd::Read if pending.covered != pending.length as u64 => {
                    Err(Failure::Bad(format!(
                        "{}: the server sent {} of {} bytes",
                        self.conn.label, pending.covered, pending.length
                    )))
                }
                Cmd::Read => Ok(Answer::Data(pending.data.freeze())),
                Cmd::BlockStatus => match pending.extents {
                    Some(extents) => Ok(Answer::Extents(extents)),
                    None => Err(Failure::Bad(format!(
                        "{}: no block status for {BASE_ALLOCATION}",
                        self.conn.label
                    ))),
                },
                Cmd::Write | Cmd::Trim | Cmd::WriteZeroes if !pending.fua => {
                    let d = &self.conn.durability;
                    let mark = d.epoch.load(Ordering::Acquire) + 1;
                    self.conn.unflushed.fetch_max(mark, Ordering::AcqRel);
                    Ok(Answer::Done)
                }
                _ => Ok(Answer::Done),
            },
        };
        let _ = pending.done.send(result);
        self.conn.disconnect_if_idle();
    }
}

/// Reads more into `input`: at least `want` bytes of room (and `GULP / 4`) first.
async fn fill(reader: &mut Reader, input: &mut BytesMut, want: usize) -> Result<(), String> {
    if input.capacity() - input.len() < want.max(GULP / 4) {
        input.reserve(want.max(GULP));
    }
    match reader.read_buf(input).await {
        Ok(0) => Err("the server closed the connection".to_string()),
        Ok(_) => Ok(()),
        Err(err) => Err(format!("reading from the server: {err}")),
    }
}

/// Appends the next `len` bytes of the stream to `data`: what `input` holds, then the
/// socket (straight into `data` when much is left).
async fn read_append(
    reader: &mut Reader,
    input: &mut BytesMut,
    data: &mut BytesMut,
    len: usize,
) -> Result<(), String> {
    let end = data.len() + len;
    loop {
        let n = input.len().min(end - data.len());
        data.extend_from_slice(&input[..n]);
        input.advance(n);
        if data.len() == end {
            return Ok(());
        }
        if end - data.len() < DIRECT_READ {
            fill(reader, input, 0).await?;
            continue;
        }
        let left = end - data.len();
        match reader.read_buf(&mut (&mut *data).limit(left)).await {
            Ok(0) => return Err("the server closed the connection mid-reply".to_string()),
            Ok(_) => {}
            Err(err) => return Err(format!("reading from the server: {err}")),
        }
    }
}

/// Fills `dest` with the next bytes of the stream: what `input` holds, then the socket.
async fn read_exact(
    reader: &mut Reader,
    input: &mut BytesMut,
    dest: &mut [u8],
) -> Result<(), String> {
    let mut at = 0;
    loop {
        let n = input.len().min(dest.len() - at);
        dest[at..at + n].copy_from_slice(&input[..n]);
        input.advance(n);
        at += n;
        if at == dest.len() {
            return Ok(());
        }
        if dest.len() - at < DIRECT_READ {
            fill(reader, input, 0).await?;
            continue;
        }
        match reader.read(&mut dest[at..]).await {
            Ok(0) => return Err("the server closed the connection mid-reply".to_string()),
            Ok(n) => at += n,
            Err(err) => return Err(format!("reading from the server: {err}")),
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

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
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

    async fn write_zeroes(&self, offset: u64, len: u32, may_trim: bool) -> io::Result<()> {
        check_range(offset, len as u64, self.info.size)?;
        if self.info.flags & NBD_FLAG_SEND_WRITE_ZEROES != 0 {
            let flags = if may_trim { 0 } else { NBD_CMD_FLAG_NO_HOLE };
            self.call(Cmd::WriteZeroes, flags, offset, len, Bytes::new()).await?;
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
                connections: None
            }
        );
        assert_eq!(
            NbdUri::parse("nbd://host").unwrap(),
            NbdUri::Tcp { addr: "host:10809".into(), export: "".into(), connections: None }
        );
        assert_eq!(
            NbdUri::parse("nbd+unix:///e?socket=/tmp/s").unwrap(),
            NbdUri::Unix { path: "/tmp/s".into(), export: "e".into(), connections: None }
        );
        for bad in ["http://x", "nbd://", "nbd+unix:///e", "nbd+unix:///e?sock=1"] {
            assert!(NbdUri::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn uris_with_a_connection_count() {
        let tcp = NbdUri::parse("nbd://h:1/d?conns=2").unwrap();
        let expected = NbdUri::Tcp { addr: "h:1".into(), export: "d".into(), connections: Some(2) };
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
