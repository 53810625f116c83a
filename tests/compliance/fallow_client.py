"""A minimal, synchronous client for the fallow node protocol.

Written from docs/protocol.md alone (Python 3 standard library only), so that it checks the
specification as much as the node: if this client and the node disagree, one of them or the
document is wrong. It is a test tool, not a production client: one socket, blocking calls,
no reconnects.

    from fallow_client import Client, read_secret
    with Client.connect("127.0.0.1", 7400, read_secret("secret")) as c:
        pool = c.create_pool(persistent=True)
        c.put(pool, [(1, 0, b"\\xab" * 4096)])
        assert c.get(pool, [(1, 0)]) == [b"\\xab" * 4096]

A node run with `--node-tls DIR` speaks the protocol inside TLS 1.3 on TCP: give the client
the CA certificate the node's certificate chains to, `DIR/ca-cert.pem`:

    Client.connect("127.0.0.1", 7400, secret, tls_ca="DIR/ca-cert.pem")

The client then checks the node's certificate against that CA and the host dialled (an IP
address must be among the certificate's IP subject alternative names); a failed check
raises ssl.SSLError (ssl.SSLCertVerificationError for a certificate). A client that
connects in the clear to such a node gets TlsRequired.
"""

import hashlib
import hmac
import ipaddress
import os
import socket
import ssl
import struct

# --- Constants (docs/protocol.md, "Conventions" and "Limits") --------------------------------

PAGE_SIZE = 4096
HEADER_LEN = 16
MIN_FRAME_LEN = 12  # the length field counts the 12 header bytes after it
MAX_FRAME_LEN = 256 * 4096 + 64 * 1024
PRE_AUTH_MAX_FRAME_LEN = 256
MAX_BATCH = 256
MAX_NAME_LEN = 64
MAGIC = b"FALLOWPP"
VERSION = 1
CLIENT_LABEL = b"fallow-v1 client proof\x00"
NODE_LABEL = b"fallow-v1 node proof\x00"
KEY_LEN = 16

# --- Op codes -------------------------------------------------------------------------------

OP_HELLO = 0x01
OP_AUTH = 0x02
OP_PING = 0x03
OP_CREATE_POOL = 0x10
OP_DESTROY_POOL = 0x11
OP_INVALIDATE_POOL = 0x12
OP_INVALIDATE_OBJECT = 0x13
OP_INVALIDATE_PAGES = 0x14
OP_PUT = 0x20
OP_GET = 0x21
OP_TAKE = 0x22
OP_STATS = 0x30
OP_MEMBERS = 0x31

# --- Status codes ---------------------------------------------------------------------------

OK = 0
UNKNOWN_OP = 1
MALFORMED = 2
TOO_LARGE = 3
NOT_AUTHENTICATED = 4
AUTH_FAILED = 5
UNSUPPORTED_VERSION = 6
UNKNOWN_POOL = 7
INVALID_SPEC = 8
SHARED_POOL_MISMATCH = 9
TOO_MANY_POOLS = 10
INTERNAL = 11
BAD_FRAME = 12
TLS_REQUIRED = 13  # a node with --node-tls, reached in the clear: one frame, then close

STATUS_NAMES = {
    OK: "OK",
    UNKNOWN_OP: "UNKNOWN_OP",
    MALFORMED: "MALFORMED",
    TOO_LARGE: "TOO_LARGE",
    NOT_AUTHENTICATED: "NOT_AUTHENTICATED",
    AUTH_FAILED: "AUTH_FAILED",
    UNSUPPORTED_VERSION: "UNSUPPORTED_VERSION",
    UNKNOWN_POOL: "UNKNOWN_POOL",
    INVALID_SPEC: "INVALID_SPEC",
    SHARED_POOL_MISMATCH: "SHARED_POOL_MISMATCH",
    TOO_MANY_POOLS: "TOO_MANY_POOLS",
    INTERNAL: "INTERNAL",
    BAD_FRAME: "BAD_FRAME",
    TLS_REQUIRED: "TLS_REQUIRED",
}

# Statuses after which the node closes the connection.
CLOSING = {NOT_AUTHENTICATED, AUTH_FAILED, UNSUPPORTED_VERSION, BAD_FRAME, TLS_REQUIRED}

# PUT outcome codes.
STORED = 0
NOT_STORED_FULL = 1
NOT_STORED_OVER_QUOTA = 2

# CREATE_POOL flag bits.
FLAG_COMPRESS = 1
FLAG_QUOTA = 2
FLAG_CLUSTER = 4  # a cluster pool: the node spreads it over the cluster (peer forwarding)

