//! Real guests that swap to fallow: a guest of 128 MiB whose swap device is a `pool:`
//! export of `fallow nbd` (a disk that lives only in a persistent pool: frontswap's use of
//! transcendent memory) runs a program that needs twice its memory, and every byte of it
//! must come back from swap intact. The pool is in the `fallow nbd` process in one test
//! and on a `fallow node` in the other; both check, from the guest, that the kernel really
//! swapped, and from the host, that the export took the writes and the pool holds them.
//!
//! Without qemu-system-x86_64 the tests skip with a message, unless
//! `FALLOW_REQUIRE_GUESTS=1` (the test command sets it).

mod support;

use std::process::Stdio;
use std::time::Duration;

use fallow_testkit::guest::{Disk, GuestSpec, MinimalImage};
use serde_json::Value;
use support::guests::{guest_image, run_guest};
use support::{metrics_addr, nbd_serving_uri, start_node, Daemon, TempDir};

const START: Duration = Duration::from_secs(30);

/// The guest's memory.
const GUEST_MIB: u32 = 128;

/// What the guest's memory hog allocates: twice the guest's memory, so that most of it
/// must be in swap at any time.
const HOG_MIB: u64 = 256;

/// The swap device, in MiB: twice what the hog needs, so that swap never runs out.
const SWAP_MIB: u64 = 512;

/// The least swap the guest must have had in use at once: what of the hog could not be in
/// memory even if the guest's kernel took none.
const MIN_PEAK_KIB: u64 = (HOG_MIB - GUEST_MIB as u64) << 10;

/// Swap on `/dev/vda`, then the hog, with a sampler in the background that keeps the most
/// swap in use it has seen (SwapTotal − SwapFree in /proc/meminfo, read by the shell
/// itself, five times a second: cheap under TCG). The hog's exit status is the script's; what the
/// kernel swapped out and in (/proc/vmstat) and the sampler's peak are reported.
const SWAP_SCRIPT: &str = r#"
mkswap /dev/vda > /dev/null || exit 10
swapon /dev/vda || exit 11
swap_used() {
    while read -r key value _; do
        case "$key" in
            SwapTotal:) total=$value ;;
            SwapFree:) free=$value ;;
        esac
    done < /proc/meminfo
    echo $((total - free))
}
echo "FALLOW-RESULT swap_total_kib $(grep SwapTotal /proc/meminfo | tr -s ' ' | cut -d' ' -f2)"
(
    peak=0
    n=0
    # Killed when the hog is done; bounded in case it is not.
    while [ $n -lt 3000 ]; do
        used=$(swap_used)
        if [ "$used" -gt "$peak" ]; then
            peak=$used
            echo $peak > /tmp/peak
        fi
        sleep 0.2
        n=$((n + 1))
    done
) &
sampler=$!
fallow-guest-tool memhog @HOG_MIB@ 7
status=$?
kill $sampler
wait $sampler 2> /dev/null
echo "FALLOW-RESULT swap_peak_kib $(cat /tmp/peak 2> /dev/null || echo 0)"
echo "FALLOW-RESULT pswpout $(grep '^pswpout ' /proc/vmstat | cut -d' ' -f2)"
echo "FALLOW-RESULT pswpin $(grep '^pswpin ' /proc/vmstat | cut -d' ' -f2)"
exit $status
"#;

/// What the guest reported of its swap.
#[derive(Debug)]
struct SwapUse {
    /// Swap in use at the sampler's peak, in KiB.
    peak_kib: u64,
    /// Pages the kernel wrote to swap.
    pages_out: u64,
    /// Pages the kernel read back from swap.
    pages_in: u64,
}

/// Starts `fallow nbd` with export `swap=pool:SWAP_MIB`, metrics, and `pool` (the `--pool`
/// arguments); returns it, its metrics address and the export's URI.
fn start_export(pool: &[&str]) -> (Daemon, String, String) {
    let mut nbd = Daemon::spawn(
        "fallow nbd",
        support::fallow()
            .arg("nbd")
            .args(["--export", &format!("swap=pool:{SWAP_MIB}M")])
            .args(["--listen", "127.0.0.1:0", "--metrics", "127.0.0.1:0"])
            .args(pool)
            .env("FALLOW_LOG", "info")
            .stdin(Stdio::null()),
    );
    let metrics = nbd.wait_for_line("metrics address", START, metrics_addr);
    let uri = nbd.wait_for_line("URI", START, nbd_serving_uri);
    (nbd, metrics, uri)
}

