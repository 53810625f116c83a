//! What to boot: the guest's memory, CPUs, disks, script and time limit, turned into a
//! QEMU command line; and which accelerator runs it.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use super::{cache, Guest, MinimalImage};

/// One virtio disk of a guest. Disks appear in the guest as `/dev/vda`, `/dev/vdb`, … in
/// the order they were added.
#[derive(Debug, Clone)]
pub enum Disk {
    /// An NBD export, e.g. `nbd://127.0.0.1:10809/disk` (QEMU's own NBD client).
    Nbd {
        /// The export's URI.
        uri: String,
        /// QEMU's `reconnect-delay` in seconds: how long the client keeps retrying a lost
        /// server before it fails requests (0: fail at once).
        reconnect_delay_s: u32,
    },
    /// A raw image file on the host.
    File {
        /// The image.
        path: PathBuf,
        /// Attached read-only.
        read_only: bool,
    },
    /// Any other disk QEMU can open, as the start of a `-drive` option string (e.g.
    /// `file=rbd:POOL/IMAGE:conf=PATH`, QEMU's own RADOS driver); `format=raw,if=virtio`
    /// is appended.
    Drive {
        /// The options.
        options: String,
    },
    /// A vhost-user-blk backend listening on a Unix socket (the guest's memory is then
    /// shared through a memfd). QEMU reconnects within half a second when the backend goes
    /// away and comes back; the guest's requests wait meanwhile.
    VhostUser {
        /// The backend's socket.
        socket: PathBuf,
        /// Queues the device offers.
        queues: u16,
    },
}

impl Disk {
    /// An NBD export that fails requests at once if its server goes away.
    pub fn nbd(uri: &str) -> Disk {
        Disk::Nbd { uri: uri.to_string(), reconnect_delay_s: 0 }
    }

    /// A writable raw image file.
    pub fn file(path: &Path) -> Disk {
        Disk::File { path: path.to_path_buf(), read_only: false }
    }

    /// QEMU's arguments for this disk, the `index`th.
    fn qemu_args(&self, index: usize) -> Vec<String> {
        match self {
            Disk::Nbd { uri, reconnect_delay_s } => {
                // cache=writeback (QEMU's default) lets the guest see a volatile write
                // cache, so its fsync and sync become NBD FLUSH requests.
                let mut drive = format!("file={uri},format=raw,if=virtio,cache=writeback");
                if *reconnect_delay_s > 0 {
                    drive.push_str(&format!(",file.reconnect-delay={reconnect_delay_s}"));
                }
                vec!["-drive".into(), drive]
            }
            Disk::File { path, read_only } => {
                let ro = if *read_only { ",readonly=on" } else { "" };
                vec![
                    "-drive".into(),
                    format!("file={},format=raw,if=virtio,cache=writeback{ro}", path.display()),
                ]
            }
            Disk::Drive { options } => {
                vec!["-drive".into(), format!("{options},format=raw,if=virtio")]
            }
            Disk::VhostUser { socket, queues } => vec![
                "-chardev".into(),
                format!("socket,id=vhost{index},path={},reconnect-ms=500", socket.display()),
                "-device".into(),
                format!("vhost-user-blk-pci,chardev=vhost{index},num-queues={queues}"),
            ],
        }
    }
}

/// Where the script runs.
#[derive(Debug, Clone)]
pub struct RootFs {
    /// The guest's device holding an ext4 file system, e.g. `/dev/vda`.
    pub device: String,
    /// Mounted read-write (else read-only).
    pub writable: bool,
}

/// What to boot and run.
#[derive(Debug, Clone)]
pub struct GuestSpec {
    /// Guest memory in MiB.
    pub memory_mib: u32,
    /// Virtual CPUs.
    pub cpus: u32,
    /// The disks, `/dev/vda` first.
    pub disks: Vec<Disk>,
    /// The shell script the guest runs (busybox `sh` in the initramfs; the root file
    /// system's `/bin/sh` with [`GuestSpec::root`]). Its exit status is the guest's.
    pub script: String,
    /// Chroot into this file system for the script; `None` runs it in the initramfs.
    pub root: Option<RootFs>,
    /// How long the guest may run, boot included, before it is killed.
    pub time_limit: Duration,
}

