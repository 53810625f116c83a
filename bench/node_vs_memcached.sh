#!/usr/bin/env bash
# A fallow node against memcached, side by side in one run (DESIGN.md, "Targets"): starts
# memcached (Debian package) and two fallow nodes on free ports of 127.0.0.1, one that
# sleeps between requests and one whose connections poll their socket (`--poll-us`), then
# for every configuration below runs `fallow bench pages` against each, rotating which goes
# first, for several rounds; each run also takes the server's CPU time over its measured
# phase (`--server-pid`). Writes the medians, the node/memcached ratios and the CPU per
# page, with the machine, the commit and this command, between the node-vs-memcached
# markers of docs/benchmarks-runs.md (BENCHMARKS.md summarises them).
#
# Usage: bash bench/node_vs_memcached.sh [--rounds N] [--duration D] [--keys N]
#            [--threads N] [--poll-us US] [--poll-cpus LIST] [--only NAME,NAME]
#            [--quick] [--no-write] [--memcached-only]
#   --rounds N        rounds of every configuration on each server (default 5)
#   --duration D      measured time of each run (default 3s)
#   --keys N          key space (default 65536 = 256 MiB of pages)
#   --threads N       load-generator threads (default 1)
#   --poll-us US      the polling node's --poll-us (default 50; 0: no polling node)
#   --poll-cpus LIST  the polling node's --cpus (default: its workers not pinned)
#   --only NAMES      only these configurations (comma-separated names from the list below)
#   --quick           1 round of 1 s: a smoke run, not numbers to publish
#   --no-write        print the section, leave docs/benchmarks-runs.md alone
#   --memcached-only  do not start a node (memcached figures only)
#
# FALLOW_BIN=PATH uses that binary instead of building target/release/fallow (for checking
# this script with a debug build; its numbers mean nothing).
#
# Raw JSON lines and logs go to bench/out/node-vs-memcached-<date>.*; the tables come from
# bench/node_vs_memcached_table.py, which can redo them from a .jsonl file. Every process this
# script starts is stopped by its PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=5
duration=3s
keys=65536
threads=1
poll_us=50
poll_cpus=""
only=""
write=1
with_node=1
args_given="$*"
while (($#)); do
    case "$1" in
        --rounds) rounds=$2; shift 2 ;;
        --duration) duration=$2; shift 2 ;;
        --keys) keys=$2; shift 2 ;;
        --threads) threads=$2; shift 2 ;;
        --poll-us) poll_us=$2; shift 2 ;;
        --poll-cpus) poll_cpus=$2; shift 2 ;;
        --only) only=$2; shift 2 ;;
        --quick) rounds=1; duration=1s; shift ;;
        --no-write) write=0; shift ;;
        --memcached-only) with_node=0; shift ;;
        *) sed -n '10,27p' "$0" >&2; exit 2 ;;
    esac
