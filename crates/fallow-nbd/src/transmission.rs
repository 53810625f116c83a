//! The transmission phase of one connection: requests are read in order, checked
//! (`validate.rs`), and executed concurrently (up to [`MAX_IN_FLIGHT`] at once); replies go
//! out in completion order, matched by cookie.
//!
//! One task per connection does all of it: it reads requests, polls every request in
//! flight (`inflight.rs`, not a task each), and writes the replies that are ready,
//! all of those at once, in one `writev` where it can. A READ's data goes out of the
//! buffer the cache returned (no copy into a reply buffer). Measured against a task per
//! request and a writer task fed by a channel (`bench/nbd_miss_cost.sh`, BENCHMARKS.md "NBD
//! export against nbdkit"): fewer instructions and wake-ups per request, the same system
//! calls. Requests in flight are never dropped half-way (a cancelled write could leave a
//! cached copy stale): when the client goes away they still run to the end, unanswered.
//!
//! READ replies are one `OFFSET_DATA` chunk when structured replies were negotiated, a
//! simple reply otherwise; other commands get simple replies (the protocol allows it),
//! except BLOCK_STATUS, which is a `BLOCK_STATUS` chunk. Errors are `ERROR` chunks or simple
//! replies with the error code; the connection goes on.

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::io::{self, IoSlice};
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use fallow_proto::nbd::*;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio_util::io::poll_read_buf;
use tokio_util::sync::CancellationToken;

use crate::export::MAX_PAYLOAD;
use crate::handshake::{Session, BASE_ALLOCATION_ID};
use crate::metrics::{NbdMetrics, RequestSeries};
use crate::validate::{errno, validate, ValidRequest};
use fallow_backing::Durability;

mod inflight;
use inflight::InFlight;

/// Requests one connection may have executing at once; more wait to be read.
pub const MAX_IN_FLIGHT: usize = inflight::SLOTS;

/// Room kept free in the input buffer before each read, so that a burst of requests takes
/// one `recv` (a WRITE's payload reserves what it needs itself).
const READ_ROOM: usize = 64 * 1024;

/// The most buffers one `writev` is given (two per READ reply: header and data).
const MAX_IOVECS: usize = 64;

/// What a request came to, encoded into a reply by the connection's task.
enum Outcome {
    /// Success with nothing to send back but the reply header.
    Done,
    /// A READ's data.
    Data(Bytes),
    /// A whole structured chunk (BLOCK_STATUS).
    Chunk(Chunk),
    /// An NBD error code and a message for structured error chunks.
    Failed(u32, String),
}

/// What woke the connection's task.
enum Event {
    /// A request finished, after this many seconds.
    Finished(Request, Outcome, f64),
    Read(io::Result<usize>),
    Wrote(io::Result<usize>),
    Shutdown,
}

