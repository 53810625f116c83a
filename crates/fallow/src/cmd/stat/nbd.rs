//! `fallow stat --nbd ADDR`: an NBD server's state (`fallow nbd --metrics ADDR`, `fallow up
//! --metrics ADDR`), read from its Prometheus endpoint, as a table or JSON.
//!
//! The NBD server speaks no stats protocol of its own: its `/metrics` page already carries
//! every counter (`fallow_nbd_*`, see `fallow-nbd/src/metrics.rs` and `docs/nbd.md`), so
//! this fetches that page with one plain HTTP/1.1 GET (no client crate: the page is small,
//! the server local) and reads it with [`super::prometheus`].

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use serde_json::{json, Value};

use super::human;
use super::prometheus::Metrics;

/// A larger answer is not a metrics page of ours (one export's page is a few KiB).
const MAX_RESPONSE: u64 = 16 << 20;

/// Commands in the order the table lists them; any other comes after, by name.
const COMMANDS: [&str; 8] =
    ["read", "write", "flush", "trim", "write_zeroes", "cache", "block_status", "disc"];

/// Fetches, reads and prints the state of the NBD server whose metrics are at `addr`.
pub fn run(addr: &str, as_json: bool, timeout: Duration) -> anyhow::Result<()> {
    let endpoint = Endpoint::parse(addr)?;
    let url = endpoint.url();
    let text = endpoint.fetch(timeout)?;
    let metrics = Metrics::parse(&text)
        .map_err(|err| anyhow!("{url} did not answer with Prometheus metrics ({err})"))?;
    let stats = NbdStats::from_metrics(&metrics).map_err(|why| anyhow!("{url}: {why}"))?;
    if as_json {
        println!("{}", stats.json(&url));
    } else {
        print!("{}", stats.table(&url));
    }
    Ok(())
}

/// Where the metrics are: `HOST:PORT` (as given to `--metrics`), `http://HOST:PORT`, or
/// `http://HOST:PORT/PATH` (the path defaults to `/metrics`).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Endpoint {
    authority: String,
    path: String,
}

impl Endpoint {
    fn parse(addr: &str) -> anyhow::Result<Endpoint> {
        let rest = match addr.split_once("://") {
            None => addr,
            Some(("http", rest)) => rest,
            Some(("https", _)) => bail!("--nbd {addr}: the metrics endpoint speaks plain HTTP"),
            Some(_) => bail!("--nbd {addr}: expected HOST:PORT or http://HOST:PORT[/PATH]"),
        };
        let (authority, path) = match rest.find('/') {
            Some(at) => rest.split_at(at),
            None => (rest, "/"),
        };
        let path = if path == "/" { "/metrics" } else { path };
        // HOST:PORT, where HOST may be a bracketed IPv6 address.
        let has_port = authority.rsplit_once(':').is_some_and(|(host, port)| {
            !host.is_empty()
                && port.parse::<u16>().is_ok()
                && (!host.contains(':') || (host.starts_with('[') && host.ends_with(']')))
        });
        if !has_port {
            bail!("--nbd {addr}: expected HOST:PORT, the address given to --metrics");
        }
        Ok(Endpoint { authority: authority.to_string(), path: path.to_string() })
    }

    fn url(&self) -> String {
        format!("http://{}{}", self.authority, self.path)
    }

    /// One GET; the body of a 200 answer.
    fn fetch(&self, timeout: Duration) -> anyhow::Result<String> {
        let url = self.url();
        let addrs: Vec<_> = self
            .authority
            .to_socket_addrs()
            .with_context(|| format!("cannot resolve {}", self.authority))?
            .collect();
        let mut failure = None;
        let mut stream = None;
        for addr in addrs {
            match TcpStream::connect_timeout(&addr, timeout) {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(err) => failure = Some(err),
            }
        }
        let Some(mut stream) = stream else {
            let why = failure.map_or("no address".to_string(), |e| e.to_string());
            bail!(
                "cannot connect to {url}: {why} (is `fallow nbd --metrics {0}` or `fallow up \
                 --metrics {0}` running?)",
                self.authority
            );
        };
        stream.set_read_timeout(Some(timeout))?;
        stream.set_write_timeout(Some(timeout))?;
        let request = format!(
            "GET {} HTTP/1.1\r\nHost: {}\r\nAccept: text/plain\r\nUser-Agent: fallow-stat\r\n\
             Connection: close\r\n\r\n",
            self.path, self.authority
        );
        let mut response = Vec::new();
        stream
            .write_all(request.as_bytes())
            .and_then(|()| stream.take(MAX_RESPONSE + 1).read_to_end(&mut response))
            .map_err(|err| match err.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    anyhow!("{url} did not answer within {} s", timeout.as_secs())
                }
                _ => anyhow!("reading {url}: {err}"),
            })?;
        if response.len() as u64 > MAX_RESPONSE {
            bail!("{url} answered with more than {} MiB: not a metrics page", MAX_RESPONSE >> 20);
        }
        http_body(&response).map_err(|why| anyhow!("{url} {why}"))
    }
}

