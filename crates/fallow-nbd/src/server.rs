//! Binding the listeners, accepting NBD connections, and stopping cleanly.

use std::io;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use fallow_core::ListenAddr;
use fallow_net::{spawn_accept_loop, Listener, ReadPolling, Stream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::export::Export;
use crate::handshake::{Negotiated, TlsPolicy};
use crate::metrics::NbdMetrics;
use crate::{handshake, transmission};

/// How long a client has for the whole negotiation, TLS handshake included.
const NEGOTIATION_TIMEOUT: Duration = Duration::from_secs(30);

/// How the server listens and serves: polling, TLS and metrics.
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    /// Prometheus metrics at `http://ADDR/metrics`.
    pub metrics: Option<std::net::SocketAddr>,
    /// How connections poll their socket before they park (`--poll-us`).
    pub polling: ReadPolling,
    /// Whether TLS is off, offered or required (`--tls`).
    pub tls: TlsPolicy,
}

/// A running NBD server.
#[derive(Debug)]
pub struct NbdServer {
    bound: Vec<ListenAddr>,
    metrics: Arc<NbdMetrics>,
    metrics_addr: Option<std::net::SocketAddr>,
    unix_paths: Vec<PathBuf>,
    shutdown: CancellationToken,
    tasks: TaskTracker,
}

impl NbdServer {
    /// Binds every address (none: the sockets the service manager handed over) and serves
    /// `exports` (the first is also the default export) on the current tokio runtime;
    /// serves Prometheus metrics on `metrics` if given.
    pub async fn start(
        listen: &[ListenAddr],
        exports: Vec<Arc<Export>>,
        metrics: Option<std::net::SocketAddr>,
    ) -> io::Result<NbdServer> {
        NbdServer::start_with(listen, exports, ServerOptions { metrics, ..Default::default() })
            .await
    }

    /// [`NbdServer::start`], with the polling, TLS and metrics `options` say.
    pub async fn start_with(
        listen: &[ListenAddr],
        exports: Vec<Arc<Export>>,
        options: ServerOptions,
    ) -> io::Result<NbdServer> {
        let ServerOptions { metrics, polling, tls } = options;
        if exports.is_empty() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "no export to serve"));
        }
        let exports: Arc<[Arc<Export>]> = exports.into();
        let shutdown = CancellationToken::new();
        let tasks = TaskTracker::new();
        let counters = Arc::new(NbdMetrics::new());
        let mut bound = Vec::new();
        let mut unix_paths = Vec::new();
        for listener in Listener::bind_all(listen).await? {
            let local = listener.local_addr()?;
            tracing::info!(addr = %local, "NBD listening");
            if let ListenAddr::Unix(path) = &local {
                unix_paths.push(path.clone());
            }
            bound.push(local);
            let (exports, stop, counters) = (exports.clone(), shutdown.clone(), counters.clone());
            let tls = tls.clone();
            spawn_accept_loop(
                listener,
                polling,
                shutdown.clone(),
                tasks.clone(),
                move |stream, peer| {
                    let (exports, tls, stop) = (exports.clone(), tls.clone(), stop.clone());
                    Some(connection(stream, peer, exports, tls, stop, counters.clone()))
                },
            );
        }
        let metrics_addr = match metrics {
            Some(addr) => {
                let (exports, counters) = (exports.clone(), counters.clone());
                let render = move || counters.render(&exports);
                Some(fallow_net::serve_metrics(addr, shutdown.clone(), render).await?)
            }
            None => None,
        };
        Ok(NbdServer { bound, metrics: counters, metrics_addr, unix_paths, shutdown, tasks })
    }

    /// The addresses bound (with the ports chosen for port 0).
    pub fn local_addrs(&self) -> &[ListenAddr] {
        &self.bound
    }

    /// The first TCP address, if any.
    pub fn tcp_addr(&self) -> Option<std::net::SocketAddr> {
        self.bound.iter().find_map(|a| match a {
            ListenAddr::Tcp(addr) => Some(*addr),
            ListenAddr::Unix(_) => None,
        })
    }

    /// The metrics endpoint, if one is served.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics_addr
    }

    /// The counters.
    pub fn metrics(&self) -> &Arc<NbdMetrics> {
        &self.metrics
    }

    /// Stops accepting; connections finish the requests they have read and close.
    pub async fn shutdown(self) {
        self.shutdown.cancel();
        self.tasks.close();
        if tokio::time::timeout(Duration::from_secs(10), self.tasks.wait()).await.is_err() {
            tracing::warn!("NBD connections still busy after 10 s; leaving them");
        }
        for path in &self.unix_paths {
            Listener::remove_socket_file(path);
        }
    }
}

async fn connection(
    stream: Box<dyn Stream>,
    peer: String,
    exports: Arc<[Arc<Export>]>,
    tls: TlsPolicy,
    shutdown: CancellationToken,
    metrics: Arc<NbdMetrics>,
) {
    let negotiation = handshake::negotiate(stream, &exports, &tls);
    let negotiated = tokio::time::timeout(NEGOTIATION_TIMEOUT, negotiation).await;
    let (session, stream, input, tls) = match negotiated {
        Ok(Ok(Negotiated { session: Some(session), stream, input, tls })) => {
            (session, stream, input, tls)
        }
        Ok(Ok(Negotiated { session: None, .. })) => {
            return tracing::debug!(%peer, "client aborted negotiation")
        }
        Ok(Err(err)) => {
            metrics.negotiation_failed(&err);
            return tracing::info!(%peer, %err, "negotiation failed");
        }
        Err(_) => return tracing::info!(%peer, "negotiation timed out"),
    };
    tracing::info!(
        %peer,
        export = %session.export.name,
        structured = session.structured,
        tls,
        "NBD client connected"
    );
    metrics.connections.inc();
    metrics.connections_total.inc();
    let served =
        transmission::serve(stream, session, input, peer.clone(), shutdown, metrics.clone()).await;
    metrics.connections.dec();
    if let Err(err) = served {
        tracing::info!(%peer, %err, "NBD connection ended with an error");
    }
}
