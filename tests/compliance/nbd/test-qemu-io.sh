#!/usr/bin/env bash
# qemu-io pattern writes and verified reads: aligned, unaligned, larger than the 32 MiB
# maximum payload (qemu splits it), FUA, write-zeroes with and without unmap, discard,
# flush and asynchronous requests in flight together. A second session on a new
# connection then rereads everything, so the data must have survived the server's cache
# tiers (and, with BACKING_FILE, reached the backing file).
source "$(dirname "$0")/lib.sh"
need qemu-io

K=1024
M=$((1024 * 1024))

# Runs one qemu-io session with the given commands; fails on a non-zero exit or on any
# error or verification failure in its output.
qio() {
    local log="$SCRATCH/qemu-io.$1.log" args=() c
    shift
    for c in "$@"; do args+=(-c "$c"); done
    local rc=0
    t qemu-io -f raw "$URI" "${args[@]}" >"$log" 2>&1 || rc=$?
    cat "$log"
    [ "$rc" = 0 ] || fail "qemu-io exited $rc"
    no_errors_in "$log"
}

step "write then read back, aligned and unaligned"
qio aligned \
    "write -P 0xab 0 64k" \
    "read -P 0xab 0 64k" \
    "write -P 0x11 4095 3" \
    "read -P 0x11 4095 3" \
    "read -P 0xab 0 4095" \
    "read -P 0xab 4098 $((64 * K - 4098))" \
    "write -P 0x22 100001 70000" \
    "read -P 0x22 100001 70000" \
    "read -P 0x00 $((64 * K)) $((100001 - 64 * K))" \
    "read -P 0x00 170001 $((256 * K - 170001))" \
    "write -P 0x23 $((300 * K + 1)) 1" \
    "read -P 0x00 $((300 * K)) 1" \
    "read -P 0x23 $((300 * K + 1)) 1" \
    "read -P 0x00 $((300 * K + 2)) 4094"

step "FUA writes, write-zeroes (with and without unmap), discard, flush"
qio zero \
    "write -f -P 0x33 1M 128k" \
    "read -P 0x33 1M 128k" \
    "write -z 1M 4k" \
    "read -P 0x00 1M 4k" \
    "read -P 0x33 $((M + 4 * K)) $((124 * K))" \
    "write -z -u $((M + 8 * K)) 8k" \
    "read -P 0x00 $((M + 8 * K)) 8k" \
    "write -z -f $((M + 20 * K + 7)) 1000" \
    "read -P 0x33 $((M + 16 * K)) $((4 * K + 7))" \
    "read -P 0x00 $((M + 20 * K + 7)) 1000" \
    "read -P 0x33 $((M + 20 * K + 1007)) $((108 * K - 1007))" \
    "write -P 0x44 2M 2M" \
    "discard 2M 1M" \
    "read -P 0x44 3M 1M" \
    "discard $((3 * M + 1000)) 5000" \
    "read -P 0x44 3M 1000" \
    "read -P 0x44 $((3 * M + 6000)) $((M - 6000))" \
    "flush"

step "asynchronous writes and reads, several in flight"
qio aio \
    "aio_write -P 0x55 4M 64k" \
    "aio_write -P 0x56 $((4 * M + 64 * K)) 64k" \
    "aio_write -P 0x57 $((4 * M + 128 * K + 3)) 5000" \
    "aio_write -f -P 0x58 5M 1M" \
    "aio_flush" \
    "aio_read -P 0x55 4M 64k" \
    "aio_read -P 0x56 $((4 * M + 64 * K)) 64k" \
    "aio_read -P 0x57 $((4 * M + 128 * K + 3)) 5000" \
    "aio_read -P 0x58 5M 1M" \
    "aio_flush"

step "a 40 MiB write, over the 32 MiB maximum payload (qemu splits it)"
qio big \
    "write -P 0x66 8M 40M" \
    "read -P 0x66 8M 40M" \
    "flush"

step "a new connection sees all of it"
qio reread \
    "read -P 0xab 0 4095" \
    "read -P 0x11 4095 3" \
    "read -P 0x22 100001 70000" \
    "read -P 0x23 $((300 * K + 1)) 1" \
    "read -P 0x00 1M 4k" \
    "read -P 0x00 $((M + 20 * K + 7)) 1000" \
    "read -P 0x44 3M 1000" \
    "read -P 0x55 4M 64k" \
    "read -P 0x57 $((4 * M + 128 * K + 3)) 5000" \
    "read -P 0x58 5M 1M" \
    "read -P 0x66 8M 40M" \
    "read -P 0x00 48M 16M" \
    "map"

step "a wrong pattern is detected (the checks above are not vacuous)"
rc=0
t qemu-io -f raw "$URI" -c "read -P 0x67 8M 4k" >"$SCRATCH/wrong.log" 2>&1 || rc=$?
cat "$SCRATCH/wrong.log"
grep -q "Pattern verification failed" "$SCRATCH/wrong.log" || fail "no verification failure"

if [ -n "${BACKING_FILE:-}" ]; then
    step "the backing file holds the 40 MiB write"
    python3 - "$BACKING_FILE" <<'EOF' || fail "backing file lacks the data"
import sys
with open(sys.argv[1], "rb") as f:
    f.seek(8 << 20)
    assert f.read(40 << 20) == b"\x66" * (40 << 20)
EOF
fi
echo "PASS: $NAME"
