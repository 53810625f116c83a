//! Coming back after a crash: the node's state file and the journal of persistent pages,
//! both in `--state-dir`, so that a node killed without warning keeps its id, its pools,
//! its clients' leases and every persistent page it acknowledged (docs/operations.md).
//!
//! ```text
//!  STATE/node.state     node id, pools, clients: rewritten (renamed over) at each pool
//!                       creation, destruction or lease expiry, before the reply
//!                       "FALLOWN1" · the snapshot's state part (restart.rs) · crc32c u32
//!  STATE/journal/       the engine's journal of persistent pages (fallow_pool::journal)
//!  STATE/node.snapshot  a clean stop's snapshot (restart.rs), preferred when present
//! ```
//!
//! A start with a snapshot restores it and drops the journal; one without restores the
//! state file's pools and clients and puts the journal's pages back. Ephemeral pools come
//! back empty (a crash may lose their pages, as eviction may).

use std::fs::File;
use std::io::{self, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

use fallow_core::{PageStore, PutOutcome};
use fallow_pool::journal::Recovered;
use fallow_pool::Engine;

use crate::clients::Clients;
use crate::node::Node;
use crate::restart::{damaged, read_state, write_state, CrcReader, CrcWriter, Report, Restored};

const MAGIC: &[u8; 8] = b"FALLOWN1";

/// Pages put back per engine call.
const BATCH: usize = 256;

/// The state file in a state directory.
pub fn state_path(dir: &Path) -> PathBuf {
    dir.join("node.state")
}

/// Writes `node`'s id, pools and clients into `dir`'s state file: under another name,
/// renamed over the old one once whole, so a crash leaves one or the other.
pub fn save_state(node: &Node, dir: &Path) -> io::Result<()> {
    let partial = dir.join("node.state.partial");
    let mut out = CrcWriter::new(Vec::with_capacity(4096));
    out.write_all(MAGIC)?;
    let pools = node.engine().pools_for_restart();
    write_state(&mut out, node.node_id(), &pools, &node.clients().for_restart())?;
    let (mut bytes, crc) = out.finish();
    bytes.extend_from_slice(&crc.to_le_bytes());
    let mut file = File::create(&partial)?;
    file.write_all(&bytes)?;
    std::fs::rename(&partial, state_path(dir))
}

/// After a crash, with `engine` journaling anew (into `fallow_pool::journal::journal_dir`):
/// restores the state file's pools and clients, then puts back the pages of `journal`
/// (the last run's journals, set aside by `fallow_pool::journal::recover`) and removes
/// them. `None` when the directory holds neither. A state file that does not hold is an
/// error, and so is a journal that had stopped (its shard's persistent pages are lost):
/// every pool restored is destroyed again and the journal removed, for the caller to
/// start empty under a new node id.
pub fn recover(
    dir: &Path,
    engine: &Engine,
    journal: Option<Recovered>,
) -> io::Result<Option<Restored>> {
    let started = Instant::now();
    let clients = Clients::default();
    let mut pools = Vec::new();
    let undo = |pools: Vec<_>, journal: Option<Recovered>| {
        for pool in pools {
            let _ = engine.destroy_pool(pool);
        }
        // The caller starts empty, under a new id, and journals that run's pages anew: a
        // journal left behind would be replayed in place of that run's at the next start
        // (`fallow_pool::journal::recover` prefers an unfinished replay), losing its pages.
        if let Some(journal) = journal {
            if let Err(err) = journal.discard() {
                tracing::error!(%err, "could not remove the journal of the run before");
            }
        }
    };
    let node_id = match read_state_file(dir, engine, &clients, &mut pools) {
        Ok(id) => id,
        Err(err) => {
            undo(pools, journal);
            return Err(err);
        }
    };
    let stopped = journal.as_ref().map_or(0, |j| j.report().stopped);
    if node_id.is_some() && stopped > 0 {
        undo(pools, journal);
        return Err(io::Error::other(format!(
            "the journal of {stopped} shard(s) had stopped after a failed write (a full state \
             directory), so some persistent pages did not survive the crash; coming back \
             under the same node id would tell clients the node still holds them"
        )));
    }
    let Some(node_id) = node_id else {
        if let Some(journal) = journal {
            let pages = journal.report().pages;
            tracing::error!(
                pages,
                "a journal without the state file that names its pools: its pages are dropped"
            );
            journal.finish()?;
        }
        return Ok(None);
    };
    let (mut stored, mut bytes) = (0u64, 0u64);
    if let Some(journal) = journal {
        let read = journal.report();
        bytes = read.bytes;
        let mut dropped = 0u64;
        journal.for_each_batch(BATCH, |keys, pages| {
            let (ok, lost) = put_back(engine, keys, pages);
            stored += ok;
            dropped += lost;
        });
        if dropped > 0 || read.torn > 0 || read.foreign > 0 {
            tracing::warn!(
                dropped,
                torn_files = read.torn,
                foreign_files = read.foreign,
                "some journaled pages did not come back (a pool no longer known, no room, \
                 or a record the crash cut short)"
            );
        }
        journal.finish()?;
    }
    let report = Report {
        pools: pools.len(),
        clients: clients.len(),
        pages: stored,
        bytes,
        elapsed: started.elapsed(),
    };
    Ok(Some(Restored { node_id, clients, report }))
}

/// Puts a batch back; a batch that names a pool the engine does not know is put page by
/// page, so the others still come back. How many were stored, and how many not.
fn put_back(engine: &Engine, keys: &[fallow_core::PageKey], pages: &[u8]) -> (u64, u64) {
    let count = |outcomes: &[PutOutcome]| {
        let ok = outcomes.iter().filter(|o| **o == PutOutcome::Stored).count() as u64;
        (ok, outcomes.len() as u64 - ok)
    };
    match engine.put_many(keys, pages) {
        Ok(outcomes) => count(&outcomes),
        Err(_) => {
            let outcomes: Vec<PutOutcome> = keys
                .iter()
                .zip(pages.chunks_exact(fallow_core::PAGE_SIZE))
                .map(|(key, page)| {
                    engine
                        .put(*key, page)
                        .unwrap_or(PutOutcome::NotStored(fallow_core::NotStored::Full))
                })
                .collect();
            count(&outcomes)
        }
    }
}

/// Reads the state file into `engine` and `clients`; the node id, or `None` when there is
/// no state file.
fn read_state_file(
    dir: &Path,
    engine: &Engine,
    clients: &Clients,
    pools: &mut Vec<fallow_core::PoolId>,
) -> io::Result<Option<u128>> {
    let file = match File::open(state_path(dir)) {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(err),
    };
    let mut r = CrcReader::new(BufReader::new(file));
    let short = |e: io::Error| match e.kind() {
        io::ErrorKind::UnexpectedEof => damaged("the state file ends too early"),
        _ => e,
    };
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic).map_err(short)?;
    if &magic != MAGIC {
        return Err(damaged("not a fallow node state file"));
    }
    let (node_id, _) = read_state(&mut r, engine, clients, pools).map_err(short)?;
    let crc = r.crc();
    let mut stored = [0u8; 4];
    r.into_inner().read_exact(&mut stored).map_err(short)?;
    if u32::from_le_bytes(stored) != crc {
        return Err(damaged("the state file's checksum does not match"));
    }
    Ok(Some(node_id))
}
