#!/usr/bin/env bash
# Benchmarks of the page pool engine (issue #2): builds the fallow-pool benches once in
# release, records the machine, runs the criterion micro-benchmarks (benches/engine.rs) and
# the memory bench (benches/memory.rs) from that one build, and writes a markdown summary
# to bench/out/engine-<date>.md (raw logs beside it).
#
# Usage: bash bench/engine.sh [--quick]
#   --quick  sizes / 8 in the memory bench, 0.2 s warm-up and 0.5 s measurement in
#            criterion: a smoke run, not numbers to publish.
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
for arg in "$@"; do
    case "$arg" in
        --quick) quick=1 ;;
        *) echo "usage: bash bench/engine.sh [--quick]" >&2; exit 2 ;;
    esac
done

stamp=$(date +%Y-%m-%d-%H%M%S)
out_dir=bench/out
mkdir -p "$out_dir"
summary="$out_dir/engine-$stamp.md"
criterion_log="$out_dir/engine-$stamp.criterion.log"
memory_md="$out_dir/engine-$stamp.memory.md"
build_json="$out_dir/engine-$stamp.build.json"

step() { printf '\n==> [%s] %s\n' "$(date +%T)" "$*" >&2; }

step "1/4 building the fallow-pool benches (release, once)"
cargo bench -p fallow-pool --no-run --message-format=json-render-diagnostics >"$build_json"
exe_of() {
    grep '"kind":\["bench"\]' "$build_json" | grep "\"name\":\"$1\"" |
        grep -o '"executable":"[^"]*"' | tail -n 1 | cut -d'"' -f4
}
engine_exe=$(exe_of engine)
memory_exe=$(exe_of memory)
if [[ -z "$engine_exe" || -z "$memory_exe" ]]; then
    echo "could not find the bench executables in $build_json" >&2
    exit 1
fi
echo "engine bench: $engine_exe" >&2
echo "memory bench: $memory_exe" >&2

step "2/4 machine"
dirty=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)
machine=$(
    cat <<EOF
| | |
|---|---|
| CPU | $(lscpu | sed -n 's/^Model name: *//p' | head -n 1) |
| L3 cache | $(lscpu | sed -n 's/^L3 cache: *//p' | head -n 1) |
| cores (nproc) | $(nproc) |
| transparent huge pages | $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null || echo unknown) |
| RAM (free -g, total) | $(free -g | awk '/^Mem:/ {print $2}') GiB |
| kernel | $(uname -r) |
| rustc | $(rustc -V) |
| commit | $(git rev-parse --short HEAD)$( ((dirty > 0)) && echo " + $dirty uncommitted modified files") |
| load average at start | $(cut -d' ' -f1-3 /proc/loadavg) |
| command | \`bash bench/engine.sh$( ((quick)) && echo " --quick")\` |
| date | $(date -u '+%Y-%m-%d %H:%M UTC') |
EOF
)
echo "$machine" >&2

step "3/4 criterion micro-benchmarks (a few minutes; raw log: $criterion_log)"
criterion_args=(--bench)
if ((quick)); then
    criterion_args+=(--warm-up-time 0.2 --measurement-time 0.5)
fi
"$engine_exe" "${criterion_args[@]}" 2>&1 | tee "$criterion_log" | grep --line-buffered -E 'time:|^Benchmarking [^:]*$' >&2

step "4/4 memory bench (fills 1.25 GiB ten times; progress below)"
if ((quick)); then
    FALLOW_BENCH_QUICK=1 "$memory_exe" >"$memory_md"
else
    "$memory_exe" >"$memory_md"
fi
load_end=$(cut -d' ' -f1-3 /proc/loadavg)
defaults=$(grep -o 'Default shards ([^)]*), policy ([^)]*)' "$memory_md" | head -n 1 || true)
defaults=${defaults/Default/default}

# Criterion prints "name  time: [low median high]" (a long name sits alone on the line
# before) and, with a throughput, "thrpt: [low median high]". Per-op time = 1 / median
# throughput, so batch benches come out per page. Lines with a % are criterion's change
# against the previous run, skipped.
criterion_table=$(
    awk '
    function ns(v, u) {
        if (u == "ps") return v / 1000
        if (u == "ns") return v
        if (u == "µs" || u == "us") return v * 1000
        if (u == "ms") return v * 1e6
        return v * 1e9
    }
    function per_sec(v, u) {
        if (u ~ /^K/) return v * 1e3
        if (u ~ /^M/) return v * 1e6
        if (u ~ /^G/) return v * 1e9
        return v
    }
    function fmt(x) { return x >= 1000 ? sprintf("%.2f µs", x / 1000) : sprintf("%.0f ns", x) }
    function target(n) {
        if (n ~ /^get\/hit|^batch32\/get_many|get_hit\+get_hit/) return 1000
        if (n ~ /^put\/|put_many|get_hit\+put/) return 2000
        return 0
    }
    /^Benchmarking/ || /%/ { next }
    /^[^ ]/ && !/time:/ { name = $1; next }
    /time:/ {
        if ($1 != "time:") name = $1
        sub(/.*\[/, ""); split($0, t, " ")
        iter[name] = ns(t[3], t[4]); order[++n] = name; next
    }
    /thrpt:/ {
        sub(/.*\[/, ""); split($0, t, " ")
        op[name] = 1e9 / per_sec(t[3], t[4]); next
    }
    END {
        print "| benchmark | median per iteration | median per op (per page) | target | |"
        print "|---|---:|---:|---|---|"
        for (i = 1; i <= n; i++) {
            b = order[i]; p = (b in op) ? op[b] : iter[b]; tg = target(b)
            verdict = tg == 0 ? "" : (p <= tg ? "met" : "**not met**")
            printf "| `%s` | %s | %s | %s | %s |\n", b, fmt(iter[b]), fmt(p), \
                tg == 0 ? "—" : "≤ " fmt(tg), verdict
        }
    }' "$criterion_log"
)

{
    echo "# fallow-pool engine benchmarks, $stamp"
    echo
    echo "## Machine"
    echo
    echo "$machine"
    echo "| load average at end | $load_end |"
    echo
    echo "## Per-operation times (criterion, medians)"
    echo
    echo "64 MiB budget, 8192 resident pages with unique contents, compression off;"
    echo "${defaults:-default shards and policy}. \`take/hit\` times the take only (pages are put back untimed);"
    echo "\`put/new_key\` times puts under empty keys (the pool is emptied untimed between passes);"
    echo "\`2threads/*\` is wall time per op of each thread, both threads running at once."
    echo
    echo "$criterion_table"
    echo
    cat "$memory_md"
} >"$summary"

step "done: $summary"
cat "$summary"
