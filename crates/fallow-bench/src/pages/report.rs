//! What a run measured: per-worker [`Stats`] (an HDR latency histogram and counters),
//! merged into one [`PagesReport`] that prints as text or serialises as JSON.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use hdrhistogram::Histogram;

/// The longest latency the histogram tells apart (60 s, in ns); longer ones count as this.
const MAX_LATENCY_NS: u64 = 60_000_000_000;

/// One worker's measurements. Workers record without sharing anything but two relaxed
/// counters for the progress line; the driver merges their stats at the end.
#[derive(Debug)]
pub(crate) struct Stats {
    /// Request latencies in ns, 3 significant digits.
    hist: Histogram<u64>,
    pub(crate) requests: u64,
    pub(crate) pages: u64,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) stored: u64,
    pub(crate) not_stored: u64,
    pub(crate) wrong: u64,
    /// Requests that failed (counted only where a run goes on after a failure).
    pub(crate) errors: u64,
    /// The first of those failures.
    pub(crate) first_error: Option<String>,
    /// Pages completed by every worker, read by the progress ticker.
    live_pages: Arc<AtomicU64>,
    /// Every request's `(start, latency ns, is a get)`, when a timeline is asked for.
    timeline: Option<Vec<(Instant, u64, bool)>>,
}

impl Stats {
    pub(crate) fn new(live_pages: Arc<AtomicU64>) -> Self {
        #[expect(clippy::expect_used, reason = "constant bounds the crate accepts")]
        let hist =
            Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3).expect("valid histogram bounds");
        Self {
            hist,
            requests: 0,
            pages: 0,
            hits: 0,
            misses: 0,
            stored: 0,
            not_stored: 0,
            wrong: 0,
            errors: 0,
            first_error: None,
            live_pages,
            timeline: None,
        }
    }

    /// Also keeps every request's start and latency (see [`Stats::timeline`]) when `on`.
    pub(crate) fn with_timeline(mut self, on: bool) -> Self {
        self.timeline = on.then(Vec::new);
        self
    }

    fn request(&mut self, start: Instant, pages: u64, get: bool) {
        let ns = u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        if let Some(timeline) = &mut self.timeline {
            timeline.push((start, ns, get));
        }
        self.hist.saturating_record(ns.clamp(1, MAX_LATENCY_NS));
        self.requests += 1;
        self.pages += pages;
        self.live_pages.fetch_add(pages, Ordering::Relaxed);
    }

    /// Records a get of `hits + misses` pages, sent at `start`; `wrong` of the hits
    /// returned a page that no put of their key stored.
    pub(crate) fn get(&mut self, start: Instant, hits: u64, misses: u64, wrong: u64) {
        self.request(start, hits + misses, true);
        self.hits += hits;
        self.misses += misses;
        self.wrong += wrong;
    }

    /// Records a put of `stored + not_stored` pages, sent at `start`.
    pub(crate) fn put(&mut self, start: Instant, stored: u64, not_stored: u64) {
        self.request(start, stored + not_stored, false);
        self.stored += stored;
        self.not_stored += not_stored;
    }

    /// Records a request that failed (not timed: a failure's latency is not a page's).
    pub(crate) fn error(&mut self, err: &dyn std::fmt::Display) {
        self.errors += 1;
        self.first_error.get_or_insert_with(|| err.to_string());
    }

    /// Adds `other`'s measurements to these.
    pub(crate) fn merge(&mut self, other: &Stats) {
        // Both histograms share bounds, so `add` cannot fail; if it ever did, the counts
        // stay right and only the latency of `other` is lost.
        let _ = self.hist.add(&other.hist);
        self.requests += other.requests;
        self.pages += other.pages;
        self.hits += other.hits;
        self.misses += other.misses;
        self.stored += other.stored;
        self.not_stored += other.not_stored;
        self.wrong += other.wrong;
        self.errors += other.errors;
        if self.first_error.is_none() {
            self.first_error.clone_from(&other.first_error);
        }
        if let Some(theirs) = &other.timeline {
            self.timeline.get_or_insert_with(Vec::new).extend_from_slice(theirs);
        }
    }

    /// The recorded requests in the order they were sent, with wall-clock start times
    /// (empty unless [`Stats::with_timeline`] turned recording on).
    pub(crate) fn timeline(&self) -> Vec<TimedRequest> {
        let Some(timeline) = &self.timeline else { return Vec::new() };
        let (now, unix_now) = (Instant::now(), SystemTime::now().duration_since(UNIX_EPOCH));
        let unix_now = unix_now.map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX));
        let mut out: Vec<TimedRequest> = timeline
            .iter()
            .map(|&(start, latency_ns, get)| {
                let ago = u64::try_from(now.duration_since(start).as_nanos()).unwrap_or(u64::MAX);
                TimedRequest { start_unix_ns: unix_now.saturating_sub(ago), latency_ns, get }
            })
            .collect();
        out.sort_by_key(|r| r.start_unix_ns);
        out
    }

    pub(crate) fn latency(&self) -> Latency {
        let us = |ns: u64| ns as f64 / 1000.0;
        let at = |q: f64| us(self.hist.value_at_quantile(q));
        if self.hist.is_empty() {
            return Latency { p50: 0.0, p99: 0.0, p999: 0.0, max: 0.0, mean: 0.0 };
        }
        Latency {
            p50: at(0.5),
            p99: at(0.99),
            p999: at(0.999),
            max: us(self.hist.max()),
            mean: self.hist.mean() / 1000.0,
        }
    }
}

