# Shared by the test-*.sh scripts beside this file; sourced, never run.
#
# Every script takes one argument, the NBD URI of a fresh export (all zeros, at least
# 64 MiB) that it may overwrite, and exits 0 (pass), 77 (skipped: a tool or a device is
# missing; the reason is on stderr) or anything else (fail). The scripts start no server:
# `crates/fallow/tests/nbd_compliance.rs` starts `fallow nbd` in each configuration, gives
# every script its own export and stops the server. By hand:
#
#   fallow nbd --export t=file:/tmp/t.img,size=64M --listen 127.0.0.1:10809 &
#   bash tests/compliance/nbd/test-qemu-io.sh nbd://127.0.0.1:10809/t
#
# Optional environment:
#   BACKING_FILE  the export's backing file, for the checks that read the backing store
#                 directly after a flush (skipped without it).
#   READ_ONLY=1   the export is read-only and filled with the offset pattern (each
#                 8-byte-aligned word holds its own offset, big-endian) instead of fresh;
#                 test-nbdinfo.sh, test-nbdsh.sh and test-nbdcopy.sh then check refusals
#                 and reads (the others need a writable export).

set -euo pipefail

# Debian's tools first: nbdsh runs `python3 -m nbd`, and the `nbd` module exists only for
# /usr/bin/python3, not for a pyenv python3 that may come first on PATH.
export PATH="/usr/bin:/usr/sbin:/bin:/sbin:$PATH"
# Keeps __pycache__ out of the source tree when nbdsh runs our Python.
export PYTHONDONTWRITEBYTECODE=1

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
NAME=$(basename "$0" .sh)
URI=${1:?usage: $0 NBD-URI}
# The exit status that marks a skip (the automake convention nbdkit's tests use too).
SKIP=77
# Seconds any one external command may take.
TMO=${TMO:-60}

skip() {
    echo "SKIP: $NAME: $*" >&2
    exit "$SKIP"
}

fail() {
    echo "FAIL: $NAME: $*" >&2
    exit 1
}

step() {
    echo "--- $NAME: $*"
}

# Skips unless every named command is installed.
need() {
    local cmd
    for cmd in "$@"; do
        command -v "$cmd" >/dev/null 2>&1 || skip "$cmd is not installed"
    done
}

# Runs a command with a bound on its time; a command that overstays is killed.
# --foreground keeps timeout (and so the command) in the script's process group, which is
# what the harness signals when the script itself overstays.
t() {
    timeout --foreground --kill-after=5 "$TMO" "$@"
}

# A scratch directory, removed at exit (scripts with more to undo chain `cleanup_scratch`
# from their own EXIT trap).
SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/fallow-$NAME.XXXXXX")
cleanup_scratch() {
    # Never into a mount left behind (test-ext4.sh mounts inside the scratch directory).
    rm -rf --one-file-system "$SCRATCH"
}
trap cleanup_scratch EXIT
# A signal (the harness's timeout) still runs the EXIT trap.
trap 'exit 143' TERM
trap 'exit 130' INT
trap 'exit 129' HUP

# Fails unless the output in file $1 contains none of the patterns that the tools print on
# an error (qemu-io has exited 0 after a failed command in some versions).
no_errors_in() {
    if grep -E -i "verification failed|failed|error|mismatch" "$1"; then
        fail "the output above reports an error (see $1)"
    fi
}

# The export's size in bytes, from nbdinfo or qemu-img, whichever is installed.
export_size() {
    if command -v nbdinfo >/dev/null 2>&1; then
        t nbdinfo --size "$URI"
    else
        t qemu-img info --output=json -f raw "$URI" |
            python3 -c 'import json, sys; print(json.load(sys.stdin)["virtual-size"])'
    fi
}
