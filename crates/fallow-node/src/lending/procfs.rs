//! Pure parsers for the kernel files the governor reads: `/proc/meminfo`,
//! `/proc/pressure/memory`, `/proc/zoneinfo`, `/proc/self/cgroup`, `/proc/self/mountinfo`,
//! `/proc/self/status`, `/proc/self/auxv` and the cgroup v2 `memory.*` files.
//!
//! Each parser takes the file's text and returns a value or a [`ProcParseError`] that names
//! the file and the field: never a panic, whatever the text (STYLE rule 7: the kernel is a
//! trusted source, but a container runtime, a FUSE `lxcfs` or a truncated read is not). No
//! function here touches the filesystem, so the unit tests below run on fixture text.
//!
//! # Components
//! [`parse_meminfo`], [`parse_psi`], [`parse_zoneinfo_percpu_pages`],
//! [`parse_cgroup_v2_path`], [`parse_cgroup2_mounts`], [`parse_vm_rss`],
//! [`parse_auxv_page_size`], [`parse_cgroup_limit`], [`parse_cgroup_bytes`].

/// What is wrong with the text of a kernel file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProcParseError {
    /// A field the governor needs is not in the file.
    #[error("{file}: no {field} field")]
    Missing {
        /// The file, as a path (`/proc/meminfo`) or a name (`memory.max`).
        file: &'static str,
        /// The field that was looked for.
        field: &'static str,
    },
    /// A field is there but its value is not what the kernel writes.
    #[error("{file}: bad value {value:?} for {field}")]
    BadValue {
        /// The file.
        file: &'static str,
        /// The field.
        field: &'static str,
        /// The text found, cut to 64 characters.
        value: String,
    },
}

impl ProcParseError {
    fn bad(file: &'static str, field: &'static str, value: &str) -> Self {
        Self::BadValue { file, field, value: value.chars().take(64).collect() }
    }
}

/// The two `/proc/meminfo` fields the governor uses, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemInfo {
    /// `MemTotal`.
    pub total: u64,
    /// `MemAvailable`: the kernel's estimate of what can be allocated without swapping,
    /// page cache that can be dropped included.
    pub available: u64,
}

/// Parses `/proc/meminfo` (`MemTotal:  24684096 kB` lines). `MemAvailable` exists since
/// Linux 3.14; without it the text is rejected rather than guessed at.
pub fn parse_meminfo(text: &str) -> Result<MemInfo, ProcParseError> {
    const FILE: &str = "/proc/meminfo";
    let mut total = None;
    let mut available = None;
    for line in text.lines() {
        let Some((name, rest)) = line.split_once(':') else { continue };
        let (slot, field) = match name.trim() {
            "MemTotal" => (&mut total, "MemTotal"),
            "MemAvailable" => (&mut available, "MemAvailable"),
            _ => continue,
        };
        *slot = Some(parse_kb(FILE, field, rest)?);
    }
    Ok(MemInfo {
        total: total.ok_or(ProcParseError::Missing { file: FILE, field: "MemTotal" })?,
        available: available
            .ok_or(ProcParseError::Missing { file: FILE, field: "MemAvailable" })?,
    })
}

/// `"  24684096 kB"` → bytes. The unit is optional (the kernel always writes `kB` here).
fn parse_kb(file: &'static str, field: &'static str, rest: &str) -> Result<u64, ProcParseError> {
    let mut words = rest.split_whitespace();
    let number = words.next().ok_or_else(|| ProcParseError::bad(file, field, rest))?;
    let multiplier = match words.next() {
        None => 1,
        Some("kB") => 1024,
        Some(_) => return Err(ProcParseError::bad(file, field, rest)),
    };
    if words.next().is_some() {
        return Err(ProcParseError::bad(file, field, rest));
    }
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(multiplier))
        .ok_or_else(|| ProcParseError::bad(file, field, rest))
}

