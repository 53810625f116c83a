//! Warm restarts of a node (`--state-dir`): a clean stop writes a snapshot and the next
//! start serves the same pages under the same node id and pool ids to the same clients;
//! after a crash (SIGKILL), or from a damaged snapshot, the node comes back from its state
//! file and its journal with the same ids and every persistent page it acknowledged, and
//! from a damaged state file it starts empty; never with a stale page.

mod support;

use std::path::Path;
use std::time::Duration;

use bytes::Bytes;
use fallow_client::{BlockingClient, ClientConfig, ClientError};
use fallow_core::{PageKey, PoolId, PoolSpec, PAGE_SIZE};
use support::{Daemon, TempDir};

const SECRET: &str = "warm-restart-node-secret-0123";
const CLIENT: u128 = 0x0123_4567_89ab_cdef;

fn start(dir: &Path, listen: &str) -> Daemon {
    let secret = dir.join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let state = dir.join("state");
    let args = ["--listen", listen, "--lend", "64M", "--secret-file", secret.to_str().unwrap()];
    support::start_node(
        &[&args[..], &["--state-dir", state.to_str().unwrap()]].concat(),
        Duration::from_secs(20),
    )
    .0
}

fn client(addr: &str) -> BlockingClient {
    let config = ClientConfig::new(addr, SECRET.as_bytes().to_vec()).unwrap().client_id(CLIENT);
    BlockingClient::connect(config).unwrap()
}

fn page(pool: u32, i: u64) -> Bytes {
    let mut bytes = vec![0u8; PAGE_SIZE];
    for (n, b) in bytes.iter_mut().enumerate() {
        *b = (i as usize * 31 + n * 7 + pool as usize) as u8;
    }
    Bytes::from(bytes)
}

fn keys(pool: PoolId, n: u64) -> Vec<PageKey> {
    (0..n).map(|i| PageKey::new(pool, 9, i)).collect()
}

fn stop(node: &mut Daemon) {
    node.signal("TERM");
    assert!(node.wait_timeout(Duration::from_secs(30)).is_some_and(|s| s.success()));
}

/// Puts pages into an ephemeral and a persistent pool; returns the pools and node id.
fn fill(addr: &str) -> (PoolId, PoolId, u128) {
    let c = client(addr);
    let eph = c.block_on(c.client().create_pool(&PoolSpec::ephemeral())).unwrap();
    let per = c.block_on(c.client().create_pool(&PoolSpec::persistent())).unwrap();
    for (pool, n) in [(eph, 2000), (per, 500)] {
        let keys = keys(pool, n);
        let mut data = Vec::new();
        for k in &keys {
            data.extend_from_slice(&page(pool.0, k.index));
        }
        c.block_on(c.client().put_many(&keys, Bytes::from(data))).unwrap();
    }
    let id = c.block_on(c.client().node_id()).unwrap();
    (eph, per, id)
}

/// How many of `pool`'s first `n` pages read back right; panics on a wrong one.
fn hits(addr: &str, pool: PoolId, n: u64) -> Result<u64, ClientError> {
    let c = client(addr);
    let got = c.block_on(c.client().get_many(&keys(pool, n)))?;
    let mut hits = 0;
    for (i, page_read) in got.iter().enumerate() {
        if let Some(bytes) = page_read {
            assert_eq!(bytes, &page(pool.0, i as u64), "page {i} of {pool} is wrong");
            hits += 1;
        }
    }
    Ok(hits)
}

#[test]
fn a_clean_restart_serves_the_same_pages_under_the_same_ids() {
    let dir = TempDir::new("node-warm");
    let listen = format!("127.0.0.1:{}", support::free_port());
    let mut node = start(dir.path(), &listen);
    let (eph, per, id) = fill(&listen);
    stop(&mut node);
    let snapshot = dir.path().join("state/node.snapshot");
    assert!(snapshot.exists(), "{}", node.log_so_far());

    let mut node = start(dir.path(), &listen);
    assert!(node.log_so_far().contains("restored the snapshot"), "{}", node.log_so_far());
    assert!(!snapshot.exists(), "a restored snapshot is removed");
    let c = client(&listen);
    assert_eq!(c.block_on(c.client().node_id()).unwrap(), id, "the node id survives");
    assert_eq!(hits(&listen, eph, 2000).unwrap(), 2000);
    assert_eq!(hits(&listen, per, 500).unwrap(), 500);
    // A new pool gets an id the restored ones do not have.
    let new = c.block_on(c.client().create_pool(&PoolSpec::ephemeral())).unwrap();
    assert!(new != eph && new != per, "{new}");
    stop(&mut node);
}

/// Invalidates page `i` of `pool`.
fn invalidate(addr: &str, pool: PoolId, i: u64) {
    let c = client(addr);
    c.block_on(c.client().invalidate_page(PageKey::new(pool, 9, i))).unwrap();
}

