#!/usr/bin/env bash
# fio's nbd engine (libnbd): random writes with crc32c checksums, then verified reads, by
# several jobs at once, each on its own connection and its own region, first with 4 KiB
# blocks, then with mixed, unaligned sizes. A verify-only pass on new connections then
# rechecks everything, and must catch one block corrupted on purpose.
source "$(dirname "$0")/lib.sh"
need fio
fio --enghelp=nbd >/dev/null 2>&1 || skip "this fio was built without the nbd engine"

# fio leaves *.state files in the working directory.
cd "$SCRATCH"
cat >verify.fio <<'EOF'
[global]
ioengine=nbd
uri=${URI}
rw=randwrite
verify=crc32c
verify_fatal=1
do_verify=1
verify_state_save=0
group_reporting=1
iodepth=16
# A bound on time; `size` bounds the work, which takes a few seconds.
runtime=60

[aligned]
bs=4k
size=8m
numjobs=4
offset=0
offset_increment=8m

[mixed]
stonewall
bsrange=512-64k
blockalign=512
size=8m
numjobs=2
offset=32m
offset_increment=8m
EOF
sed 's/^do_verify=1/verify_only=1/' verify.fio >verify-only.fio

step "randwrite + verify: 4 jobs x 8 MiB at 4 KiB, then 2 jobs x 8 MiB at 512 B-64 KiB"
URI=$URI t fio --output="$SCRATCH/fio.out" verify.fio || {
    cat "$SCRATCH/fio.out"
    fail "fio write+verify failed"
}
grep -E "^ +(write|read):|jobs=|err=" "$SCRATCH/fio.out" || true
no_errors_in "$SCRATCH/fio.out"

step "verify only, on new connections"
URI=$URI t fio --output="$SCRATCH/fio-again.out" verify-only.fio || {
    cat "$SCRATCH/fio-again.out"
    fail "fio verify-only failed"
}

if command -v nbdsh >/dev/null 2>&1 && python3 -c 'import nbd' 2>/dev/null; then
    step "a corrupted block is caught (the verify passes above are not vacuous)"
    t nbdsh -u "$URI" -c 'h.pwrite(bytes(4096), 12288)'
    rc=0
    URI=$URI t fio --output="$SCRATCH/fio-bad.out" verify-only.fio || rc=$?
    [ "$rc" != 0 ] || fail "fio verified a corrupted block"
    grep -m1 -i "verify:" "$SCRATCH/fio-bad.out" || grep -m1 -i "bad magic" "$SCRATCH/fio-bad.out" || true
fi
echo "PASS: $NAME"
