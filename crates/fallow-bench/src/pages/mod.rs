//! `fallow bench pages`: the same 4 KiB page load against a fallow node or a memcached
//! server, so the two can be compared side by side in one run (DESIGN.md, "Targets").
//!
//! # The load
//!
//! `connections` TCP connections; each keeps up to `queue_depth` requests in flight, and
//! each request carries `batch` pages: a fallow `get_many`/`put_many` (or a single
//! `get`/`put` when `batch` is 1), a memcached multi-get of `batch` keys or `batch`
//! pipelined `set`s. A request is a get or a put ([`Workload`]); its keys are drawn from
//! `0..keys` ([`KeyDist`]); a put's pages are unique or drawn from a few identical contents
//! ([`ValueMode`]), the latter so that fallow's dedup engages. Latency is measured per
//! request, from the moment it is written until its last reply byte is parsed.
//!
//! An optional warm-up first puts every key once (not measured), so that gets hit.
//! An optional rate bounds the requests per second (fallow targets): each loop then waits
//! for its next slot instead of sending as soon as its last request is answered.
//!
//! # A cluster of nodes
//!
//! `cluster://A,B,C` (or `fallow://A,B,C`, any list with a comma) drives the same load
//! through [`fallow_client::ClusterClient`]: pages spread over the nodes, a dead node's
//! pages are misses. The report then adds [`ClusterReport`]: each node's capacity and
//! this client's pages there, the summary's size and the process RSS after connecting,
//! after the warm-up and at the end, and every change of a node's state as the client saw
//! it, timestamped, to line up with a node killed mid-run. A failed request is counted
//! (`errors`) and the run goes on, so that a fault shows as a number, not an abort.
//!
//! # Components
//!
//! [`keys`]: key ids, uniform or Zipf. [`memcached`]: a strict text-protocol codec and a
//! pipelining connection. `fallow`: the same through `fallow_client` (one node or a
//! cluster). `cluster`: what a cluster run adds to the report. [`report`]: the
//! latency histogram and the final figures. The driver (private) runs the phases on a tokio
//! runtime and ticks the progress callback once a second.
//!
//! The load generator shares the machine with the server under test: on a 2-core host
//! both compete for the same CPUs, which the report states (`host_cpus`,
//! `client_threads`).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

mod cluster;
mod driver;
mod fallow;
pub mod keys;
pub mod memcached;
pub mod report;
mod workload;

pub use cluster::{ClusterReport, ClusterSnapshot, NodeEvent, NodeReport};
pub use driver::{run, Phase, Tick};
pub use keys::{KeyDist, KeyGen};
pub use report::{Latency, PagesReport, TimedRequest};
pub use workload::{ValueMode, Workload};

/// The server under test, from `fallow://ADDR`, `cluster://ADDR,...` (or `fallow://` with
/// a list) or `memcached://ADDR`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A fallow node: `HOST:PORT` or `unix:/path`.
    Fallow {
        /// Where the node listens.
        addr: String,
    },
    /// A memcached server speaking the text protocol: `HOST:PORT`.
    Memcached {
        /// Where memcached listens.
        addr: String,
    },
    /// A cluster of fallow nodes, driven through the cluster client.
    Cluster {
        /// Seed nodes, `A,B,C`: each `HOST:PORT` or `unix:/path`.
        seeds: String,
    },
}

impl Target {
    /// `fallow`, `fallow-cluster` or `memcached`.
    pub fn kind(&self) -> &'static str {
        match self {
            Target::Fallow { .. } => "fallow",
            Target::Cluster { .. } => "fallow-cluster",
            Target::Memcached { .. } => "memcached",
        }
    }

    /// Whether the target is fallow (one node or a cluster).
    pub fn is_fallow(&self) -> bool {
        !matches!(self, Target::Memcached { .. })
    }
}

impl FromStr for Target {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (scheme, addr) = s.split_once("://").ok_or_else(|| {
            format!("expected fallow://ADDR, cluster://ADDR,... or memcached://ADDR, not {s:?}")
        })?;
        if addr.is_empty() {
            return Err(format!("{s:?} names no address"));
        }
        let addr = addr.to_string();
        match scheme {
            "fallow" if addr.contains(',') => Ok(Target::Cluster { seeds: addr }),
            "fallow" => Ok(Target::Fallow { addr }),
            "cluster" => Ok(Target::Cluster { seeds: addr }),
            "memcached" => Ok(Target::Memcached { addr }),
            _ => Err(format!("unknown scheme {scheme:?}: expected fallow, cluster or memcached")),
        }
    }
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Fallow { addr } => write!(f, "fallow://{addr}"),
            Target::Memcached { addr } => write!(f, "memcached://{addr}"),
            Target::Cluster { seeds } => write!(f, "cluster://{seeds}"),
        }
    }
}

