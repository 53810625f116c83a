//! Warm restart: the snapshot a clean stop writes into `--state-dir`, and the next start
//! loads, so that a restarted node serves the same pages under the same node id, pool ids
//! and clients.
//!
//! ```text
//!  "FALLOWS1"  node id u128
//!  pools   u32, each: id u32 · kind u8 · shared u8 · uuid u128 · dedup u8 · domain u64 ·
//!                     compress u8 · quota? u8 · quota u64 · users u32
//!  clients u32, each: id u128 · pools u32 · pool ids u32…
//!  pages, each: pool u32 · object u64 · index u64 · 4096 bytes
//!  0xffffffff (no pool has this id) · the count of pages u64
//!  crc32c of everything before it, u32                      (all integers little-endian)
//! ```
//!
//! The file is written under another name and renamed when complete, read once at the
//! next start with its CRC checked as it is read (what a snapshot that fails it restored
//! is undone before the node serves), and removed once restored: a node that crashes
//! later must not come back with pages older than what it served since. After a crash
//! there is no snapshot: the node comes back from its state file and the journal of its
//! persistent pages instead (`recovery.rs`), as it does from a damaged snapshot. A
//! client's cluster pools (peer forwarding) live on other nodes and are not in the
//! snapshot.
//!
//! `DIR` should be in memory (tmpfs: `/run`, `/dev/shm`): the snapshot is as large as the
//! pages, it exists only between a stop and the next start, and while it exists it is
//! memory the lent budget does not count (docs/governor.md).

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use fallow_core::{
    DedupScope, PageKey, PageStore, PoolId, PoolKind, PoolSpec, PutOutcome, Sharing, TrustDomain,
    PAGE_SIZE,
};
use fallow_pool::Engine;

use crate::clients::Clients;
use crate::node::Node;

const MAGIC: &[u8; 8] = b"FALLOWS1";

/// Where a pool id would be, the end of the pages: engine pool ids stay below 2³¹.
const END: u32 = u32::MAX;

/// Pages put back per engine call.
const RESTORE_BATCH: usize = 256;

/// The snapshot's file in a state directory.
pub fn snapshot_path(dir: &Path) -> PathBuf {
    dir.join("node.snapshot")
}

/// What a save or a restore did.
#[derive(Debug, Clone, Copy, Default)]
pub struct Report {
    /// Pools.
    pub pools: usize,
    /// Clients.
    pub clients: usize,
    /// Pages written, or put back.
    pub pages: u64,
    /// Bytes of the file.
    pub bytes: u64,
    /// How long it took.
    pub elapsed: Duration,
}

/// Writes `node`'s pools, clients and pages into `dir` (created if missing), after the
/// node stopped serving. Pages that go meanwhile (the governor shrinking) are left out.
pub fn save(node: &Node, dir: &Path) -> io::Result<Report> {
    let started = Instant::now();
    std::fs::create_dir_all(dir)?;
    let path = snapshot_path(dir);
    let partial = dir.join("node.snapshot.partial");
    let mut out = CrcWriter::new(BufWriter::with_capacity(1 << 20, File::create(&partial)?));
    let engine = node.engine();
    let pools = engine.pools_for_restart();
    let clients = node.clients().for_restart();
    out.write_all(MAGIC)?;
    write_state(&mut out, node.node_id(), &pools, &clients)?;
    // Page by page, each read as it is written: one that went meanwhile (the governor
    // shrinking) is left out. The end is marked, and the count follows it.
    let mut written = 0u64;
    let mut page = vec![0u8; PAGE_SIZE];
    for (id, _, _) in &pools {
        for key in engine.pool_keys(*id) {
            if !matches!(engine.get(key, &mut page), Ok(fallow_core::Lookup::Hit)) {
                continue;
            }
            out.write_all(&key.pool.0.to_le_bytes())?;
            out.write_all(&key.object.to_le_bytes())?;
            out.write_all(&key.index.to_le_bytes())?;
            out.write_all(&page)?;
            written += 1;
        }
    }
    out.write_all(&END.to_le_bytes())?;
    out.write_all(&written.to_le_bytes())?;
    let (mut file, crc) = out.finish();
    file.write_all(&crc.to_le_bytes())?;
    let file = file.into_inner().map_err(|e| e.into_error())?;
    file.sync_all()?;
    let bytes = file.metadata()?.len();
    std::fs::rename(&partial, &path)?;
    Ok(Report {
        pools: pools.len(),
        clients: clients.len(),
        pages: written,
        bytes,
        elapsed: started.elapsed(),
    })
}

/// What a snapshot gave back: the node id to take again, the clients with their pools
/// (to make the node with), and what was done.
#[derive(Debug)]
pub struct Restored {
    /// The id of the node that wrote the snapshot.
    pub node_id: u128,
    /// Its clients, each with the pools it held; their leases run from now.
    pub clients: Clients,
    /// What was restored, and how long it took.
    pub report: Report,
}

