//! CPU lists (`--cpus 2,3` or `--cpus 0-3`) and pinning a server thread to one of them, for
//! the polling front ends: a thread that spins on its queue or socket wastes less when it
//! owns its core, and is not moved between caches by the scheduler.

use std::fmt;
use std::str::FromStr;

use rustix::thread::{sched_setaffinity, CpuSet};

/// A list of CPU numbers, in the order given, each at most once.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct CpuList(Vec<usize>);

/// A CPU list that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("bad CPU list {list:?}: {why} (expected numbers and ranges, as in \"2,3\" or \"0-3\")")]
pub struct BadCpuList {
    list: String,
    why: String,
}

impl CpuList {
    /// The CPUs, in order.
    pub fn cpus(&self) -> &[usize] {
        &self.0
    }

    /// Whether the list names no CPU.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The CPU of the `n`th pinned thread: the list's CPUs are handed out in turn, and
    /// again from the start when there are more threads than CPUs.
    pub fn for_thread(&self, n: usize) -> Option<usize> {
        match self.0.len() {
            0 => None,
            len => self.0.get(n % len).copied(),
        }
    }

    /// Pins the calling thread to `cpu`.
    pub fn pin_current_thread(cpu: usize) -> std::io::Result<()> {
        let mut set = CpuSet::new();
        set.set(cpu);
        sched_setaffinity(None, &set).map_err(std::io::Error::from)
    }
}

impl FromStr for CpuList {
    type Err = BadCpuList;

    fn from_str(list: &str) -> Result<CpuList, BadCpuList> {
        let bad = |why: String| BadCpuList { list: list.to_string(), why };
        let number = |s: &str| -> Result<usize, BadCpuList> {
            let cpu: usize = s.trim().parse().map_err(|_| bad(format!("{s:?} is not a number")))?;
            if cpu >= CpuSet::MAX_CPU {
                return Err(bad(format!(
                    "CPU {cpu} is past the last one ({})",
                    CpuSet::MAX_CPU - 1
                )));
            }
            Ok(cpu)
        };
        let mut cpus = Vec::new();
        for part in list.split(',').filter(|p| !p.trim().is_empty()) {
            let (first, last) = match part.split_once('-') {
                Some((a, b)) => (number(a)?, number(b)?),
                None => (number(part)?, number(part)?),
            };
            if first > last {
                return Err(bad(format!("range {part:?} runs backwards")));
            }
            for cpu in first..=last {
                if cpus.contains(&cpu) {
                    return Err(bad(format!("CPU {cpu} appears twice")));
                }
                cpus.push(cpu);
            }
        }
        if cpus.is_empty() {
            return Err(bad("no CPU named".to_string()));
        }
        Ok(CpuList(cpus))
    }
}

impl fmt::Display for CpuList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<String> = self.0.iter().map(usize::to_string).collect();
        f.write_str(&names.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_and_ranges_parse_in_order() {
        let list: CpuList = "3,0-1".parse().unwrap();
        assert_eq!(list.cpus(), &[3, 0, 1]);
        assert_eq!(list.to_string(), "3,0,1");
        assert_eq!(list.for_thread(0), Some(3));
        assert_eq!(list.for_thread(4), Some(0));
    }

    #[test]
    fn bad_lists_are_refused_with_the_reason() {
        for (list, why) in [
            ("", "no CPU"),
            ("a", "not a number"),
            ("3-1", "backwards"),
            ("1,1", "twice"),
            ("0-2,2", "twice"),
            ("99999", "past the last"),
        ] {
            let err = list.parse::<CpuList>().unwrap_err().to_string();
            assert!(err.contains(why), "{list:?}: {err}");
        }
    }

    #[test]
    fn pinning_to_a_cpu_this_thread_may_use_works() {
        // The first CPU this process may run on (a container may not allow CPU 0); on a
        // thread of its own, so the test's thread is left as it was.
        let allowed = rustix::thread::sched_getaffinity(None).unwrap();
        let cpu = (0..CpuSet::MAX_CPU).find(|&c| allowed.is_set(c)).unwrap();
        std::thread::spawn(move || CpuList::pin_current_thread(cpu).unwrap()).join().unwrap();
    }
}
