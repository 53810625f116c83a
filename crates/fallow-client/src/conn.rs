//! One connection to a node: connect, handshake, then any number of requests in flight,
//! their replies matched by request id in whatever order they come.
//!
//! Writing: a caller appends its encoded frame to `queue`, then takes the socket's write
//! lock and writes everything queued. Under concurrency the first caller to get the lock
//! writes the frames of those queued behind it in one syscall, and they find nothing left
//! to write; alone, a request is written by its own caller with no task switch.
//! Reading: one task reads replies and hands each to the oneshot its request waits on.
//!
//! # Locking
//! `queue` and `pending` are `parking_lot` mutexes held for a buffer append or a map
//! update, never across `.await`. `writer` is a tokio mutex held across the socket write.
//! `pending` also orders closing: `close` sets `closed` under it, so a request either
//! registers before the close (and is woken by it) or sees `closed`.
//!
//! A connection closed with requests in flight, or after one timed out, gives them up:
//! the client's session with the node is fenced (`session.rs`), so the node runs none of
//! them after what the client sends next.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use fallow_proto::fallow::auth::{Transcript, MIN_SECRET_LEN};
use fallow_proto::fallow::frame::{decode, Frame};
use fallow_proto::fallow::{Hello, Op, Reply, Request, Status, MAX_BATCH, MAX_NAME_LEN, VERSION};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;

use crate::config::{ClientConfig, Endpoint};
use crate::session::Numbering;
use crate::ClientError;

type Reader = Box<dyn AsyncRead + Send + Unpin>;
type Writer = Box<dyn AsyncWrite + Send + Unpin>;

/// An open, authenticated connection.
pub(crate) struct Conn {
    writer: tokio::sync::Mutex<Writer>,
    queue: Mutex<BytesMut>,
    pending: Mutex<HashMap<u64, oneshot::Sender<Frame>>>,
    closed: AtomicBool,
    next_id: AtomicU64,
    stop: CancellationToken,
    /// The most pages the node takes in one request.
    pub(crate) max_batch: usize,
    /// The node's id from HELLO.
    pub(crate) node_id: u128,
    /// This connection's number in the client's session with the node.
    epoch: u32,
    numbering: Arc<Numbering>,
}

impl Conn {
    /// Connects and authenticates, as the next connection of `numbering`'s session.
    pub(crate) async fn open(
        config: &ClientConfig,
        numbering: &Arc<Numbering>,
    ) -> Result<Arc<Conn>, ClientError> {
        if config.secret.len() < MIN_SECRET_LEN {
            return Err(ClientError::Protocol(format!(
                "the secret has {} bytes; at least {MIN_SECRET_LEN} are needed",
                config.secret.len()
            )));
        }
        let session = numbering.next();
        let opened = tokio::time::timeout(config.connect_timeout, async {
            let (mut reader, mut writer) = connect(&config.endpoint, config.tls.as_ref()).await?;
            let mut input = BytesMut::with_capacity(4096);
            let hello = handshake(config, session, &mut reader, &mut writer, &mut input).await?;
            Ok::<_, ClientError>((reader, writer, input, hello))
        })
        .await
        .map_err(|_| ClientError::Timeout(config.connect_timeout))??;
        let (reader, writer, input, hello) = opened;
        let conn = Arc::new(Conn {
            writer: tokio::sync::Mutex::new(writer),
            queue: Mutex::new(BytesMut::with_capacity(64 * 1024)),
            pending: Mutex::new(HashMap::new()),
            closed: AtomicBool::new(false),
            next_id: AtomicU64::new(3),
            stop: CancellationToken::new(),
            max_batch: (hello.max_batch as usize).clamp(1, MAX_BATCH),
            node_id: hello.node_id,
            epoch: session.epoch,
            numbering: numbering.clone(),
        });
        tokio::spawn(read_replies(conn.clone(), reader, input));
        Ok(conn)
    }

    /// True once the connection failed or was closed; it is never reused after that.
    pub(crate) fn is_closed(&self) -> bool {
        self.closed.load(Ordering::Acquire)
    }

