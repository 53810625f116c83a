//! One client connection: read frames, answer them, write the replies.
//!
//! One task owns the socket. It decodes every whole frame in its read buffer, answers page
//! requests inline (they take microseconds) into one output buffer, hands slow requests
//! (invalidate a pool or object, destroy a pool, stats) to blocking threads, and writes
//! all replies ready with one write. So a pipelining client gets its replies batched, and a
//! slow request never holds up the page requests behind it: replies leave in completion
//! order, matched by request id. Requests on cluster pools (peer forwarding) run as tokio
//! tasks (`forward.rs`) and come back through the same channel; a connection with
//! `forward::MAX_IN_FLIGHT_PER_CONNECTION` of them running stops reading until one ends.
//!
//! Hostile input: a bad length field closes the connection (the stream cannot be
//! resynchronised); a bad body gets an error reply and the connection goes on; anything
//! before AUTH other than HELLO/AUTH, a wrong proof or no common version closes it. Before
//! AUTH, frames are limited to a few hundred bytes, and the handshake must finish within
//! `handshake_timeout`. A peer that stops reading its replies is dropped after
//! `write_timeout`. Each of these is logged and counted in `fallow_node_protocol_errors`.
//!
//! A connection that says where it stands in its client's session (HELLO) joins the
//! session at AUTH and may be fenced by a newer connection of it (`fence.rs`): every request
//! passes the connection's gate, and a fenced connection runs nothing more and closes.

use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use fallow_net::{Stream, UNIX_PEER};
use fallow_proto::fallow::frame::{decode_limited, Frame};
use fallow_proto::fallow::{encode_error, Op, Request, Status, MAX_FRAME_LEN};
use fallow_tls::Prefixed;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::cmd::{self, handshake, handshake::Phase};
use crate::fence::{Busy, Gate, Registration};
use crate::forward;
use crate::node::Node;

/// The longest frame accepted before authentication: HELLO and AUTH are under 100 bytes.
const PRE_AUTH_MAX_FRAME: usize = 256;

/// Read buffer growth: big enough for a burst of pipelined requests in one read.
const READ_CHUNK: usize = 64 * 1024;

/// Replies are written once this many bytes are waiting, even mid-burst, so the output
/// buffer stays bounded.
const FLUSH_AT: usize = 1 << 20;

/// Slow requests one connection may have on blocking threads at once; beyond that they
/// run inline.
const MAX_SLOW_IN_FLIGHT: usize = 16;

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
enum Closed {
    #[error("peer closed the connection")]
    Eof,
    #[error("node is shutting down")]
    Shutdown,
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("protocol violation: {0}")]
    Protocol(String),
    #[error("handshake not finished in time")]
    HandshakeTimeout,
    #[error("peer stopped reading replies")]
    WriteTimeout,
    #[error("fenced by a newer connection of its client's session")]
    Fenced,
}

/// Whether [`Connection::process`] answered every whole frame it had.
enum Drained {
    Yes,
    No,
    /// Stopped: the connection has its most forwarded requests in flight. Nothing more is
    /// read until one of them finishes.
    Paused,
}

/// Which kind of background request a reply on the `slow_done` channel finishes.
#[derive(Debug, Clone, Copy)]
enum Lane {
    /// On a blocking thread (`cmd::is_slow`).
    Slow,
    /// A tokio task forwarding to the cluster (`forward::is_forwarded`).
    Forwarded,
    /// The AUTH reply, once the connections it fences are idle.
    Fence,
}

/// A finished background request: its reply frame.
type Finished = (Lane, BytesMut);

struct Connection {
    node: Arc<Node>,
    peer: String,
    phase: Phase,
    out: BytesMut,
    slow_in_flight: usize,
    forwarded_in_flight: usize,
    slow_done: mpsc::UnboundedSender<Finished>,
    /// Cancelled when a newer connection of the session fences this one.
    fenced: CancellationToken,
    /// This connection's place in its client's session, once authenticated with one.
    session: Option<Registration>,
}