# MEMBERS (section 4.6): entry layout, member states, entry flags.
MEMBER_ENTRY_LEN = 56
MAX_MEMBERS = 3000
MEMBER_ALIVE = 0
MEMBER_SUSPECT = 1
MEMBER_DEAD = 2
MEMBER_STATES = {MEMBER_ALIVE: "alive", MEMBER_SUSPECT: "suspect", MEMBER_DEAD: "dead"}
MEMBER_FLAG_LOCAL = 0x01


def status_name(code):
    return STATUS_NAMES.get(code, "status %d" % code)


class ProtocolError(Exception):
    """The node sent something this document does not allow, or the stream broke."""


class StatusError(Exception):
    """The node answered a request with a status other than OK."""

    def __init__(self, op, status, body):
        self.op = op
        self.status = status
        self.body = body
        if status == UNSUPPORTED_VERSION and len(body) == 4:
            lo, hi = struct.unpack("<HH", body)
            detail = "node speaks versions %d..%d" % (lo, hi)
        else:
            detail = body.decode("utf-8", "replace")
        super().__init__("op 0x%02x: %s: %s" % (op, status_name(status), detail))


class TlsRequired(StatusError):
    """The node speaks only TLS on this address and the client connected in the clear: it
    answered the first bytes with one TLS_REQUIRED frame (op 0, id 0) and closed. Connect
    again with tls_ca."""

    def __init__(self, body):
        super().__init__(0, TLS_REQUIRED, body)
        self.args = ("the node requires TLS (connect with tls_ca=the CA's ca-cert.pem): %s"
                     % body.decode("utf-8", "replace"),)


def tls_context(tls_ca):
    """A client context that trusts only the CA certificate at `tls_ca`, checks the node's
    name or address, and speaks TLS 1.3 only, as the node does."""
    context = ssl.create_default_context(cafile=tls_ca)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    return context


