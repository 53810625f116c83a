#!/usr/bin/env bash
# Alternating A/B of the cluster client between two builds of `fallow`, for a shared and
# noisy machine: two `fallow node` processes (from the NEW build) on 127.0.0.1 hold a
# persistent pool; `fallow bench pages --persistent --target cluster://…` of each build
# runs the same load in turn, ROUNDS times per shape, and each shape reports both builds'
# medians and the median, lowest and highest of the per-round ratios NEW / OLD.
#
# Usage: bash bench/cluster_ab.sh OLD_FALLOW NEW_FALLOW [ROUNDS]
#   OLD_FALLOW, NEW_FALLOW  two `fallow` executables (e.g. target/release/fallow of two
#                           commits, copied aside)
#   ROUNDS                  default 5
# Env: AB_SHAPES (default "put:16:32 put:4:32 put:1:32 put:16:1 mix:0.5:16:1"):
#   WORKLOAD:QUEUE_DEPTH:BATCH, run for AB_SECONDS (default 3) each.
set -euo pipefail
[[ $# -ge 2 ]] || { sed -n '2,13p' "$0" >&2; exit 2; }
old=$(realpath "$1")
new=$(realpath "$2")
rounds=${3:-5}
seconds=${AB_SECONDS:-3}
shapes=${AB_SHAPES:-"put:16:32 put:4:32 put:1:32 put:16:1 mix:0.5:16:1"}
[[ -x "$old" && -x "$new" ]] || { echo "both builds must be executables" >&2; exit 2; }

dir=$(mktemp -d)
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$dir"
}
trap cleanup EXIT

# A free port of the kind asked for (tcp or udp), from the kernel.
free_port() {
    python3 -c 'import socket,sys
kind = socket.SOCK_STREAM if sys.argv[1] == "tcp" else socket.SOCK_DGRAM
s = socket.socket(socket.AF_INET, kind); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' "$1"
}

echo "cluster-ab-secret-0123456789abcdef" >"$dir/secret"
listen=("127.0.0.1:$(free_port tcp)" "127.0.0.1:$(free_port tcp)")
gossip=("127.0.0.1:$(free_port udp)" "127.0.0.1:$(free_port udp)")
for i in 0 1; do
    "$new" node --listen "${listen[$i]}" --gossip "${gossip[$i]}" --join "${gossip[$((1 - i))]}" \
        --lend 1G --secret-file "$dir/secret" >"$dir/node$i.log" 2>&1 &
    pids+=($!)
done
target="cluster://${listen[0]},${listen[1]}"
for _ in $(seq 100); do
    "$new" stat --node "${listen[0]}" --secret-file "$dir/secret" >/dev/null 2>&1 && break
    sleep 0.1
done

# One run: pages per second.
run() {
    local exe=$1 workload=$2 depth=$3 batch=$4
    "$exe" bench pages --target "$target" --secret-file "$dir/secret" --persistent \
        --keys 16384 --workload "$workload" -q "$depth" -b "$batch" -d "${seconds}s" --json \
        2>/dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["pages_per_s"])'
}

results="$dir/results"
for round in $(seq "$rounds"); do
    for shape in $shapes; do
        IFS=: read -r workload depth batch <<<"${shape/mix:/mix_}"
        workload=${workload/mix_/mix:}
        # Alternate which build goes first.
        order=(old new)
        ((round % 2)) || order=(new old)
        for which in "${order[@]}"; do
            exe=$old
            [[ $which == new ]] && exe=$new
            echo "$shape $which $(run "$exe" "$workload" "$depth" "$batch")" >>"$results"
        done
        echo "round $round/$rounds: $shape done" >&2
    done
done

python3 - "$results" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    shape, which, value = line.split()
    runs[shape][which].append(float(value))
print("| workload:QD:batch | old pages/s | new pages/s | new / old, median (min–max) |")
print("|---|---:|---:|---|")
for shape, by in runs.items():
    ratios = [n / o for o, n in zip(by["old"], by["new"])]
    print(f"| {shape} | {statistics.median(by['old']):,.0f} | {statistics.median(by['new']):,.0f} "
          f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) |")
EOF
