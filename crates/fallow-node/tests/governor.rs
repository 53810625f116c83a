//! The lending governor against a simulated host and a real one: it shrinks the engine's
//! budget within about 100 ms of memory pressure (ephemeral pages dropped, segments
//! returned to the OS, persistent pages kept), grows it back gradually after the cooldown,
//! and follows a real allocation in a child process.
//!
//! The tests run one at a time (they measure this process's resident size and the host's
//! free memory). Timings are printed, and asserted generously: the machines are shared.

use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fallow_core::{Lookup, PageKey, PageStore, PoolId, PoolSpec, PutOutcome, PAGE_SIZE};
use fallow_node::lending::{
    AutoConfig, Governor, HostMemory, LendMode, MemorySource, ProcSource, Reason, SimulatedSource,
};
use fallow_pool::{Engine, EngineBuilder, SEGMENT_BYTES};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const SEGMENT: u64 = SEGMENT_BYTES as u64;

fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn engine() -> Arc<Engine> {
    let config = EngineBuilder::new(0).shards(4).compress_interval(None).build().unwrap();
    Arc::new(Engine::new(config))
}

/// A page no other page equals (so dedup cannot merge it) and that is not same-filled.
fn page(pool: PoolId, index: u64) -> Vec<u8> {
    let mut page = vec![0xa5; PAGE_SIZE];
    page[..4].copy_from_slice(&pool.0.to_le_bytes());
    page[8..16].copy_from_slice(&index.to_le_bytes());
    page
}

fn fill(engine: &Engine, spec: PoolSpec, pages: u64) -> PoolId {
    let pool = engine.create_pool(&spec).unwrap();
    for i in 0..pages {
        let outcome = engine.put(PageKey::new(pool, 0, i), &page(pool, i)).unwrap();
        assert_eq!(outcome, PutOutcome::Stored);
    }
    pool
}

fn hits(engine: &Engine, pool: PoolId, pages: u64) -> u64 {
    let mut out = vec![0; PAGE_SIZE];
    (0..pages)
        .filter(|&i| {
            let hit = engine.get(PageKey::new(pool, 0, i), &mut out).unwrap() == Lookup::Hit;
            assert!(!hit || out == page(pool, i), "page {i} of {pool:?} came back wrong");
            hit
        })
        .count() as u64
}

/// Polls `done` every millisecond until it holds, for at most `limit`; returns how long it
/// took, or `None`.
fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    done().then(|| start.elapsed())
}

fn rss() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb = text.lines().find_map(|l| l.strip_prefix("VmRSS:"))?;
    Some(kb.trim().trim_end_matches("kB").trim().parse::<u64>().ok()? * 1024)
}

fn quick_config() -> AutoConfig {
    AutoConfig {
        reserve_bytes: GIB,
        reserve_fraction: 0.0,
        max_lend_bytes: 256 * MIB,
        grow_step_bytes: 32 * MIB,
        grow_every: Duration::from_millis(50),
        grow_hysteresis_bytes: 2 * MIB,
        pressure_step_bytes: 32 * MIB,
        cooldown: Duration::from_millis(300),
        ..AutoConfig::default()
    }
}

