//! The benchmark guest's root file system: Debian (the host's release) made with
//! `mmdebstrap --variant=essential` plus fio, sqlite3, postmark, e2fsprogs and the tools
//! a workload script needs, written as an ext4 image with `mke2fs -d` (no mount, no loop
//! device). It boots with the minimal image's kernel and initramfs, whose init chroots
//! the script into it ([`super::GuestSpec::root`]).
//!
//! The image is keyed by the candidate versions of the packages asked for (what apt, and
//! so mmdebstrap, would install now) and by this recipe; building it needs root (the
//! chroot's device nodes and ownership) and Debian's mirror, and takes about a minute.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::debs;
use super::{cache, ext4_image, run_step, GuestError};

/// What the benchmarks run, beyond the `essential` variant. `mount` and `util-linux` for
/// mounting data disks; `procps` for `free` and `vmstat`.
pub const PACKAGES: [&str; 7] =
    ["fio", "sqlite3", "postmark", "e2fsprogs", "util-linux", "mount", "procps"];

/// The image's size: the tree is about 240 MB; the rest leaves room for a workload that
/// mounts it read-write.
const IMAGE_BYTES: u64 = 1 << 30;

/// Bumped when the recipe below changes.
const RECIPE: &[u8] = b"debian image recipe 1: essential, no docs, man or locales";

/// The Debian root file system image, in the cache.
#[derive(Debug, Clone)]
pub struct DebianImage {
    dir: PathBuf,
}

impl DebianImage {
    /// The image, built first if the cache does not hold it for the current package
    /// versions.
    pub fn get() -> Result<DebianImage, GuestError> {
        let mut labels = vec![String::from_utf8_lossy(RECIPE).to_string(), suite()?];
        for name in ["mmdebstrap"].iter().chain(PACKAGES.iter()) {
            labels.push(debs::candidate(name)?.label());
        }
        let parts: Vec<&[u8]> = labels.iter().map(|l| l.as_bytes()).collect();
        let key = cache::key(&parts);
        let dir = cache::build_once("debian", &key, |dir| build(dir, &labels))?;
        Ok(DebianImage { dir })
    }

    /// The ext4 image of the root file system. Attach it read-only (several guests may
    /// share it), or copy it for a guest that writes.
    pub fn root_image(&self) -> PathBuf {
        self.dir.join("root.ext4")
    }

    /// What the image was built from, one package per line.
    pub fn versions(&self) -> String {
        std::fs::read_to_string(self.dir.join("versions.txt")).unwrap_or_default()
    }
}

/// The host's Debian release name (`bookworm`), the suite the image is made from.
fn suite() -> Result<String, GuestError> {
    let release = std::fs::read_to_string("/etc/os-release").unwrap_or_default();
    release
        .lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|s| s.trim_matches('"').to_string())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| GuestError::Image {
            step: "finding the host's Debian release".to_string(),
            detail: "/etc/os-release has no VERSION_CODENAME".to_string(),
        })
}

fn build(dir: &Path, labels: &[String]) -> Result<(), GuestError> {
    let tree = dir.join("tree");
    let suite = suite()?;
    let mut cmd = Command::new("mmdebstrap");
    cmd.args(["--quiet", "--variant=essential", "--mode=root"])
        .arg(format!("--include={}", PACKAGES.join(",")))
        .args(["--aptopt=APT::Install-Recommends \"false\""])
        .args(["--aptopt=APT::Install-Suggests \"false\""]);
    // Documentation, manual pages and translations are not read by any workload; leaving
    // them out halves the image.
    for rule in [
        "path-exclude=/usr/share/man/*",
        "path-exclude=/usr/share/locale/*",
        "path-include=/usr/share/locale/locale.alias",
        "path-exclude=/usr/share/doc/*",
        "path-include=/usr/share/doc/*/copyright",
        "path-exclude=/usr/share/info/*",
    ] {
        cmd.arg(format!("--dpkgopt={rule}"));
    }
    cmd.arg("--customize-hook=rm -rf \"$1\"/var/cache/apt/* \"$1\"/var/lib/apt/lists/*")
        .arg(&suite)
        .arg(&tree)
        .arg("http://deb.debian.org/debian");
    run_step("mmdebstrap (Debian package mmdebstrap; needs root)", &mut cmd)?;
    ext4_image(&tree, &dir.join("root.ext4"), IMAGE_BYTES)?;
    std::fs::write(dir.join("versions.txt"), labels.join("\n") + "\n")
        .map_err(super::image_io("noting versions"))?;
    std::fs::remove_dir_all(&tree).map_err(super::image_io("removing the tree"))
}