/// Serves one accepted connection until it closes: inside TLS first when the node has
/// `--node-tls` and the connection is TCP (a Unix socket never leaves the host).
pub(crate) async fn serve(
    node: Arc<Node>,
    stream: Box<dyn Stream>,
    peer: String,
    shutdown: CancellationToken,
) {
    let stream = match (&node.config().tls, peer.as_str()) {
        (Some(tls), peer) if peer != UNIX_PEER => {
            match secure(&node, &tls.server, stream, peer).await {
                Some(stream) => stream,
                None => return,
            }
        }
        _ => stream,
    };
    let metrics = node.metrics();
    metrics.connections.inc();
    metrics.connections_total.inc();
    tracing::debug!(%peer, "connection accepted");
    let (slow_done, slow_results) = mpsc::unbounded_channel();
    let mut conn = Connection {
        node: node.clone(),
        peer,
        phase: Phase::AwaitHello,
        out: BytesMut::with_capacity(READ_CHUNK),
        slow_in_flight: 0,
        forwarded_in_flight: 0,
        slow_done,
        fenced: CancellationToken::new(),
        session: None,
    };
    let closed = conn.run(stream, slow_results, shutdown).await;
    match &closed {
        Closed::Eof | Closed::Shutdown => tracing::debug!(peer = %conn.peer, "connection closed"),
        Closed::Fenced => {
            // The client gave up on this connection and has opened a newer one.
            tracing::info!(peer = %conn.peer, "connection fenced by a newer one of its client");
            node.metrics().fenced_connections.inc();
        }
        Closed::Io(err) => tracing::info!(peer = %conn.peer, %err, "connection failed"),
        Closed::Protocol(_) | Closed::HandshakeTimeout | Closed::WriteTimeout => {
            tracing::warn!(peer = %conn.peer, reason = %closed, "connection dropped")
        }
    }
    match closed {
        Closed::HandshakeTimeout => node.metrics().reject("handshake_timeout"),
        Closed::WriteTimeout => node.metrics().reject("write_timeout"),
        _ => {}
    }
    if let Phase::Ready { client_id, .. } | Phase::Fencing { client_id, .. } = conn.phase {
        node.clients().disconnect(client_id);
    }
    node.metrics().connections.dec();
}

/// How a connection to a TLS listener began.
enum Opening {
    /// With a TLS handshake, now done.
    Tls(Box<dyn Stream>),
    /// In the clear: refused with `TLS_REQUIRED`.
    Plaintext,
    /// With nothing: the peer closed at once.
    Probe,
}

/// The TLS handshake on a TCP connection to a node with `--node-tls`. A peer that begins in
/// the clear gets one `TLS_REQUIRED` frame it can read, instead of a handshake it would
/// wait on; then the connection closes. Either failure is logged and counted.
async fn secure(
    node: &Node,
    tls: &fallow_tls::TlsServer,
    mut stream: Box<dyn Stream>,
    peer: &str,
) -> Option<Box<dyn Stream>> {
    let secured = tokio::time::timeout(node.config().handshake_timeout, async {
        let mut first = vec![0u8; 3];
        let mut got = 0;
        while got < first.len() {
            match stream.read(first.get_mut(got..).unwrap_or_default()).await? {
                // A probe (a health check, a port scan) that connects and closes.
                0 if got == 0 => return Ok(Opening::Probe),
                0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
                n => got += n,
            }
        }
        if !fallow_tls::looks_like_tls(&first) {
            let mut out = BytesMut::new();
            let message = "this node speaks only TLS here: connect with --node-tls DIR";
            encode_error(&mut out, 0, 0, Status::TlsRequired, message);
            let _ = stream.write_all(&out).await;
            // Closing with the rest of the peer's HELLO unread would reset the connection,
            // and a reset may overtake the frame: half-close, and read what is left.
            let _ = stream.shutdown().await;
            let mut sink = [0u8; 512];
            for _ in 0..8 {
                if matches!(stream.read(&mut sink).await, Ok(0) | Err(_)) {
                    break;
                }
            }
            return Ok(Opening::Plaintext);
        }
        let stream: Box<dyn Stream> = Box::new(tls.accept(Prefixed::new(first, stream)).await?);
        Ok::<_, std::io::Error>(Opening::Tls(stream))
    })
    .await;
    match secured {
        Ok(Ok(Opening::Tls(stream))) => return Some(stream),
        Ok(Ok(Opening::Probe)) => tracing::debug!(%peer, "closed before sending anything"),
        Ok(Ok(Opening::Plaintext)) => {
            tracing::warn!(%peer, "plaintext connection refused: this node requires TLS");
            node.metrics().reject("tls_required");
        }
        Ok(Err(err)) => {
            tracing::warn!(%peer, %err, "TLS handshake failed");
            node.metrics().reject("tls_handshake");
        }
        Err(_) => {
            tracing::warn!(%peer, "TLS handshake not finished in time");
            node.metrics().reject("handshake_timeout");
        }
    }
    None
}