/// This process's resident set (`VmRSS` of `/proc/self/status`), in bytes; `None` where
/// the OS does not tell it.
pub(crate) fn rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib = line.trim_start_matches("VmRSS:").trim().trim_end_matches("kB").trim();
    Some(kib.parse::<u64>().ok()? * 1024)
}

/// The CPU time (user + system) process `pid` has used so far, in seconds, from
/// `/proc/PID/stat`.
pub(crate) fn process_cpu_seconds(pid: u32) -> Result<f64, String> {
    let path = format!("/proc/{pid}/stat");
    let stat = std::fs::read_to_string(&path).map_err(|e| format!("reading {path}: {e}"))?;
    // The command name (field 2) may hold spaces and parentheses; the fields after its
    // last ')' are plain. utime and stime (fields 14 and 15) are the 12th and 13th of those.
    let after_name = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let mut ticks = after_name.split_whitespace().skip(11).take(2).map(str::parse::<u64>);
    let (Some(Ok(user)), Some(Ok(system))) = (ticks.next(), ticks.next()) else {
        return Err(format!("{path}: no utime and stime fields"));
    };
    let per_second = rustix::param::clock_ticks_per_second().max(1);
    Ok((user + system) as f64 / per_second as f64)
}

/// What a local server spent on the measured phase (`--server-pid`): its CPU time, the
/// way to compare servers at the same load (a node against memcached).
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct ServerCpu {
    /// The server's process.
    pub pid: u32,
    /// Its user + system time over the measured phase, in seconds (the kernel counts in
    /// ticks, 10 ms each, so short runs are coarse).
    pub seconds: f64,
    /// `seconds` per wall-clock second of the phase: the CPUs it kept busy.
    pub cpus: f64,
    /// `seconds` per page served, in µs.
    pub us_per_page: f64,
}

impl ServerCpu {
    /// `seconds` of CPU over the measured phase of `report`.
    pub(crate) fn new(pid: u32, seconds: f64, report: &PagesReport) -> ServerCpu {
        ServerCpu {
            pid,
            seconds,
            cpus: seconds / report.seconds.max(1e-9),
            us_per_page: seconds * 1e6 / report.pages.max(1) as f64,
        }
    }
}

/// The load generator's resident set at three moments of the run, in bytes (`None`: not
/// known). The growth over the warm-up is what the client keeps per page put (with a
/// cluster target, its summary), plus the allocator's noise.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct Rss {
    /// Right after connecting and creating the pool.
    pub connected: Option<u64>,
    /// After the warm-up (`None` without one).
    pub after_warmup: Option<u64>,
    /// After the measured phase.
    pub end: Option<u64>,
}

