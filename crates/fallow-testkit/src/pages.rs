//! Page contents shared by the engine's tests and benches, so that both fill pools with the
//! same kind of bytes, and the benches' engine settings from the environment.

use fallow_core::PAGE_SIZE;
use fallow_pool::EngineBuilder;

/// The benches' engine settings from the environment, for measuring other settings than
/// the defaults: `FALLOW_BENCH_POLICY=NAME` (another eviction policy),
/// `FALLOW_BENCH_THREADS=N` (the default shards of a host with N CPUs,
/// `EngineBuilder::threads`) and `FALLOW_BENCH_SHARDS=N` (N shards).
pub fn bench_builder_from_env(mut builder: EngineBuilder) -> EngineBuilder {
    if let Ok(name) = std::env::var("FALLOW_BENCH_POLICY") {
        builder = builder.policy(&name);
    }
    // A bench run with a setting it cannot read would measure the default instead.
    let number = |var: &str| {
        std::env::var(var).ok().map(|v| {
            v.parse::<usize>().unwrap_or_else(|_| panic!("{var}={v:?} is not a whole number"))
        })
    };
    if let Some(threads) = number(BENCH_THREADS_VAR) {
        builder = builder.threads(threads);
    }
    if let Some(shards) = number("FALLOW_BENCH_SHARDS") {
        builder = builder.shards(shards);
    }
    builder
}

/// [`bench_builder_from_env`]'s variable for the CPUs the default shards are sized for.
pub const BENCH_THREADS_VAR: &str = "FALLOW_BENCH_THREADS";

/// Fills `out` with bytes unique to `seed` (xorshift words), never same-filled.
pub fn unique_page_into(seed: u64, out: &mut [u8]) {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    for chunk in out.chunks_exact_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        chunk.copy_from_slice(&x.to_le_bytes());
    }
}

/// A page of bytes unique to `seed`, never same-filled.
pub fn unique_page(seed: u64) -> Vec<u8> {
    let mut p = vec![0u8; PAGE_SIZE];
    unique_page_into(seed, &mut p);
    p
}
