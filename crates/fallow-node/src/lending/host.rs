//! What the host's memory looks like right now, and where that is read from.
//!
//! # Components
//! [`HostMemory`]: one sample (MemAvailable, memory PSI, the cgroup v2 limit that binds us,
//! our own resident size). [`MemorySource`]: anything that can take a sample.
//! [`ProcSource`]: the real one, over `/proc` and the cgroup v2 filesystem.
//! [`SimulatedSource`]: a handle whose values a test sets.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use super::procfs::{self, ProcParseError};

/// One sample of the host's memory, in bytes unless named otherwise.
#[derive(Debug, Clone, PartialEq)]
pub struct HostMemory {
    /// `MemTotal`.
    pub total: u64,
    /// `MemAvailable`: what the host could still allocate without swapping. Memory this
    /// process already holds is *not* in it.
    pub available: u64,
    /// Memory PSI, `some avg10`: percent of the last 10 s in which a task stalled on memory.
    /// 0 when the kernel has no PSI.
    pub psi_some_avg10: f64,
    /// Memory PSI, `some total`: microseconds stalled since boot (a counter). 0 without PSI.
    pub psi_some_total_us: u64,
    /// The cgroup v2 level that limits this process most, if it runs in a cgroup v2 with
    /// the memory controller on.
    pub cgroup: Option<CgroupMemory>,
    /// `VmRSS` of this process, when the source can tell (exported, never used to decide).
    pub process_rss: Option<u64>,
    /// Free memory on the kernel's per-CPU page lists, which `available` leaves out (see
    /// [`procfs::parse_zoneinfo_percpu_pages`]). 0 when not read: the governor asks for it
    /// ([`MemorySource::percpu_free`]) only when a shrink is on the table.
    pub percpu_free: u64,
}

impl HostMemory {
    /// A sample of an idle host with no PSI and no cgroup: for tests and simulations.
    pub fn idle(total: u64, available: u64) -> Self {
        Self {
            total,
            available,
            psi_some_avg10: 0.0,
            psi_some_total_us: 0,
            cgroup: None,
            process_rss: None,
            percpu_free: 0,
        }
    }

    /// Memory that could still be given to us: `available` plus the free pages on per-CPU
    /// lists, and in a limited cgroup also what is left under the limit (the smaller of the
    /// two). Like `available`, it leaves out what this process already holds.
    pub fn free_for_us(&self) -> u64 {
        let host = self.available.saturating_add(self.percpu_free);
        match self.cgroup.as_ref().and_then(CgroupMemory::headroom) {
            Some(headroom) => host.min(headroom),
            None => host,
        }
    }

    /// The memory this process could ever use: `total`, or the cgroup limit if smaller.
    pub fn effective_total(&self) -> u64 {
        match self.cgroup.as_ref().and_then(CgroupMemory::limit) {
            Some(limit) => self.total.min(limit),
            None => self.total,
        }
    }
}

/// One cgroup v2 level's memory files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupMemory {
    /// `memory.max`; `None` for `max` (no limit).
    pub max: Option<u64>,
    /// `memory.high` (where the kernel starts throttling and reclaiming); `None` for `max`
    /// or when the file is absent.
    pub high: Option<u64>,
    /// `memory.current`: everything charged to the cgroup, page cache included.
    pub current: u64,
}

impl CgroupMemory {
    /// The lower of `max` and `high`, if either is set.
    pub fn limit(&self) -> Option<u64> {
        match (self.max, self.high) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// What is left under the limit (`None` without a limit). Conservative: page cache
    /// charged to the cgroup counts as used, though the kernel could reclaim it.
    pub fn headroom(&self) -> Option<u64> {
        self.limit().map(|limit| limit.saturating_sub(self.current))
    }
}

/// Takes samples of the host's memory. Implementations MUST NOT block for long (the
/// governor calls `sample` every tick) and MUST return an error, not a guess, when they
/// cannot read what they need: the governor then keeps the budget as it is.
pub trait MemorySource {
    /// One sample, now.
    fn sample(&mut self) -> io::Result<HostMemory>;

