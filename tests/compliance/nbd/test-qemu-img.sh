#!/usr/bin/env bash
# qemu-img against the export: `info` (raw, the right size), `convert` of a sparse image
# with data and holes into the export and back out, and `compare` both ways, including a
# compare that must see a one-byte difference (so that a vacuous "identical" cannot pass).
source "$(dirname "$0")/lib.sh"
need qemu-img python3 cmp

step "info"
t qemu-img info --output=json -f raw "$URI" >"$SCRATCH/info.json"
SIZE=$(python3 - "$SCRATCH/info.json" <<'EOF'
import json, sys
info = json.load(open(sys.argv[1]))
assert info["format"] == "raw", info
size = info["virtual-size"]
assert size >= 64 << 20, f"export too small for the suite: {size}"
print(size)
EOF
) || fail "qemu-img info: $(cat "$SCRATCH/info.json")"
echo "virtual-size $SIZE"

step "build a sparse source image of the export's size: data runs, holes, odd offsets"
python3 - "$SCRATCH/src.img" "$SIZE" <<'EOF'
import os, random, sys
path, size = sys.argv[1], int(sys.argv[2])
rng = random.Random(0x5eed)
with open(path, "wb") as f:
    f.truncate(size)
    # Page-aligned runs, unaligned runs, one that ends the image, and holes between them.
    for offset, length in [(0, 1 << 20), (3 << 20, 4096), (5 << 20 | 511, 70001),
                           (9 << 20, 8 << 20), (size - 12345, 12345)]:
        f.seek(offset)
        f.write(rng.randbytes(length))
EOF

step "convert the image into the export (-n: the target exists)"
t qemu-img convert -n -f raw -O raw "$SCRATCH/src.img" "$URI"

step "compare the export with the image"
t qemu-img compare -f raw -F raw "$SCRATCH/src.img" "$URI" | tee "$SCRATCH/compare.out"
grep -q "Images are identical" "$SCRATCH/compare.out" || fail "compare: not identical"

step "compare sees a one-byte difference"
cp --sparse=always "$SCRATCH/src.img" "$SCRATCH/changed.img"
printf '\x01' | dd of="$SCRATCH/changed.img" bs=1 seek=$((9 << 20 | 4097)) conv=notrunc status=none
rc=0
t qemu-img compare -f raw -F raw "$SCRATCH/changed.img" "$URI" >"$SCRATCH/diff.out" 2>&1 || rc=$?
cat "$SCRATCH/diff.out"
[ "$rc" = 1 ] || fail "compare of differing images: exit $rc, expected 1"
grep -q "Content mismatch at offset $((9 << 20 | 4096))" "$SCRATCH/diff.out" ||
    fail "compare did not report the mismatch at the changed sector"

step "convert the export back out to a file; it equals the image"
t qemu-img convert -f raw -O raw "$URI" "$SCRATCH/out.img"
cmp "$SCRATCH/src.img" "$SCRATCH/out.img" || fail "the round trip changed the data"

if [ -n "${BACKING_FILE:-}" ]; then
    step "the backing file holds the image (writes go through before they are acked)"
    cmp "$SCRATCH/src.img" "$BACKING_FILE" || fail "backing file differs from the image"
fi

step "map (block status through qemu) covers the whole export"
t qemu-img map --output=json -f raw "$URI" >"$SCRATCH/map.json"
python3 - "$SCRATCH/map.json" "$SIZE" <<'EOF'
import json, sys
extents, size = json.load(open(sys.argv[1])), int(sys.argv[2])
at = 0
for e in extents:
    assert e["start"] == at, (e, at)
    at += e["length"]
assert at == size, (at, size)
# The first MiB is data in any store.
assert extents[0]["data"], extents[0]
EOF
echo "PASS: $NAME"
