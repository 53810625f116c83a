#!/usr/bin/env python3
"""Checks a running fallow node against docs/protocol.md with an independent client.

    python3 tests/compliance/protocol_check.py --addr 127.0.0.1:7400 --secret-file SECRET \
        [--members N]

--members N: the node gossips and lists N members (itself included); without it, any
answer that follows the layout passes.

Runs a scripted session (handshake, pools, batched page operations, invalidation, STATS,
MEMBERS, error statuses, pool visibility between client ids, refused handshakes) and exits 0 when
every result matches the document, or 1 with a message naming the first mismatch. It
creates its own pools under fresh random client ids and leaves the node as it found it,
apart from counters.
"""

import argparse
import os
import struct
import sys

sys.dont_write_bytecode = True  # leave no __pycache__ beside the scripts
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fallow_client as fc  # noqa: E402  (the path above must come first)
from fallow_client import Client, RawConnection, StatusError  # noqa: E402

# STATS names docs/protocol.md says are always present.
NODE_STATS = [
    "lent_bytes", "mapped_bytes", "used_bytes", "pages", "fill_pages", "dedup_saved_bytes",
    "compressed_pages", "compression_saved_bytes", "checksum_failures", "dropped_by_shrink",
    "over_budget_bytes", "metadata_bytes", "hits", "misses", "puts_stored", "puts_refused",
    "evictions", "pools", "clients", "connections", "uptime_seconds",
]
POOL_STATS = [
    "persistent", "pages", "hits", "misses", "puts_stored", "puts_refused", "evictions",
    "invalidations", "checksum_failures",
]


class Mismatch(Exception):
    pass


def expect(cond, what):
    if not cond:
        raise Mismatch(what)


def expect_status(status, what, fn, *args):
    """Runs fn(*args), which must fail with `status`; returns the StatusError."""
    try:
        result = fn(*args)
    except StatusError as err:
        expect(err.status == status, "%s: got %s, expected %s" % (
            what, fc.status_name(err.status), fc.status_name(status)))
        return err
    raise Mismatch("%s: succeeded (%r), expected %s" % (what, result, fc.status_name(status)))


def page(seed):
    """A 4096-byte page that is neither same-filled nor equal to another seed's page."""
    return (struct.pack("<Q", seed) * 8 + os.urandom(64)) * 32


LAST_OK = ["nothing yet"]


def ok(what):
    LAST_OK[0] = what
    print("ok   %s" % what, flush=True)