#[test]
fn a_crash_keeps_the_ids_and_every_persistent_page() {
    let dir = TempDir::new("node-warm-crash");
    let listen = format!("127.0.0.1:{}", support::free_port());
    let mut node = start(dir.path(), &listen);
    let (eph, per, id) = fill(&listen);
    invalidate(&listen, per, 499);
    node.kill();
    // The crash cut a record short at the end of one journal: what came before it stays.
    let journal = dir.path().join("state/journal/shard-0000");
    let mut bytes = std::fs::read(&journal).unwrap();
    bytes.extend_from_slice(&[0x5a; 100]);
    std::fs::write(&journal, bytes).unwrap();

    let mut node = start(dir.path(), &listen);
    let log = node.log_so_far();
    assert!(log.contains("restored the state and the journaled persistent pages"), "{log}");
    let c = client(&listen);
    assert_eq!(c.block_on(c.client().node_id()).unwrap(), id, "the node id survives a crash");
    assert_eq!(hits(&listen, per, 500).unwrap(), 499, "every persistent page, none invalidated");
    assert_eq!(hits(&listen, eph, 2000).unwrap(), 0, "the ephemeral pool is back, empty");
    assert!(!dir.path().join("state/journal.replay").exists(), "the old journal is removed");
    // Twice: the journal written while recovering is what the next crash leaves.
    node.kill();
    let mut node = start(dir.path(), &listen);
    assert_eq!(hits(&listen, per, 500).unwrap(), 499);
    stop(&mut node);
}

#[test]
fn a_damaged_snapshot_falls_back_to_the_journal_and_a_damaged_state_file_starts_empty() {
    let dir = TempDir::new("node-warm-damaged");
    let listen = format!("127.0.0.1:{}", support::free_port());
    let mut node = start(dir.path(), &listen);
    let (eph, per, id) = fill(&listen);
    stop(&mut node);
    // A snapshot altered on disk is set aside; the journal still holds the persistent pages.
    let snapshot = dir.path().join("state/node.snapshot");
    let mut bytes = std::fs::read(&snapshot).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x40;
    std::fs::write(&snapshot, bytes).unwrap();
    let mut node = start(dir.path(), &listen);
    let log = node.log_so_far();
    assert!(log.contains("the snapshot is damaged"), "{log}");
    assert!(dir.path().join("state/node.damaged").exists());
    let c = client(&listen);
    assert_eq!(c.block_on(c.client().node_id()).unwrap(), id);
    assert_eq!(hits(&listen, per, 500).unwrap(), 500);
    assert_eq!(hits(&listen, eph, 10).unwrap(), 0);
    drop(c);

    // A state file altered on disk: the node cannot tell which pools the journal's pages
    // belong to, and starts empty under a new id.
    node.kill();
    let state = dir.path().join("state/node.state");
    let mut bytes = std::fs::read(&state).unwrap();
    bytes[20] ^= 0x01;
    std::fs::write(&state, bytes).unwrap();
    let mut node = start(dir.path(), &listen);
    let log = node.log_so_far();
    assert!(log.contains("starting empty"), "{log}");
    let c = client(&listen);
    let new_id = c.block_on(c.client().node_id()).unwrap();
    assert_ne!(new_id, id);
    assert!(matches!(hits(&listen, per, 10), Err(ClientError::UnknownPool(_))));
    drop(c);
    crash_keeps_the_new_runs_pages(dir.path(), &listen, &mut node, new_id);
    stop(&mut node);
}

/// After a start that dropped what the last run left, the pages of this run survive its
/// crash under its own ids: the old journal was not left to be replayed in place of this
/// run's.
fn crash_keeps_the_new_runs_pages(dir: &Path, listen: &str, node: &mut Daemon, id: u128) {
    let (_, per, filled_id) = fill(listen);
    assert_eq!(filled_id, id);
    node.kill();
    *node = start(dir, listen);
    let log = node.log_so_far();
    assert!(log.contains("restored the state and the journaled persistent pages"), "{log}");
    let c = client(listen);
    assert_eq!(c.block_on(c.client().node_id()).unwrap(), id, "{log}");
    assert_eq!(hits(listen, per, 500).unwrap(), 500, "{log}");
}

/// A journal that stopped after a failed write (a full state directory) was emptied, so a
/// crash loses that shard's persistent pages. Coming back under the same node id would
/// tell the node's clients it holds them; it starts empty under a new id instead, and a
/// cluster client re-creates the copies elsewhere.
#[test]
fn a_crash_after_a_journal_stopped_starts_empty_under_a_new_id() {
    let dir = TempDir::new("node-warm-stopped");
    let listen = format!("127.0.0.1:{}", support::free_port());
    let mut node = start(dir.path(), &listen);
    let (_, per, id) = fill(&listen);
    node.kill();
    // What a stopped journal leaves: its file emptied (`fallow_pool::journal`).
    std::fs::write(dir.path().join("state/journal/shard-0000"), b"").unwrap();
    let mut node = start(dir.path(), &listen);
    let log = node.log_so_far();
    assert!(log.contains("had stopped") && log.contains("starting empty"), "{log}");
    let c = client(&listen);
    let new_id = c.block_on(c.client().node_id()).unwrap();
    assert_ne!(new_id, id, "{log}");
    assert!(matches!(hits(&listen, per, 10), Err(ClientError::UnknownPool(_))));
    drop(c);
    crash_keeps_the_new_runs_pages(dir.path(), &listen, &mut node, new_id);
    stop(&mut node);
}
