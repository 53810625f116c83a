//! The exports of `fallow nbd` and `fallow vhost`: `--export NAME=BACKING` opened as backing
//! stores (a file, RAM, an upstream NBD server, a RADOS image, or a persistent pool that is
//! the only copy), the pool behind them (`--pool`), and one cache layer per export over
//! both. The front ends differ only in how they serve the caches this module opens.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::{Args, ValueEnum};
use fallow_backing::{BackingStore, FileStore, MemStore, NbdStore, PoolStore};
use fallow_cache::{CacheConfig, CacheLayer, Mode, PoolTier, WritePolicy};
use fallow_core::{AsyncPageStore, PoolSpec};
use fallow_node::lending::parse_size;
use fallow_pool::{Engine, EngineBuilder};

use super::warm::{self, StateDir};

/// The exports and their caches, shared by `fallow nbd` and `fallow vhost`. The settings
/// without a value here take one from `fallow nbd`'s config file, else the default each
/// names; an export's own section in the file wins over all of them for that export.
#[derive(Debug, Clone, Args)]
pub struct ExportArgs {
    /// An export: NAME=file:PATH[,size=SIZE] | NAME=PATH | NAME=mem:SIZE | NAME=nbd://… |
    /// NAME=nbds://… (TLS) |
    /// NAME=rados:POOL/PREFIX[,size=SIZE][,conf=PATH][,user=NAME][,namespace=NS][,timeout=SECS]
    /// | NAME=pool:SIZE[,uuid=UUID][,backup=PATH] (a disk that lives only in --pool, in a
    /// persistent pool of its own: pages never written read as zeros, writes must be whole
    /// 4 KiB pages, a write the pool has no room for fails with ENOSPC; with uuid=, 32 hex
    /// digits, the pool is named on a node, and the export, restarted, finds its disk again
    /// while the node keeps it; with backup=, a file, created sparse if missing, receives
    /// every page in the background (up to --max-dirty on its way), so that the disk
    /// survives the loss of the pool; for swap or scratch space, see docs/nbd.md).
    /// Repeatable; the first is also the default export.
    #[arg(long = "export", value_name = "NAME=BACKING")]
    pub exports: Vec<String>,
    /// The pool behind the local tier: local:SIZE (in this process), fallow://HOST:PORT (a
    /// node, or the cluster it is a member of), fallow://HOST:PORT,HOST:PORT,... (a
    /// cluster, through any of these seeds), or none. In a cluster, pages are spread over
    /// the live nodes and a node that dies costs misses, never errors [default: none].
    #[arg(long, value_name = "POOL")]
    pub pool: Option<String>,
    /// The shared secret, for a fallow:// pool.
    #[arg(long, value_name = "FILE")]
    pub secret_file: Option<PathBuf>,
    /// For a fallow:// pool whose nodes run with --node-tls.
    #[command(flatten)]
    pub node_tls: super::tls::NodeTlsArgs,
    /// Size of the local tier in this process, per export (0 for none) [default: 64M].
    #[arg(long, value_name = "SIZE")]
    pub local_tier: Option<String>,
    /// exclusive: a page lives in the local tier or in the pool; inclusive: the pool keeps
    /// a copy of what the local tier holds [default: exclusive].
    #[arg(long, value_enum)]
    pub mode: Option<CacheMode>,
    /// through: a write is acknowledged once the backing store has it. back: acknowledged
    /// from memory; FLUSH and FUA make writes durable, and a background flusher writes
    /// them out (see --max-dirty, --max-dirty-age). A crash loses only writes no FLUSH
    /// covered [default: through].
    #[arg(long, value_enum)]
    pub write_policy: Option<WriteMode>,
    /// With --write-policy back: the most dirty data per export; writers wait beyond it
    /// [default: 64M].
    #[arg(long, value_name = "SIZE")]
    pub max_dirty: Option<String>,
    /// With --write-policy back: the oldest dirty data may get, in milliseconds
    /// [default: 1000].
    #[arg(long, value_name = "MS")]
    pub max_dirty_age: Option<u64>,
    /// How long a stopping server keeps trying to write acknowledged data to the stores
    /// (dirty data, a store's own volatile part), retrying a store that fails, before it
    /// gives up, logs what is lost and exits with an error. Keep it under the service
    /// manager's stop timeout (systemd: TimeoutStopSec, 90 s) [default: 60].
    #[arg(long, value_name = "SECS")]
    pub stop_timeout: Option<u64>,
    /// Refuse writes on every export.
    #[arg(long)]
    pub read_only: bool,
    /// Compress pages that stay cold in the pools this process creates (the cache pool and
    /// every pool: export's), in the background: more pages in the same memory, for CPU.
    #[arg(long)]
    pub compress: bool,
    /// Keep the cache warm across restarts (with a fallow:// pool, which outlives this
    /// process): DIR records the pool the exports cache in; a clean stop (SIGTERM) moves
    /// the local tier's pages into it and marks each export clean, and the next start over
    /// the same DIR serves them at once. After a crash, or over a store changed meanwhile,
    /// the export's pages in the pool are dropped instead: cold, never stale.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Each export's own settings, from a config file's `[exports.NAME]` sections.
    #[arg(skip)]
    pub own: std::collections::BTreeMap<String, ExportSettingsFile>,
}

