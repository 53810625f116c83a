#!/usr/bin/env bash
# The cluster client over 1, 2 and 3 `fallow node` processes on 127.0.0.1 (issue #5,
# "Benchmarks"), driven by `fallow bench pages --target cluster://A,B,C`:
#   1. capacity and throughput: three clusters of 1, 2 and 3 nodes (each lending 256 MiB)
#      run side by side, measured in turn, the order rotating each round. Capacity: a
#      warm-up puts twice the lent pages, then random gets over them count what stayed
#      (and every node's `fallow stat` is read meanwhile). Throughput: batched puts and
#      gets (32 pages) at queue depths 1, 4 and 16; a plain `Client` to the 1-node cluster's
#      node runs the same load, for the cost of the cluster layer.
#   2. a node killed mid-run: a fresh 3-node cluster per round; 1-page gets at a bounded
#      rate, with a per-request timeline; one node SIGKILLed 2 s into the measured phase.
#      The latency windows before the kill, from the kill to the client's detection, and
#      after it, and the errors (must be 0), come from bench/cluster_table.py.
#   3. the client's metadata: 3 nodes lending 2 GiB each, a warm-up puts 2^20 pages; the
#      summary's own byte count, and the RSS growth of the process against the same
#      warm-up through a plain `Client` (no summary).
#
# Usage: bash bench/cluster.sh [--rounds N] [--duration D] [--quick] [--write] [--parts "1 2 3"]
#   --rounds N     rounds of each measurement (default 3; medians are reported)
#   --duration D   measured time of each throughput run (default 2s)
#   --quick        1 round, 1 s runs, smaller key spaces: a smoke run, not numbers to publish
#   --write        put the tables between the cluster-bench markers of docs/benchmarks-runs.md
#   --parts LIST   which of the three parts to run (default "1 2 3")
#
# FALLOW_BIN=PATH uses that binary instead of building target/release/fallow.
# Everything runs on 127.0.0.1 of one machine: the nodes and the load generator share its
# CPUs. Raw JSON lines, timelines and logs go to bench/out/cluster-<date>.*; every process
# this script starts is stopped by its PID on exit.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=3
duration=2s
quick=0
write=0
parts="1 2 3"
args_given="$*"
while (($#)); do
    case "$1" in
        --rounds) rounds=$2; shift 2 ;;
        --duration) duration=$2; shift 2 ;;
        --quick) quick=1; rounds=1; duration=1s; shift ;;
        --write) write=1; shift ;;
        --parts) parts=$2; shift 2 ;;
        *) sed -n '18,25p' "$0" >&2; exit 2 ;;
    esac
done
command_line="bash bench/cluster.sh${args_given:+ $args_given}"

lend=256M
lend_pages=65536        # 256 MiB of 4 KiB pages
tp_keys=32768           # throughput key space: 128 MiB, fits one node
meta_keys=1048576       # part 3: 2^20 placed pages
meta_lend=2G
kill_rate=4000          # part 2: 1-page gets per second, over 4 loops
kill_duration=6
kill_at=2               # seconds into the measured phase
if ((quick)); then
    meta_keys=131072
    meta_lend=256M
    kill_duration=4
fi

# shellcheck source=bench/lib.sh
. bench/lib.sh
bench_setup fallow-cluster-bench
prefix="$out_dir/cluster-$stamp"
results="$prefix.jsonl"

log() { printf '    [%s] %s\n' "$(date +%T)" "$*" >&2; }

step "1/5 release build and secret"
build_fallow
new_secret "$work/secret"
secret=(--secret-file "$work/secret")

# Cluster bookkeeping: cluster NAME has nodes "$NAME-1".. with ports in node_port[...] and
# PIDs in node_pid[...]; cluster_nodes[NAME] lists its node names.
declare -A node_port node_pid cluster_nodes

