//! One connection to the upstream server: its write queue (requests leave in batches,
//! one `writev` each), the requests waiting for replies, and how it closes.

use super::*;

pub(super) type Reader = Box<dyn AsyncRead + Send + Unpin>;

/// The write half of a connection, as tokio's own type: a request is written with one
/// non-blocking `writev` from whichever task has it, with no `.await` in between.
pub(super) enum WriteHalf {
    Tcp(tcp::OwnedWriteHalf),
    Unix(unix::OwnedWriteHalf),
}

impl WriteHalf {
    pub(super) fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            WriteHalf::Tcp(w) => w.try_write_vectored(bufs),
            WriteHalf::Unix(w) => w.try_write_vectored(bufs),
        }
    }

    pub(super) async fn writable(&self) -> io::Result<()> {
        match self {
            WriteHalf::Tcp(w) => w.writable().await,
            WriteHalf::Unix(w) => w.writable().await,
        }
    }

    pub(super) async fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        match self {
            WriteHalf::Tcp(w) => w.write_all(buf).await,
            WriteHalf::Unix(w) => w.write_all(buf).await,
        }
    }
}

/// A request not written yet: its header, and for a WRITE its data.
pub(super) struct Frame {
    pub(super) head: [u8; REQUEST_LEN],
    pub(super) payload: Bytes,
}

/// The requests waiting to be written.
#[derive(Default)]
pub(super) struct Outbox {
    pub(super) queue: VecDeque<Frame>,
    /// Someone is writing (a caller, or the task that waits for room): whoever queues a
    /// frame meanwhile leaves it to them, and they take it before they stop.
    pub(super) writing: bool,
    /// The writer's emptied queue, kept for its capacity.
    pub(super) spare: VecDeque<Frame>,
}

/// The frames one writer took off the queue, and how much of the first is written.
#[derive(Default)]
pub(super) struct Batch {
    pub(super) frames: VecDeque<Frame>,
    pub(super) sent: usize,
}

