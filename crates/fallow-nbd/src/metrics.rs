//! Prometheus metrics of the NBD server: requests and latency by command, connections, and
//! each export's cache (size, hits per tier, backing-store reads and their time, local tier
//! and pool use, pool errors, dirty data), read from the cache counters at scrape time; and
//! the memory of a pool held in this process, when the caller has said how to read it
//! ([`NbdMetrics::watch_pool_memory`]). `fallow stat --nbd` reads these names;
//! `docs/metrics.md` lists them all. What only grows is a counter (`_total`), advanced at
//! each scrape to the cache's own count.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, OnceLock};

use fallow_cache::WritePolicy;
use fallow_net::{advance_counter, advance_seconds};

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
struct ReasonLabel {
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ExportLabel {
    export: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PoolLabel {
    pool: &'static str,
}

/// The memory of a pool held in this process (an engine), as the metrics report it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolMemory {
    /// Bytes held for pages (page frames and compressed copies).
    pub used_bytes: u64,
    /// Bytes the pool may hold: its budget, the memory this host lends it.
    pub lent_bytes: u64,
    /// Pages the pool holds (each 4 KiB to its users): with `used_bytes`, how much the
    /// pool holds per byte of memory once dedup and compression have had their say.
    pub pages: u64,
}

/// Reads a [`PoolMemory`] at scrape time.
type PoolMemorySource = Box<dyn Fn() -> PoolMemory + Send + Sync>;

/// Set at most once, by [`NbdMetrics::watch_pool_memory`].
#[derive(Default)]
struct PoolWatch(OnceLock<PoolMemorySource>);

impl std::fmt::Debug for PoolWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.get().is_some() { "PoolWatch(set)" } else { "PoolWatch(unset)" })
    }
}

type HistogramFamily = Family<CmdLabel, Histogram, fn() -> Histogram>;

/// The series of one command and result ([`NbdMetrics::request_series`]).
#[derive(Debug, Clone)]
pub struct RequestSeries {
    requests: Counter,
    latency: Histogram,
    bytes: Option<Counter>,
}

