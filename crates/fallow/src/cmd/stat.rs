//! `fallow stat`: a node's state (over the node protocol), the cluster's members as a
//! node sees them (`stat/cluster.rs`), or an NBD server's state (from its Prometheus
//! endpoint, in `stat/nbd.rs`), as a table or JSON.

mod cluster;
mod nbd;
mod prometheus;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;
use fallow_client::{Client, ClientConfig, NodeStats};

use super::tls::NodeTlsArgs;

/// Print a node's or an NBD server's state: memory, hit ratio, traffic, pressure.
///
/// A node (`--node`, the default; needs `--secret-file`): lent and used memory, pages,
/// dedup and compression savings, hit ratio, pools, clients and host memory pressure.
///
/// The cluster (`--cluster`, asked of `--node`): every member the node knows, its state
/// (alive, suspect, dead), protocol address, lent, used and free memory, and how long
/// ago the node last heard of it.
///
/// An NBD server (`--nbd ADDR`, the address given to `fallow nbd --metrics` or `fallow
/// up --metrics`): requests by command, and per export its size, hits per tier (local,
/// pool) and misses, hit ratio, backing-store reads and latency, local tier and pool
/// use, and dirty data; read from http://ADDR/metrics.
#[derive(Debug, Args)]
pub struct StatArgs {
    /// The node: HOST:PORT, fallow://HOST:PORT or unix:PATH.
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:7400", conflicts_with = "nbd")]
    node: String,
    /// File holding the shared cluster secret (for a node).
    #[arg(long, value_name = "FILE", conflicts_with = "nbd")]
    secret_file: Option<PathBuf>,
    #[command(flatten)]
    node_tls: NodeTlsArgs,
    /// An NBD server instead: its metrics address, HOST:PORT or http://HOST:PORT[/PATH].
    #[arg(long, value_name = "ADDR")]
    nbd: Option<String>,
    /// List the cluster's members as the node sees them, instead of the node's counters.
    #[arg(long, conflicts_with = "nbd")]
    cluster: bool,
    /// Print one JSON object (every counter by name) instead of a table.
    #[arg(long)]
    json: bool,
    /// Seconds to wait for the node or the NBD server.
    #[arg(long, value_name = "SECS", default_value_t = 5)]
    timeout: u64,
}

/// Prints the state of one node or NBD server.
pub fn run(args: StatArgs) -> anyhow::Result<()> {
    let timeout = Duration::from_secs(args.timeout.max(1));
    if let Some(addr) = &args.nbd {
        return nbd::run(addr, args.json, timeout);
    }
    if args.node.starts_with("http://") || args.node.starts_with("https://") {
        bail!(
            "--node {0}: that is a metrics URL; --node takes the node's protocol address \
             (HOST:PORT), and an NBD server's metrics are read with --nbd {0}",
            args.node
        );
    }
    let Some(secret_file) = &args.secret_file else {
        bail!("--secret-file FILE is needed for a node (--nbd ADDR reads an NBD server)");
    };
    let secret = fallow_node::config::read_secret(secret_file).map_err(anyhow::Error::msg)?;
    let config = ClientConfig::new(&args.node, secret)?
        .tls(args.node_tls.client()?)
        .name("fallow-stat")
        .timeout(timeout)
        .connect_timeout(timeout);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    if args.cluster {
        return cluster::run(&runtime, config, &args.node, args.json);
    }
    let (stats, node_id) = runtime.block_on(async {
        let client = Client::connect(config).await?;
        let stats = client.stats().await?;
        let node_id = client.node_id().await?;
        Ok::<_, fallow_client::ClientError>((stats, node_id))
    })?;
    if args.json {
        let mut object = serde_json::Map::new();
        object.insert("node".into(), args.node.clone().into());
        object.insert("node_id".into(), format!("{node_id:032x}").into());
        for entry in &stats.entries {
            object.insert(entry.name.clone(), entry.value.into());
        }
        let v = |name: &str| stats.get(name).unwrap_or(0);
        let held = v("used_bytes") + v("compressed_space_bytes");
        object.insert("apparent_capacity".into(), apparent_capacity(v("pages"), held).into());
        println!("{}", serde_json::Value::Object(object));
    } else {
        print!("{}", table(&args.node, node_id, &stats));
    }
    Ok(())
}

