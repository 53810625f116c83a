#!/usr/bin/env bash
# The metadata a node process holds per cached page, end to end: everything the process
# keeps beside the page bytes (the engine's tables, tokio, connection buffers, what the
# allocator holds), from its RssAnon, against the engine's own figure (`fallow stat`).
# The memory bench (`benches/memory.rs`) measures the engine alone, in process; this is
# what a host lending memory actually pays.
#
# Cases: a node lending 256 MiB and 1 GiB, filled with `fallow bench pages --warmup`
# (1024 pages an object, keys in order) and then read; and a node lending 1 GiB in the
# steady state of random puts over three times the pages it lends, in batches of 32 pages
# and one page a request (the batches' requests in flight, up to 2 MiB, sit in the
# connections' buffers and count in RssAnon too). Each starts its own node on a Unix
# socket in a temporary directory and stops it after.
#
# Usage: bash bench/node_metadata.sh [--quick]   (--quick: shorter runs, for a smoke check)
# Writes bench/out/node-metadata-<date>.md and prints it. FALLOW_BIN overrides the build.
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh

duration=15
steady_duration=30
if [[ ${1:-} == --quick ]]; then
    duration=5
    steady_duration=8
fi

bench_setup node-metadata
build_fallow
new_secret "$work/secret"
out="$out_dir/node-metadata-$stamp.md"

rss_anon_kb() { awk '/^RssAnon:/ {print $2}' "/proc/$1/status"; }

# measure LABEL LEND_MIB KEYS BENCH_ARGS...: one node, one bench run against it; prints a
# table row. Samples the node every second while the bench runs and keeps the last sample
# taken while the pool held at least 99 % of what it should (the bench drops its pool as
# it ends).
measure() {
    local label=$1 lend_mib=$2 keys=$3
    shift 3
    local sock="$work/node-$lend_mib.sock"
    rm -f "$sock"
    "$fallow" node --listen "unix:$sock" --lend "${lend_mib}MiB" --secret-file "$work/secret" \
        2>"$work/node-$lend_mib.log" &
    local node=$!
    pids+=("$node")
    local i
    for i in $(seq 100); do
        [[ -S $sock ]] && break
        kill -0 "$node" 2>/dev/null || { cat "$work/node-$lend_mib.log" >&2; exit 1; }
        sleep 0.1
    done
    [[ -S $sock ]] || { echo "node did not listen on $sock within 10 s" >&2; exit 1; }
    local before
    before=$(rss_anon_kb "$node")
    local expect=$((lend_mib * 256 * 99 / 100))
    ((keys * 99 / 100 < expect)) && expect=$((keys * 99 / 100))
    "$fallow" bench pages --target "fallow://unix:$sock" --secret-file "$work/secret" \
        --keys "$keys" --quiet "$@" >"$work/bench.out" 2>&1 &
    local bench=$!
    pids+=("$bench")
    local sample="" stat
    while kill -0 "$bench" 2>/dev/null; do
        sleep 1
        stat=$("$fallow" stat --node "unix:$sock" --secret-file "$work/secret" --json 2>/dev/null) ||
            continue
        local anon new
        anon=$(rss_anon_kb "$node")
        new=$(python3 -c '
import json, sys
s = json.loads(sys.argv[1])
if s["pages"] >= int(sys.argv[2]):
    print(s["pages"], s["mapped_bytes"], s["metadata_bytes"], sys.argv[3])
' "$stat" "$expect" "$anon")
        [[ -n $new ]] && sample=$new
    done
    wait "$bench" || { cat "$work/bench.out" >&2; echo "the bench failed" >&2; exit 1; }
    kill "$node"
    wait "$node" 2>/dev/null || true
    if [[ -z $sample ]]; then
        echo "the pool never held $expect pages: raise the duration" >&2
        exit 1
    fi
    python3 - "$label" "$before" $sample <<'PY'
import sys
label, before, pages, mapped, metadata, anon = sys.argv[1], *map(int, sys.argv[2:])
resident = (anon - before) * 1024 - mapped
print(f"| {label} | {pages:,} | {before:,} kB → {anon:,} kB | **{resident / pages:.1f} B** "
      f"| {metadata / pages:.1f} B |")
PY
}

{
    echo "# Node metadata per cached page, end to end, $stamp"
    echo
    echo "| | |"
    echo "|---|---|"
    echo "| CPU | $(cpu_model) |"
    echo "| cores (nproc) | $(nproc) |"
    host_rows
    run_rows "" "bash bench/node_metadata.sh $*"
    echo
    echo "RssAnon growth of the node less the bytes of its mapped page frames, per cached page,"
    echo "against the engine's own count of its metadata (\`fallow stat\`), both read while the"
    echo "bench ran."
    echo
    echo "| case | pages | RssAnon before → during | resident a page | engine's figure a page |"
    echo "|---|---:|---|---:|---:|"
} >"$out"

step "256 MiB, keys in order, then read"
measure "256 MiB, filled in order (\`--workload get --warmup\`)" 256 65536 \
    --workload get --warmup --duration "${duration}s" >>"$out"
step "1 GiB, keys in order, then read"
measure "1 GiB, filled in order (\`--workload get --warmup\`)" 1024 262144 \
    --workload get --warmup --duration "${duration}s" >>"$out"
step "1 GiB, steady state of random puts over 3 x the lent pages"
measure "1 GiB, random puts over 3 × the pages (\`--workload put -c 2 -q 8 -b 32\`)" 1024 786432 \
    --workload put -c 2 -q 8 -b 32 --duration "${steady_duration}s" >>"$out"
step "the same with one page a request"
measure "1 GiB, the same, one page a request (\`-c 2 -q 16 -b 1\`)" 1024 786432 \
    --workload put -c 2 -q 16 -b 1 --duration "${steady_duration}s" >>"$out"
cat "$out"
