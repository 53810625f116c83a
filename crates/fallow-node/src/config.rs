//! A node's settings, with their defaults, and the TOML file that may hold them.
//!
//! The binary merges three sources: defaults here, then the file (`--config`), then flags;
//! flags win. Every setting has a sample line in `deploy/fallow-node.toml`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use fallow_core::ListenAddr;
use fallow_net::ReadPolling;

use crate::summary::SummarySettings;

/// Everything a running node needs besides its engine.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Where to serve the pool protocol.
    pub listen: Vec<ListenAddr>,
    /// The shared cluster secret (at least 16 bytes).
    pub secret: Vec<u8>,
    /// Where to serve Prometheus metrics (`/metrics`), if anywhere.
    pub metrics: Option<SocketAddr>,
    /// How long a client's pools outlive its last connection: long enough to ride out a
    /// reconnect, short enough that a client that went away does not pin memory forever.
    pub client_lease: Duration,
    /// The most connections served at once; more are closed as they arrive.
    pub max_connections: usize,
    /// The most pools one client may hold at once.
    pub max_pools_per_client: usize,
    /// How long a peer has to finish HELLO and AUTH.
    pub handshake_timeout: Duration,
    /// How long a reply may wait for the peer to read it before the connection is dropped
    /// (a client that stops reading must not hold the node's buffers forever).
    pub write_timeout: Duration,
    /// Cluster membership by gossip (`docs/cluster.md`); `None` runs the node alone.
    pub cluster: Option<ClusterSettings>,
    /// How long a request forwarded for a cluster pool (`forward.rs`) may wait for
    /// another node, and connecting to one may take: a node that does not answer in time
    /// costs misses, as with the cluster client, whose default this is.
    pub forward_timeout: Duration,
    /// The content summary served to clients that dedup across nodes.
    pub summary: SummarySettings,
    /// Whether a connection polls its socket for a while before its task parks
    /// (`--poll-us`): lower latency for a core per busy connection.
    pub read_polling: ReadPolling,
    /// The node protocol over TLS 1.3 on TCP (`--node-tls`): the server half for its
    /// listeners, the client half for its connections to other nodes. `None`: plaintext.
    pub tls: Option<NodeTls>,
}

/// Both halves of the node protocol's TLS.
#[derive(Debug, Clone)]
pub struct NodeTls {
    /// What the node's TCP listeners present.
    pub server: fallow_tls::TlsServer,
    /// What the node's own connections to other nodes (peer forwarding) trust.
    pub client: fallow_tls::TlsClient,
}

/// How a node joins a cluster. The timings are `fallow_cluster`'s defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterSettings {
    /// The UDP address to gossip on. `None`: the IP of the first TCP listen address and
    /// its port + 1 (7401 beside the default 7400; port 0, OS-chosen, beside port 0).
    pub gossip: Option<SocketAddr>,
    /// Gossip addresses (`HOST:PORT`) of members to contact first; may be empty for the
    /// first node, and may list nodes that are not up yet.
    pub join: Vec<String>,
    /// The protocol address other members and clients are told to reach this node at,
    /// when it is not the one it listens on (NAT, a port forward, a proxy in front).
    /// `None`: the first TCP listen address as bound (a wildcard IP replaced by the gossip
    /// IP).
    pub advertise: Option<SocketAddr>,
}

impl NodeConfig {
    /// Defaults for everything but where to listen and the secret.
    pub fn new(listen: Vec<ListenAddr>, secret: Vec<u8>) -> Self {
        Self {
            listen,
            secret,
            metrics: None,
            client_lease: Duration::from_secs(300),
            max_connections: 1024,
            max_pools_per_client: 1024,
            handshake_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(30),
            cluster: None,
            forward_timeout: Duration::from_millis(250),
            summary: SummarySettings::default(),
            read_polling: ReadPolling::OFF,
            tls: None,
        }
    }
}

