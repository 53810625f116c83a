# The body of test-nbdsh.sh, run inside `nbdsh -n` (the `nbd` module is loaded; no handle
# is made for us). libnbd's strict mode is off on every handle, so bad requests reach the
# server and its error replies are what is tested; after each one the same connection
# must still work. The export's URI is in $NBD_URI; the export is fresh (all zeros), or,
# with READ_ONLY=1, read-only and filled with the offset pattern (see `pattern`).
#
# Regions of the export each check owns, so that they do not disturb one another:
#   [0, 40M)   oversize (zero/trim/cache of more than the maximum payload)
#   [16M, 18M) unaligned        [20M, 24M) multi_conn      [24M, 32M) aio
#   [40M, 48M) block_status     [48M, 50M) flags, zero_length
#   [52M, 53M) race             the last 8 KiB  out_of_range

import errno
import os
import random
import sys
import threading
import traceback

URI = os.environ["NBD_URI"]
READ_ONLY = os.environ.get("READ_ONLY") == "1"
K, M = 1 << 10, 1 << 20
MAX_PAYLOAD = 32 * M
HOLE, ZERO = nbd.STATE_HOLE, nbd.STATE_ZERO


def connect(structured=True, meta=True):
    """A handle with strict mode off (structured replies and base:allocation by default)."""
    h = nbd.NBD()
    h.set_request_structured_replies(structured)
    if meta:
        h.add_meta_context(nbd.CONTEXT_BASE_ALLOCATION)
    h.connect_uri(URI)
    assert h.get_structured_replies_negotiated() == structured
    h.set_strict_mode(0)
    return h


def expect_error(what, fn, *errnos):
    """Runs fn, which must fail with an NBD error (one of `errnos`, if any are given)."""
    try:
        fn()
    except nbd.Error as e:
        if errnos and e.errnum not in errnos:
            names = [errno.errorcode[n] for n in errnos]
            raise AssertionError(f"{what}: failed with {e} (errno {e.errnum}), expected {names}")
        print(f"  {what}: {errno.errorcode.get(e.errnum, e.errnum)} as expected")
        return
    raise AssertionError(f"{what}: succeeded, expected an error")


def still_works(h, offset=48 * M):
    """The connection still serves a write and a read after a refused request."""
    data = os.urandom(4096)
    h.pwrite(data, offset)
    assert h.pread(4096, offset) == data, "read after an error returned other data"


def extents(h, count, offset, flags=0):
    """base:allocation extents as (offset, length, flags)."""
    got = []

    def cb(meta, off, entries, err):
        assert meta == nbd.CONTEXT_BASE_ALLOCATION, meta
        assert off == offset, (off, offset)
        at = off
        for i in range(0, len(entries), 2):
            got.append((at, entries[i], entries[i + 1]))
            at += entries[i]
        return 0

    h.block_status(count, offset, cb, flags)
    return got


def check_fresh():
    """The checks below expect a fresh export: all of it a hole that reads as zeros."""
    h = connect()
    size, at = h.get_size(), 0
    while at < size:
        got = extents(h, min(size - at, 1 << 30), at)
        bad = [e for e in got if e[2] != HOLE | ZERO]
        assert not bad, f"the export is not fresh (run these checks on a new one): {bad}"
        at += sum(length for _, length, _ in got)
    h.shutdown()


def check_info():
    h = connect()
    size = h.get_size()
    assert size >= 64 * M, size
    assert not h.is_read_only()
    for cap in ("can_flush", "can_fua", "can_trim", "can_zero", "can_multi_conn", "can_df",
                "can_cache", "can_meta_context"):
        arg = (nbd.CONTEXT_BASE_ALLOCATION,) if cap == "can_meta_context" else ()
        assert getattr(h, cap)(*arg), f"{cap} is false"
    sizes = [h.get_block_size(k) for k in (nbd.SIZE_MINIMUM, nbd.SIZE_PREFERRED,
                                           nbd.SIZE_MAXIMUM)]
    assert sizes == [1, 4096, MAX_PAYLOAD], sizes
    print(f"  size {size}, block sizes {sizes}, protocol {h.get_protocol()}")
    h.shutdown()