/// The body of a whole HTTP/1.x response, if its status is 200. `Err` completes a
/// sentence that starts with the URL.
fn http_body(response: &[u8]) -> Result<String, String> {
    if response.is_empty() {
        return Err("closed the connection without answering".into());
    }
    let Some(end) = response.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Err("did not answer with HTTP".into());
    };
    let head = String::from_utf8_lossy(&response[..end]);
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or_default();
    let mut parts = status.splitn(3, ' ');
    let (version, code) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    if !version.starts_with("HTTP/1.") || code.len() != 3 {
        return Err("did not answer with HTTP".into());
    }
    if code != "200" {
        return Err(format!(
            "answered {} (not a metrics endpoint; is it the address given to --metrics?)",
            status.trim_start_matches(version).trim()
        ));
    }
    let (mut chunked, mut length) = (false, None);
    for line in lines {
        let Some((name, value)) = line.split_once(':') else { continue };
        let value = value.trim();
        if name.eq_ignore_ascii_case("transfer-encoding") {
            chunked = value.eq_ignore_ascii_case("chunked");
        } else if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse::<usize>().map_err(|_| "sent a bad Content-Length")?);
        }
    }
    let body = &response[end + 4..];
    let body = if chunked {
        dechunk(body).ok_or("sent a bad chunked body")?
    } else if let Some(length) = length {
        body.get(..length).ok_or("sent a response cut short")?.to_vec()
    } else {
        body.to_vec()
    };
    String::from_utf8(body).map_err(|_| "sent a body that is not UTF-8".into())
}

/// A `Transfer-Encoding: chunked` body, or `None` if it is malformed or cut short.
fn dechunk(mut body: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line_end = body.windows(2).position(|w| w == b"\r\n")?;
        let line = std::str::from_utf8(&body[..line_end]).ok()?;
        let size = line.split(';').next()?.trim();
        let size = usize::from_str_radix(size, 16).ok()?;
        body = &body[line_end + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(body.get(..size)?);
        body = body.get(size..)?.strip_prefix(b"\r\n")?;
    }
}

/// One command's requests.
#[derive(Debug, Clone, Default, PartialEq)]
struct CmdStats {
    ok: u64,
    error: u64,
    refused: u64,
    /// Bytes read or written.
    bytes: u64,
    /// Sum and count of the request-duration histogram.
    seconds: f64,
    timed: u64,
}

/// One export's cache.
#[derive(Debug, Clone, Default, PartialEq)]
struct ExportStats {
    /// `None` from a server too old to report it.
    size_bytes: Option<u64>,
    /// Pages read, by the tier that had them.
    dirty: u64,
    local: u64,
    pool: u64,
    backing: u64,
    backing_reads: u64,
    backing_read_seconds: f64,
    dirty_bytes: u64,
    written_back_pages: u64,
    local_tier_pages: u64,
    pool_put_pages: u64,
    pool_errors: u64,
    pool_trusted: bool,
}

impl ExportStats {
    fn hits(&self) -> u64 {
        self.dirty + self.local + self.pool
    }

    fn hit_ratio(&self) -> Option<f64> {
        let total = self.hits() + self.backing;
        (total > 0).then(|| self.hits() as f64 / total as f64)
    }

    fn backing_mean_seconds(&self) -> Option<f64> {
        (self.backing_reads > 0).then(|| self.backing_read_seconds / self.backing_reads as f64)
    }
}

/// What an NBD server's metrics say.
#[derive(Debug, Clone, Default, PartialEq)]
struct NbdStats {
    connections: u64,
    connections_accepted: u64,
    requests: BTreeMap<String, CmdStats>,
    exports: BTreeMap<String, ExportStats>,
    /// The pool in the server's process, when it reports one.
    pool_memory: Option<PoolMemory>,
}

/// The memory of a pool in the server's process.
#[derive(Debug, Clone, Copy, PartialEq)]
struct PoolMemory {
    used_bytes: u64,
    lent_bytes: u64,
    /// Pages it holds (a server from before the gauge reports none).
    pages: Option<u64>,
}