/// One request of the measured phase, for a latency timeline (`PagesOptions::timeline`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimedRequest {
    /// When it was sent, in ns since the Unix epoch.
    pub start_unix_ns: u64,
    /// Its latency, in ns.
    pub latency_ns: u64,
    /// A get (`false`: a put).
    pub get: bool,
}

/// Request latency, from the write of a request to the last byte of its reply, in µs.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Latency {
    /// Median.
    pub p50: f64,
    /// 99th percentile.
    pub p99: f64,
    /// 99.9th percentile.
    pub p999: f64,
    /// Slowest request.
    pub max: f64,
    /// Mean.
    pub mean: f64,
}

/// The outcome of a run: its configuration and what it measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct PagesReport {
    /// The target URL.
    pub target: String,
    /// `fallow` or `memcached`.
    pub server: String,
    /// `get`, `put` or `mix:R`.
    pub workload: String,
    /// `uniform` or `zipf:THETA`.
    pub dist: String,
    /// `random` or `dup:N`.
    pub value: String,
    /// Size of the key space.
    pub keys: u64,
    /// TCP connections.
    pub connections: usize,
    /// Requests in flight per connection.
    pub queue_depth: usize,
    /// Pages per request.
    pub batch: usize,
    /// Fallow only: whether the pool was created with dedup on.
    pub dedup: Option<bool>,
    /// Fallow only: whether the pool was persistent (journaled by a node with
    /// `--state-dir`) rather than ephemeral.
    pub persistent: Option<bool>,
    /// Worker threads of the load generator.
    pub client_threads: usize,
    /// CPUs of this host, which the load generator shares with a local server.
    pub host_cpus: usize,
    /// Pages put by the warm-up (0: none).
    pub warmup_pages: u64,
    /// Wall time of the warm-up, in seconds.
    pub warmup_seconds: f64,
    /// Wall time of the measured phase, in seconds, including the drain of the requests
    /// in flight at its deadline.
    pub seconds: f64,
    /// Requests completed.
    pub requests: u64,
    /// Pages carried by those requests.
    pub pages: u64,
    /// `requests / seconds`.
    pub requests_per_s: f64,
    /// `pages / seconds`.
    pub pages_per_s: f64,
    /// Pages a get found.
    pub hits: u64,
    /// Pages a get did not find.
    pub misses: u64,
    /// Pages a put stored.
    pub stored: u64,
    /// Pages a put was refused (fallow: full or over quota; memcached: `SERVER_ERROR`).
    pub not_stored: u64,
    /// Hits whose bytes no put of their key stored: must be 0.
    pub wrong: u64,
    /// Requests that failed (cluster targets, where the run goes on): must be 0.
    pub errors: u64,
    /// The first failure, if any.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_error: Option<String>,
    /// Per-request latency in µs.
    pub latency_us: Latency,
    /// The load generator's resident set.
    pub rss: Rss,
    /// The server's CPU time over the measured phase (`PagesOptions::server_pid`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub server_cpu: Option<ServerCpu>,
    /// Cluster targets: the client's nodes and summary, and node state changes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cluster: Option<super::ClusterReport>,
    /// Every measured request, oldest first, when `PagesOptions::timeline` is set (not
    /// serialised: the CLI writes it to a file of its own).
    #[serde(skip)]
    pub timeline: Vec<TimedRequest>,
}