    /// True when the client gave up on requests since this connection was opened: it
    /// must carry no new request, which the node could run before the ones given up on.
    pub(crate) fn is_fenced(&self) -> bool {
        self.numbering.is_fenced(self.epoch)
    }

    /// Closes the connection: the reader stops, and every request in flight fails with
    /// [`ClientError::Disconnected`] and is given up on.
    pub(crate) fn close(&self) {
        let mut pending = self.pending.lock();
        // A fenced connection's requests are covered by the fence already: giving up again
        // would fence the connections opened since, for nothing.
        if !pending.is_empty() && !self.is_fenced() {
            self.numbering.give_up();
        }
        self.closed.store(true, Ordering::Release);
        // Dropping the senders wakes their receivers with an error.
        pending.clear();
        drop(pending);
        self.stop.cancel();
    }

    /// Sends one request and waits for its reply frame.
    pub(crate) async fn call(
        &self,
        request: &Request,
        timeout: Duration,
    ) -> Result<Frame, ClientError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut pending = self.pending.lock();
            if self.is_closed() {
                return Err(ClientError::Disconnected);
            }
            pending.insert(id, tx);
        }
        request.encode(id, &mut self.queue.lock());
        if let Err(err) = self.flush().await {
            self.close();
            return Err(ClientError::Io(err));
        }
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(frame)) => Ok(frame),
            Ok(Err(_)) => Err(ClientError::Disconnected),
            Err(_) => {
                // Still in `pending`, so the close gives it up with the others in flight.
                tracing::warn!(id, ?timeout, "request timed out; closing the connection");
                self.close();
                Err(ClientError::Timeout(timeout))
            }
        }
    }

    /// Writes everything queued (ours, and what others queued meanwhile).
    async fn flush(&self) -> std::io::Result<()> {
        let mut writer = self.writer.lock().await;
        // If this future is dropped mid-write, a frame is half on the wire and the stream
        // is lost: the guard closes the connection in that case.
        let mut guard = CloseOnDrop { conn: self, armed: true };
        loop {
            let chunk = {
                let mut queue = self.queue.lock();
                if queue.is_empty() {
                    break;
                }
                queue.split()
            };
            writer.write_all(&chunk).await?;
        }
        guard.armed = false;
        Ok(())
    }
}

struct CloseOnDrop<'a> {
    conn: &'a Conn,
    armed: bool,
}

impl Drop for CloseOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.conn.close();
        }
    }
}

async fn connect(
    endpoint: &Endpoint,
    tls: Option<&fallow_tls::TlsClient>,
) -> Result<(Reader, Writer), ClientError> {
    let failed = |source| ClientError::Connect { endpoint: endpoint.to_string(), source };
    match endpoint {
        Endpoint::Tcp(addr) => {
            let stream = tokio::net::TcpStream::connect(addr.as_str()).await.map_err(failed)?;
            stream.set_nodelay(true).map_err(failed)?;
            let Some(tls) = tls else {
                let (r, w) = stream.into_split();
                return Ok((Box::new(r), Box::new(w)));
            };
            let host = addr.rsplit_once(':').map_or(addr.as_str(), |(host, _)| host);
            let secured = tls.connect(host, stream).await.map_err(|err| ClientError::Tls {
                endpoint: endpoint.to_string(),
                why: err.to_string(),
            })?;
            let (r, w) = tokio::io::split(secured);
            Ok((Box::new(r), Box::new(w)))
        }
        Endpoint::Unix(path) => {
            let stream = tokio::net::UnixStream::connect(path).await.map_err(failed)?;
            let (r, w) = stream.into_split();
            Ok((Box::new(r), Box::new(w)))
        }
    }
}

