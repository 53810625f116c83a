#!/usr/bin/env bash
# Crash-state enumeration of write-back, the full run (docs/reliability.md, "Crash
# states"): STATES crash states of the cache layer in process (default 100000, at least
# 10000 for issue #31's target), then ext4 through `fallow nbd` with --write-policy back
# and through: EXT4_ROUNDS rounds of files (default 24), EXT4_STATES crash states each
# (default 1500; needs root, /dev/fuse, nbdfuse and e2fsprogs, else that part says it
# skipped). Release build; prints the counts and the time of each part, and fails if
# any state failed.
#
#   scripts/crash-states.sh [STATES]         EXT4_STATES=N scripts/crash-states.sh
set -euo pipefail
cd "$(dirname "$0")/.."
states=${1:-100000}
ext4_states=${EXT4_STATES:-1500}
ext4_rounds=${EXT4_ROUNDS:-24}
case "$states$ext4_states$ext4_rounds" in
*[!0-9]*) echo "usage: $0 [STATES] (a number; EXT4_STATES and EXT4_ROUNDS too)" >&2; exit 2 ;;
esac
export CARGO_INCREMENTAL=0

echo "==> cache layer in process: $states crash states"
start=$(date +%s)
FALLOW_CRASH_STATES=$states cargo test --release --locked -p fallow-cache --test crash_states \
    -- --nocapture --test-threads 1
echo "    ($(($(date +%s) - start)) s with the build)"

echo "==> ext4 through fallow nbd: $ext4_states crash states per write policy"
start=$(date +%s)
# The state images (32 MiB each, rewritten per state) go to RAM when /dev/shm is there.
tmp=${TMPDIR:-/tmp}
[ -d /dev/shm ] && [ -w /dev/shm ] && tmp=/dev/shm
TMPDIR=$tmp FALLOW_CRASH_EXT4_STATES=$ext4_states FALLOW_CRASH_EXT4_ROUNDS=$ext4_rounds \
    FALLOW_CRASH_EXT4_POLICIES=back,through \
    cargo test --release --locked -p fallow --test crash_states -- --nocapture --test-threads 1
echo "    ($(($(date +%s) - start)) s with the build)"