impl Connection {
    async fn run<S>(
        &mut self,
        mut stream: S,
        mut slow_results: mpsc::UnboundedReceiver<Finished>,
        shutdown: CancellationToken,
    ) -> Closed
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let config = self.node.config().clone();
        let handshake_deadline = tokio::time::Instant::now() + config.handshake_timeout;
        let fenced = self.fenced.clone();
        let mut input = BytesMut::with_capacity(READ_CHUNK);
        loop {
            let verdict = self.process(&mut input);
            if !self.out.is_empty() {
                let write = stream.write_all(&self.out);
                match tokio::time::timeout(config.write_timeout, write).await {
                    Ok(Ok(())) => self.out.clear(),
                    Ok(Err(err)) => return Closed::Io(err),
                    Err(_) => return Closed::WriteTimeout,
                }
            }
            let paused = match verdict {
                Err(closed) => return closed,
                // The output filled up mid-burst: whole frames may still wait in `input`.
                Ok(Drained::No) => continue,
                Ok(Drained::Yes) => false,
                Ok(Drained::Paused) => true,
            };
            let ready = matches!(self.phase, Phase::Ready { .. });
            if input.capacity() - input.len() < READ_CHUNK / 4 {
                input.reserve(READ_CHUNK);
            }
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Closed::Shutdown,
                _ = fenced.cancelled() => return Closed::Fenced,
                Some(finished) = slow_results.recv() => self.finished(finished),
                read = stream.read_buf(&mut input), if !paused => match read {
                    Ok(0) if !input.is_empty() => {
                        self.node.metrics().reject("truncated_frame");
                        return Closed::Protocol(format!(
                            "closed in the middle of a frame ({} bytes of it received)",
                            input.len()
                        ));
                    }
                    Ok(0) => return self.finish_slow(&mut stream, &mut slow_results, &config).await,
                    Ok(_) => {}
                    Err(err) => return Closed::Io(err),
                },
                _ = tokio::time::sleep_until(handshake_deadline), if !ready => {
                    return Closed::HandshakeTimeout;
                }
            }
        }
    }

    /// The peer finished sending: deliver the replies of slow requests still running
    /// (a client may half-close and keep reading), then close.
    async fn finish_slow<S>(
        &mut self,
        stream: &mut S,
        slow_results: &mut mpsc::UnboundedReceiver<Finished>,
        config: &crate::NodeConfig,
    ) -> Closed
    where
        S: AsyncWrite + Unpin,
    {
        while self.slow_in_flight + self.forwarded_in_flight > 0 {
            let Some(finished) = slow_results.recv().await else { break };
            self.finished(finished);
        }
        if !self.out.is_empty() {
            match tokio::time::timeout(config.write_timeout, stream.write_all(&self.out)).await {
                Ok(Ok(())) => self.out.clear(),
                Ok(Err(err)) => return Closed::Io(err),
                Err(_) => return Closed::WriteTimeout,
            }
        }
        Closed::Eof
    }

    /// Answers every whole frame in `input`. Stops early to let the caller write when the
    /// output grows large (then says whether `input` was drained); returns an error when the
    /// connection must close (after the output, which may hold the reason, is written).
    fn process(&mut self, input: &mut BytesMut) -> Result<Drained, Closed> {
        while self.out.len() < FLUSH_AT {
            if self.forwarded_in_flight >= forward::MAX_IN_FLIGHT_PER_CONNECTION {
                return Ok(Drained::Paused);
            }
            let limit = match self.phase {
                Phase::Ready { .. } => MAX_FRAME_LEN,
                _ => PRE_AUTH_MAX_FRAME,
            };
            let frame = match decode_limited(input, limit) {
                Ok(Some(frame)) => frame,
                Ok(None) => return Ok(Drained::Yes),
                Err(_) if fallow_tls::looks_like_tls(input) => {
                    // Nothing the TLS client could read would help: it waits for a
                    // handshake. Its own error says the node closed during it.
                    self.node.metrics().reject("tls_on_plaintext");
                    return Err(Closed::Protocol(
                        "a TLS client reached this node, which has no --node-tls".into(),
                    ));
                }
                Err(err) => {
                    self.node.metrics().reject("bad_frame");
                    let message = err.to_string();
                    encode_error(&mut self.out, 0, 0, Status::BadFrame, &message);
                    return Err(Closed::Protocol(message));
                }
            };
            self.handle(frame)?;
        }
        Ok(Drained::No)
    }

    fn handle(&mut self, frame: Frame) -> Result<(), Closed> {
        let started = Instant::now();
        let (op_code, id) = (frame.op, frame.id);
        let request = match Request::parse(frame) {
            Ok(request) => request,
            Err(err) => {
                let status = match self.phase {
                    Phase::Ready { .. } => err.status(),
                    // A HELLO we cannot read: tell the peer which versions we speak.
                    Phase::AwaitHello if op_code == Op::Hello as u8 => Status::UnsupportedVersion,
                    Phase::AwaitHello | Phase::AwaitAuth { .. } | Phase::Fencing { .. } => {
                        Status::NotAuthenticated
                    }
                };
                let metrics = self.node.metrics();
                metrics.reject(status.name());
                if status == Status::UnsupportedVersion {
                    let reply = fallow_proto::fallow::Reply::VersionMismatch {
                        min: fallow_proto::fallow::VERSION,
                        max: fallow_proto::fallow::VERSION,
                    };
                    reply.encode(Op::Hello, id, &mut self.out);
                } else {
                    encode_error(&mut self.out, op_code, id, status, &err.to_string());
                }
                if let Some(op) = Op::from_code(op_code) {
                    metrics.request(op, status, started.elapsed().as_secs_f64());
                }
                if status.closes_connection() {
                    return Err(Closed::Protocol(err.to_string()));
                }
                tracing::debug!(peer = %self.peer, %err, "malformed request");
                return Ok(());
            }
        };
        let op = request.op();
        let status = match (&self.phase, request) {
            (Phase::AwaitHello, Request::Hello(hello)) => {
                let name = hello.name.clone();
                match handshake::hello(&self.node, hello, id, &mut self.out) {
                    Ok(next) => {
                        tracing::debug!(peer = %self.peer, %name, "hello");
                        self.phase = next;
                        Status::Ok
                    }
                    Err(status) => return self.refuse(op, status, "no protocol version in common"),
                }
            }
            (
                Phase::AwaitAuth { version, challenge, client_id, name, session },
                Request::Auth { client_nonce, proof },
            ) => {
                let (version, challenge, client_id, name, session) =
                    (*version, *challenge, *client_id, name.clone(), *session);
                let mut reply = BytesMut::new();
                let authenticated = handshake::auth(
                    &self.node,
                    version,
                    challenge,
                    client_id,
                    session,
                    self.fenced.clone(),
                    client_nonce,
                    &proof,
                    id,
                    &mut reply,
                );
                let handshake::Authenticated { client, session, fenced } = match authenticated {
                    Ok(authenticated) => authenticated,
                    Err(status) => {
                        self.out.extend_from_slice(&reply);
                        let why = match status {
                            Status::AuthFailed => "wrong secret",
                            _ => "a connection below its session's fence",
                        };
                        return self.refuse(op, status, why);
                    }
                };
                self.session = session;
                tracing::info!(
                    peer = %self.peer,
                    client = %format_args!("{client_id:032x}"),
                    %name,
                    "client authenticated"
                );
                if fenced.iter().all(|gate| gate.is_idle()) {
                    self.out.extend_from_slice(&reply);
                    self.phase = Phase::Ready { client_id, client };
                } else {
                    self.phase = Phase::Fencing { client_id, client };
                    self.answer_when_idle(fenced, reply);
                }
                Status::Ok
            }
            (Phase::AwaitHello | Phase::AwaitAuth { .. } | Phase::Fencing { .. }, _) => {
                encode_error(
                    &mut self.out,
                    op as u8,
                    id,
                    Status::NotAuthenticated,
                    "authenticate first",
                );
                return self.refuse(op, Status::NotAuthenticated, "request before authentication");
            }
            (Phase::Ready { client, .. }, request) => {
                // Held until the request has taken effect, wherever it runs.
                let busy = match self.session.as_ref().map(|s| s.gate().enter()) {
                    Some(None) => return Err(Closed::Fenced),
                    Some(busy) => busy,
                    None => None,
                };
                if forward::is_forwarded(&request) {
                    self.spawn_forwarded(client.clone(), request, id, started, busy);
                    return Ok(());
                }
                if cmd::is_slow(&request) && self.slow_in_flight < MAX_SLOW_IN_FLIGHT {
                    self.spawn_slow(client.clone(), request, id, started, busy);
                    return Ok(());
                }
                let status = cmd::execute(&self.node, client, request, id, &mut self.out);
                drop(busy);
                status
            }
        };
        self.node.metrics().request(op, status, started.elapsed().as_secs_f64());
        Ok(())
    }

    /// Counts and logs a refusal that closes the connection (its reply is already in `out`).
    fn refuse(&mut self, op: Op, status: Status, why: &str) -> Result<(), Closed> {
        let metrics = self.node.metrics();
        metrics.reject(status.name());
        metrics.request(op, status, 0.0);
        Err(Closed::Protocol(why.to_string()))
    }

    fn spawn_slow(
        &mut self,
        client: Arc<crate::clients::Client>,
        request: Request,
        id: u64,
        started: Instant,
        busy: Option<Busy>,
    ) {
        self.slow_in_flight += 1;
        let node = self.node.clone();
        let done = self.slow_done.clone();
        tokio::task::spawn_blocking(move || {
            let op = request.op();
            let mut out = BytesMut::new();
            let status = cmd::execute(&node, &client, request, id, &mut out);
            drop(busy);
            node.metrics().request(op, status, started.elapsed().as_secs_f64());
            // The connection may have closed meanwhile; then the reply has nowhere to go.
            let _ = done.send((Lane::Slow, out));
        });
    }

    /// A background request finished: its reply joins the output.
    fn finished(&mut self, (lane, reply): Finished) {
        match lane {
            Lane::Slow => self.slow_in_flight -= 1,
            Lane::Forwarded => self.forwarded_in_flight -= 1,
            Lane::Fence => {
                self.phase = match std::mem::replace(&mut self.phase, Phase::AwaitHello) {
                    Phase::Fencing { client_id, client } => Phase::Ready { client_id, client },
                    other => other,
                };
            }
        }
        self.out.extend_from_slice(&reply);
    }

    /// Sends the AUTH reply once the connections this one fenced have finished the
    /// requests they were running (bounded by the handshake timeout: past it the
    /// connection closes unanswered, and the client tries again).
    fn answer_when_idle(&mut self, fenced: Vec<Arc<Gate>>, reply: BytesMut) {
        tracing::debug!(peer = %self.peer, connections = fenced.len(), "waiting for fenced requests");
        let done = self.slow_done.clone();
        tokio::spawn(async move {
            for gate in &fenced {
                gate.idle().await;
            }
            // The connection may have closed meanwhile; then the reply has nowhere to go.
            let _ = done.send((Lane::Fence, reply));
        });
    }

    /// Runs a request on a cluster pool as a tokio task: it waits on other nodes, and
    /// neither this connection nor any other waits with it.
    fn spawn_forwarded(
        &mut self,
        client: Arc<crate::clients::Client>,
        request: Request,
        id: u64,
        started: Instant,
        busy: Option<Busy>,
    ) {
        self.forwarded_in_flight += 1;
        let node = self.node.clone();
        let op = request.op();
        let mut reply =
            ForwardedReply { done: self.slow_done.clone(), op, id, out: BytesMut::new() };
        tokio::spawn(async move {
            let status = forward::execute(&node, &client, request, id, &mut reply.out).await;
            drop(busy);
            node.metrics().request(op, status, started.elapsed().as_secs_f64());
        });
    }
}

/// Delivers a forwarded request's reply when its task ends, however it ends: a task that
/// panicked still answers (`INTERNAL`), so the connection's count of forwarded requests in
/// flight stays true and it never stays paused.
struct ForwardedReply {
    done: mpsc::UnboundedSender<Finished>,
    op: Op,
    id: u64,
    out: BytesMut,
}

impl Drop for ForwardedReply {
    fn drop(&mut self) {
        let mut out = std::mem::take(&mut self.out);
        if out.is_empty() {
            encode_error(&mut out, self.op as u8, self.id, Status::Internal, "forwarding failed");
        }
        // The connection may have closed meanwhile; then the reply has nowhere to go.
        let _ = self.done.send((Lane::Forwarded, out));
    }
}
