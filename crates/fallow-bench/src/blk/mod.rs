//! `fallow bench blk`: block-device load from a small virtio-blk driver of our own, so a
//! vhost-user-blk backend's latency is measured without an emulated guest, and the same
//! load over NBD for side-by-side runs.
//!
//! The driver plays the part QEMU and a guest's virtio-blk driver play together: it shares
//! a memfd as the guest's memory through the vhost-user memory table, lays out split
//! virtqueues in it, writes requests, kicks, and reaps completions from the used ring,
//! spinning by default. It drives any vhost-user-blk backend the same way:
//! qemu-storage-daemon's export is the reference, `fallow vhost` the subject. Its floor is
//! measured against the null device, a thread in this process that completes every
//! request at once on the same rings.
//!
//! # Components
//!
//! [`memory`]: the memfd guest memory, checked accesses, canaries. [`layout`]: where rings,
//! headers, buffers and the scratch area live. [`ring`]: the split virtqueue (descriptors,
//! available and used rings, event indexes). [`request`]: virtio-blk headers, statuses,
//! features, configuration. [`notify`]: kick and call eventfds. [`frontend`]: the
//! vhost-user handshake (rust-vmm's `vhost` frontend). The null device (private).
//! [`driver`]: the [`Driver`], with a slot API for the load loop, one-request helpers, and
//! raw chains for hostile tests. The load loops (private): the ring one and the NBD one
//! (through `fallow_backing::NbdStore`). [`report`]: latency histogram and the report.
//!
//! # A hostile chain, step by step
//!
//! ```no_run
//! # use std::time::Duration;
//! # use fallow_bench::blk::{Driver, DriverOptions, ring::Descriptor, request};
//! # fn main() -> Result<(), fallow_bench::blk::BlkError> {
//! let mut d = Driver::vhost_user("/run/fallow/disk.sock".as_ref(), &DriverOptions::default())?;
//! let s = d.layout().scratch().start; // buffers go in the scratch area
//! let first = d.layout().free_descriptors().start; // descriptors no slot uses
//! d.memory().fill_canary(s, 1 << 16)?;
//! d.memory().write(s, &request::header(request::RequestType::In.into(), 0)[..8])?;
//! let head = d.place_chain(0, first, &[
//!     Descriptor::readable(s, 8), // a header shorter than 16 bytes
//!     Descriptor::writable(s + 4096, 4096),
//!     Descriptor::writable(s + 8192, 1),
//! ])?;
//! d.publish(0, head)?;
//! let used = d.wait_used(0, head, Duration::from_secs(5))?;
//! let status = request::Status::from(d.memory().read_u8(s + 8192)?);
//! let damage = d.memory().canary_damage(s, 1 << 16, &[s..s + 8, s + 8192..s + 8193])?;
//! assert!(damage.is_empty() && used.len <= 1 && status == request::Status::IoErr);
//! # Ok(()) }
//! ```

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

pub mod driver;
pub mod frontend;
pub mod layout;
pub mod memory;
mod nbd;
pub mod notify;
mod null;
pub mod report;
pub mod request;
pub mod ring;
mod run;

pub use driver::{Completion, Driver, DriverOptions, Op, Request};
pub use report::{BlkReport, LatencyUs};
pub use run::run;

/// The device under test, from `--target`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BlkTarget {
    /// `vhost-user:PATH`: a vhost-user-blk backend's socket.
    VhostUser(PathBuf),
    /// `nbd://HOST:PORT/NAME` or `nbd+unix:///NAME?socket=PATH`.
    Nbd(String),
    /// `null`: the driver's floor (see the module documentation).
    Null,
}

impl FromStr for BlkTarget {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "null" {
            return Ok(BlkTarget::Null);
        }
        if let Some(path) = s.strip_prefix("vhost-user:") {
            if path.is_empty() {
                return Err("vhost-user: needs the socket's path".into());
            }
            return Ok(BlkTarget::VhostUser(PathBuf::from(path)));
        }
        if s.starts_with("nbd://") || s.starts_with("nbd+unix://") {
            fallow_backing::NbdUri::parse(s).map_err(|e| e.to_string())?;
            return Ok(BlkTarget::Nbd(s.to_string()));
        }
        Err(format!(
            "expected vhost-user:PATH, nbd://HOST:PORT/NAME, nbd+unix:///NAME?socket=PATH or \
             null, not {s:?}"
        ))
    }
}

impl fmt::Display for BlkTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlkTarget::VhostUser(path) => write!(f, "vhost-user:{}", path.display()),
            BlkTarget::Nbd(uri) => f.write_str(uri),
            BlkTarget::Null => f.write_str("null"),
        }
    }
}

/// The access pattern, from `--rw` (fio's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rw {
    /// Reads at uniformly random block-aligned offsets.
    RandRead,
    /// Writes at uniformly random block-aligned offsets.
    RandWrite,
    /// Reads in order, wrapping at the end of the range.
    Read,
    /// Writes in order, wrapping at the end of the range.
    Write,
}

