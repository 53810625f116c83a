//! `--state-dir`: what `fallow nbd` keeps across restarts so that a restarted export
//! starts warm: the UUID of the shared pool its exports cache in (on a node or cluster,
//! which outlives the process), each export's object id in it, and, after a clean stop, a
//! mark saying that the pool's pages of that export match its backing store.
//!
//! ```text
//!  DIR/lock        held (flock) while a fallow nbd uses DIR: one at a time
//!  DIR/state.json  {"pool_uuid": "…", "exports": {"NAME": {"object": N, "clean": {…} | null}}}
//! ```
//!
//! The mark is taken (removed from the file, on disk) before the export serves, and
//! written back only by a clean stop that wrote every dirty page to the store and handed
//! the local tier to the pool. So after a crash, or a stop whose flush failed, there is no
//! mark and the export invalidates its pages in the pool before serving: cold, never
//! stale. A mark names the backing store (its spec and size, and for a file its device,
//! inode and modification time), so a store changed or replaced while the export was
//! stopped is not trusted either. What no mark can see is an upstream NBD or RADOS store
//! written by someone else while the export was stopped: the cache assumes, stopped as
//! running, that it is the store's only writer (docs/nbd.md).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::{Deserialize, Serialize};

/// How long a starting process waits for the one before it to let go of the directory.
const LOCK_WAIT: Duration = Duration::from_secs(30);

/// What a clean stop records about one export's backing store.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleanMark {
    /// The BACKING text of `--export`.
    pub spec: String,
    /// The store's size in bytes.
    pub size: u64,
    /// For a file or block device: `DEV:INODE:MTIME_NS`; `None` for other stores.
    pub fingerprint: Option<String>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct ExportState {
    object: u64,
    clean: Option<CleanMark>,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct State {
    /// Hex, 32 digits.
    pool_uuid: String,
    exports: BTreeMap<String, ExportState>,
}

/// The state directory, locked for this process.
#[derive(Debug)]
pub struct StateDir {
    dir: PathBuf,
    state: State,
    /// Held for the process's life: the flock goes with the descriptor.
    _lock: File,
}

impl StateDir {
    /// Creates `dir` if needed, takes its lock (waiting up to 30 s for a process still
    /// stopping), and reads the state, making a pool UUID the first time.
    pub fn open(dir: &Path) -> anyhow::Result<StateDir> {
        std::fs::create_dir_all(dir).with_context(|| format!("--state-dir {}", dir.display()))?;
        let lock_path = dir.join("lock");
        let lock = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .with_context(|| format!("opening {}", lock_path.display()))?;
        let deadline = Instant::now() + LOCK_WAIT;
        loop {
            match rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => break,
                Err(rustix::io::Errno::WOULDBLOCK) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(50));
                }
                Err(rustix::io::Errno::WOULDBLOCK) => bail!(
                    "--state-dir {}: another fallow nbd uses it (still after {LOCK_WAIT:?})",
                    dir.display()
                ),
                Err(err) => bail!("locking {}: {err}", lock_path.display()),
            }
        }
        let path = dir.join("state.json");
        let mut state = match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .with_context(|| format!("{}: not a fallow state file", path.display()))?,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => State::default(),
            Err(err) => return Err(err).with_context(|| format!("reading {}", path.display())),
        };
        if u128::from_str_radix(&state.pool_uuid, 16).is_err() {
            state.pool_uuid = format!("{:032x}", rand::random::<u128>());
        }
        let mut opened = StateDir { dir: dir.to_path_buf(), state, _lock: lock };
        opened.save()?;
        Ok(opened)
    }

    /// The UUID of the shared pool the exports cache in.
    pub fn pool_uuid(&self) -> u128 {
        u128::from_str_radix(&self.state.pool_uuid, 16).unwrap_or_default()
    }

    /// The object id of export `name` in the pool: kept from run to run, a new one for a
    /// name not seen before.
    pub fn object(&mut self, name: &str) -> u64 {
        if let Some(export) = self.state.exports.get(name) {
            return export.object;
        }
        let next = self.state.exports.values().map(|e| e.object + 1).max().unwrap_or(0);
        self.state.exports.insert(name.to_string(), ExportState { object: next, clean: None });
        next
    }

    /// Takes export `name`'s clean mark, and records on disk that it is gone, before the
    /// export serves.
    pub fn take_clean(&mut self, name: &str) -> anyhow::Result<Option<CleanMark>> {
        let mark = self.state.exports.get_mut(name).and_then(|e| e.clean.take());
        self.save()?;
        Ok(mark)
    }

    /// Records that export `name` stopped cleanly over the store `mark` describes.
    pub fn mark_clean(&mut self, name: &str, mark: CleanMark) -> anyhow::Result<()> {
        let object = self.object(name);
        self.state.exports.insert(name.to_string(), ExportState { object, clean: Some(mark) });
        self.save()
    }

    /// Writes the state: a new file, synced, renamed over the old, the directory synced.
    fn save(&mut self) -> anyhow::Result<()> {
        use std::io::Write;
        let path = self.dir.join("state.json");
        let tmp = self.dir.join("state.json.new");
        let mut file = File::create(&tmp).with_context(|| format!("writing {}", tmp.display()))?;
        file.write_all(&serde_json::to_vec_pretty(&self.state)?)?;
        file.sync_all()?;
        std::fs::rename(&tmp, &path).with_context(|| format!("writing {}", path.display()))?;
        File::open(&self.dir)?.sync_all()?;
        Ok(())
    }
}

