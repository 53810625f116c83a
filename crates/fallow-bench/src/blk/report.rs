//! What a `fallow bench blk` run measured: completions and their latency in an HDR
//! histogram (`Stats`), then one [`BlkReport`] that prints as text or serialises as the
//! JSON object the benchmark scripts read.

use std::fmt;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// The longest latency the histogram tells apart (60 s, in ns); longer ones count as this.
const MAX_LATENCY_NS: u64 = 60_000_000_000;

/// One load loop's measurements.
#[derive(Debug)]
pub(crate) struct Stats {
    /// Latencies of requests that completed OK, in ns, 3 significant digits.
    hist: Histogram<u64>,
    /// Requests that completed with another status (or failed, over NBD).
    pub(crate) errors: u64,
    /// The first of those.
    pub(crate) first_error: Option<String>,
}

impl Stats {
    pub(crate) fn new() -> Stats {
        #[expect(clippy::expect_used, reason = "constant bounds the crate accepts")]
        let hist =
            Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3).expect("valid histogram bounds");
        Stats { hist, errors: 0, first_error: None }
    }

    /// A request that completed OK after `latency`.
    pub(crate) fn ok(&mut self, latency: Duration) {
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX);
        self.hist.saturating_record(ns.clamp(1, MAX_LATENCY_NS));
    }

    /// A request that did not complete OK.
    pub(crate) fn error(&mut self, what: impl FnOnce() -> String) {
        self.errors += 1;
        if self.first_error.is_none() {
            self.first_error = Some(what());
        }
    }

    /// Requests that completed OK.
    pub(crate) fn ops(&self) -> u64 {
        self.hist.len()
    }

    /// Adds `other`'s measurements.
    pub(crate) fn merge(&mut self, other: &Stats) {
        // Same bounds on both sides, so `add` cannot fail; if it did, only latencies are lost.
        let _ = self.hist.add(&other.hist);
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error.clone_from(&other.first_error);
        }
    }

    /// The latency summary, in µs (all 0 when nothing completed).
    pub(crate) fn latency(&self) -> LatencyUs {
        let h = &self.hist;
        let us = |ns: u64| ns as f64 / 1000.0;
        if h.is_empty() {
            return LatencyUs::default();
        }
        LatencyUs {
            min: us(h.min()),
            p50: us(h.value_at_quantile(0.50)),
            p90: us(h.value_at_quantile(0.90)),
            p99: us(h.value_at_quantile(0.99)),
            p999: us(h.value_at_quantile(0.999)),
            max: us(h.max()),
            mean: h.mean() / 1000.0,
        }
    }
}

/// Latency percentiles of the requests that completed OK, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LatencyUs {
    /// The fastest.
    pub min: f64,
    /// The median.
    pub p50: f64,
    /// The 90th percentile.
    pub p90: f64,
    /// The 99th percentile.
    pub p99: f64,
    /// The 99.9th percentile.
    pub p999: f64,
    /// The slowest.
    pub max: f64,
    /// The mean.
    pub mean: f64,
}

/// One run's result.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BlkReport {
    /// `vhost-user:PATH`, `null` or the NBD URI.
    pub target: String,
    /// `randread`, `randwrite`, `read` or `write`.
    pub rw: &'static str,
    /// Bytes per request.
    pub bs: u32,
    /// Requests kept in flight (per queue).
    pub qd: u16,
    /// Queues driven (1 over NBD).
    pub queues: u16,
    /// `spin` or `call` (vhost-user and null); `null` over NBD.
    pub wait: Option<&'static str>,
    /// Requests completed OK within the run.
    pub ops: u64,
    /// How long the run issued requests.
    pub seconds: f64,
    /// `ops / seconds`.
    pub iops: f64,
    /// `ops × bs / seconds`, in MiB/s.
    pub mib_per_s: f64,
    /// Latency of the OK requests, submitted to seen used (or replied, over NBD).
    pub latency_us: LatencyUs,
    /// Requests that completed with another status (or failed, over NBD).
    pub errors: u64,
    /// The first of those, if any.
    pub first_error: Option<String>,
    /// The disk's size in bytes.
    pub disk_bytes: u64,
    /// The bytes addressed from offset 0 (`--range`, or the disk).
    pub range_bytes: u64,
    /// CPUs of the host, which the driver shares with the device under test.
    pub host_cpus: usize,
}

impl fmt::Display for BlkReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let wait = self.wait.map(|w| format!(", {w}")).unwrap_or_default();
        let queues = if self.queues == 1 { "queue" } else { "queues" };
        writeln!(
            f,
            "fallow bench blk: {}, {} of {} B, QD {} × {} {queues}{wait}, {:.2} s",
            self.target, self.rw, self.bs, self.qd, self.queues, self.seconds
        )?;
        writeln!(
            f,
            "  {} ops, {:.0} IOPS, {:.1} MiB/s, {} errors (disk {} MiB, range {} MiB)",
            self.ops,
            self.iops,
            self.mib_per_s,
            self.errors,
            self.disk_bytes >> 20,
            self.range_bytes >> 20
        )?;
        let l = &self.latency_us;
        write!(
            f,
            "  latency µs: min {:.1}  p50 {:.1}  p90 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  mean {:.1}",
            l.min, l.p50, l.p90, l.p99, l.p999, l.max, l.mean
        )?;
        if let Some(e) = &self.first_error {
            write!(f, "\n  first error: {e}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_summarise_in_microseconds() {
        let mut s = Stats::new();
        assert_eq!(s.latency(), LatencyUs::default());
        for us in 1..=100 {
            s.ok(Duration::from_micros(us));
        }
        s.error(|| "first".into());
        let mut other = Stats::new();
        other.error(|| "second".into());
        s.merge(&other);
        assert_eq!((s.ops(), s.errors, s.first_error.as_deref()), (100, 2, Some("first")));
        let l = s.latency();
        assert!((l.p50 - 50.0).abs() < 0.1 && (l.max - 100.0).abs() < 0.1, "{l:?}");
        assert!((l.mean - 50.5).abs() < 0.1 && l.min >= 0.99, "{l:?}");
    }
}