/// A count from a float sample (negative and NaN read as 0).
fn count(value: f64) -> u64 {
    value as u64
}

impl NbdStats {
    /// `Err` says what the page is instead, when it is not an NBD server's.
    fn from_metrics(m: &Metrics) -> Result<NbdStats, &'static str> {
        let Some(connections) = m.get("fallow_nbd_connections", &[]) else {
            return Err(if m.samples().iter().any(|s| s.name.starts_with("fallow_")) {
                "these are a fallow node's metrics, not an NBD server's; for a node use \
                 `fallow stat --node HOST:PORT --secret-file FILE` (its protocol address)"
            } else {
                "not a fallow NBD server's metrics (no fallow_nbd_connections)"
            });
        };
        let mut stats = NbdStats {
            connections: count(connections),
            connections_accepted: count(
                m.get("fallow_nbd_connections_accepted_total", &[]).unwrap_or(0.0),
            ),
            ..NbdStats::default()
        };
        for s in m.samples() {
            if let Some(cmd) = s.label("cmd") {
                stats.add_request_sample(cmd, s);
            }
            if let Some(export) = s.label("export") {
                stats.add_export_sample(export, s);
            }
        }
        let used = m.get("fallow_nbd_pool_used_bytes", &[]);
        let lent = m.get("fallow_nbd_pool_lent_bytes", &[]);
        if let (Some(used), Some(lent)) = (used, lent) {
            let pages = m.get("fallow_nbd_pool_pages", &[]).map(count);
            stats.pool_memory =
                Some(PoolMemory { used_bytes: count(used), lent_bytes: count(lent), pages });
        }
        Ok(stats)
    }

    fn add_request_sample(&mut self, cmd: &str, s: &super::prometheus::Sample) {
        let entry = self.requests.entry(cmd.to_string()).or_default();
        match (s.name.as_str(), s.label("result")) {
            ("fallow_nbd_requests_total", Some("ok")) => entry.ok += count(s.value),
            ("fallow_nbd_requests_total", Some("error")) => entry.error += count(s.value),
            ("fallow_nbd_requests_total", Some("refused")) => entry.refused += count(s.value),
            ("fallow_nbd_bytes_total", _) => entry.bytes += count(s.value),
            ("fallow_nbd_request_duration_seconds_sum", _) => entry.seconds += s.value,
            ("fallow_nbd_request_duration_seconds_count", _) => entry.timed += count(s.value),
            _ => {}
        }
    }

    fn add_export_sample(&mut self, export: &str, s: &super::prometheus::Sample) {
        let e = self.exports.entry(export.to_string()).or_default();
        let v = count(s.value);
        match s.name.as_str() {
            "fallow_nbd_export_size_bytes" => e.size_bytes = Some(v),
            "fallow_nbd_cache_pages_read_total" => match s.label("tier") {
                Some("dirty") => e.dirty = v,
                Some("local") => e.local = v,
                Some("pool") => e.pool = v,
                Some("backing") => e.backing = v,
                _ => {}
            },
            "fallow_nbd_backing_reads_total" => e.backing_reads = v,
            "fallow_nbd_backing_read_seconds_total" => e.backing_read_seconds = s.value,
            "fallow_nbd_dirty_bytes" => e.dirty_bytes = v,
            "fallow_nbd_written_back_pages_total" => e.written_back_pages = v,
            "fallow_nbd_local_tier_pages" => e.local_tier_pages = v,
            "fallow_nbd_pool_put_pages_total" => e.pool_put_pages = v,
            "fallow_nbd_pool_errors_total" => e.pool_errors = v,
            "fallow_nbd_pool_trusted" => e.pool_trusted = v != 0,
            _ => {}
        }
    }

    /// The commands that were asked for, in table order.
    fn commands(&self) -> Vec<(&str, &CmdStats)> {
        let mut list: Vec<_> = self
            .requests
            .iter()
            .filter(|(_, c)| c.ok + c.error + c.refused > 0)
            .map(|(name, c)| (name.as_str(), c))
            .collect();
        list.sort_by_key(|(name, _)| {
            (COMMANDS.iter().position(|c| c == name).unwrap_or(COMMANDS.len()), name.to_string())
        });
        list
    }

    fn json(&self, url: &str) -> Value {
        let requests: serde_json::Map<String, Value> = self
            .commands()
            .into_iter()
            .map(|(name, c)| {
                let mean = (c.timed > 0).then(|| c.seconds / c.timed as f64);
                let value = json!({
                    "ok": c.ok, "error": c.error, "refused": c.refused, "bytes": c.bytes,
                    "mean_seconds": mean,
                });
                (name.to_string(), value)
            })
            .collect();
        let exports: serde_json::Map<String, Value> = self
            .exports
            .iter()
            .map(|(name, e)| {
                let value = json!({
                    "size_bytes": e.size_bytes,
                    "pages_read": {
                        "dirty": e.dirty, "local": e.local, "pool": e.pool, "backing": e.backing,
                    },
                    "hits": e.hits(),
                    "misses": e.backing,
                    "hit_ratio": e.hit_ratio(),
                    "backing_reads": e.backing_reads,
                    "backing_read_seconds": e.backing_read_seconds,
                    "backing_read_mean_seconds": e.backing_mean_seconds(),
                    "local_tier_pages": e.local_tier_pages,
                    "pool_put_pages": e.pool_put_pages,
                    "pool_errors": e.pool_errors,
                    "pool_trusted": e.pool_trusted,
                    "dirty_bytes": e.dirty_bytes,
                    "written_back_pages": e.written_back_pages,
                });
                (name.clone(), value)
            })
            .collect();
        let pool = self.pool_memory.map(|p| {
            json!({
                "used_bytes": p.used_bytes,
                "lent_bytes": p.lent_bytes,
                "pages": p.pages,
                "apparent_capacity": p.pages.and_then(|n| super::apparent_capacity(n, p.used_bytes)),
            })
        });
        json!({
            "nbd": url,
            "connections": self.connections,
            "connections_accepted": self.connections_accepted,
            "requests": requests,
            "pool": pool,
            "exports": exports,
        })
    }

    /// The human-readable table: the server, then one block per export.
    fn table(&self, url: &str) -> String {
        let mut rows: Vec<(String, String)> = Vec::new();
        let open = plural(self.connections, "connection", "connections");
        rows.push((
            "nbd".into(),
            format!("{url} ({open} open, {} accepted)", self.connections_accepted),
        ));
        let commands = self.commands();
        if commands.is_empty() {
            rows.push(("requests".into(), "none yet".into()));
        }
        for (i, (name, c)) in commands.into_iter().enumerate() {
            let mut text = format!("{name:<13}{:>9} ok", c.ok);
            if c.bytes > 0 {
                text.push_str(&format!(", {}", human(c.bytes)));
            }
            if c.timed > 0 {
                text.push_str(&format!(", mean {}", duration(c.seconds / c.timed as f64)));
            }
            if c.error > 0 {
                text.push_str(&format!(", {} failed", c.error));
            }
            if c.refused > 0 {
                text.push_str(&format!(", {} refused", c.refused));
            }
            rows.push((if i == 0 { "requests" } else { "" }.into(), text));
        }
        if let Some(p) = self.pool_memory {
            let mut text = format!("{} used of {} lent", human(p.used_bytes), human(p.lent_bytes));
            if let Some(pages) = p.pages {
                text.push_str(&format!(", {pages} pages"));
                if let Some(ratio) = super::apparent_capacity(pages, p.used_bytes) {
                    text.push_str(&format!(" (apparent capacity {ratio:.2} ×)"));
                }
            }
            rows.push(("pool".into(), text));
        }
        for (name, e) in &self.exports {
            rows.push((String::new(), String::new()));
            let size = e.size_bytes.map_or("size unknown".to_string(), human);
            rows.push((format!("export {name}"), size));
            rows.push(("  hit ratio".into(), hit_ratio(e)));
            let mean = e
                .backing_mean_seconds()
                .map_or(String::new(), |s| format!(", mean {}", duration(s)));
            rows.push((
                "  backing".into(),
                format!("{}{mean}", plural(e.backing_reads, "read", "reads")),
            ));
            rows.push((
                "  local tier".into(),
                format!(
                    "{} pages ({})",
                    e.local_tier_pages,
                    human(e.local_tier_pages * fallow_core::PAGE_SIZE as u64)
                ),
            ));
            let mut pool = format!("{} pages put, {} errors", e.pool_put_pages, e.pool_errors);
            if !e.pool_trusted {
                pool.push_str(", skipped until a failed invalidation is cleared");
            }
            rows.push(("  pool".into(), pool));
            rows.push((
                "  dirty".into(),
                format!("{} ({} pages written back)", human(e.dirty_bytes), e.written_back_pages),
            ));
        }
        let mut out = String::new();
        for (name, value) in rows {
            out.push_str(format!("{name:<14}{value}").trim_end());
            out.push('\n');
        }
        out
    }
}