done
command_line="bash bench/node_vs_memcached.sh${args_given:+ $args_given}"

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
if [[ -n $only ]]; then
    chosen=()
    for config in "${configs[@]}"; do
        [[ ,$only, == *",${config%%|*},"* ]] && chosen+=("$config")
    done
    if ((${#chosen[@]} == 0)); then
        echo "--only $only: no such configuration" >&2
        exit 2
    fi
    configs=("${chosen[@]}")
fi

# shellcheck source=bench/lib.sh
. bench/lib.sh
bench_setup fallow-vs-mc
results="$out_dir/node-vs-memcached-$stamp.jsonl"
section="$out_dir/node-vs-memcached-$stamp.md"

clk=$(getconf CLK_TCK)

# Prints "wall-seconds busy-jiffies server-jiffies children-cpu-seconds": the machine's
# busy time (user, nice, system, steal; not irq and softirq, which no process is charged
# for and which our own loopback traffic fills), server process $1's CPU time, and the CPU
# time of this shell's finished children (the load generator). Runs in this shell, not a
# subshell, so that `times` sees our children.
cpu_sample() {
    local wall busy server
    wall=$(date +%s.%N)
    busy=$(awk '/^cpu / {print $2 + $3 + $4 + $9}' /proc/stat)
    server=$(awk '{print $14 + $15}' "/proc/$1/stat")
    times >"$work/times"
    echo "$wall $busy $server $(awk 'NR == 2 {
        gsub(/s/, ""); split($1, u, "m"); split($2, k, "m"); print u[1] * 60 + u[2] + k[1] * 60 + k[2]
    }' "$work/times")"
}

step "1/5 memcached and the release build"
if ! command -v memcached >/dev/null; then
    apt-get -o DPkg::Lock::Timeout=600 install -y memcached >&2
fi
build_fallow
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
# name|URL|PID of every server under test.
targets=("memcached|memcached://127.0.0.1:$mc_port|$mc_pid")
secret_args=()
# start_node NAME FLAGS...: a fallow node lending 1 GiB, added to the targets.
start_node() {
    local name=$1 port pid
    shift
    port=$(free_port)
    "$fallow" node --listen "127.0.0.1:$port" --lend 1G --secret-file "$work/secret" "$@" \
        >"$out_dir/node-vs-memcached-$stamp.$name.log" 2>&1 &
    pid=$!
    pids+=("$pid")
    wait_listening "$port" "$pid"
    echo "$name: pid $pid, 127.0.0.1:$port, --lend 1G $*" >&2
    targets=("${targets[@]}" "$name|fallow://127.0.0.1:$port|$pid")
}
if ((with_node)); then
    new_secret "$work/secret"
    secret_args=(--secret-file "$work/secret")
    start_node fallow
    if ((poll_us > 0)); then
        start_node fallow-poll --poll-us "$poll_us" ${poll_cpus:+--cpus "$poll_cpus"}
    fi
fi

step "3/5 machine"
machine=$(
    cat <<EOF
| | |
|---|---|
| CPU | $(cpu_model) |
| cores (nproc) | $(nproc) |
$(host_rows)
| memcached | $(memcached -V) (\`-m 1024 -t 2 -I 2m\`) |
$(run_rows "" "$command_line")
| runs | $rounds rounds x ${#configs[@]} configurations x ${#targets[@]} servers, $duration each, $keys keys, $threads client thread(s), order rotating |
| polling node | \`fallow node --poll-us $poll_us${poll_cpus:+ --cpus $poll_cpus}\` (\`fallow-poll\`; 0: none) |
| date | $(date -u '+%Y-%m-%d %H:%M UTC') |
EOF
)
echo "$machine" >&2

step "4/5 runs (raw JSON: $results)"
for ((round = 1; round <= rounds; round++)); do
    for config in "${configs[@]}"; do
        IFS='|' read -r name _ bench_args <<<"$config"
        # Rotate who goes first, so slow drift of the machine favours no server.
        n=${#targets[@]}
        order=()
        for ((i = 0; i < n; i++)); do
            order+=("${targets[(i + round) % n]}")
        done
        for target in "${order[@]}"; do
            IFS='|' read -r server url server_pid <<<"$target"
            extra=()
            [[ $server == fallow* ]] && extra=("${secret_args[@]}")
            cpu_sample "$server_pid" >"$work/before"
            # shellcheck disable=SC2086 # bench_args is a list of words by design
            line=$("$fallow" bench pages --target "$url" "${extra[@]}" $bench_args \
                --keys "$keys" --duration "$duration" --threads "$threads" \
                --server-pid "$server_pid" --json --quiet)
            cpu_sample "$server_pid" >"$work/after"
            python3 - "$name" "$round" "$line" "$work/before" "$work/after" "$clk" "$server" \
                >>"$results" <<'EOF'
import json, sys
name, rnd, line = sys.argv[1], int(sys.argv[2]), sys.argv[3]
clk = float(sys.argv[6])
(w0, b0, s0, c0), (w1, b1, s1, c1) = (map(float, open(f).read().split()) for f in sys.argv[4:6])
wall = max(w1 - w0, 1e-9)
server, client = (s1 - s0) / clk, c1 - c0
other = (b1 - b0) / clk - server - client
r = json.loads(line)
# The server's name in this script (fallow, fallow-poll, memcached), not its protocol.
r["config"], r["round"], r["server"] = name, rnd, sys.argv[7]
# CPUs kept busy during the run (warm-up included): by the server under test, by the load
# generator, and by everything else (other processes, and steal time of this VM).
r["server_cpus"], r["client_cpus"] = server / wall, client / wall
r["other_cpus"] = max(other, 0.0) / wall
print(json.dumps(r))
EOF
            python3 - "$line" "$name" "$round" "$server" <<'EOF' >&2
import json, sys
r = json.loads(sys.argv[1])
l = r["latency_us"]
print(f"round {sys.argv[3]} {sys.argv[2]:<16} {sys.argv[4]:<11} {r['pages_per_s']:>10.0f} pages/s"
      f"  p50 {l['p50']:7.1f}  p99 {l['p99']:8.1f}  p99.9 {l['p999']:8.1f} µs"
      f"  hits {r['hits']} misses {r['misses']} wrong {r['wrong']}")
EOF
        done
    done
done
load_end=$(cut -d' ' -f1-3 /proc/loadavg)

step "5/5 table"
printf '%s\n' "${configs[@]}" | cut -d'|' -f1,2 >"$work/configs"
python3 bench/node_vs_memcached_table.py "$results" --configs "$work/configs" \
    --load-end "$load_end" >"$section"

{
    echo "<!-- node-vs-memcached:start -->"
    echo "## A fallow node against memcached (4 KiB pages)"
    echo
    echo "**Command:** \`$command_line\`. It starts memcached and two fallow nodes on"
    echo "127.0.0.1 (\`fallow\` sleeps between requests, \`fallow-poll\` polls its sockets),"
    echo "runs \`fallow bench pages\` against each for every configuration, rotating which goes"
    echo "first, and rewrites this section. The load generator runs on the same 2 CPUs as the"
    echo "server under test, so every figure includes its cost; only the ratios are meant to"
    echo "travel."
    echo
    echo "$machine"
    echo
    cat "$section"
    echo "<!-- node-vs-memcached:end -->"
} >"$section.full"
mv "$section.full" "$section"
cat "$section"

if ((write)); then
    write_section "$section" node-vs-memcached "$runs_doc"
    echo "wrote the section into $runs_doc" >&2
fi