def check_out_of_range(structured):
    h = connect(structured=structured, meta=structured)
    size = h.get_size()
    end = size - 2048
    expect_error("pread past the end", lambda: h.pread(4096, end), errno.EINVAL)
    expect_error("pread starting at the end", lambda: h.pread(1, size), errno.EINVAL)
    expect_error("pread with offset+length overflowing 64 bits",
                 lambda: h.pread(4096, (1 << 64) - 512), errno.EINVAL)
    assert h.pread(4096, size - 4096) == bytes(4096), "a normal pread after the errors"
    expect_error("pwrite past the end", lambda: h.pwrite(b"\xee" * 4096, end), errno.ENOSPC)
    expect_error("pwrite far past the end", lambda: h.pwrite(b"\xee", 1 << 62), errno.ENOSPC)
    expect_error("zero past the end", lambda: h.zero(4096, end), errno.ENOSPC)
    expect_error("trim past the end", lambda: h.trim(4096, end), errno.EINVAL)
    expect_error("cache past the end", lambda: h.cache(4096, end), errno.EINVAL)
    if structured:
        expect_error("block_status past the end",
                     lambda: extents(h, 4096, size), errno.EINVAL)
    # Refused requests changed nothing: the tail of the export is still zeros.
    assert h.pread(8192, size - 8192) == bytes(8192), "a refused write changed the export"
    # The last byte is writable; one past it is not.
    h.pwrite(b"\x01", size - 1)
    assert h.pread(2, size - 2) == b"\x00\x01"
    h.zero(1, size - 1)
    still_works(h)
    h.shutdown()


def check_oversize():
    h = connect()
    expect_error("pread over the 32 MiB maximum payload",
                 lambda: h.pread(MAX_PAYLOAD + 4096, 0), errno.EOVERFLOW, errno.EINVAL)
    still_works(h)
    assert len(h.pread(MAX_PAYLOAD, 0)) == MAX_PAYLOAD, "a maximal read"
    # No payload: the spec allows EOVERFLOW/EINVAL or success, never a disconnect.
    for name, fn in (("zero", lambda: h.zero(40 * M, 0)), ("trim", lambda: h.trim(40 * M, 0)),
                     ("cache", lambda: h.cache(40 * M, 0))):
        try:
            fn()
            print(f"  {name} of 40 MiB: ok")
        except nbd.Error as e:
            assert e.errnum in (errno.EOVERFLOW, errno.EINVAL), f"{name} of 40 MiB: {e}"
            print(f"  {name} of 40 MiB: {errno.errorcode[e.errnum]}")
    still_works(h)
    h.shutdown()


def check_unaligned():
    """Random unaligned writes, zeroes and trims in [16M, 18M) against a model."""
    h = connect()
    base, span = 16 * M, 2 * M
    model = bytearray(span)
    known = bytearray(b"\x01" * span)  # 0 where a trim left the contents unspecified
    rng = random.Random(1234)
    for i in range(300):
        off = rng.randrange(span - 1)
        length = rng.randrange(1, min(span - off, rng.choice((16, 600, 5000, 70000))) + 1)
        op = rng.choice(("write", "write", "write", "zero", "trim", "read"))
        if op == "write":
            data = rng.randbytes(length)
            h.pwrite(data, base + off, rng.choice((0, nbd.CMD_FLAG_FUA)))
            model[off:off + length] = data
            known[off:off + length] = b"\x01" * length
        elif op == "zero":
            flags = rng.choice((0, nbd.CMD_FLAG_NO_HOLE, nbd.CMD_FLAG_FUA))
            h.zero(length, base + off, flags)
            model[off:off + length] = bytes(length)
            known[off:off + length] = b"\x01" * length
        elif op == "trim":
            h.trim(length, base + off)
            known[off:off + length] = bytes(length)
        got = h.pread(length, base + off)
        for j in range(length):
            if known[off + j] and got[j] != model[off + j]:
                raise AssertionError(
                    f"op {i} {op} at {base + off}+{length}: byte {base + off + j} is "
                    f"{got[j]:#x}, expected {model[off + j]:#x}")
    h.flush()
    # A new connection sees the same bytes.
    h2 = connect()
    got = h2.pread(span, base)
    bad = [j for j in range(span) if known[j] and got[j] != model[j]]
    assert not bad, f"{len(bad)} bytes differ on a new connection, first at {base + bad[0]}"
    print(f"  300 random unaligned ops in [{base}, {base + span}) match the model")
    h.shutdown()
    h2.shutdown()