/// One export's section of `fallow nbd`'s config file: its store, and settings that win
/// over the flags and the file's defaults for this export.
#[derive(Debug, Clone, Default, PartialEq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExportSettingsFile {
    /// The BACKING of `--export NAME=BACKING`.
    pub backing: String,
    /// As `--local-tier`.
    pub local_tier: Option<String>,
    /// As `--mode`.
    pub mode: Option<CacheMode>,
    /// As `--write-policy`.
    pub write_policy: Option<WriteMode>,
    /// As `--max-dirty`.
    pub max_dirty: Option<String>,
    /// As `--max-dirty-age`.
    pub max_dirty_age_ms: Option<u64>,
}

/// One export's cache settings, resolved.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheSettings {
    /// Pages in the local tier.
    pub local_pages: usize,
    /// Exclusive or inclusive.
    pub mode: Mode,
    /// When writes are acknowledged, with write-back's limits.
    pub write: WritePolicy,
    /// The most data on its way: write-back's dirty limit, and a pool export's backup.
    pub max_dirty: u64,
}

impl ExportArgs {
    /// `--pool`, or none.
    pub fn pool(&self) -> &str {
        self.pool.as_deref().unwrap_or("none")
    }

    /// The export names and stores of `--export`, checked: NAME=BACKING, distinct names,
    /// at least one.
    pub fn specs(&self) -> anyhow::Result<Vec<(String, String)>> {
        let mut specs: Vec<(String, String)> = Vec::new();
        for spec in &self.exports {
            let Some((name, backing)) = spec.split_once('=') else {
                bail!("--export {spec:?}: expected NAME=BACKING");
            };
            if name.is_empty() || specs.iter().any(|(n, _)| n == name) {
                bail!("--export {spec:?}: export names must be non-empty and distinct");
            }
            specs.push((name.to_string(), backing.to_string()));
        }
        if specs.is_empty() {
            bail!(
                "no export: give --export NAME=BACKING (or an [exports.NAME] section in --config)"
            );
        }
        Ok(specs)
    }

