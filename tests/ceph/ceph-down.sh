#!/usr/bin/env bash
# Tears down a cluster made by ceph-up.sh: signals each daemon by the PID recorded in
# DIR/run (OSDs first, then the monitor, so the OSD's "mark me down" still reaches a live
# monitor), waits up to 10 s for each, SIGKILLs what is left, and deletes DIR.
# FAST=1 sends SIGKILL at once: fine for a throwaway cluster whose data is deleted anyway.
#
# Usage: ceph-down.sh DIR
DIR=$(realpath -m "${1:?usage: $0 DIR}")
SIG=TERM
[ "${FAST:-0}" = 1 ] && SIG=KILL
# Alive: exists and is not a zombie. The daemons are reparented to PID 1, which may reap
# them late, and `kill -0` succeeds on a zombie.
alive() { [ -r "/proc/$1/stat" ] && [ "$(cut -d' ' -f3 "/proc/$1/stat" 2>/dev/null)" != Z ]; }
for kind in osd mgr mon; do
    for f in "$DIR"/run/"$kind".*.pid; do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        [[ $pid =~ ^[0-9]+$ ]] || continue
        # A stale file (a run killed before its teardown) may name a PID reused since.
        [[ $(cat "/proc/$pid/comm" 2>/dev/null) == ceph-* ]] || continue
        kill -s "$SIG" "$pid" 2>/dev/null || continue
        for _ in $(seq 1 100); do
            alive "$pid" || break
            sleep 0.1
        done
        if alive "$pid"; then
            echo "ceph-down: SIGKILL $(basename "$f" .pid) pid=$pid" >&2
            kill -9 "$pid" 2>/dev/null
        fi
    done
done
rm -rf "$DIR"
