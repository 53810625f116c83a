#!/usr/bin/env bash
# The kill loops at full count (docs/reliability.md, "Kill loops"): the five loops of
# crates/fallow/tests/kill_loops.rs, one at a time, each for ITERATIONS kills (default 50:
# 250 kill-and-verify iterations in all), then the counts each loop printed and the time.
# Usage: scripts/kill-loops.sh [ITERATIONS]; FALLOW_KILL_SEED=N repeats a run's draws.
# Needs python3-libnbd for the three NBD loops (they skip, with a message, without it).
set -euo pipefail
cd "$(dirname "$0")/.."
iterations="${1:-50}"
log=$(mktemp)
trap 'rm -f "$log" "$log.counts"' EXIT
cargo build --locked -p fallow --tests
start=$(date +%s)
# One test at a time: each loop has the machine to itself, and its time is its own.
FALLOW_KILL_ITERATIONS="$iterations" cargo test --locked -p fallow --test kill_loops -- \
    --nocapture --test-threads=1 2>&1 | tee "$log"
took=$(($(date +%s) - start))
echo
echo "kill loops, $iterations iterations each, ${took} s:"
# With one test at a time, a loop's line follows libtest's `test NAME ... ` on its line.
grep -o 'kill loop .*' "$log" | tee "$log.counts"
awk '{ for (i = 1; i < NF; i++) if ($(i + 1) == "iterations") n += $i }
     END { print n " kill-and-verify iterations in all, 0 acknowledged writes lost" }' \
    "$log.counts"
