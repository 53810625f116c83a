#!/usr/bin/env bash
# nbdcopy: 32 MiB of random data into the export (4 connections, many requests in flight)
# and back out (one connection, small requests), compared with cmp; the rest of the export
# must still read as zeros. With BACKING_FILE, the backing file is compared too. With
# READ_ONLY=1, only the copies out (compared with each other and with BACKING_FILE).
source "$(dirname "$0")/lib.sh"
need nbdcopy cmp head
SIZE=$(export_size)
N=$((32 * 1024 * 1024))

if [ "${READ_ONLY:-0}" = 1 ]; then
    step "read-only: copy the whole export out, twice, and compare"
    t nbdcopy --no-extents -C 1 --request-size=65536 -R 16 "$URI" "$SCRATCH/out.img"
    t nbdcopy "$URI" "$SCRATCH/out2.img"
    cmp "$SCRATCH/out.img" "$SCRATCH/out2.img" || fail "two copies of the export differ"
    if [ -n "${BACKING_FILE:-}" ]; then
        cmp "$SCRATCH/out.img" "$BACKING_FILE" || fail "the copy differs from the backing file"
    fi
    echo "PASS: $NAME (read-only)"
    exit 0
fi

step "a random 32 MiB image"
head -c "$N" /dev/urandom >"$SCRATCH/src.img"

step "copy it into the export (4 connections, 64 requests each, then a flush)"
t nbdcopy --flush -C 4 -R 64 "$SCRATCH/src.img" "$URI"

step "copy the whole export out (1 connection, 64 KiB requests, no extents)"
t nbdcopy --no-extents -C 1 --request-size=65536 -R 16 "$URI" "$SCRATCH/out.img"
[ "$(stat -c %s "$SCRATCH/out.img")" = "$SIZE" ] || fail "the copy is not $SIZE bytes"
cmp -n "$N" "$SCRATCH/src.img" "$SCRATCH/out.img" || fail "the data read back differs"
cmp -n $((SIZE - N)) -i "$N:0" "$SCRATCH/out.img" /dev/zero ||
    fail "the export past the copied image is not zeros"

step "copy it out again with the defaults (extents, 4 connections)"
t nbdcopy "$URI" "$SCRATCH/out2.img"
cmp "$SCRATCH/out.img" "$SCRATCH/out2.img" || fail "two copies of the export differ"

step "export to export: null: reads everything"
t nbdcopy --no-extents "$URI" null:

if [ -n "${BACKING_FILE:-}" ]; then
    step "the backing file holds the image"
    cmp -n "$N" "$SCRATCH/src.img" "$BACKING_FILE" || fail "backing file differs"
fi
echo "PASS: $NAME"
