//! Where guest images live: a directory outside the repository, one subdirectory per
//! image and key (`minimal-3f2a…`), built once and reused until its key changes.
//!
//! The root is `$FALLOW_GUEST_CACHE`, else `$XDG_CACHE_HOME/fallow-guest`, else
//! `~/.cache/fallow-guest`. Builds take an exclusive `flock` on `ROOT/lock`, so tests
//! running in parallel (threads or processes) build an image once and the others wait for
//! it; a build happens in a temporary directory that is renamed into place only when
//! complete, so a build that was killed leaves nothing that looks finished. Older keys of
//! the same image are removed after a new one is built.

use std::fs::File;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::{image_io, GuestError};

/// The cache's root directory (created if missing).
pub fn root() -> Result<PathBuf, GuestError> {
    let root = if let Some(dir) = std::env::var_os("FALLOW_GUEST_CACHE") {
        PathBuf::from(dir)
    } else if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        PathBuf::from(dir).join("fallow-guest")
    } else if let Some(home) = std::env::var_os("HOME") {
        PathBuf::from(home).join(".cache/fallow-guest")
    } else {
        std::env::temp_dir().join("fallow-guest-cache")
    };
    std::fs::create_dir_all(&root).map_err(image_io("creating the cache directory"))?;
    Ok(root)
}

/// A key for the given parts (package versions, sources): 16 hex digits of their SHA-256.
pub fn key(parts: &[&[u8]]) -> String {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    hash.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
}

/// The exclusive lock on the cache, held while an image is built; released when dropped.
pub struct Lock(File);

impl Lock {
    /// Waits for and takes the cache's lock.
    pub fn take(root: &Path) -> Result<Lock, GuestError> {
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(root.join("lock"))
            .map_err(image_io("opening the cache lock"))?;
        rustix::fs::flock(&file, rustix::fs::FlockOperation::LockExclusive)
            .map_err(|e| image_io("locking the cache")(e.into()))?;
        Ok(Lock(file))
    }
}

impl Drop for Lock {
    fn drop(&mut self) {
        let _ = rustix::fs::flock(&self.0, rustix::fs::FlockOperation::Unlock);
    }
}

/// The directory of image `name` under `key`, built by `build` (into an empty directory it
/// is given) if it is not there yet. `build` runs with the cache locked.
pub fn build_once(
    name: &str,
    key: &str,
    build: impl FnOnce(&Path) -> Result<(), GuestError>,
) -> Result<PathBuf, GuestError> {
    let root = root()?;
    let dir = root.join(format!("{name}-{key}"));
    if dir.join("COMPLETE").exists() {
        return Ok(dir);
    }
    let _lock = Lock::take(&root)?;
    if dir.join("COMPLETE").exists() {
        return Ok(dir); // another process built it while this one waited
    }
    let partial = root.join(format!(".{name}-{key}.partial"));
    let _ = std::fs::remove_dir_all(&partial);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&partial).map_err(image_io("creating the build directory"))?;
    eprintln!("guest: building the {name} image into {}", dir.display());
    build(&partial)?;
    std::fs::write(partial.join("COMPLETE"), key).map_err(image_io("finishing the image"))?;
    std::fs::rename(&partial, &dir).map_err(image_io("moving the image into place"))?;
    remove_other_keys(&root, name, key);
    Ok(dir)
}

/// Removes the directories of image `name` under keys other than `key`.
fn remove_other_keys(root: &Path, name: &str, key: &str) {
    let Ok(entries) = std::fs::read_dir(root) else { return };
    let prefix = format!("{name}-");
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        let file_name = file_name.to_string_lossy();
        if let Some(other) = file_name.strip_prefix(&prefix) {
            if other != key && other.len() == key.len() {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_changes_with_any_part_and_with_where_parts_split() {
        let base = key(&[b"linux 6.1", b"busybox 1.35"]);
        assert_eq!(base.len(), 16);
        assert_eq!(base, key(&[b"linux 6.1", b"busybox 1.35"]));
        assert_ne!(base, key(&[b"linux 6.2", b"busybox 1.35"]));
        assert_ne!(key(&[b"ab", b"c"]), key(&[b"a", b"bc"]));
    }
}
