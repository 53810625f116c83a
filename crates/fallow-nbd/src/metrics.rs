//! Prometheus metrics of the NBD server: requests and latency by command, connections, and
//! each export's cache (hits per tier, backing-store reads and their time, pool errors,
//! dirty data), read from the cache counters at scrape time.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::export::Export;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CmdResult {
    cmd: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CmdLabel {
    cmd: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExportTier {
    export: String,
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExportLabel {
    export: String,
}

type HistogramFamily = Family<CmdLabel, Histogram, fn() -> Histogram>;

/// The NBD server's metrics.
#[derive(Debug)]
pub struct NbdMetrics {
    registry: Registry,
    requests: Family<CmdResult, Counter>,
    latency: HistogramFamily,
    bytes: Family<CmdLabel, Counter>,
    /// Open NBD connections.
    pub connections: Gauge,
    /// Connections accepted.
    pub connections_total: Counter,
    pages: Family<ExportTier, Gauge>,
    backing_reads: Family<ExportLabel, Gauge>,
    backing_read_seconds: Family<
        ExportLabel,
        prometheus_client::metrics::gauge::Gauge<f64, std::sync::atomic::AtomicU64>,
    >,
    pool_errors: Family<ExportLabel, Gauge>,
    pool_trusted: Family<ExportLabel, Gauge>,
    dirty_bytes: Family<ExportLabel, Gauge>,
    written_back: Family<ExportLabel, Gauge>,
}

impl Default for NbdMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl NbdMetrics {
    /// Registers every metric.
    pub fn new() -> Self {
        let mut registry = Registry::with_prefix("fallow_nbd");
        let requests = Family::<CmdResult, Counter>::default();
        registry.register(
            "requests",
            "NBD requests answered, by command and result (ok, error, refused)",
            requests.clone(),
        );
        let latency: HistogramFamily =
            Family::new_with_constructor(|| Histogram::new(exponential_buckets(4e-6, 2.0, 22)));
        registry.register(
            "request_duration_seconds",
            "Time from a request read to its reply queued, by command",
            latency.clone(),
        );
        let bytes = Family::<CmdLabel, Counter>::default();
        registry.register("bytes", "Bytes read and written by clients", bytes.clone());
        let connections = Gauge::default();
        registry.register("connections", "Open NBD connections", connections.clone());
        let connections_total = Counter::default();
        registry.register(
            "connections_accepted",
            "NBD connections accepted",
            connections_total.clone(),
        );
        let pages = Family::<ExportTier, Gauge>::default();
        registry.register(
            "cache_pages_read",
            "Pages read, by export and the tier that had them (dirty, local, pool, backing)",
            pages.clone(),
        );
        let backing_reads = Family::<ExportLabel, Gauge>::default();
        registry.register(
            "backing_reads",
            "Reads sent to the backing store",
            backing_reads.clone(),
        );
        let backing_read_seconds = Family::default();
        registry.register(
            "backing_read_seconds",
            "Time spent in backing-store reads",
            backing_read_seconds.clone(),
        );
        let pool_errors = Family::<ExportLabel, Gauge>::default();
        registry.register(
            "pool_errors",
            "Pool operations that failed (treated as misses or skipped)",
            pool_errors.clone(),
        );
        let pool_trusted = Family::<ExportLabel, Gauge>::default();
        registry.register(
            "pool_trusted",
            "1 while the pool is used; 0 after a failed invalidation until it is cleared",
            pool_trusted.clone(),
        );
        let dirty_bytes = Family::<ExportLabel, Gauge>::default();
        registry.register(
            "dirty_bytes",
            "Bytes acknowledged but not yet in the backing store (write-back)",
            dirty_bytes.clone(),
        );
        let written_back = Family::<ExportLabel, Gauge>::default();
        registry.register(
            "written_back_pages",
            "Dirty pages written to the backing store",
            written_back.clone(),
        );
        Self {
            registry,
            requests,
            latency,
            bytes,
            connections,
            connections_total,
            pages,
            backing_reads,
            backing_read_seconds,
            pool_errors,
            pool_trusted,
            dirty_bytes,
            written_back,
        }
    }

    /// Counts one answered request.
    pub fn request(&self, cmd: &'static str, result: &'static str, seconds: f64, bytes: u64) {
        self.requests.get_or_create(&CmdResult { cmd, result }).inc();
        self.latency.get_or_create(&CmdLabel { cmd }).observe(seconds);
        if bytes > 0 {
            self.bytes.get_or_create(&CmdLabel { cmd }).inc_by(bytes);
        }
    }

    /// Refreshes the export gauges and encodes everything in the Prometheus text format.
    pub fn render(&self, exports: &[Arc<Export>]) -> String {
        let set = |g: &Gauge, v: u64| {
            g.set(i64::try_from(v).unwrap_or(i64::MAX));
        };
        for export in exports {
            let s = export.cache.stats();
            let name = export.name.clone();
            for (tier, v) in [
                ("dirty", &s.dirty_hits),
                ("local", &s.local_hits),
                ("pool", &s.pool_hits),
                ("backing", &s.misses),
            ] {
                set(
                    &self.pages.get_or_create(&ExportTier { export: name.clone(), tier }),
                    v.load(Relaxed),
                );
            }
            let label = ExportLabel { export: name };
            set(&self.backing_reads.get_or_create(&label), s.backing_reads.load(Relaxed));
            self.backing_read_seconds
                .get_or_create(&label)
                .set(s.backing_read_micros.load(Relaxed) as f64 / 1e6);
            set(&self.pool_errors.get_or_create(&label), s.pool_errors.load(Relaxed));
            set(&self.pool_trusted.get_or_create(&label), export.cache.pool_trusted() as u64);
            set(&self.dirty_bytes.get_or_create(&label), export.cache.dirty_bytes());
            set(&self.written_back.get_or_create(&label), s.written_back.load(Relaxed));
        }
        let mut text = String::new();
        encode(&mut text, &self.registry).expect("encoding into a String");
        text
    }
}
