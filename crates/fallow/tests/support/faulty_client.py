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
flight at once (libnbd's aio calls). A connection that dies (the server killed) fails every
request in flight and every later one, each with its errno (ENOTCONN, ...): the batch is
still answered, so the kill loops (crates/fallow/tests/kill_loops.rs) learn which requests
were acknowledged before the kill. The answer is one JSON line: a list with, per op,
{"e": ERRNO} if it failed ("EIO", "ENOSPC", ...), else {} or, for a read, {"d": [P, G]}
(the page holds stamp(P, G)), {"d": "zero"} or {"d": "other"} (anything else); "t0" and
"t1" are when it was submitted and seen complete (monotonic nanoseconds). An "other" page
whose 16-byte units are each a unit of a stamp or zeros (a torn page: parts of several
writes) also has "u", the [P, G, COUNT] of its stamps' units, and "z", its zero units.

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


def read_fields(data):
    """A read's fields: "d", and for a torn page "u" and "z" (see the top)."""
    data = bytes(data)
    d = content(data)
    if d != "other":
        return {"d": d}
    units, zeros = {}, 0
    for at in range(0, PAGE, 16):
        unit = data[at:at + 16]
        if unit == ZEROS[:16]:
            zeros += 1
        elif unit[8:] == MAGIC:
            key = struct.unpack_from("<II", unit)
            units[key] = units.get(key, 0) + 1
        else:
            return {"d": d}
    return {"d": d, "u": [[p, g, n] for (p, g), n in sorted(units.items())], "z": zeros}


def errname(err):
    return errno.errorcode.get(err.errnum, str(err.errnum))


def run_one(h, op):
    """One request, synchronously: its outcome."""
    try:
        if op[0] == "r":
            return read_fields(h.pread(PAGE, op[1] * PAGE))
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
    dead = None  # the error that ended the connection, once it has
    while following < len(ops) or pending:
        while following < len(ops) and len(pending) < in_flight:
            t0 = time.monotonic_ns()
            results[following] = {"t0": t0}
            try:
                cookie, buf = submit(h, ops[following])
            except nbd.Error as err:
                # The connection is gone: nothing more can be sent.
                results[following].update(e=errname(err), t1=time.monotonic_ns())
                following += 1
                continue
            pending[cookie] = (following, buf)
            following += 1
        done = []
        for cookie, (i, buf) in pending.items():
            try:
                if not h.aio_command_completed(cookie):
                    continue
                if ops[i][0] == "r":
                    results[i].update(read_fields(buf.to_bytearray()))
            except nbd.Error as err:
                results[i]["e"] = errname(err)
            results[i]["t1"] = time.monotonic_ns()
            done.append(cookie)
        for cookie in done:
            del pending[cookie]
        if not done and pending:
            if dead:
                # libnbd kept requests of a dead connection: they fail here.
                for i, _ in pending.values():
                    results[i].update(e=dead, t1=time.monotonic_ns())
                pending.clear()
                continue
            try:
                h.poll(-1)
            except nbd.Error as err:
                # The connection died: libnbd retires the requests in flight with
                # ENOTCONN, which the next look reports.
                dead = errname(err)
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
