#!/usr/bin/env bash
# What a read that misses costs `fallow nbd` in CPU, with no cache at all (`--pool none
# --local-tier 0`: every 4 KiB read goes to the upstream NBD store), in numbers that do not
# depend on how busy the machine is:
#   * instructions per read, user space, from valgrind's callgrind (the difference between a
#     run of N and one of 3N reads, divided by 2N, so start-up and shutdown cancel out);
#   * system calls per read, by kind, from perf's syscall tracepoints over N reads;
#   * CPU time per read (user + system, perf's task-clock over N reads), of fallow and of
#     the store: these depend on the machine, but cover the kernel side that callgrind
#     cannot see, and what fallow's way of talking to the store costs the store.
# The store is `nbdkit memory` on 127.0.0.1 (no delay: only fallow is measured); the client
# is fio (ioengine=nbd, 4 KiB random reads) at QD 1 and QD 16.
#
# Usage: bash bench/nbd_miss_cost.sh [--reads N] [--repeat R] [--qd "1 16"] [--uri-params P]
#                                    LABEL=BINARY...
#   LABEL=BINARY  a fallow binary to measure, e.g. before=/tmp/fallow-old after=target/release/fallow
#   --reads N     reads per measured run (default 2000; callgrind also runs 3N)
#   --repeat R    perf runs of each binary, interleaved; medians reported (default 5)
#   --qd LIST     queue depths (default "1 16")
#   --uri-params  appended to the store's URI, e.g. "?conns=2"
#
# Every process it starts is stopped by its PID on exit. Output: a markdown table on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=bench/lib.sh
. bench/lib.sh
trap stop_pids EXIT

reads=2000
repeat=5
qds="1 16"
params=""
bins=()
while (($#)); do
    case "$1" in
        --reads) reads=$2; shift 2 ;;
        --qd) qds=$2; shift 2 ;;
        --repeat) repeat=$2; shift 2 ;;
        --uri-params) params=$2; shift 2 ;;
        *=*) bins+=("$1"); shift ;;
        *) sed -n '13,22p' "$0" >&2; exit 2 ;;
    esac
