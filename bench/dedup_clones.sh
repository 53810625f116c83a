#!/usr/bin/env bash
# Cross-node dedup on clones of one VM image (issue #5): one ext4 image copied N times,
# each copy exported by `fallow nbd` over a three-node cluster on 127.0.0.1, every export
# read whole with nbdcopy (so every page lands in the pool), and the nodes' counters read
# after each clone: pages sent whole, pages sent as a hash, bytes saved on the wire and in
# memory. Prints a markdown table (BENCHMARKS.md, "Cross-node dedup").
#
#   bash bench/dedup_clones.sh [--clones N] [--image-mib M] [--exe PATH]
set -euo pipefail
cd "$(dirname "$0")/.."
source bench/lib.sh

clones=4
image_mib=128
exe=target/release/fallow
while (($#)); do
    case "$1" in
        --clones) clones=$2; shift 2 ;;
        --image-mib) image_mib=$2; shift 2 ;;
        --exe) exe=$2; shift 2 ;;
        -h|--help) sed -n 2,9p "$0"; exit 0 ;;
        *) echo "unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done
[ -x "$exe" ] || cargo build --release -p fallow
for tool in mkfs.ext4 nbdcopy curl; do
    command -v "$tool" >/dev/null || { echo "$tool is needed" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'stop_pids; rm -rf "$work"' EXIT

# The image: an ext4 file system about half full of a real tree of files (Python's
# standard library from Debian's package: source, bytecode, shared objects), as a VM's
# root disk would be.
mkdir -p "$work/tree"
src=$(ls -d /usr/lib/python3.[0-9]* | head -1)
[ -n "$src" ] || { echo "no /usr/lib/python3.X to build the image from" >&2; exit 1; }
cp -r "$src" "$work/tree/"
echo "building a ${image_mib} MiB ext4 image of $(du -sh "$work/tree" | cut -f1) of files..." >&2
mkfs.ext4 -q -F -b 4096 -d "$work/tree" "$work/image0" "${image_mib}M"
rm -rf "$work/tree"
for ((i = 1; i < clones; i++)); do cp "$work/image0" "$work/image$i"; done
head -c 32 /dev/urandom | base64 >"$work/secret"

# Three nodes, their summaries rebuilt at most every second.
declare -a node_port gossip_port metrics_port
for i in 0 1 2; do
    node_port[$i]=$(free_port); gossip_port[$i]=$(free_port); metrics_port[$i]=$(free_port)
done
for i in 0 1 2; do
    join=()
    for j in 0 1 2; do ((j == i)) || join+=("127.0.0.1:${gossip_port[$j]}"); done
    "$exe" node --listen "127.0.0.1:${node_port[$i]}" --gossip "127.0.0.1:${gossip_port[$i]}" \
        --join "$(IFS=,; echo "${join[*]}")" --lend 1G --secret-file "$work/secret" \
        --metrics "127.0.0.1:${metrics_port[$i]}" --summary-refresh 1 \
        2>"$work/node$i.log" &
    pids+=($!)
done
sleep 2
exports=()
for ((i = 0; i < clones; i++)); do exports+=(--export "clone$i=file:$work/image$i"); done
nbd_port=$(free_port)
seeds="fallow://127.0.0.1:${node_port[0]},127.0.0.1:${node_port[1]},127.0.0.1:${node_port[2]}"
"$exe" nbd --listen "127.0.0.1:$nbd_port" --pool "$seeds" --secret-file "$work/secret" \
    --local-tier 0 "${exports[@]}" 2>"$work/nbd.log" &
pids+=($!)
for _ in $(seq 50); do nbdinfo --size "nbd://127.0.0.1:$nbd_port/clone0" >/dev/null 2>&1 && break; sleep 0.2; done

# A counter summed over the three nodes' /metrics.
metric() {
    local total=0 v
    for i in 0 1 2; do
        v=$(curl -s "http://127.0.0.1:${metrics_port[$i]}/metrics" | awk -v m="$1" '$1 == m { print $2 }')
        total=$((total + ${v:-0}))
    done
    echo "$total"
}
whole='fallow_node_pages_total{op="put",result="stored"}'
hashed='fallow_node_pages_total{op="put_hashes",result="stored"}'
missed='fallow_node_pages_total{op="put_hashes",result="miss"}'

echo "| clone | pages put | sent whole | sent as hash | hash not held | wire bytes saved | pool memory (MiB) |"
echo "|---:|---:|---:|---:|---:|---:|---:|"
for ((i = 0; i < clones; i++)); do
    before_whole=$(metric "$whole"); before_hashed=$(metric "$hashed"); before_missed=$(metric "$missed")
    echo "reading clone$i..." >&2
    nbdcopy "nbd://127.0.0.1:$nbd_port/clone$i" null: 
    sleep 1
    w=$(($(metric "$whole") - before_whole))
    h=$(($(metric "$hashed") - before_hashed))
    m=$(($(metric "$missed") - before_missed))
    used=$(metric fallow_node_used_bytes)
    printf '| %d | %d | %d | %d | %d | %s | %s |\n' "$i" $((w + h)) "$w" "$h" "$m" \
        "$(python3 -c "print(f'{$h * 4076 / 2**20:.1f} MiB ({100 * $h * 4076 / max(1, ($w + $h) * 4096):.0f} %)')")" \
        "$(python3 -c "print(f'{$used / 2**20:.1f}')")"
    # The next clone's pages find the summaries rebuilt: the cluster client fetches every
    # 10 s, the nodes rebuild at most every second.
    ((i + 1 < clones)) && sleep 12
done