    /// The cache settings of export `name`: its own section's, else the flags' (or the
    /// file's defaults merged into them), else the defaults.
    pub fn cache_settings(&self, name: &str) -> anyhow::Result<CacheSettings> {
        let own = self.own.get(name);
        let which = |setting: &str| match own {
            Some(_) => format!("[exports.{name}] {setting}"),
            None => format!("--{setting}"),
        };
        let local_tier = own.and_then(|o| o.local_tier.clone()).or(self.local_tier.clone());
        let local_tier = local_tier.unwrap_or_else(|| "64M".to_string());
        let local_bytes = parse_size(&local_tier)
            .with_context(|| format!("{} {local_tier}", which("local-tier")))?;
        let mode = match own.and_then(|o| o.mode).or(self.mode).unwrap_or(CacheMode::Exclusive) {
            CacheMode::Exclusive => Mode::Exclusive,
            CacheMode::Inclusive => Mode::Inclusive,
        };
        let max_dirty = own.and_then(|o| o.max_dirty.clone()).or(self.max_dirty.clone());
        let max_dirty = max_dirty.unwrap_or_else(|| "64M".to_string());
        let max_dirty = parse_size(&max_dirty)
            .with_context(|| format!("{} {max_dirty}", which("max-dirty")))?;
        let max_age = own.and_then(|o| o.max_dirty_age_ms).or(self.max_dirty_age).unwrap_or(1000);
        let write = match own.and_then(|o| o.write_policy).or(self.write_policy) {
            None | Some(WriteMode::Through) => WritePolicy::Through,
            Some(WriteMode::Back) => WritePolicy::Back {
                max_dirty_bytes: max_dirty,
                max_age: std::time::Duration::from_millis(max_age.max(1)),
            },
        };
        let local_pages = (local_bytes / fallow_core::PAGE_SIZE as u64) as usize;
        Ok(CacheSettings { local_pages, mode, write, max_dirty })
    }
}

/// `--write-policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WriteMode {
    /// Acknowledged once the backing store has it.
    Through,
    /// Acknowledged from memory.
    Back,
}

/// `--mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    /// A page lives in one tier.
    Exclusive,
    /// The pool keeps a copy of the local tier's pages.
    Inclusive,
}
/// One opened export: its name, the BACKING it was given, its cache.
pub struct OpenedExport {
    /// The name clients ask for.
    pub name: String,
    /// The BACKING text, for logs and descriptions.
    pub spec: String,
    /// The cache layer over the backing store (and the pool).
    pub cache: CacheLayer,
}

/// Every export of a process, the engine of an in-process pool, and the state kept
/// across restarts (`--state-dir`).
pub struct OpenedExports {
    /// The exports, in `--export` order.
    pub exports: Vec<OpenedExport>,
    /// The pool's engine when it runs in this process (for its memory gauges).
    pub engine: Option<Arc<Engine>>,
    state: Option<StateDir>,
}

/// Opens every export of `args` and the pool behind them, on the current runtime; returns
/// them with the pool's engine when it runs in this process (for its memory gauges).
pub async fn open_exports(args: &ExportArgs) -> anyhow::Result<OpenedExports> {
    let specs = args.specs()?;
    // Every setting is checked before anything opens.
    for (name, _) in &specs {
        args.cache_settings(name)?;
    }
    let mut state = match &args.state_dir {
        Some(dir) if !args.pool().starts_with("fallow://") => bail!(
            "--state-dir {}: keeping the cache across restarts needs a pool that outlives \
             this process (--pool fallow://…), not --pool {}",
            dir.display(),
            args.pool()
        ),
        Some(dir) => {
            let dir = dir.clone();
            Some(tokio::task::spawn_blocking(move || StateDir::open(&dir)).await??)
        }
        None => None,
    };
    let pool = open_pool(args, state.as_ref().map(StateDir::pool_uuid)).await?;
    let mut backings = Vec::new();
    for (name, spec) in specs {
        let (backing, in_pool) = match spec.strip_prefix("pool:") {
            Some(rest) => {
                let max_dirty = args.cache_settings(&name)?.max_dirty;
                let backing =
                    open_pool_backing(pool.as_ref(), rest, args.compress, max_dirty).await;
                (backing.with_context(|| format!("--export {name}={spec}"))?, true)
            }
            None => (open_backing(&spec).await?, false),
        };
        backings.push((name, spec, backing, in_pool));
    }
    let mut exports = Vec::new();
    for (index, (name, spec, backing, in_pool)) in backings.into_iter().enumerate() {
        let object = match &mut state {
            Some(state) => state.object(&name),
            None => index as u64,
        };
        // A pool: export's store is the pool already: no second copy in it.
        let tier = pool.as_ref().filter(|_| !in_pool).map(|opened| PoolTier {
            store: opened.store.clone(),
            pool: opened.pool,
            object,
        });
        if let (Some(state), Some(tier)) = (&mut state, &tier) {
            warm_or_cold(state, &name, &spec, backing.size(), tier).await?;
        }
        let CacheSettings { local_pages, mode, write, .. } = args.cache_settings(&name)?;
        let config = CacheConfig { local_pages, mode, write, ..CacheConfig::default() };
        let cache = CacheLayer::new(backing, tier, config);
        tracing::info!(export = %name, backing = %spec, size = cache.size(), "export ready");
        exports.push(OpenedExport { name, spec, cache });
    }
    Ok(OpenedExports { exports, engine: pool.and_then(|opened| opened.engine), state })
}

