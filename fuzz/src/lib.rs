//! What the fuzz targets share: NBD exports over memory stores, and the runtime the NBD
//! server's handshake (an async function over a stream) runs on.
//!
//! Each target in `fuzz_targets/` checks a property of the code it drives, not only that
//! it returns: a round trip through the encoder, agreement of two decoders, or a model of
//! the rules the code implements. A failed check panics, which libFuzzer reports as a
//! crash with the input that caused it.

use std::sync::{Arc, OnceLock};

use fallow_backing::MemStore;
use fallow_cache::{CacheConfig, CacheLayer};
use fallow_nbd::Export;

/// The exports every NBD target serves: names the golden tests use, sizes on and off page
/// boundaries, one read-only.
pub struct NbdFixture {
    /// A single-threaded runtime: one fuzz input runs at a time.
    pub runtime: tokio::runtime::Runtime,
    /// `disk` (1 MiB, writable, the default export), `d` (1 MiB + 512 bytes, read-only,
    /// with a description) and `a` (64 KiB + 1 byte, writable).
    pub exports: Vec<Arc<Export>>,
}

/// The fixture, built on first use.
pub fn nbd_fixture() -> &'static NbdFixture {
    static FIXTURE: OnceLock<NbdFixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a current-thread runtime");
        // A write-through cache without a pool starts no background task, but
        // `CacheLayer::new` may spawn one, so it runs inside the runtime.
        let _inside = runtime.enter();
        let exports = vec![
            export("disk", "", 1 << 20, false),
            export("d", "a read-only disk", (1 << 20) + 512, true),
            export("a", "", (64 << 10) + 1, false),
        ];
        NbdFixture { runtime, exports }
    })
}

fn export(name: &str, description: &str, size: u64, read_only: bool) -> Arc<Export> {
    let cache = CacheLayer::new(Arc::new(MemStore::new(size)), None, CacheConfig::default());
    Arc::new(Export { name: name.into(), description: description.into(), cache, read_only })
}