/// The `some` line of a PSI file: the share of time at least one task stalled on memory.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Psi {
    /// `avg10`: percent of the last 10 seconds (0.0 to 100.0).
    pub some_avg10: f64,
    /// `total`: microseconds stalled since boot (a counter).
    pub some_total_us: u64,
}

/// Parses `/proc/pressure/memory` (or a cgroup's `memory.pressure`):
/// `some avg10=0.00 avg60=0.00 avg300=0.00 total=0`. The `full` line is not used: "some"
/// reacts first, and it is what `systemd-oomd` and Android's lmkd watch too.
pub fn parse_psi(text: &str) -> Result<Psi, ProcParseError> {
    const FILE: &str = "/proc/pressure/memory";
    let line = text
        .lines()
        .find(|l| l.split_whitespace().next() == Some("some"))
        .ok_or(ProcParseError::Missing { file: FILE, field: "some" })?;
    let mut avg10 = None;
    let mut total = None;
    for pair in line.split_whitespace().skip(1) {
        match pair.split_once('=') {
            Some(("avg10", v)) => {
                let x: f64 = v.parse().map_err(|_| ProcParseError::bad(FILE, "avg10", v))?;
                if !(0.0..=100.0).contains(&x) {
                    return Err(ProcParseError::bad(FILE, "avg10", v));
                }
                avg10 = Some(x);
            }
            Some(("total", v)) => {
                total = Some(v.parse().map_err(|_| ProcParseError::bad(FILE, "total", v))?);
            }
            Some(_) => {}
            None => return Err(ProcParseError::bad(FILE, "some", pair)),
        }
    }
    Ok(Psi {
        some_avg10: avg10.ok_or(ProcParseError::Missing { file: FILE, field: "avg10" })?,
        some_total_us: total.ok_or(ProcParseError::Missing { file: FILE, field: "total" })?,
    })
}

/// Free pages held on the kernel's per-CPU lists, summed over every zone and CPU of
/// `/proc/zoneinfo` (the `count:` lines of each zone's `pagesets`), in pages.
///
/// `MemFree`, and so `MemAvailable`, leave these pages out, though they are free: the CPU
/// that holds them allocates from them first, and the kernel drains every list before it
/// reclaims. Since Linux 6.7 the lists grow with the rate of frees, so right after a large
/// `munmap` of 4 KiB pages they can hold a gigabyte that `MemAvailable` shows only seconds
/// later, or not at all (measured: 1.25 GiB unmapped, `MemAvailable` +107 MiB, the lists
/// +1172 MiB, for seconds). Zones without memory have no `pagesets`; a text with none at
/// all is an error.
pub fn parse_zoneinfo_percpu_pages(text: &str) -> Result<u64, ProcParseError> {
    const FILE: &str = "/proc/zoneinfo";
    let mut total: Option<u64> = None;
    let mut in_pagesets = false;
    for line in text.lines() {
        let item = line.trim_start();
        if line.starts_with("Node ") {
            in_pagesets = false;
        } else if item == "pagesets" {
            in_pagesets = true;
        } else if let Some(rest) = item.strip_prefix("count:").filter(|_| in_pagesets) {
            let pages: u64 =
                rest.trim().parse().map_err(|_| ProcParseError::bad(FILE, "count", rest))?;
            total = Some(total.unwrap_or(0).saturating_add(pages));
        }
    }
    total.ok_or(ProcParseError::Missing { file: FILE, field: "pagesets count" })
}

/// The page size from `/proc/self/auxv` (`AT_PAGESZ`): native-endian pairs of machine
/// words, ended by `AT_NULL`. `None` if the entry is not there.
pub fn parse_auxv_page_size(bytes: &[u8]) -> Option<u64> {
    const AT_NULL: u64 = 0;
    const AT_PAGESZ: u64 = 6;
    const WORD: usize = std::mem::size_of::<usize>();
    let word = |w: &[u8; WORD]| usize::from_ne_bytes(*w) as u64;
    for pair in bytes.chunks_exact(2 * WORD) {
        let (Some(key), Some(value)) = (pair.first_chunk::<WORD>(), pair.last_chunk::<WORD>())
        else {
            return None;
        };
        match word(key) {
            AT_NULL => return None,
            AT_PAGESZ => return Some(word(value)).filter(|&size| size > 0),
            _ => {}
        }
    }
    None
}