/// Serves requests until the client disconnects (DISC or end of stream) or the server
/// shuts down. Requests already read are finished and answered first.
pub async fn serve<S>(
    mut stream: S,
    session: Session,
    mut input: BytesMut,
    peer: String,
    shutdown: CancellationToken,
    metrics: std::sync::Arc<NbdMetrics>,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let session = &session;
    let mut series = Series { metrics: &metrics, known: Vec::new() };
    let mut running = InFlight::default();
    let mut out = Outbox::default();
    let cancelled = shutdown.cancelled();
    tokio::pin!(cancelled);
    // Set once no more requests are taken: DISC, end of stream, shutdown, a broken stream.
    let mut stopping = false;
    // The first error that ends the connection; replies are no longer written after a
    // write failed, but the requests in flight still run to their end.
    let mut failed: Option<io::Error> = None;
    let mut broken = false;
    loop {
        // Start every request that has arrived whole, while there is room. Replies the
        // client has not taken yet count against the room too, so that a client that
        // stops reading stops being read.
        while !stopping && !running.is_full() && out.len() < MAX_IN_FLIGHT {
            let (request, payload) = match decode_request_with_payload(&mut input, MAX_PAYLOAD) {
                Ok(Some(decoded)) => decoded,
                Ok(None) => break,
                Err(err) => {
                    failed = Some(io::Error::new(io::ErrorKind::InvalidData, err.to_string()));
                    stopping = true;
                    break;
                }
            };
            if request.cmd == Cmd::Disc {
                tracing::debug!(%peer, "client disconnected");
                stopping = true;
                break;
            }
            let valid = match validate(&request, session, &session.export) {
                Ok(valid) => valid,
                Err(refusal) => {
                    let error = refusal.errno();
                    tracing::debug!(%peer, cmd = request.cmd.name(), error, %refusal, "request refused");
                    series.record(&request, "refused", 0.0);
                    if !broken {
                        out.push(session, &request, Outcome::Failed(error, refusal.to_string()));
                    }
                    continue;
                }
            };
            running.push(run(session, valid, payload));
        }
        if stopping && running.is_empty() && (out.is_empty() || broken) {
            break;
        }
        if input.capacity() - input.len() < READ_ROOM / 2 {
            input.reserve(READ_ROOM);
        }
        let reading = !stopping && !running.is_full() && out.len() < MAX_IN_FLIGHT;
        let event = poll_fn(|cx| {
            // Replies first, so that all those ready go out in one write.
            if !running.is_empty() {
                if let Poll::Ready(Some((request, outcome, seconds))) = running.poll_next(cx) {
                    return Poll::Ready(Event::Finished(request, outcome, seconds));
                }
            }
            if !out.is_empty() && !broken {
                if let Poll::Ready(wrote) = out.poll_write(&mut stream, cx) {
                    return Poll::Ready(Event::Wrote(wrote));
                }
            }
            if reading {
                if let Poll::Ready(read) = poll_read_buf(Pin::new(&mut stream), cx, &mut input) {
                    return Poll::Ready(Event::Read(read));
                }
                if cancelled.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Event::Shutdown);
                }
            }
            Poll::Pending
        })
        .await;
        match event {
            Event::Finished(request, outcome, seconds) => {
                let result = if matches!(outcome, Outcome::Failed(..)) { "error" } else { "ok" };
                series.record(&request, result, seconds);
                if !broken {
                    out.push(session, &request, outcome);
                }
            }
            Event::Wrote(Ok(n)) => out.consume(n),
            Event::Wrote(Err(err)) => {
                failed.get_or_insert(err);
                (stopping, broken) = (true, true);
                out.clear();
            }
            Event::Read(Ok(0)) => {
                if !input.is_empty() {
                    tracing::debug!(%peer, bytes = input.len(), "client closed mid-request");
                }
                stopping = true;
            }
            Event::Read(Ok(_)) => {}
            Event::Read(Err(err)) => {
                failed.get_or_insert(err);
                stopping = true;
            }
            Event::Shutdown => stopping = true,
        }
    }
    if broken {
        return Err(failed.unwrap_or_else(|| io::ErrorKind::BrokenPipe.into()));
    }
    let closed = stream.shutdown().await;
    match failed {
        Some(err) => Err(err),
        None => closed,
    }
}

/// Executes a checked request; says how long it took.
async fn run(session: &Session, valid: ValidRequest, payload: Bytes) -> (Request, Outcome, f64) {
    let started = std::time::Instant::now();
    let outcome = execute(session, &valid, payload).await;
    (valid.request, outcome, started.elapsed().as_secs_f64())
}

/// The metric series this connection has updated, kept so that counting a request does
/// not look them up again.
struct Series<'a> {
    metrics: &'a NbdMetrics,
    /// By command name (unknown commands share one) and result: a handful.
    known: Vec<(&'static str, &'static str, RequestSeries)>,
}

impl Series<'_> {
    /// Counts one answered request (`result`: ok, error or refused).
    #[expect(clippy::indexing_slicing, reason = "the entry just pushed")]
    fn record(&mut self, request: &Request, result: &'static str, seconds: f64) {
        let (cmd, ok) = (request.cmd.name(), result == "ok");
        let with_bytes = ok && matches!(request.cmd, Cmd::Read | Cmd::Write);
        let bytes = if with_bytes { request.length as u64 } else { 0 };
        let found = self.known.iter().find(|(c, r, _)| *c == cmd && *r == result);
        let series = match found {
            Some((_, _, series)) => series,
            None => {
                let series = self.metrics.request_series(cmd, result, with_bytes);
                self.known.push((cmd, result, series));
                &self.known[self.known.len() - 1].2
            }
        };
        series.record(seconds, bytes);
    }
}