def open_socket(host, port, timeout=10.0, tls_ca=None):
    """A connected TCP socket (TCP_NODELAY), inside TLS when `tls_ca` (the path of a CA
    certificate) is given; the TLS handshake is done before it returns."""
    sock = socket.create_connection((host, port), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls_ca is not None:
            sock = tls_context(tls_ca).wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise
    return sock


def read_secret(path):
    """The secret in a secret file: its bytes with surrounding ASCII whitespace removed
    (space, tab, LF, FF, CR), as the node reads it."""
    with open(path, "rb") as f:
        return f.read().strip(b" \t\n\x0c\r")


def proofs(secret, version, challenge, client_nonce, client_id):
    """(client proof, node proof) of the handshake transcript."""
    transcript = (
        struct.pack("<H", version) + challenge + client_nonce + client_id.to_bytes(16, "little")
    )
    client = hmac.new(secret, CLIENT_LABEL + transcript, hashlib.sha256).digest()
    node = hmac.new(secret, NODE_LABEL + transcript, hashlib.sha256).digest()
    return client, node


# --- Encoding (pure functions: used by the client and by the documentation's examples) ------


def encode_frame(op, request_id, body, status=0):
    """One frame: length, op, status, reserved, id, body."""
    return struct.pack("<IBBHQ", MIN_FRAME_LEN + len(body), op, status, 0, request_id) + body


def hello_body(client_id, name, version_min=VERSION, version_max=VERSION):
    name = name.encode("utf-8")
    if len(name) > MAX_NAME_LEN:
        raise ValueError("client name over 64 bytes")
    return (
        MAGIC
        + struct.pack("<HH", version_min, version_max)
        + client_id.to_bytes(16, "little")
        + bytes([len(name)])
        + name
    )


def create_pool_body(persistent=False, shared_uuid=None, dedup_domain=None, compress=False,
                     quota_pages=None, cluster=False):
    flags = (FLAG_COMPRESS if compress else 0) | (FLAG_QUOTA if quota_pages is not None else 0)
    flags |= FLAG_CLUSTER if cluster else 0
    return struct.pack(
        "<BBBBIQQ",
        1 if persistent else 0,
        0 if shared_uuid is None else 1,
        0 if dedup_domain is None else 1,
        flags,
        0,
        quota_pages or 0,
        dedup_domain or 0,
    ) + (shared_uuid or 0).to_bytes(16, "little")


def keys_body(pool, keys):
    """pool, count, then (object, index) for each key."""
    if not 1 <= len(keys) <= MAX_BATCH:
        raise ValueError("a batch holds 1 to 256 keys, not %d" % len(keys))
    parts = [struct.pack("<II", pool, len(keys))]
    parts += [struct.pack("<QQ", obj, idx) for obj, idx in keys]
    return b"".join(parts)


def put_body(pool, items):
    """items: (object, index, page) triples; every page is exactly 4096 bytes."""
    for _, _, page in items:
        if len(page) != PAGE_SIZE:
            raise ValueError("a page is 4096 bytes, not %d" % len(page))
    return keys_body(pool, [(o, i) for o, i, _ in items]) + b"".join(p for _, _, p in items)


def parse_stats(body):
    """A STATS reply body as a list of (name, value), in the node's order."""
    (count,) = struct.unpack_from("<H", body, 0)
    at, entries = 2, []
    for _ in range(count):
        n = body[at]
        name = body[at + 1 : at + 1 + n].decode("utf-8")
        (value,) = struct.unpack_from("<Q", body, at + 1 + n)
        entries.append((name, value))
        at += 1 + n + 8
    if at != len(body):
        raise ProtocolError("STATS reply: %d bytes after the last entry" % (len(body) - at))
    return entries


def parse_members(body):
    """A MEMBERS reply body as a list of dicts (id, state, local, ip, port, generation,
    lendable_bytes, free_bytes, age_ms), in the node's order. Raises ProtocolError on
    anything section 4.6 does not allow."""
    if len(body) < 2:
        raise ProtocolError("MEMBERS reply of %d bytes, shorter than its count" % len(body))
    (count,) = struct.unpack_from("<H", body, 0)
    if count > MAX_MEMBERS:
        raise ProtocolError("MEMBERS count %d over %d" % (count, MAX_MEMBERS))
    at, members = 2, []
    for n in range(count):
        if len(body) < at + MEMBER_ENTRY_LEN:
            raise ProtocolError("MEMBERS entry %d cut short" % n)
        state, flags, family, id_len = body[at : at + 4]
        ip = bytes(body[at + 4 : at + 20])
        port, reserved = struct.unpack_from("<HH", body, at + 20)
        generation, lendable, free, age_ms, reserved2 = struct.unpack_from(
            "<QQQII", body, at + 24)
        if state not in MEMBER_STATES:
            raise ProtocolError("MEMBERS entry %d: state %d" % (n, state))
        if flags & ~MEMBER_FLAG_LOCAL:
            raise ProtocolError("MEMBERS entry %d: flags 0x%02x" % (n, flags))
        if family == 4:
            if any(ip[4:]):
                raise ProtocolError("MEMBERS entry %d: IPv4 address not padded with zeros" % n)
            address = str(ipaddress.IPv4Address(ip[:4]))
        elif family == 6:
            address = str(ipaddress.IPv6Address(ip))
        else:
            raise ProtocolError("MEMBERS entry %d: address family %d" % (n, family))
        if id_len == 0:
            raise ProtocolError("MEMBERS entry %d: empty id" % n)
        if reserved or reserved2:
            raise ProtocolError("MEMBERS entry %d: reserved bytes not zero" % n)
        if len(body) < at + MEMBER_ENTRY_LEN + id_len:
            raise ProtocolError("MEMBERS entry %d: id cut short" % n)
        raw_name = bytes(body[at + MEMBER_ENTRY_LEN : at + MEMBER_ENTRY_LEN + id_len])
        try:
            name = raw_name.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("MEMBERS entry %d: id is not UTF-8" % n) from None
        members.append({
            "id": name,
            "state": state,
            "local": bool(flags & MEMBER_FLAG_LOCAL),
            "ip": address,
            "port": port,
            "generation": generation,
            "lendable_bytes": lendable,
            "free_bytes": free,
            "age_ms": age_ms,
        })
        at += MEMBER_ENTRY_LEN + id_len
    if at != len(body):
        raise ProtocolError("MEMBERS reply: %d bytes after the last entry" % (len(body) - at))
    return members


# --- The client -----------------------------------------------------------------------------


class Client:
    """One authenticated connection. Requests may be pipelined with `send` and `wait`;
    every other method sends one request (or one per batch) and waits for its reply."""

    def __init__(self, sock, max_batch, node_id, client_id):
        self.sock = sock
        self.max_batch = max_batch
        self.node_id = node_id
        self.client_id = client_id
        self._next_id = 3
        self._buf = bytearray()
        self._early = {}  # replies that arrived before someone waited for them, by id

    # Connection and handshake.

    @classmethod
    def connect(cls, host, port, secret, client_id=None, name="fallow_client.py", timeout=10.0,
                tls_ca=None):
        """Connects, says HELLO, authenticates and checks the node's proof. With `tls_ca`
        (the path of the CA certificate of a node run with --node-tls), inside TLS 1.3."""
        if client_id is None:
            client_id = int.from_bytes(os.urandom(16), "little")
        sock = open_socket(host, port, timeout, tls_ca)
        try:
            return cls._handshake(sock, secret, client_id, name)
        except BaseException:
            sock.close()
            raise

    @classmethod
    def _handshake(cls, sock, secret, client_id, name):
        raw = RawConnection(sock)
        raw.send(encode_frame(OP_HELLO, 1, hello_body(client_id, name)))
        op, status, rid, body = raw.recv_frame()
        if status == TLS_REQUIRED and (op, rid) == (0, 0):
            raise TlsRequired(body)
        if (op, rid) != (OP_HELLO, 1):
            raise ProtocolError("HELLO answered with op 0x%02x id %d" % (op, rid))
        if status != OK:
            raise StatusError(op, status, body)
        if len(body) != 56:
            raise ProtocolError("HELLO reply of %d bytes, not 56" % len(body))
        version, _reserved, max_batch = struct.unpack_from("<HHI", body, 0)
        node_id = int.from_bytes(body[8:24], "little")
        challenge = body[24:56]
        if version != VERSION:
            raise ProtocolError("node chose version %d, outside the range offered" % version)
        nonce = os.urandom(32)
        client_proof, node_proof = proofs(secret, version, challenge, nonce, client_id)
        raw.send(encode_frame(OP_AUTH, 2, nonce + client_proof))
        op, status, rid, body = raw.recv_frame()
        if (op, rid) != (OP_AUTH, 2):
            raise ProtocolError("AUTH answered with op 0x%02x id %d" % (op, rid))
        if status != OK:
            raise StatusError(op, status, body)
        if not hmac.compare_digest(body, node_proof):
            raise ProtocolError("the node's proof is wrong: it does not hold the secret")
        client = cls(sock, min(max_batch, MAX_BATCH), node_id, client_id)
        client._buf = raw.buf
        return client

    def close(self):
        self.sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # Pipelining: send now, wait later, replies matched by id.

    def send(self, op, body):
        """Sends one request; returns its id."""
        rid = self._next_id
        self._next_id += 1
        self.sock.sendall(encode_frame(op, rid, body))
        return rid

    def wait(self, rid):
        """The (op, status, body) of the reply to request `rid`, whenever it comes."""
        if rid in self._early:
            return self._early.pop(rid)
        raw = RawConnection(self.sock, self._buf)
        while True:
            op, status, got, body = raw.recv_frame()
            if got == 0 and status == BAD_FRAME:
                raise StatusError(op, status, body)
            if got == rid:
                return op, status, body
            self._early[got] = (op, status, body)

    def call(self, op, body):
        """Sends one request, waits for its reply, and returns the body of an OK reply;
        raises StatusError otherwise."""
        return self._ok(op, self.wait(self.send(op, body)))

    @staticmethod
    def _ok(op, reply):
        got_op, status, body = reply
        if got_op != op:
            raise ProtocolError("reply with op 0x%02x to a request of op 0x%02x" % (got_op, op))
        if status != OK:
            raise StatusError(op, status, body)
        return body

    # Operations.

    def ping(self):
        self._expect_len(self.call(OP_PING, b""), 0, "PING")

    def create_pool(self, persistent=False, shared_uuid=None, dedup_domain=None, compress=False,
                    quota_pages=None, cluster=False):
        """Creates a pool (or attaches to the shared pool `shared_uuid`); returns its id.
        `cluster`: a cluster pool, whose pages the node spreads over the cluster it gossips
        with (a node alone refuses it with INVALID_SPEC)."""
        body = create_pool_body(persistent, shared_uuid, dedup_domain, compress, quota_pages,
                                cluster)
        reply = self.call(OP_CREATE_POOL, body)
        self._expect_len(reply, 4, "CREATE_POOL")
        return struct.unpack("<I", reply)[0]

    def destroy_pool(self, pool):
        self._expect_len(self.call(OP_DESTROY_POOL, struct.pack("<I", pool)), 0, "DESTROY_POOL")

    def invalidate_pool(self, pool):
        """Removes every page of the pool; returns how many were removed."""
        reply = self.call(OP_INVALIDATE_POOL, struct.pack("<I", pool))
        self._expect_len(reply, 8, "INVALIDATE_POOL")
        return struct.unpack("<Q", reply)[0]

    def invalidate_object(self, pool, obj):
        """Removes every page of one object; returns how many were removed."""
        reply = self.call(OP_INVALIDATE_OBJECT, struct.pack("<IIQ", pool, 0, obj))
        self._expect_len(reply, 8, "INVALIDATE_OBJECT")
        return struct.unpack("<Q", reply)[0]

    def invalidate_pages(self, pool, keys):
        """Removes the pages under `keys` ((object, index) pairs), in batches."""
        bodies = [keys_body(pool, b) for b in self._batches(keys)]
        for body in self._pipeline(OP_INVALIDATE_PAGES, bodies):
            self._expect_len(body, 0, "INVALIDATE_PAGES")

    def put(self, pool, items):
        """Stores (object, index, page) triples, in pipelined batches of at most max_batch;
        returns one outcome code per item (STORED, NOT_STORED_FULL, NOT_STORED_OVER_QUOTA)."""
        batches = self._batches(items)
        replies = self._pipeline(OP_PUT, [put_body(pool, b) for b in batches])
        outcomes = []
        for reply, batch in zip(replies, batches):
            self._expect_len(reply, len(batch), "PUT")
            if any(code > NOT_STORED_OVER_QUOTA for code in reply):
                raise ProtocolError("PUT reply with an unknown outcome code: %r" % reply)
            outcomes += list(reply)
        return outcomes

    def get(self, pool, keys):
        """The pages under `keys`: bytes for a hit, None for a miss; the pages stay."""
        return self._read(OP_GET, pool, keys)

    def take(self, pool, keys):
        """Like get, but each page found is removed."""
        return self._read(OP_TAKE, pool, keys)

    def _read(self, op, pool, keys):
        batches = self._batches(keys)
        pages = []
        replies = self._pipeline(op, [keys_body(pool, b) for b in batches])
        for body, batch in zip(replies, batches):
            flags = body[: len(batch)]
            if len(flags) != len(batch) or any(f > 1 for f in flags):
                raise ProtocolError("found flags %r for %d keys" % (bytes(flags), len(batch)))
            self._expect_len(body, len(batch) + sum(flags) * PAGE_SIZE, "GET/TAKE")
            at = len(batch)
            for found in flags:
                if found:
                    pages.append(bytes(body[at : at + PAGE_SIZE]))
                    at += PAGE_SIZE
                else:
                    pages.append(None)
        return pages

    def stats(self):
        """Every counter, as a dict name -> value."""
        return dict(parse_stats(self.call(OP_STATS, b"")))

    def members(self):
        """The cluster as the node sees it (parse_members); empty when it does not gossip."""
        return parse_members(self.call(OP_MEMBERS, b""))

    # Helpers.

    def _pipeline(self, op, bodies, window=8):
        """Sends one request per body, at most `window` in flight (a client that only
        sends while the node cannot write its replies would stall both), and returns the
        OK reply bodies in request order."""
        ids, replies = [], []
        for body in bodies:
            if len(ids) - len(replies) == window:
                replies.append(self._ok(op, self.wait(ids[len(replies)])))
            ids.append(self.send(op, body))
        while len(replies) < len(ids):
            replies.append(self._ok(op, self.wait(ids[len(replies)])))
        return replies

    def _batches(self, items):
        items = list(items)
        if not items:
            raise ValueError("an empty batch")
        return [items[i : i + self.max_batch] for i in range(0, len(items), self.max_batch)]

    @staticmethod
    def _expect_len(body, n, what):
        if len(body) != n:
            raise ProtocolError("%s reply body of %d bytes, expected %d" % (what, len(body), n))


class RawConnection:
    """Frames over a socket with no handshake logic: for the handshake itself and for
    tests that send what a well-behaved client never would."""

    def __init__(self, sock, buf=None):
        self.sock = sock
        self.buf = bytearray() if buf is None else buf

    @classmethod
    def open(cls, host, port, timeout=10.0, tls_ca=None):
        return cls(open_socket(host, port, timeout, tls_ca))

    def send(self, data):
        self.sock.sendall(data)

    def recv_frame(self):
        """(op, status, id, body) of the next frame; ProtocolError on a bad length or if
        the node closes first."""
        self._fill(4)
        (length,) = struct.unpack_from("<I", self.buf, 0)
        if not MIN_FRAME_LEN <= length <= MAX_FRAME_LEN:
            raise ProtocolError("frame length %d out of range" % length)
        self._fill(4 + length)
        op, status, _reserved, rid = struct.unpack_from("<BBHQ", self.buf, 4)
        body = bytes(self.buf[HEADER_LEN : 4 + length])
        del self.buf[: 4 + length]
        return op, status, rid, body

    def at_eof(self):
        """True when the node has closed the connection and sent nothing more."""
        if self.buf:
            return False
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except socket.timeout:
            return False

    def _fill(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self.buf)))
            if not chunk:
                raise ProtocolError("the node closed the connection")
            self.buf += chunk

    def close(self):
        self.sock.close()