/// With `--state-dir`, before export `name` serves: keeps its pages in the pool if the
/// last stop was clean over this very store, and drops them otherwise.
async fn warm_or_cold(
    state: &mut StateDir,
    name: &str,
    spec: &str,
    size: u64,
    tier: &PoolTier,
) -> anyhow::Result<()> {
    let mark = state.take_clean(name)?;
    if warm::survives_restart(spec) && mark.as_ref() == Some(&warm::current_mark(spec, size)) {
        tracing::info!(export = %name, "clean stop recorded: its pages in the pool are kept (warm start)");
        return Ok(());
    }
    let why = match mark {
        None => "no clean stop recorded",
        Some(_) => "the backing store changed since the clean stop",
    };
    let dropped = tier
        .store
        .invalidate_object(tier.pool, tier.object)
        .await
        .with_context(|| format!("export {name}: dropping its pages in the pool ({why})"))?;
    tracing::info!(export = %name, why, dropped, "its pages in the pool are dropped (cold start)");
    Ok(())
}

/// How long a stopping server keeps trying to write the exports' acknowledged data to
/// their stores, unless `--stop-timeout` says otherwise.
const STOP_TIMEOUT_SECS: u64 = 60;

/// The exports' last step before the process exits, after the last client: makes every
/// acknowledged write durable (with write-back, the dirty data still in memory, and what a
/// store holds on its way, such as a pool export's backup file), retrying a store that
/// fails for up to `--stop-timeout`, so that a store that is briefly gone loses nothing
/// and one that is gone for good cannot hold the exit forever. With `--state-dir`, an
/// export whose data all reached its store then hands its local tier to the pool and is
/// marked clean, so that the next start is warm. An error when some acknowledged data
/// could not be written: it is lost, and the process must not exit as if it were not.
pub async fn stop_exports(opened: &mut OpenedExports, args: &ExportArgs) -> anyhow::Result<()> {
    let timeout = Duration::from_secs(args.stop_timeout.unwrap_or(STOP_TIMEOUT_SECS));
    let flushed = flush_exports(&opened.exports, timeout).await;
    let lost: Vec<&str> = opened
        .exports
        .iter()
        .zip(&flushed)
        .filter(|(_, ok)| !**ok)
        .map(|(export, _)| export.name.as_str())
        .collect();
    if let Some(state) = &mut opened.state {
        for (export, flushed) in opened.exports.iter().zip(flushed) {
            if !flushed || !warm::survives_restart(&export.spec) {
                continue;
            }
            let handed = export.cache.hand_local_to_pool().await;
            let mark = warm::current_mark(&export.spec, export.cache.size());
            match state.mark_clean(&export.name, mark) {
                Ok(()) => {
                    tracing::info!(export = %export.name, handed, "stopped clean: the next start is warm")
                }
                Err(err) => {
                    tracing::error!(export = %export.name, error = %format!("{err:#}"), "could not record the clean stop: the next start is cold")
                }
            }
        }
    }
    if !lost.is_empty() {
        anyhow::bail!(
            "acknowledged writes of export(s) {} could not be written to their store within \
             {}s and are lost",
            lost.join(", "),
            timeout.as_secs()
        );
    }
    Ok(())
}

