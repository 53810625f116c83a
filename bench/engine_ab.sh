#!/usr/bin/env bash
# Alternating A/B of the engine's criterion benches between two commits, for a shared and
# noisy machine: the two builds run in turn, ROUNDS times, and each bench's median per
# build is the median of its per-round medians (STYLE.md rule 15). This is how the
# "old → new" rows of BENCHMARKS.md's engine section were measured.
#
# Usage: bash bench/engine_ab.sh OLD_REV [NEW_REV] [FILTER] [ROUNDS]
#   NEW_REV  default HEAD
#   FILTER   criterion filter (a regex), default every single-page, batch and two-thread bench
#   ROUNDS   default 3
# Env: AB_TARGET_DIR (default target/ab): where both commits are built, one after the other.
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# -ge 1 ]] || { sed -n '2,11p' "$0" >&2; exit 2; }
old_rev=$1
new_rev=${2:-HEAD}
filter=${3:-'get/|put/|take|batch32|2threads'}
rounds=${4:-3}
target=$(realpath -m "${AB_TARGET_DIR:-target/ab}")
tmp=$(mktemp -d)
cleanup() {
    git worktree remove --force "$tmp/tree" 2>/dev/null || true
    rm -rf "$tmp"
}
trap cleanup EXIT

# Builds the engine bench of REV into $tmp/NAME.
build() {
    local rev=$1 name=$2 exe
    git worktree add -q --detach "$tmp/tree" "$rev"
    exe=$(cd "$tmp/tree" && CARGO_TARGET_DIR="$target" cargo bench -p fallow-pool --bench engine \
        --no-run --message-format=json 2>/dev/null |
        grep -o '"executable":"[^"]*/engine-[^"]*"' | tail -n 1 | cut -d'"' -f4)
    [[ -x "$exe" ]] || { echo "no engine bench built for $rev" >&2; exit 1; }
    cp "$exe" "$tmp/$name"
    git worktree remove --force "$tmp/tree"
}

echo "building $old_rev and $new_rev in $target ..." >&2
build "$old_rev" old
build "$new_rev" new

# One run of one build: "BUILD BENCH NANOSECONDS" for each bench's criterion median.
run() {
    "$tmp/$1" --bench "$filter" 2>/dev/null | awk -v b="$1" '
        /^[a-z0-9_]+\/[^ ]+/ { name = $1 }
        /time:/ && !/%/ {
            for (i = 1; i <= NF; i++) if ($i == "time:") {
                v = $(i + 3); u = $(i + 4)
                if (u == "µs") v *= 1000; else if (u == "ms") v *= 1e6; else if (u == "s") v *= 1e9
                print b, name, v
            }
        }'
}

for r in $(seq "$rounds"); do
    echo "round $r of $rounds" >&2
    run old >>"$tmp/results"
    run new >>"$tmp/results"
done

echo "| bench | $old_rev (ns) | $new_rev (ns) | new / old | rounds: old | rounds: new |"
echo "|---|---:|---:|---:|---|---|"
python3 - "$tmp/results" <<'EOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    build, bench, ns = line.split()
    runs.setdefault(bench, {}).setdefault(build, []).append(float(ns))
for bench in sorted(runs):
    old, new = runs[bench].get("old", []), runs[bench].get("new", [])
    if not old or not new:
        continue
    mo, mn = statistics.median(old), statistics.median(new)
    fmt = lambda xs: " ".join(f"{x:.0f}" for x in xs)
    print(f"| `{bench}` | {mo:.0f} | {mn:.0f} | {mn / mo:.2f} | {fmt(old)} | {fmt(new)} |")
EOF
