//! The transmission phase of one connection: requests are read in order, checked
//! (`validate.rs`), and executed concurrently (up to [`MAX_IN_FLIGHT`] at once); replies go
//! out in completion order, matched by cookie, through one writer task that coalesces them.
//!
//! READ replies are one `OFFSET_DATA` chunk when structured replies were negotiated, a
//! simple reply otherwise; other commands get simple replies (the protocol allows it),
//! except BLOCK_STATUS, which is a `BLOCK_STATUS` chunk. Errors are `ERROR` chunks or simple
//! replies with the error code; the connection goes on.

use std::io;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use fallow_proto::nbd::*;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::export::MAX_PAYLOAD;
use crate::handshake::{Session, BASE_ALLOCATION_ID};
use crate::metrics::NbdMetrics;
use crate::validate::{errno, validate};

/// Requests one connection may have executing at once; more wait to be read.
pub const MAX_IN_FLIGHT: u32 = 64;

/// Serves requests until the client disconnects (DISC or end of stream) or the server
/// shuts down. Requests already read are finished and answered first.
pub async fn serve<S>(
    stream: S,
    session: Session,
    mut input: BytesMut,
    peer: String,
    shutdown: CancellationToken,
    metrics: Arc<NbdMetrics>,
) -> io::Result<()>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let (mut reader, writer) = tokio::io::split(stream);
    let (tx, rx) = mpsc::channel::<BytesMut>(MAX_IN_FLIGHT as usize);
    let writer = tokio::spawn(write_replies(writer, rx));
    let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT as usize));
    let session = Arc::new(session);
    let result: io::Result<()> = async {
        loop {
            let (request, payload) = loop {
                match decode_request_with_payload(&mut input, MAX_PAYLOAD) {
                    Ok(Some(decoded)) => break decoded,
                    Ok(None) => {}
                    Err(err) => {
                        return Err(io::Error::new(io::ErrorKind::InvalidData, err.to_string()));
                    }
                }
                let read = tokio::select! {
                    _ = shutdown.cancelled() => return Ok(()),
                    read = reader.read_buf(&mut input) => read?,
                };
                if read == 0 {
                    if !input.is_empty() {
                        tracing::debug!(%peer, bytes = input.len(), "client closed mid-request");
                    }
                    return Ok(());
                }
            };
            if request.cmd == Cmd::Disc {
                tracing::debug!(%peer, "client disconnected");
                return Ok(());
            }
            let export = &session.export;
            if let Err((error, message)) = validate(&request, &session, export) {
                tracing::debug!(%peer, cmd = request.cmd.name(), error, %message, "request refused");
                metrics.request(request.cmd.name(), "refused", 0.0, 0);
                let mut out = BytesMut::new();
                encode_error(&mut out, &session, &request, error, &message);
                if tx.send(out).await.is_err() {
                    return Ok(());
                }
                continue;
            }
            let permit = slots.clone().acquire_owned().await.map_err(io::Error::other)?;
            let (session, tx, metrics) = (session.clone(), tx.clone(), metrics.clone());
            tokio::spawn(async move {
                let started = std::time::Instant::now();
                let (out, ok) = execute(&session, &request, payload).await;
                let bytes = if ok && matches!(request.cmd, Cmd::Read | Cmd::Write) { request.length as u64 } else { 0 };
                let result = if ok { "ok" } else { "error" };
                metrics.request(request.cmd.name(), result, started.elapsed().as_secs_f64(), bytes);
                let _ = tx.send(out).await;
                drop(permit);
            });
        }
    }
    .await;
    // Let every request in flight finish and be answered before the writer stops.
    let _all = slots.acquire_many(MAX_IN_FLIGHT).await;
    drop(tx);
    let written = writer.await.map_err(io::Error::other)?;
    result.and(written)
}

/// Writes replies as they complete, several per system call when they queue up.
async fn write_replies<W: AsyncWrite + Unpin>(
    mut writer: W,
    mut rx: mpsc::Receiver<BytesMut>,
) -> io::Result<()> {
    let mut batch = BytesMut::new();
    while let Some(first) = rx.recv().await {
        batch.unsplit(first);
        while batch.len() < 1 << 20 {
            match rx.try_recv() {
                Ok(more) => batch.unsplit(more),
                Err(_) => break,
            }
        }
        writer.write_all(&batch).await?;
        batch.clear();
    }
    writer.shutdown().await
}

/// Executes a checked request and encodes its reply; says whether it succeeded.
async fn execute(session: &Session, request: &Request, payload: Bytes) -> (BytesMut, bool) {
    let cache = &session.export.cache;
    let mut out = BytesMut::new();
    let fua = request.flags & NBD_CMD_FLAG_FUA != 0;
    // A zero-length request has nothing to do (the spec leaves its result to the server;
    // doing nothing keeps stores from seeing empty ranges).
    let empty = request.length == 0
        && matches!(request.cmd, Cmd::Write | Cmd::Trim | Cmd::WriteZeroes | Cmd::Cache);
    let result: io::Result<Option<Bytes>> = match request.cmd {
        _ if empty => Ok(None),
        Cmd::Read => cache.read(request.offset, request.length).await.map(Some),
        Cmd::Write => cache.write(request.offset, payload, fua).await.map(|_| None),
        Cmd::Flush => cache.flush().await.map(|_| None),
        Cmd::Trim => {
            async {
                cache.trim(request.offset, request.length).await?;
                if fua {
                    cache.flush().await?;
                }
                Ok(None)
            }
            .await
        }
        Cmd::WriteZeroes => {
            async {
                let may_trim = request.flags & NBD_CMD_FLAG_NO_HOLE == 0;
                cache.write_zeroes(request.offset, request.length, may_trim).await?;
                if fua {
                    cache.flush().await?;
                }
                Ok(None)
            }
            .await
        }
        Cmd::Cache => cache.prefetch(request.offset, request.length).await.map(|_| None),
        Cmd::BlockStatus => match block_status(session, request).await {
            Ok(chunk) => {
                chunk.encode(&mut out);
                return (out, true);
            }
            Err(err) => Err(err),
        },
        Cmd::Disc | Cmd::Unknown(_) => Ok(None),
    };
    let ok = result.is_ok();
    match result {
        Ok(Some(data)) if session.structured => {
            if data.is_empty() {
                Chunk { flags: NBD_REPLY_FLAG_DONE, cookie: request.cookie, body: ChunkBody::None }
                    .encode(&mut out);
            } else {
                encode_offset_data_header(
                    &mut out,
                    NBD_REPLY_FLAG_DONE,
                    request.cookie,
                    request.offset,
                    data.len() as u32,
                );
                out.extend_from_slice(&data);
            }
        }
        Ok(data) => {
            SimpleReply { error: 0, cookie: request.cookie }.encode(&mut out);
            if let Some(data) = data {
                out.extend_from_slice(&data);
            }
        }
        Err(err) => {
            tracing::warn!(cmd = request.cmd.name(), offset = request.offset, length = request.length, %err, "request failed");
            encode_error(&mut out, session, request, errno(&err), &err.to_string());
        }
    }
    (out, ok)
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