    /// Bytes of free pages on the kernel's per-CPU lists, which `MemAvailable` leaves out;
    /// `None` when unknown. Dearer than a sample (one line per zone and CPU), so the
    /// governor asks only when the sample says the budget should shrink: memory the node
    /// has just unmapped can sit on those lists, and without them the governor would take
    /// its own release for more demand and give back again (and again).
    fn percpu_free(&mut self) -> Option<u64> {
        None
    }
}

/// Reads `/proc/meminfo`, `/proc/pressure/memory`, `/proc/self/status` and, when this
/// process is in a cgroup v2 with the memory controller on, `memory.max`, `memory.high`
/// and `memory.current` of its cgroup and of every ancestor up to the mount's root (a
/// parent's limit binds its children too); and, when asked, `/proc/zoneinfo` (with the
/// page size from `/proc/self/auxv`).
#[derive(Debug)]
pub struct ProcSource {
    /// Prepended to every absolute path read: `/` on a real host, a fixture tree in tests.
    root: PathBuf,
    /// The cgroup directories with memory files, ours first; `None` until found (found on
    /// the first sample, and again after a read of one of them fails).
    cgroup_dirs: Option<Vec<PathBuf>>,
    /// The missing PSI file has been logged (it is logged once, not every tick).
    psi_missing_logged: bool,
    /// The kernel's page size; read from `/proc/self/auxv` the first time it is needed.
    page_size: Option<u64>,
    /// A failure to read the per-CPU lists has been logged (once).
    percpu_failure_logged: bool,
}

impl Default for ProcSource {
    fn default() -> Self {
        Self::new()
    }
}

impl ProcSource {
    /// Reads the real `/proc` and `/sys`.
    pub fn new() -> Self {
        Self::with_root("/")
    }

    /// Reads `root/proc/…` and the cgroup mounts under `root`: for tests on a fixture tree.
    pub fn with_root(root: impl Into<PathBuf>) -> Self {
        Self {
            root: root.into(),
            cgroup_dirs: None,
            psi_missing_logged: false,
            page_size: None,
            percpu_failure_logged: false,
        }
    }

    fn path(&self, absolute: impl AsRef<Path>) -> PathBuf {
        let absolute = absolute.as_ref();
        self.root.join(absolute.strip_prefix("/").unwrap_or(absolute))
    }

    fn read(&self, absolute: &str) -> io::Result<String> {
        std::fs::read_to_string(self.path(absolute))
    }

    fn psi(&mut self) -> io::Result<procfs::Psi> {
        match self.read("/proc/pressure/memory") {
            Ok(text) => procfs::parse_psi(&text).map_err(invalid),
            // No PSI (kernel < 4.20, or built without it, or `psi=0`): the governor follows
            // MemAvailable alone.
            Err(e) if matches!(e.kind(), io::ErrorKind::NotFound | io::ErrorKind::Unsupported) => {
                self.log_psi_missing(&e);
                Ok(procfs::Psi { some_avg10: 0.0, some_total_us: 0 })
            }
            // Some kernels have the file but refuse to read it when PSI is off at boot.
            Err(e) if e.raw_os_error() == Some(95) => {
                self.log_psi_missing(&e);
                Ok(procfs::Psi { some_avg10: 0.0, some_total_us: 0 })
            }
            Err(e) => Err(e),
        }
    }

    fn log_psi_missing(&mut self, e: &io::Error) {
        if !self.psi_missing_logged {
            self.psi_missing_logged = true;
            tracing::info!(error = %e, "no memory PSI on this host; lending follows MemAvailable only");
        }
    }

    /// The directories of this process's cgroup and its ancestors that have memory files,
    /// ours first. Empty when there is no usable cgroup v2.
    fn find_cgroup_dirs(&self) -> Vec<PathBuf> {
        let Ok(text) = self.read("/proc/self/cgroup") else { return Vec::new() };
        let Some(path) = procfs::parse_cgroup_v2_path(&text) else { return Vec::new() };
        let mut mounts = match self.read("/proc/self/mountinfo") {
            Ok(text) => procfs::parse_cgroup2_mounts(&text),
            Err(_) => Vec::new(),
        };
        if mounts.is_empty() {
            mounts.push(procfs::CgroupMount {
                root: "/".to_string(),
                mount_point: "/sys/fs/cgroup".to_string(),
            });
        }
        // The mount whose root is the longest prefix of our path shows our cgroup.
        let best = mounts
            .iter()
            .filter_map(|m| {
                let rel = Path::new(path).strip_prefix(&m.root).ok()?;
                Some((m.root.len(), self.path(&m.mount_point), rel.to_path_buf()))
            })
            .max_by_key(|(len, _, _)| *len);
        let Some((_, mount_point, rel)) = best else { return Vec::new() };
        // Ours, then each ancestor, down to the mount point itself (inside a cgroup
        // namespace the mount point is our own, limited, cgroup).
        let mut dirs = Vec::new();
        let mut rel = Some(rel.as_path());
        while let Some(r) = rel {
            let dir = mount_point.join(r);
            if dir.join("memory.current").is_file() || dir.join("memory.max").is_file() {
                dirs.push(dir);
            }
            rel = r.parent();
        }
        dirs
    }