/// Replies waiting to be written, oldest first: their headers back to back in `heads`,
/// each READ's data as the `Bytes` the cache returned.
#[derive(Default)]
struct Outbox {
    heads: BytesMut,
    /// Per reply: how many of its header bytes (at the front of what is left of `heads`)
    /// and which of its data are still to be written.
    queue: VecDeque<(usize, Bytes)>,
}

impl Outbox {
    fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Replies not wholly written yet.
    fn len(&self) -> usize {
        self.queue.len()
    }

    fn clear(&mut self) {
        self.heads.clear();
        self.queue.clear();
    }

    /// Encodes the reply to `request`.
    fn push(&mut self, session: &Session, request: &Request, outcome: Outcome) {
        let before = self.heads.len();
        let heads = &mut self.heads;
        let data = match outcome {
            Outcome::Data(data) if session.structured => {
                if data.is_empty() {
                    let body = ChunkBody::None;
                    Chunk { flags: NBD_REPLY_FLAG_DONE, cookie: request.cookie, body }
                        .encode(heads);
                } else {
                    let (cookie, offset) = (request.cookie, request.offset);
                    let len = data.len() as u32;
                    encode_offset_data_header(heads, NBD_REPLY_FLAG_DONE, cookie, offset, len);
                }
                data
            }
            Outcome::Data(data) => {
                SimpleReply { error: 0, cookie: request.cookie }.encode(heads);
                data
            }
            Outcome::Done => {
                SimpleReply { error: 0, cookie: request.cookie }.encode(heads);
                Bytes::new()
            }
            Outcome::Chunk(chunk) => {
                chunk.encode(heads);
                Bytes::new()
            }
            Outcome::Failed(error, message) => {
                encode_error(heads, session, request, error, &message);
                Bytes::new()
            }
        };
        self.queue.push_back((self.heads.len() - before, data));
    }

    /// Writes as much of the queue as the stream takes in one (vectored) write.
    #[expect(clippy::indexing_slicing, reason = "`n` stops at the iovec array's length")]
    fn poll_write<S: AsyncWrite + Unpin>(
        &self,
        stream: &mut S,
        cx: &mut Context<'_>,
    ) -> Poll<io::Result<usize>> {
        let mut slices = [IoSlice::new(&[]); MAX_IOVECS];
        let mut n = 0;
        let mut at = 0;
        for (head, data) in &self.queue {
            if n + 2 > MAX_IOVECS {
                break;
            }
            if *head > 0 {
                slices[n] = IoSlice::new(&self.heads[at..at + head]);
                n += 1;
                at += head;
            }
            if !data.is_empty() {
                slices[n] = IoSlice::new(data);
                n += 1;
            }
        }
        match Pin::new(stream).poll_write_vectored(cx, &slices[..n]) {
            Poll::Ready(Ok(0)) => Poll::Ready(Err(io::ErrorKind::WriteZero.into())),
            other => other,
        }
    }

    /// Drops the first `n` bytes of the queue (they were written).
    fn consume(&mut self, mut n: usize) {
        while n > 0 {
            let Some((head, data)) = self.queue.front_mut() else { return };
            let from_head = (*head).min(n);
            self.heads.advance(from_head);
            *head -= from_head;
            n -= from_head;
            let from_data = data.len().min(n);
            data.advance(from_data);
            n -= from_data;
            if *head == 0 && data.is_empty() {
                self.queue.pop_front();
            }
        }
    }
}