class Check:
    def __init__(self, host, port, secret, members=None):
        self.host, self.port, self.secret = host, port, secret
        self.expected_members = members

    def client(self, client_id=None):
        return Client.connect(self.host, self.port, self.secret, client_id=client_id,
                              name="protocol_check")

    def raw(self):
        return RawConnection.open(self.host, self.port)

    def run(self):
        a = self.client()
        ok("HELLO and AUTH; node proof verified; max_batch %d" % a.max_batch)
        expect(1 <= a.max_batch <= fc.MAX_BATCH, "max_batch %d outside 1..=256" % a.max_batch)
        a.ping()
        ok("PING")
        pool = self.persistent_round_trip(a)
        self.batches_over_max_batch(a)
        self.quota_and_specs(a)
        self.stats(a, pool)
        self.members(a)
        self.errors_keep_the_connection(a)
        self.visibility(a, pool)
        self.shared_pool(a)
        self.pipelining(a)
        a.destroy_pool(pool)
        expect_status(fc.UNKNOWN_POOL, "GET after DESTROY_POOL", a.get, pool, [(1, 0)])
        ok("DESTROY_POOL; the id is unknown afterwards")
        a.close()
        self.refused_handshakes()

    def persistent_round_trip(self, a):
        pool = a.create_pool(persistent=True)
        keys = [(1, i) for i in range(5)] + [(2, i) for i in range(3)]
        pages = {k: page(n + 1) for n, k in enumerate(keys)}
        pages[(2, 2)] = bytes(fc.PAGE_SIZE)  # a zero page is stored like any other
        outcomes = a.put(pool, [(o, i, pages[(o, i)]) for o, i in keys])
        expect(outcomes == [fc.STORED] * len(keys), "PUT outcomes %r, all STORED" % outcomes)
        got = a.get(pool, keys)
        expect(got == [pages[k] for k in keys], "GET returns the bytes PUT stored")
        ok("persistent pool %d: PUT then GET of %d pages round-trips" % (pool, len(keys)))

        got = a.get(pool, [(1, 100), (1, 0), (3, 0), (2, 1)])
        expect(got == [None, pages[(1, 0)], None, pages[(2, 1)]],
               "GET of miss, hit, miss, hit gives pages in key order")
        ok("GET misses and hits mixed in one batch")

        expect(a.take(pool, [(2, 0)]) == [pages[(2, 0)]], "TAKE returns the page")
        expect(a.get(pool, [(2, 0)]) == [None], "GET after TAKE misses")
        expect(a.take(pool, [(2, 0)]) == [None], "a second TAKE misses")
        ok("TAKE removes the page it returns")

        new = page(99)
        expect(a.put(pool, [(1, 1, new)]) == [fc.STORED], "overwrite PUT stored")
        expect(a.get(pool, [(1, 1)]) == [new], "GET after overwrite returns the new page")
        ok("PUT replaces the page under a key")

        a.invalidate_pages(pool, [(1, 4), (5, 5)])
        expect(a.get(pool, [(1, 4), (1, 3)]) == [None, pages[(1, 3)]],
               "INVALIDATE_PAGES removes exactly the keys named")
        ok("INVALIDATE_PAGES (a key with no page is not an error)")

        n = a.invalidate_object(pool, 1)
        expect(n == 4, "INVALIDATE_OBJECT of object 1 removed %d pages, expected 4" % n)
        expect(a.get(pool, [(1, i) for i in range(5)]) == [None] * 5, "object 1 is empty")
        expect(a.get(pool, [(2, 1)]) == [pages[(2, 1)]], "object 2 is untouched")
        n = a.invalidate_object(pool, 1)
        expect(n == 0, "a second INVALIDATE_OBJECT removed %d pages, expected 0" % n)
        ok("INVALIDATE_OBJECT counts")

        n = a.invalidate_pool(pool)
        expect(n == 2, "INVALIDATE_POOL removed %d pages, expected 2" % n)
        expect(a.get(pool, [(2, 1), (2, 2)]) == [None, None], "the pool is empty")
        expect(a.put(pool, [(3, 0, page(3))]) == [fc.STORED], "the pool stays usable")
        expect(a.invalidate_pool(pool) == 1, "INVALIDATE_POOL counts the new page")
        ok("INVALIDATE_POOL counts; the pool stays usable")
        return pool

    def batches_over_max_batch(self, a):
        pool = a.create_pool(persistent=True, dedup_domain=7)
        n = a.max_batch + 44
        items = [(9, i, page(1000 + i)) for i in range(n)]
        expect(a.put(pool, items) == [fc.STORED] * n, "%d pages stored" % n)
        got = a.take(pool, [(o, i) for o, i, _ in items])
        expect(got == [p for _, _, p in items], "TAKE of %d pages returns them" % n)
        expect(a.invalidate_pool(pool) == 0, "TAKE emptied the pool")
        a.destroy_pool(pool)
        ok("%d pages in pipelined batches of at most %d" % (n, a.max_batch))

    def quota_and_specs(self, a):
        pool = a.create_pool(persistent=True, quota_pages=2)
        items = [(1, i, page(i)) for i in range(3)]
        outcomes = a.put(pool, items)
        # Which key of a batch meets the full quota is not specified (docs/protocol.md §8).
        expect(sorted(outcomes) == [fc.STORED, fc.STORED, fc.NOT_STORED_OVER_QUOTA],
               "PUT of 3 pages into a quota of 2: outcomes %r" % outcomes)
        got = a.get(pool, [(o, i) for o, i, _ in items])
        expect(got == [p if r == fc.STORED else None for (_, _, p), r in zip(items, outcomes)],
               "stored pages hit, the refused one misses")
        again = a.put(pool, [(1, 9, page(9))])
        expect(again == [fc.NOT_STORED_OVER_QUOTA], "a fourth page is over quota: %r" % again)
        a.destroy_pool(pool)
        ok("quota of 2 pages: one of 3 is NOT_STORED_OVER_QUOTA and stores nothing")
        expect_status(fc.INVALID_SPEC, "a quota on an ephemeral pool", a.create_pool,
                      False, None, None, False, 10)
        bad = bytearray(fc.create_pool_body(persistent=True))
        bad[3] = 0x80
        expect_status(fc.MALFORMED, "CREATE_POOL with an unknown flag", a.call,
                      fc.OP_CREATE_POOL, bytes(bad))
        expect_status(fc.MALFORMED, "CREATE_POOL of 39 bytes", a.call, fc.OP_CREATE_POOL,
                      fc.create_pool_body()[:39])
        ok("INVALID_SPEC and MALFORMED pool specs")

    def stats(self, a, pool):
        stats = a.stats()
        missing = [n for n in NODE_STATS if n not in stats]
        expect(not missing, "STATS lacks %s" % missing)
        prefix = "pool.%d." % pool
        missing = [n for n in POOL_STATS if prefix + n not in stats]
        expect(not missing, "STATS lacks %s for pool %d" % (missing, pool))
        expect(stats[prefix + "persistent"] == 1, "pool.%d.persistent is 1" % pool)
        expect(stats["connections"] >= 1 and stats["pools"] >= 1, "connections, pools >= 1")
        ok("STATS: %d entries, every documented name present" % len(stats))

    def members(self, a):
        members = a.members()
        if self.expected_members is not None:
            expect(len(members) == self.expected_members,
                   "MEMBERS lists %d members, expected %d" % (len(members), self.expected_members))
        ids = [m["id"] for m in members]
        expect(ids == sorted(ids) and len(set(ids)) == len(ids),
               "MEMBERS entries sorted by id, one per name: %r" % ids)
        local = [m for m in members if m["local"]]
        if members:
            expect(len(local) == 1, "exactly one entry flagged as the answering node: %r" % local)
            me = local[0]
            expect((me["ip"], me["port"]) == (self.host, self.port),
                   "the local entry's address %s:%d is the one connected to, %s:%d"
                   % (me["ip"], me["port"], self.host, self.port))
            expect(me["state"] == fc.MEMBER_ALIVE and me["age_ms"] == 0,
                   "the answering node is alive, heard of 0 ms ago: %r" % me)
            expect(0 < me["lendable_bytes"] and me["free_bytes"] <= me["lendable_bytes"],
                   "0 < free <= lendable: %r" % me)
            expect(me["generation"] > 0, "a generation: %r" % me)
        expect_status(fc.MALFORMED, "MEMBERS with a body", a.call, fc.OP_MEMBERS, b"x")
        ok("MEMBERS: %d member(s)%s; a body is MALFORMED" % (
            len(members), ", the answering node flagged, alive" if members else ""))

    def errors_keep_the_connection(self, a):
        rid = a.send(0x7F, b"anything")
        op, status, body = a.wait(rid)
        expect((op, status) == (0x7F, fc.UNKNOWN_OP),
               "unknown op 0x7f: reply op 0x%02x %s" % (op, fc.status_name(status)))
        a.ping()
        ok("unknown op: UNKNOWN_OP with the op echoed; the connection stays usable")

        expect_status(fc.MALFORMED, "GET of 0 keys", a.call, fc.OP_GET, struct.pack("<II", 0, 0))
        expect_status(fc.TOO_LARGE, "GET of 257 keys", a.call, fc.OP_GET,
                      struct.pack("<II", 0, 257) + bytes(16 * 257))
        expect_status(fc.MALFORMED, "GET with a short key list", a.call, fc.OP_GET,
                      struct.pack("<II", 0, 2) + bytes(16))
        expect_status(fc.MALFORMED, "PING with a body", a.call, fc.OP_PING, b"x")
        expect_status(fc.MALFORMED, "INVALIDATE_OBJECT with reserved bits", a.call,
                      fc.OP_INVALIDATE_OBJECT, struct.pack("<IIQ", 0, 1, 0))
        expect_status(fc.MALFORMED, "HELLO after AUTH", a.call, fc.OP_HELLO,
                      fc.hello_body(a.client_id, "again"))
        a.ping()
        ok("MALFORMED and TOO_LARGE keep the connection usable")

    def visibility(self, a, pool):
        b = self.client()
        ghost = 0xFFFF_FFF0
        mine = expect_status(fc.UNKNOWN_POOL, "another client's GET", b.get, pool, [(1, 0)])
        none = expect_status(fc.UNKNOWN_POOL, "GET of a pool that never was", b.get, ghost,
                             [(1, 0)])
        expect(mine.body.replace(str(pool).encode(), b"N")
               == none.body.replace(str(ghost).encode(), b"N"),
               "an unreachable pool answers like an unknown one: %r vs %r"
               % (mine.body, none.body))
        for what, fn, args in [
            ("PUT", b.put, (pool, [(1, 0, page(1))])),
            ("TAKE", b.take, (pool, [(1, 0)])),
            ("INVALIDATE_PAGES", b.invalidate_pages, (pool, [(1, 0)])),
            ("INVALIDATE_OBJECT", b.invalidate_object, (pool, 1)),
            ("INVALIDATE_POOL", b.invalidate_pool, (pool,)),
            ("DESTROY_POOL", b.destroy_pool, (pool,)),
        ]:
            expect_status(fc.UNKNOWN_POOL, "another client's " + what, fn, *args)
        expect(not any(n.startswith("pool.%d." % pool) for n in b.stats()),
               "STATS of another client lists pool %d" % pool)
        b.close()
        ok("a private pool is unreachable by another client id, like an unknown pool")

        again = self.client(client_id=a.client_id)
        p = page(4)
        expect(again.put(pool, [(4, 0, p)]) == [fc.STORED], "same id, second connection")
        expect(a.get(pool, [(4, 0)]) == [p], "the first connection sees the page")
        expect(again.invalidate_pool(pool) == 1, "the second connection empties the pool")
        again.close()
        ok("a second connection of the same client id reaches its pools")

    def shared_pool(self, a):
        uuid = int.from_bytes(os.urandom(16), "little")
        s = a.create_pool(persistent=True, shared_uuid=uuid)
        expect(a.create_pool(persistent=True, shared_uuid=uuid) == s,
               "presenting the UUID again returns the same id")
        b = self.client()
        expect_status(fc.UNKNOWN_POOL, "a shared pool before attaching", b.get, s, [(1, 0)])
        expect(b.create_pool(persistent=True, shared_uuid=uuid) == s, "attach gives the id")
        p = page(77)
        expect(b.put(s, [(1, 0, p)]) == [fc.STORED], "PUT into the shared pool")
        expect(a.get(s, [(1, 0)]) == [p], "the other client reads it")
        expect_status(fc.SHARED_POOL_MISMATCH, "attach with other options", b.create_pool,
                      False, uuid)
        b.destroy_pool(s)
        expect_status(fc.UNKNOWN_POOL, "GET after detaching", b.get, s, [(1, 0)])
        expect(a.get(s, [(1, 0)]) == [p], "the pool lives while a client is attached")
        a.destroy_pool(s)
        b.close()
        ok("shared pool: attach by UUID, pages visible to both, mismatch refused, detach")

    def pipelining(self, a):
        pool = a.create_pool(persistent=True)
        a.put(pool, [(1, i, page(i)) for i in range(4)])
        ids = {
            a.send(fc.OP_STATS, b""): fc.OP_STATS,
            a.send(fc.OP_GET, fc.keys_body(pool, [(1, 0)])): fc.OP_GET,
            a.send(fc.OP_PING, b""): fc.OP_PING,
            a.send(fc.OP_INVALIDATE_OBJECT, struct.pack("<IIQ", pool, 0, 2)): 0x13,
            a.send(fc.OP_GET, fc.keys_body(pool, [(1, 1), (1, 2)])): fc.OP_GET,
        }
        for rid in sorted(ids, reverse=True):
            op, status, _ = a.wait(rid)
            expect((op, status) == (ids[rid], fc.OK),
                   "pipelined request %d: reply op 0x%02x %s" % (rid, op, fc.status_name(status)))
        a.destroy_pool(pool)
        ok("5 pipelined requests, each reply matched by id")

    def refused_handshakes(self):
        # A wrong secret: AUTH_FAILED, then the node closes.
        raw = self.raw()
        client_id = 5
        raw.send(fc.encode_frame(fc.OP_HELLO, 1, fc.hello_body(client_id, "wrong secret")))
        op, status, rid, body = raw.recv_frame()
        expect((op, status, rid) == (fc.OP_HELLO, fc.OK, 1), "HELLO accepted")
        challenge = body[24:56]
        nonce = os.urandom(32)
        proof, _ = fc.proofs(self.secret + b"x", 1, challenge, nonce, client_id)
        raw.send(fc.encode_frame(fc.OP_AUTH, 2, nonce + proof))
        op, status, rid, _ = raw.recv_frame()
        expect((op, status, rid) == (fc.OP_AUTH, fc.AUTH_FAILED, 2),
               "wrong secret: op 0x%02x %s id %d" % (op, fc.status_name(status), rid))
        expect(raw.at_eof(), "the node closes after AUTH_FAILED")
        raw.close()
        try:
            Client.connect(self.host, self.port, b"not the secret at all").close()
            raise Mismatch("Client.connect with a wrong secret succeeded")
        except StatusError as err:
            expect(err.status == fc.AUTH_FAILED, "wrong secret: %s" % err)
        ok("a wrong secret is refused with AUTH_FAILED and the connection closed")

        raw = self.raw()
        raw.send(fc.encode_frame(fc.OP_HELLO, 7, fc.hello_body(1, "future", 2, 3)))
        op, status, rid, body = raw.recv_frame()
        expect((op, status, rid) == (fc.OP_HELLO, fc.UNSUPPORTED_VERSION, 7),
               "HELLO 2..3: op 0x%02x %s id %d" % (op, fc.status_name(status), rid))
        expect(len(body) == 4, "UNSUPPORTED_VERSION body is the node's range")
        lo, hi = struct.unpack("<HH", body)
        expect(lo <= 1 <= hi, "the node's range %d..%d includes 1" % (lo, hi))
        expect(raw.at_eof(), "the node closes after UNSUPPORTED_VERSION")
        raw.close()
        ok("no version in common: UNSUPPORTED_VERSION %d..%d, closed" % (lo, hi))

        raw = self.raw()
        raw.send(fc.encode_frame(fc.OP_PING, 9, b""))
        op, status, rid, _ = raw.recv_frame()
        expect((op, status, rid) == (fc.OP_PING, fc.NOT_AUTHENTICATED, 9),
               "PING first: op 0x%02x %s id %d" % (op, fc.status_name(status), rid))
        expect(raw.at_eof(), "the node closes after NOT_AUTHENTICATED")
        raw.close()
        ok("a request before AUTH: NOT_AUTHENTICATED, closed")

        raw = self.raw()
        raw.send(struct.pack("<I", fc.PRE_AUTH_MAX_FRAME_LEN + 1) + bytes(16))
        op, status, rid, _ = raw.recv_frame()
        expect((op, status, rid) == (0, fc.BAD_FRAME, 0),
               "257-byte frame before AUTH: op 0x%02x %s id %d"
               % (op, fc.status_name(status), rid))
        expect(raw.at_eof(), "the node closes after BAD_FRAME")
        raw.close()
        ok("a frame over the pre-auth limit: BAD_FRAME with id 0, closed")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--addr", required=True, help="the node's HOST:PORT")
    parser.add_argument("--secret-file", required=True, help="the shared secret's file")
    parser.add_argument("--members", type=int, help="how many members MEMBERS must list")
    args = parser.parse_args()
    host, _, port = args.addr.rpartition(":")
    if not host or not port.isdigit():
        parser.error("--addr must be HOST:PORT, not %r" % args.addr)
    check = Check(host.strip("[]"), int(port), fc.read_secret(args.secret_file), args.members)
    try:
        check.run()
    except Mismatch as err:
        print("FAIL: %s (last passed: %s)" % (err, LAST_OK[0]), file=sys.stderr)
        return 1
    except (StatusError, fc.ProtocolError, OSError) as err:
        print("FAIL: %s: %s (last passed: %s)" % (type(err).__name__, err, LAST_OK[0]),
              file=sys.stderr)
        return 1
    print("all protocol checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
