//! Reads every real trace in `shared/traces/` (see its README) and checks the page accesses
//! and distinct 4 KiB pages against the numbers measured when the readers were written.
//!
//! The distinct-page counts agree with the README's table where it gives one
//! (cloudPhysicsIO 269,210; OLTP 186,880; P2 120,308; P3 102,348), and every count agrees with
//! the cache sizes in its reference miss-ratio table, which are 1 %, 5 %, 10 % and 25 % of
//! the distinct pages (rounded). The traces are third-party files that stay outside the
//! repository, so each test prints "skipped: shared traces not found" and passes when the
//! directory is missing.

use std::path::PathBuf;

use fallow_bench::trace::{count_distinct, TraceFormat, TraceOptions, TraceSummary};

/// `shared/traces/`, beside the repository checkout, if it is there.
fn traces_dir() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/traces");
    dir.is_dir().then_some(dir)
}

/// Reads `file` (relative to `shared/traces/`) with `opts` and checks its summary.
fn check(file: &str, opts: TraceOptions, accesses: u64, distinct_pages: u64) {
    let Some(dir) = traces_dir() else {
        println!("skipped: shared traces not found");
        return;
    };
    let got = count_distinct(&dir.join(file), &opts).unwrap();
    let reads = if opts.reads_only { ", reads only" } else { "" };
    let (accesses_got, distinct_got) = (got.accesses, got.distinct_pages);
    println!(
        "{file} ({}{reads}): {accesses_got} accesses, {distinct_got} distinct pages",
        opts.format
    );
    assert_eq!(got, TraceSummary { accesses, distinct_pages }, "{file}");
}

fn opts(format: TraceFormat) -> TraceOptions {
    TraceOptions::new(format)
}

fn reads_only(format: TraceFormat) -> TraceOptions {
    TraceOptions { reads_only: true, ..TraceOptions::new(format) }
}

#[test]
fn cloud_physics_vscsi() {
    check("libcachesim/cloudPhysicsIO.vscsi", opts(TraceFormat::Vscsi), 1_141_869, 269_210);
    // The README's reads-only cache sizes (2,100 pages = 1 %) imply 210,000 distinct pages.
    check("libcachesim/cloudPhysicsIO.vscsi", reads_only(TraceFormat::Vscsi), 485_700, 210_000);
}

#[test]
fn arc_oltp_with_4k_blocks() {
    let opts = TraceOptions { block_size: Some(4096), ..opts(TraceFormat::Arc) };
    check("arc/OLTP.lis.zst", opts, 914_145, 186_880);
}

#[test]
fn arc_p2() {
    check("arc/P2.lis.zst", opts(TraceFormat::Arc), 2_231_617, 120_308);
}

#[test]
fn arc_p3() {
    check("arc/P3.lis.zst", opts(TraceFormat::Arc), 611_918, 102_348);
}

#[test]
fn caffeine_lirs() {
    for (name, accesses, distinct) in [
        ("2_pools", 100_000, 9_939),
        ("cpp", 9_047, 1_223),
        ("cs", 6_781, 1_409),
        ("gli", 6_015, 2_529),
        ("loop", 505_500, 1_011),
        ("multi1", 15_858, 2_606),
        ("multi2", 26_311, 5_684),
        ("multi3", 30_241, 7_454),
        ("ps", 10_448, 3_083),
        ("scan", 50_025, 2_001),
        ("sprite", 133_996, 7_075),
        ("zigzag", 52_001, 2_001),
    ] {
        let file = format!("caffeine/lirs/{name}.trace.gz");
        check(&file, opts(TraceFormat::Lirs), accesses, distinct);
    }
}

#[test]
fn caffeine_snia_samples() {
    let tencent = "caffeine/snia/tencent-cbs-cloud_storage-sample.bz2";
    check(tencent, opts(TraceFormat::Tencent), 378_253, 348_239);
    check(tencent, reads_only(TraceFormat::Tencent), 161_418, 139_099);
    check("caffeine/snia/msr-cambridge1-sample.csv", opts(TraceFormat::Msr), 2_473, 1_917);
    let systor = "caffeine/snia/systor17-traces-sample.csv.gz";
    check(systor, opts(TraceFormat::Systor), 10_466, 9_831);
    let systor = "caffeine/snia/systor17-additional-sample.csv.gz";
    check(systor, opts(TraceFormat::Systor), 5_890, 5_460);
}
