#!/usr/bin/env bash
# The seeds' experiments in real QEMU guests, each with and without fallow in the same run
# (bench/vm.py says what each one is). Builds the release binaries (fallow with the RADOS
# store, and fallow-guest, which builds the guest images into ~/.cache/fallow-guest),
# installs what the experiments drive, runs them, prints one JSON line per experiment, and
# puts the table between the vm markers of BENCHMARKS.md and the plot in
# docs/img/vm-speedups.png (with --no-write it prints the table instead).
#
# Usage: bash bench/vm.sh [--quick] [--rounds N] [--only LIST] [--no-write]
#   --quick      every experiment at a small size, one round: ~15 minutes here
#   --rounds N   rounds of every configuration (default 3, or 1 with --quick)
#   --only LIST  comma-separated: puma-fio,puma-postmark,puma-sqlite,tmem-clones,cached-rados,
#                swap (a 128 MiB guest whose memory hog goes through swap: a 5 ms disk,
#                nbdkit memory, a pool: export on one node and on a three-node cluster)
#   --no-write   leave BENCHMARKS.md and the plot alone: print the table on stdout
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh

write=1
args=()
for arg in "$@"; do
    case "$arg" in
    --no-write) write=0 ;;
    -h | --help)
        sed -n '2,/^set -e/p' "$0" | sed '$d; s/^# \{0,1\}//'
        exit 0
        ;;
    *) args+=("$arg") ;;
    esac
done

step "tools"
# QEMU and qemu-block-extra (its rbd driver) from bookworm-backports, like the test command;
# nbdkit for the stores; sqlite3 and e2fsprogs build the database image on the host; Ceph
# for cached-rados; mmdebstrap for the guests' root file system.
if ! command -v qemu-system-x86_64 >/dev/null ||
    [ ! -e /usr/lib/x86_64-linux-gnu/qemu/block-rbd.so ]; then
    bash scripts/install-qemu.sh qemu-system-x86 qemu-block-extra
fi
need=()
for tool in nbdkit:nbdkit sqlite3:sqlite3 mmdebstrap:mmdebstrap ceph-mon:ceph-mon \
    ceph-osd:ceph-osd rbd:ceph-common; do
    command -v "${tool%%:*}" >/dev/null || need+=("${tool#*:}")
done
if ((${#need[@]})); then
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 install -y \
        --no-install-recommends "${need[@]}"
fi

step "build"
cargo build --release -p fallow -p fallow-testkit --features fallow/rados >&2

step "experiments"
bench_setup vm
results="$out_dir/vm-$stamp.jsonl"
python3 bench/vm.py --out "$results" "${args[@]}"

if ((write)); then
    step "BENCHMARKS.md and the plot"
    python3 bench/vm_table.py "$results" "bash bench/vm.sh ${args[*]}" >"$work/section.md"
    write_section "$work/section.md" vm
    if python3 -c 'import matplotlib' 2>/dev/null; then
        python3 bench/vm_table.py --plot docs/img/vm-speedups.png "$results"
    else
        echo "no matplotlib: no plot (pip install matplotlib)" >&2
    fi
else
    python3 bench/vm_table.py "$results" "bash bench/vm.sh ${args[*]}"
fi
