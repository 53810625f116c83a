#!/usr/bin/env bash
# The NBD benchmark of issue #4, side by side in one run (DESIGN.md, "Targets"): fio 4 KiB
# random reads (ioengine=nbd) at QD 1 and QD 16 against
#   * `nbdkit memory` (the ceiling);
#   * nbdkit memory behind the delay filter at 1 ms and at 5 ms (the backing store alone);
#   * nbdkit's nbd plugin over the 1 ms store (what a plain pass-through proxy costs);
#   * a plain TCP relay over the 1 ms store (`fallow bench delay-proxy --delay 0`: bytes
#     copied from one socket to the other, no NBD work), what the extra hop alone costs;
#   * `fallow nbd` over that same delayed store, with the working set inside its cache
#     (half of it), at twice its cache, and with no cache at all (`--pool none
#     --local-tier 0`, the "empty pool");
# plus, for the plot, fallow over the 1 ms store at working sets of 1/4 ... 4 x its cache.
# Every server listens on a free port of 127.0.0.1. The configurations of a group are run
# one after the other, round after round (the order rotates), and every ratio is taken within
# one round before the median over the rounds. The section goes between the nbd-vs-nbdkit
# markers of docs/benchmarks-runs.md (BENCHMARKS.md summarises it), the plot to
# docs/img/nbd-iops-vs-working-set.png.
#
# Usage: bash bench/nbd_vs_nbdkit.sh [--rounds N] [--runtime S] [--ramp S] [--pool SIZE]
#                                    [--local-tier SIZE] [--quick] [--no-write] [--only LIST]
#                                    [--uri-params P] [--variant TAG=[BINARY][,P]]... [--qd LIST]
#   --rounds N         rounds of every configuration (default 3)
#   --runtime S        measured seconds of each fio run (default 6)
#   --ramp S           fio ramp_time before it, not measured (default 2)
#   --pool SIZE        fallow's in-process pool, --pool local:SIZE (default 48M)
#   --local-tier SIZE  fallow's local tier (default 16M); the cache is pool + local tier
#   --quick            1 round of 2 s: a smoke run, not numbers to publish
#   --no-write         print the section, leave docs/benchmarks-runs.md and the plot alone
#   --only LIST        run only these configurations (comma-separated names, e.g.
#                      store1,f1_empty); servers no chosen configuration needs are not started
#   --uri-params P     appended to fallow's store URI, e.g. '?conns=2'
#   --variant TAG=[BINARY][,P]  also run every chosen fallow configuration as CONFIG+TAG,
#                      with that binary (default: the same) and URI parameters P, interleaved
#                      with the others: before/after comparisons, connection counts
#   --qd LIST          the queue depths of the groups (default "1 16"; the plot is QD 16)
#
# FALLOW_BIN=PATH uses that binary instead of building target/release/fallow.
#
# Raw JSON lines and logs go to bench/out/nbd-vs-nbdkit-<date>.*; bench/nbd_table.py makes the
# tables and bench/plot_nbd.py the plot, and both can redo them from the .jsonl file. Every
# process this script starts is stopped by its PID on exit. Progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=3
runtime=6
ramp=2
pool=48M
local_tier=16M
write=1
only=""
qds="1 16"
uri_params=""
variants=()
args_given="$*"
while (($#)); do
    case "$1" in
        --only) only=",$2,"; shift 2 ;;
        --uri-params) uri_params=$2; shift 2 ;;
        --variant) variants+=("$2"); shift 2 ;;
        --qd) qds=$2; shift 2 ;;
        --rounds) rounds=$2; shift 2 ;;
        --runtime) runtime=$2; shift 2 ;;
        --ramp) ramp=$2; shift 2 ;;
        --pool) pool=$2; shift 2 ;;
        --local-tier) local_tier=$2; shift 2 ;;
        --quick) rounds=1; runtime=2; ramp=1; shift ;;
        --no-write) write=0; shift ;;
        *) sed -n '16,34p' "$0" >&2; exit 2 ;;
    esac
done

log() { echo "[nbd-vs-nbdkit $(date +%H:%M:%S)] $*" >&2; }