/// [`stop_exports`]' first step; returns, per export, whether everything acknowledged is
/// in its store now. A flush that fails is tried again, after a pause that doubles from
/// 100 ms up to 5 s, until `timeout` has passed since the first try.
async fn flush_exports(exports: &[OpenedExport], timeout: Duration) -> Vec<bool> {
    let deadline = tokio::time::Instant::now() + timeout;
    let mut flushed = Vec::with_capacity(exports.len());
    for export in exports {
        let dirty = export.cache.dirty_bytes();
        let caps = export.cache.backing().capabilities();
        // A store with a volatile part (a file's page cache, a pool export's backup on its
        // way) is flushed even with nothing dirty in the cache.
        if dirty == 0 && (!caps.flush || caps.read_only) {
            flushed.push(true);
            continue;
        }
        if dirty > 0 {
            tracing::info!(export = %export.name, dirty, "writing dirty data out before exit");
        }
        let mut pause = Duration::from_millis(100);
        let mut tries = 0u32;
        let ok = loop {
            tries += 1;
            let attempt = tokio::time::timeout_at(deadline, export.cache.flush()).await;
            let err = match attempt {
                Ok(Ok(())) if export.cache.dirty_bytes() == 0 => break true,
                Ok(Ok(())) => "dirty data is left after the flush".to_string(),
                Ok(Err(err)) => err.to_string(),
                Err(_) => "the store did not answer in time".to_string(),
            };
            let now = tokio::time::Instant::now();
            if now + pause >= deadline {
                tracing::error!(
                    export = %export.name,
                    tries,
                    dirty = export.cache.dirty_bytes(),
                    err,
                    "the store's flush failed until the stop timeout: acknowledged writes \
                     since the last flush are lost"
                );
                break false;
            }
            tracing::warn!(
                export = %export.name,
                tries,
                dirty = export.cache.dirty_bytes(),
                err,
                retry_ms = pause.as_millis() as u64,
                "the store's flush failed; trying again"
            );
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(5));
        };
        flushed.push(ok);
    }
    flushed
}

/// The exports as the NBD server serves them, sharing their caches with any other front
/// end.
pub fn nbd_exports(opened: &[OpenedExport], read_only: bool) -> Vec<Arc<fallow_nbd::Export>> {
    opened
        .iter()
        .map(|e| {
            Arc::new(fallow_nbd::Export {
                name: e.name.clone(),
                description: e.spec.clone(),
                cache: e.cache.clone(),
                read_only,
            })
        })
        .collect()
}

/// Opens BACKING.
async fn open_backing(spec: &str) -> anyhow::Result<Arc<dyn BackingStore>> {
    if let Some(size) = spec.strip_prefix("mem:") {
        let size = parse_size(size).with_context(|| format!("backing {spec:?}"))?;
        return Ok(Arc::new(MemStore::new(size)));
    }
    if ["nbd://", "nbds://", "nbd+unix://", "nbds+unix://"].iter().any(|s| spec.starts_with(s)) {
        return Ok(Arc::new(NbdStore::connect(spec).await?));
    }
    if let Some(rest) = spec.strip_prefix("rados:") {
        return open_rados(spec, rest).await;
    }
    let rest = spec.strip_prefix("file:").unwrap_or(spec);
    let (path, size) = match rest.split_once(",size=") {
        Some((path, size)) => {
            (path, Some(parse_size(size).with_context(|| format!("backing {spec:?}"))?))
        }
        None => (rest, None),
    };
    if path.is_empty() {
        bail!("backing {spec:?}: no path");
    }
    let path = PathBuf::from(path);
    let store = match size {
        Some(size) => FileStore::open_or_create(&path, size)?,
        None => FileStore::open(&path, false)?,
    };
    Ok(Arc::new(store))
}