    /// The level with the least headroom under its limit; or, when no level is limited, our
    /// own level's usage with no limit.
    fn cgroup(&mut self) -> io::Result<Option<CgroupMemory>> {
        let dirs = match self.cgroup_dirs.take() {
            Some(dirs) => dirs,
            None => self.find_cgroup_dirs(),
        };
        let mut tightest: Option<CgroupMemory> = None;
        let mut own: Option<CgroupMemory> = None;
        for dir in &dirs {
            // On an error `cgroup_dirs` is left `None`, so the next sample looks for our
            // cgroup again (it may have been moved or removed).
            let level = read_cgroup_level(dir)?;
            own.get_or_insert(level);
            if let Some(headroom) = level.headroom() {
                if tightest.and_then(|t| t.headroom()).is_none_or(|t| headroom < t) {
                    tightest = Some(level);
                }
            }
        }
        self.cgroup_dirs = Some(dirs);
        Ok(tightest.or(own))
    }
}

fn read_cgroup_level(dir: &Path) -> io::Result<CgroupMemory> {
    let read = |name: &str| std::fs::read_to_string(dir.join(name));
    let optional = |name: &'static str| -> io::Result<Option<u64>> {
        match read(name) {
            Ok(text) => procfs::parse_cgroup_limit(name, &text).map_err(invalid),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(e),
        }
    };
    Ok(CgroupMemory {
        max: optional("memory.max")?,
        high: optional("memory.high")?,
        current: procfs::parse_cgroup_bytes("memory.current", &read("memory.current")?)
            .map_err(invalid)?,
    })
}

fn invalid(e: ProcParseError) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl MemorySource for ProcSource {
    fn sample(&mut self) -> io::Result<HostMemory> {
        let mem = procfs::parse_meminfo(&self.read("/proc/meminfo")?).map_err(invalid)?;
        let psi = self.psi()?;
        let cgroup = self.cgroup()?;
        // Exported only, so a failure to read it is not a failure of the sample.
        let process_rss =
            self.read("/proc/self/status").ok().and_then(|t| procfs::parse_vm_rss(&t).ok());
        Ok(HostMemory {
            total: mem.total,
            available: mem.available,
            psi_some_avg10: psi.some_avg10,
            psi_some_total_us: psi.some_total_us,
            cgroup,
            process_rss,
            percpu_free: 0,
        })
    }

    fn percpu_free(&mut self) -> Option<u64> {
        let pages = self
            .read("/proc/zoneinfo")
            .and_then(|text| procfs::parse_zoneinfo_percpu_pages(&text).map_err(invalid));
        let pages = match pages {
            Ok(pages) => pages,
            Err(e) => {
                if !self.percpu_failure_logged {
                    self.percpu_failure_logged = true;
                    tracing::info!(
                        error = %e,
                        "cannot read the per-CPU free lists; lending follows MemAvailable alone"
                    );
                }
                return None;
            }
        };
        let page_size = *self.page_size.get_or_insert_with(|| {
            std::fs::read(self.root.join("proc/self/auxv"))
                .ok()
                .and_then(|bytes| procfs::parse_auxv_page_size(&bytes))
                .unwrap_or(4096)
        });
        Some(pages.saturating_mul(page_size))
    }
}

/// A [`MemorySource`] whose samples a test sets. Clones share the same values, so a test
/// keeps one clone and hands another to the governor.
#[derive(Debug, Clone)]
pub struct SimulatedSource {
    /// The next sample, or the kind of error the next samples fail with.
    state: Arc<Mutex<Result<HostMemory, io::ErrorKind>>>,
}

impl SimulatedSource {
    /// A source that returns `sample` until told otherwise.
    pub fn new(sample: HostMemory) -> Self {
        Self { state: Arc::new(Mutex::new(Ok(sample))) }
    }

    /// Replaces the sample.
    pub fn set(&self, sample: HostMemory) {
        *self.state.lock() = Ok(sample);
    }

    /// Changes the sample in place (a failing source starts from an idle, empty host).
    pub fn update(&self, change: impl FnOnce(&mut HostMemory)) {
        let mut state = self.state.lock();
        let mut sample = state.clone().unwrap_or_else(|_| HostMemory::idle(0, 0));
        change(&mut sample);
        *state = Ok(sample);
    }