impl Rw {
    /// Its name, as `--rw` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Rw::RandRead => "randread",
            Rw::RandWrite => "randwrite",
            Rw::Read => "read",
            Rw::Write => "write",
        }
    }

    /// Whether it writes.
    pub fn writes(self) -> bool {
        matches!(self, Rw::RandWrite | Rw::Write)
    }

    /// Whether offsets are random.
    pub fn random(self) -> bool {
        matches!(self, Rw::RandRead | Rw::RandWrite)
    }
}

impl FromStr for Rw {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Rw::RandRead, Rw::RandWrite, Rw::Read, Rw::Write]
            .into_iter()
            .find(|rw| rw.name() == s)
            .ok_or_else(|| format!("expected randread, randwrite, read or write, not {s:?}"))
    }
}

impl fmt::Display for Rw {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How the driver waits for completions, from `--wait`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Spin on the used ring (the default): the device's latency, not the driver's wake-up.
    Spin,
    /// Sleep on the call eventfd, as a guest waits for an interrupt.
    Call,
}

impl Wait {
    /// Its name, as `--wait` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Wait::Spin => "spin",
            Wait::Call => "call",
        }
    }
}

impl FromStr for Wait {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "spin" => Ok(Wait::Spin),
            "call" => Ok(Wait::Call),
            _ => Err(format!("expected spin or call, not {s:?}")),
        }
    }
}

/// Everything a run needs; [`BlkOptions::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct BlkOptions {
    /// The device under test.
    pub target: BlkTarget,
    /// The access pattern.
    pub rw: Rw,
    /// Bytes per request (whole sectors).
    pub bs: u32,
    /// Requests kept in flight, per queue.
    pub qd: u16,
    /// How long to issue requests.
    pub duration: Duration,
    /// The bytes addressed, from offset 0 (`None`: the whole disk).
    pub range: Option<u64>,
    /// Queues (vhost-user and null), each with `qd` in flight, all driven by one thread.
    pub queues: u16,
    /// How the driver waits (vhost-user and null).
    pub wait: Wait,
    /// Seed of the random offsets and of the written data.
    pub seed: u64,
}

impl BlkOptions {
    /// The defaults: randread of 4 KiB at QD 1 on one queue for 5 s over the whole disk,
    /// spinning.
    pub fn new(target: BlkTarget) -> BlkOptions {
        BlkOptions {
            target,
            rw: Rw::RandRead,
            bs: 4096,
            qd: 1,
            duration: Duration::from_secs(5),
            range: None,
            queues: 1,
            wait: Wait::Spin,
            seed: 1,
        }
    }
}

/// The disk size the null device claims.
pub const NULL_CAPACITY: u64 = 1 << 30;

/// What can stop a run, or a driver.
#[derive(Debug, thiserror::Error)]
pub enum BlkError {
    /// An option or argument is out of range.
    #[error("{0}")]
    Options(String),
    /// The device could not be reached.
    #[error("cannot connect to {target}: {source}")]
    Connect {
        /// The socket or URI.
        target: String,
        /// Why.
        source: std::io::Error,
    },
    /// A vhost-user handshake step failed.
    #[error("vhost-user {step}: {message}")]
    Handshake {
        /// The request that failed.
        step: &'static str,
        /// Why.
        message: String,
    },
    /// The backend lacks something the driver needs.
    #[error("{0}")]
    Unsupported(String),
    /// An access to the driver's guest memory failed.
    #[error(transparent)]
    Memory(#[from] memory::MemoryError),
    /// A system call failed.
    #[error("i/o: {0}")]
    Io(std::io::Error),
    /// The device hung up (or the NBD connection failed).
    #[error("disconnected: {0}")]
    Disconnected(String),
    /// The device broke the virtio rules (a used element for a chain never made available).
    #[error("device: {0}")]
    Device(String),
    /// Nothing completed in time.
    #[error("no completion within {0:?}")]
    Stalled(Duration),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_and_modes_parse() {
        assert_eq!("null".parse::<BlkTarget>().unwrap(), BlkTarget::Null);
        let v: BlkTarget = "vhost-user:/run/d.sock".parse().unwrap();
        assert_eq!(v, BlkTarget::VhostUser("/run/d.sock".into()));
        assert_eq!(v.to_string(), "vhost-user:/run/d.sock");
        let n: BlkTarget = "nbd://127.0.0.1:10809/disk".parse().unwrap();
        assert_eq!(n.to_string(), "nbd://127.0.0.1:10809/disk");
        assert!("nbd+unix:///disk?socket=/run/n.sock".parse::<BlkTarget>().is_ok());
        for bad in ["", "vhost-user:", "nbd+unix:///disk", "file:/x", "nbd://"] {
            assert!(bad.parse::<BlkTarget>().is_err(), "{bad:?} parsed");
        }
        for rw in ["randread", "randwrite", "read", "write"] {
            assert_eq!(rw.parse::<Rw>().unwrap().to_string(), rw);
        }
        assert!("rw".parse::<Rw>().is_err());
        assert!(Rw::RandWrite.writes() && Rw::RandWrite.random() && !Rw::Read.random());
        assert_eq!("call".parse::<Wait>().unwrap(), Wait::Call);
        assert!("poll".parse::<Wait>().is_err());
    }
}