/// Executes a checked request.
async fn execute(session: &Session, valid: &ValidRequest, payload: Bytes) -> Outcome {
    let cache = &session.export.cache;
    let request = &valid.request;
    let fua = valid.durability == Durability::Immediate;
    // A zero-length request has nothing to do (the spec leaves its result to the server;
    // doing nothing keeps stores from seeing empty ranges).
    let empty = request.length == 0
        && matches!(request.cmd, Cmd::Write | Cmd::Trim | Cmd::WriteZeroes | Cmd::Cache);
    let result: io::Result<Outcome> = match request.cmd {
        _ if empty => Ok(Outcome::Done),
        Cmd::Read => cache.read(request.offset, request.length).await.map(Outcome::Data),
        Cmd::Write => {
            cache.write(request.offset, payload, valid.durability).await.map(|_| Outcome::Done)
        }
        Cmd::Flush => cache.flush().await.map(|_| Outcome::Done),
        Cmd::Trim => {
            async {
                cache.trim(request.offset, request.length).await?;
                if fua {
                    cache.flush().await?;
                }
                Ok(Outcome::Done)
            }
            .await
        }
        Cmd::WriteZeroes => {
            async {
                cache.write_zeroes(request.offset, request.length, valid.zeroing).await?;
                if fua {
                    cache.flush().await?;
                }
                Ok(Outcome::Done)
            }
            .await
        }
        Cmd::Cache => cache.prefetch(request.offset, request.length).await.map(|_| Outcome::Done),
        Cmd::BlockStatus => block_status(session, request).await.map(Outcome::Chunk),
        Cmd::Disc | Cmd::Unknown(_) => Ok(Outcome::Done),
    };
    result.unwrap_or_else(|err| {
        tracing::warn!(cmd = request.cmd.name(), offset = request.offset, length = request.length, %err, "request failed");
        Outcome::Failed(errno(&err), err.to_string())
    })
}

/// The `base:allocation` extents of a range, from the backing store.
async fn block_status(session: &Session, request: &Request) -> io::Result<Chunk> {
    let backing = session.export.cache.backing();
    let extents = backing.block_status(request.offset, request.length).await?;
    let mut out: Vec<Extent> = Vec::with_capacity(extents.len());
    for e in extents {
        let mut flags = 0;
        if e.hole {
            flags |= NBD_STATE_HOLE;
        }
        if e.zero {
            flags |= NBD_STATE_ZERO;
        }
        // Lengths fit: the store answers within the request's u32 length.
        let length = e.length.min(u32::MAX as u64) as u32;
        if length == 0 {
            continue;
        }
        out.push(Extent { length, flags });
        if request.flags & NBD_CMD_FLAG_REQ_ONE != 0 {
            break;
        }
    }
    if out.is_empty() {
        out.push(Extent { length: request.length, flags: 0 });
    }
    Ok(Chunk {
        flags: NBD_REPLY_FLAG_DONE,
        cookie: request.cookie,
        body: ChunkBody::BlockStatus { context_id: BASE_ALLOCATION_ID, extents: out },
    })
}