/// Restores the snapshot in `dir`, if there is one, into `engine` (which serves nobody
/// yet), then removes the file. The file is read once; its CRC is checked as it goes and
/// compared at the end, and a snapshot that does not hold (altered, truncated, nonsense)
/// is undone: every pool it restored is destroyed again, and the error is returned for
/// the caller to log, with the engine as empty as it was.
pub fn restore(dir: &Path, engine: &Engine) -> io::Result<Option<Restored>> {
    let started = Instant::now();
    let path = snapshot_path(dir);
    let file = match File::open(&path) {
        Ok(file) => file,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(err),
    };
    let bytes = file.metadata()?.len();
    let mut restored_pools = Vec::new();
    let clients = Clients::default();
    let mut r = CrcReader::new(BufReader::with_capacity(1 << 20, file));
    let outcome = read_into(&mut r, engine, &clients, &mut restored_pools);
    let outcome = outcome.and_then(|(node_id, pages)| {
        let crc = r.crc;
        let mut stored = [0u8; 4];
        r.inner.read_exact(&mut stored).map_err(|_| damaged("it ends before its checksum"))?;
        if u32::from_le_bytes(stored) != crc {
            return Err(damaged("its checksum does not match"));
        }
        Ok((node_id, pages))
    });
    match outcome {
        Ok((node_id, pages)) => {
            std::fs::remove_file(&path)?;
            let report = Report {
                pools: restored_pools.len(),
                clients: clients.len(),
                pages,
                bytes,
                elapsed: started.elapsed(),
            };
            Ok(Some(Restored { node_id, clients, report }))
        }
        Err(err) => {
            for pool in restored_pools {
                let _ = engine.destroy_pool(pool);
            }
            Err(err)
        }
    }
}

/// Reads the snapshot's body into `engine` and `clients`; returns the node id and how
/// many pages the engine took. `restored` collects the pools made, for an undo.
fn read_into(
    r: &mut impl Read,
    engine: &Engine,
    clients: &Clients,
    restored: &mut Vec<PoolId>,
) -> io::Result<(u128, u64)> {
    let short = |e: io::Error| match e.kind() {
        io::ErrorKind::UnexpectedEof => damaged("it ends too early"),
        _ => e,
    };
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic).map_err(short)?;
    if &magic != MAGIC {
        return Err(damaged("not a fallow node snapshot"));
    }
    let (node_id, specs) = read_state(r, engine, clients, restored).map_err(short)?;
    let mut keys = Vec::with_capacity(RESTORE_BATCH);
    let mut data = vec![0u8; RESTORE_BATCH * PAGE_SIZE];
    let (mut read, mut stored) = (0u64, 0u64);
    let mut put = |keys: &mut Vec<PageKey>, data: &[u8]| {
        let pages = data.get(..keys.len() * PAGE_SIZE).unwrap_or_default();
        if let Ok(outcomes) = engine.put_many(keys, pages) {
            stored += outcomes.iter().filter(|o| **o == PutOutcome::Stored).count() as u64;
        }
        keys.clear();
    };
    loop {
        let pool = read_u32(r).map_err(short)?;
        if pool == END {
            break;
        }
        if !specs.contains_key(&PoolId(pool)) {
            return Err(damaged("a page of a pool not in it"));
        }
        let object = read_u64(r).map_err(short)?;
        let index = read_u64(r).map_err(short)?;
        let at = keys.len() * PAGE_SIZE;
        r.read_exact(data.get_mut(at..at + PAGE_SIZE).unwrap_or_default()).map_err(short)?;
        keys.push(PageKey::new(PoolId(pool), object, index));
        read += 1;
        if keys.len() == RESTORE_BATCH {
            put(&mut keys, &data);
        }
    }
    put(&mut keys, &data);
    if read_u64(r).map_err(short)? != read {
        return Err(damaged("its page count does not match its pages"));
    }
    Ok((node_id, stored))
}

/// The part a snapshot and the state file share: the node id, the pools with their specs
/// and users, and the clients with the pools they hold.
pub(crate) fn write_state(
    out: &mut impl Write,
    node_id: u128,
    pools: &[(PoolId, PoolSpec, u32)],
    clients: &[(u128, Vec<(PoolId, PoolSpec)>)],
) -> io::Result<()> {
    out.write_all(&node_id.to_le_bytes())?;
    out.write_all(&(pools.len() as u32).to_le_bytes())?;
    for (id, spec, users) in pools {
        out.write_all(&id.0.to_le_bytes())?;
        write_spec(out, spec)?;
        out.write_all(&users.to_le_bytes())?;
    }
    out.write_all(&(clients.len() as u32).to_le_bytes())?;
    for (id, held) in clients {
        out.write_all(&id.to_le_bytes())?;
        out.write_all(&(held.len() as u32).to_le_bytes())?;
        for (pool, _) in held {
            out.write_all(&pool.0.to_le_bytes())?;
        }
    }
    Ok(())
}

