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
source "$(dirname "$0")/lib.sh"
ab_setup 2,13 5 "$@"
seconds=${AB_SECONDS:-3}
shapes=${AB_SHAPES:-"put:16:32 put:4:32 put:1:32 put:16:1 mix:0.5:16:1"}

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

# One run of build WHICH (old or new): pages per second.
run() {
    local exe=$old workload=$2 depth=$3 batch=$4
    [[ $1 == new ]] && exe=$new
    "$exe" bench pages --target "$target" --secret-file "$dir/secret" --persistent \
        --keys 16384 --workload "$workload" -q "$depth" -b "$batch" -d "${seconds}s" --json \
        2>/dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["pages_per_s"])'
}

results="$dir/results"
ab_rounds "$results" "$rounds" "$shapes"
ab_table "$results" "pages/s"
