#!/usr/bin/env bash
# The lending governor, measured (DESIGN.md "Targets": give back 1 GiB of lent memory in
# ≤ 10 ms with no get stalled > 1 ms; a memory-hungry program slowed by ≤ 2 % by a node
# lending `auto` on the same host). Builds target/release/fallow once, then runs
# bench/governor.py, which:
#
#   1. give-back under reads: a node with `--lend auto` and a reserve of
#      MemAvailable − 1.5 GiB, filled with ~1.25 GiB of ephemeral pages by a QD1 reader's
#      warm-up; ~3 s into the reads a hog takes ~1.4 GiB (plus what the kernel's per-CPU
#      free lists hold, which the governor counts as free), so the governor must give
#      ≥ 1 GiB back: (a) at once (the node is SIGSTOPped while the hog populates its
#      memory, then continued), (b) following the hog as it writes its memory. Reports the
#      shrinks from the node's log (set_budget time, wall time), mapped bytes before/after,
#      and the reader's latency during the shrinks and in the shrink window against an
#      equal window before it; each run is followed by a control with a fixed `--lend`
#      (the hog's own disturbance, nothing given back), measured at the same offsets;
#   2. slowdown: a deterministic hog (allocate X GiB, touch every page, two passes of
#      checksum + rewrite) timed N times alone and N times next to a filled `auto` node,
#      alternating; medians and their ratio;
#   3. the kernel's cost of unmapping 2 MiB segments one per call (as the engine does) and
#      batched, with and without a busy sibling thread (bench/munmap_cost.rs);
#
# and writes the results, the machine, the commit and this command between the
# `<!-- governor:start -->` / `<!-- governor:end -->` markers of docs/benchmarks-runs.md
# (BENCHMARKS.md summarises them).
#
# Usage: bash bench/governor.sh [--rounds N] [--runs N] [--lend-gib G] [--fill-gib G]
#                               [--hog-gib G] [--slow-gib G] [--quick] [--no-write]
#   --rounds N     give-back rounds (each: both scenarios, auto + control; default 3)
#   --runs N       slowdown runs on each side (default 8)
#   --lend-gib G   what the node lends (default 1.5)
#   --fill-gib G   pages put into it (default 1.25)
#   --hog-gib G    the give-back hog, plus the per-CPU free lists (default 1.375: the
#                  node must give back ~1.1 GiB of its 1.25)
#   --slow-gib G   the slowdown hog's X, plus the per-CPU free lists (default: --lend-gib)
#   --quick        small sizes and 2 runs: a smoke run, not numbers to publish
#   --no-write     print the section, leave docs/benchmarks-runs.md alone
#   --kinds K      give-back scenarios, step,follow (default both)
#   --skip giveback|slowdown   leave a part out (repeatable)
#   --governor-nice N          an experiment: renice the node's governor thread to N
#   --render DIR               write the section again from DIR/results.json (no run)
#
# Before each measurement it waits (up to 15 min, polling every 10 s) until no other
# benchmark runs (`fallow bench pages`, a busy memcached, node_vs_memcached), then at most
# 2 min more for the CPUs to be under 30 % busy (builds are noise too). Progress goes to
# stderr; raw logs, timelines and JSON to bench/out/governor-<date>/. Every process it
# starts is stopped by its PID on exit. Traffic only to 127.0.0.1.
#
# FALLOW_BIN=PATH uses that binary instead of building (its numbers mean nothing if it is
# a debug build).
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=bench/lib.sh
. bench/lib.sh
trap stop_pids EXIT

if [[ -z "${FALLOW_BIN:-}" ]]; then
    printf '==> [%s] cargo build --release -p fallow\n' "$(date +%T)" >&2
    cargo build --release -p fallow >&2
    FALLOW_BIN=target/release/fallow
fi

# The kernel's cost of unmapping segments, for the analysis (std only, so plain rustc).
if [[ ! target/munmap_cost -nt bench/munmap_cost.rs ]]; then
    rustc -O --edition 2021 bench/munmap_cost.rs -o target/munmap_cost >&2
fi

# The Python side kills its own children by PID (try/finally); this trap covers a
# SIGTERM or SIGINT of the script itself.
python3 bench/governor.py --fallow-bin "$FALLOW_BIN" --command "bash bench/governor.sh $*" "$@" &
pids+=("$!")
wait "$!"