# start_cluster NAME N LEND: N nodes that join each other by gossip (one node gossips
# alone: a cluster of one, so that it publishes its capacity); waits until the first node
# lists all N alive.
start_cluster() {
    local name=$1 n=$2 lend_each=$3 i j
    local -a tcp udp
    for ((i = 1; i <= n; i++)); do
        tcp[i]=$(free_port tcp)
        udp[i]=$(free_port udp)
    done
    cluster_nodes[$name]=""
    for ((i = 1; i <= n; i++)); do
        local join=()
        local peers=""
        for ((j = 1; j <= n; j++)); do
            ((j != i)) && peers+="${peers:+,}127.0.0.1:${udp[j]}"
        done
        [[ -n $peers ]] && join=(--join "$peers")
        "$fallow" node --listen "127.0.0.1:${tcp[i]}" --gossip "127.0.0.1:${udp[i]}" \
            "${join[@]}" --lend "$lend_each" "${secret[@]}" >"$prefix.$name-$i.log" 2>&1 &
        local pid=$!
        pids+=("$pid")
        node_port[$name-$i]=${tcp[i]}
        node_pid[$name-$i]=$pid
        cluster_nodes[$name]+="$name-$i "
    done
    for ((i = 1; i <= n; i++)); do
        wait_listening "${tcp[i]}" "${node_pid[$name-$i]}"
    done
    local alive=0
    for i in $(seq 150); do
        alive=$("$fallow" stat --node "127.0.0.1:${tcp[1]}" "${secret[@]}" --cluster --json 2>/dev/null |
            python3 -c 'import json, sys; print(json.load(sys.stdin)["alive"])' 2>/dev/null || echo 0)
        ((alive == n)) && break
        sleep 0.1
    done
    ((alive == n)) || { echo "cluster $name: $alive of $n members alive after 15 s" >&2; return 1; }
    log "cluster $name: $n node(s) lending $lend_each each, ports ${tcp[*]}"
}

# The seed list of cluster NAME.
seeds() {
    local list="" node
    for node in ${cluster_nodes[$1]}; do
        list+="${list:+,}127.0.0.1:${node_port[$node]}"
    done
    echo "$list"
}

stop_cluster() {
    local node
    for node in ${cluster_nodes[$1]}; do
        kill "${node_pid[$node]}" 2>/dev/null || true
        wait "${node_pid[$node]}" 2>/dev/null || true
    done
}

# Every node's counters of cluster NAME, as one JSON array.
node_stats() {
    local node first=1
    printf '['
    for node in ${cluster_nodes[$1]}; do
        ((first)) || printf ','
        first=0
        "$fallow" stat --node "127.0.0.1:${node_port[$node]}" "${secret[@]}" --json 2>/dev/null || printf 'null'
    done
    printf ']'
}

# bench RECORD-FIELDS-JSON BENCH-ARGS...: runs `fallow bench pages` and appends its report,
# with the fields given, to $results; prints a one-line summary.
bench() {
    local fields=$1
    shift
    local line
    line=$("$fallow" bench pages "${secret[@]}" "$@" --json --quiet)
    python3 - "$fields" "$line" >>"$results" <<'EOF'
import json, sys
r = json.loads(sys.argv[2])
r.update(json.loads(sys.argv[1]))
print(json.dumps(r))
EOF
    python3 - "$fields" "$line" <<'EOF' >&2
import json, sys
f, r = json.loads(sys.argv[1]), json.loads(sys.argv[2])
l = r["latency_us"]
print(f"    round {f['round']} {f['part']:<10} {f['config']:<22} {r['pages_per_s']:>9.0f} pages/s"
      f"  p50 {l['p50']:7.1f}  p99 {l['p99']:8.1f} µs  hits {r['hits']} misses {r['misses']}"
      f"  errors {r['errors']} wrong {r['wrong']}")
EOF
}

# bench_bg FILE-STEM BENCH-ARGS...: runs `fallow bench pages` in the background with its
# progress in STEM.err and report in STEM.json; sets bench_pid.
bench_bg() {
    local stem=$1
    shift
    "$fallow" bench pages "${secret[@]}" "$@" --json >"$stem.json" 2>"$stem.err" &
    bench_pid=$!
    pids+=("$bench_pid")
}