def check_zero_length():
    """Zero-length requests: the spec leaves the answer open but forbids a disconnect."""
    h = connect()
    size = h.get_size()
    for offset in (48 * M + 1, size, size + 4096):
        for name, fn in (("pread", lambda: h.pread(0, offset)),
                         ("pwrite", lambda: h.pwrite(b"", offset)),
                         ("zero", lambda: h.zero(0, offset)),
                         ("trim", lambda: h.trim(0, offset)),
                         ("cache", lambda: h.cache(0, offset)),
                         ("block_status", lambda: extents(h, 0, offset))):
            try:
                fn()
                outcome = "ok"
            except nbd.Error as e:
                outcome = errno.errorcode.get(e.errnum, str(e))
            print(f"  zero-length {name} at {offset}: {outcome}")
            still_works(h)
    h.shutdown()


def check_flags():
    h = connect()
    base = 49 * M
    # FUA is valid on every command once advertised: the server MUST accept it.
    data = os.urandom(8192)
    h.pwrite(data, base, nbd.CMD_FLAG_FUA)
    assert h.pread(8192, base, nbd.CMD_FLAG_FUA) == data
    h.flush(nbd.CMD_FLAG_FUA)
    h.cache(8192, base, nbd.CMD_FLAG_FUA)
    # Flags that do not belong to the command, and unknown bits, are refused.
    expect_error("pread with NO_HOLE", lambda: h.pread(4096, base, nbd.CMD_FLAG_NO_HOLE),
                 errno.EINVAL)
    expect_error("pwrite with REQ_ONE",
                 lambda: h.pwrite(data, base, nbd.CMD_FLAG_REQ_ONE), errno.EINVAL)
    expect_error("trim with an unknown flag bit", lambda: h.trim(4096, base, 1 << 12),
                 errno.EINVAL)
    assert h.pread(8192, base) == data, "a refused write changed the data"
    # FAST_ZERO is advertised: success, or ENOTSUP and no change.
    try:
        h.zero(4096, base, nbd.CMD_FLAG_FAST_ZERO)
        assert h.pread(4096, base) == bytes(4096), "fast zero did not zero"
    except nbd.Error as e:
        assert e.errnum == errno.ENOTSUP, e
        assert h.pread(4096, base) == data[:4096], "a failed fast zero changed the data"
    h.zero(4096, base + 4096, nbd.CMD_FLAG_NO_HOLE | nbd.CMD_FLAG_FUA)
    assert h.pread(4096, base + 4096) == bytes(4096)
    # DF: one data chunk for a range mixing data and never-written zeros.
    h.pwrite(b"\x77" * 4096, base + 64 * K)
    chunks = []
    h.pread_structured(256 * K, base + 32 * K,
                       lambda buf, off, status, err: chunks.append((off, len(buf), status)),
                       nbd.CMD_FLAG_DF)
    assert chunks == [(base + 32 * K, 256 * K, nbd.READ_DATA)], f"DF read chunks: {chunks}"
    still_works(h)
    h.shutdown()


