#!/usr/bin/env bash
# Replays the shared real traces (../shared/traces, when present) through the release
# build and fails if the default eviction policy regresses (see bench/trace_compare.py).
# The goal of issue #2 is stricter than these bounds and is not met on every row yet:
# BENCHMARKS.md shows where. The bounds sit just outside today's measured results for the
# default `s3fifo-lean` (worst row +0.008 over LRU, +0.030 over the best reference policy
# on seeds 0-1; mean reduction 11.4-11.5 %, which meets the goal), so a change that
# makes the policy worse fails here, on either of two samples of the default's
# simulations (`--sim-seeds`: a change that is good on one sample and bad on another is
# not good). Tighten them as the policy improves. Skips cleanly when the traces are not
# there.
set -euo pipefail
cd "$(dirname "$0")/.."
traces="${FALLOW_TRACES:-$(cd .. && pwd)/shared/traces}"
if [ ! -f "$traces/README.md" ]; then
    echo "skipped: no shared traces at $traces"
    exit 0
fi
cargo build --release --locked -p fallow
# Where cargo put it: CARGO_TARGET_DIR when set (a CI cache, a clean clone's test run).
fallow="${CARGO_TARGET_DIR:-target}/release/fallow"
default=$("$fallow" trace policies --default)
python3 bench/trace_compare.py --fallow "$fallow" --traces "$traces" \
    --policies "lru,$default" --default "$default" --check \
    --max-over-lru 0.012 --max-over-best 0.04 --min-mean-reduction 0.11 --sim-seeds 0,1