#[test]
fn shrinks_within_100ms_of_low_memory_and_grows_back_gradually() {
    let _serial = serial();
    let engine = engine();
    let sim = SimulatedSource::new(HostMemory::idle(16 * GIB, 8 * GIB));
    let config = quick_config();
    let mut governor =
        Governor::spawn(engine.clone(), config.clone(), Box::new(sim.clone())).unwrap();
    // The first tick ran inside spawn: the budget is sized before anything is served.
    assert_eq!(engine.stats().budget_bytes as u64, 256 * MIB);
    assert_eq!(governor.status().last_reason, "initial");

    let rss_empty = rss();
    let eph = fill(&engine, PoolSpec::ephemeral(), 8192); // 32 MiB
    let per = fill(&engine, PoolSpec::persistent(), 256); // 1 MiB
    let filled = engine.stats();
    assert!(filled.mapped_bytes as u64 >= 33 * MIB, "{filled:?}");
    let rss_filled = rss();

    // Another program takes memory: only 512 MiB free, under the 1 GiB reserve.
    sim.set_available(512 * MIB);
    let reaction = wait_for(Duration::from_secs(5), || {
        let s = engine.stats();
        // The status is published just after `set_budget` returns.
        s.budget_bytes == 0 && s.mapped_bytes as u64 <= 2 * SEGMENT && governor.status().shrinks > 0
    });
    let reaction = reaction.expect("the budget did not shrink within 5 s");
    println!("budget and mapped bytes fell {reaction:?} after free memory fell below the reserve");
    assert!(reaction <= Duration::from_millis(500), "shrink took {reaction:?}");

    let status = governor.status();
    assert_eq!(status.last_reason, "low-memory");
    assert!(status.shrinks >= 1 && status.pages_dropped >= 8000, "{status:?}");
    assert_eq!(status.pinned_over_budget_bytes, 256 * PAGE_SIZE as u64, "{status:?}");
    let change = governor.recent_changes().pop().unwrap();
    assert_eq!((change.reason, change.new_bytes), (Reason::LowMemory, 0));
    println!("set_budget took {:?} to drop {} pages", change.elapsed, change.pages_dropped);
    assert_eq!(hits(&engine, per, 256), 256, "persistent pages must all stay");
    assert!(hits(&engine, eph, 8192) < 512, "ephemeral pages should be gone");
    engine.validate();

    // Memory honesty: the segments went back to the OS.
    if let (Some(empty), Some(full), Some(now)) = (rss_empty, rss_filled, rss()) {
        let mapped = engine.stats().mapped_bytes as u64;
        println!(
            "RSS: {} MiB empty, {} MiB filled, {} MiB after the shrink",
            empty >> 20,
            full >> 20,
            now >> 20
        );
        assert!(now + 24 * MIB <= full, "RSS fell by less than 24 MiB: {full} → {now}");
        assert!(now <= empty + mapped + 16 * MIB, "RSS {now} is over {empty} + {mapped} + 16 MiB");
    }

    // Free memory is back: nothing happens during the cooldown, then the budget grows one
    // step at a time.
    let back = Instant::now();
    sim.set_available(8 * GIB);
    let regrown = wait_for(Duration::from_secs(5), || {
        // The change log is written just after `set_budget` returns.
        engine.stats().budget_bytes as u64 == 256 * MIB
            && governor.status().budget_bytes == 256 * MIB
    });
    println!(
        "budget grew back to 256 MiB {:?} after free memory came back",
        regrown.unwrap_or_default()
    );
    assert!(regrown.is_some(), "{:?}", governor.status());
    let grows: Vec<_> =
        governor.recent_changes().into_iter().filter(|c| c.reason == Reason::Grow).collect();
    assert!(grows.len() >= 8, "{grows:?}");
    for g in &grows {
        assert!(g.new_bytes > g.old_bytes && g.new_bytes - g.old_bytes <= 32 * MIB, "{g:?}");
    }
    let first = grows[0].at.duration_since(back);
    // The last sample that saw low memory may have come up to a tick after `back`.
    assert!(first + config.interval >= config.cooldown, "grew {first:?} after pressure ended");

    governor.stop();
    assert!(!governor.status().running);
    governor.stop(); // a second stop does nothing
}

/// A host whose kernel parks what the engine unmaps on per-CPU free lists, as Linux 6.7+
/// does after a large `munmap` of 4 KiB pages: `MemAvailable` does not rise, the lists do.
struct LaggingKernel {
    engine: Arc<Engine>,
    available: Arc<Mutex<u64>>,
    /// The engine's mapped bytes when the host's demand arrived; what it unmapped since is
    /// on the lists.
    mapped_before: Arc<Mutex<Option<u64>>>,
    /// The lists cannot be read (as on a kernel without `/proc/zoneinfo`).
    hidden: Arc<std::sync::atomic::AtomicBool>,
    asked: Arc<std::sync::atomic::AtomicU64>,
}

impl MemorySource for LaggingKernel {
    fn sample(&mut self) -> std::io::Result<HostMemory> {
        Ok(HostMemory::idle(16 * GIB, *self.available.lock().unwrap()))
    }

    fn percpu_free(&mut self) -> Option<u64> {
        use std::sync::atomic::Ordering::Relaxed;
        self.asked.fetch_add(1, Relaxed);
        if self.hidden.load(Relaxed) {
            return None;
        }
        let mapped = self.engine.stats().mapped_bytes as u64;
        Some(self.mapped_before.lock().unwrap().map_or(0, |before| before.saturating_sub(mapped)))
    }
}