/// The TOML config file. Every field is optional; unknown fields are an error, so a typo
/// is reported instead of silently ignored.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Listening endpoints, as for `--listen`.
    pub listen: Option<Vec<String>>,
    /// `SIZE` or `auto`, as for `--lend`.
    pub lend: Option<String>,
    /// Memory kept free for the host under `lend = "auto"`, as a size.
    pub reserve: Option<String>,
    /// Path of the file holding the shared secret.
    pub secret_file: Option<PathBuf>,
    /// Directory of the node protocol's TLS credentials, as for `--node-tls`.
    pub node_tls: Option<PathBuf>,
    /// Where a clean stop writes the snapshot the next start loads, as for `--state-dir`.
    pub state_dir: Option<PathBuf>,
    /// The log filter (`info`, `debug`, `fallow_node=debug,warn`, …); `FALLOW_LOG` wins.
    /// Changes on SIGHUP.
    pub log: Option<String>,
    /// Address of the Prometheus endpoint.
    pub metrics: Option<String>,
    /// Eviction policy of ephemeral pages.
    pub policy: Option<String>,
    /// Seconds a client's pools outlive its last connection.
    pub client_lease_secs: Option<u64>,
    /// The most connections served at once.
    pub max_connections: Option<usize>,
    /// Seconds a reply may wait for a peer that does not read.
    pub write_timeout_secs: Option<u64>,
    /// Gossip addresses of cluster members to join, as for `--join`.
    pub join: Option<Vec<String>>,
    /// The UDP address to gossip on, as for `--gossip`.
    pub gossip: Option<String>,
    /// The protocol address to advertise, as for `--advertise`.
    pub advertise: Option<String>,
    /// False-positive rate of the content summary, as for `--summary-fpr`.
    pub summary_fpr: Option<f64>,
    /// Largest content summary, as a size, as for `--summary-max`.
    pub summary_max: Option<String>,
    /// Seconds a content summary is served before it is rebuilt, as for
    /// `--summary-refresh`.
    pub summary_refresh_secs: Option<u64>,
    /// Milliseconds a forwarded request may wait for another node, as for
    /// `--forward-timeout`.
    pub forward_timeout_ms: Option<u64>,
    /// Microseconds a connection polls its socket before it parks, as for `--poll-us`.
    pub poll_us: Option<u64>,
    /// CPUs the runtime's worker threads are pinned to, as for `--cpus` ("2,3", "0-3").
    pub cpus: Option<String>,
}

impl ConfigFile {
    /// Reads and parses a config file; errors name the file and, for syntax errors, the
    /// line.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read config file {}: {e}", path.display()))?;
        toml::from_str(&text).map_err(|e| format!("config file {}: {e}", path.display()))
    }
}

/// Reads the shared secret: the file's bytes with surrounding whitespace trimmed (so an
/// editor's trailing newline does not change the secret). At least 16 bytes must remain.
pub fn read_secret(path: &Path) -> Result<Vec<u8>, String> {
    let bytes = std::fs::read(path)
        .map_err(|e| format!("cannot read secret file {}: {e}", path.display()))?;
    let secret = bytes.trim_ascii().to_vec();
    let min = fallow_proto::fallow::auth::MIN_SECRET_LEN;
    if secret.len() < min {
        return Err(format!(
            "secret file {} holds {} bytes; at least {min} are needed \
             (e.g. `head -c 32 /dev/urandom | base64 > {}`)",
            path.display(),
            secret.len(),
            path.display()
        ));
    }
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_file_parses_and_rejects_unknown_keys() {
        let file: ConfigFile =
            toml::from_str("listen = [\"127.0.0.1:7400\"]\nlend = \"auto\"\nreserve = \"2G\"\n")
                .unwrap();
        assert_eq!(file.lend.as_deref(), Some("auto"));
        let file: ConfigFile =
            toml::from_str("join = [\"10.0.0.2:7401\"]\ngossip = \"10.0.0.1:7401\"\n").unwrap();
        assert_eq!(file.join.unwrap(), ["10.0.0.2:7401"]);
        assert_eq!(file.gossip.as_deref(), Some("10.0.0.1:7401"));
        let err = toml::from_str::<ConfigFile>("lnd = \"1G\"\n").unwrap_err().to_string();
        assert!(err.contains("unknown field"), "{err}");
    }

    #[test]
    fn the_sample_config_parses() {
        let sample = include_str!("../../../deploy/fallow-node.toml");
        let file: ConfigFile = toml::from_str(sample).unwrap();
        assert!(file.listen.is_some());
        // Commented-out settings parse too once uncommented.
        let uncommented =
            sample.replace("# node_tls =", "node_tls =").replace("# state_dir =", "state_dir =");
        let file: ConfigFile = toml::from_str(&uncommented).unwrap();
        assert_eq!(file.node_tls, Some("/etc/fallow/tls".into()));
        assert_eq!(file.state_dir, Some("/run/fallow/state".into()));
    }

    #[test]
    fn short_secrets_are_refused() {
        let dir = std::env::temp_dir().join(format!("fallow-secret-{}", std::process::id()));
        std::fs::write(&dir, "short\n").unwrap();
        assert!(read_secret(&dir).unwrap_err().contains("at least 16"));
        std::fs::write(&dir, "  0123456789abcdef0123\n").unwrap();
        assert_eq!(read_secret(&dir).unwrap(), b"0123456789abcdef0123");
        std::fs::remove_file(&dir).unwrap();
    }
}