impl Batch {
    /// Writes as much as the socket takes without waiting: `Ok(true)` once all is written,
    /// `Ok(false)` when the socket is full.
    #[expect(clippy::indexing_slicing, reason = "`n` stops at the iovec array's length")]
    pub(super) fn write(&mut self, writer: &WriteHalf) -> io::Result<bool> {
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
    pub(super) fn consume(&mut self, mut n: usize) {
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
pub(super) enum Failure {
    /// The server answered with this NBD error.
    Nbd { error: u32, message: String },
    /// The connection ended (or was closing) before the reply.
    Lost(String),
    /// The reply broke the protocol in a way that fails this request only (a READ without
    /// all its data, a BLOCK_STATUS without its context).
    Bad(String),
}

impl Failure {
    pub(super) fn retryable(&self) -> bool {
        matches!(self, Failure::Lost(_) | Failure::Nbd { error: NBD_ESHUTDOWN, .. })
    }

    pub(super) fn into_io(self, uri: &NbdUri) -> io::Error {
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
pub(super) fn retry_is_safe(cmd: Cmd) -> bool {
    matches!(cmd, Cmd::Read | Cmd::BlockStatus | Cmd::Write | Cmd::Trim | Cmd::WriteZeroes)
}

/// A successful reply.
pub(super) enum Answer {
    /// A READ's data.
    Data(Bytes),
    /// A BLOCK_STATUS's `base:allocation` descriptors.
    Extents(Vec<NbdExtent>),
    /// Anything else.
    Done,
}

/// A request waiting for its reply.
pub(super) struct Pending {
    pub(super) cmd: Cmd,
    /// Sent with FUA: durable once answered.
    pub(super) fua: bool,
    pub(super) offset: u64,
    pub(super) length: u32,
    /// A READ's data (see [`Pending::place`]), and how many of its bytes chunks covered.
    pub(super) data: BytesMut,
    pub(super) covered: u64,
    /// A BLOCK_STATUS's descriptors for `base:allocation`.
    pub(super) extents: Option<Vec<NbdExtent>>,
    /// The first error the server reported.
    pub(super) error: Option<(u32, String)>,
    pub(super) done: oneshot::Sender<Result<Answer, Failure>>,
}

impl Pending {
    pub(super) fn fail(self, why: &str) {
        let _ = self.done.send(Err(Failure::Lost(why.to_string())));
    }

    /// Where `len` bytes of a READ's data at `offset` go, or `None` when they are outside
    /// the request. Data that continues what came before (a simple reply, the usual single
    /// chunk, chunks in order) is appended; anything else is written in place, in a buffer
    /// zero-filled to its full length the first time, which also makes holes read as zeros.
    pub(super) fn place(&mut self, offset: u64, len: u32) -> Option<Place> {
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
pub(super) enum Place {
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
pub(super) struct FlushCoverage {
    pub(super) epoch: AtomicU64,
    /// The epoch of the latest FLUSH that succeeded.
    pub(super) covered: AtomicU64,
    pub(super) lost: AtomicBool,
}

/// [`Conn::state`]: open for requests.
pub(super) const OPEN: u8 = 0;
/// The server said `NBD_ESHUTDOWN`: no new requests; DISC once the last reply is in.
pub(super) const CLOSING: u8 = 1;
/// DISC is sent; the reader waits for the server to close.
pub(super) const DISCONNECTED: u8 = 2;
/// Done: every request failed or answered.
pub(super) const CLOSED: u8 = 3;

/// One connection to the upstream server.
pub(super) struct Conn {
    /// `URI #slot`, for logs.
    pub(super) label: String,
    /// Structured replies were agreed: a READ is answered with chunks.
    pub(super) structured: bool,
    /// The id the server gave `base:allocation` on this connection, if it gave one.
    pub(super) base_allocation: Option<u32>,
    /// Written only by whoever set `Outbox::writing`.
    pub(super) writer: WriteHalf,
    pub(super) outbox: Mutex<Outbox>,
    /// Cookie → the request waiting for its reply.
    pub(super) pending: Mutex<HashMap<u64, Pending>>,
    /// `OPEN`, `CLOSING`, `DISCONNECTED` or `CLOSED`; changed only under `pending`.
    pub(super) state: AtomicU8,
    /// Notified when the store is dropped: the reader stops.
    pub(super) stop: Notify,
    pub(super) durability: Arc<FlushCoverage>,
    /// The epoch a FLUSH needs to cover the writes acknowledged here (0: none).
    pub(super) unflushed: AtomicU64,
}

impl Conn {
    pub(super) fn is_open(&self) -> bool {
        self.state.load(Ordering::Acquire) == OPEN
    }

    /// Sends one request and waits for its reply.
    pub(super) async fn request(
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
    pub(super) fn submit(self: &Arc<Self>, frame: Frame) {
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
    pub(super) fn take_queued(&self, batch: &mut Batch) -> bool {
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
    pub(super) async fn write_rest(self: Arc<Self>, mut batch: Batch) {
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

    pub(super) fn write_failed(&self, why: &str) {
        {
            let mut out = self.outbox.lock();
            out.queue.clear();
            out.writing = false;
        }
        self.close(why);
    }

    /// The server said `NBD_ESHUTDOWN`: take no new requests.
    pub(super) fn begin_closing(&self) {
        let _map = self.pending.lock();
        if self.state.load(Ordering::Acquire) == OPEN {
            self.state.store(CLOSING, Ordering::Release);
            tracing::info!(conn = %self.label, "the upstream NBD server is shutting down; later requests go to a new connection");
        }
    }

    /// Sends DISC once a closing connection has no request left in flight.
    pub(super) fn disconnect_if_idle(self: &Arc<Self>) {
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

    pub(super) fn send_disc(self: &Arc<Self>) {
        let disc = Request { flags: 0, cmd: Cmd::Disc, cookie: 0, offset: 0, length: 0 };
        self.submit(Frame { head: disc.to_bytes(), payload: Bytes::new() });
    }

    /// The store is going away: a soft disconnect, then the reader stops.
    pub(super) fn shut(self: &Arc<Self>) {
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
    pub(super) fn close(&self, why: &str) {
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
