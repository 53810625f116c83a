#!/usr/bin/env bash
# A fallow node against memcached, side by side in one run (DESIGN.md, "Targets"): starts
# memcached (Debian package) and a fallow node on free ports of 127.0.0.1, then for every
# configuration below runs `fallow bench pages` against each, alternating which goes first,
# for several rounds; writes the medians and the fallow/memcached ratios, with the machine,
# the commit and this command, between the node-vs-memcached markers of BENCHMARKS.md.
#
# Usage: bash bench/node_vs_memcached.sh [--rounds N] [--duration D] [--keys N]
#                                        [--threads N] [--quick] [--no-write] [--memcached-only]
#   --rounds N        rounds of every configuration on each server (default 5)
#   --duration D      measured time of each run (default 3s)
#   --keys N          key space (default 65536 = 256 MiB of pages)
#   --threads N       load-generator threads (default 1)
#   --quick           1 round of 1 s: a smoke run, not numbers to publish
#   --no-write        print the section, leave BENCHMARKS.md alone
#   --memcached-only  do not start a node (memcached figures only)
#
# FALLOW_BIN=PATH uses that binary instead of building target/release/fallow (for checking
# this script with a debug build; its numbers mean nothing).
#
# Raw JSON lines and logs go to bench/out/node-vs-memcached-<date>.*. Every process this
# script starts is stopped by its PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=5
duration=3s
keys=65536
threads=1
write=1
with_node=1
args_given="$*"
while (($#)); do
    case "$1" in
        --rounds) rounds=$2; shift 2 ;;
        --duration) duration=$2; shift 2 ;;
        --keys) keys=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --quick) rounds=1; duration=1s; shift ;;
        --no-write) write=0; shift ;;
        --memcached-only) with_node=0; shift ;;
        *) sed -n '8,21p' "$0" >&2; exit 2 ;;
    esac
done

# name | what it measures | bench arguments (besides target, keys, duration, threads)
configs=(
    "get-qd1|get hit, 1 conn, QD 1, batch 1|--workload get -c 1 -q 1 -b 1 --warmup"
    "get-pipelined|get hit, 2 conns, QD 16, batch 1|--workload get -c 2 -q 16 -b 1 --warmup"
    "get-batched-1c|get hit, 1 conn, QD 4, batch 32|--workload get -c 1 -q 4 -b 32 --warmup"
    "get-batched|get hit, 2 conns, QD 4, batch 32|--workload get -c 2 -q 4 -b 32 --warmup"
    "put-batched|put, 2 conns, QD 4, batch 32|--workload put -c 2 -q 4 -b 32"
    "dup-get-qd1|dedup: get hit of 16 distinct pages, 1 conn, QD 1, batch 1|--workload get -c 1 -q 1 -b 1 --value dup --warmup"
    "dup-get-batched|dedup: get hit of 16 distinct pages, 2 conns, QD 4, batch 32|--workload get -c 2 -q 4 -b 32 --value dup --warmup"
    "dup-put-batched|dedup: put of 16 distinct pages, 2 conns, QD 4, batch 32|--workload put -c 2 -q 4 -b 32 --value dup"
)

stamp=$(date +%Y-%m-%d-%H%M%S)
out_dir=bench/out
mkdir -p "$out_dir"
results="$out_dir/node-vs-memcached-$stamp.jsonl"
section="$out_dir/node-vs-memcached-$stamp.md"
work=$(mktemp -d /tmp/fallow-vs-mc.XXXXXX)

pids=()
cleanup() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT

