"""The NBD client of crates/fallow/tests/faulty_store.rs: libnbd's Python binding (the
library nbdsh runs), connected to one `fallow nbd` export and run as a coprocess.

Each line on stdin is a JSON batch, {"ops": [...], "in_flight": N}; each op is one
request:

    ["r", PAGE]                    read page PAGE (4 KiB)
    ["w", OFFSET, LENGTH, GEN]     write the image's bytes OFFSET..OFFSET+LENGTH as they
                                   are when every page p holds stamp(p, GEN)
    ["wf", OFFSET, LENGTH, GEN]    the same with FUA
    ["t", PAGE]                    trim page PAGE
    ["f"]                          flush

With "in_flight": 1 the requests go one after another; with more, up to that many are in
flight at once (libnbd's aio calls). The answer is one JSON line: a list with, per op,
{"e": ERRNO} if it failed ("EIO", "ENOSPC", ...), else {} or, for a read, {"d": [P, G]}
(the page holds stamp(P, G)), {"d": "zero"} or {"d": "other"} (anything else); "t0" and
"t1" are when it was submitted and seen complete (monotonic nanoseconds).

Page p holds stamp(p, g) at generation g: (p, g) as two little-endian u32 and the 8 bytes
b"fallowpg", repeated (never zeros, so a trimmed page differs from every written one).
"""

import errno
import json
import struct
import sys
import time

import nbd

PAGE = 4096
ZEROS = bytes(PAGE)
MAGIC = b"fallowpg"


def stamp(page, gen):
    return (struct.pack("<II", page, gen) + MAGIC) * (PAGE // 16)


def image_bytes(offset, length, gen):
    first, last = offset // PAGE, (offset + length - 1) // PAGE
    whole = b"".join(stamp(p, gen) for p in range(first, last + 1))
    start = offset - first * PAGE
    return whole[start:start + length]


def content(data):
    data = bytes(data)
    if data == ZEROS:
        return "zero"
    page, gen = struct.unpack_from("<II", data)
    return [page, gen] if data == stamp(page, gen) else "other"


def errname(err):
    return errno.errorcode.get(err.errnum, str(err.errnum))


def run_one(h, op):
    """One request, synchronously: its outcome."""
    try:
        if op[0] == "r":
            return {"d": content(h.pread(PAGE, op[1] * PAGE))}
        if op[0] in ("w", "wf"):
            flags = nbd.CMD_FLAG_FUA if op[0] == "wf" else 0
            h.pwrite(image_bytes(op[1], op[2], op[3]), op[1], flags)
        elif op[0] == "t":
            h.trim(PAGE, op[1] * PAGE)
        elif op[0] == "f":
            h.flush()
        else:
            raise SystemExit(f"unknown op {op!r}")
    except nbd.Error as err:
        return {"e": errname(err)}
    return {}


def submit(h, op):
    """Starts one request: its cookie and, for a read, its buffer."""
    if op[0] == "r":
        buf = nbd.Buffer(PAGE)
        return h.aio_pread(buf, op[1] * PAGE), buf
    if op[0] in ("w", "wf"):
        flags = nbd.CMD_FLAG_FUA if op[0] == "wf" else 0
        buf = nbd.Buffer.from_bytearray(bytearray(image_bytes(op[1], op[2], op[3])))
        return h.aio_pwrite(buf, op[1], flags=flags), buf
    if op[0] == "t":
        return h.aio_trim(PAGE, op[1] * PAGE), None
    if op[0] == "f":
        return h.aio_flush(), None
    raise SystemExit(f"unknown op {op!r}")


def run_concurrently(h, ops, in_flight):
    """Up to `in_flight` requests at once, each timed from submission to completion."""
    results = [None] * len(ops)
    pending = {}  # cookie -> (index, buffer)
    following = 0
    while following < len(ops) or pending:
        while following < len(ops) and len(pending) < in_flight:
            t0 = time.monotonic_ns()
            cookie, buf = submit(h, ops[following])
            pending[cookie] = (following, buf)
            results[following] = {"t0": t0}
            following += 1
        done = []
        for cookie, (i, buf) in pending.items():
            try:
                if not h.aio_command_completed(cookie):
                    continue
                if ops[i][0] == "r":
                    results[i]["d"] = content(buf.to_bytearray())
            except nbd.Error as err:
                results[i]["e"] = errname(err)
            results[i]["t1"] = time.monotonic_ns()
            done.append(cookie)
        for cookie in done:
            del pending[cookie]
        if not done and pending:
            h.poll(-1)
    return results


def main():
    h = nbd.NBD()
    h.connect_uri(sys.argv[1])
    for line in sys.stdin:
        batch = json.loads(line)
        if batch.get("in_flight", 1) > 1:
            out = run_concurrently(h, batch["ops"], batch["in_flight"])
        else:
            out = [run_one(h, op) for op in batch["ops"]]
        print(json.dumps(out), flush=True)
    h.shutdown()


main()