/// Boots the guest with the export at `uri` as its swap and runs the hog, which must
/// find every page intact; returns what the guest reported of its swap.
fn swap_to(image: &MinimalImage, uri: &str) -> SwapUse {
    let script = SWAP_SCRIPT.replace("@HOG_MIB@", &HOG_MIB.to_string());
    let spec = GuestSpec::new(&script)
        .memory_mib(GUEST_MIB)
        .disk(Disk::nbd(uri))
        .time_limit(Duration::from_secs(300));
    let out = run_guest(image, &spec);
    let pages = HOG_MIB * 256;
    let want = format!("ok={pages} bad=0");
    assert!(
        out.marked("FALLOW-MEMHOG").any(|r| r == want),
        "the hog did not get its memory back intact (exit {}):\n{}",
        out.exit_code,
        out.console_text()
    );
    assert_eq!(out.exit_code, 0, "{}", out.console_text());
    let number = |key: &str| -> u64 {
        let value = out.result(key).unwrap_or_default();
        value.parse().unwrap_or_else(|_| panic!("{key}: {value:?}\n{}", out.console_text()))
    };
    // mkswap keeps the device's first page for its header.
    assert_eq!(number("swap_total_kib"), SWAP_MIB * 1024 - 4, "{}", out.console_text());
    let used = SwapUse {
        peak_kib: number("swap_peak_kib"),
        pages_out: number("pswpout"),
        pages_in: number("pswpin"),
    };
    eprintln!("swap: {used:?}");
    assert!(used.peak_kib > MIN_PEAK_KIB, "the guest hardly swapped: {used:?}");
    assert!(used.pages_out * 4 >= used.peak_kib, "{used:?}");
    assert!(used.pages_in > 0, "nothing came back from swap: {used:?}");
    used
}

/// `fallow stat ARGS --json`, parsed.
fn stat_json(args: &[&str]) -> Value {
    let out = support::fallow().arg("stat").args(args).arg("--json").output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "fallow stat failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

/// Checks, from the export's metrics, that every page the guest swapped out was a write
/// the export took, and that none failed; returns the metrics.
fn check_writes(metrics: &str, used: &SwapUse) -> Value {
    let v = stat_json(&["--nbd", metrics]);
    let write = &v["requests"]["write"];
    eprintln!("fallow nbd: writes {write}, reads {}", v["requests"]["read"]);
    assert_eq!(write["error"], 0, "{v}");
    assert!(write["bytes"].as_u64().unwrap() >= used.pages_out * 4096, "{used:?}: {v}");
    assert!(v["requests"]["read"]["bytes"].as_u64().unwrap() >= used.pages_in * 4096, "{v}");
    v
}

/// Checks that `pool` holds `pages`, at least as many as the guest had in swap at its
/// peak: the guest never discards its swap, so every slot it wrote is still in the pool.
fn check_held(pool: &str, pages: Option<u64>, used: &SwapUse, stats: &Value) {
    let pages = pages.unwrap_or_else(|| panic!("no page count for {pool}: {stats}"));
    eprintln!("{pool} holds {pages} pages");
    assert!(pages * 4 >= used.peak_kib, "{pool} lost swap pages: {used:?}: {stats}");
}

/// Stops `fallow nbd` with SIGTERM; it must exit cleanly and have logged no error.
fn stop(mut nbd: Daemon) {
    nbd.signal("TERM");
    let status = nbd.wait_timeout(START).expect("fallow nbd did not stop on SIGTERM");
    assert!(status.success(), "fallow nbd failed: {}", nbd.log_so_far());
    let log = nbd.log_lines();
    let errors: Vec<&String> = log.iter().filter(|l| l.contains("ERROR")).collect();
    assert!(errors.is_empty(), "fallow nbd logged errors:\n{}", nbd.log_so_far());
}

#[test]
fn a_guest_swaps_to_a_pool_export_in_process() {
    let Some(image) = guest_image(&[]) else { return };
    let (nbd, metrics, uri) = start_export(&["--pool", "local:640M"]);
    let used = swap_to(&image, &uri);
    let v = check_writes(&metrics, &used);
    check_held("the pool in fallow nbd", v["pool"]["pages"].as_u64(), &used, &v);
    stop(nbd);
}

#[test]
fn a_guest_swaps_to_a_pool_export_on_a_node() {
    let Some(image) = guest_image(&[]) else { return };
    let dir = TempDir::new("guest-swap-node");
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "guest-swap-secret-0123456789abcdef\n").unwrap();
    let secret = secret.to_str().unwrap();
    let (mut node, node_addr) =
        start_node(&["--listen", "127.0.0.1:0", "--lend", "768M", "--secret-file", secret], START);
    let pool = format!("fallow://{node_addr}");
    let (nbd, metrics, uri) = start_export(&["--pool", &pool, "--secret-file", secret]);
    let used = swap_to(&image, &uri);
    check_writes(&metrics, &used);
    let stats = stat_json(&["--node", &node_addr, "--secret-file", secret]);
    check_held("the node", stats["pages"].as_u64(), &used, &stats);
    stop(nbd);
    assert!(node.is_running(), "the node died: {}", node.log_so_far());
}