/// Reads what [`write_state`] wrote: restores the pools into `engine` (collected in
/// `restored`, for an undo) and the clients into `clients`; returns the node id and the
/// pools' specs.
pub(crate) fn read_state(
    r: &mut impl Read,
    engine: &Engine,
    clients: &Clients,
    restored: &mut Vec<PoolId>,
) -> io::Result<(u128, HashMap<PoolId, PoolSpec>)> {
    let node_id = read_u128(r)?;
    let pools = read_u32(r)?;
    let mut specs = HashMap::new();
    for _ in 0..pools {
        let id = PoolId(read_u32(r)?);
        let spec = read_spec(r)?;
        let users = read_u32(r)?;
        engine.restore_pool(id, &spec, users).map_err(|e| damaged(&format!("pool {id}: {e}")))?;
        restored.push(id);
        specs.insert(id, spec);
    }
    let count = read_u32(r)?;
    for _ in 0..count {
        let id = read_u128(r)?;
        let held = read_u32(r)?;
        let mut pools = Vec::new();
        for _ in 0..held {
            let pool = PoolId(read_u32(r)?);
            let spec =
                specs.get(&pool).ok_or_else(|| damaged("a client holds a pool not in it"))?;
            pools.push((pool, *spec));
        }
        clients.restore(id, pools);
    }
    Ok((node_id, specs))
}

/// A reader that keeps the CRC-32C of what went through it.
pub(crate) struct CrcReader<R> {
    inner: R,
    crc: u32,
}

impl<R> CrcReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        Self { inner, crc: 0 }
    }

    /// The CRC-32C of everything read so far.
    pub(crate) fn crc(&self) -> u32 {
        self.crc
    }

    /// The reader, to read what the CRC does not cover.
    pub(crate) fn into_inner(self) -> R {
        self.inner
    }
}

impl<R: Read> Read for CrcReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, buf.get(..n).unwrap_or_default());
        Ok(n)
    }
}

/// A snapshot (or state file) that does not hold: `why` says how.
pub(crate) fn damaged(why: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("the snapshot is damaged: {why}"))
}

fn write_spec(out: &mut impl Write, spec: &PoolSpec) -> io::Result<()> {
    let kind = u8::from(spec.kind == PoolKind::Persistent);
    let (shared, uuid) = match spec.sharing {
        Sharing::Private => (0u8, 0u128),
        Sharing::Shared { uuid } => (1, uuid),
    };
    let (dedup, domain) = match spec.dedup {
        DedupScope::Off => (0u8, 0u64),
        DedupScope::Domain(TrustDomain(d)) => (1, d),
    };
    out.write_all(&[kind, shared])?;
    out.write_all(&uuid.to_le_bytes())?;
    out.write_all(&[dedup])?;
    out.write_all(&domain.to_le_bytes())?;
    out.write_all(&[u8::from(spec.compress), u8::from(spec.quota_pages.is_some())])?;
    out.write_all(&spec.quota_pages.unwrap_or(0).to_le_bytes())
}

fn read_spec(r: &mut impl Read) -> io::Result<PoolSpec> {
    let kind = if read_u8(r)? == 1 { PoolKind::Persistent } else { PoolKind::Ephemeral };
    let shared = read_u8(r)?;
    let uuid = read_u128(r)?;
    let dedup = read_u8(r)?;
    let domain = read_u64(r)?;
    let compress = read_u8(r)? == 1;
    let has_quota = read_u8(r)? == 1;
    let quota = read_u64(r)?;
    Ok(PoolSpec {
        kind,
        sharing: if shared == 1 { Sharing::Shared { uuid } } else { Sharing::Private },
        dedup: if dedup == 1 { DedupScope::Domain(TrustDomain(domain)) } else { DedupScope::Off },
        compress,
        quota_pages: has_quota.then_some(quota),
    })
}

fn read_u8(r: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    r.read_exact(&mut b)?;
    Ok(u8::from_le_bytes(b))
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_le_bytes(b))
}

fn read_u128(r: &mut impl Read) -> io::Result<u128> {
    let mut b = [0u8; 16];
    r.read_exact(&mut b)?;
    Ok(u128::from_le_bytes(b))
}

/// A writer that keeps the CRC-32C of what went through it.
pub(crate) struct CrcWriter<W> {
    inner: W,
    crc: u32,
}

impl<W: Write> CrcWriter<W> {
    pub(crate) fn new(inner: W) -> Self {
        CrcWriter { inner, crc: 0 }
    }

    /// The writer and the CRC-32C of everything written.
    pub(crate) fn finish(self) -> (W, u32) {
        (self.inner, self.crc)
    }
}

impl<W: Write> Write for CrcWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, buf.get(..n).unwrap_or_default());
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_of_pool_spec_round_trips() {
        let specs = [
            PoolSpec::ephemeral(),
            PoolSpec::persistent(),
            PoolSpec::ephemeral().shared(0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10),
            PoolSpec { quota_pages: Some(77), compress: true, ..PoolSpec::persistent() },
            PoolSpec { dedup: DedupScope::Off, ..PoolSpec::ephemeral() },
            PoolSpec { dedup: DedupScope::Domain(TrustDomain(u64::MAX)), ..PoolSpec::ephemeral() },
        ];
        for spec in specs {
            let mut bytes = Vec::new();
            write_spec(&mut bytes, &spec).unwrap();
            assert_eq!(read_spec(&mut bytes.as_slice()).unwrap(), spec);
        }
    }
}