def check_multi_conn():
    """Writes flushed on one connection are seen by reads on another, also where the
    reader had the old data cached."""
    h1, h2 = connect(), connect()
    base = 20 * M
    a = os.urandom(64 * K)
    h1.pwrite(a, base)
    h1.flush()
    assert h2.pread(64 * K, base) == a, "h2 does not see h1's write"
    # h2 has read (and so cached) the region; h1 overwrites part of it, unaligned.
    b = os.urandom(10000)
    h1.pwrite(b, base + 1000)
    h1.flush()
    assert h2.pread(64 * K, base) == a[:1000] + b + a[11000:], "h2 read stale data"
    h2.zero(8192, base + 4096)
    h2.flush()
    assert h1.pread(8192, base + 4096) == bytes(8192), "h1 does not see h2's zeroes"
    # Many writes in flight on both connections, to disjoint pages, then cross reads.
    want = {}
    for i in range(64):
        h, off = (h1, h2)[i % 2], base + M + i * 8 * K + i
        want[off] = os.urandom(5000)
        h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(want[off])), off)
    for h in (h1, h2):
        while h.aio_in_flight() > 0:
            h.poll(-1)
        h.flush()
    for i, (off, data) in enumerate(want.items()):
        other = (h2, h1)[i % 2]
        assert other.pread(len(data), off) == data, f"cross read at {off}"
    print("  two connections stay coherent")
    h1.shutdown()
    h2.shutdown()


def check_race():
    """Reads on three connections race with unaligned writes and zeroes on a fourth:
    once a write is acknowledged and flushed, a fifth connection must read exactly it. A
    read that fetched a page before a write and put it into the cache after the write's
    invalidation would leave the old bytes there for good."""
    base, span, rounds = 52 * M, 6 * 4096, 200
    stop = threading.Event()
    reads = []

    def reader(seed):
        h, rng, n = connect(), random.Random(seed), 0
        while not stop.is_set():
            off = rng.randrange(span - 1)
            h.pread(rng.randrange(1, span - off + 1), base + off)
            n += 1
        h.shutdown()
        reads.append(n)

    threads = [threading.Thread(target=reader, args=(seed,)) for seed in range(3)]
    writer, checker = connect(), connect()
    model, rng = bytearray(span), random.Random(7)
    for t in threads:
        t.start()
    try:
        for i in range(rounds):
            off = rng.randrange(span - 1)
            length = rng.randrange(1, min(span - off, 9000) + 1)
            if rng.random() < 0.25:
                writer.zero(length, base + off)
                model[off:off + length] = bytes(length)
            else:
                data = rng.randbytes(length)
                writer.pwrite(data, base + off)
                model[off:off + length] = data
            writer.flush()
            got = checker.pread(span, base)
            if got != model:
                bad = [j for j in range(span) if got[j] != model[j]]
                raise AssertionError(f"round {i}: {len(bad)} stale bytes from {base + bad[0]} "
                                     f"after a write at {base + off}+{length}")
    finally:
        stop.set()
        for t in threads:
            t.join()
    print(f"  {rounds} writes stayed visible against {sum(reads)} racing reads")
    writer.shutdown()
    checker.shutdown()


def check_aio():
    """More requests in flight on one connection than the server executes at once."""
    h = connect()
    base, n = 24 * M, 160
    blocks = [os.urandom(16 * K) for _ in range(n)]
    for i, data in enumerate(blocks):
        h.aio_pwrite(nbd.Buffer.from_bytearray(bytearray(data)), base + i * 48 * K + i,
                     flags=nbd.CMD_FLAG_FUA if i % 7 == 0 else 0)
    while h.aio_in_flight() > 0:
        h.poll(-1)
    bufs = [nbd.Buffer(16 * K) for _ in range(n)]
    cookies = [h.aio_pread(buf, base + i * 48 * K + i) for i, buf in enumerate(bufs)]
    while h.aio_in_flight() > 0:
        h.poll(-1)
    for cookie in cookies:
        assert h.aio_command_completed(cookie)
    for i, (buf, data) in enumerate(zip(bufs, blocks)):
        assert buf.to_bytearray() == data, f"aio read {i} returned other data"
    print(f"  {n} writes then {n} reads in flight on one connection")
    h.shutdown()