impl fmt::Display for PagesReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let l = &self.latency_us;
        writeln!(f, "target       {} ({})", self.target, self.server)?;
        write!(
            f,
            "load         {} pages, {} keys {}, values {}",
            self.workload, self.keys, self.dist, self.value
        )?;
        if let Some(dedup) = self.dedup {
            write!(f, ", pool dedup {}", if dedup { "on" } else { "off" })?;
        }
        if self.persistent == Some(true) {
            write!(f, ", persistent pool")?;
        }
        writeln!(f)?;
        writeln!(
            f,
            "shape        {} connection(s) x queue depth {} x batch {}",
            self.connections, self.queue_depth, self.batch
        )?;
        writeln!(
            f,
            "client       {} thread(s) on a {}-CPU host shared with the server if it is local",
            self.client_threads, self.host_cpus
        )?;
        if self.warmup_pages > 0 {
            writeln!(
                f,
                "warm-up      {} pages put in {:.2} s",
                self.warmup_pages, self.warmup_seconds
            )?;
        }
        writeln!(f, "duration     {:.2} s", self.seconds)?;
        writeln!(f, "requests     {} ({:.0}/s)", self.requests, self.requests_per_s)?;
        writeln!(f, "pages        {} ({:.0}/s)", self.pages, self.pages_per_s)?;
        writeln!(
            f,
            "gets         {} hits, {} misses, {} wrong",
            self.hits, self.misses, self.wrong
        )?;
        writeln!(f, "puts         {} stored, {} not stored", self.stored, self.not_stored)?;
        if self.errors > 0 {
            writeln!(
                f,
                "errors       {} (first: {})",
                self.errors,
                self.first_error.as_deref().unwrap_or("?")
            )?;
        }
        write!(
            f,
            "latency µs   p50 {:.1}  p99 {:.1}  p99.9 {:.1}  max {:.1}  mean {:.1}",
            l.p50, l.p99, l.p999, l.max, l.mean
        )?;
        if let Some(c) = &self.server_cpu {
            write!(
                f,
                "\nserver CPU   {:.2} s ({:.2} CPUs), {:.2} µs per page (pid {})",
                c.seconds, c.cpus, c.us_per_page, c.pid
            )?;
        }
        if let Some(c) = &self.cluster {
            let s = c.after_warmup.as_ref().unwrap_or(&c.end);
            let per_page = s.summary_heap_bytes as f64 / s.summary_pages.max(1) as f64;
            write!(
                f,
                "\nsummary      {} pages, {} objects, {} heap bytes ({per_page:.1} B/page){}",
                s.summary_pages,
                s.summary_objects,
                s.summary_heap_bytes,
                if c.after_warmup.is_some() { " after the warm-up" } else { "" }
            )?;
            for n in &c.end.nodes {
                write!(f, "\nnode         {} {}: {} pages of this client", n.id, n.state, n.pages)?;
                if let (Some(lent), Some(free)) = (n.lendable, n.free) {
                    write!(f, ", lends {} MiB, {} MiB free", lent >> 20, free >> 20)?;
                }
            }
            for e in &c.events {
                write!(f, "\nevent        {} {} {}", e.unix_ns, e.node, e.state)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn stats() -> Stats {
        Stats::new(Arc::new(AtomicU64::new(0)))
    }

    #[test]
    fn counts_and_percentiles() {
        let live = Arc::new(AtomicU64::new(0));
        let mut s = Stats::new(live.clone());
        let start = Instant::now();
        std::thread::sleep(Duration::from_millis(2));
        s.get(start, 3, 1, 0);
        s.put(start, 2, 0);
        assert_eq!((s.requests, s.pages, s.hits, s.misses, s.stored), (2, 6, 3, 1, 2));
        assert_eq!(live.load(Ordering::Relaxed), 6);
        let l = s.latency();
        assert!(l.p50 >= 2000.0 && l.p50 < 60_000.0, "{l:?}");
        assert!(l.p50 <= l.p99 && l.p99 <= l.p999 && l.p999 <= l.max);
    }

    #[test]
    fn a_process_cpu_time_grows_with_work_and_a_missing_process_is_an_error() {
        let me = std::process::id();
        let before = process_cpu_seconds(me).unwrap();
        // Work until the kernel has counted two more ticks (bounded: 10 s of CPU).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut x = 0u64;
        while process_cpu_seconds(me).unwrap() < before + 0.015 {
            assert!(std::time::Instant::now() < deadline, "no CPU time counted");
            for i in 0..100_000u64 {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
            }
        }
        // PIDs stop well below this (pid_max is at most 2^22).
        let err = process_cpu_seconds(u32::MAX).unwrap_err();
        assert!(err.contains("/proc/4294967295/stat"), "{err}");
    }

    #[test]
    fn percentiles_of_a_known_distribution() {
        let mut s = stats();
        // 1..=1000 µs, one each: p50 ≈ 500 µs, p99 ≈ 990 µs, within 0.1 %.
        for us in 1..=1000u64 {
            s.hist.record(us * 1000).unwrap();
        }
        let l = s.latency();
        assert!((l.p50 - 500.0).abs() < 1.0, "{l:?}");
        assert!((l.p99 - 990.0).abs() < 1.5, "{l:?}");
        assert!((l.p999 - 999.0).abs() < 1.5, "{l:?}");
        assert!((l.mean - 500.5).abs() < 1.0, "{l:?}");
    }

    #[test]
    fn merge_adds_counts_and_histograms() {
        let (mut a, mut b) = (stats(), stats());
        a.hist.record(10_000).unwrap();
        b.hist.record(1_000_000).unwrap();
        b.wrong = 1;
        b.requests = 1;
        b.error(&"first");
        b.error(&"second");
        a.merge(&b);
        assert_eq!((a.requests, a.wrong, a.errors), (1, 1, 2));
        assert_eq!(a.first_error.as_deref(), Some("first"));
        assert!((a.latency().max - 1000.0).abs() < 1.0);
        assert_eq!(stats().latency().p50, 0.0, "an empty histogram reports zeros");
    }

    #[test]
    fn timeline_is_kept_only_when_asked_and_sorted_after_merge() {
        let live = Arc::new(AtomicU64::new(0));
        let mut off = Stats::new(live.clone());
        off.get(Instant::now(), 1, 0, 0);
        assert!(off.timeline().is_empty());
        let (mut a, mut b) =
            (Stats::new(live.clone()).with_timeline(true), Stats::new(live).with_timeline(true));
        let first = Instant::now();
        std::thread::sleep(Duration::from_millis(1));
        b.put(Instant::now(), 1, 0);
        a.get(first, 0, 1, 0);
        let mut total = stats();
        total.merge(&a);
        total.merge(&b);
        let t = total.timeline();
        assert_eq!(t.len(), 2);
        assert!(t[0].get && !t[1].get, "oldest first: {t:?}");
        assert!(t[1].start_unix_ns - t[0].start_unix_ns >= 1_000_000, "{t:?}");
        assert!(t[0].latency_ns >= 1_000_000, "the get was timed from `first`: {t:?}");
    }

    #[test]
    fn rss_is_read_on_linux() {
        if cfg!(target_os = "linux") {
            let rss = rss_bytes().expect("VmRSS in /proc/self/status");
            assert!(rss > 1 << 20, "{rss}");
        }
    }

    #[test]
    fn report_prints_every_figure() {
        let report = PagesReport {
            target: "memcached://127.0.0.1:1".into(),
            server: "memcached".into(),
            workload: "get".into(),
            dist: "uniform".into(),
            value: "random".into(),
            keys: 10,
            connections: 1,
            queue_depth: 2,
            batch: 3,
            dedup: None,
            persistent: None,
            client_threads: 1,
            host_cpus: 2,
            warmup_pages: 10,
            warmup_seconds: 0.5,
            seconds: 1.0,
            requests: 100,
            pages: 300,
            requests_per_s: 100.0,
            pages_per_s: 300.0,
            hits: 299,
            misses: 1,
            stored: 0,
            not_stored: 0,
            wrong: 0,
            errors: 0,
            first_error: None,
            latency_us: Latency { p50: 15.0, p99: 40.0, p999: 90.0, max: 100.0, mean: 16.0 },
            rss: Rss::default(),
            server_cpu: None,
            cluster: None,
            timeline: Vec::new(),
        };
        let text = report.to_string();
        for needle in ["300/s", "299 hits", "p50 15.0", "p99.9 90.0", "queue depth 2 x batch 3"] {
            assert!(text.contains(needle), "{needle:?} missing from\n{text}");
        }
    }
}
