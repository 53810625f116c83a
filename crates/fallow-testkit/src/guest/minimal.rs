//! The minimal guest: Debian's cloud kernel and an initramfs of busybox, the kernel's
//! virtio modules, `fallow-guest-tool` (compiled here, statically) and `guest/init.sh`.
//! It boots in a few seconds under TCG and is what the tests use.

use std::path::{Path, PathBuf};
use std::process::Command;

use super::debs::{self, Package};
use super::{cache, image_io, run_step, Cpio, GuestError};

/// PID 1 of every guest.
const INIT: &str = include_str!("../../guest/init.sh");

/// The guest tool's source: pattern writes and checks, and a memory hog.
const TOOL_SOURCE: &str = include_str!("../../guest/fallow-guest-tool.c");

/// Bumped when the way an image is put together changes, so cached images are rebuilt.
const LAYOUT: &[u8] = b"minimal image layout 1";

/// The virtio modules the cloud kernel does not build in, in the order they load (each
/// needs only those before it). ext4 is built in.
pub(super) const MODULES: [&str; 6] = [
    "drivers/virtio/virtio_ring",
    "drivers/virtio/virtio",
    "drivers/virtio/virtio_pci_modern_dev",
    "drivers/virtio/virtio_pci_legacy_dev",
    "drivers/virtio/virtio_pci",
    "drivers/block/virtio_blk",
];

/// The kernel and base initramfs of the minimal guest, in the cache.
#[derive(Debug, Clone)]
pub struct MinimalImage {
    /// The image's cache directory.
    dir: PathBuf,
}

impl MinimalImage {
    /// The image, built first if the cache does not hold it for the current package
    /// versions and harness sources.
    pub fn get() -> Result<MinimalImage, GuestError> {
        let kernel = debs::cloud_kernel()?;
        let busybox = debs::candidate("busybox-static")?;
        let key = cache::key(&[
            LAYOUT,
            kernel.label().as_bytes(),
            busybox.label().as_bytes(),
            INIT.as_bytes(),
            TOOL_SOURCE.as_bytes(),
        ]);
        let dir = cache::build_once("minimal", &key, |dir| build(dir, &kernel, &busybox))?;
        Ok(MinimalImage { dir })
    }

    /// The kernel to boot.
    pub fn kernel(&self) -> PathBuf {
        self.dir.join("vmlinuz")
    }

    /// The base initramfs (a run appends its own archive to it).
    pub fn initramfs(&self) -> PathBuf {
        self.dir.join("initramfs.cpio")
    }

    /// `busybox` from the image, a static binary that also runs on the host: for root file
    /// systems that tests put together.
    pub fn busybox(&self) -> PathBuf {
        self.dir.join("busybox")
    }

    /// `fallow-guest-tool`, statically linked: the guests run it, and the host runs the
    /// same binary to check what a guest wrote to a backing file.
    pub fn tool(&self) -> PathBuf {
        self.dir.join("fallow-guest-tool")
    }

    /// What the image was built from, one package per line.
    pub fn versions(&self) -> String {
        std::fs::read_to_string(self.dir.join("versions.txt")).unwrap_or_default()
    }
}

/// Builds the image into the empty directory `dir`.
fn build(dir: &Path, kernel: &Package, busybox: &Package) -> Result<(), GuestError> {
    let unpacked = dir.join("unpacked");
    debs::unpack(kernel, &unpacked)?;
    debs::unpack(busybox, &unpacked)?;
    let release = kernel.name.trim_start_matches("linux-image-");
    std::fs::copy(unpacked.join(format!("boot/vmlinuz-{release}")), dir.join("vmlinuz"))
        .map_err(image_io("copying the kernel"))?;
    std::fs::copy(unpacked.join("bin/busybox"), dir.join("busybox"))
        .map_err(image_io("copying busybox"))?;
    compile_tool(dir)?;

    let mut cpio = Cpio::new();
    cpio.dir("dev").dir("proc").dir("sys").dir("tmp").dir("run");
    cpio.file("init", 0o755, INIT.as_bytes().to_vec());
    cpio.file("bin/busybox", 0o755, read(&dir.join("busybox"))?);
    cpio.file("bin/fallow-guest-tool", 0o755, read(&dir.join("fallow-guest-tool"))?);
    let modules = unpacked.join(format!("lib/modules/{release}/kernel"));
    for module in MODULES {
        let name = module.rsplit('/').next().unwrap_or(module);
        let ko = read(&modules.join(format!("{module}.ko")))?;
        cpio.file(&format!("lib/modules/{name}.ko"), 0o644, ko);
    }
    cpio.write_to(&dir.join("initramfs.cpio"))?;
    let versions = format!("{}\n{}\n", kernel.label(), busybox.label());
    std::fs::write(dir.join("versions.txt"), versions).map_err(image_io("noting versions"))?;
    std::fs::remove_dir_all(&unpacked).map_err(image_io("removing unpacked packages"))
}

/// Compiles `fallow-guest-tool` statically into `dir`.
fn compile_tool(dir: &Path) -> Result<(), GuestError> {
    let source = dir.join("fallow-guest-tool.c");
    std::fs::write(&source, TOOL_SOURCE).map_err(image_io("writing the tool's source"))?;
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    run_step(
        "compiling fallow-guest-tool (a static build needs libc6-dev)",
        Command::new(cc)
            .args(["-static", "-O2", "-Wall", "-o"])
            .arg(dir.join("fallow-guest-tool"))
            .arg(&source),
    )?;
    Ok(())
}

/// The bytes of `path`, as an image-building step.
fn read(path: &Path) -> Result<Vec<u8>, GuestError> {
    std::fs::read(path).map_err(image_io(&format!("reading {}", path.display())))
}

/// Makes an ext4 file system image of `size` bytes at `image` whose contents are the tree
/// under `tree` (`mke2fs -d`: no mount, no loop device, no root needed for the copy).
pub fn ext4_image(tree: &Path, image: &Path, size: u64) -> Result<(), GuestError> {
    let step = format!("making an ext4 image of {}", tree.display());
    let _ = std::fs::remove_file(image);
    run_step(
        &step,
        Command::new("mke2fs")
            .args(["-q", "-F", "-t", "ext4", "-E", "root_owner=0:0", "-d"])
            .arg(tree)
            .arg(image)
            .arg(format!("{}k", size / 1024)),
    )?;
    Ok(())
}