impl GuestSpec {
    /// A guest of 256 MiB and one CPU that runs `script` in its initramfs, with no disks
    /// and a time limit of two minutes.
    pub fn new(script: &str) -> GuestSpec {
        GuestSpec {
            memory_mib: 256,
            cpus: 1,
            disks: Vec::new(),
            script: script.to_string(),
            root: None,
            time_limit: Duration::from_secs(120),
        }
    }

    /// Adds a disk (the next of `/dev/vda`, `/dev/vdb`, …).
    pub fn disk(mut self, disk: Disk) -> GuestSpec {
        self.disks.push(disk);
        self
    }

    /// Sets the guest's memory.
    pub fn memory_mib(mut self, mib: u32) -> GuestSpec {
        self.memory_mib = mib;
        self
    }

    /// Sets the number of virtual CPUs.
    pub fn cpus(mut self, cpus: u32) -> GuestSpec {
        self.cpus = cpus;
        self
    }

    /// Runs the script chrooted into the ext4 file system on `device`.
    pub fn root(mut self, device: &str, writable: bool) -> GuestSpec {
        self.root = Some(RootFs { device: device.to_string(), writable });
        self
    }

    /// Sets the time limit.
    pub fn time_limit(mut self, limit: Duration) -> GuestSpec {
        self.time_limit = limit;
        self
    }

    /// The kernel command line.
    pub(super) fn kernel_args(&self) -> String {
        let mut args =
            format!("console=ttyS0 quiet loglevel=3 panic=-1 fallow.disks={}", self.disks.len());
        if let Some(root) = &self.root {
            args.push_str(&format!(" fallow.root={}", root.device));
            if root.writable {
                args.push_str(" fallow.rootrw=1");
            }
        }
        args
    }

    /// QEMU's arguments, but for the kernel, initramfs and command line.
    pub(super) fn qemu_args(&self, accel: Accel) -> Vec<String> {
        let mut args: Vec<String> = [
            "-nodefaults",
            "-no-reboot",
            "-display",
            "none",
            "-serial",
            "stdio",
            "-monitor",
            "none",
        ]
        .map(String::from)
        .to_vec();
        args.extend(accel.qemu_args());
        args.extend([
            "-smp".into(),
            self.cpus.to_string(),
            "-m".into(),
            self.memory_mib.to_string(),
        ]);
        if self.disks.iter().any(|d| matches!(d, Disk::VhostUser { .. })) {
            // vhost-user backends map the guest's memory, so it must be shareable.
            args.extend([
                "-object".into(),
                format!("memory-backend-memfd,id=mem,size={}M,share=on", self.memory_mib),
                "-machine".into(),
                "memory-backend=mem".into(),
            ]);
        }
        for (index, disk) in self.disks.iter().enumerate() {
            args.extend(disk.qemu_args(index));
        }
        args
    }
}

/// How QEMU runs the guest's CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Accel {
    /// Hardware virtualisation.
    Kvm,
    /// QEMU's software emulation: slower by an order of magnitude, works everywhere.
    Tcg,
}

impl Accel {
    /// Its name, as QEMU's `-accel` and the benchmark records spell it.
    pub fn name(self) -> &'static str {
        match self {
            Accel::Kvm => "kvm",
            Accel::Tcg => "tcg",
        }
    }

    fn qemu_args(self) -> Vec<String> {
        match self {
            Accel::Kvm => vec!["-accel".into(), "kvm".into(), "-cpu".into(), "host".into()],
            Accel::Tcg => vec!["-accel".into(), "tcg".into(), "-cpu".into(), "max".into()],
        }
    }
}

/// How long the KVM probe waits for the guest to boot and power off. A KVM guest that
/// works does it in about a second; on a host whose KVM cannot run a standard guest, it
/// hangs in the firmware.
const KVM_PROBE_LIMIT: Duration = Duration::from_secs(10);

/// The accelerator guests use on this host: `$FALLOW_GUEST_ACCEL` (`kvm` or `tcg`) when
/// set; else KVM if `/dev/kvm` can be opened and a probe guest boots with it within
/// [`KVM_PROBE_LIMIT`]; else TCG. The probe runs once per host boot (its answer is kept
/// in the cache, keyed by the boot id and the QEMU binary) and the choice is logged.
pub fn accel(image: &MinimalImage) -> Accel {
    static CHOSEN: OnceLock<Accel> = OnceLock::new();
    *CHOSEN.get_or_init(|| {
        let accel = choose_accel(image);
        eprintln!("guest: using {} (set FALLOW_GUEST_ACCEL to choose)", accel.name());
        accel
    })
}