done
((${#bins[@]})) || { sed -n '13,22p' "$0" >&2; exit 2; }
for tool in nbdkit fio valgrind perf; do
    command -v "$tool" >/dev/null || { echo "needs $tool" >&2; exit 2; }
done
work=$(mktemp -d /tmp/fallow-miss-cost.XXXXXX)
log() { echo "[nbd-miss-cost $(date +%H:%M:%S)] $*" >&2; }

wait_port() { # PORT
    for _ in $(seq 200); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
        sleep 0.05
    done
    log "nothing listens on $1"; return 1
}

store_port=$(free_port)
nbdkit -f -i 127.0.0.1 -p "$store_port" --exit-with-parent memory 256M 2>"$work/nbdkit.err" &
store_pid=$!
pids+=("$store_pid")
wait_port "$store_port"

# start_fallow BINARY [WRAPPER...]: starts fallow nbd (under WRAPPER if given) and sets
# $fallow_pid and $fallow_port once it serves.
start_fallow() {
    local bin=$1; shift
    fallow_port=$(free_port)
    "$@" "$bin" nbd --export "d=nbd://127.0.0.1:$store_port/$params" --pool none --local-tier 0 \
        --listen "127.0.0.1:$fallow_port" 2>"$work/fallow.err" &
    fallow_pid=$!
    pids+=("$fallow_pid")
    for _ in $(seq 600); do
        grep -q 'fallow nbd: serving' "$work/fallow.err" && return 0
        sleep 0.1
    done
    cat "$work/fallow.err" >&2; log "fallow did not start"; exit 1
}
stop_fallow() {
    kill -TERM "$fallow_pid"
    wait "$fallow_pid" 2>/dev/null || true
}
run_fio() { # QD N
    fio --name=r --ioengine=nbd --uri="nbd://127.0.0.1:$fallow_port/d" --rw=randread --bs=4k \
        --iodepth="$1" --size=128M --norandommap --randrepeat=0 --number_ios="$2" \
        --output=/dev/null >/dev/null 2>"$work/fio.err" || { cat "$work/fio.err" >&2; exit 1; }
}

callgrind_ir() { # BINARY QD N -> total Ir of a run of N reads
    local out="$work/cg.out"
    rm -f "$out"
    start_fallow "$1" valgrind --tool=callgrind --callgrind-out-file="$out"
    run_fio "$2" "$3"
    stop_fallow
    awk '/^totals:/{print $2}' "$out"
}

syscalls="sendto recvfrom writev readv read write epoll_wait futex"
perf_run() { # BINARY QD N -> "store-task-clock-ms task-clock-ms count..." over N reads
    local events="task-clock" s
    for s in $syscalls; do events+=",syscalls:sys_enter_$s"; done
    start_fallow "$1"
    run_fio "$2" 200 # warm: connections open, buffers grown
    perf stat -x, -e "$events" -p "$fallow_pid" -o "$work/perf.csv" &
    local perf_pid=$!
    perf stat -x, -e task-clock -p "$store_pid" -o "$work/store.csv" &
    local store_perf=$!
    pids+=("$perf_pid" "$store_perf")
    sleep 0.5
    run_fio "$2" "$3"
    kill -INT "$perf_pid" "$store_perf"
    wait "$perf_pid" "$store_perf" 2>/dev/null || true
    stop_fallow
    awk -F, '!/^#/ && NF > 2 {printf "%s ", $1} END {print ""}' "$work/store.csv" "$work/perf.csv"
}

# The perf runs of every binary are interleaved, $repeat times, and the medians reported:
# CPU time on a shared VM moves by tens of per cent from one run to the next.
echo "| binary | QD | instructions per read (callgrind) | CPU µs per read, fallow (range) / store: task-clock, median of $repeat | system calls per read (median) |"
echo "|---|---:|---:|---:|---|"
for qd in $qds; do
    declare -A ir=()
    for spec in "${bins[@]}"; do
        label=${spec%%=*} bin=${spec#*=}
        log "$label QD $qd: callgrind, $reads and $((3 * reads)) reads"
        ir1=$(callgrind_ir "$bin" "$qd" "$reads")
        ir3=$(callgrind_ir "$bin" "$qd" $((3 * reads)))
        ir[$label]="$ir1 $ir3"
        : >"$work/perf-$label"
    done
    for ((i = 1; i <= repeat; i++)); do
        for spec in "${bins[@]}"; do
            label=${spec%%=*} bin=${spec#*=}
            log "$label QD $qd: perf $i/$repeat, $reads reads"
            perf_run "$bin" "$qd" "$reads" >>"$work/perf-$label"
        done
    done
    for spec in "${bins[@]}"; do
        label=${spec%%=*}
        # shellcheck disable=SC2086
        per=$(python3 - "$reads" ${ir[$label]} "$work/perf-$label" <<'EOF'
import statistics, sys
n, ir1, ir3 = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
runs = [[float(v) for v in line.split()] for line in open(sys.argv[4]) if line.strip()]
med = [statistics.median(col) for col in zip(*runs)]
store, fallow, counts = med[0], med[1], med[2:]
names = "sendto recvfrom writev readv read write epoll_wait futex".split()
calls = ", ".join(f"{name} {v / n:.2f}" for name, v in zip(names, counts) if v)
lo, hi = (f(r[1] for r in runs) * 1000 / n for f in (min, max))
print(f"{(ir3 - ir1) / (2 * n):,.0f} | {fallow * 1000 / n:.1f} ({lo:.0f}–{hi:.0f}) / "
      f"{store * 1000 / n:.1f} | {calls}")
EOF
)
        echo "| $label | $qd | $per |"
    done
done
rm -rf "$work"