/// Opens `pool:SIZE[,uuid=UUID]`: a persistent pool of its own in the `--pool` store, with a
/// quota of the device's pages, as the export's only store. With a UUID the pool is shared
/// under it, so that a restarted export attaches to the pool it left on a node.
async fn open_pool_backing(
    pool: Option<&OpenedPool>,
    rest: &str,
    compress: bool,
    backup_limit: u64,
) -> anyhow::Result<Arc<dyn BackingStore>> {
    let Some(pool) = pool else {
        bail!("a pool: export lives in the pool: give --pool local:SIZE or fallow://HOST:PORT");
    };
    let mut parts = rest.split(',');
    let size = parts.next().unwrap_or_default();
    let (mut uuid, mut backup) = (None, None);
    for option in parts {
        match option.split_once('=') {
            Some(("uuid", text)) => uuid = Some(parse_uuid(text)?),
            Some(("backup", path)) if !path.is_empty() => backup = Some(PathBuf::from(path)),
            _ => bail!("unknown option {option:?}; expected pool:SIZE[,uuid=UUID][,backup=PATH]"),
        }
    }
    let bytes = parse_size(size)?;
    if bytes == 0 || !bytes.is_multiple_of(fallow_core::PAGE_SIZE as u64) {
        bail!("pool:{size}: the size must be a positive multiple of 4 KiB");
    }
    let pages = bytes / fallow_core::PAGE_SIZE as u64;
    let mut spec = PoolSpec { quota_pages: Some(pages), compress, ..PoolSpec::persistent() };
    if let Some(uuid) = uuid {
        if pool.engine.is_some() {
            bail!(
                "uuid= names a pool on a node, to find it again after a restart; a pool in \
                 this process (--pool local:) goes with the process"
            );
        }
        spec = spec.shared(uuid);
    }
    let id = pool.store.create_pool(&spec).await.map_err(|err| match err {
        fallow_core::StoreError::SharedPoolMismatch { .. } => anyhow::anyhow!(
            "the pool under uuid {uuid:032x} was made with another size or --compress \
             setting; give the same ones, or another uuid",
            uuid = uuid.unwrap_or_default()
        ),
        // A cluster keeps two copies of private persistent pools only.
        fallow_core::StoreError::InvalidSpec(why) if uuid.is_some() => anyhow::anyhow!(
            "{why}: a pool export with uuid= needs a single node (a shared pool is not \
             replicated across a cluster)"
        ),
        err => anyhow::Error::new(err).context("creating the persistent pool"),
    })?;
    match uuid {
        Some(uuid) => tracing::info!(pool = %id, pages, compress, uuid = %format!("{uuid:032x}"),
            "persistent pool of the export created, or attached to again"),
        None => {
            tracing::info!(pool = %id, pages, compress, "persistent pool created for the export")
        }
    }
    let store = PoolStore::new(pool.store.clone(), id, 0, bytes)?;
    let Some(path) = backup else {
        return Ok(Arc::new(store));
    };
    let file = FileStore::open_or_create(&path, bytes)
        .with_context(|| format!("the backup file {}", path.display()))?;
    let limit = usize::try_from(backup_limit).unwrap_or(usize::MAX);
    tracing::info!(backup = %path.display(), limit, "the export is backed up into a file");
    Ok(Arc::new(store.with_backup(file, limit)?))
}

