#!/usr/bin/env bash
# A throwaway single-node Ceph cluster (Pacific 16.2, Debian 12 packages) on 127.0.0.1, for
# the RADOS store's tests: one monitor, one OSD, no manager, no systemd, no containers.
# `ceph-down.sh DIR` stops it by the PIDs recorded in DIR/run and deletes DIR.
#
# Usage: ceph-up.sh DIR
# Environment:
#   MON_PORT   msgr2 port of the monitor (the legacy v1 port is MON_PORT+1)   [3300]
#   STORE      memstore (data in RAM, the fastest to start) | bluestore (a sparse file
#              DIR/osd.0.block of BLOCK_BYTES)                               [memstore]
#   BLOCK_BYTES  the BlueStore file's size                                  [2147483648]
#   AUTH       cephx (exercises the client keyring) | none                    [cephx]
#   POOL       the pool created at the end (8 PGs, size 1)                    [cache]
#   TIMEOUT    seconds each wait (monitor up, OSD up, first write) may take  [60]
#
# A client needs CEPH_CONF=DIR/ceph.conf (which names DIR/keyring) and the user `admin`.
# The OSD picks its own free ports in 6800-7300; everything binds to 127.0.0.1 only.
# Adapted from the team's reference recipe (shared/reference/ceph-single-node.md), which
# also has the timings and the harmless stderr noise of a first mkfs.
set -euo pipefail
DIR=$(realpath -m "${1:?usage: $0 DIR}")
MON_PORT=${MON_PORT:-3300}
V1_PORT=$((MON_PORT + 1))
STORE=${STORE:-memstore}
BLOCK_BYTES=${BLOCK_BYTES:-2147483648}
AUTH=${AUTH:-cephx}
POOL=${POOL:-cache}
TIMEOUT=${TIMEOUT:-60}
T0=$(date +%s%N)
ts() {
    local ms=$((($(date +%s%N) - T0) / 1000000))
    printf 'ceph-up: [%3d.%03ds] %s\n' $((ms / 1000)) $((ms % 1000)) "$*"
}
# Runs "$@" until it succeeds, at most TIMEOUT seconds; fails the script otherwise.
wait_for() {
    local what=$1 deadline=$((SECONDS + TIMEOUT))
    shift
    until "$@" >/dev/null 2>&1; do
        if ((SECONDS >= deadline)); then
            echo "ceph-up: no $what within ${TIMEOUT}s; logs in $DIR/log" >&2
            exit 1
        fi
        sleep 0.2
    done
}

mkdir -p "$DIR"/{log,run,mon.a,osd.0}
FSID=$(uuidgen)
export CEPH_CONF="$DIR/ceph.conf"

if [ "$AUTH" = cephx ]; then
    AUTHLINES="auth cluster required = cephx
auth service required = cephx
auth client required = cephx"
else
    AUTHLINES="auth cluster required = none
auth service required = none
auth client required = none
auth supported = none"
fi

cat >"$CEPH_CONF" <<EOF
[global]
fsid = $FSID
mon host = [v2:127.0.0.1:$MON_PORT,v1:127.0.0.1:$V1_PORT]
public addr = 127.0.0.1
cluster addr = 127.0.0.1
$AUTHLINES
keyring = $DIR/keyring
run dir = $DIR/run
admin socket = $DIR/run/\$name.asok
pid file = $DIR/run/\$name.pid
log file = $DIR/log/\$name.log
mon cluster log file = $DIR/log/cluster.log
chdir = ""
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
osd crush chooseleaf type = 0
mon max pg per osd = 1000
auth allow insecure global id reclaim = false
osd pool default pg autoscale mode = off

[mon]
mon data = $DIR/mon.\$id

[osd]
osd data = $DIR/osd.\$id
osd objectstore = $STORE
osd memory target = 1073741824
bluestore block path = $DIR/osd.\$id.block
bluestore block create = true
bluestore block size = $BLOCK_BYTES
bluestore fsck on mount = false
memstore device bytes = 1073741824
osd class load list = *
osd class default list = *
EOF

# One keyring for every entity, as vstart.sh does.
ceph-authtool --create-keyring "$DIR/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool "$DIR/keyring" --gen-key -n client.admin \
    --cap mon 'allow *' --cap osd 'allow *' --cap mgr 'allow *' --cap mds 'allow *' >/dev/null

# The monitor daemonizes; its PID goes to DIR/run/mon.a.pid.
monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MON_PORT,v1:127.0.0.1:$V1_PORT]" \
    "$DIR/monmap" >/dev/null
ceph-mon --mkfs -i a --monmap "$DIR/monmap" --keyring "$DIR/keyring"
ceph-mon -i a
ts "mon started"
wait_for "monitor answer" ceph --connect-timeout 2 mon stat
ts "mon answering"

OSD_UUID=$(uuidgen)
if [ "$AUTH" = cephx ]; then
    OSD_SECRET=$(ceph-authtool --gen-print-key)
    OSD_ID=$(echo "{\"cephx_secret\": \"$OSD_SECRET\"}" | ceph osd new "$OSD_UUID" -i -)
    ceph-authtool "$DIR/keyring" -n "osd.$OSD_ID" --add-key "$OSD_SECRET" >/dev/null
else
    OSD_ID=$(ceph osd new "$OSD_UUID")
fi
ceph-osd -i "$OSD_ID" --mkfs --osd-uuid "$OSD_UUID" 2>"$DIR/log/osd-mkfs.err" || {
    cat "$DIR/log/osd-mkfs.err" >&2
    exit 1
}
ceph-osd -i "$OSD_ID"
ts "osd started ($STORE)"
osd_up() { ceph osd dump -f json 2>/dev/null | grep -q '"up":1'; }
wait_for "OSD up" osd_up
ts "osd up"

ceph osd pool create "$POOL" 8 8 >/dev/null 2>&1
ceph osd pool application enable "$POOL" rados >/dev/null 2>&1 || true
echo hello >"$DIR/hello.txt"
wait_for "first write" timeout 10 rados -p "$POOL" put hello "$DIR/hello.txt"
rados -p "$POOL" rm hello
ts "pool $POOL written"
touch "$DIR/.ready"
echo "ceph-up: pids mon=$(cat "$DIR/run/mon.a.pid") osd=$(cat "$DIR/run/osd.$OSD_ID.pid")"