#[test]
fn memory_we_just_unmapped_is_not_taken_for_more_demand() {
    use std::sync::atomic::Ordering::Relaxed;
    let _serial = serial();
    let engine = engine();
    let kernel = LaggingKernel {
        engine: engine.clone(),
        available: Arc::new(Mutex::new(8 * GIB)),
        mapped_before: Arc::new(Mutex::new(None)),
        hidden: Arc::default(),
        asked: Arc::default(),
    };
    let (available, mapped_before, hidden, asked) = (
        kernel.available.clone(),
        kernel.mapped_before.clone(),
        kernel.hidden.clone(),
        kernel.asked.clone(),
    );
    let mut governor = Governor::spawn(engine.clone(), quick_config(), Box::new(kernel)).unwrap();
    fill(&engine, PoolSpec::ephemeral(), 8192); // 32 MiB
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(asked.load(Relaxed), 0, "with room to spare the lists are not read");

    // A program takes memory: free is 16 MiB short of the 1 GiB reserve. The governor
    // should give back 16 MiB, once.
    let mapped = engine.stats().mapped_bytes as u64;
    assert_eq!(mapped, 32 * MIB);
    *mapped_before.lock().unwrap() = Some(mapped);
    *available.lock().unwrap() = GIB - 16 * MIB;
    let shrunk =
        wait_for(Duration::from_secs(5), || engine.stats().budget_bytes as u64 == 16 * MIB);
    assert!(shrunk.is_some(), "{:?}", governor.status());
    std::thread::sleep(Duration::from_millis(300)); // a dozen ticks
    let status = governor.status();
    assert_eq!((status.budget_bytes, status.shrinks), (16 * MIB, 1), "{status:?}");
    assert_eq!(engine.stats().mapped_bytes as u64, 16 * MIB);
    assert!(asked.load(Relaxed) > 0);

    // Without the lists, the governor takes its own release for more demand: it gives
    // back the rest, though the host needed only 16 MiB.
    hidden.store(true, Relaxed);
    let cascaded = wait_for(Duration::from_secs(5), || engine.stats().budget_bytes == 0);
    assert!(cascaded.is_some(), "{:?}", governor.status());
    governor.stop();
}

#[test]
fn a_psi_stall_steps_the_budget_down_with_free_memory_to_spare() {
    let _serial = serial();
    let engine = engine();
    let sim = SimulatedSource::new(HostMemory::idle(16 * GIB, 8 * GIB));
    let governor = Governor::spawn(engine.clone(), quick_config(), Box::new(sim.clone())).unwrap();
    assert_eq!(engine.stats().budget_bytes as u64, 256 * MIB);
    // Tasks stall 40 % of the time (2 ms every 5 ms) for 300 ms.
    let start = Instant::now();
    while start.elapsed() < Duration::from_millis(300) {
        sim.add_stall(2_000, 40.0);
        std::thread::sleep(Duration::from_millis(5));
    }
    let shrunk =
        wait_for(Duration::from_secs(2), || governor.status().budget_bytes <= 256 * MIB - 32 * MIB);
    assert!(shrunk.is_some(), "{:?}", governor.status());
    let status = governor.status();
    println!(
        "after 300 ms of 40 % stall: {} MiB, {} shrinks",
        status.budget_bytes >> 20,
        status.shrinks
    );
    assert_eq!(status.last_reason, "pressure");
    assert!(status.in_cooldown, "{status:?}");
    assert_eq!(status.free_bytes, 8 * GIB, "free memory was never short");
}

#[test]
fn a_failing_source_keeps_the_budget_and_recovers() {
    let _serial = serial();
    let engine = engine();
    let sim = SimulatedSource::new(HostMemory::idle(16 * GIB, 8 * GIB));
    let governor = Governor::spawn(engine.clone(), quick_config(), Box::new(sim.clone())).unwrap();
    sim.fail(std::io::ErrorKind::PermissionDenied);
    let failing = wait_for(Duration::from_secs(2), || governor.status().sample_errors >= 3);
    assert!(failing.is_some());
    let status = governor.status();
    assert_eq!(status.budget_bytes, 256 * MIB);
    assert!(status.last_sample_error.is_some());
    sim.set(HostMemory::idle(16 * GIB, 512 * MIB));
    let shrunk = wait_for(Duration::from_secs(2), || governor.status().budget_bytes == 0);
    assert_eq!(engine.stats().budget_bytes, 0);
    assert!(shrunk.is_some(), "{:?}", governor.status());
    assert_eq!(governor.status().last_sample_error, None);
}

