#!/usr/bin/env bash
# Replays the shared real traces (../shared/traces, when present) through the release
# build and fails if the default eviction policy misses the goals of issue #2 (see
# bench/trace_compare.py). Skips cleanly when the traces are not there.
set -euo pipefail
cd "$(dirname "$0")/.."
traces="${FALLOW_TRACES:-$(cd .. && pwd)/shared/traces}"
if [ ! -f "$traces/README.md" ]; then
    echo "skipped: no shared traces at $traces"
    exit 0
fi
cargo build --release --locked -p fallow
default=$(./target/release/fallow trace policies --default)
python3 bench/trace_compare.py --fallow target/release/fallow --traces "$traces" \
    --policies "lru,$default" --default "$default" --check
