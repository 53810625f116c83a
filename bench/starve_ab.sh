#!/usr/bin/env bash
# Persistent pages of a cluster on a starved host, two builds side by side: three
# `fallow node` processes gossiping on 127.0.0.1 and `fallow bench pages --persistent
# --workload mix:0.5` against them all run at nice 15 beside HOGS busy loops at nice 0,
# so fallow gets a few percent of the 2 CPUs, its gossip misses its deadlines and its
# requests time out. Each round runs both builds in turn (alternating which goes
# first), each with a fresh cluster of its own; it prints each run's requests, failed
# requests, wrong pages, how often the nodes declared a peer dead and how many connections
# they fenced (a build without sessions counts none), then the totals.
#
# Usage: bash bench/starve_ab.sh OLD_FALLOW NEW_FALLOW [ROUNDS]
#   ROUNDS   default 3
# Env: HOGS (default 12) busy loops; SECONDS_PER_RUN (default 30).
set -euo pipefail
source "$(dirname "$0")/lib.sh"
ab_setup 2,12 3 "$@"
hogs=${HOGS:-12}
seconds=${SECONDS_PER_RUN:-30}

echo "starve-ab-secret-0123456789abcdef" >"$dir/secret"

# One run of build $1 (named $2): prints "NAME REQUESTS ERRORS WRONG DECLARED_DEAD FENCED".
run() {
    local exe=$1 name=$2 listen=() gossip=() metrics=() i j join
    for i in 0 1 2; do
        listen+=("127.0.0.1:$(free_port tcp)")
        gossip+=("127.0.0.1:$(free_port udp)")
        metrics+=("127.0.0.1:$(free_port tcp)")
    done
    for i in 0 1 2; do
        join=""
        for j in 0 1 2; do [[ $j == "$i" ]] || join+="${join:+,}${gossip[$j]}"; done
        nice -n 15 "$exe" node --listen "${listen[$i]}" --gossip "${gossip[$i]}" --join "$join" \
            --lend 256M --secret-file "$dir/secret" --metrics "${metrics[$i]}" \
            >"$dir/node$i.log" 2>&1 &
        pids+=($!)
    done
    for _ in $(seq 100); do
        "$exe" stat --node "${listen[0]}" --secret-file "$dir/secret" >/dev/null 2>&1 && break
        sleep 0.1
    done
    sleep 2
    for _ in $(seq "$hogs"); do
        (while :; do :; done) &
        pids+=($!)
    done
    nice -n 15 "$exe" bench pages --target "fallow://${listen[0]},${listen[1]},${listen[2]}" \
        --secret-file "$dir/secret" --workload mix:0.5 --persistent --keys 8192 \
        --connections 2 --queue-depth 4 --batch 8 --duration "${seconds}s" --warmup --json \
        --quiet >"$dir/bench.json" 2>"$dir/bench.err" || true
    local fenced=0 count
    for i in 0 1 2; do
        count=$(curl -s --max-time 10 "http://${metrics[$i]}/metrics" |
            awk '/^fallow_node_fenced_connections_total /{print $2}')
        fenced=$((fenced + ${count:-0}))
    done
    stop_pids
    pids=()
    local dead
    dead=$(cat "$dir"/node*.log | grep -c "declared dead" || true)
    python3 - "$name" "$dir/bench.json" "$dead" "$fenced" <<'EOF'
import json, sys
name, path, dead, fenced = sys.argv[1:]
try:
    r = json.load(open(path))
    print(name, r["requests"], r["errors"], r["wrong"], dead, fenced)
    if r.get("first_error"):
        print(f"{name}: the first failure: {r['first_error']}", file=sys.stderr)
except (OSError, ValueError, KeyError):
    print(name, 0, "failed", 0, dead, fenced)
EOF
}

results="$dir/results"
for round in $(seq "$rounds"); do
    order=(old new)
    ((round % 2)) || order=(new old)
    for which in "${order[@]}"; do
        exe=$old
        [[ $which == new ]] && exe=$new
        line=$(run "$exe" "$which")
        echo "round $round/$rounds: $line" >&2
        echo "$line" >>"$results"
    done
done

python3 - "$results" <<'EOF'
import collections, sys
total = collections.defaultdict(lambda: [0, 0, 0, 0, 0, 0])
for line in open(sys.argv[1]):
    name, requests, errors, wrong, dead, fenced = line.split()
    t = total[name]
    t[0] += 1
    t[1] += int(requests)
    t[2] += int(errors) if errors.isdigit() else 0
    t[3] += int(wrong)
    t[4] += int(dead)
    t[5] += int(fenced)
print("| build | runs | requests | failed requests | wrong pages | peers declared dead "
      "| connections fenced |")
print("|---|---|---|---|---|---|---|")
for name in ("old", "new"):
    runs, requests, errors, wrong, dead, fenced = total[name]
    print(f"| {name} | {runs} | {requests:,} | {errors:,} | {wrong} | {dead} | {fenced} |")
EOF
