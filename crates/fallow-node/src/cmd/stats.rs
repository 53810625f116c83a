//! STATS: the node's counters, and those of the pools the asking client can reach.
//!
//! Names are stable and listed in `docs/protocol.md`; a reader must ignore names it does
//! not know, so new counters can be added without a version change.

use fallow_core::{PoolKind, PAGE_SIZE};
use fallow_proto::fallow::{Op, Reply, StatEntry};

use crate::clients::Client;
use crate::metrics::PageEvent;
use crate::node::Node;

pub(super) fn collect(node: &Node, client: &Client) -> Reply {
    let stats = node.engine().stats();
    let metrics = node.metrics();
    let mut entries = Vec::with_capacity(64);
    let mut add = |name: String, value: u64| entries.push(StatEntry { name, value });
    let hits =
        metrics.page_count(Op::Get, PageEvent::Hit) + metrics.page_count(Op::Take, PageEvent::Hit);
    let misses = metrics.page_count(Op::Get, PageEvent::Miss)
        + metrics.page_count(Op::Take, PageEvent::Miss);
    for (name, value) in [
        ("lent_bytes", stats.budget_bytes as u64),
        ("mapped_bytes", stats.mapped_bytes as u64),
        ("discarded_bytes", stats.discarded_bytes as u64),
        ("used_bytes", (stats.frames_used * PAGE_SIZE) as u64),
        ("pages", stats.pages),
        ("fill_pages", stats.fill_pages),
        ("dedup_saved_bytes", stats.dedup_saved_bytes),
        ("compressed_pages", stats.compressed_pages as u64),
        ("compressed_space_bytes", stats.compressed_space_bytes as u64),
        ("compression_saved_bytes", stats.compression_saved_bytes),
        ("checksum_failures", stats.corruptions),
        ("dropped_by_shrink", stats.dropped_by_shrink),
        ("over_budget_bytes", (stats.over_budget_frames * PAGE_SIZE) as u64),
        ("metadata_bytes", stats.metadata_bytes as u64),
        ("hits", hits),
        ("misses", misses),
        ("puts_stored", metrics.page_count(Op::Put, PageEvent::Stored)),
        ("puts_refused", metrics.page_count(Op::Put, PageEvent::Refused)),
        ("evictions", stats.pools.iter().map(|p| p.evictions).sum()),
        ("pools", stats.pools.len() as u64),
        ("clients", node.clients().len() as u64),
        ("connections", metrics.connections.get().max(0) as u64),
        ("uptime_seconds", node.uptime_secs()),
    ] {
        add(name.to_string(), value);
    }
    if let Some(percent) = stats.small_share_percent {
        add("eviction_small_share_percent".into(), u64::from(percent));
    }
    if let Some(lending) = node.lending_status() {
        add("lend_auto".into(), (lending.mode == "auto") as u64);
        add("lend_target_bytes".into(), lending.target_bytes);
        if let Some(rss) = lending.process_rss_bytes {
            add("process_rss_bytes".into(), rss);
        }
    }
    if let Some(lending) = node.lending_status().filter(|l| l.mode == "auto") {
        add("host_total_bytes".into(), lending.host_total_bytes);
        add("host_available_bytes".into(), lending.host_available_bytes);
        add("host_reserve_bytes".into(), lending.reserve_bytes);
        // Hundredths of a percent, so the integer keeps two decimals.
        add("psi_some_avg10_centi".into(), (lending.psi_some_avg10 * 100.0).round() as u64);
        add("budget_shrinks".into(), lending.shrinks);
        add("budget_grows".into(), lending.grows);
    }
    for pool in client.pools() {
        let Some(p) = stats.pools.iter().find(|p| p.pool == pool) else { continue };
        let prefix = format!("pool.{}.", pool.0);
        let kind = match p.kind {
            PoolKind::Ephemeral => 0,
            PoolKind::Persistent => 1,
        };
        for (name, value) in [
            ("persistent", kind),
            ("pages", p.pages),
            ("hits", p.hits),
            ("misses", p.misses),
            ("puts_stored", p.puts_stored),
            ("puts_refused", p.puts_refused),
            ("evictions", p.evictions),
            ("invalidations", p.invalidations),
            ("checksum_failures", p.corruptions),
        ] {
            add(format!("{prefix}{name}"), value);
        }
    }
    Reply::Stats(entries)
}