fn choose_accel(image: &MinimalImage) -> Accel {
    match std::env::var("FALLOW_GUEST_ACCEL").as_deref() {
        Ok("kvm") => return Accel::Kvm,
        Ok("tcg") => return Accel::Tcg,
        _ => {}
    }
    if std::fs::File::options().read(true).write(true).open("/dev/kvm").is_err() {
        return Accel::Tcg;
    }
    let remembered = probe_record();
    if let Some(path) = &remembered {
        match std::fs::read_to_string(path).as_deref() {
            Ok("kvm") => return Accel::Kvm,
            Ok("tcg") => return Accel::Tcg,
            _ => {}
        }
    }
    let spec = GuestSpec::new("true").time_limit(KVM_PROBE_LIMIT);
    let accel = match Guest::boot_with(image, &spec, Accel::Kvm).and_then(|g| g.finish()) {
        Ok(out) if out.exit_code == 0 => Accel::Kvm,
        Ok(out) => {
            eprintln!("guest: the KVM probe guest exited with {}; not using KVM", out.exit_code);
            Accel::Tcg
        }
        Err(e) => {
            let first = e.to_string().lines().next().unwrap_or_default().to_string();
            eprintln!("guest: KVM cannot boot the guest here ({first}); not using KVM");
            Accel::Tcg
        }
    };
    if let Some(path) = remembered {
        let _ = std::fs::write(path, accel.name());
    }
    accel
}

/// Where the probe's answer is kept: a file named by the host's boot id and the QEMU
/// binary's size and change time, so a reboot or a new QEMU probes again.
fn probe_record() -> Option<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let qemu = which("qemu-system-x86_64")?;
    let meta = std::fs::metadata(qemu).ok()?;
    let key = cache::key(&[
        boot_id.trim().as_bytes(),
        &meta.size().to_le_bytes(),
        &meta.ctime().to_le_bytes(),
    ]);
    Some(cache::root().ok()?.join(format!("accel-{key}")))
}

/// The path of `program` on `$PATH`.
pub(super) fn which(program: &str) -> Option<PathBuf> {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {program}"))
        .stderr(Stdio::null())
        .output()
        .ok()?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
    (out.status.success() && !path.is_empty()).then(|| PathBuf::from(path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn disks_are_virtio_drives_in_order_and_vhost_user_shares_memory() {
        let spec = GuestSpec::new("true")
            .memory_mib(128)
            .disk(Disk::Nbd { uri: "nbd://127.0.0.1:1/a".into(), reconnect_delay_s: 5 })
            .disk(Disk::File { path: "/tmp/x.img".into(), read_only: true })
            .disk(Disk::VhostUser { socket: "/tmp/v.sock".into(), queues: 2 })
            .disk(Disk::Drive { options: "file=rbd:p/i:conf=/c".into() });
        let args = spec.qemu_args(Accel::Tcg).join(" ");
        let nbd = args.find("file=nbd://127.0.0.1:1/a,").unwrap();
        let file = args.find("file=/tmp/x.img,").unwrap();
        let vhost = args.find("vhost-user-blk-pci,chardev=vhost2,num-queues=2").unwrap();
        let rbd = args.find("file=rbd:p/i:conf=/c,format=raw,if=virtio").unwrap();
        assert!(nbd < file && file < vhost && vhost < rbd, "{args}");
        assert!(args.contains("file.reconnect-delay=5"), "{args}");
        assert!(args.contains("readonly=on"), "{args}");
        assert!(args.contains("memory-backend-memfd,id=mem,size=128M,share=on"), "{args}");
        assert!(args.contains("-accel tcg"), "{args}");
        assert_eq!(spec.kernel_args(), "console=ttyS0 quiet loglevel=3 panic=-1 fallow.disks=4");
    }

    #[test]
    fn a_root_file_system_is_named_on_the_kernel_command_line() {
        let spec = GuestSpec::new("true").disk(Disk::nbd("nbd://h/a")).root("/dev/vda", true);
        assert!(spec
            .kernel_args()
            .ends_with("fallow.disks=1 fallow.root=/dev/vda fallow.rootrw=1"));
        let plain = GuestSpec::new("true").qemu_args(Accel::Kvm).join(" ");
        assert!(!plain.contains("memory-backend"), "{plain}");
        assert!(plain.contains("-accel kvm -cpu host"), "{plain}");
    }
}