/// A pool's UUID: 32 hex digits, dashes allowed (`uuidgen`'s form).
fn parse_uuid(text: &str) -> anyhow::Result<u128> {
    let digits: String = text.chars().filter(|c| *c != '-').collect();
    if digits.len() != 32 {
        bail!("uuid={text}: expected 32 hex digits (as `uuidgen` prints, dashes allowed)");
    }
    u128::from_str_radix(&digits, 16).with_context(|| format!("uuid={text}: not hex"))
}

/// Opens `rados:REST`: connects to the cluster and opens (or, with `size=`, creates) the
/// image.
#[cfg(feature = "rados")]
async fn open_rados(spec: &str, rest: &str) -> anyhow::Result<Arc<dyn BackingStore>> {
    let (config, size) = parse_rados(rest).with_context(|| format!("backing {spec:?}"))?;
    let store = fallow_backing::RadosStore::open(&config, size)
        .await
        .with_context(|| format!("backing {spec:?}"))?;
    Ok(Arc::new(store))
}

/// Without the `rados` feature there is no RADOS store to open.
#[cfg(not(feature = "rados"))]
async fn open_rados(spec: &str, _rest: &str) -> anyhow::Result<Arc<dyn BackingStore>> {
    bail!(
        "backing {spec:?}: this fallow was built without RADOS support (cargo feature \
         `rados`, which needs librados-dev to build)"
    )
}

/// `POOL/PREFIX[,size=SIZE][,conf=PATH][,user=NAME][,namespace=NS][,timeout=SECS]`: where the image is,
/// and the size to create it with if it is missing.
#[cfg(feature = "rados")]
fn parse_rados(rest: &str) -> anyhow::Result<(fallow_backing::RadosConfig, Option<u64>)> {
    const FORM: &str =
        "rados:POOL/PREFIX[,size=SIZE][,conf=PATH][,user=NAME][,namespace=NS][,timeout=SECS]";
    let mut parts = rest.split(',');
    let location = parts.next().unwrap_or_default();
    let Some((pool, prefix)) =
        location.split_once('/').filter(|(p, x)| !p.is_empty() && !x.is_empty())
    else {
        bail!("expected {FORM}");
    };
    // librados' own default: $CEPH_CONF, then /etc/ceph/ceph.conf.
    let conf = std::env::var_os("CEPH_CONF")
        .filter(|c| !c.is_empty())
        .map_or_else(|| PathBuf::from(fallow_backing::rados::DEFAULT_CONF), PathBuf::from);
    let mut config = fallow_backing::RadosConfig::new(pool, prefix).conf(conf);
    let mut size = None;
    for part in parts {
        match part.split_once('=') {
            Some(("size", v)) => size = Some(parse_size(v).with_context(|| format!("size={v}"))?),
            Some(("conf", v)) if !v.is_empty() => config = config.conf(v),
            Some(("user", v)) if !v.is_empty() => config = config.user(v),
            Some(("namespace", v)) if !v.is_empty() => config = config.namespace(v),
            Some(("timeout", v)) => {
                let secs = v.parse::<f64>().ok().filter(|s| s.is_finite() && *s > 0.0);
                let secs = secs.with_context(|| format!("timeout={v}: give seconds, e.g. 10"))?;
                config = config.connect_timeout(std::time::Duration::from_secs_f64(secs));
            }
            _ => bail!("unknown or empty option {part:?}; expected {FORM}"),
        }
    }
    Ok((config, size))
}

/// The pool behind the exports: its store, the pool made in it, and the engine itself when
/// it runs in this process (for its memory gauges).
pub struct OpenedPool {
    store: Arc<dyn AsyncPageStore>,
    pool: fallow_core::PoolId,
    engine: Option<Arc<Engine>>,
}