/// HELLO and AUTH, before the reader task starts.
async fn handshake(
    config: &ClientConfig,
    session: fallow_proto::fallow::Session,
    reader: &mut Reader,
    writer: &mut Writer,
    input: &mut BytesMut,
) -> Result<fallow_proto::fallow::HelloReply, ClientError> {
    let mut name = config.name.clone();
    while name.len() > MAX_NAME_LEN {
        name.pop();
    }
    let hello = Request::Hello(Hello {
        version_min: VERSION,
        version_max: VERSION,
        client_id: config.client_id,
        name,
        session: Some(session),
    });
    let reply = exchange(reader, writer, input, &hello, 1, Op::Hello).await?;
    let hello = match reply {
        Reply::Hello(hello) if hello.version == VERSION => hello,
        Reply::Hello(hello) => {
            return Err(ClientError::Protocol(format!("node chose version {}", hello.version)))
        }
        Reply::VersionMismatch { min, max } => {
            return Err(ClientError::VersionMismatch { node_min: min, node_max: max })
        }
        other => return Err(unexpected(other)),
    };
    let client_nonce: [u8; 32] = rand::random();
    let transcript = Transcript {
        version: hello.version,
        challenge: hello.challenge,
        client_nonce,
        client_id: config.client_id,
    };
    let auth = Request::Auth { client_nonce, proof: transcript.client_proof(&config.secret) };
    match exchange(reader, writer, input, &auth, 2, Op::Auth).await? {
        Reply::Auth { proof } if transcript.verify_node(&config.secret, &proof) => Ok(hello),
        Reply::Auth { .. } => Err(ClientError::NodeNotAuthenticated),
        Reply::Error { status: Status::AuthFailed, .. } => Err(ClientError::AuthFailed),
        other => Err(unexpected(other)),
    }
}

/// One request and its reply, on a connection with nothing else in flight.
async fn exchange(
    reader: &mut Reader,
    writer: &mut Writer,
    input: &mut BytesMut,
    request: &Request,
    id: u64,
    op: Op,
) -> Result<Reply, ClientError> {
    let mut out = BytesMut::new();
    request.encode(id, &mut out);
    writer.write_all(&out).await?;
    loop {
        if let Some(frame) = decode(input).map_err(|e| ClientError::Protocol(e.to_string()))? {
            if frame.id == 0 && frame.status == Status::TlsRequired as u8 {
                return Err(ClientError::TlsRequired);
            }
            if frame.id != id {
                return Err(ClientError::Protocol(format!(
                    "reply to request {} during the handshake",
                    frame.id
                )));
            }
            return Reply::parse(frame, op, 0).map_err(|e| ClientError::Protocol(e.to_string()));
        }
        if reader.read_buf(input).await? == 0 {
            return Err(ClientError::Disconnected);
        }
    }
}

fn unexpected(reply: Reply) -> ClientError {
    match reply {
        Reply::Error { status, message } => ClientError::Refused { status, message },
        other => ClientError::Protocol(format!("unexpected reply {other:?}")),
    }
}

/// The reader task: hands each reply to its waiting request until the connection ends.
async fn read_replies(conn: Arc<Conn>, mut reader: Reader, mut input: BytesMut) {
    let result: Result<(), String> = async {
        loop {
            while let Some(frame) = decode(&mut input).map_err(|e| e.to_string())? {
                if frame.id == 0 {
                    let message = String::from_utf8_lossy(&frame.body).into_owned();
                    return Err(format!("the node closed the connection: {message}"));
                }
                let waiter = conn.pending.lock().remove(&frame.id);
                match waiter {
                    Some(tx) => {
                        let _ = tx.send(frame);
                    }
                    // A reply to a request that timed out: nobody waits for it.
                    None => tracing::debug!(id = frame.id, "late reply dropped"),
                }
            }
            // Read in large gulps: pipelined batch replies arrive as megabytes at a time,
            // and a socket drained in small reads let loopback TCP drop segments and wait
            // for a retransmission (p99 of 100+ ms at 8 batches of 32 pages in flight).
            if input.capacity() - input.len() < 256 * 1024 {
                input.reserve(1024 * 1024);
            }
            tokio::select! {
                _ = conn.stop.cancelled() => return Ok(()),
                read = reader.read_buf(&mut input) => match read {
                    Ok(0) => return Err("the node closed the connection".to_string()),
                    Ok(_) => {}
                    Err(err) => return Err(err.to_string()),
                },
            }
        }
    }
    .await;
    if let Err(reason) = result {
        if !conn.is_closed() {
            tracing::warn!(%reason, "connection to the node lost");
        }
    }
    conn.close();
}