/// The cgroup v2 path of this process from `/proc/self/cgroup`: the `0::/path` line.
/// `None` when there is none (a cgroup v1-only host); lines of v1 hierarchies are skipped.
pub fn parse_cgroup_v2_path(text: &str) -> Option<&str> {
    text.lines().find_map(|line| line.strip_prefix("0::")).map(str::trim_end)
}

/// A cgroup2 mount from `/proc/self/mountinfo`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupMount {
    /// The cgroup path that is the mount's root (`/` unless a cgroup namespace or a bind
    /// mount shows a subtree).
    pub root: String,
    /// Where it is mounted (`/sys/fs/cgroup`, `/sys/fs/cgroup/unified` on hybrid hosts).
    pub mount_point: String,
}

/// Every `cgroup2` mount in `/proc/self/mountinfo`. A line is
/// `id parent major:minor root mount_point options [optional…] - fstype source super`;
/// lines that do not have that shape are skipped (they cannot be cgroup2 mounts we could
/// use). Paths have `\040`-style octal escapes for spaces and the like, undone here.
pub fn parse_cgroup2_mounts(text: &str) -> Vec<CgroupMount> {
    let mut mounts = Vec::new();
    for line in text.lines() {
        let Some((before, after)) = line.split_once(" - ") else { continue };
        if after.split_whitespace().next() != Some("cgroup2") {
            continue;
        }
        let fields: Vec<&str> = before.split_whitespace().collect();
        if let (Some(root), Some(mount_point)) = (fields.get(3), fields.get(4)) {
            mounts.push(CgroupMount { root: unescape(root), mount_point: unescape(mount_point) });
        }
    }
    mounts
}

