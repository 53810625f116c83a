#!/usr/bin/env bash
# Alternating A/B of a node between two builds of `fallow`, for a shared and noisy
# machine: one `fallow node` of each build on 127.0.0.1, and the NEW build's
# `fallow bench pages` running the same load against each in turn, ROUNDS times per
# shape (which node goes first alternates). Each shape reports both nodes' medians and
# the median, lowest and highest of the per-round ratios NEW / OLD.
#
# Usage: bash bench/node_ab.sh OLD_FALLOW NEW_FALLOW [ROUNDS]
#   OLD_FALLOW, NEW_FALLOW  two `fallow` executables (e.g. target/release/fallow of two
#                           commits, copied aside)
#   ROUNDS                  default 5
# Env: AB_SHAPES (default "get:1:1 get:16:32 put:1:1 put:16:32 mix:0.5:4:1"):
#   WORKLOAD:QUEUE_DEPTH:BATCH, run for AB_SECONDS (default 3) each.
set -euo pipefail
source "$(dirname "$0")/lib.sh"
ab_setup 2,13 5 "$@"
seconds=${AB_SECONDS:-3}
shapes=${AB_SHAPES:-"get:1:1 get:16:32 put:1:1 put:16:32 mix:0.5:4:1"}

echo "node-ab-secret-0123456789abcdef" >"$dir/secret"
declare -A addr
for which in old new; do
    exe=$old
    [[ $which == new ]] && exe=$new
    port=$(free_port)
    "$exe" node --listen "127.0.0.1:$port" --lend 1G --secret-file "$dir/secret" \
        >"$dir/$which.log" 2>&1 &
    pids+=($!)
    wait_listening "$port" "$!"
    addr[$which]="127.0.0.1:$port"
done

# One run against node WHICH: pages per second.
run() {
    local which=$1 workload=$2 depth=$3 batch=$4
    "$new" bench pages --target "fallow://${addr[$which]}" --secret-file "$dir/secret" \
        --keys 16384 --workload "$workload" -q "$depth" -b "$batch" -d "${seconds}s" --json \
        2>/dev/null | python3 -c 'import json, sys; print(json.load(sys.stdin)["pages_per_s"])'
}

results="$dir/results"
ab_rounds "$results" "$rounds" "$shapes"
ab_table "$results" "node pages/s"