/// The human-readable table.
fn table(node: &str, node_id: u128, stats: &NodeStats) -> String {
    let v = |name: &str| stats.get(name).unwrap_or(0);
    let mut rows: Vec<(&str, String)> = Vec::new();
    rows.push((
        "node",
        format!("{node} (id {:08x}, up {})", (node_id >> 96) as u32, uptime(v("uptime_seconds"))),
    ));
    let mode = match stats.get("lend_auto") {
        Some(1) => format!("auto, target {}", human(v("lend_target_bytes"))),
        Some(_) => "fixed".to_string(),
        None => "unknown".to_string(),
    };
    rows.push(("lent", format!("{} ({mode})", human(v("lent_bytes")))));
    let mut used = format!(
        "{} mapped, {} in page frames, {} metadata",
        human(v("mapped_bytes")),
        human(v("used_bytes")),
        human(v("metadata_bytes"))
    );
    // Per page, the figure the engine's target is stated in (≤ 32 B for dense objects).
    if v("pages") > 0 {
        used.push_str(&format!(
            " ({:.1} B a page)",
            v("metadata_bytes") as f64 / v("pages") as f64
        ));
    }
    rows.push(("used", used));
    if let Some(over) = stats.get("over_budget_bytes").filter(|b| *b > 0) {
        rows.push((
            "over budget",
            format!("{} of persistent pages the budget could not shed", human(over)),
        ));
    }
    rows.push(("pages", format!("{} ({} same-filled)", v("pages"), v("fill_pages"))));
    rows.push(("dedup saved", human(v("dedup_saved_bytes"))));
    let mut compression =
        format!("{} saved on {} pages", human(v("compression_saved_bytes")), v("compressed_pages"));
    // A node whose engine reports no compressed space (none compressed yet, or a node
    // from before the field existed) gets no "held in" part.
    if let Some(space) = stats.get("compressed_space_bytes").filter(|b| *b > 0) {
        compression.push_str(&format!(", held in {}", human(space)));
    }
    rows.push(("compression", compression));
    let held = v("used_bytes") + v("compressed_space_bytes");
    if let Some(ratio) = apparent_capacity(v("pages"), held) {
        rows.push((
            "apparent",
            format!("{ratio:.2} × ({} pages of 4 KiB held in {})", v("pages"), human(held)),
        ));
    }
    let (hits, misses) = (v("hits"), v("misses"));
    let ratio = if hits + misses == 0 {
        "-".to_string()
    } else {
        format!("{:.3}", hits as f64 / (hits + misses) as f64)
    };
    rows.push(("hit ratio", format!("{ratio} ({hits} hits, {misses} misses)")));
    if let Some(percent) = stats.get("eviction_small_share_percent") {
        let shape = if percent >= 100 { "LRU" } else { "S3-FIFO" };
        rows.push(("eviction", format!("small queue {percent} % of the cache ({shape})")));
    }
    rows.push((
        "puts",
        format!(
            "{} stored, {} refused, {} evictions",
            v("puts_stored"),
            v("puts_refused"),
            v("evictions")
        ),
    ));
    rows.push(("pools", v("pools").to_string()));
    rows.push(("clients", format!("{} ({} connections)", v("clients"), v("connections"))));
    if stats.get("host_available_bytes").is_some() {
        rows.push((
            "pressure",
            format!(
                "host {} available of {}, reserve {}, PSI some avg10 {:.2} %, {} shrinks, {} grows",
                human(v("host_available_bytes")),
                human(v("host_total_bytes")),
                human(v("host_reserve_bytes")),
                v("psi_some_avg10_centi") as f64 / 100.0,
                v("budget_shrinks"),
                v("budget_grows"),
            ),
        ));
    }
    if let Some(rss) = stats.get("process_rss_bytes") {
        rows.push(("node rss", human(rss)));
    }
    if v("checksum_failures") > 0 {
        rows.push(("checksum fail", format!("{} (returned as misses)", v("checksum_failures"))));
    }
    let mut out = String::new();
    for (name, value) in rows {
        out.push_str(&format!("{name:<14}{value}\n"));
    }
    out
}

/// How many bytes a pool holds for its users per byte of memory it uses for them: `pages`
/// of 4 KiB over `held_bytes` (frames and compressed data). Above 1 where dedup, same-filled
/// pages and compression save memory; `None` while nothing is held.
pub(crate) fn apparent_capacity(pages: u64, held_bytes: u64) -> Option<f64> {
    (held_bytes > 0).then(|| (pages * fallow_core::PAGE_SIZE as u64) as f64 / held_bytes as f64)
}

/// Bytes in binary units with one decimal.
fn human(bytes: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < units.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", units[unit])
    }
}

fn uptime(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s => format!("{}h{:02}m", s / 3600, (s % 3600) / 60),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fallow_proto::fallow::StatEntry;

    #[test]
    fn human_sizes() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(8 << 30), "8.0 GiB");
    }

    #[test]
    fn table_shows_hit_ratio_and_pressure() {
        let entry = |name: &str, value| StatEntry { name: name.into(), value };
        let stats = NodeStats {
            entries: vec![
                entry("lent_bytes", 1 << 30),
                entry("hits", 3),
                entry("misses", 1),
                entry("lend_auto", 1),
                entry("host_available_bytes", 2 << 30),
                entry("psi_some_avg10_centi", 150),
                entry("eviction_small_share_percent", 100),
                entry("compressed_pages", 512),
                entry("compression_saved_bytes", 1 << 20),
                entry("compressed_space_bytes", 1 << 20),
                entry("metadata_bytes", 7_759_462),
                entry("pages", 262_144),
                entry("used_bytes", 511 << 20),
            ],
        };
        let text = table("127.0.0.1:7400", 1, &stats);
        assert!(text.contains("hit ratio     0.750 (3 hits, 1 misses)"), "{text}");
        assert!(text.contains("eviction      small queue 100 % of the cache (LRU)"), "{text}");
        assert!(text.contains("1.0 GiB (auto"), "{text}");
        assert!(text.contains("PSI some avg10 1.50 %"), "{text}");
        assert!(text.contains("1.0 MiB saved on 512 pages, held in 1.0 MiB"), "{text}");
        assert!(text.contains("7.4 MiB metadata (29.6 B a page)"), "{text}");
        // 1 GiB of pages in 511 MiB of frames and 1 MiB of compressed data.
        assert!(text.contains("apparent      2.00 × (262144 pages of 4 KiB held in 512.0 MiB)"));
        assert_eq!(apparent_capacity(5, 0), None, "nothing held yet");
    }
}
