# Shared by the benchmark scripts: source it after `cd` to the repository root.

# Processes a script started, by PID; `stop_pids` kills and reaps them (call it from an EXIT
# trap, so nothing outlives the script).
pids=()
stop_pids() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}

# A free port of 127.0.0.1 for TCP (the default, or $1 = tcp) or UDP ($1 = udp), chosen by
# the OS. (Free when asked: a script binds it soon after.)
free_port() {
    python3 -c 'import socket, sys
kind = socket.SOCK_DGRAM if sys.argv[1] == "udp" else socket.SOCK_STREAM
s = socket.socket(socket.AF_INET, kind); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' "${1:-tcp}"
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

# ab_setup USAGE_LINES DEFAULT_ROUNDS "$@": the start of an A/B script, which sources this file
# before changing directory. Reads OLD_FALLOW NEW_FALLOW [ROUNDS] into $old and $new
# (absolute paths) and $rounds (default DEFAULT_ROUNDS); with fewer arguments prints the
# script's lines USAGE_LINES ("2,13") and exits. Then changes to the repository root and
# makes $dir, removed on exit with every process in $pids stopped.
ab_setup() {
    local usage=$1 default_rounds=$2
    shift 2
    [[ $# -ge 2 ]] || { sed -n "${usage}p" "$0" >&2; exit 2; }
    old=$(realpath "$1")
    new=$(realpath "$2")
    rounds=${3:-$default_rounds}
    [[ -x "$old" && -x "$new" ]] || { echo "both builds must be executables" >&2; exit 2; }
    cd "$(dirname "${BASH_SOURCE[0]}")/.."
    dir=$(mktemp -d)
    trap 'stop_pids; rm -rf "$dir"' EXIT
}

# ab_rounds RESULTS ROUNDS SHAPES: the alternating loop of the A/B scripts. For each round and
# each WORKLOAD:QUEUE_DEPTH:BATCH shape, calls the script's `run WHICH WORKLOAD DEPTH BATCH`
# for `old` and `new` (which goes first alternates by round) and appends "SHAPE WHICH VALUE"
# lines to RESULTS.
ab_rounds() {
    local results=$1 rounds=$2 shapes=$3 round shape workload depth batch which
    for round in $(seq "$rounds"); do
        for shape in $shapes; do
            IFS=: read -r workload depth batch <<<"${shape/mix:/mix_}"
            workload=${workload/mix_/mix:}
            local order=(old new)
            ((round % 2)) || order=(new old)
            for which in "${order[@]}"; do
                echo "$shape $which $(run "$which" "$workload" "$depth" "$batch")" >>"$results"
            done
            echo "round $round/$rounds: $shape done" >&2
        done
    done
}

# ab_table RESULTS WHAT: the Markdown table of ab_rounds' results, WHAT naming what is
# measured ("pages/s"): per shape, both medians and the median (min–max) of the per-round
# ratios new / old.
ab_table() {
    python3 - "$1" "$2" <<'EOF'
import collections, statistics, sys
runs = collections.defaultdict(lambda: collections.defaultdict(list))
for line in open(sys.argv[1]):
    shape, which, value = line.split()
    runs[shape][which].append(float(value))
what = sys.argv[2]
print(f"| workload:QD:batch | old {what} | new {what} | new / old, median (min–max) |")
print("|---|---:|---:|---|")
for shape, by in runs.items():
    ratios = [n / o for o, n in zip(by["old"], by["new"])]
    print(f"| {shape} | {statistics.median(by['old']):,.0f} | {statistics.median(by['new']):,.0f} "
          f"| {statistics.median(ratios):.2f} ({min(ratios):.2f}–{max(ratios):.2f}) |")
EOF
}

# The rest is for the scripts that build fallow, write raw results to bench/out and a section
# into docs/benchmarks-runs.md (cluster.sh, node_vs_memcached.sh) or BENCHMARKS.md (vm.sh).
# Sourcing it runs nothing below but the assignment of `runs_doc`.

# A numbered step of the run, on stderr.
step() { printf '\n==> [%s] %s\n' "$(date +%T)" "$*" >&2; }

# bench_setup NAME: sets $stamp (the run's date and time, for file names), $out_dir
# (bench/out, created) and $work (a new directory /tmp/NAME.XXXXXX), and on exit stops every
# process in $pids and removes $work.
bench_setup() {
    stamp=$(date +%Y-%m-%d-%H%M%S)
    out_dir=bench/out
    mkdir -p "$out_dir"
    work=$(mktemp -d "/tmp/$1.XXXXXX")
    trap bench_cleanup EXIT
}
bench_cleanup() {
    stop_pids
    rm -rf "$work"
}

# Sets $fallow: $FALLOW_BIN when set (for checking a script with a debug build), else a
# release build of the workspace's binary.
build_fallow() {
    if [[ -n ${FALLOW_BIN:-} ]]; then
        fallow=$FALLOW_BIN
        echo "using $fallow (FALLOW_BIN), not a release build" >&2
    else
        cargo build --release -p fallow >&2
        fallow=target/release/fallow
    fi
}

# Writes a new random secret (64 hex digits) to file $1, readable by its owner only.
new_secret() {
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$1"
    chmod 600 "$1"
}

# Rows of the machine table a section opens with ("| what | value |"), for a script to put in
# its own order. The CPU's model name:
cpu_model() { lscpu | sed -n 's/^Model name: *//p' | head -n 1; }
# RAM, kernel and rustc:
host_rows() {
    echo "| RAM (free -g, total) | $(free -g | awk '/^Mem:/ {print $2}') GiB |"
    echo "| kernel | $(uname -r) |"
    echo "| rustc | $(rustc -V) |"
}
# run_rows NOTE COMMAND: the commit, with the number of files changed since (untracked ones
# count too: a new benchmark is itself untracked until committed) followed by NOTE, the load
# average now, and COMMAND.
run_rows() {
    local dirty
    dirty=$(git status --porcelain 2>/dev/null | wc -l)
    echo "| commit | $(git rev-parse --short HEAD)$( ((dirty > 0)) && echo " + $dirty uncommitted changed or new files$1") |"
    echo "| load average at start | $(cut -d' ' -f1-3 /proc/loadavg) |"
    echo "| command | \`$2\` |"
}

# The full tables of the benchmark scripts' latest runs; BENCHMARKS.md summarises them.
runs_doc=docs/benchmarks-runs.md

# write_section FILE NAME [DOC]: puts FILE, a section between the markers
# "<!-- NAME:start -->" and "<!-- NAME:end -->", into DOC (default BENCHMARKS.md; the scripts
# whose full tables live in docs/benchmarks-runs.md pass "$runs_doc") in place of the one
# between the same markers. Where there is none yet, it goes at the end of DOC.
write_section() {
    python3 - "$1" "$2" "${3:-BENCHMARKS.md}" <<'PY'
import re, sys
section = open(sys.argv[1]).read().rstrip("\n")
name, path = sys.argv[2], sys.argv[3]
text = open(path).read()
pattern = re.compile(re.escape(f"<!-- {name}:start -->") + ".*?" + re.escape(f"<!-- {name}:end -->"), re.S)
if pattern.search(text):
    text = pattern.sub(lambda _: section, text)
else:
    text = text.rstrip("\n") + "\n\n" + section + "\n"
open(path, "w").write(text)
PY
}