/// Everything a run needs. [`PagesOptions::new`] gives the defaults; [`run`] validates.
#[derive(Debug, Clone)]
pub struct PagesOptions {
    /// The server under test.
    pub target: Target,
    /// The cluster secret for a fallow target (ignored by memcached).
    pub secret: Vec<u8>,
    /// TLS to the nodes of a fallow target (`--node-tls`).
    pub tls: Option<fallow_tls::TlsClient>,
    /// Gets, puts or a mix.
    pub workload: Workload,
    /// The key space: ids `0..keys`.
    pub keys: u64,
    /// How keys are drawn.
    pub dist: KeyDist,
    /// What a put stores.
    pub value: ValueMode,
    /// TCP connections to the server.
    pub connections: usize,
    /// Requests in flight per connection.
    pub queue_depth: usize,
    /// Pages per request.
    pub batch: usize,
    /// Worker threads of the load generator's runtime (1: a current-thread runtime).
    pub threads: usize,
    /// How long the measured phase issues requests.
    pub duration: Duration,
    /// Put every key once before measuring, so that gets hit.
    pub warmup: bool,
    /// Fallow only: create the pool with dedup on (trust domain 0) or off.
    pub dedup: bool,
    /// Fallow only: create a persistent pool instead of an ephemeral one (its pages are
    /// never evicted, and a node with `--state-dir` journals them).
    pub persistent: bool,
    /// Seed of every random choice (keys, mix, page contents).
    pub seed: u64,
    /// Keep every measured request's start and latency in [`PagesReport::timeline`]
    /// (about 32 bytes per request).
    pub timeline: bool,
    /// At most this many requests per second over all loops of the measured phase
    /// (fallow targets only; `None`: as fast as replies come).
    pub rate: Option<f64>,
    /// A local server's process: its CPU time over the measured phase goes into the report
    /// ([`PagesReport::server_cpu`]).
    pub server_pid: Option<u32>,
}

impl PagesOptions {
    /// The defaults: gets, 65,536 uniform keys, unique pages, 1 connection at queue depth
    /// 1, batch 1, 1 thread, 5 s, no warm-up, dedup on.
    pub fn new(target: Target) -> Self {
        Self {
            target,
            secret: Vec::new(),
            tls: None,
            workload: Workload::Get,
            keys: 65_536,
            dist: KeyDist::Uniform,
            value: ValueMode::Random,
            connections: 1,
            queue_depth: 1,
            batch: 1,
            threads: 1,
            duration: Duration::from_secs(5),
            warmup: false,
            dedup: true,
            persistent: false,
            seed: 1,
            timeline: false,
            rate: None,
            server_pid: None,
        }
    }

    fn validate(&self) -> Result<(), PagesError> {
        let bad = |what: String| Err(PagesError::Options(what));
        if let Some(pid) = self.server_pid {
            // Before connecting: a wrong PID is refused at once, not after the run.
            report::process_cpu_seconds(pid)
                .map_err(|e| PagesError::Options(format!("server PID: {e}")))?;
        }
        if self.connections == 0 || self.connections > MAX_CONNECTIONS {
            return bad(format!("connections must be 1 to {MAX_CONNECTIONS}"));
        }
        if self.queue_depth == 0 || self.queue_depth > MAX_QUEUE_DEPTH {
            return bad(format!("queue depth must be 1 to {MAX_QUEUE_DEPTH}"));
        }
        if self.connections * self.queue_depth > MAX_IN_FLIGHT {
            return bad(format!("connections x queue depth must be at most {MAX_IN_FLIGHT}"));
        }
        if self.batch == 0 || self.batch > MAX_BATCH {
            return bad(format!("batch must be 1 to {MAX_BATCH} pages"));
        }
        if self.threads == 0 || self.threads > 64 {
            return bad("threads must be 1 to 64".into());
        }
        if self.duration.is_zero() {
            return bad("the duration must be above zero".into());
        }
        if self.target.is_fallow() && self.secret.is_empty() {
            return bad("a fallow target needs the cluster secret (--secret-file)".into());
        }
        match self.rate {
            Some(_) if !self.target.is_fallow() => {
                return bad("a rate applies to fallow targets only".into())
            }
            Some(rate) if !(rate.is_finite() && rate > 0.0) => {
                return bad(format!("the rate must be above zero, not {rate}"))
            }
            _ => {}
        }
        KeyGen::new(self.keys, self.dist).map(drop).map_err(PagesError::Options)
    }
}