fn hit_ratio(e: &ExportStats) -> String {
    let Some(ratio) = e.hit_ratio() else {
        return "- (no pages read yet)".to_string();
    };
    format!(
        "{ratio:.3} ({}: {} local, {} pool, {} dirty; {})",
        plural(e.hits(), "hit", "hits"),
        e.local,
        e.pool,
        e.dirty,
        plural(e.backing, "miss", "misses")
    )
}

/// `1 read`, `2 reads`.
fn plural(n: u64, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Seconds as µs, ms or s.
fn duration(seconds: f64) -> String {
    if seconds < 1e-3 {
        format!("{:.0} µs", seconds * 1e6)
    } else if seconds < 1.0 {
        format!("{:.2} ms", seconds * 1e3)
    } else {
        format!("{seconds:.2} s")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A page as `fallow nbd` writes it: one export `d` with a local tier and a pool.
    const PAGE: &str = "\
# HELP fallow_nbd_requests NBD requests answered.
# TYPE fallow_nbd_requests counter
fallow_nbd_requests_total{cmd=\"read\",result=\"ok\"} 40
fallow_nbd_requests_total{cmd=\"read\",result=\"refused\"} 2
fallow_nbd_requests_total{cmd=\"write\",result=\"ok\"} 4
fallow_nbd_requests_total{cmd=\"flush\",result=\"error\"} 1
fallow_nbd_request_duration_seconds_sum{cmd=\"read\"} 0.004
fallow_nbd_request_duration_seconds_count{cmd=\"read\"} 40
fallow_nbd_request_duration_seconds_bucket{cmd=\"read\",le=\"+Inf\"} 40
fallow_nbd_bytes_total{cmd=\"read\"} 163840
fallow_nbd_connections 1
fallow_nbd_connections_accepted_total 3
fallow_nbd_cache_pages_read_total{export=\"d\",tier=\"local\"} 30
fallow_nbd_cache_pages_read_total{export=\"d\",tier=\"pool\"} 6
fallow_nbd_cache_pages_read_total{export=\"d\",tier=\"dirty\"} 0
fallow_nbd_cache_pages_read_total{export=\"d\",tier=\"backing\"} 4
fallow_nbd_backing_reads_total{export=\"d\"} 2
fallow_nbd_backing_read_seconds_total{export=\"d\"} 0.01
fallow_nbd_pool_errors_total{export=\"d\"} 0
fallow_nbd_pool_trusted{export=\"d\"} 1
fallow_nbd_dirty_bytes{export=\"d\"} 8192
fallow_nbd_written_back_pages_total{export=\"d\"} 5
fallow_nbd_export_size_bytes{export=\"d\"} 16777216
fallow_nbd_local_tier_pages{export=\"d\"} 34
fallow_nbd_pool_put_pages_total{export=\"d\"} 10
fallow_nbd_pool_used_bytes{pool=\"in-process\"} 2097152
fallow_nbd_pool_lent_bytes{pool=\"in-process\"} 67108864
fallow_nbd_pool_pages{pool=\"in-process\"} 1024
# EOF
";

    fn stats() -> NbdStats {
        NbdStats::from_metrics(&Metrics::parse(PAGE).unwrap()).unwrap()
    }

    #[test]
    fn reads_every_counter() {
        let s = stats();
        assert_eq!((s.connections, s.connections_accepted), (1, 3));
        let read = &s.requests["read"];
        assert_eq!((read.ok, read.refused, read.bytes, read.timed), (40, 2, 163840, 40));
        assert_eq!(s.requests["flush"].error, 1);
        let d = &s.exports["d"];
        assert_eq!(d.size_bytes, Some(16 << 20));
        assert_eq!((d.local, d.pool, d.dirty, d.backing), (30, 6, 0, 4));
        assert_eq!(d.hit_ratio(), Some(0.9));
        assert_eq!(d.backing_mean_seconds(), Some(0.005));
        assert!(d.pool_trusted);
        let pool = PoolMemory { used_bytes: 2 << 20, lent_bytes: 64 << 20, pages: Some(1024) };
        assert_eq!(s.pool_memory, Some(pool));
        let names: Vec<_> = s.commands().iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["read", "write", "flush"]);
    }

    #[test]
    fn table_shows_requests_hits_backing_and_pool() {
        let text = stats().table("http://127.0.0.1:9100/metrics");
        let expected = "\
nbd           http://127.0.0.1:9100/metrics (1 connection open, 3 accepted)
requests      read                40 ok, 160.0 KiB, mean 100 µs, 2 refused
              write                4 ok
              flush                0 ok, 1 failed
pool          2.0 MiB used of 64.0 MiB lent, 1024 pages (apparent capacity 2.00 ×)

export d      16.0 MiB
  hit ratio   0.900 (36 hits: 30 local, 6 pool, 0 dirty; 4 misses)
  backing     2 reads, mean 5.00 ms
  local tier  34 pages (136.0 KiB)
  pool        10 pages put, 0 errors
  dirty       8.0 KiB (5 pages written back)
";
        assert_eq!(text, expected);
    }

    #[test]
    fn table_of_an_idle_server() {
        let page = "fallow_nbd_connections 0\n\
                    fallow_nbd_cache_pages_read_total{export=\"e\",tier=\"local\"} 0\n\
                    fallow_nbd_pool_trusted{export=\"e\"} 0\n";
        let stats = NbdStats::from_metrics(&Metrics::parse(page).unwrap()).unwrap();
        let text = stats.table("http://h:1/metrics");
        assert!(text.contains("requests      none yet\n"), "{text}");
        assert!(text.contains("export e      size unknown\n"), "{text}");
        assert!(text.contains("  hit ratio   - (no pages read yet)\n"), "{text}");
        assert!(text.contains("skipped until a failed invalidation is cleared"), "{text}");
        assert!(!text.contains("\npool "), "no in-process pool reported: {text}");
    }

    #[test]
    fn json_has_every_number_by_name() {
        let v = stats().json("http://127.0.0.1:9100/metrics");
        assert_eq!(v["requests"]["read"]["ok"], 40);
        assert_eq!(v["requests"]["read"]["mean_seconds"], 0.0001);
        assert_eq!(v["exports"]["d"]["pages_read"]["pool"], 6);
        assert_eq!(v["exports"]["d"]["hits"], 36);
        assert_eq!(v["exports"]["d"]["misses"], 4);
        assert_eq!(v["exports"]["d"]["hit_ratio"], 0.9);
        assert_eq!(v["exports"]["d"]["size_bytes"], 16 << 20);
        assert_eq!(v["pool"]["lent_bytes"], 64 << 20);
    }

    #[test]
    fn other_pages_are_named_for_what_they_are() {
        let node =
            Metrics::parse("fallow_node_requests_total{op=\"get\",status=\"ok\"} 1\n").unwrap();
        assert!(NbdStats::from_metrics(&node).unwrap_err().contains("--node"));
        let other = Metrics::parse("go_goroutines 7\n").unwrap();
        assert!(NbdStats::from_metrics(&other).unwrap_err().contains("not a fallow NBD"));
    }

    #[test]
    fn endpoints() {
        let parse = |a: &str| Endpoint::parse(a).map(|e| e.url()).map_err(|e| e.to_string());
        assert_eq!(parse("127.0.0.1:9100").unwrap(), "http://127.0.0.1:9100/metrics");
        assert_eq!(parse("http://localhost:9100/").unwrap(), "http://localhost:9100/metrics");
        assert_eq!(parse("http://[::1]:9100/m").unwrap(), "http://[::1]:9100/m");
        for bad in ["127.0.0.1", "http://host/metrics", "::1:9100", ":9100", "nbd://h:1/d"] {
            assert!(parse(bad).unwrap_err().contains("expected"), "{bad}");
        }
        assert!(parse("https://h:1").unwrap_err().contains("plain HTTP"));
    }

    #[test]
    fn http_bodies() {
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello";
        assert_eq!(http_body(ok).unwrap(), "hello");
        let chunked =
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nhel\r\n2;x=y\r\nlo\r\n0\r\n\r\n";
        assert_eq!(http_body(chunked).unwrap(), "hello");
        let not_found = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n";
        assert!(http_body(not_found).unwrap_err().contains("404 Not Found"));
        assert!(http_body(b"").unwrap_err().contains("without answering"));
        assert!(http_body(b"SSH-2.0-OpenSSH\r\n").unwrap_err().contains("HTTP"));
        assert!(http_body(b"FW\0\x01garbage\r\n\r\n").unwrap_err().contains("HTTP"));
        let short = b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\nhello";
        assert!(http_body(short).unwrap_err().contains("cut short"));
        let bad_chunk = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhel";
        assert!(http_body(bad_chunk).unwrap_err().contains("chunked"));
    }
}