mib() { # SIZE (K/M/G suffix) -> MiB
    local v=${1%[KkMmGg]} u=${1: -1}
    case "$u" in
        K|k) echo $((v / 1024)) ;; M|m) echo "$v" ;; G|g) echo $((v * 1024)) ;;
        *) echo $((v / 1048576)) ;;
    esac
}
cache_mib=$(($(mib "$pool") + $(mib "$local_tier")))
export_mib=$((cache_mib * 4))
((cache_mib >= 4)) || { echo "the cache (pool + local tier) must be at least 4 MiB" >&2; exit 2; }

stamp=$(date +%Y-%m-%d-%H%M%S)
out_dir=bench/out
mkdir -p "$out_dir"
results="$out_dir/nbd-vs-nbdkit-$stamp.jsonl"
discarded="$out_dir/nbd-vs-nbdkit-$stamp.discarded.jsonl"
section="$out_dir/nbd-vs-nbdkit-$stamp.md"
meta="$out_dir/nbd-vs-nbdkit-$stamp.meta.json"
work=$(mktemp -d /tmp/fallow-nbd-bench.XXXXXX)
: >"$results"
: >"$discarded"

pids=()
cleanup() {
    local pid
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        # bounded: SIGKILL whatever has not gone after 5 s
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$work"
}
trap cleanup EXIT

# --- the binary, copied so that a rebuild by someone else cannot change it mid-run -------------
if [[ -n "${FALLOW_BIN:-}" ]]; then
    cp "$FALLOW_BIN" "$work/fallow"
else
    log "building fallow (release)"
    cargo build --release -p fallow >&2
    cp target/release/fallow "$work/fallow"