/// Upper bounds on the shape of the load: enough for any benchmark on one host, and low
/// enough that a typo cannot open thousands of sockets.
pub const MAX_CONNECTIONS: usize = 256;
/// See [`MAX_CONNECTIONS`].
pub const MAX_QUEUE_DEPTH: usize = 1024;
/// The most requests in flight over all connections (each has its own latency histogram
/// on the fallow side).
pub const MAX_IN_FLIGHT: usize = 4096;
/// The largest batch: fallow's largest frame carries 256 pages.
pub const MAX_BATCH: usize = 256;

/// What can stop a run.
#[derive(Debug, thiserror::Error)]
pub enum PagesError {
    /// An option is out of range or missing.
    #[error("{0}")]
    Options(String),
    /// The server could not be reached.
    #[error("cannot connect to {target}: {source}")]
    Connect {
        /// The target URL.
        target: String,
        /// Why.
        source: std::io::Error,
    },
    /// A socket failed mid-run (or the runtime could not start).
    #[error("i/o: {0}")]
    Io(#[from] std::io::Error),
    /// memcached sent something this client does not accept.
    #[error("memcached: {0}")]
    Memcached(#[from] memcached::ProtocolError),
    /// The fallow client failed.
    #[error("fallow: {0}")]
    Fallow(String),
    /// In-flight requests were not answered in time.
    #[error("no reply within {0:?}")]
    Stalled(Duration),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_parse_and_print() {
        let mc: Target = "memcached://127.0.0.1:11211".parse().unwrap();
        assert_eq!(mc, Target::Memcached { addr: "127.0.0.1:11211".into() });
        assert_eq!(mc.to_string(), "memcached://127.0.0.1:11211");
        let node: Target = "fallow://unix:/run/f.sock".parse().unwrap();
        assert_eq!(node, Target::Fallow { addr: "unix:/run/f.sock".into() });
        assert_eq!(node.kind(), "fallow");
        let cluster: Target = "fallow://h:1,h:2".parse().unwrap();
        assert_eq!(cluster, Target::Cluster { seeds: "h:1,h:2".into() });
        assert_eq!(cluster.to_string(), "cluster://h:1,h:2");
        let one: Target = "cluster://h:1".parse().unwrap();
        assert_eq!(one, Target::Cluster { seeds: "h:1".into() });
        assert_eq!(one.kind(), "fallow-cluster");
        assert!(one.is_fallow() && !mc.is_fallow());
        for bad in ["127.0.0.1:1", "redis://h:1", "fallow://", "cluster://", ""] {
            assert!(bad.parse::<Target>().is_err(), "{bad:?} parsed");
        }
    }

    #[test]
    fn options_are_validated() {
        let ok = PagesOptions::new(Target::Memcached { addr: "h:1".into() });
        assert!(ok.validate().is_ok());
        let broken: [fn(&mut PagesOptions); 9] = [
            |o| o.connections = 0,
            |o| o.queue_depth = MAX_QUEUE_DEPTH + 1,
            |o| (o.connections, o.queue_depth) = (MAX_CONNECTIONS, MAX_QUEUE_DEPTH),
            |o| o.batch = MAX_BATCH + 1,
            |o| o.duration = Duration::ZERO,
            |o| o.keys = 0,
            |o| o.target = Target::Fallow { addr: "h:1".into() },
            |o| o.rate = Some(100.0),
            |o| {
                (o.target, o.secret, o.rate) =
                    (Target::Cluster { seeds: "h:1".into() }, b"s".to_vec(), Some(0.0))
            },
        ];
        for (i, breaks) in broken.iter().enumerate() {
            let mut o = ok.clone();
            breaks(&mut o);
            assert!(matches!(o.validate(), Err(PagesError::Options(_))), "case {i}");
        }
    }
}
