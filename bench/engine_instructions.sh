#!/usr/bin/env bash
# Instructions per engine operation under valgrind (callgrind), setup excluded: runs
# crates/fallow-pool/benches/instructions.rs with N = 0 and N = COUNT for each operation and
# prints (Ir(COUNT) - Ir(0)) / COUNT. Deterministic, so it compares two builds on a busy
# machine where criterion's times cannot.
#
# Usage: bash bench/engine_instructions.sh [EXE]   (EXE: a prebuilt instructions bench,
#        e.g. a copy from an older commit; default: build the current tree in release)
# Env:   COUNT (default 20000), OPS (default: every operation)
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
instructions() { # OP N -> total Ir
    valgrind --tool=callgrind --callgrind-out-file="$tmp/out" "$exe" "$1" "$2" >/dev/null 2>"$tmp/err" ||
        { cat "$tmp/err" >&2; exit 1; }
    sed -n 's/^summary: //p' "$tmp/out"
}
echo "| operation | instructions per op |"
echo "|---|---:|"
for op in $ops; do
    base=$(instructions "$op" 0)
    total=$(instructions "$op" "$count")
    echo "| \`$op\` | $(( (total - base) / count )) |"
done
