//! A member's settings: who it is, where it gossips, whom it asks first, and the timings
//! of gossip and failure detection. Built through [`ClusterConfig::builder`], which checks
//! everything and never panics.

use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::ClusterError;

/// How often a member gossips with up to three others. Every figure below is derived from
/// it; `docs/cluster.md` has the measured detection times and bandwidth.
pub const DEFAULT_GOSSIP_INTERVAL: Duration = Duration::from_millis(100);

/// chitchat's phi threshold. Its phi is "time since the last news of a member, divided by
/// the mean time between news" (the mean starts from a prior of half an interval): at
/// three members news of each arrives every 30–50 ms (each member hears of the others in
/// every SYN and SYN-ACK), so 10 declares a silent member dead after 0.3–0.5 s of
/// silence, to which chitchat's once-a-round liveness check and our once-a-round watcher
/// add up to 0.2 s (`docs/cluster.md` has the measurements). Lower detects faster but
/// flaps when a busy host stalls a process for a few hundred milliseconds.
pub const DEFAULT_PHI_THRESHOLD: f64 = 10.0;

/// The shortest secret accepted: the node protocol's minimum.
pub const MIN_SECRET_LEN: usize = 16;

/// Everything a cluster member needs. Fields are public for reading; build one with
/// [`ClusterConfig::builder`].
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// The member's name, stable across restarts (the node uses its protocol address).
    pub node_id: String,
    /// Distinguishes this run of the member from earlier ones: must grow from one start
    /// to the next. The default is the start time in milliseconds since the Unix epoch.
    pub generation: u64,
    /// The node-protocol address clients use (the node's TCP `--listen`), gossiped as-is.
    pub protocol_addr: SocketAddr,
    /// The UDP address to gossip on, also the one peers send to. Port 0 lets the OS choose
    /// (tests); the address must not be unspecified (0.0.0.0 or ::), since peers could not
    /// reach it.
    pub gossip_addr: SocketAddr,
    /// Gossip addresses (`HOST:PORT`) of members to contact first. Unreachable seeds are
    /// retried; a member with no seeds waits to be contacted.
    pub seeds: Vec<String>,
    /// The shared cluster secret: gossip datagrams are sealed with a key derived from it.
    pub secret: Vec<u8>,
    /// See [`DEFAULT_GOSSIP_INTERVAL`].
    pub gossip_interval: Duration,
    /// See [`DEFAULT_PHI_THRESHOLD`].
    pub phi_threshold: f64,
    /// A live member not heard of for this long is reported `Suspect` (default: three
    /// gossip intervals). Purely informational: placement may avoid suspects, but only
    /// chitchat's detector declares a member dead.
    pub suspect_after: Duration,
    /// How long a dead member stays listed (and gossiped about) before it is forgotten.
    pub dead_member_ttl: Duration,
}

impl ClusterConfig {
    /// Starts a config with the required values; everything else has a default.
    pub fn builder(
        node_id: impl Into<String>,
        protocol_addr: SocketAddr,
        gossip_addr: SocketAddr,
        secret: impl Into<Vec<u8>>,
    ) -> ClusterConfigBuilder {
        ClusterConfigBuilder {
            config: ClusterConfig {
                node_id: node_id.into(),
                generation: generation_now(),
                protocol_addr,
                gossip_addr,
                seeds: Vec::new(),
                secret: secret.into(),
                gossip_interval: DEFAULT_GOSSIP_INTERVAL,
                phi_threshold: DEFAULT_PHI_THRESHOLD,
                suspect_after: DEFAULT_GOSSIP_INTERVAL * 3,
                dead_member_ttl: Duration::from_secs(3600),
            },
            suspect_after_set: false,
        }
    }
}

/// Builds a [`ClusterConfig`]; [`ClusterConfigBuilder::build`] validates it.
#[derive(Debug, Clone)]
pub struct ClusterConfigBuilder {
    config: ClusterConfig,
    suspect_after_set: bool,
}

impl ClusterConfigBuilder {
    /// Gossip addresses of members to contact first.
    pub fn seeds(mut self, seeds: impl IntoIterator<Item = impl Into<String>>) -> Self {
        self.config.seeds = seeds.into_iter().map(Into::into).collect();
        self
    }

    /// Overrides the generation (tests; a restart must use a larger one).
    pub fn generation(mut self, generation: u64) -> Self {
        self.config.generation = generation;
        self
    }

    /// How often to gossip. Unless set explicitly, `suspect_after` follows it (×3).
    pub fn gossip_interval(mut self, interval: Duration) -> Self {
        self.config.gossip_interval = interval;
        if !self.suspect_after_set {
            self.config.suspect_after = interval * 3;
        }
        self
    }

