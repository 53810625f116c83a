//! Where the node is and how to talk to it.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::ClientError;

/// A node's address: `HOST:PORT` (TCP; a name is resolved) or `unix:PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// TCP to this host and port.
    Tcp(String),
    /// A Unix stream socket.
    Unix(PathBuf),
}

impl Endpoint {
    /// Parses `HOST:PORT`, `fallow://HOST:PORT` or `unix:PATH`.
    pub fn parse(s: &str) -> Result<Self, ClientError> {
        let s = s.strip_prefix("fallow://").unwrap_or(s);
        if let Some(path) = s.strip_prefix("unix:") {
            if path.is_empty() {
                return Err(ClientError::InvalidAddress(s.to_string()));
            }
            return Ok(Endpoint::Unix(PathBuf::from(path)));
        }
        match s.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => {
                Ok(Endpoint::Tcp(s.to_string()))
            }
            _ => Err(ClientError::InvalidAddress(s.to_string())),
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(addr) => write!(f, "{addr}"),
            Endpoint::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

/// How a [`crate::Client`] connects and behaves.
#[derive(Clone)]
pub struct ClientConfig {
    /// The node.
    pub endpoint: Endpoint,
    /// The shared cluster secret.
    pub secret: Vec<u8>,
    /// This client's identity: its private pools belong to it, so keep it stable across
    /// restarts to find them again (within the node's client lease). Random by default.
    pub client_id: u128,
    /// A name for the node's logs.
    pub name: String,
    /// Connections to open; requests are spread over them round-robin.
    pub connections: usize,
    /// How long a request may wait for its reply. After a timeout the connection is
    /// closed and reopened on next use (a node that does not answer may be gone).
    pub timeout: Duration,
    /// How long connecting and the handshake may take.
    pub connect_timeout: Duration,
    /// How long a request the node runs in the background may wait for its reply
    /// (`Op::is_slow`: destroying or invalidating a pool or object walks every page of it,
    /// which takes far longer than a page request). At least `timeout`.
    pub slow_timeout: Duration,
    /// What to do when a reconnection finds a restarted node (another node id).
    pub on_restart: NodeRestart,
    /// TLS 1.3 to TCP endpoints (nodes started with `--node-tls`): the node's certificate
    /// must chain to the client's CA and name the host connected to. Unix sockets stay
    /// in the clear.
    pub tls: Option<fallow_tls::TlsClient>,
}

/// What a [`crate::Client`] does when a new connection reaches a node whose id differs
/// from the one its first connection saw: the node restarted, and every pool (and pool
/// id) of its earlier run is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeRestart {
    /// Use the new run as if nothing happened (requests naming old pools fail with
    /// `UnknownPool`, or reach a new pool that reused the id).
    Reconnect,
    /// Refuse it: the connection is closed and the request fails with
    /// [`crate::ClientError::NodeRestarted`]. A cluster client uses this, because it maps
    /// its own pools to each node's pool ids and must never send an old id to a new run.
    Refuse,
}

impl fmt::Debug for ClientConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The secret is never printed.
        f.debug_struct("ClientConfig")
            .field("endpoint", &self.endpoint)
            .field("client_id", &format_args!("{:032x}", self.client_id))
            .field("name", &self.name)
            .field("connections", &self.connections)
            .field("timeout", &self.timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("slow_timeout", &self.slow_timeout)
            .field("on_restart", &self.on_restart)
            .field("tls", &self.tls.is_some())
            .finish_non_exhaustive()
    }
}

impl ClientConfig {
    /// A config for the node at `addr` (`HOST:PORT`, `fallow://HOST:PORT` or `unix:PATH`)
    /// with the defaults: a random client id, one connection, 5 s request and connect
    /// timeouts, 60 s for slow requests.
    pub fn new(addr: &str, secret: impl Into<Vec<u8>>) -> Result<Self, ClientError> {
        Ok(Self {
            endpoint: Endpoint::parse(addr)?,
            secret: secret.into(),
            client_id: rand::random(),
            name: default_name(),
            connections: 1,
            timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            slow_timeout: Duration::from_secs(60),
            on_restart: NodeRestart::Reconnect,
            tls: None,
        })
    }

    /// Connects to TCP endpoints over TLS (see [`ClientConfig::tls`]).
    pub fn tls(mut self, tls: Option<fallow_tls::TlsClient>) -> Self {
        self.tls = tls;
        self
    }

    /// Sets the number of connections (at least 1).
    pub fn connections(mut self, n: usize) -> Self {
        self.connections = n.max(1);
        self
    }

    /// Sets the request timeout.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets the connect and handshake timeout.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Sets the timeout of slow requests (pool and object invalidations, destroy, stats,
    /// content summaries).
    pub fn slow_timeout(mut self, timeout: Duration) -> Self {
        self.slow_timeout = timeout;
        self
    }

    /// Sets what happens when a reconnection finds that the node restarted.
    pub fn on_restart(mut self, on_restart: NodeRestart) -> Self {
        self.on_restart = on_restart;
        self
    }

    /// Sets the client id (to reach the private pools of an earlier run).
    pub fn client_id(mut self, id: u128) -> Self {
        self.client_id = id;
        self
    }

    /// Sets the name shown in the node's logs (at most 64 bytes are sent).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }
}

pub(crate) fn default_name() -> String {
    let exe = std::env::current_exe().ok();
    let program =
        exe.as_ref().and_then(|p| p.file_name()).and_then(|n| n.to_str()).unwrap_or("client");
    format!("{program}/{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            Endpoint::parse("127.0.0.1:7400").unwrap(),
            Endpoint::Tcp("127.0.0.1:7400".into())
        );
        assert_eq!(
            Endpoint::parse("fallow://node1:7400").unwrap(),
            Endpoint::Tcp("node1:7400".into())
        );
        assert_eq!(Endpoint::parse("[::1]:1").unwrap(), Endpoint::Tcp("[::1]:1".into()));
        assert_eq!(
            Endpoint::parse("unix:/run/f.sock").unwrap(),
            Endpoint::Unix("/run/f.sock".into())
        );
        for bad in ["", "node", "node:", ":7400", "node:99999", "unix:"] {
            assert!(Endpoint::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn debug_hides_the_secret() {
        let config = ClientConfig::new("127.0.0.1:1", b"super-secret-value".to_vec()).unwrap();
        assert!(!format!("{config:?}").contains("super-secret"));
    }
}