fi
fallow="$work/fallow"
# what was built: the commit, and files changed since (other people's work in progress)
commit=$(git rev-parse --short HEAD)
dirty=$(git status --porcelain --untracked-files=no -- crates Cargo.toml Cargo.lock | awk '{print $2}' | tr '\n' ' ')
has_metrics=0
if "$fallow" nbd --help | grep -q -- '--metrics'; then has_metrics=1; fi
# the variants: TAG=[BINARY][,URI_PARAMS], each binary copied like the main one
declare -A v_bin v_params
variant_tags=()
for v in "${variants[@]}"; do
    tag=${v%%=*} rest=${v#*=}
    vbin=${rest%%,*} vparams=""
    [[ $rest == *,* ]] && vparams=${rest#*,}
    [[ -n $tag && $tag != "$v" ]] || { echo "--variant $v: expected TAG=[BINARY][,URI_PARAMS]" >&2; exit 2; }
    if [[ -n $vbin ]]; then
        cp "$vbin" "$work/fallow+$tag"
        v_bin[$tag]="$work/fallow+$tag"
    else
        v_bin[$tag]=$fallow
    fi
    v_params[$tag]=$vparams
    variant_tags+=("$tag")
done
selected() { [[ -z $only || $only == *",$1,"* ]]; }

# --- other benchmarks: wait for them before each block ------------------------------------------
others_pattern='fallow bench pages|memcached|governor.py|node_vs_memcached'
waited=0
gave_up=0
wait_quiet() { # polls every 10 s; gives up after 15 min, or at once after 30 min of waits in all
    local start=$SECONDS found
    while found=$(pgrep -f "$others_pattern" | grep -vx "$$" || true); [[ -n "$found" ]]; do
        if ((SECONDS - start >= 900 || waited + SECONDS - start >= 1800)); then
            log "other benchmarks still running; measuring anyway (noted in the section)"
            gave_up=$((gave_up + 1))
            break
        fi
        log "waiting for other benchmarks: $(ps -o args= -p "$(echo "$found" | head -1)" 2>/dev/null | cut -c1-80)"
        sleep 10
    done
    waited=$((waited + SECONDS - start))
    wait_idle
}
others_now() { pgrep -f "$others_pattern" | grep -vx "$$" | wc -l; }

# Other work that the pattern above does not catch (builds, tests): a run during which it took
# more than $busy_limit CPUs is redone (at most twice, and $max_redone times in all), after
# waiting (2 min at most) for the machine to be idle: below $busy_limit CPUs busy over 2 s.
busy_limit=0.3
max_redone=20
redone=0
busy_cpus_now() {
    local a b
    a=$(awk '/^cpu /{print $2 + $3 + $4 + $9, $2 + $3 + $4 + $5 + $6 + $9}' /proc/stat)
    sleep 2
    b=$(awk '/^cpu /{print $2 + $3 + $4 + $9, $2 + $3 + $4 + $5 + $6 + $9}' /proc/stat)
    echo "$a $b $(nproc)" | awk '{d = $4 - $2; print (d > 0 ? ($3 - $1) / d * $5 : 0)}'
}
idle_waited=0
wait_idle() {
    local start=$SECONDS busy
    while busy=$(busy_cpus_now); awk -v b="$busy" -v l="$busy_limit" 'BEGIN{exit !(b > l)}'; do
        if ((SECONDS - start >= 120)); then
            log "the machine stays busy ($busy CPUs); measuring anyway"
            break
        fi
        sleep 3
    done
    idle_waited=$((idle_waited + SECONDS - start))
}

free_ports() { # N -> N free TCP ports on 127.0.0.1
    python3 - "$1" <<'EOF'
import socket, sys
socks = []
for _ in range(int(sys.argv[1])):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); socks.append(s)
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

wait_nbd() { # URI: until an NBD server answers there (10 s at most)
    for _ in $(seq 100); do
        timeout 2 nbdinfo --size "$1" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    log "no NBD server answers at $1"; return 1
}

# --- the reference servers ----------------------------------------------------------------------
read -r p_mem p_d1 p_d5 p_px p_rl <<<"$(free_ports 5)"
start_nbdkit() { # PORT NAME ARGS...
    local port=$1 name=$2; shift 2
    nbdkit -f -i 127.0.0.1 -p "$port" --exit-with-parent "$@" 2>"$work/$name.err" &
    pids+=($!)
    eval "pid_$name=$!"
    wait_nbd "nbd://127.0.0.1:$port/"
    # random data, so that no page is a zero page the pool would store for free
    timeout 300 nbdcopy --no-extents -- [ nbdkit random "${export_mib}M" seed=42 ] "nbd://127.0.0.1:$port/"
}
# --- fallow instances ---------------------------------------------------------------------------
# name | store port | working set (MiB) | cached? | label
ws_q=$((cache_mib / 4)) ws_h=$((cache_mib / 2)) ws_1=$cache_mib ws_2=$((cache_mib * 2)) ws_4=$((cache_mib * 4))
declare -A f_port f_mport f_pid f_ws f_store f_label f_cached
add_fallow() { f_store[$1]=$2; f_ws[$1]=$3; f_cached[$1]=$4; f_label[$1]=$5; }
add_fallow f1_in "$p_d1" "$ws_h" 1 "fallow over the 1 ms store, working set inside the cache (1/2)"
add_fallow f1_x2 "$p_d1" "$ws_2" 1 "fallow over the 1 ms store, working set 2 x the cache"
add_fallow f1_empty "$p_d1" "$ws_h" 0 "fallow over the 1 ms store, no cache (--pool none --local-tier 0)"
add_fallow f5_in "$p_d5" "$ws_h" 1 "fallow over the 5 ms store, working set inside the cache (1/2)"
add_fallow f5_x2 "$p_d5" "$ws_2" 1 "fallow over the 5 ms store, working set 2 x the cache"
add_fallow f5_empty "$p_d5" "$ws_h" 0 "fallow over the 5 ms store, no cache (--pool none --local-tier 0)"
add_fallow f1_q "$p_d1" "$ws_q" 1 "fallow over the 1 ms store, working set 1/4 x the cache"
add_fallow f1_c "$p_d1" "$ws_1" 1 "fallow over the 1 ms store, working set 1 x the cache"
add_fallow f1_x4 "$p_d1" "$ws_4" 1 "fallow over the 1 ms store, working set 4 x the cache"
declare -A f_bin f_params
fallow_names=()
for n in f1_in f1_x2 f1_empty f5_in f5_x2 f5_empty f1_q f1_c f1_x4; do
    selected "$n" || continue
    fallow_names+=("$n")
    f_bin[$n]=$fallow
    f_params[$n]=$uri_params
    for tag in "${variant_tags[@]}"; do
        t="$n+$tag"
        add_fallow "$t" "${f_store[$n]}" "${f_ws[$n]}" "${f_cached[$n]}" "${f_label[$n]} [$tag]"
        f_bin[$t]=${v_bin[$tag]}
        f_params[$t]=${v_params[$tag]}
        fallow_names+=("$t")
    done
done
twins() { # CONFIGS... -> each, followed by its variants if it is a fallow configuration
    local c tag
    for c in "$@"; do
        selected "$c" || continue
        echo "$c"
        [[ -n ${f_store[$c]:-} ]] || continue
        for tag in "${variant_tags[@]}"; do echo "$c+$tag"; done
    done
}

# --- the reference servers (those the chosen configurations need) ------------------------------
needs() { # PATTERN: some chosen configuration matches
    local c
    for c in mem store1 store5 proxy1 relay1 "${fallow_names[@]}"; do
        selected "${c%%+*}" && [[ $c == $1 ]] && return 0
    done
    return 1
}
log "starting the stores the chosen configurations need (${export_mib} MiB each, filled with random data)"
needs mem && start_nbdkit "$p_mem" mem memory "${export_mib}M"
needs "@(store1|proxy1|relay1|f1_*)" && start_nbdkit "$p_d1" d1 --filter=delay memory "${export_mib}M" rdelay=1ms wdelay=1ms
needs "@(store5|f5_*)" && start_nbdkit "$p_d5" d5 --filter=delay memory "${export_mib}M" rdelay=5ms wdelay=5ms
# what a plain pass-through proxy costs: nbdkit's nbd plugin in front of the 1 ms store
if needs proxy1; then
    nbdkit -f -i 127.0.0.1 -p "$p_px" --exit-with-parent nbd uri="nbd://127.0.0.1:$p_d1/" 2>"$work/px.err" &
    pids+=($!)
    pid_px=$!
    wait_nbd "nbd://127.0.0.1:$p_px/"
fi
# what the hop alone costs: a TCP relay that copies bytes and does no NBD work
if needs relay1; then
    "$fallow" bench delay-proxy --listen "127.0.0.1:$p_rl" --to "127.0.0.1:$p_d1" --delay 0 \
        2>"$work/rl.err" &
    pids+=($!)
    pid_rl=$!
    wait_nbd "nbd://127.0.0.1:$p_rl/"
fi



fallow_cmd() { # NAME -> the command line (without --listen/--metrics)
    local n=$1 export="d=nbd://127.0.0.1:${f_store[$1]}/${f_params[$1]}"
    if [[ ${f_cached[$n]} == 1 ]]; then
        echo "fallow nbd --export $export --pool local:$pool --local-tier $local_tier --mode exclusive"
    else
        echo "fallow nbd --export $export --pool none --local-tier 0"
    fi
}

start_fallow() { # NAME
    local n=$1 port mport args
    read -r port mport <<<"$(free_ports 2)"
    f_port[$n]=$port
    f_mport[$n]=$mport
    args=$(fallow_cmd "$n")
    args=${args#fallow }
    local extra=()
    ((has_metrics)) && extra=(--metrics "127.0.0.1:$mport")
    # shellcheck disable=SC2086
    "${f_bin[$n]}" $args --listen "127.0.0.1:$port" "${extra[@]}" 2>"$work/$n.err" &
    f_pid[$n]=$!
    pids+=($!)
    for _ in $(seq 200); do
        grep -q 'fallow nbd: serving' "$work/$n.err" 2>/dev/null && break
        kill -0 "${f_pid[$n]}" 2>/dev/null || { cat "$work/$n.err" >&2; log "fallow $n died"; exit 1; }
        sleep 0.1
    done
    grep -q 'fallow nbd: serving' "$work/$n.err" || { log "fallow $n did not start in 20 s"; exit 1; }
    if [[ ${f_cached[$n]} == 1 ]]; then
        # warm: read the working set once, 64 KiB at a time (below the 1 MiB scan bypass),
        # QD 4 so that the demotions into the pool keep up
        timeout 120 fio --name=warm --ioengine=nbd --uri="nbd://127.0.0.1:$port/d" --rw=read \
            --bs=64k --iodepth=4 --offset=0 --size="${f_ws[$n]}M" --output=/dev/null >/dev/null 2>&1
    fi
}

log "starting ${#fallow_names[@]} fallow nbd instances (cache: pool $pool + local tier $local_tier = $cache_mib MiB) and warming them"
for n in "${fallow_names[@]}"; do start_fallow "$n"; done

# --- one measured run ---------------------------------------------------------------------------
clk=$(getconf CLK_TCK)
cpu_snap() { # PIDS... -> "wall busy-jiffies pids-jiffies" (busy: user+nice+system+steal)
    local j=0 p t
    for p in "$@"; do
        t=$(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)
        j=$((j + t))
    done
    echo "$(date +%s.%N) $(awk '/^cpu /{print $2 + $3 + $4 + $9}' /proc/stat) $j"
}
metrics_snap() { # MPORT FILE
    if ((has_metrics)); then
        timeout 5 curl -s "http://127.0.0.1:$1/metrics" >"$2" 2>/dev/null || : >"$2"
    else
        : >"$2"
    fi
}

run() { # CONFIG ROUND QD
    local cfg=$1 round=$2 qd=$3 uri ws label cmd server_pids mport=""
    case "$cfg" in
        mem) uri="nbd://127.0.0.1:$p_mem/"; ws=$ws_h; server_pids="$pid_mem"
             label="nbdkit memory"; cmd="nbdkit -f -i 127.0.0.1 -p PORT memory ${export_mib}M" ;;
        store1) uri="nbd://127.0.0.1:$p_d1/"; ws=$ws_h; server_pids="$pid_d1"
                label="nbdkit memory + delay filter 1 ms (the store alone)"
                cmd="nbdkit -f -i 127.0.0.1 -p PORT_1MS --filter=delay memory ${export_mib}M rdelay=1ms wdelay=1ms" ;;
        store5) uri="nbd://127.0.0.1:$p_d5/"; ws=$ws_h; server_pids="$pid_d5"
                label="nbdkit memory + delay filter 5 ms (the store alone)"
                cmd="nbdkit -f -i 127.0.0.1 -p PORT_5MS --filter=delay memory ${export_mib}M rdelay=5ms wdelay=5ms" ;;
        proxy1) uri="nbd://127.0.0.1:$p_px/"; ws=$ws_h; server_pids="$pid_px $pid_d1"
                label="nbdkit nbd plugin (a plain proxy) over the 1 ms store"
                cmd="nbdkit -f -i 127.0.0.1 -p PORT nbd uri=nbd://127.0.0.1:PORT_1MS/" ;;
        relay1) uri="nbd://127.0.0.1:$p_rl/"; ws=$ws_h; server_pids="$pid_rl $pid_d1"
                label="a plain TCP relay (no NBD work) over the 1 ms store"
                cmd="fallow bench delay-proxy --listen 127.0.0.1:PORT --to 127.0.0.1:PORT_1MS --delay 0" ;;
        *) uri="nbd://127.0.0.1:${f_port[$cfg]}/d"; ws=${f_ws[$cfg]}; label=${f_label[$cfg]}
           mport=${f_mport[$cfg]}
           cmd="$(fallow_cmd "$cfg" | sed "s|127.0.0.1:$p_d1/|127.0.0.1:PORT_1MS/|; s|127.0.0.1:$p_d5/|127.0.0.1:PORT_5MS/|") --listen 127.0.0.1:PORT"
           if [[ ${f_store[$cfg]} == "$p_d1" ]]; then server_pids="${f_pid[$cfg]} $pid_d1"
           else server_pids="${f_pid[$cfg]} $pid_d5"; fi ;;
    esac
    local attempt line other
    for ((attempt = 1; ; attempt++)); do
        line=$(measure "$uri" "$qd" "$ws" "$mport" "$server_pids" \
            --field config="$cfg" --field label="$label" --field round="$round" --field qd="$qd" \
            --field ws_mib="$ws" --field command="$cmd" --field attempt="$attempt") || return 0
        other=$(echo "$line" | python3 -c 'import json, sys; print(json.load(sys.stdin)["other_cpus"])')
        if python3 -c "import sys; sys.exit(0 if $other > $busy_limit else 1)" &&
            ((attempt < 3 && redone < max_redone)); then
            # other work took CPUs during the run: keep it aside, wait for a quiet machine, redo
            redone=$((redone + 1))
            echo "$line" >>"$discarded"
            log "  $(echo "$line" | python3 bench/nbd_table.py brief): machine busy, redoing"
            wait_idle
            continue
        fi
        echo "$line" >>"$results"
        log "  $(echo "$line" | python3 bench/nbd_table.py brief)"
        return 0
    done
}