    /// chitchat's phi threshold.
    pub fn phi_threshold(mut self, phi: f64) -> Self {
        self.config.phi_threshold = phi;
        self
    }

    /// Silence after which a live member is reported `Suspect`.
    pub fn suspect_after(mut self, after: Duration) -> Self {
        self.config.suspect_after = after;
        self.suspect_after_set = true;
        self
    }

    /// How long a dead member stays listed.
    pub fn dead_member_ttl(mut self, ttl: Duration) -> Self {
        self.config.dead_member_ttl = ttl;
        self
    }

    /// Checks the settings.
    pub fn build(self) -> Result<ClusterConfig, ClusterError> {
        let c = self.config;
        let invalid = |why: String| Err(ClusterError::InvalidConfig(why));
        if c.node_id.is_empty() || c.node_id.len() > 255 {
            return invalid(format!("node id {:?}: must be 1 to 255 bytes", c.node_id));
        }
        if c.secret.len() < MIN_SECRET_LEN {
            return invalid(format!("secret: at least {MIN_SECRET_LEN} bytes are needed"));
        }
        if c.gossip_addr.ip().is_unspecified() {
            return invalid(format!(
                "gossip address {}: give the IP peers reach this member at, not a wildcard",
                c.gossip_addr
            ));
        }
        if c.protocol_addr.ip().is_unspecified() || c.protocol_addr.port() == 0 {
            return invalid(format!(
                "protocol address {}: give the address clients reach the node at",
                c.protocol_addr
            ));
        }
        if c.gossip_interval < Duration::from_millis(10) || c.gossip_interval > MAX_INTERVAL {
            return invalid(format!(
                "gossip interval {:?}: must be between 10 ms and {MAX_INTERVAL:?}",
                c.gossip_interval
            ));
        }
        if !(c.phi_threshold.is_finite() && c.phi_threshold >= 1.0) {
            return invalid(format!("phi threshold {}: must be at least 1", c.phi_threshold));
        }
        if c.suspect_after < c.gossip_interval {
            return invalid(format!(
                "suspect after {:?}: must be at least the gossip interval",
                c.suspect_after
            ));
        }
        for seed in &c.seeds {
            if seed.rsplit_once(':').and_then(|(_, port)| port.parse::<u16>().ok()).is_none() {
                return invalid(format!("seed {seed:?}: not HOST:PORT"));
            }
        }
        Ok(c)
    }
}

/// The longest gossip interval accepted.
const MAX_INTERVAL: Duration = Duration::from_secs(10);

/// Milliseconds since the Unix epoch: grows from one start to the next, as long as the
/// clock is not set back by more than the time between two starts.
fn generation_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn builder() -> ClusterConfigBuilder {
        ClusterConfig::builder(
            "n1",
            "127.0.0.1:7400".parse().unwrap(),
            "127.0.0.1:7401".parse().unwrap(),
            b"0123456789abcdef".to_vec(),
        )
    }

    #[test]
    fn defaults_are_valid_and_suspicion_follows_the_interval() {
        let config = builder().build().unwrap();
        assert_eq!(config.gossip_interval, DEFAULT_GOSSIP_INTERVAL);
        assert_eq!(config.suspect_after, DEFAULT_GOSSIP_INTERVAL * 3);
        let config = builder().gossip_interval(Duration::from_millis(50)).build().unwrap();
        assert_eq!(config.suspect_after, Duration::from_millis(150));
        let config = builder()
            .suspect_after(Duration::from_secs(1))
            .gossip_interval(Duration::from_millis(50))
            .build()
            .unwrap();
        assert_eq!(config.suspect_after, Duration::from_secs(1));
    }

    #[test]
    fn bad_settings_are_refused_with_a_reason() {
        let err = |b: ClusterConfigBuilder| b.build().unwrap_err().to_string();
        let mut short = builder();
        short.config.secret = b"short".to_vec();
        assert!(err(short).contains("at least 16"));
        let mut wildcard = builder();
        wildcard.config.gossip_addr = "0.0.0.0:7401".parse().unwrap();
        assert!(err(wildcard).contains("wildcard"));
        assert!(err(builder().seeds(["localhost"])).contains("HOST:PORT"));
        assert!(err(builder().phi_threshold(f64::NAN)).contains("phi"));
        assert!(err(builder().gossip_interval(Duration::from_millis(1))).contains("interval"));
        assert!(builder().seeds(["node2.example:7401", "[::1]:7401"]).build().is_ok());
    }

    #[test]
    fn generations_grow() {
        let a = generation_now();
        std::thread::sleep(Duration::from_millis(2));
        assert!(generation_now() > a);
    }
}
