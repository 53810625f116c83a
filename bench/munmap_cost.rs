//! What the kernel charges for giving 2 MiB segments back, as the pool engine does it (one
//! `munmap` per 2 MiB-aligned, `MADV_HUGEPAGE` segment) and batched (several adjacent
//! segments per call), with and without another thread of the process running on another
//! CPU (which makes every `munmap` a TLB shootdown). Built and run by bench/governor.sh:
//! `rustc -O bench/munmap_cost.rs -o target/munmap_cost && target/munmap_cost [SEGMENTS]`.
//! Std only; prints one JSON object per case: ms per GiB, median of 5.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

extern "C" {
    fn mmap(addr: *mut u8, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut u8;
    fn munmap(addr: *mut u8, len: usize) -> i32;
    fn madvise(addr: *mut u8, len: usize, advice: i32) -> i32;
}

const SEG: usize = 2 << 20;
const PROT_READ_WRITE: i32 = 0x3;
const MAP_PRIVATE_ANONYMOUS: i32 = 0x22;
const MADV_HUGEPAGE: i32 = 14;

/// Maps `n` adjacent 2 MiB-aligned segments, faults them in, and times unmapping them
/// `per_call` segments per `munmap`. Returns the time per GiB.
fn once(n: usize, per_call: usize) -> Duration {
    let len = n * SEG;
    // SAFETY: a fresh private anonymous mapping of len + SEG bytes; only the 2 MiB-aligned
    // window of `len` bytes inside it is written and unmapped, and nothing else refers to it.
    let base = unsafe {
        let p = mmap(std::ptr::null_mut(), len + SEG, PROT_READ_WRITE, MAP_PRIVATE_ANONYMOUS, -1, 0);
        assert!(p as isize != -1, "mmap failed");
        let a = (p as usize).div_ceil(SEG) * SEG;
        let a = a as *mut u8;
        madvise(a, len, MADV_HUGEPAGE);
        std::ptr::write_bytes(a, 1, len);
        a
    };
    let start = Instant::now();
    let mut off = 0;
    while off < len {
        let n = (per_call * SEG).min(len - off);
        // SAFETY: unmaps a part of the window mapped above, each byte once.
        unsafe { munmap(base.add(off), n) };
        off += n;
    }
    let took = start.elapsed();
    took * 512 / n as u32
}

fn median(n: usize, per_call: usize) -> f64 {
    let mut runs: Vec<f64> = (0..5).map(|_| once(n, per_call).as_secs_f64() * 1e3).collect();
    runs.sort_by(f64::total_cmp);
    runs[2]
}

fn main() {
    let n: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(512);
    let cases = [1usize, 8, 64];
    for per in cases {
        println!("{{\"sibling\":false,\"per_call\":{per},\"ms_per_gib\":{:.2}}}", median(n, per));
    }
    // A sibling thread that stays on a CPU, as a node's runtime threads do under load.
    let stop = Arc::new(AtomicBool::new(false));
    let spinning = stop.clone();
    let sibling = std::thread::spawn(move || {
        let mut x = 0u64;
        while !spinning.load(Ordering::Relaxed) {
            x = std::hint::black_box(x.wrapping_add(1));
        }
    });
    std::thread::sleep(Duration::from_millis(50));
    for per in cases {
        println!("{{\"sibling\":true,\"per_call\":{per},\"ms_per_gib\":{:.2}}}", median(n, per));
    }
    stop.store(true, Ordering::Relaxed);
    let _ = sibling.join();
}