step() { printf '\n==> [%s] %s\n' "$(date +%T)" "$*" >&2; }

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Waits up to 10 s for something to listen on 127.0.0.1:$1, and fails if process $2 died.
wait_listening() {
    local i
    for i in $(seq 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
            return 0
        fi
        kill -0 "$2" 2>/dev/null || { echo "process $2 exited before listening on $1" >&2; return 1; }
        sleep 0.1
    done
    echo "nothing listens on 127.0.0.1:$1 after 10 s" >&2
    return 1
}

step "1/5 memcached and the release build"
if ! command -v memcached >/dev/null; then
    apt-get -o DPkg::Lock::Timeout=600 install -y memcached >&2
fi
if [[ -n ${FALLOW_BIN:-} ]]; then
    fallow=$FALLOW_BIN
    echo "using $fallow (FALLOW_BIN), not a release build" >&2
else
    cargo build --release -p fallow >&2
    fallow=target/release/fallow
fi
if ((with_node)) && ! "$fallow" node --help >/dev/null 2>&1; then
    echo "this build has no 'fallow node': measuring memcached only" >&2
    with_node=0
fi

step "2/5 servers"
mc_port=$(free_port)
mc_user=()
[[ $(id -u) == 0 ]] && mc_user=(-u root)
memcached -l 127.0.0.1 -p "$mc_port" -U 0 -m 1024 -t 2 -I 2m "${mc_user[@]}" &
mc_pid=$!
pids+=("$mc_pid")
wait_listening "$mc_port" "$mc_pid"
echo "memcached $(memcached -V | cut -d' ' -f2): pid $mc_pid, 127.0.0.1:$mc_port, -m 1024 -t 2 -I 2m" >&2
targets=("memcached|memcached://127.0.0.1:$mc_port")
secret_args=()
if ((with_node)); then
    node_port=$(free_port)
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$work/secret"
    chmod 600 "$work/secret"
    "$fallow" node --listen "127.0.0.1:$node_port" --lend 1G --secret-file "$work/secret" \
        >"$out_dir/node-vs-memcached-$stamp.node.log" 2>&1 &
    node_pid=$!
    pids+=("$node_pid")
    wait_listening "$node_port" "$node_pid"
    echo "fallow node: pid $node_pid, 127.0.0.1:$node_port, --lend 1G" >&2
    targets=("fallow|fallow://127.0.0.1:$node_port" "${targets[@]}")
    secret_args=(--secret-file "$work/secret")
fi

step "3/5 machine"
dirty=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)
command_line="bash bench/node_vs_memcached.sh${args_given:+ $args_given}"
machine=$(
    cat <<EOF
| | |
|---|---|
| CPU | $(lscpu | sed -n 's/^Model name: *//p' | head -n 1) |
| cores (nproc) | $(nproc) |
| RAM (free -g, total) | $(free -g | awk '/^Mem:/ {print $2}') GiB |
| kernel | $(uname -r) |
| rustc | $(rustc -V) |
| memcached | $(memcached -V) (\`-m 1024 -t 2 -I 2m\`) |
| commit | $(git rev-parse --short HEAD)$( ((dirty > 0)) && echo " + $dirty uncommitted modified files") |
| load average at start | $(cut -d' ' -f1-3 /proc/loadavg) |
| command | \`$command_line\` |
| runs | $rounds rounds x ${#configs[@]} configurations x ${#targets[@]} servers, $duration each, $keys keys, $threads client thread(s), order alternating |
| date | $(date -u '+%Y-%m-%d %H:%M UTC') |
EOF
)
echo "$machine" >&2

step "4/5 runs (raw JSON: $results)"
for ((round = 1; round <= rounds; round++)); do
    for config in "${configs[@]}"; do
        IFS='|' read -r name _ bench_args <<<"$config"
        # Alternate who goes first, so slow drift of the machine favours neither.
        order=("${targets[@]}")
        if ((round % 2 == 0)) && ((${#targets[@]} == 2)); then
            order=("${targets[1]}" "${targets[0]}")
        fi
        for target in "${order[@]}"; do
            IFS='|' read -r server url <<<"$target"
            extra=()
            [[ $server == fallow ]] && extra=("${secret_args[@]}")
            # shellcheck disable=SC2086 # bench_args is a list of words by design
            line=$("$fallow" bench pages --target "$url" "${extra[@]}" $bench_args \
                --keys "$keys" --duration "$duration" --threads "$threads" --json --quiet)
            python3 - "$name" "$round" "$line" >>"$results" <<'EOF'
import json, sys
name, rnd, line = sys.argv[1], int(sys.argv[2]), sys.argv[3]
r = json.loads(line)
r["config"], r["round"] = name, rnd
print(json.dumps(r))
EOF
            python3 - "$line" "$name" "$round" <<'EOF' >&2
import json, sys
r = json.loads(sys.argv[1])
l = r["latency_us"]
print(f"round {sys.argv[3]} {sys.argv[2]:<16} {r['server']:<9} {r['pages_per_s']:>10.0f} pages/s"
      f"  p50 {l['p50']:7.1f}  p99 {l['p99']:8.1f}  p99.9 {l['p999']:8.1f} µs"
      f"  hits {r['hits']} misses {r['misses']} wrong {r['wrong']}")
EOF
        done
    done
done
load_end=$(cut -d' ' -f1-3 /proc/loadavg)

step "5/5 table"
descriptions=$(printf '%s\n' "${configs[@]}" | cut -d'|' -f1,2)
python3 - "$results" "$descriptions" "$load_end" >"$section" <<'EOF'
import json, statistics, sys

rows = [json.loads(l) for l in open(sys.argv[1])]
desc = dict(line.split("|", 1) for line in sys.argv[2].splitlines() if line)
load_end = sys.argv[3]

def med(config, server, field):
    vals = [r for r in rows if r["config"] == config and r["server"] == server]
    if not vals:
        return None
    get = (lambda r: r["latency_us"][field]) if field in ("p50", "p99", "p999") else (lambda r: r[field])
    return statistics.median(get(r) for r in vals)

def fmt(x, nd=0):
    return "n/a" if x is None else f"{x:,.{nd}f}"

def ratio(a, b):
    return "n/a" if a is None or b is None or b == 0 else f"{a / b:.2f}"

servers = sorted({r["server"] for r in rows}, key=lambda s: s != "fallow")
print("| configuration | fallow pages/s | memcached pages/s | ratio | fallow p50 µs | memcached p50 µs | p50 ratio | fallow p99 / p99.9 µs | memcached p99 / p99.9 µs |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for config in desc:
    f_tp, m_tp = med(config, "fallow", "pages_per_s"), med(config, "memcached", "pages_per_s")
    f50, m50 = med(config, "fallow", "p50"), med(config, "memcached", "p50")
    tail = lambda s: f"{fmt(med(config, s, 'p99'), 1)} / {fmt(med(config, s, 'p999'), 1)}"
    print(f"| `{config}`: {desc[config]} | {fmt(f_tp)} | {fmt(m_tp)} | {ratio(f_tp, m_tp)} "
          f"| {fmt(f50, 1)} | {fmt(m50, 1)} | {ratio(f50, m50)} | {tail('fallow')} | {tail('memcached')} |")

wrong = sum(r["wrong"] for r in rows)
misses = sum(r["misses"] for r in rows if r["workload"] == "get")
print()
n_rounds = max(r["round"] for r in rows)
print(f"Medians of {n_rounds} round{'s' if n_rounds > 1 else ''}; ratio = fallow / memcached (above 1 "
      f"is better for fallow in pages/s, worse in latency). Wrong pages read back: {wrong}; "
      f"misses in the warmed get runs: {misses}. Load average at the end: {load_end}.")
print()
best = lambda server, configs: max(((med(c, server, "pages_per_s") or 0, c) for c in configs), default=(0, None))
tp_configs = [c for c in desc if not c.endswith("qd1")]
m_best, m_cfg = best("memcached", tp_configs)
dedup = [c for c in tp_configs if c.startswith("dup-")]
plain = [c for c in tp_configs if not c.startswith("dup-")]
print("| target | measured (medians) | met? |")
print("|---|---|---|")
for label, suffix in (("", ""), (" with dedup on", "dup-")):
    q = f"{suffix}get-qd1"
    f50, m50 = med(q, "fallow", "p50"), med(q, "memcached", "p50")
    met = "n/a" if f50 is None or m50 is None else ("yes" if f50 <= m50 else "**no**")
    print(f"| get hit at QD 1{label}: p50 ≤ memcached's | fallow {fmt(f50, 1)} µs, memcached {fmt(m50, 1)} µs | {met} |")
    f_best, f_cfg = best("fallow", dedup if suffix else plain)
    if "fallow" in servers:
        met = "yes" if f_best >= 250_000 and f_best >= 2 * m_best else "**no**"
        fallow_part = f"fallow {fmt(f_best)} (`{f_cfg}`)"
    else:
        met, fallow_part, f_best = "n/a", "fallow n/a", None
    print(f"| pipelined/batched{label}: ≥ 250 k pages/s and ≥ 2 × memcached's best | "
          f"{fallow_part}, memcached's best {fmt(m_best)} (`{m_cfg}`): "
          f"{ratio(f_best, m_best)} × | {met} |")
EOF

{
    echo "<!-- node-vs-memcached:start -->"
    echo "## A fallow node against memcached (4 KiB pages)"
    echo
    echo "**Command:** \`$command_line\`. It starts memcached and a fallow node on 127.0.0.1,"
    echo "runs \`fallow bench pages\` against each for every configuration, alternating which"
    echo "goes first, and rewrites this section. The load generator runs on the same 2 CPUs"
    echo "as the server under test, so every figure includes its cost; only the ratios are"
    echo "meant to travel."
    echo
    echo "$machine"
    echo
    cat "$section"
    echo "<!-- node-vs-memcached:end -->"
} >"$section.full"
mv "$section.full" "$section"
cat "$section"

if ((write)); then
    python3 - "$section" <<'EOF'
import re, sys
section = open(sys.argv[1]).read().rstrip("\n")
path = "BENCHMARKS.md"
text = open(path).read()
pattern = re.compile(r"<!-- node-vs-memcached:start -->.*?<!-- node-vs-memcached:end -->", re.S)
if pattern.search(text):
    text = pattern.sub(lambda _: section, text)
else:
    text = text.rstrip("\n") + "\n\n" + section + "\n"
open(path, "w").write(text)
EOF
    echo "wrote the section into BENCHMARKS.md" >&2
fi
