//! Prometheus metrics: counters the request path updates, gauges read from the engine at
//! scrape time, and the `/metrics` HTTP endpoint.
//!
//! The request path touches only pre-resolved handles (one per op), so counting a request
//! costs a few atomic adds and one histogram observation; label lookups happen for errors
//! only.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use fallow_cluster::{MemberEvent, MemberState};
use fallow_net::advance_counter;
use fallow_proto::fallow::{Op, Status};
use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::node::Node;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpStatus {
    op: &'static str,
    status: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OpLabel {
    op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PageResult {
    op: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Kind {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Outcome {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabel {
    event: &'static str,
}

type HistogramFamily = Family<OpLabel, Histogram, fn() -> Histogram>;

/// Handles for one op, resolved once.
#[derive(Debug, Clone)]
pub struct OpMetrics {
    ok: Counter,
    latency: Histogram,
}

/// What a page operation did, per page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageEvent {
    /// A get or take found the page.
    Hit,
    /// A get or take did not; for a put by hash, the content was not held.
    Miss,
    /// A put was stored.
    Stored,
    /// A put was refused (full or over quota).
    Refused,
}

/// Every metric of a node.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    per_op: Vec<(Op, OpMetrics)>,
    requests: Family<OpStatus, Counter>,
    page_handles: [[Counter; 4]; 4],
    /// Open connections.
    pub connections: Gauge,
    /// Connections accepted since start.
    pub connections_total: Counter,
    /// Connections closed because a newer connection of their client's session fenced them.
    pub fenced_connections: Counter,
    rejections: Family<Kind, Counter>,
    reloads: Family<Outcome, Counter>,
    engine: EngineGauges,
    cluster: ClusterGauges,
    forwarding: ForwardGauges,
    /// Forwarded requests running (peer forwarding, `forward.rs`).
    pub forwarded_in_flight: Gauge,
    /// Held while a scrape advances the counters, so that two scrapes at once do not both
    /// add the same difference.
    refresh: std::sync::Mutex<()>,
}

/// Peer forwarding: requests and pages of cluster pools, served through the cluster.
/// Label lookups per request are fine here: each such request waits on other nodes.
#[derive(Debug)]
struct ForwardGauges {
    requests: Family<OpStatus, Counter>,
    latency: HistogramFamily,
    pages: Family<PageResult, Counter>,
    pools: Gauge,
}

/// Read from the cluster member at scrape time; all zero when the node does not gossip.
#[derive(Debug, Default)]
struct ClusterGauges {
    members: Family<StateLabel, Gauge>,
    events: Family<EventLabel, Counter>,
    sent_datagrams: Counter,
    sent_bytes: Counter,
    received_bytes: Counter,
    rejected: Counter,
}

#[derive(Debug, Default)]
struct EngineGauges {
    lent: Gauge,
    mapped: Gauge,
    discarded: Gauge,
    used: Gauge,
    compressed_space: Gauge,
    pages: Gauge,
    dedup_saved: Gauge,
    compression_saved: Gauge,
    evictions: Gauge,
    corruptions: Counter,
    over_budget: Gauge,
    metadata: Gauge,
    small_share: Gauge<f64, AtomicU64>,
    summary_builds: Counter,
    summary_bytes: Gauge,
    clients: Gauge,
    pools: Gauge,
    host_available: Gauge,
    psi_some_avg10: Gauge<f64, AtomicU64>,
    budget_shrinks: Counter,
    budget_grows: Counter,
    journal_bytes: Gauge,
    journal_records: Counter,
    journal_failed_shards: Gauge,
    journal_compactions: Counter,
}

/// Registers each `(name, handle, help)` in `registry`, in the order given (the order of the
/// `/metrics` text). The registry keeps a clone of each handle, which shares its value with
/// the handle `Metrics` keeps. A macro rather than a loop over a table: the handles are of
/// several types, and one list keeps every metric's name, handle and help together.
macro_rules! register {
    ($registry:ident, $(($name:expr, $metric:expr, $help:expr)),+ $(,)?) => {
        $($registry.register($name, $help, $metric.clone());)+
    };
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let requests = Family::<OpStatus, Counter>::default();
        let latency: HistogramFamily = Family::new_with_constructor(|| {
            // 2 µs to about 1 s, doubling.
            Histogram::new(exponential_buckets(2e-6, 2.0, 20))
        });
        let pages = Family::<PageResult, Counter>::default();
        let connections = Gauge::default();
        let connections_total = Counter::default();
        let fenced_connections = Counter::default();
        let rejections = Family::<Kind, Counter>::default();
        let reloads = Family::<Outcome, Counter>::default();
        let engine = EngineGauges::default();
        let cluster = ClusterGauges::default();
        let forwarding = ForwardGauges {
            latency: Family::new_with_constructor(|| {
                // 20 µs to about 10 s, doubling: these requests cross the network.
                Histogram::new(exponential_buckets(2e-5, 2.0, 20))
            }),
            requests: Family::default(),
            pages: Family::default(),
            pools: Gauge::default(),
        };
        let forwarded_in_flight = Gauge::default();
        let mut registry = Registry::with_prefix("fallow_node");
        // Laid out by hand (rustfmt leaves `register! { }` alone): a name and its handle, then
        // the help under them.
        register! {
            registry,
            ("requests", requests,
             "Requests answered, by op and status"),
            ("request_duration_seconds", latency,
             "Time from a request's last byte read to its reply encoded, by op"),
            ("pages", pages,
             "Pages by op and result (hit, miss, stored, refused)"),
            ("connections", connections,
             "Open client connections"),
            ("connections_accepted", connections_total,
             "Connections accepted"),
            ("fenced_connections", fenced_connections,
             "Connections stopped by a newer connection of their client, which gave up on their requests"),
            ("protocol_errors", rejections,
             "Bad input and misbehaving peers, by kind (bad_frame, malformed, auth_failed, ...)"),
            ("config_reloads", reloads,
             "Config file reloads on SIGHUP, by result (applied, failed)"),
            ("lent_bytes", engine.lent,
             "The lent budget"),
            ("mapped_bytes", engine.mapped,
             "Bytes mapped for page frames"),
            ("discarded_bytes", engine.discarded,
             "Of the mapped bytes, free frames whose memory went back to the OS"),
            ("used_bytes", engine.used,
             "Bytes of frames holding pages"),
            ("compressed_space_bytes", engine.compressed_space,
             "Memory holding compressed pages (their slabs, holes included), counted against the lent budget"),
            ("stored_pages", engine.pages,
             "Logical pages stored"),
            ("dedup_saved_bytes", engine.dedup_saved,
             "Bytes saved by dedup and fill detection"),
            ("compression_saved_bytes", engine.compression_saved,
             "Bytes saved by compression"),
            ("live_pool_evictions", engine.evictions,
             "Evictions counted by pools that still exist"),
            ("checksum_failures", engine.corruptions,
             "Reads whose checksum failed (returned as misses)"),
            ("over_budget_bytes", engine.over_budget,
             "Persistent bytes a shrink could not shed"),
            ("metadata_bytes", engine.metadata,
             "Heap bytes of index and tables"),
            ("eviction_small_share_ratio", engine.small_share,
             "Small-queue share of the cache the eviction policy chose (1: LRU; 0: none)"),
            ("content_summary_builds", engine.summary_builds,
             "Content summaries built for clients"),
            ("content_summary_bytes", engine.summary_bytes,
             "Size of the last content summary"),
            ("clients", engine.clients,
             "Clients known (connected or within their lease)"),
            ("pools", engine.pools,
             "Pools held by clients"),
            ("host_available_bytes", engine.host_available,
             "The host's available memory at the last governor sample"),
            ("host_memory_pressure_some_avg10_ratio", engine.psi_some_avg10,
             "PSI memory 'some' avg10 at the last governor sample (0 to 1)"),
            ("budget_shrinks", engine.budget_shrinks,
             "Times the governor shrank the budget"),
            ("budget_grows", engine.budget_grows,
             "Times the governor grew the budget"),
            ("journal_bytes", engine.journal_bytes,
             "Bytes of the journal of persistent pages in --state-dir (memory of its tmpfs, outside the lent budget)"),
            ("journal_records", engine.journal_records,
             "Records appended to the journal of persistent pages"),
            ("journal_failed_shards", engine.journal_failed_shards,
             "Shards whose journal stopped after a failed write: their persistent pages would not survive a crash"),
            ("journal_compactions", engine.journal_compactions,
             "Journal files rewritten with only their live pages"),
            ("cluster_members", cluster.members,
             "Cluster members this node knows, by state (alive, suspect, dead), itself included"),
            ("cluster_member_events", cluster.events,
             "Membership changes seen, by event (joined, failed, left, ...)"),
            ("gossip_sent_datagrams", cluster.sent_datagrams,
             "Gossip datagrams sent"),
            ("gossip_sent_bytes", cluster.sent_bytes,
             "Gossip bytes sent (UDP payloads)"),
            ("gossip_received_bytes", cluster.received_bytes,
             "Authenticated gossip bytes received (UDP payloads)"),
            ("gossip_rejected_datagrams", cluster.rejected,
             "Gossip datagrams dropped: wrong tag (another secret, a stranger) or not understood"),
            ("forwarded_requests", forwarding.requests,
             "Requests on cluster pools forwarded to the cluster, by op and status"),
            ("forwarded_request_duration_seconds", forwarding.latency,
             "Time to serve a request forwarded to the cluster, by op"),
            ("forwarded_pages", forwarding.pages,
             "Pages of forwarded requests by op and result (hit, miss, stored, refused)"),
            ("cluster_pools", forwarding.pools,
             "Cluster pools this node serves for its clients (peer forwarding)"),
            ("forwarded_in_flight", forwarded_in_flight,
             "Forwarded requests running"),
        }
        // Every label from the start, at 0, so a dashboard sees the series before any change.
        for state in MemberState::ALL {
            let _ = cluster.members.get_or_create(&StateLabel { state: state.name() });
        }
        for event in MemberEvent::ALL {
            let _ = cluster.events.get_or_create(&EventLabel { event: event.name() });
        }
        let per_op = Op::ALL
            .into_iter()
            .map(|op| {
                let ok = requests.get_or_create(&OpStatus { op: op.name(), status: "ok" }).clone();
                let latency = latency.get_or_create(&OpLabel { op: op.name() }).clone();
                (op, OpMetrics { ok, latency })
            })
            .collect();
        let page_ops = ["get", "take", "put", "put_hashes"];
        let results = ["hit", "miss", "stored", "refused"];
        let page_handles = page_ops.map(|op| {
            results.map(|result| pages.get_or_create(&PageResult { op, result }).clone())
        });
        Self {
            registry,
            per_op,
            requests,
            page_handles,
            connections,
            connections_total,
            fenced_connections,
            rejections,
            reloads,
            engine,
            cluster,
            forwarding,
            forwarded_in_flight,
            refresh: std::sync::Mutex::new(()),
        }
    }

    /// The handles of `op`.
    #[expect(clippy::expect_used, reason = "`new` registers every op")]
    pub fn op(&self, op: Op) -> &OpMetrics {
        &self.per_op.iter().find(|(o, _)| *o == op).expect("every op is registered").1
    }

    /// Counts a request answered with `status`, which took `seconds`.
    pub fn request(&self, op: Op, status: Status, seconds: f64) {
        let handles = self.op(op);
        handles.latency.observe(seconds);
        if status == Status::Ok {
            handles.ok.inc();
        } else {
            self.requests.get_or_create(&OpStatus { op: op.name(), status: status.name() }).inc();
        }
    }

    /// Counts a forwarded request answered with `status`, which took `seconds`.
    pub fn forwarded(&self, op: Op, status: Status, seconds: f64) {
        let f = &self.forwarding;
        f.requests.get_or_create(&OpStatus { op: op.name(), status: status.name() }).inc();
        f.latency.get_or_create(&OpLabel { op: op.name() }).observe(seconds);
    }

    /// Counts `n` pages of a forwarded page op with result `event`.
    pub fn forwarded_pages(&self, op: Op, event: PageEvent, n: u64) {
        let result = match event {
            PageEvent::Hit => "hit",
            PageEvent::Miss => "miss",
            PageEvent::Stored => "stored",
            PageEvent::Refused => "refused",
        };
        self.forwarding.pages.get_or_create(&PageResult { op: op.name(), result }).inc_by(n);
    }

    /// Forwarded requests of `op` answered with `status` so far.
    pub fn forwarded_count(&self, op: Op, status: Status) -> u64 {
        let label = OpStatus { op: op.name(), status: status.name() };
        self.forwarding.requests.get_or_create(&label).get()
    }

    /// Counts `n` pages of a page op with result `event`.
    pub fn pages(&self, op: Op, event: PageEvent, n: u64) {
        let row = page_row(op).and_then(|row| self.page_handles.get(row));
        if let Some(counter) = row.and_then(|row| row.get(event as usize)) {
            counter.inc_by(n);
        }
    }

    /// Counts one instance of bad input or a misbehaving peer.
    pub fn reject(&self, kind: &'static str) {
        self.rejections.get_or_create(&Kind { kind }).inc();
    }

    /// Counts a config reload (SIGHUP) that was applied, or not.
    pub fn reloaded(&self, applied: bool) {
        let result = if applied { "applied" } else { "failed" };
        self.reloads.get_or_create(&Outcome { result }).inc();
    }

    /// How many rejections of `kind` were counted (for tests and `fallow stat`).
    pub fn rejections(&self, kind: &'static str) -> u64 {
        self.rejections.get_or_create(&Kind { kind }).get()
    }

    /// Pages counted with `event` for `op` so far.
    pub fn page_count(&self, op: Op, event: PageEvent) -> u64 {
        let row = page_row(op).and_then(|row| self.page_handles.get(row));
        row.and_then(|row| row.get(event as usize)).map_or(0, Counter::get)
    }

    /// Refreshes the engine's and the cluster's metrics and encodes everything in the
    /// Prometheus text format. What only grows is a counter, advanced to the source's own
    /// count.
    pub fn render(&self, node: &Node) -> String {
        let _one_at_a_time = self.refresh.lock().unwrap_or_else(|e| e.into_inner());
        let stats = node.engine().stats();
        let e = &self.engine;
        let set = |g: &Gauge, v: u64| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };

        set(&e.lent, stats.budget_bytes as u64);
        set(&e.mapped, stats.mapped_bytes as u64);
        set(&e.discarded, stats.discarded_bytes as u64);
        set(&e.used, (stats.frames_used * fallow_core::PAGE_SIZE) as u64);
        set(&e.compressed_space, stats.compressed_space_bytes as u64);
        set(&e.pages, stats.pages);
        set(&e.dedup_saved, stats.dedup_saved_bytes);
        set(&e.compression_saved, stats.compression_saved_bytes);
        set(&e.evictions, stats.pools.iter().map(|p| p.evictions).sum());
        advance_counter(&e.corruptions, stats.corruptions);
        set(&e.over_budget, (stats.over_budget_frames * fallow_core::PAGE_SIZE) as u64);
        set(&e.metadata, stats.metadata_bytes as u64);
        e.small_share.set(stats.small_share_percent.map_or(0.0, |p| f64::from(p) / 100.0));
        let (builds, bytes) = node.summaries().usage();
        advance_counter(&e.summary_builds, builds);
        set(&e.summary_bytes, bytes as u64);
        set(&e.clients, node.clients().len() as u64);
        set(&e.pools, node.clients().pool_count() as u64);
        set(&self.forwarding.pools, node.cluster_pool_count() as u64);
        let journal = node.engine().journal_stats();
        set(&e.journal_bytes, journal.bytes);
        advance_counter(&e.journal_records, journal.records);
        set(&e.journal_failed_shards, journal.failed_shards);
        advance_counter(&e.journal_compactions, journal.compactions);
        if let Some(lending) = node.lending_status() {
            set(&e.host_available, lending.host_available_bytes);
            e.psi_some_avg10.set(lending.psi_some_avg10 / 100.0);
            advance_counter(&e.budget_shrinks, lending.shrinks);
            advance_counter(&e.budget_grows, lending.grows);
        }
        if let Some(cluster) = node.cluster() {
            let members = cluster.members();
            for state in MemberState::ALL {
                let n = members.iter().filter(|m| m.state == state).count() as u64;
                set(&self.cluster.members.get_or_create(&StateLabel { state: state.name() }), n);
            }
            for event in MemberEvent::ALL {
                let label = EventLabel { event: event.name() };
                advance_counter(
                    &self.cluster.events.get_or_create(&label),
                    cluster.event_count(event),
                );
            }
            let traffic = cluster.traffic();
            advance_counter(&self.cluster.sent_datagrams, traffic.sent_datagrams);
            advance_counter(&self.cluster.sent_bytes, traffic.sent_bytes);
            advance_counter(&self.cluster.received_bytes, traffic.received_bytes);
            advance_counter(&self.cluster.rejected, traffic.rejected_datagrams);
        }
        let mut text = String::new();
        // Writing into a String cannot fail; were it to, the scrape would be empty.
        if encode(&mut text, &self.registry).is_err() {
            text.clear();
        }
        text
    }
}

/// The row of `Metrics::page_handles` for a page op (the order of `page_ops` in `new`).
fn page_row(op: Op) -> Option<usize> {
    match op {
        Op::Get => Some(0),
        Op::Take => Some(1),
        Op::Put => Some(2),
        Op::PutHashes => Some(3),
        _ => None,
    }
}

/// Serves `/metrics` on `addr` until `shutdown` is cancelled. Returns the bound address
/// (port 0 picks a free one).
pub async fn serve(
    node: Arc<Node>,
    addr: SocketAddr,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    fallow_net::serve_metrics(addr, shutdown, move || node.metrics().render(&node)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The registration list keeps each metric's name, type, help and labels: one of each
    /// kind (counter, gauge, float gauge, labelled families, histograms) from every group.
    #[test]
    fn every_group_is_registered() {
        let metrics = Metrics::new();
        let mut text = String::new();
        encode(&mut text, &metrics.registry).unwrap();
        for line in [
            "# TYPE fallow_node_requests counter",
            "fallow_node_requests_total{op=\"get\",status=\"ok\"} 0",
            "# TYPE fallow_node_request_duration_seconds histogram",
            "# TYPE fallow_node_connections_accepted counter",
            "fallow_node_fenced_connections_total 0",
            "# HELP fallow_node_lent_bytes The lent budget.",
            "# TYPE fallow_node_lent_bytes gauge",
            "# TYPE fallow_node_compressed_space_bytes gauge",
            "# TYPE fallow_node_discarded_bytes gauge",
            "# TYPE fallow_node_host_memory_pressure_some_avg10_ratio gauge",
            "fallow_node_host_memory_pressure_some_avg10_ratio 0.0",
            "# TYPE fallow_node_budget_grows counter",
            "fallow_node_budget_grows_total 0",
            "# TYPE fallow_node_checksum_failures counter",
            "# TYPE fallow_node_eviction_small_share_ratio gauge",
            "fallow_node_cluster_members{state=\"alive\"} 0",
            "fallow_node_cluster_member_events_total{event=\"failed\"} 0",
            "# TYPE fallow_node_gossip_rejected_datagrams counter",
            "# TYPE fallow_node_forwarded_request_duration_seconds histogram",
            "# TYPE fallow_node_forwarded_in_flight gauge",
            "# TYPE fallow_node_config_reloads counter",
            "# TYPE fallow_node_journal_bytes gauge",
            "fallow_node_journal_records_total 0",
            "# TYPE fallow_node_journal_failed_shards gauge",
            "# TYPE fallow_node_journal_compactions counter",
        ] {
            assert!(text.lines().any(|l| l == line), "no line {line:?} in\n{text}");
        }
        // Every metric once, none lost or doubled (a new metric raises this count).
        assert_eq!(text.matches("# TYPE ").count(), 44, "{text}");
    }
}