/// The mark of a store as it is now: its spec, size, and for a file or block device what
/// tells it from another file at the same path, or the same file changed.
pub fn current_mark(spec: &str, size: u64) -> CleanMark {
    let path = spec.strip_prefix("file:").unwrap_or(spec);
    let path = path.split(',').next().unwrap_or(path);
    let fingerprint = file_fingerprint(path);
    CleanMark { spec: spec.to_string(), size, fingerprint }
}

fn file_fingerprint(path: &str) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some(format!("{}:{}:{}.{:09}", meta.dev(), meta.ino(), meta.mtime(), meta.mtime_nsec()))
}

/// Whether a store's pages in the pool can be trusted at start: stores whose data lives
/// only in this process (`mem:`) never can.
pub fn survives_restart(spec: &str) -> bool {
    !spec.starts_with("mem:")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fallow-warm-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn keeps_the_uuid_and_object_ids_and_hands_a_mark_out_once() {
        let dir = scratch("state");
        let mark = CleanMark { spec: "file:/x".into(), size: 4096, fingerprint: None };
        let uuid = {
            let mut state = StateDir::open(&dir).unwrap();
            assert_eq!((state.object("a"), state.object("b"), state.object("a")), (0, 1, 0));
            state.mark_clean("b", mark.clone()).unwrap();
            state.pool_uuid()
        };
        let mut state = StateDir::open(&dir).unwrap();
        assert_eq!(state.pool_uuid(), uuid);
        assert_ne!(uuid, 0);
        assert_eq!(state.object("b"), 1);
        assert_eq!(state.take_clean("a").unwrap(), None);
        assert_eq!(state.take_clean("b").unwrap(), Some(mark));
        drop(state);
        // Taken means gone, on disk too.
        assert_eq!(StateDir::open(&dir).unwrap().take_clean("b").unwrap(), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_file_changed_behind_the_mark_does_not_match() {
        let dir = scratch("mark");
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("disk.img");
        std::fs::write(&file, [0u8; 4096]).unwrap();
        let spec = format!("file:{},size=4096", file.display());
        let before = current_mark(&spec, 4096);
        assert!(before.fingerprint.is_some());
        assert_eq!(current_mark(&spec, 4096), before);
        std::thread::sleep(Duration::from_millis(10));
        std::fs::write(&file, [1u8; 4096]).unwrap();
        assert_ne!(current_mark(&spec, 4096), before);
        assert!(!survives_restart("mem:1G") && survives_restart(&spec));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_second_process_cannot_take_the_directory() {
        let dir = scratch("lock");
        let _held = StateDir::open(&dir).unwrap();
        let lock = File::options().write(true).open(dir.join("lock")).unwrap();
        assert_eq!(
            rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive),
            Err(rustix::io::Errno::WOULDBLOCK)
        );
        drop(_held);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
