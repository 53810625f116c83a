//! Debian packages as the guests' raw material: the version apt would install, fetched
//! with `apt-get download` into the cache (`ROOT/debs/`), unpacked with `dpkg-deb -x`.
//! Nothing is installed on the host.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::{cache, image_io, run_step, GuestError};

/// The metapackage that names the current cloud kernel.
const KERNEL_METAPACKAGE: &str = "linux-image-cloud-amd64";

/// A package at the version apt would fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Package {
    /// Its name, e.g. `busybox-static`.
    pub name: String,
    /// Its version, e.g. `1:1.35.0-4+deb12u1+b1`.
    pub version: String,
}

impl Package {
    /// `NAME VERSION`, as the image keys and version notes record it.
    pub fn label(&self) -> String {
        format!("{} {}", self.name, self.version)
    }
}

/// The candidate version of package `name` (what `apt-get download` would fetch).
pub fn candidate(name: &str) -> Result<Package, GuestError> {
    let step = format!("finding package {name}");
    let out = run_step(&step, Command::new("apt-cache").args(["policy", name]))?;
    let text = String::from_utf8_lossy(&out.stdout);
    match parse_candidate(&text) {
        Some(version) => Ok(Package { name: name.to_string(), version }),
        None => Err(GuestError::Image {
            step,
            detail: format!(
                "apt knows no installable version (run `apt-get update`?); apt-cache said: {}",
                text.trim()
            ),
        }),
    }
}

/// The `Candidate:` line of `apt-cache policy` output, unless it is `(none)`.
fn parse_candidate(policy: &str) -> Option<String> {
    let version = policy.lines().find_map(|l| l.trim().strip_prefix("Candidate:"))?.trim();
    (!version.is_empty() && version != "(none)").then(|| version.to_string())
}

/// The versioned kernel package the cloud metapackage depends on, e.g.
/// `linux-image-6.1.0-56-cloud-amd64`.
pub fn cloud_kernel() -> Result<Package, GuestError> {
    let step = format!("finding the kernel {KERNEL_METAPACKAGE} depends on");
    let out = run_step(&step, Command::new("apt-cache").args(["depends", KERNEL_METAPACKAGE]))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let name = parse_kernel_dependency(&text).ok_or_else(|| GuestError::Image {
        step,
        detail: format!("no linux-image dependency in: {}", text.trim()),
    })?;
    candidate(&name)
}

/// The first `Depends: linux-image-…` of `apt-cache depends` output.
fn parse_kernel_dependency(depends: &str) -> Option<String> {
    depends.lines().find_map(|l| {
        let dep = l.trim().strip_prefix("Depends:")?.trim();
        dep.starts_with("linux-image-").then(|| dep.to_string())
    })
}

/// The `.deb` of `package`, downloaded into the cache unless it is there already.
pub fn fetch(package: &Package) -> Result<PathBuf, GuestError> {
    let debs = cache::root()?.join("debs");
    let file_version = package.version.replace(':', "%3a");
    let path = debs.join(format!("{}_{file_version}.deb", package.name));
    if path.exists() {
        return Ok(path);
    }
    let step = format!("downloading {}", package.label());
    let download = debs.join(format!(".download-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&download);
    std::fs::create_dir_all(&download).map_err(image_io(&step))?;
    let fetched = run_step(
        &step,
        Command::new("apt-get")
            .args(["download", "-q", &format!("{}={}", package.name, package.version)])
            .current_dir(&download),
    )
    .and_then(|_| single_deb(&download, &step))
    .and_then(|deb| std::fs::rename(deb, &path).map_err(image_io(&step)));
    let _ = std::fs::remove_dir_all(&download);
    fetched.map(|()| path)
}

/// The one `.deb` file in `dir`.
fn single_deb(dir: &Path, step: &str) -> Result<PathBuf, GuestError> {
    let mut debs = std::fs::read_dir(dir)
        .map_err(image_io(step))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "deb"));
    match (debs.next(), debs.next()) {
        (Some(deb), None) => Ok(deb),
        _ => Err(GuestError::Image {
            step: step.to_string(),
            detail: "apt-get download did not leave exactly one .deb".to_string(),
        }),
    }
}

/// Unpacks `package` (fetched if needed) into `dest`.
pub fn unpack(package: &Package, dest: &Path) -> Result<(), GuestError> {
    let deb = fetch(package)?;
    std::fs::create_dir_all(dest).map_err(image_io("creating an unpack directory"))?;
    run_step(
        &format!("unpacking {}", package.label()),
        Command::new("dpkg-deb").arg("-x").arg(&deb).arg(dest),
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_candidate_line_is_found_and_none_is_no_version() {
        let policy = "busybox-static:\n  Installed: (none)\n  Candidate: 1:1.35.0-4+deb12u1+b1\n  Version table:\n";
        assert_eq!(parse_candidate(policy).as_deref(), Some("1:1.35.0-4+deb12u1+b1"));
        assert_eq!(parse_candidate("x:\n  Installed: (none)\n  Candidate: (none)\n"), None);
        assert_eq!(parse_candidate(""), None);
    }

    #[test]
    fn the_kernel_is_the_linux_image_dependency() {
        let depends = "linux-image-cloud-amd64\n  Depends: linux-image-6.1.0-56-cloud-amd64\n";
        assert_eq!(
            parse_kernel_dependency(depends).as_deref(),
            Some("linux-image-6.1.0-56-cloud-amd64")
        );
        assert_eq!(parse_kernel_dependency("x\n  Depends: libc6\n"), None);
    }
}