measure() { # URI QD WS MPORT SERVER_PIDS FIELDS... -> one JSON line
    local uri=$1 qd=$2 ws=$3 mport=$4 server_pids=$5; shift 5
    [[ -n $mport ]] && metrics_snap "$mport" "$work/m0"
    local before after rc=0
    # shellcheck disable=SC2086
    before=$(cpu_snap $server_pids)
    timeout $((runtime + ramp + 60)) fio --name=r --ioengine=nbd --uri="$uri" --rw=randread --bs=4k \
        --iodepth="$qd" --offset=0 --size="${ws}M" --norandommap --randrepeat=0 --time_based \
        --runtime="$runtime" --ramp_time="$ramp" --lat_percentiles=1 --output-format=json \
        --output="$work/fio.json" >/dev/null 2>"$work/fio.err" || rc=$?
    # shellcheck disable=SC2086
    after=$(cpu_snap $server_pids)
    [[ -n $mport ]] && metrics_snap "$mport" "$work/m1"
    if ((rc != 0)); then
        log "fio failed ($rc) on $uri QD $qd: $(head -c 300 "$work/fio.err")"
        return 1
    fi
    python3 bench/nbd_table.py record "$work/fio.json" \
        ${mport:+--metrics "$work/m0" "$work/m1"} "$@" --field others="$(others_now)" \
        --field cpu_before="$before" --field cpu_after="$after" --field clk="$clk" \
        --field load="$(cut -d' ' -f1-3 /proc/loadavg)"
}