    /// Sets `available`.
    pub fn set_available(&self, available: u64) {
        self.update(|s| s.available = available);
    }

    /// Adds `stalled_us` to the PSI total and sets `avg10`.
    pub fn add_stall(&self, stalled_us: u64, avg10: f64) {
        self.update(|s| {
            s.psi_some_total_us += stalled_us;
            s.psi_some_avg10 = avg10;
        });
    }

    /// Makes every sample fail with `kind` until the next `set` or `update`.
    pub fn fail(&self, kind: io::ErrorKind) {
        *self.state.lock() = Err(kind);
    }

    /// The current sample (`None` while failing).
    pub fn current(&self) -> Option<HostMemory> {
        self.state.lock().clone().ok()
    }
}

impl MemorySource for SimulatedSource {
    fn sample(&mut self) -> io::Result<HostMemory> {
        self.state.lock().clone().map_err(|kind| io::Error::new(kind, "simulated failure"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// A fixture tree under the system temp directory, removed on drop.
    struct Tree(PathBuf);

    impl Tree {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "fallow-host-{name}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }

        fn write(&self, path: &str, text: &str) {
            self.write_bytes(path, text.as_bytes());
        }

        fn write_bytes(&self, path: &str, bytes: &[u8]) {
            let path = self.0.join(path.trim_start_matches('/'));
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, bytes).unwrap();
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn base_tree(name: &str) -> Tree {
        let t = Tree::new(name);
        t.write("/proc/meminfo", "MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n");
        t.write("/proc/pressure/memory", "some avg10=2.50 avg60=0 avg300=0 total=777\n");
        t.write("/proc/self/status", "VmRSS:\t2048 kB\n");
        t
    }

    #[test]
    fn free_for_us_takes_the_tighter_of_host_and_cgroup() {
        let mut h = HostMemory::idle(16 * GIB, 8 * GIB);
        assert_eq!(h.free_for_us(), 8 * GIB);
        h.cgroup = Some(CgroupMemory { max: Some(4 * GIB), high: None, current: GIB });
        assert_eq!(h.free_for_us(), 3 * GIB);
        assert_eq!(h.effective_total(), 4 * GIB);
        h.cgroup = Some(CgroupMemory { max: Some(4 * GIB), high: Some(2 * GIB), current: 3 * GIB });
        assert_eq!(h.free_for_us(), 0, "over memory.high: nothing left");
        h.cgroup = Some(CgroupMemory { max: None, high: None, current: GIB });
        assert_eq!(h.free_for_us(), 8 * GIB);
        assert_eq!(h.effective_total(), 16 * GIB);
    }

    #[test]
    fn proc_source_reads_a_host_without_cgroup_v2() {
        let t = base_tree("plain");
        t.write("/proc/self/cgroup", "4:memory:/x\n0::/\n");
        let s = ProcSource::with_root(&t.0).sample().unwrap();
        assert_eq!(s.total, 16 * GIB);
        assert_eq!(s.available, 8 * GIB);
        assert_eq!(s.psi_some_avg10, 2.5);
        assert_eq!(s.psi_some_total_us, 777);
        assert_eq!(s.cgroup, None);
        assert_eq!(s.process_rss, Some(2 << 20));
    }

    #[test]
    fn free_for_us_counts_the_per_cpu_lists_on_the_host_side_only() {
        let mut h = HostMemory::idle(16 * GIB, 8 * GIB);
        h.percpu_free = GIB;
        assert_eq!(h.free_for_us(), 9 * GIB);
        // A cgroup's headroom is exact (freed pages are uncharged at once): it still binds.
        h.cgroup = Some(CgroupMemory { max: Some(4 * GIB), high: None, current: GIB });
        assert_eq!(h.free_for_us(), 3 * GIB);
    }

    #[test]
    fn proc_source_reads_the_per_cpu_lists_when_asked() {
        let t = base_tree("percpu");
        let mut source = ProcSource::with_root(&t.0);
        assert_eq!(source.sample().unwrap().percpu_free, 0, "not read by a sample");
        assert_eq!(source.percpu_free(), None, "no zoneinfo");
        assert!(source.percpu_failure_logged);
        t.write(
            "/proc/zoneinfo",
            "Node 0, zone Normal\n  pagesets\n    cpu: 0\n      count: 100\n\
             \x20   cpu: 1\n      count: 28\n",
        );
        let mut auxv = Vec::new();
        for (key, value) in [(6usize, 16384usize), (0, 0)] {
            auxv.extend_from_slice(&key.to_ne_bytes());
            auxv.extend_from_slice(&value.to_ne_bytes());
        }
        t.write_bytes("/proc/self/auxv", &auxv);
        assert_eq!(source.percpu_free(), Some(128 * 16384));
    }

    #[test]
    fn proc_source_without_psi_reports_zero() {
        let t = Tree::new("nopsi");
        t.write("/proc/meminfo", "MemTotal: 1024 kB\nMemAvailable: 512 kB\n");
        let mut source = ProcSource::with_root(&t.0);
        for _ in 0..2 {
            let s = source.sample().unwrap();
            assert_eq!((s.psi_some_avg10, s.psi_some_total_us), (0.0, 0));
            assert_eq!(s.process_rss, None);
        }
        assert!(source.psi_missing_logged);
    }

    #[test]
    fn proc_source_fails_clearly_on_bad_meminfo() {
        let t = base_tree("bad");
        t.write("/proc/meminfo", "MemTotal: 1024 kB\n");
        let err = ProcSource::with_root(&t.0).sample().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert_eq!(err.to_string(), "/proc/meminfo: no MemAvailable field");
        let missing = ProcSource::with_root(t.0.join("nowhere")).sample().unwrap_err();
        assert_eq!(missing.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn proc_source_finds_the_tightest_cgroup_level() {
        let t = base_tree("cgroup");
        t.write("/proc/self/cgroup", "0::/system.slice/fallow.service\n");
        t.write(
            "/proc/self/mountinfo",
            "30 1 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
        );
        let cg = "/sys/fs/cgroup/system.slice";
        // Our own level: a loose limit. The parent: tight (2 GiB, 1.5 GiB used).
        t.write(&format!("{cg}/fallow.service/memory.max"), "6442450944\n");
        t.write(&format!("{cg}/fallow.service/memory.high"), "max\n");
        t.write(&format!("{cg}/fallow.service/memory.current"), "1073741824\n");
        t.write(&format!("{cg}/memory.max"), "2147483648\n");
        t.write(&format!("{cg}/memory.current"), "1610612736\n");
        let mut source = ProcSource::with_root(&t.0);
        let s = source.sample().unwrap();
        let c = s.cgroup.unwrap();
        assert_eq!(c, CgroupMemory { max: Some(2 * GIB), high: None, current: 3 * GIB / 2 });
        assert_eq!(s.free_for_us(), GIB / 2);

        // The parent's limit goes away: our own level binds.
        t.write(&format!("{cg}/memory.max"), "max\n");
        let c = source.sample().unwrap().cgroup.unwrap();
        assert_eq!(c.max, Some(6 * GIB));

        // A garbled file is an error, and the next sample looks for the cgroup again.
        t.write(&format!("{cg}/fallow.service/memory.current"), "garbage\n");
        let err = source.sample().unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        assert!(source.cgroup_dirs.is_none());
    }

    #[test]
    fn proc_source_reports_an_unlimited_cgroup_and_a_namespaced_root() {
        let t = base_tree("ns");
        // Inside a cgroup namespace: our cgroup is "/", mounted at /sys/fs/cgroup.
        t.write("/proc/self/cgroup", "0::/\n");
        t.write("/proc/self/mountinfo", "30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n");
        t.write("/sys/fs/cgroup/memory.max", "max\n");
        t.write("/sys/fs/cgroup/memory.current", "4096\n");
        let c = ProcSource::with_root(&t.0).sample().unwrap().cgroup.unwrap();
        assert_eq!(c, CgroupMemory { max: None, high: None, current: 4096 });
    }

    #[test]
    fn simulated_source_shares_values_and_fails_on_demand() {
        let sim = SimulatedSource::new(HostMemory::idle(4 * GIB, 2 * GIB));
        let mut other = sim.clone();
        sim.set_available(GIB);
        sim.add_stall(500, 12.0);
        let s = other.sample().unwrap();
        assert_eq!((s.available, s.psi_some_total_us, s.psi_some_avg10), (GIB, 500, 12.0));
        sim.fail(io::ErrorKind::TimedOut);
        assert_eq!(other.sample().unwrap_err().kind(), io::ErrorKind::TimedOut);
        assert_eq!(sim.current(), None);
        sim.set(HostMemory::idle(1, 1));
        assert_eq!(other.sample().unwrap().available, 1);
    }
}