/// Opens `--pool` and makes the exports' pool in it: a private one, or with `shared`
/// (`--state-dir`) the shared pool of that UUID, which a restarted process attaches to again.
async fn open_pool(args: &ExportArgs, shared: Option<u128>) -> anyhow::Result<Option<OpenedPool>> {
    let mut engine = None;
    let pool_text = args.pool();
    let store: Arc<dyn AsyncPageStore> = if pool_text == "none" {
        return Ok(None);
    } else if let Some(size) = pool_text.strip_prefix("local:") {
        let budget = parse_size(size).with_context(|| format!("--pool {pool_text}"))?;
        let config = EngineBuilder::new(usize::try_from(budget).unwrap_or(usize::MAX)).build()?;
        let local = Arc::new(Engine::new(config));
        engine = Some(local.clone());
        local
    } else if pool_text.starts_with("fallow://") {
        let Some(secret_file) = &args.secret_file else {
            bail!("--pool {pool_text} needs --secret-file");
        };
        let secret = fallow_node::config::read_secret(secret_file).map_err(anyhow::Error::msg)?;
        let tls = args.node_tls.client()?;
        open_remote(pool_text, secret, tls).await.with_context(|| format!("pool {pool_text}"))?
    } else {
        bail!("--pool {pool_text:?}: expected none, local:SIZE, fallow://HOST:PORT or fallow://A,B,...");
    };
    let mut spec = PoolSpec { compress: args.compress, ..PoolSpec::ephemeral() };
    if let Some(uuid) = shared {
        spec = spec.shared(uuid);
    }
    let pool = store.create_pool(&spec).await?;
    Ok(Some(OpenedPool { store, pool, engine }))
}

/// Connects to `fallow://…`: a cluster client for a list of seeds, or for one node that
/// gossips with live peers; a plain client for a node alone.
async fn open_remote(
    pool: &str,
    secret: Vec<u8>,
    tls: Option<fallow_tls::TlsClient>,
) -> anyhow::Result<Arc<dyn AsyncPageStore>> {
    use fallow_client::{Client, ClientConfig, ClusterClient, ClusterClientConfig, MemberState};
    if !pool.contains(',') {
        let config = ClientConfig::new(pool, secret.clone())?
            .name("fallow-nbd")
            .connections(2)
            .tls(tls.clone());
        let client = Client::connect(config).await?;
        // A node too old to know MEMBERS, or one that does not gossip, is used alone.
        let members = client.members().await.unwrap_or_default();
        let live = members.iter().filter(|m| m.state != MemberState::Dead).count();
        if live <= 1 {
            tracing::info!(node = pool, "caching in one node");
            return Ok(Arc::new(client));
        }
    }
    let config = ClusterClientConfig::new(pool, secret)?
        .per_node(|c| c.name("fallow-nbd").connections(2).tls(tls));
    let cluster = ClusterClient::connect(config).await?;
    tracing::info!(nodes = cluster.nodes().len(), "caching in a cluster");
    Ok(Arc::new(cluster))
}

#[cfg(all(test, feature = "rados"))]
mod tests {
    use super::*;
    use fallow_backing::RadosConfig;

    #[test]
    fn rados_specs_parse_and_bad_ones_say_the_form() {
        let (config, size) =
            parse_rados("cache/img,size=64M,conf=/c.conf,user=client.bob,namespace=t,timeout=2.5")
                .unwrap();
        let want = RadosConfig::new("cache", "img")
            .conf("/c.conf")
            .user("bob")
            .namespace("t")
            .connect_timeout(std::time::Duration::from_millis(2500));
        assert_eq!((config, size), (want, Some(64 << 20)));
        let (config, size) = parse_rados("p/dir/img").unwrap();
        assert_eq!(config.image(), "rados:p/dir/img");
        assert_eq!(size, None);
        let bad = ["cache", "/img", "cache/", "cache/img,size=lots", "cache/img,color=red"];
        for bad in bad.into_iter().chain(["cache/img,timeout=0", "cache/img,timeout=soon"]) {
            let err = format!("{:#}", parse_rados(bad).unwrap_err());
            let named = ["size=", "POOL/PREFIX", "timeout="].iter().any(|w| err.contains(w));
            assert!(named, "{bad}: {err}");
        }
    }
}