def check_block_status():
    h = connect()
    base = 40 * M
    fresh = extents(h, 8 * M, base)
    assert fresh and all(f & (HOLE | ZERO) == HOLE | ZERO for _, _, f in fresh), fresh
    h.pwrite(b"\x42" * (8 * K), base + M)
    h.flush()
    got = extents(h, 8 * M, base)
    print(f"  extents after an 8 KiB write: {got}")
    total = sum(length for _, length, _ in got)
    assert 0 < total and all(length > 0 for _, length, _ in got), got
    assert got[0][0] == base

    def state(offset):
        [f] = [f for o, length, f in got if o <= offset < o + length]
        return f

    assert state(base) == HOLE | ZERO
    assert state(base + M) & (HOLE | ZERO) == 0 and state(base + M + 8 * K - 1) & HOLE == 0
    assert state(base + 2 * M) == HOLE | ZERO
    one = extents(h, 8 * M, base, nbd.CMD_FLAG_REQ_ONE)
    assert len(one) == 1 and one[0][1] <= 8 * M and one[0][2] == HOLE | ZERO, one
    # Unaligned offset inside the data.
    mid = extents(h, 5000, base + M + 1000)
    assert mid[0][2] & HOLE == 0, mid
    # Without base:allocation negotiated, BLOCK_STATUS is refused; the connection goes on.
    h2 = connect(meta=False)
    expect_error("block_status without a meta context",
                 lambda: h2.block_status(4096, base, lambda *a: 0), errno.EINVAL)
    still_works(h2)
    h.shutdown()
    h2.shutdown()


def check_handshake():
    """Option haggling in opt mode: LIST, INFO, LIST_META_CONTEXT, a GO that fails, a GO
    that succeeds."""
    h = nbd.NBD()
    h.set_opt_mode(True)
    h.connect_uri(URI)
    want = h.get_export_name()
    names = []
    h.opt_list(lambda name, desc: names.append(name))
    assert want in names, (want, names)
    contexts = []
    h.opt_list_meta_context(lambda name: contexts.append(name))
    assert nbd.CONTEXT_BASE_ALLOCATION in contexts, contexts
    h.set_export_name("no-such-export-here")
    expect_error("INFO for a missing export", h.opt_info)
    expect_error("GO to a missing export", h.opt_go)
    h.set_export_name(want)
    h.opt_info()
    assert h.get_size() >= 64 * M
    h.opt_go()
    assert h.aio_is_ready()
    h.pread(4096, 0)
    print(f"  exports {names}, contexts {contexts}")
    h.shutdown()
    # ABORT is acknowledged.
    h = nbd.NBD()
    h.set_opt_mode(True)
    h.connect_uri(URI)
    h.opt_abort()
    assert h.aio_is_closed()
    # No TLS offered: STARTTLS is refused, so TLS "allow" goes on in the clear and TLS
    # "require" fails (the handshake must not hang or break either way).
    h = nbd.NBD()
    if h.supports_tls():
        h.set_tls(nbd.TLS_ALLOW)
        h.connect_uri(URI)
        assert not h.get_tls_negotiated()
        h.pread(512, 0)
        h.shutdown()
        h = nbd.NBD()
        h.set_tls(nbd.TLS_REQUIRE)
        expect_error("TLS required by the client", lambda: h.connect_uri(URI))


