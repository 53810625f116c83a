//! The golden messages as the fuzz targets' seeds: with `FALLOW_FUZZ_SEEDS=DIR` set, each
//! golden test writes what it checks to `DIR/TARGET/golden-HASH`, the name a content hash
//! so that a rerun rewrites the same files (`scripts/fuzz.sh seeds` fills `fuzz/corpus`
//! this way). Without the variable nothing is written.

use std::path::Path;

/// Writes `bytes` as a seed of fuzz target `target`, behind `prefix` (the bytes that target
/// reads before the message: a session choice, a key count, client flags).
pub fn seed(target: &str, prefix: &[u8], bytes: &[u8]) {
    let Some(dir) = std::env::var_os("FALLOW_FUZZ_SEEDS") else { return };
    let dir = Path::new(&dir).join(target);
    std::fs::create_dir_all(&dir).unwrap();
    let input = [prefix, bytes].concat();
    // FNV-1a: stable across Rust releases, unlike the standard library's hasher.
    let hash = input
        .iter()
        .fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3));
    std::fs::write(dir.join(format!("golden-{hash:016x}")), input).unwrap();
}
