#!/usr/bin/env bash
# nbdinfo: the handshake's view of the export (`--json`: size, flags, block sizes,
# contexts), `--can`/`--is` exit codes, `--list` (NBD_OPT_LIST, then INFO per export), and
# `--map` (base:allocation) on the fresh, sparse export before and after writing data.
# With READ_ONLY=1 the export is read-only: the flags must say so, and nothing is written.
source "$(dirname "$0")/lib.sh"
need nbdinfo nbdsh python3

# The export name: the URI's path without its leading slash (nbd:// and nbd+unix://).
EXPORT=$(python3 -c 'import sys, urllib.parse; print(urllib.parse.urlsplit(sys.argv[1]).path[1:])' "$URI")
# READ_ONLY=1: the export is read-only, and the flags must say so.
READ_ONLY=${READ_ONLY:-0}

step "--json: size, flags, block sizes"
t nbdinfo --json "$URI" >"$SCRATCH/info.json"
cat "$SCRATCH/info.json"
python3 - "$SCRATCH/info.json" "$EXPORT" "$READ_ONLY" <<'EOF' || fail "nbdinfo --json: unexpected values"
import json, sys
info, name, read_only = json.load(open(sys.argv[1])), sys.argv[2], sys.argv[3] == "1"
assert info["protocol"] == "newstyle-fixed", info["protocol"]
assert info["TLS"] is False
assert info["structured"] is True, "structured replies were not negotiated"
[e] = info["exports"]
assert e["export-name"] == name, e["export-name"]
assert e["export-size"] >= 64 << 20, e["export-size"]
writable = not read_only
want = {
    "is_read_only": read_only, "can_flush": writable, "can_fua": writable,
    "can_trim": writable, "can_zero": writable, "can_multi_conn": True, "can_cache": True,
    "can_df": True,
    "block_size_minimum": 1, "block_size_preferred": 4096, "block_size_maximum": 32 << 20,
}
wrong = {k: (e.get(k), v) for k, v in want.items() if e.get(k) != v}
assert not wrong, f"(got, expected): {wrong}"
assert "base:allocation" in e["contexts"], e["contexts"]
EOF

step "--size, --can, --is agree with --json"
[ "$(t nbdinfo --size "$URI")" = "$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["exports"][0]["export-size"])' "$SCRATCH/info.json")" ] ||
    fail "--size differs from --json"
# Exit status 0 means true, 2 false.
expect_can() {
    local rc=0
    t nbdinfo "$1" "$2" "$URI" || rc=$?
    [ "$rc" = "$3" ] || fail "nbdinfo $1 $2: exit $rc, expected $3"
}
for cap in multi-conn cache df structured-reply; do
    expect_can --can "$cap" 0
done
if [ "$READ_ONLY" = 1 ]; then
    for cap in flush fua trim zero; do expect_can --can "$cap" 2; done
    expect_can --is read-only 0
else
    for cap in flush fua trim zero; do expect_can --can "$cap" 0; done
    expect_can --is read-only 2
fi

step "--list names this export"
t nbdinfo --list --json "$URI" >"$SCRATCH/list.json"
python3 - "$SCRATCH/list.json" "$EXPORT" <<'EOF' || fail "nbdinfo --list: $(cat "$SCRATCH/list.json")"
import json, sys
info, name = json.load(open(sys.argv[1])), sys.argv[2]
names = [e["export-name"] for e in info["exports"]]
assert name in names, names
for e in info["exports"]:
    assert e["export-size"] > 0 and e["block_size_maximum"] == 32 << 20, e
print("exports:", names)
EOF

if [ "$READ_ONLY" = 1 ]; then
    step "--map of the read-only export"
    t nbdinfo --map "$URI"
    echo "PASS: $NAME (read-only)"
    exit 0
fi

step "--map of the fresh export: one hole"
t nbdinfo --map --json "$URI" >"$SCRATCH/map0.json"
cat "$SCRATCH/map0.json"

step "write two data runs, then --map shows data between holes"
t nbdsh -u "$URI" -c '
h.pwrite(b"\xa5" * (64 << 10), 1 << 20)
h.pwrite(b"\x5a" * 4096, 8 << 20)
h.flush()'
t nbdinfo --map --json "$URI" >"$SCRATCH/map1.json"
cat "$SCRATCH/map1.json"
t nbdinfo --map --totals "$URI"
python3 - "$SCRATCH/map0.json" "$SCRATCH/map1.json" <<'EOF' || fail "nbdinfo --map: unexpected extents"
import json, sys
HOLE, ZERO = 1, 2

def load(path):
    extents = json.load(open(path))
    at = 0
    for e in extents:
        assert e["offset"] == at, f"gap or overlap at {at}: {e}"
        at += e["length"]
    return extents, at

def state(extents, offset):
    [e] = [e for e in extents if e["offset"] <= offset < e["offset"] + e["length"]]
    return e["type"]

fresh, size = load(sys.argv[1])
assert all(e["type"] & ZERO for e in fresh), f"a fresh export reads as zeros: {fresh}"
assert all(e["type"] & HOLE for e in fresh), f"a fresh export is all hole: {fresh}"
written, size1 = load(sys.argv[2])
assert size1 == size, (size1, size)
for offset in (1 << 20, (1 << 20) + (64 << 10) - 1, 8 << 20):
    assert state(written, offset) & (HOLE | ZERO) == 0, f"data at {offset} is not data: {written}"
for offset in (0, (1 << 20) - 1, 2 << 20, (8 << 20) + 4096, size - 1):
    assert state(written, offset) == HOLE | ZERO, f"{offset} is not a hole: {written}"
EOF
echo "PASS: $NAME"