def pattern(offset, length):
    """The read-only export's bytes: each 8-byte-aligned word holds its own offset,
    big-endian, so that data read from the wrong place never matches."""
    first = offset // 8
    words = b"".join((8 * w).to_bytes(8, "big") for w in range(first, (offset + length + 7) // 8))
    return words[offset - 8 * first:offset - 8 * first + length]


def check_ro_info():
    h = connect()
    assert h.is_read_only(), "the export is not read-only"
    for cap in ("can_flush", "can_fua", "can_trim", "can_zero", "can_fast_zero"):
        assert not getattr(h, cap)(), f"{cap} is advertised on a read-only export"
    assert h.can_multi_conn() and h.can_cache() and h.can_df()
    h.shutdown()


def check_ro_refusals(structured):
    h = connect(structured=structured, meta=structured)
    size = h.get_size()
    expect_error("pwrite", lambda: h.pwrite(b"\xee" * 4096, 4096), errno.EPERM)
    expect_error("pwrite with FUA", lambda: h.pwrite(b"\xee", 1, nbd.CMD_FLAG_FUA),
                 errno.EPERM)
    expect_error("pwrite past the end", lambda: h.pwrite(b"\xee" * 4096, size - 1),
                 errno.EPERM, errno.ENOSPC)
    expect_error("zero", lambda: h.zero(4096, 0), errno.EPERM)
    expect_error("trim", lambda: h.trim(4096, 0), errno.EPERM)
    expect_error("pread past the end", lambda: h.pread(4096, size - 2048), errno.EINVAL)
    assert h.pread(8192, 0) == pattern(0, 8192), "the refused writes changed the data"
    assert h.pread(4096, size - 4096) == pattern(size - 4096, 4096)
    h.shutdown()


def check_ro_reads():
    """Random unaligned reads, on two connections and many in flight, match the pattern."""
    h1, h2 = connect(), connect()
    size = h1.get_size()
    rng = random.Random(99)
    for i in range(200):
        h = (h1, h2)[i % 2]
        length = rng.randrange(1, rng.choice((16, 5000, 70000, 1 << 20)) + 1)
        off = rng.randrange(size - length + 1)
        assert h.pread(length, off) == pattern(off, length), f"read {off}+{length}"
    reads = [(rng.randrange(size - 20000), rng.randrange(1, 20000)) for _ in range(150)]
    bufs = [(off, nbd.Buffer(length)) for off, length in reads]
    for off, buf in bufs:
        h1.aio_pread(buf, off)
    while h1.aio_in_flight() > 0:
        h1.poll(-1)
    for off, buf in bufs:
        data = buf.to_bytearray()
        assert data == pattern(off, len(data)), f"aio read at {off}"
    got = extents(h1, size, 0)
    assert not [e for e in got if e[2] & HOLE], f"holes in a fully written file: {got}"
    print("  350 reads match the offset pattern")
    h1.shutdown()
    h2.shutdown()


if READ_ONLY:
    CHECKS = [
        ("ro_info", check_ro_info),
        ("ro_refusals (structured replies)", lambda: check_ro_refusals(True)),
        ("ro_refusals (simple replies)", lambda: check_ro_refusals(False)),
        ("ro_reads", check_ro_reads),
        ("handshake", check_handshake),
    ]
else:
    CHECKS = [
        ("fresh", check_fresh),
        ("info", check_info),
        ("oversize", check_oversize),
        ("out_of_range (structured replies)", lambda: check_out_of_range(True)),
        ("out_of_range (simple replies)", lambda: check_out_of_range(False)),
        ("unaligned", check_unaligned),
        ("zero_length", check_zero_length),
        ("flags", check_flags),
        ("multi_conn", check_multi_conn),
        ("aio", check_aio),
        ("race", check_race),
        ("block_status", check_block_status),
        ("handshake", check_handshake),
    ]

failed = []
for name, check in CHECKS:
    if failed == ["fresh"]:
        break
    print(f"- {name}")
    try:
        check()
    except Exception:
        traceback.print_exc(file=sys.stdout)
        failed.append(name)
if failed:
    print(f"nbdsh checks FAILED: {failed}")
    sys.exit(1)
print("nbdsh checks passed")
