#!/usr/bin/env bash
# The history check of persistent pools across a cluster at length (docs/reliability.md,
# "Histories of persistent pools"): ROUNDS fault rounds (default 24) of SIGKILL, SIGSTOP
# and nft partitions on three nodes in network namespaces while four workers put, get and
# invalidate persistent pages through the cluster client; then the same on 127.0.0.1
# (kills and pauses). Prints the counts and fails on any anomaly. The namespace test needs
# root (or CAP_NET_ADMIN and CAP_SYS_ADMIN) and nft; without them it prints `skipped`.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-24}"
export FALLOW_HISTORY_ROUNDS="$rounds"
cargo test -p fallow --test netns_history persistent_history -- --nocapture --test-threads 1