# --- the rounds ---------------------------------------------------------------------------------
mapfile -t group_1ms < <(twins mem store1 proxy1 relay1 f1_in f1_x2 f1_empty)
mapfile -t group_5ms < <(twins store5 f5_in f5_x2 f5_empty)
mapfile -t group_plot < <(twins f1_q f1_c f1_x4)
rotate() { # R ITEMS... -> the items rotated left by R
    local r=$1; shift
    local a=("$@") n=$# i
    for ((i = 0; i < n; i++)); do echo "${a[(i + r) % n]}"; done
}
started=$SECONDS
for ((round = 1; round <= rounds; round++)); do
    for qd in $qds; do
        for group in group_1ms group_5ms; do
            declare -n g=$group
            if ((${#g[@]} == 0)); then unset -n g; continue; fi
            wait_quiet
            log "round $round/$rounds, QD $qd, ${group#group_}"
            for cfg in $(rotate $((round - 1)) "${g[@]}"); do run "$cfg" "$round" "$qd"; done
            unset -n g
        done
    done
    ((${#group_plot[@]})) || continue
    wait_quiet
    log "round $round/$rounds, QD 16, working sets for the plot"
    for cfg in $(rotate $((round - 1)) "${group_plot[@]}"); do run "$cfg" "$round" 16; done
done
log "measured in $((SECONDS - started)) s"

# --- the section --------------------------------------------------------------------------------
python3 - "$meta" <<EOF
import json, sys
json.dump({
    "date": "$(date -u '+%Y-%m-%d %H:%M UTC')",
    "commit": "$commit",
    "dirty": "$dirty".split(),
    "nproc": "$(nproc)",
    "cpu": "$(lscpu | sed -n 's/^Model name: *//p' | head -1)",
    "kernel": "$(uname -r)",
    "mem": "$(free -g | awk '/^Mem:/{print $2}') GiB",
    "fio": "$(fio --version)",
    "nbdkit": "$(nbdkit --version | head -1)",
    "command": "bash bench/nbd_vs_nbdkit.sh $args_given".strip(),
    "rounds": $rounds, "runtime": $runtime, "ramp": $ramp,
    "pool": "$pool", "local_tier": "$local_tier", "cache_mib": $cache_mib, "export_mib": $export_mib,
    "has_metrics": $has_metrics, "waited_s": $waited, "gave_up": $gave_up,
    "uri_params": "$uri_params", "variants": "${variants[*]}".split(), "only": "$only".strip(","),
    "idle_waited_s": $idle_waited, "redone": $redone, "busy_limit": $busy_limit,
    "loadavg_end": "$(cut -d' ' -f1-3 /proc/loadavg)",
}, open(sys.argv[1], "w"), indent=1)
EOF
python3 bench/nbd_table.py table "$results" "$meta" >"$section"
cat "$section"
if ((write)); then
    python3 bench/nbd_table.py write-section "$section" docs/benchmarks-runs.md
    if python3 -c 'import matplotlib' 2>/dev/null; then
        mkdir -p docs/img
        python3 bench/plot_nbd.py "$results" docs/img/nbd-iops-vs-working-set.png
        log "wrote docs/img/nbd-iops-vs-working-set.png"
    else
        log "no matplotlib: no plot (pip install matplotlib, then: python3 bench/plot_nbd.py $results docs/img/nbd-iops-vs-working-set.png)"
    fi
    log "wrote the section into docs/benchmarks-runs.md"
fi
log "raw results: $results"