#[test]
fn a_fixed_size_is_set_once() {
    let _serial = serial();
    let engine = engine();
    let mode: LendMode = "64M".parse().unwrap();
    let mut handle = Governor::start(engine.clone(), &mode).unwrap();
    assert_eq!(engine.stats().budget_bytes as u64, 64 * MIB);
    let status = handle.status();
    assert_eq!((status.mode, status.running, status.budget_bytes), ("fixed", false, 64 * MIB));
    assert_eq!(status.last_reason, "fixed");
    handle.stop();
    assert_eq!(engine.stats().budget_bytes as u64, 64 * MIB);
}

/// Kills the child (by its PID, through `Child::kill`) however the test ends.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn shrinks_when_a_child_process_allocates_real_memory() {
    let _serial = serial();
    let host = match ProcSource::new().sample() {
        Ok(host) => host,
        Err(e) => return println!("skipped: cannot read this host's memory ({e})"),
    };
    const LEND: u64 = 256 * MIB;
    const CHILD: u64 = 768 * MIB;
    if host.free_for_us() < CHILD + 2 * GIB {
        return println!("skipped: only {} MiB free, too little", host.free_for_us() >> 20);
    }
    if Command::new("python3").args(["-c", "pass"]).status().map_or(true, |s| !s.success()) {
        return println!("skipped: no python3 to allocate memory in a child process");
    }
    // Lend about 256 MiB: keep all but that free. PSI is left out so that only the
    // child's allocation moves the budget.
    let config = AutoConfig {
        reserve_bytes: host.free_for_us() - LEND,
        reserve_fraction: 0.0,
        max_lend_bytes: GIB,
        psi_threshold_percent: 100.0,
        ..AutoConfig::default()
    };
    let engine = engine();
    let governor = Governor::spawn(engine.clone(), config, Box::new(ProcSource::new())).unwrap();
    let eph = fill(&engine, PoolSpec::ephemeral(), 8192); // 32 MiB
    let before = engine.stats();
    let b0 = before.budget_bytes as u64;
    if b0 < 128 * MIB {
        // Other programs on this machine took memory since the sample above.
        return println!("skipped: the host got busy, only {} MiB lent", b0 >> 20);
    }
    println!("lending {} MiB, {} MiB mapped", b0 >> 20, before.mapped_bytes >> 20);

    let script = format!(
        "import sys\nb = b'\\x01' * {CHILD}\nsys.stdout.write('ready\\n')\nsys.stdout.flush()\nsys.stdin.read()\n"
    );
    let spawned = Instant::now();
    let child = Command::new("python3")
        .args(["-c", &script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = KillOnDrop(child);
    // When the child has touched all its memory (it says `ready`).
    let (ready_tx, ready) = std::sync::mpsc::channel();
    let stdout = child.0.stdout.take().unwrap();
    std::thread::spawn(move || {
        let mut line = String::new();
        if std::io::BufReader::new(stdout).read_line(&mut line).is_ok() && line == "ready\n" {
            let _ = ready_tx.send(Instant::now());
        }
    });
    let ready = ready.recv_timeout(Duration::from_secs(10)).expect("the child did not allocate");
    println!("the child allocated {} MiB in {:?}", CHILD >> 20, ready - spawned);
    // The child took 768 MiB of the ~256 MiB we could lend, so nothing is left to lend: the
    // budget goes to 0 and the 32 MiB of pages are dropped. Most of the shrink follows the
    // allocation as it happens; the last step lands within a tick or two of its end.
    let lag = wait_for(Duration::from_secs(5), || {
        let s = engine.stats();
        s.budget_bytes as u64 <= 2 * SEGMENT
            && s.mapped_bytes as u64 <= 3 * SEGMENT
            && governor.status().budget_bytes == s.budget_bytes as u64
    });
    let status = governor.status();
    println!(
        "budget {} MiB {lag:?} after the allocation ended ({} shrinks, last {}, {} pages dropped)",
        status.budget_bytes >> 20,
        status.shrinks,
        status.last_reason,
        status.pages_dropped
    );
    let lag = lag.unwrap_or_else(|| panic!("the budget did not follow the child: {status:?}"));
    assert!(lag <= Duration::from_millis(500), "{lag:?}");
    assert!(status.shrinks >= 1 && status.last_change_at.is_some_and(|t| t > spawned));
    assert!(hits(&engine, eph, 8192) < 8192 / 2, "the pages should have been dropped");
    // Tell the child to exit, then make sure it is gone.
    if let Some(stdin) = child.0.stdin.as_mut() {
        let _ = stdin.write_all(b"\n");
    }
    drop(child);
}