impl RequestSeries {
    /// Counts one answered request, as [`NbdMetrics::request`] does.
    pub fn record(&self, seconds: f64, bytes: u64) {
        self.requests.inc();
        self.latency.observe(seconds);
        if let (Some(counter), true) = (&self.bytes, bytes > 0) {
            counter.inc_by(bytes);
        }
    }
}

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
    negotiation_failures: Family<ReasonLabel, Counter>,
    pages: Family<ExportTier, Counter>,
    backing_reads: Family<ExportLabel, Counter>,
    backing_read_seconds: Family<ExportLabel, Counter<f64, AtomicU64>>,
    pool_errors: Family<ExportLabel, Counter>,
    pool_trusted: Family<ExportLabel, Gauge>,
    dirty_bytes: Family<ExportLabel, Gauge>,
    dirty_oldest_age: Family<ExportLabel, Gauge<f64, AtomicU64>>,
    dirty_limit_bytes: Family<ExportLabel, Gauge>,
    dirty_age_limit: Family<ExportLabel, Gauge<f64, AtomicU64>>,
    written_back: Family<ExportLabel, Counter>,
    write_back_errors: Family<ExportLabel, Counter>,
    export_size: Family<ExportLabel, Gauge>,
    local_tier_pages: Family<ExportLabel, Gauge>,
    pool_puts: Family<ExportLabel, Counter>,
    /// Only a pool in this process has its memory reported; these stay without samples
    /// until [`NbdMetrics::watch_pool_memory`] is called.
    pool_used_bytes: Family<PoolLabel, Gauge>,
    pool_lent_bytes: Family<PoolLabel, Gauge>,
    pool_pages: Family<PoolLabel, Gauge>,
    pool_watch: PoolWatch,
    /// Held while a scrape advances the counters, so that two scrapes at once do not both
    /// add the same difference.
    refresh: Mutex<()>,
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
        let negotiation_failures = Family::<ReasonLabel, Counter>::default();
        registry.register(
            "negotiation_failures",
            "Negotiations that ended without a session, by reason (tls_required: a client \
             without TLS where TLS is required; tls_handshake: the TLS handshake failed; \
             protocol, io, ended)",
            negotiation_failures.clone(),
        );
        let pages = Family::<ExportTier, Counter>::default();
        registry.register(
            "cache_pages_read",
            "Pages read, by export and the tier that had them (dirty, local, pool, backing)",
            pages.clone(),
        );
        let backing_reads = Family::<ExportLabel, Counter>::default();
        registry.register(
            "backing_reads",
            "Reads sent to the backing store",
            backing_reads.clone(),
        );
        let backing_read_seconds = Family::default();
        registry.register(
            "backing_read_seconds",
            "Seconds spent in backing-store reads",
            backing_read_seconds.clone(),
        );
        let pool_errors = Family::<ExportLabel, Counter>::default();
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
        let dirty_oldest_age = Family::<ExportLabel, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "dirty_oldest_age_seconds",
            "How long the oldest dirty page has waited for the backing store (0 when none)",
            dirty_oldest_age.clone(),
        );
        let dirty_limit_bytes = Family::<ExportLabel, Gauge>::default();
        registry.register(
            "dirty_limit_bytes",
            "Write-back: the most dirty bytes before writes wait (--max-dirty)",
            dirty_limit_bytes.clone(),
        );
        let dirty_age_limit = Family::<ExportLabel, Gauge<f64, AtomicU64>>::default();
        registry.register(
            "dirty_age_limit_seconds",
            "Write-back: the age at which the flusher writes a dirty page (--max-dirty-age)",
            dirty_age_limit.clone(),
        );
        let write_back_errors = Family::<ExportLabel, Counter>::default();
        registry.register(
            "write_back_errors",
            "Write-back writes the backing store failed (the pages stay dirty and are retried)",
            write_back_errors.clone(),
        );
        let written_back = Family::<ExportLabel, Counter>::default();
        registry.register(
            "written_back_pages",
            "Dirty pages written to the backing store",
            written_back.clone(),
        );
        let export_size = Family::<ExportLabel, Gauge>::default();
        registry.register("export_size_bytes", "Size of the export", export_size.clone());
        let local_tier_pages = Family::<ExportLabel, Gauge>::default();
        registry.register(
            "local_tier_pages",
            "Pages held in the export's local tier (this process)",
            local_tier_pages.clone(),
        );
        let pool_puts = Family::<ExportLabel, Counter>::default();
        registry.register(
            "pool_put_pages",
            "Pages put into the pool (populates and demotions)",
            pool_puts.clone(),
        );
        let pool_used_bytes = Family::<PoolLabel, Gauge>::default();
        registry.register(
            "pool_used_bytes",
            "Memory held for pages by the pool in this process (fallow up, --pool local:SIZE)",
            pool_used_bytes.clone(),
        );
        let pool_lent_bytes = Family::<PoolLabel, Gauge>::default();
        registry.register(
            "pool_lent_bytes",
            "Memory lent to the pool in this process: its budget",
            pool_lent_bytes.clone(),
        );
        let pool_pages = Family::<PoolLabel, Gauge>::default();
        registry.register(
            "pool_pages",
            "Pages the pool in this process holds, each 4 KiB to its users",
            pool_pages.clone(),
        );
        Self {
            registry,
            requests,
            latency,
            bytes,
            connections,
            connections_total,
            negotiation_failures,
            pages,
            backing_reads,
            backing_read_seconds,
            pool_errors,
            pool_trusted,
            dirty_bytes,
            dirty_oldest_age,
            dirty_limit_bytes,
            dirty_age_limit,
            written_back,
            write_back_errors,
            export_size,
            local_tier_pages,
            pool_puts,
            pool_used_bytes,
            pool_lent_bytes,
            pool_pages,
            pool_watch: PoolWatch::default(),
            refresh: Mutex::new(()),
        }
    }

    /// Reports the memory of the pool in this process, read by `source` at every scrape
    /// (as `fallow_nbd_pool_used_bytes` and `fallow_nbd_pool_lent_bytes`). The first call
    /// sets it; later ones are ignored. A pool on other hosts is not reported here: its
    /// nodes have their own metrics and `fallow stat --node`.
    pub fn watch_pool_memory(&self, source: impl Fn() -> PoolMemory + Send + Sync + 'static) {
        let _ = self.pool_watch.0.set(Box::new(source));
    }

    /// Counts a negotiation that ended without a session.
    pub fn negotiation_failed(&self, err: &crate::handshake::HandshakeError) {
        self.negotiation_failures.get_or_create(&ReasonLabel { reason: err.reason() }).inc();
    }

    /// Counts one answered request.
    pub fn request(&self, cmd: &'static str, result: &'static str, seconds: f64, bytes: u64) {
        self.requests.get_or_create(&CmdResult { cmd, result }).inc();
        self.latency.get_or_create(&CmdLabel { cmd }).observe(seconds);
        if bytes > 0 {
            self.bytes.get_or_create(&CmdLabel { cmd }).inc_by(bytes);
        }
    }

    /// The series [`request`](Self::request) updates for `cmd` and `result`, for a caller
    /// to keep: looking them up hashes the labels under a lock, about 1,000 instructions a
    /// request. `with_bytes`: also the byte counter (created only where bytes are counted).
    pub fn request_series(
        &self,
        cmd: &'static str,
        result: &'static str,
        with_bytes: bool,
    ) -> RequestSeries {
        RequestSeries {
            requests: self.requests.get_or_create(&CmdResult { cmd, result }).clone(),
            latency: self.latency.get_or_create(&CmdLabel { cmd }).clone(),
            bytes: with_bytes.then(|| self.bytes.get_or_create(&CmdLabel { cmd }).clone()),
        }
    }

    /// Refreshes the export metrics and encodes everything in the Prometheus text format.
    pub fn render(&self, exports: &[Arc<Export>]) -> String {
        let _one_at_a_time = self.refresh.lock().unwrap_or_else(|e| e.into_inner());
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
                advance_counter(
                    &self.pages.get_or_create(&ExportTier { export: name.clone(), tier }),
                    v.load(Relaxed),
                );
            }
            let label = ExportLabel { export: name };
            advance_counter(
                &self.backing_reads.get_or_create(&label),
                s.backing_reads.load(Relaxed),
            );
            advance_seconds(
                &self.backing_read_seconds.get_or_create(&label),
                s.backing_read_micros.load(Relaxed) as f64 / 1e6,
            );
            advance_counter(&self.pool_errors.get_or_create(&label), s.pool_errors.load(Relaxed));
            set(&self.pool_trusted.get_or_create(&label), export.cache.pool_trusted() as u64);
            set(&self.dirty_bytes.get_or_create(&label), export.cache.dirty_bytes());
            if let WritePolicy::Back { max_dirty_bytes, max_age } = export.cache.write_policy() {
                let age = export.cache.dirty_oldest_age().unwrap_or_default();
                self.dirty_oldest_age.get_or_create(&label).set(age.as_secs_f64());
                set(&self.dirty_limit_bytes.get_or_create(&label), max_dirty_bytes);
                self.dirty_age_limit.get_or_create(&label).set(max_age.as_secs_f64());
                advance_counter(
                    &self.write_back_errors.get_or_create(&label),
                    s.write_back_errors.load(Relaxed),
                );
            }
            advance_counter(&self.written_back.get_or_create(&label), s.written_back.load(Relaxed));
            set(&self.export_size.get_or_create(&label), export.size());
            set(&self.local_tier_pages.get_or_create(&label), export.cache.local_pages() as u64);
            advance_counter(&self.pool_puts.get_or_create(&label), s.pool_puts.load(Relaxed));
        }
        if let Some(source) = self.pool_watch.0.get() {
            let memory = source();
            let label = PoolLabel { pool: "in-process" };
            set(&self.pool_used_bytes.get_or_create(&label), memory.used_bytes);
            set(&self.pool_lent_bytes.get_or_create(&label), memory.lent_bytes);
            set(&self.pool_pages.get_or_create(&label), memory.pages);
        }
        let mut text = String::new();
        // Writing into a String cannot fail; were it to, the scrape would be empty.
        if encode(&mut text, &self.registry).is_err() {
            text.clear();
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fallow_backing::MemStore;
    use fallow_cache::{CacheConfig, CacheLayer};

    #[test]
    fn export_size_always_pool_memory_only_once_watched() {
        let cache = CacheLayer::new(Arc::new(MemStore::new(1 << 20)), None, CacheConfig::default());
        let export =
            Export { name: "e".into(), description: String::new(), cache, read_only: false };
        let exports = [Arc::new(export)];
        let metrics = NbdMetrics::new();
        let text = metrics.render(&exports);
        assert!(text.contains("fallow_nbd_export_size_bytes{export=\"e\"} 1048576\n"), "{text}");
        assert!(text.contains("fallow_nbd_local_tier_pages{export=\"e\"} 0\n"), "{text}");
        assert!(!text.contains("fallow_nbd_pool_used_bytes{"), "{text}");
        metrics.watch_pool_memory(|| PoolMemory { used_bytes: 3, lent_bytes: 5, pages: 7 });
        metrics.watch_pool_memory(PoolMemory::default); // ignored: the first one stays
        let text = metrics.render(&exports);
        assert!(text.contains("fallow_nbd_pool_used_bytes{pool=\"in-process\"} 3\n"), "{text}");
        assert!(text.contains("fallow_nbd_pool_lent_bytes{pool=\"in-process\"} 5\n"), "{text}");
        assert!(text.contains("fallow_nbd_pool_pages{pool=\"in-process\"} 7\n"), "{text}");
    }
}