/// Undoes mountinfo's octal escapes (`\040` is a space). A malformed escape is kept as is.
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&byte) = bytes.get(i) {
        let escape =
            bytes.get(i + 1..i + 4).and_then(|d| <&[u8; 3]>::try_from(d).ok()).filter(|d| {
                byte == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)) && d[0] <= b'3'
            });
        match escape {
            Some(&[a, b, c]) => {
                out.push((a - b'0') * 64 + (b - b'0') * 8 + (c - b'0'));
                i += 4;
            }
            None => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `VmRSS` of `/proc/self/status`, in bytes: what this process holds in RAM.
pub fn parse_vm_rss(text: &str) -> Result<u64, ProcParseError> {
    const FILE: &str = "/proc/self/status";
    let rest = text
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .ok_or(ProcParseError::Missing { file: FILE, field: "VmRSS" })?;
    parse_kb(FILE, "VmRSS", rest)
}

/// A cgroup v2 limit file (`memory.max`, `memory.high`): `max` means no limit (`None`),
/// otherwise a number of bytes.
pub fn parse_cgroup_limit(file: &'static str, text: &str) -> Result<Option<u64>, ProcParseError> {
    match text.trim() {
        "max" => Ok(None),
        other => parse_cgroup_bytes(file, other).map(Some),
    }
}

/// A cgroup v2 byte count (`memory.current`): one decimal number.
pub fn parse_cgroup_bytes(file: &'static str, text: &str) -> Result<u64, ProcParseError> {
    let value = text.trim();
    value.parse().map_err(|_| ProcParseError::bad(file, "value", value))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MEMINFO: &str = "MemTotal:       24684096 kB\nMemFree:        23443472 kB\n\
                           MemAvailable:   24275232 kB\nBuffers:          120000 kB\n\
                           HugePages_Total:       0\n";

    #[test]
    fn meminfo_reads_total_and_available_in_bytes() {
        let m = parse_meminfo(MEMINFO).unwrap();
        assert_eq!(m.total, 24_684_096 * 1024);
        assert_eq!(m.available, 24_275_232 * 1024);
    }

    #[test]
    fn meminfo_without_available_is_an_error_naming_the_field() {
        let err = parse_meminfo("MemTotal: 1000 kB\nMemFree: 10 kB\n").unwrap_err();
        assert_eq!(err, ProcParseError::Missing { file: "/proc/meminfo", field: "MemAvailable" });
        assert_eq!(err.to_string(), "/proc/meminfo: no MemAvailable field");
    }

    #[test]
    fn meminfo_rejects_garbage_values_and_overflow() {
        for bad in [
            "MemTotal: x kB\nMemAvailable: 1 kB",
            "MemTotal: 1 MB\nMemAvailable: 1 kB",
            "MemTotal: 1 kB extra\nMemAvailable: 1 kB",
            "MemTotal:\nMemAvailable: 1 kB",
            "MemTotal: -1 kB\nMemAvailable: 1 kB",
            "MemTotal: 18446744073709551615 kB\nMemAvailable: 1 kB",
        ] {
            let err = parse_meminfo(bad).unwrap_err();
            assert!(matches!(err, ProcParseError::BadValue { field: "MemTotal", .. }), "{bad}");
        }
        assert!(parse_meminfo("").is_err());
        assert!(parse_meminfo("\u{0}\u{ff}:::").is_err());
    }

    #[test]
    fn psi_reads_the_some_line() {
        let text = "some avg10=1.25 avg60=0.50 avg300=0.00 total=123456\n\
                    full avg10=0.75 avg60=0.00 avg300=0.00 total=99\n";
        let p = parse_psi(text).unwrap();
        assert_eq!(p, Psi { some_avg10: 1.25, some_total_us: 123_456 });
    }

    #[test]
    fn psi_rejects_malformed_lines() {
        for bad in [
            "",
            "full avg10=0.00 avg60=0.00 avg300=0.00 total=0",
            "some avg10=abc avg60=0.00 avg300=0.00 total=0",
            "some avg10=NaN avg60=0.00 avg300=0.00 total=0",
            "some avg10=-1.0 avg60=0.00 avg300=0.00 total=0",
            "some avg10=0.00 total=-5",
            "some avg10=0.00 avg60=0.00",
            "some avg10 total=0",
        ] {
            assert!(parse_psi(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn cgroup_path_is_the_zero_line_on_any_host() {
        assert_eq!(
            parse_cgroup_v2_path("0::/user.slice/fallow.service\n"),
            Some("/user.slice/fallow.service")
        );
        let hybrid = "9:name=systemd:/\n4:memory:/process_api/3c03\n0::/\n";
        assert_eq!(parse_cgroup_v2_path(hybrid), Some("/"));
        assert_eq!(parse_cgroup_v2_path("4:memory:/a\n1:cpu:/\n"), None);
        assert_eq!(parse_cgroup_v2_path(""), None);
    }

    #[test]
    fn mountinfo_finds_cgroup2_mounts_and_unescapes_paths() {
        let text = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
                    35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n\
                    41 31 0:38 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw\n\
                    42 31 0:39 /a\\040b /mnt/my\\040cg rw - cgroup2 none rw\n\
                    garbage - cgroup2\n\
                    1 2 3 - cgroup2\n";
        assert_eq!(
            parse_cgroup2_mounts(text),
            vec![
                CgroupMount { root: "/".into(), mount_point: "/sys/fs/cgroup/unified".into() },
                CgroupMount { root: "/a b".into(), mount_point: "/mnt/my cg".into() },
            ]
        );
        assert_eq!(unescape("a\\0"), "a\\0");
        assert_eq!(unescape("\\999x"), "\\999x");
        assert_eq!(unescape("\\"), "\\");
    }

    /// Trimmed from a 2-CPU host: an empty zone, then two with per-CPU lists.
    const ZONEINFO: &str = "Node 0, zone      DMA\n  per-node stats\n  nr_inactive_anon 139180\n\
        pages free     3840\n        min      5\n  pagesets\n    cpu: 0\n  count:    0\n\
        \x20             high:     0\n              batch:    1\n  vm stats threshold: 6\n\
        \x20   cpu: 1\n              count:    0\n  node_unreclaimable:  0\n\
        Node 0, zone   Normal\n  pages free     3937281\n  pagesets\n    cpu: 0\n\
        \x20             count:    72954\n              high:     73214\n    cpu: 1\n\
        \x20             count:    8295\n  start_pfn:           1048576\n\
        Node 0, zone  Movable\n  pages free     0\n";

    #[test]
    fn zoneinfo_sums_every_per_cpu_list() {
        assert_eq!(parse_zoneinfo_percpu_pages(ZONEINFO).unwrap(), 72_954 + 8_295);
        let err = parse_zoneinfo_percpu_pages("Node 0, zone DMA\n  pages free 1\n").unwrap_err();
        assert_eq!(err.to_string(), "/proc/zoneinfo: no pagesets count field");
        assert!(parse_zoneinfo_percpu_pages("  pagesets\n  count: many\n").is_err());
        // A `count:` outside `pagesets` is not a list.
        assert!(parse_zoneinfo_percpu_pages("Node 0\n  count: 5\n").is_err());
    }

    #[test]
    fn auxv_gives_the_page_size() {
        let mut auxv = Vec::new();
        for (key, value) in [(33usize, 0x7fff_0000usize), (6, 4096), (0, 0)] {
            auxv.extend_from_slice(&key.to_ne_bytes());
            auxv.extend_from_slice(&value.to_ne_bytes());
        }
        assert_eq!(parse_auxv_page_size(&auxv), Some(4096));
        assert_eq!(parse_auxv_page_size(&auxv[..16]), None, "cut before AT_PAGESZ");
        assert_eq!(parse_auxv_page_size(&[]), None);
    }

    #[test]
    fn vm_rss_is_in_bytes() {
        let text = "Name:\tfallow\nVmPeak:\t  9000 kB\nVmRSS:\t    4212 kB\n";
        assert_eq!(parse_vm_rss(text).unwrap(), 4212 * 1024);
        assert!(parse_vm_rss("Name: x\n").is_err());
        assert!(parse_vm_rss("VmRSS: lots kB\n").is_err());
    }

    proptest::proptest! {
        /// Whatever the text, every parser answers: a value or an error, never a panic.
        #[test]
        fn parsers_never_panic(text in "(?s).{0,200}", noise in "[a-zA-Z0-9 :=.\\\n-]{0,200}") {
            for t in [text.as_str(), noise.as_str()] {
                let _ = parse_meminfo(t);
                let _ = parse_psi(t);
                let _ = parse_cgroup_v2_path(t);
                let _ = parse_cgroup2_mounts(t);
                let _ = parse_vm_rss(t);
                let _ = parse_zoneinfo_percpu_pages(t);
                let _ = parse_auxv_page_size(t.as_bytes());
                let _ = parse_cgroup_limit("memory.max", t);
                let _ = parse_cgroup_bytes("memory.current", t);
                let _ = unescape(t);
            }
        }
    }

    #[test]
    fn cgroup_limits_parse_max_and_numbers() {
        assert_eq!(parse_cgroup_limit("memory.max", "max\n").unwrap(), None);
        assert_eq!(parse_cgroup_limit("memory.max", "1073741824\n").unwrap(), Some(1 << 30));
        assert_eq!(parse_cgroup_bytes("memory.current", "4096\n").unwrap(), 4096);
        let err = parse_cgroup_limit("memory.max", "lots").unwrap_err();
        assert_eq!(err.to_string(), "memory.max: bad value \"lots\" for value");
        assert!(parse_cgroup_bytes("memory.current", "").is_err());
        assert!(parse_cgroup_bytes("memory.current", "-1").is_err());
    }
}
