//! Real virtual machines for fallow's tests and benchmarks.
//!
//! A guest is Debian's cloud kernel and a small initramfs (busybox, the virtio modules,
//! `fallow-guest-tool`, and `guest/init.sh` as PID 1), booted by `qemu-system-x86_64`
//! with any number of virtio disks: NBD URIs, image files, or vhost-user sockets. The
//! harness hands the guest one shell script, runs it (in the initramfs, or chrooted into
//! an ext4 root file system on one of the disks), and reads what it reports from the
//! serial console: `FALLOW-RESULT KEY VALUE` lines and a closing `FALLOW-EXIT STATUS`.
//! Every guest has a time limit; one that passes it is killed and reported, with its
//! console, never left running.
//!
//! # Components
//!
//! [`MinimalImage`]: the kernel and the base initramfs, built from Debian packages
//! (`apt-get download`, unpacked, never installed) into a cache directory outside the
//! repository ([`cache`]), keyed by the packages' versions and the harness's own sources,
//! so it is rebuilt only when one of them changes. [`DebianImage`]: an ext4 root file
//! system made with `mmdebstrap` (fio, sqlite3, postmark, e2fsprogs) for benchmarks.
//! [`GuestSpec`] and [`Disk`]: what to boot. [`Guest`]: a running guest, its console,
//! its result. [`Accel`]: KVM when this host can boot the guest with it (probed once per
//! host boot, with a short time limit), else TCG.
//!
//! # Why a chroot and not a real init
//!
//! The guests exist to drive block I/O through fallow, not to test a distribution's boot.
//! Under TCG, systemd alone takes longer than the whole minimal guest, so PID 1 stays the
//! initramfs's shell: it mounts the root file system the host named, chroots the script
//! into it, and unmounts it cleanly afterwards, so the host can `fsck` the image.

pub mod cache;
mod debian;
mod debs;
mod initramfs;
mod machine;
mod minimal;
mod running;

pub use debian::DebianImage;
pub use initramfs::Cpio;
pub use machine::{accel, Accel, Disk, GuestSpec, RootFs};
pub use minimal::{ext4_image, MinimalImage};
pub use running::{Guest, GuestOutput};

use std::process::{Command, Output};

/// What can go wrong while building an image or running a guest.
#[derive(Debug, thiserror::Error)]
pub enum GuestError {
    /// A step of building an image failed: a package could not be found or fetched, the
    /// guest tool did not compile, an image could not be made.
    #[error("building the guest image: {step}: {detail}")]
    Image {
        /// What was being done.
        step: String,
        /// Why it failed (a command's stderr, an I/O error).
        detail: String,
    },
    /// QEMU could not be started, or a file the run needs could not be written.
    #[error("starting the guest: {0}")]
    Start(String),
    /// The guest did not finish within its time limit; it was killed.
    #[error("the guest did not {what} within {limit:?} and was killed; its console:\n{console}")]
    TimedOut {
        /// What it was expected to do.
        what: String,
        /// The limit that passed.
        limit: std::time::Duration,
        /// The last lines of its console and QEMU's own messages.
        console: String,
    },
    /// QEMU exited before the guest reported its exit status (a kernel panic, a QEMU
    /// error, a guest that powered off early).
    #[error("the guest stopped before it could {what} (QEMU {status}); its console:\n{console}")]
    Died {
        /// What it was expected to do.
        what: String,
        /// QEMU's exit status.
        status: String,
        /// The last lines of its console and QEMU's own messages.
        console: String,
    },
}

/// Runs `cmd` to completion; a failure to start it or a non-zero exit is a
/// [`GuestError::Image`] naming `step`, with the command's stderr.
fn run_step(step: &str, cmd: &mut Command) -> Result<Output, GuestError> {
    let out = cmd
        .output()
        .map_err(|e| GuestError::Image { step: step.to_string(), detail: e.to_string() })?;
    if !out.status.success() {
        return Err(GuestError::Image {
            step: step.to_string(),
            detail: format!(
                "{:?} exited with {}: {}",
                cmd.get_program(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        });
    }
    Ok(out)
}

/// An I/O error during `step` of an image build, as a [`GuestError::Image`].
fn image_io(step: &str) -> impl FnOnce(std::io::Error) -> GuestError + '_ {
    move |e| GuestError::Image { step: step.to_string(), detail: e.to_string() }
}
