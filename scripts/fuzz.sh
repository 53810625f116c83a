#!/usr/bin/env bash
# Coverage-guided fuzzing of the decoders and parsers that read outside bytes (fuzz/,
# docs/reliability.md "Fuzzing"). libFuzzer through cargo-fuzz, on the stable toolchain:
# coverage instrumentation is a stable codegen option, and only the sanitizers need nightly,
# so targets are built with `--sanitizer none` (panics and failed checks are the crashes).
#
#   scripts/fuzz.sh smoke                 every target for FUZZ_SMOKE_SECONDS (10) from the
#                                         seeds, dev build; any crash or hang fails
#   scripts/fuzz.sh long SECONDS [T...]   each target (or those named) for SECONDS, one at a
#                                         time, release build; the corpus grows in fuzz/work/
#   scripts/fuzz.sh seeds                 rewrite the golden seeds in fuzz/corpus/ from the
#                                         golden-bytes tests of fallow-proto
#
# A crash leaves its input in fuzz/artifacts/TARGET/; replay it with
#   cargo fuzz run -s none TARGET fuzz/artifacts/TARGET/crash-…   (from the repository root)
# FUZZ_TOOLCHAIN (stable) and FUZZ_SANITIZER (none) can be changed on a machine with
# nightly, e.g. FUZZ_TOOLCHAIN=nightly FUZZ_SANITIZER=address.
set -euo pipefail
cd "$(dirname "$0")/.."

targets=(nbd_handshake nbd_request nbd_reply node_frame trace_parse config_toml)
cargo_fuzz_version=0.13.2
export CARGO_INCREMENTAL=0
export RUSTUP_TOOLCHAIN="${FUZZ_TOOLCHAIN:-stable}"
sanitizer="${FUZZ_SANITIZER:-none}"

usage() {
    sed -n '7,12p' "$0" >&2
    exit 2
}

# What a fresh Debian machine lacks: cargo-fuzz, a C++ compiler for libFuzzer itself, and
# the system OpenSSL the NBD server links (as for the main build).
install() {
    local packages=()
    command -v c++ >/dev/null || packages+=(g++)
    command -v pkg-config >/dev/null || packages+=(pkg-config)
    [ -e /usr/include/openssl/ssl.h ] || packages+=(libssl-dev)
    if ((${#packages[@]})); then
        apt-get -o DPkg::Lock::Timeout=600 update
        DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y "${packages[@]}"
    fi
    if ! cargo fuzz --version 2>/dev/null | grep -q "$cargo_fuzz_version"; then
        cargo install --locked "cargo-fuzz@$cargo_fuzz_version"
    fi
    # Dependencies as fuzz/Cargo.lock pins them, as the main build uses --locked.
    if ! cargo fetch --locked --manifest-path fuzz/Cargo.toml; then
        echo "fuzz/Cargo.lock is out of date: refresh it with" >&2
        echo "  cargo metadata --manifest-path fuzz/Cargo.toml >/dev/null" >&2
        exit 1
    fi
}

# run PROFILE_FLAG SECONDS TARGET WORK_DIR: one target from its work corpus and its seeds
# (and its dictionary, fuzz/dicts/TARGET.dict, if it has one). libFuzzer adds what it
# finds to the first directory only, so the seeds stay as they are. -timeout makes an
# input that runs 10 s a failure (a hang); the exit status is non-zero on any crash,
# failed check, hang or out-of-memory.
run() {
    local profile=$1 seconds=$2 target=$3 work=$4
    local dict=()
    [ -e "fuzz/dicts/$target.dict" ] && dict=(-dict="fuzz/dicts/$target.dict")
    mkdir -p "$work" "fuzz/artifacts/$target"
    cargo fuzz run --fuzz-dir fuzz -s "$sanitizer" $profile "$target" "$work" "fuzz/corpus/$target" -- \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        -artifact_prefix="fuzz/artifacts/$target/" "${dict[@]}"
}

# The closing numbers of a run's log: executions, seconds, coverage, corpus.
summary() {
    local target=$1 log=$2
    local done_line runs secs
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1 || true)
    runs=$(sed -nE 's/^Done ([0-9]+) runs in ([0-9]+) second.*/\1/p' "$log" | tail -1)
    secs=$(sed -nE 's/^Done ([0-9]+) runs in ([0-9]+) second.*/\2/p' "$log" | tail -1)
    printf '%-14s runs %-11s seconds %-6s %s\n' "$target" "${runs:-?}" "${secs:-?}" \
        "$(sed -nE 's/.*(cov: [0-9]+ ft: [0-9]+ corp: [0-9]+\/[0-9A-Za-z]+).*/\1/p' <<<"$done_line")"
}

mode=${1:-}
case "$mode" in
smoke)
    install
    seconds=${FUZZ_SMOKE_SECONDS:-10}
    cargo fuzz build --fuzz-dir fuzz -s "$sanitizer" --dev
    scratch=$(mktemp -d)
    trap 'rm -rf "$scratch"' EXIT
    failed=()
    for target in "${targets[@]}"; do
        log="$scratch/$target.log"
        if ! run --dev "$seconds" "$target" "$scratch/$target" >"$log" 2>&1; then
            failed+=("$target")
            tail -40 "$log"
        fi
        summary "$target" "$log"
    done
    if ((${#failed[@]})); then
        echo "fuzz smoke: ${failed[*]} failed (inputs in fuzz/artifacts/)" >&2
        exit 1
    fi
    echo "fuzz smoke: ${#targets[@]} targets, ${seconds} s each, no crash"
    ;;
long)
    seconds=${2:-}
    [[ "$seconds" =~ ^[0-9]+$ ]] || usage
    shift 2
    chosen=("$@")
    ((${#chosen[@]})) || chosen=("${targets[@]}")
    install
    cargo fuzz build --fuzz-dir fuzz -s "$sanitizer"
    failed=()
    for target in "${chosen[@]}"; do
        log="fuzz/work/$target.log"
        mkdir -p fuzz/work
        if ! run "" "$seconds" "$target" "fuzz/work/$target" >"$log" 2>&1; then
            failed+=("$target")
            tail -40 "$log"
        fi
        summary "$target" "$log"
    done
    if ((${#failed[@]})); then
        echo "fuzz long: ${failed[*]} failed (inputs in fuzz/artifacts/, logs in fuzz/work/)" >&2
        exit 1
    fi
    ;;
seeds)
    FALLOW_FUZZ_SEEDS="$PWD/fuzz/corpus" cargo test -p fallow-proto --test golden --test nbd_golden
    ;;
*)
    usage
    ;;
esac
