//! Guests for the tests that boot one: the minimal image (or a reason to skip), a boot
//! that fails loudly, and what a guest's console says it synced.

use fallow_testkit::guest::{Guest, GuestOutput, GuestSpec, MinimalImage};

/// The minimal guest image, or `None` (after saying why) when guests cannot run here
/// (QEMU or one of `tools` is missing, or the image cannot be built) and the run does not
/// require them (`FALLOW_REQUIRE_GUESTS=1`, which the test command sets).
pub fn guest_image(tools: &[&str]) -> Option<MinimalImage> {
    let required = std::env::var("FALLOW_REQUIRE_GUESTS").is_ok_and(|v| v == "1");
    let missing: Vec<&str> =
        ["qemu-system-x86_64"].iter().chain(tools).copied().filter(|t| !super::have(t)).collect();
    if !missing.is_empty() {
        let why = format!("{} not installed (Debian qemu-system-x86, nbdkit)", missing.join(", "));
        assert!(!required, "FALLOW_REQUIRE_GUESTS=1 but {why}");
        eprintln!("skipped: {why}");
        return None;
    }
    match MinimalImage::get() {
        Ok(image) => Some(image),
        Err(e) => {
            assert!(!required, "FALLOW_REQUIRE_GUESTS=1 but the guest image failed: {e}");
            eprintln!("skipped: {e}");
            None
        }
    }
}

/// Boots a guest and waits for it to finish; panics with its console if it fails, or if
/// its kernel logged an I/O error. Its exit code is the caller's to judge.
pub fn run_guest(image: &MinimalImage, spec: &GuestSpec) -> GuestOutput {
    let out = Guest::boot(image, spec).and_then(Guest::finish).unwrap_or_else(|e| panic!("{e}"));
    eprintln!("guest finished in {:.1?} ({})", out.elapsed, out.accel.name());
    for (key, value) in out.results() {
        eprintln!("  {key}: {value}");
    }
    assert!(
        !out.console.iter().any(|l| l.contains("I/O error")),
        "the guest's kernel saw I/O errors:\n{}",
        out.console_text()
    );
    out
}

/// The largest `N` of the `FALLOW-SYNCED N` lines in a guest's `console`: how far its
/// script got in writing and syncing before it was stopped.
pub fn synced(console: &[String]) -> u64 {
    console
        .iter()
        .filter_map(|l| l.split_once("FALLOW-SYNCED ")?.1.trim().parse().ok())
        .max()
        .unwrap_or(0)
}