# wait_progress STEM SECONDS: waits until the measured phase of the background bench has
# run SECONDS s (its progress line "measure   S.0 s"), up to 120 s.
wait_progress() {
    local i
    for i in $(seq 12000); do
        if grep -Eq "^measure +$2\.[0-9] s" "$1.err" 2>/dev/null; then
            return 0
        fi
        kill -0 "$bench_pid" 2>/dev/null || { echo "bench ended early: $(cat "$1.err")" >&2; return 1; }
        sleep 0.01
    done
    echo "no progress line 'measure $2 s' after 120 s" >&2
    return 1
}

step "2/5 machine"
machine=$(
    cat <<EOF
| | |
|---|---|
| CPU | $(cpu_model), $(nproc) vCPUs (a shared VM: other builds ran meanwhile) |
$(host_rows)
$(run_rows " (other work in progress)" "$command_line")
| date | $(date -u '+%Y-%m-%d %H:%M UTC') |
| network | every node and the client on 127.0.0.1 of this one machine (there is no other); all share its CPUs |
EOF
)
echo "$machine" >&2

if [[ " $parts " == *" 1 "* ]]; then
    step "3/5 part 1: capacity and throughput, 1, 2 and 3 nodes lending $lend each"
    start_cluster n1 1 "$lend"
    start_cluster n2 2 "$lend"
    start_cluster n3 3 "$lend"
    # name | target | lent pages (0: no capacity run)
    targets=(
        "1 node|cluster://$(seeds n1)|$((lend_pages))"
        "2 nodes|cluster://$(seeds n2)|$((2 * lend_pages))"
        "3 nodes|cluster://$(seeds n3)|$((3 * lend_pages))"
        "plain Client, 1 node|fallow://127.0.0.1:${node_port[n1-1]}|0"
    )
    cluster_of=("n1" "n2" "n3" "n1")
    qds=(1 4 16)
    for ((round = 1; round <= rounds; round++)); do
        # Rotate which target goes first, so slow drift of the machine favours none.
        for ((k = 0; k < ${#targets[@]}; k++)); do
            t=$(((k + round - 1) % ${#targets[@]}))
            IFS='|' read -r name url lent <<<"${targets[t]}"
            if ((lent > 0)); then
                keys=$((2 * lent))
                stem="$work/cap-$round-$t"
                # 2 s: the node counters are read at the first progress tick (1 s).
                bench_bg "$stem" --target "$url" --workload get -b 64 -q 4 --keys "$keys" \
                    --warmup --duration 2s
                wait_progress "$stem" 1
                stats=$(node_stats "${cluster_of[t]}")
                wait "$bench_pid"
                python3 - "$name" "$round" "$lent" "$stem.json" "$stats" >>"$results" <<'EOF'
import json, sys
name, rnd, lent, path, stats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
r = json.load(open(path))
r.update(part="capacity", config=name, round=rnd, lent_pages=lent, node_stats=json.loads(stats))
print(json.dumps(r))
EOF
                python3 - "$name" "$round" "$stem.json" "$stats" <<'EOF' >&2
import json, sys
r, stats = json.load(open(sys.argv[3])), json.loads(sys.argv[4])
ratio = r["hits"] / max(r["hits"] + r["misses"], 1)
print(f"    round {sys.argv[2]} capacity   {sys.argv[1]:<22} put {r['warmup_pages']} pages; "
      f"get hit ratio {ratio:.3f} -> ~{ratio * r['keys']:.0f} pages resident; nodes hold "
      f"{sum(s['pages'] for s in stats if s)} pages, evicted {sum(s['evictions'] for s in stats if s)}, "
      f"refused {sum(s['puts_refused'] for s in stats if s)}; errors {r['errors']}")
EOF
            fi
            for qd in "${qds[@]}"; do
                bench "{\"part\": \"throughput\", \"config\": \"$name put q$qd\", \"target_name\": \"$name\", \"round\": $round}" \
                    --target "$url" --workload put -b 32 -q "$qd" --keys "$tp_keys" --duration "$duration"
                bench "{\"part\": \"throughput\", \"config\": \"$name get q$qd\", \"target_name\": \"$name\", \"round\": $round}" \
                    --target "$url" --workload get -b 32 -q "$qd" --keys "$tp_keys" --duration "$duration" --warmup
            done
        done
    done
    stop_cluster n1
    stop_cluster n2
    stop_cluster n3
fi

if [[ " $parts " == *" 2 "* ]]; then
    step "4/5 part 2: a node SIGKILLed under a steady read ($kill_rate gets/s of 1 page, QD 4)"
    for ((round = 1; round <= rounds; round++)); do
        start_cluster "k$round" 3 "$lend"
        victim="k$round-2"
        stem="$prefix.kill-$round"
        bench_bg "$stem" --target "cluster://$(seeds "k$round")" --workload get -b 1 -q 4 \
            --rate "$kill_rate" --keys "$tp_keys" --warmup --duration "${kill_duration}s" \
            --timeline "$stem.csv"
        wait_progress "$stem" "$kill_at"
        kill_ns=$(date +%s%N)
        kill -KILL "${node_pid[$victim]}"
        log "round $round: SIGKILLed node 127.0.0.1:${node_port[$victim]} (pid ${node_pid[$victim]})"
        wait "$bench_pid"
        python3 - "$round" "$stem.json" "$kill_ns" "${node_port[$victim]}" "$stem.csv" \
            >>"$results" <<'EOF'
import json, sys
rnd, path, kill_ns, port, csv = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
r = json.load(open(path))
r.update(part="kill", config="3 nodes, kill 1", round=rnd, kill_unix_ns=kill_ns,
         victim=f"127.0.0.1:{port}", timeline_csv=csv)
print(json.dumps(r))
EOF
        python3 bench/cluster_table.py --kill-round "$results" "$round" >&2
        stop_cluster "k$round"
    done
fi

if [[ " $parts " == *" 3 "* ]]; then
    step "5/5 part 3: client metadata at $meta_keys placed pages (3 nodes lending $meta_lend each)"
    start_cluster m 3 "$meta_lend"
    for ((round = 1; round <= rounds; round++)); do
        # A plain Client first or second in turn: its RSS growth is the baseline of the
        # same warm-up without a summary.
        order=("cluster" "plain")
        ((round % 2 == 0)) && order=("plain" "cluster")
        for which in "${order[@]}"; do
            url="cluster://$(seeds m)"
            [[ $which == plain ]] && url="fallow://127.0.0.1:${node_port[m-1]}"
            bench "{\"part\": \"metadata\", \"config\": \"$which\", \"round\": $round}" \
                --target "$url" --workload get -b 64 -q 4 --keys "$meta_keys" --warmup --duration 1s
        done
    done
    stop_cluster m
fi

load_end=$(cut -d' ' -f1-3 /proc/loadavg)
section="$prefix.md"
{
    echo "<!-- cluster-bench:start -->"
    echo "### Capacity, throughput, a node kill and metadata: \`bench/cluster.sh\`"
    echo
    echo "**Command:** \`$command_line\` (raw results: \`$results\`)."
    echo
    echo "$machine"
    echo "| load average at end | $load_end |"
    echo
    # The section lives in docs/, so its link to the plot is relative to docs/.
    python3 bench/cluster_table.py "$results" --plot docs/img/cluster-kill-latency.png |
        sed 's|](docs/img/|](img/|'
    echo "<!-- cluster-bench:end -->"
} >"$section"
cat "$section"

if ((write)); then
    write_section "$section" cluster-bench "$runs_doc"
    echo "wrote the tables into $runs_doc" >&2
fi
