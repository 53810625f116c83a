#!/usr/bin/env bash
# Instructions per engine operation under valgrind (callgrind), setup excluded: runs
# crates/fallow-pool/benches/instructions.rs with N = 0 and N = COUNT for each operation and
# prints (Ir(COUNT) - Ir(0)) / COUNT. Deterministic, so it compares two builds on a busy
# machine where criterion's times cannot.
#
# Usage: bash bench/engine_instructions.sh [EXE]   (EXE: a prebuilt instructions bench,
#        e.g. a copy from an older commit; default: build the current tree in release)
# Env:   COUNT (default 20000), OPS (default: every operation), CACHE_SIM=1 (also
#        callgrind's simulated first-level data read misses per operation, D1mr: whether a
#        change that keeps the instructions moved the memory traffic)
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind is needed (apt-get install valgrind)" >&2; exit 1; }
count=${COUNT:-20000}
ops=${OPS:-get_hit get_miss put_new put_overwrite take_put invalidate_object}
exe=${1:-}
if [[ -z "$exe" ]]; then
    exe=$(cargo bench -p fallow-pool --bench instructions --no-run --message-format=json 2>/dev/null |
        grep -o '"executable":"[^"]*instructions[^"]*"' | tail -n 1 | cut -d'"' -f4)
fi
[[ -x "$exe" ]] || { echo "no instructions bench executable ($exe)" >&2; exit 1; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cache_sim=${CACHE_SIM:-0}
sim_args=()
[[ "$cache_sim" == 1 ]] && sim_args=(--cache-sim=yes)
counts() { # OP N -> total Ir [D1mr]
    valgrind --tool=callgrind "${sim_args[@]}" --callgrind-out-file="$tmp/out" "$exe" "$1" "$2" \
        >/dev/null 2>"$tmp/err" || { cat "$tmp/err" >&2; exit 1; }
    # The summary's events: Ir, or with the cache simulation Ir Dr Dw I1mr D1mr ...
    sed -n 's/^summary: //p' "$tmp/out" | awk -v sim="$cache_sim" '{ print (sim == 1 ? $1 " " $5 : $1) }'
}
if [[ "$cache_sim" == 1 ]]; then
    echo "| operation | instructions per op | D1 read misses per op |"
    echo "|---|---:|---:|"
else
    echo "| operation | instructions per op |"
    echo "|---|---:|"
fi
for op in $ops; do
    read -r base base_d1 <<<"$(counts "$op" 0)"
    read -r total total_d1 <<<"$(counts "$op" "$count")"
    if [[ "$cache_sim" == 1 ]]; then
        d1=$(awk -v a="$total_d1" -v b="$base_d1" -v n="$count" 'BEGIN { printf "%.1f", (a - b) / n }')
        echo "| \`$op\` | $(( (total - base) / count )) | $d1 |"
    else
        echo "| \`$op\` | $(( (total - base) / count )) |"
    fi
done
