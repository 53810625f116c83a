#!/usr/bin/env bash
# A real filesystem on the export, with no kernel NBD client: nbdfuse shows the export as
# a file, a loop device turns that into a block device, and ext4 goes on it. mkfs, write
# files with known checksums, unmount, fsck; then, through a new nbdfuse connection, fsck
# again, remount and verify every file. Needs root, /dev/fuse and loop devices; skips
# cleanly without them. Everything it mounts or attaches is undone at exit, even on
# failure.
source "$(dirname "$0")/lib.sh"
need nbdfuse losetup mkfs.ext4 e2fsck mount umount mountpoint sha256sum
[ "$(id -u)" = 0 ] || skip "needs root (losetup, mount)"
[ -c /dev/fuse ] && [ -r /dev/fuse ] && [ -w /dev/fuse ] || skip "no usable /dev/fuse"
FUSERMOUNT=$(command -v fusermount3 || command -v fusermount || true)

FUSE_DIR=$SCRATCH/fuse
EXT_DIR=$SCRATCH/ext4
mkdir -p "$FUSE_DIR" "$EXT_DIR"
FUSE_PID=
LOOP=

# Undoes, in reverse order, whatever is set up: the ext4 mount, the loop device, the FUSE
# mount and the nbdfuse process (by its PID).
teardown() {
    if mountpoint -q "$EXT_DIR"; then
        umount "$EXT_DIR" || umount -l "$EXT_DIR" || true
    fi
    if [ -n "$LOOP" ]; then
        losetup -d "$LOOP" || true
        LOOP=
    fi
    if mountpoint -q "$FUSE_DIR"; then
        if [ -n "$FUSERMOUNT" ]; then
            "$FUSERMOUNT" -u "$FUSE_DIR" || umount -l "$FUSE_DIR" || true
        else
            umount "$FUSE_DIR" || umount -l "$FUSE_DIR" || true
        fi
    fi
    if [ -n "$FUSE_PID" ]; then
        # nbdfuse exits by itself once unmounted; give it a moment, then make sure.
        for _ in $(seq 50); do kill -0 "$FUSE_PID" 2>/dev/null || break; sleep 0.1; done
        kill "$FUSE_PID" 2>/dev/null || true
        wait "$FUSE_PID" 2>/dev/null || true
        FUSE_PID=
    fi
}
trap 'teardown; cleanup_scratch' EXIT

# Shows the export as the file $FUSE_DIR/disk, attached to a loop device in $LOOP.
attach() {
    nbdfuse "$FUSE_DIR/disk" "$URI" &
    FUSE_PID=$!
    for _ in $(seq 100); do
        [ -e "$FUSE_DIR/disk" ] && break
        kill -0 "$FUSE_PID" 2>/dev/null || fail "nbdfuse exited (is FUSE usable here?)"
        sleep 0.1
    done
    [ -e "$FUSE_DIR/disk" ] || fail "nbdfuse did not show the export within 10 s"
    LOOP=$(t losetup -f --show "$FUSE_DIR/disk") || skip "no free loop device"
    echo "export on $LOOP"
}

step "nbdfuse + loop device + mkfs.ext4"
attach
t mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$LOOP"
t mount -t ext4 "$LOOP" "$EXT_DIR"

step "write files with known checksums"
mkdir -p "$EXT_DIR/dir/sub"
head -c $((5 * 1024 * 1024)) /dev/urandom >"$EXT_DIR/big.bin"
for i in $(seq 40); do
    head -c $((i * 997)) /dev/urandom >"$EXT_DIR/dir/sub/small-$i.bin"
done
echo "hello from fallow" >"$EXT_DIR/dir/hello.txt"
dd if=/dev/urandom of="$EXT_DIR/sparse.bin" bs=4k seek=1000 count=3 status=none
(cd "$EXT_DIR" && find . -type f ! -name SUMS -print0 | sort -z | xargs -0 sha256sum >"$SCRATCH/SUMS")
cp "$SCRATCH/SUMS" "$EXT_DIR/SUMS"
t sync

step "unmount, fsck"
t umount "$EXT_DIR"
t e2fsck -f -n "$LOOP" || fail "e2fsck found errors after the first mount"

step "detach everything, then a new nbdfuse connection: fsck, mount, verify"
teardown
attach
t e2fsck -f -n "$LOOP" || fail "e2fsck found errors through a new connection"
t mount -t ext4 -o ro "$LOOP" "$EXT_DIR"
(cd "$EXT_DIR" && t sha256sum --quiet -c "$SCRATCH/SUMS") || fail "file contents changed"
cmp "$SCRATCH/SUMS" "$EXT_DIR/SUMS" || fail "SUMS changed"
echo "$(wc -l <"$SCRATCH/SUMS") files verified"
teardown
echo "PASS: $NAME"