/// An error reply: a structured ERROR chunk for reads and block status when structured
/// replies are on, a simple reply otherwise.
fn encode_error(
    out: &mut BytesMut,
    session: &Session,
    request: &Request,
    error: u32,
    message: &str,
) {
    let structured_cmd = matches!(request.cmd, Cmd::Read | Cmd::BlockStatus);
    if session.structured && structured_cmd {
        let body = ChunkBody::Error { error, message: message.to_string() };
        Chunk { flags: NBD_REPLY_FLAG_DONE, cookie: request.cookie, body }.encode(out);
    } else {
        SimpleReply { error, cookie: request.cookie }.encode(out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::Export;
    use fallow_backing::MemStore;
    use fallow_cache::{CacheConfig, CacheLayer};
    use std::collections::HashMap;
    use std::sync::Arc;
    use std::time::Duration;
    use tokio::io::{AsyncRead, AsyncReadExt};

    const BASE: u64 = 4096;

    fn session(structured: bool) -> Session {
        let store = Arc::new(MemStore::new(1 << 20));
        let cache = CacheLayer::new(store, None, CacheConfig::default());
        let export =
            Export { name: "t".into(), description: String::new(), cache, read_only: false };
        Session { export: Arc::new(export), structured, base_allocation: false }
    }

    fn request(cmd: Cmd, cookie: u64, offset: u64, length: u32) -> Request {
        Request { flags: 0, cmd, cookie, offset, length }
    }

    fn be32(b: &[u8]) -> u32 {
        u32::from_be_bytes(b.try_into().unwrap())
    }

    fn be64(b: &[u8]) -> u64 {
        u64::from_be_bytes(b.try_into().unwrap())
    }

    /// One reply: (cookie, error, data), reading a simple READ reply's data by the length
    /// its request asked for.
    async fn reply<R: AsyncRead + Unpin>(
        reader: &mut R,
        lengths: &HashMap<u64, u32>,
    ) -> (u64, u32, Vec<u8>) {
        let mut head = [0u8; 32];
        reader.read_exact(&mut head[..16]).await.unwrap();
        if be32(&head[..4]) == NBD_SIMPLE_REPLY_MAGIC {
            let (error, cookie) = (be32(&head[4..8]), be64(&head[8..16]));
            let len = if error == 0 { lengths.get(&cookie).copied().unwrap_or(0) } else { 0 };
            let mut data = vec![0u8; len as usize];
            reader.read_exact(&mut data).await.unwrap();
            return (cookie, error, data);
        }
        assert_eq!(be32(&head[..4]), NBD_STRUCTURED_REPLY_MAGIC);
        reader.read_exact(&mut head[16..20]).await.unwrap();
        let (kind, cookie) = (head[6..8].to_vec(), be64(&head[8..16]));
        let mut payload = vec![0u8; be32(&head[16..20]) as usize];
        reader.read_exact(&mut payload).await.unwrap();
        if u16::from_be_bytes([kind[0], kind[1]]) == NBD_REPLY_TYPE_OFFSET_DATA {
            return (cookie, 0, payload);
        }
        (cookie, be32(&payload[..4]), Vec::new())
    }

    /// Pipelined requests through a pipe that takes 7 bytes per write: replies are cut
    /// anywhere (inside headers, inside data) and must still arrive whole, once each, with
    /// the right data.
    #[tokio::test]
    async fn pipelined_replies_survive_short_writes() {
        for structured in [false, true] {
            let (client, server) = tokio::io::duplex(7);
            let serving = tokio::spawn(serve(
                server,
                session(structured),
                BytesMut::new(),
                "test".into(),
                CancellationToken::new(),
                Arc::new(NbdMetrics::new()),
            ));
            let (mut reader, mut writer) = tokio::io::split(client);
            let pattern: Vec<u8> = (0..3 * 4096u32).map(|i| (i * 7 % 251) as u8).collect();
            let mut wire = BytesMut::new();
            request(Cmd::Write, 1, BASE, pattern.len() as u32).encode(&mut wire);
            wire.extend_from_slice(&pattern);
            writer.write_all(&wire).await.unwrap();
            let none = HashMap::new();
            let written = tokio::time::timeout(Duration::from_secs(10), reply(&mut reader, &none));
            assert_eq!(written.await.unwrap(), (1, 0, Vec::new()));

            // Unaligned reads of what was written, and one past the end, all queued at once.
            let reads: Vec<(u64, u32)> =
                (0..40).map(|i| (BASE + i * 211, 100 + i as u32 * 97)).collect();
            let mut lengths = HashMap::new();
            let mut wire = BytesMut::new();
            for (i, (offset, len)) in reads.iter().enumerate() {
                request(Cmd::Read, 100 + i as u64, *offset, *len).encode(&mut wire);
                lengths.insert(100 + i as u64, *len);
            }
            request(Cmd::Read, 99, 1 << 20, 1).encode(&mut wire);
            let sending = tokio::spawn(async move {
                writer.write_all(&wire).await.unwrap();
                writer
            });
            let mut got = HashMap::new();
            for _ in 0..=reads.len() {
                let next =
                    tokio::time::timeout(Duration::from_secs(10), reply(&mut reader, &lengths));
                let (cookie, error, data) = next.await.unwrap();
                assert!(got.insert(cookie, (error, data)).is_none(), "cookie {cookie} twice");
            }
            assert_ne!(got[&99].0, 0, "a read past the end fails");
            for (i, (offset, len)) in reads.iter().enumerate() {
                let (error, data) = &got[&(100 + i as u64)];
                assert_eq!(*error, 0);
                let at = (offset - BASE) as usize;
                // Structured: the chunk starts with the offset.
                let data = if structured {
                    assert_eq!(be64(&data[..8]), *offset);
                    &data[8..]
                } else {
                    &data[..]
                };
                assert_eq!(data, &pattern[at..at + *len as usize], "read {i}");
            }
            drop(sending.await.unwrap());
            drop(reader);
            let served = tokio::time::timeout(Duration::from_secs(10), serving).await;
            served.unwrap().unwrap().unwrap();
        }
    }
}
