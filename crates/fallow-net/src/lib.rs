//! Listening sockets shared by fallow's servers (the node, the NBD server): bind a TCP
//! address or a Unix socket, and accept connections until shut down, each handed to the
//! server as one boxed stream so that a server is written once for both kinds.
//!
//! # Components
//! [`Listener`]: one bound socket, or one handed over by the service manager
//! ([`activation`]). [`spawn_accept_loop`]: its accept loop.
//! [`busy_poll`]: connections that poll their socket before they park (`--poll-us`).
//! [`serve_metrics`]: a Prometheus `/metrics` endpoint. [`cpus::CpuList`]: the CPUs a
//! polling server pins its threads to.

// Bytes from the network or a disk never panic the process (STYLE.md rule 7): no unwrap,
// expect or unchecked indexing outside tests; an index that holds by construction says
// why, in an `expect` on its function.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used, clippy::indexing_slicing))]

pub mod activation;
pub mod busy_poll;
pub mod cpus;

use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

pub use busy_poll::{BusyPoll, ReadPolling};
use fallow_core::ListenAddr;
use prometheus_client::metrics::counter::Counter;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A connected byte stream of either kind.
pub trait Stream: AsyncRead + AsyncWrite + Send + Unpin {}

impl<T: AsyncRead + AsyncWrite + Send + Unpin> Stream for T {}

/// The peer name of every connection accepted on a Unix socket.
pub const UNIX_PEER: &str = "unix";

/// One accepted connection and a name for its peer (`IP:PORT`, or [`UNIX_PEER`]).
pub type Accepted = (Box<dyn Stream>, String);

/// A bound listening socket.
#[derive(Debug)]
pub enum Listener {
    /// TCP.
    Tcp(TcpListener),
    /// A Unix socket at this path (removed by [`Listener::remove_socket_file`]).
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Binds `addr`. A stale Unix socket file (no process listening) is replaced; a live
    /// one, or a file that is not a socket, is an error. Errors name the address.
    pub async fn bind(addr: &ListenAddr) -> io::Result<Listener> {
        if let Some(inherited) = activation::take_matching(addr) {
            return Ok(inherited);
        }
        match addr {
            ListenAddr::Tcp(addr) => TcpListener::bind(addr)
                .await
                .map(Listener::Tcp)
                .map_err(|e| io::Error::new(e.kind(), format!("cannot listen on {addr}: {e}"))),
            ListenAddr::Unix(path) => {
                fallow_core::prepare_unix_socket(path)?;
                UnixListener::bind(path).map(|l| Listener::Unix(l, path.clone())).map_err(|e| {
                    io::Error::new(e.kind(), format!("cannot listen on {}: {e}", path.display()))
                })
            }
        }
    }

    /// The address bound (with the port the OS chose for port 0).
    pub fn local_addr(&self) -> io::Result<ListenAddr> {
        match self {
            Listener::Tcp(l) => l.local_addr().map(ListenAddr::Tcp),
            Listener::Unix(_, path) => Ok(ListenAddr::Unix(path.clone())),
        }
    }

    /// Accepts one connection, its reads polling as `polling` says (in a [`BusyPoll`] when
    /// it is on). TCP connections get `TCP_NODELAY`: fallow's requests and replies are
    /// latency-bound, never worth delaying to fill a packet.
    pub async fn accept(&self, polling: ReadPolling) -> io::Result<Accepted> {
        match self {
            Listener::Tcp(l) => {
                let (stream, peer) = l.accept().await?;
                let _ = stream.set_nodelay(true);
                Ok((polling.tcp(stream), peer.to_string()))
            }
            Listener::Unix(l, _) => {
                let (stream, _) = l.accept().await?;
                Ok((polling.unix(stream), UNIX_PEER.to_string()))
            }
        }
    }

    /// Removes the socket file of a Unix listener (after it has stopped), unless the
    /// service manager made it: that one serves the next run too.
    pub fn remove_socket_file(path: &std::path::Path) {
        if !activation::was_inherited(path) {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Binds every address of `listen`; with none, takes every socket the service manager
    /// handed over ([`activation`]). Errors name the address.
    pub async fn bind_all(listen: &[ListenAddr]) -> io::Result<Vec<Listener>> {
        if listen.is_empty() {
            let inherited = activation::take_all();
            if inherited.is_empty() {
                return Err(io::Error::new(io::ErrorKind::InvalidInput, "nothing to listen on"));
            }
            return Ok(inherited);
        }
        let mut bound = Vec::with_capacity(listen.len());
        for addr in listen {
            bound.push(Listener::bind(addr).await?);
        }
        Ok(bound)
    }
}

/// Spawns on `tasks` a loop that accepts connections until `shutdown` and spawns (on
/// `tasks` too) the future `serve` makes for each, or drops the connection when `serve`
/// returns `None` (a connection limit, say). Each connection's reads poll as `polling`
/// says. Accept errors (out of file descriptors, a peer that reset first) are logged and
/// retried after a short pause.
pub fn spawn_accept_loop<F, Fut>(
    listener: Listener,
    polling: ReadPolling,
    shutdown: CancellationToken,
    tasks: TaskTracker,
    serve: F,
) where
    F: Fn(Box<dyn Stream>, String) -> Option<Fut> + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let spawner = tasks.clone();
    tasks.spawn(async move {
        loop {
            let accepted = tokio::select! {
                _ = shutdown.cancelled() => return,
                accepted = listener.accept(polling) => accepted,
            };
            match accepted {
                Ok((stream, peer)) => {
                    if let Some(connection) = serve(stream, peer) {
                        spawner.spawn(connection);
                    }
                }
                Err(err) => {
                    tracing::warn!(%err, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    });
}

/// Serves `render()` as Prometheus text at `http://ADDR/metrics` until `shutdown`.
/// Returns the bound address (port 0 picks a free one).
pub async fn serve_metrics<F>(
    addr: std::net::SocketAddr,
    shutdown: CancellationToken,
    render: F,
) -> io::Result<std::net::SocketAddr>
where
    F: Fn() -> String + Clone + Send + Sync + 'static,
{
    use axum::routing::get;
    let listener = TcpListener::bind(addr)
        .await
        .map_err(|e| io::Error::new(e.kind(), format!("cannot serve metrics on {addr}: {e}")))?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let render = render.clone();
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "text/plain; version=0.0.4; charset=utf-8",
                    )],
                    render(),
                )
            }
        }),
    );
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(err) = served {
            tracing::error!(%err, "metrics endpoint failed");
        }
    });
    tracing::info!(%bound, "serving metrics at http://{bound}/metrics");
    Ok(bound)
}

/// Advances `counter` to `total`, a count kept elsewhere (an engine's, a cache's) that only
/// grows: a counter cannot be set, only increased, so a scrape adds what changed since the
/// last. A `total` below the counter (the source was reset) leaves it as it is. Callers
/// serialise their scrapes, or two would add the same difference.
pub fn advance_counter(counter: &Counter, total: u64) {
    let now = counter.get();
    if total > now {
        counter.inc_by(total - now);
    }
}

/// [`advance_counter`] for a float counter of seconds.
pub fn advance_seconds(counter: &Counter<f64, AtomicU64>, total: f64) {
    let now = counter.get();
    if total > now {
        counter.inc_by(total - now);
    }
}
