#!/usr/bin/env python3
"""Warm restarts of `fallow node` (issue #30): a node lending 1 GiB, full, stopped and
started again over the same --state-dir (docs/operations.md, "fallow node").

Each round starts a node (`--lend 1G --state-dir DIR`, DIR a fresh directory under
/dev/shm) and fills one ephemeral pool through one client with a fixed client id, the
Python client of the compliance tests (tests/compliance/fallow_client.py): --keys-factor
× the pages the budget holds (1.25 ×: the pool is full and has evicted, as a cache
does). Every page is derived from its key (the salt of its round, its pool, object and
index, 32 bytes repeated 128 times), so every hit is checked. Then:

  before   --seconds of random GETs (batches of 64 keys, uniform over every key put,
           8 batches in flight): hit ratio, wrong pages;
  SIGTERM  the time to the old process's exit, and the node's own account of writing
           the snapshot (its log: elapsed_ms, bytes);
  restart  a new process over the same DIR; the client dials every 2 ms from the
           spawn: the time to its first HELLO+AUTH, and to its first answered GET
           ("serving again"); the node's log gives the CRC check (from the budget set
           to the restore starting) and the restore (its elapsed_ms);
  after    the same GETs, same client id and pool id, from the spawn for --seconds:
           hit ratio (and the same with the time before serving counted as misses),
           wrong pages; the node id must be the one before;
  SIGKILL  a persistent pool is filled with --persistent-share × the budget's pages
           (the ephemeral pool gives way), then kill -9 and a new process over the same
           DIR: the time to serving (the first GET of the persistent pool answered), the
           node's account of the recovery (its log: elapsed_ms, pages, journal_bytes),
           the same node id, every persistent key read back and checked, and the
           ephemeral pool's old keys for --kill-seconds (the pool is known again, empty:
           no hit, nothing wrong).

Also the node's resident memory (VmRSS) before the stop and after the restore, the
snapshot file's size, what a plain read of the snapshot costs, and the new process's CPU
time (user, system) and the machine's idle and stolen time until the first HELLO. The
last round restarts once more under `perf record -p` (not in the table; --no-perf skips
it): where the restart's time goes. Targets: serving again ≤ 1 s and after/before hit
ratio ≥ 0.95 after a clean restart; serving again ≤ 2 s, no wrong page and no persistent
page lost after SIGKILL.

    python3 bench/node_restart.py [--rounds 3] [--lend 1G] [--seconds 10]
                                  [--keys-factor 1.25] [--kill-seconds 3]
                                  [--persistent-share 0.5]
                                  [--no-perf] [--quick] [--no-write] [--fallow BIN]
    python3 bench/node_restart.py --table RESULTS.jsonl

Raw lines go to bench/out/node-restart-DATE.jsonl, progress to stderr; the section goes
between the node-restart markers of BENCHMARKS.md (added at its end if missing; not with
--no-write or --quick) and to stdout. Every process it starts is stopped by PID, and its
directories under /dev/shm are removed.
"""

import argparse
import collections
import datetime
import json
import os
import random
import re
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time

from benchutil import free_port, git_commit, write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests/compliance"))
import fallow_client as fc  # noqa: E402

MARKER = "node-restart"
PAGE = fc.PAGE_SIZE
BATCH = 64
WINDOW = 8
CLIENT_ID = 0x30_6e6f6465_72657374_61727430  # fixed: the node keeps its pools across a restart
# Targets (issue #30).
CLEAN_SERVING_S = 1.0
KILL_SERVING_S = 2.0
RATIO_AFTER = 0.95
STOP_TIMEOUT = 120
SERVE_TIMEOUT = 60


def log(msg):
    print(f"[node-restart {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_size(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("IB").rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def key_of(i):
    """The i-th key: (object, index)."""
    return i >> 10, i & 1023


def page_of(salt, pool, obj, idx):
    """The page stored under a key: 32 bytes that name it, 128 times."""
    return struct.pack("<QQQQ", salt, pool, obj, idx) * 128


def rss_bytes(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")


def proc_cpu(pid):
    """(user ms, system ms, minor faults) a process has used so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) * TICK_MS, int(fields[12]) * TICK_MS, int(fields[7])


def host_ms():
    """(steal ms, idle ms) of all CPUs since boot, from /proc/stat."""
    with open("/proc/stat") as f:
        cpu = f.readline().split()
    return int(cpu[8]) * TICK_MS, int(cpu[4]) * TICK_MS


def read_ms(path):
    """A plain read of the file, 1 MiB at a time."""
    started = time.monotonic()
    with open(path, "rb", buffering=0) as f:
        while f.read(1 << 20):
            pass
    return (time.monotonic() - started) * 1000


PERF_LINE = re.compile(r"^\s*([\d.]+)%\s+\[([k.])\]\s+(.+?)\s*$")


def perf_top(path, n=8):
    """The symbols with the most samples in a perf.data: [(share %, symbol)]."""
    out = subprocess.run(["perf", "report", "-i", path, "--no-children", "--sort", "sym",
                          "--stdio"], capture_output=True, text=True)
    top = []
    for line in out.stdout.splitlines():
        m = PERF_LINE.match(line)
        if m:
            top.append((float(m.group(1)), ("kernel " if m.group(2) == "k" else "")
                        + m.group(3)))
    return top[:n]


# --- the node's log ----------------------------------------------------------------------

LINE = re.compile(r"^(\S+Z)\s+(\w+)\s+(\S+): (.*)$")
FIELD = re.compile(r"(\w+)=(\"[^\"]*\"|\S+)")


def log_events(path):
    """(wall-clock seconds, message, fields) for each line of a node's log."""
    events = []
    for line in open(path, errors="replace"):
        m = LINE.match(line.strip())
        if not m:
            continue
        stamp = datetime.datetime.strptime(m.group(1)[:26], "%Y-%m-%dT%H:%M:%S.%f")
        wall = stamp.replace(tzinfo=datetime.timezone.utc).timestamp()
        rest = m.group(4)
        first = FIELD.search(rest)
        message = (rest[: first.start()] if first else rest).strip()
        fields = {k: v.strip('"') for k, v in FIELD.findall(rest)}
        events.append((wall, message, fields))
    return events


def find(events, prefix):
    for ev in events:
        if ev[1].startswith(prefix):
            return ev
    return None


# --- the node ----------------------------------------------------------------------------

class Node:
    """One `fallow node` process at a time over one state directory; stopped by PID."""

    def __init__(self, args, work, secret_path, state_dir, port):
        self.args, self.work, self.secret_path = args, work, secret_path
        self.state_dir, self.port = state_dir, port
        self.proc = None
        self.starts = 0

    def spawn(self, tag):
        """Starts a process; returns (monotonic, wall clock) of the spawn and its log."""
        self.starts += 1
        self.log_path = os.path.join(self.work, f"node-{tag}.log")
        logf = open(self.log_path, "w")
        argv = [self.args.fallow, "node", "--listen", f"127.0.0.1:{self.port}",
                "--lend", self.args.lend, "--secret-file", self.secret_path,
                "--state-dir", self.state_dir]
        mono, wall = time.monotonic(), time.time()
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf,
                                     stderr=logf, start_new_session=True)
        logf.close()
        return mono, wall

    def signal_and_wait(self, sig):
        """Sends `sig`; returns (wall clock sent, seconds to the exit)."""
        wall, mono = time.time(), time.monotonic()
        self.proc.send_signal(sig)
        self.proc.wait(STOP_TIMEOUT)
        return wall, time.monotonic() - mono

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def connect_when_up(node, secret, spawn_mono):
    """Dials every 2 ms until HELLO+AUTH succeed; returns (client, seconds from spawn)."""
    while True:
        try:
            c = fc.Client.connect("127.0.0.1", node.port, secret, client_id=CLIENT_ID,
                                  timeout=30)
            return c, time.monotonic() - spawn_mono
        except (ConnectionRefusedError, ConnectionResetError, fc.ProtocolError):
            if node.proc.poll() is not None:
                raise RuntimeError(f"the node exited ({node.proc.returncode}): "
                                   f"see {node.log_path}")
            if time.monotonic() - spawn_mono > SERVE_TIMEOUT:
                raise RuntimeError(f"the node did not serve in {SERVE_TIMEOUT} s")
            time.sleep(0.002)


# --- the workload ------------------------------------------------------------------------

def fill(client, pool, n_keys, salt):
    """Puts every key's page; returns (seconds, outcomes counted)."""
    started = time.monotonic()
    outcomes = collections.Counter()
    chunk = 4096
    for first in range(0, n_keys, chunk):
        items = []
        for i in range(first, min(first + chunk, n_keys)):
            obj, idx = key_of(i)
            items.append((obj, idx, page_of(salt, pool, obj, idx)))
        outcomes.update(client.put(pool, items))
        if first and first % (chunk * 32) == 0:
            log(f"  filled {first:,} of {n_keys:,} pages")
    return time.monotonic() - started, outcomes


def check_pages(keys, body, salt, pool, tally, old_salt=None):
    """Counts the hits of one GET reply and checks each page against its key; a wrong
    page that carries `old_salt` is also counted as stale."""
    for name in ("gets", "hits", "wrong", "stale"):
        tally.setdefault(name, 0)
    flags = body[: len(keys)]
    at = len(keys)
    view = memoryview(body)
    for (obj, idx), found in zip(keys, flags):
        tally["gets"] += 1
        if not found:
            continue
        tally["hits"] += 1
        page = view[at : at + PAGE]
        at += PAGE
        if page != page_of(salt, pool, obj, idx):
            tally["wrong"] += 1
            if old_salt is not None and page[:8] == struct.pack("<Q", old_salt):
                tally["stale"] += 1
    if at != len(body):
        raise fc.ProtocolError(f"GET reply of {len(body)} bytes, {at} expected")


def random_gets(client, pool, n_keys, salt, until, rng, tally, old_salt=None):
    """Random GETs of BATCH keys, WINDOW in flight, until the monotonic time `until`."""
    inflight = collections.deque()
    while True:
        while len(inflight) < WINDOW and time.monotonic() < until:
            keys = [key_of(rng.randrange(n_keys)) for _ in range(BATCH)]
            rid = client.send(fc.OP_GET, fc.keys_body(pool, keys))
            inflight.append((rid, keys))
        if not inflight:
            break
        rid, keys = inflight.popleft()
        op, status, body = client.wait(rid)
        if status != fc.OK:
            raise fc.StatusError(op, status, body)
        check_pages(keys, body, salt, pool, tally, old_salt)
    return tally


def first_get(client, pool, n_keys, salt, rng, tally, old_salt=None):
    """One GET batch; returns the monotonic time of its answer."""
    keys = [key_of(rng.randrange(n_keys)) for _ in range(BATCH)]
    op, status, body = client.wait(client.send(fc.OP_GET, fc.keys_body(pool, keys)))
    at = time.monotonic()
    if status != fc.OK:
        raise fc.StatusError(op, status, body)
    check_pages(keys, body, salt, pool, tally, old_salt)
    return at


def scan(client, pool, n_keys, salt, tally):
    """GETs every key from 0 to `n_keys`, BATCH at a time, WINDOW in flight."""
    inflight = collections.deque()
    nxt = 0
    while nxt < n_keys or inflight:
        while len(inflight) < WINDOW and nxt < n_keys:
            keys = [key_of(i) for i in range(nxt, min(nxt + BATCH, n_keys))]
            nxt += len(keys)
            inflight.append((client.send(fc.OP_GET, fc.keys_body(pool, keys)), keys))
        rid, keys = inflight.popleft()
        op, status, body = client.wait(rid)
        if status != fc.OK:
            raise fc.StatusError(op, status, body)
        check_pages(keys, body, salt, pool, tally)
    return tally


# --- a round -----------------------------------------------------------------------------

def one_round(args, work, secret, secret_path, rnd, rng):
    state_dir = tempfile.mkdtemp(prefix="fallow-bench-", dir="/dev/shm")
    node = Node(args, work, secret_path, state_dir, free_port())
    snapshot = os.path.join(state_dir, "node.snapshot")
    res = {"round": rnd}
    salt = 0x5A17_0000 + rnd
    try:
        # Start and fill.
        spawn_mono, _ = node.spawn(f"r{rnd}-first")
        c, _ = connect_when_up(node, secret, spawn_mono)
        capacity = parse_size(args.lend) // PAGE
        n_keys = int(capacity * args.keys_factor)
        pool = c.create_pool()
        res.update(node_id=c.node_id, pool=pool, capacity_pages=capacity, keys=n_keys)
        log(f"round {rnd}: node {c.node_id:032x} on port {node.port}, pool {pool}; "
            f"filling {n_keys:,} pages ({n_keys * PAGE / (1 << 30):.2f} GiB)")
        fill_s, outcomes = fill(c, pool, n_keys, salt)
        stats = c.stats()
        res.update(fill_s=fill_s, fill_stored=outcomes[fc.STORED],
                   fill_refused=n_keys - outcomes[fc.STORED], pages_held=stats["pages"],
                   evictions=stats["evictions"], used_bytes=stats["used_bytes"],
                   metadata_bytes=stats["metadata_bytes"])
        log(f"round {rnd}: filled in {fill_s:.1f} s ({n_keys / fill_s:,.0f} pages/s); "
            f"the node holds {stats['pages']:,} pages, {stats['evictions']:,} evicted")

        # Before.
        before = random_gets(c, pool, n_keys, salt, time.monotonic() + args.seconds, rng,
                             {})
        res["before"] = before
        res["rss_before_stop"] = rss_bytes(node.proc.pid)
        log(f"round {rnd}: before: {before['gets']:,} gets, hit ratio "
            f"{before['hits'] / before['gets']:.4f}, {before['wrong']} wrong; node RSS "
            f"{res['rss_before_stop'] / (1 << 20):,.0f} MiB")

        # SIGTERM: the snapshot. The client stays connected, as a real one would.
        sent_wall, exit_s = node.signal_and_wait(signal.SIGTERM)
        c.close()
        ev = log_events(node.log_path)
        wrote = find(ev, "wrote the snapshot")
        stopped = find(ev, "node stopped")
        res.update(term_exit_s=exit_s, term_rc=node.proc.returncode,
                   snapshot_file_bytes=os.path.getsize(snapshot)
                   if os.path.exists(snapshot) else None)
        if wrote:
            res.update(save_ms=int(wrote[2]["elapsed_ms"]), save_bytes=int(wrote[2]["bytes"]),
                       save_pages=int(wrote[2]["pages"]),
                       save_done_s=wrote[0] - sent_wall)
        if stopped:
            res["term_to_stopped_s"] = stopped[0] - sent_wall
        if os.path.exists(snapshot):
            res["read_ms"] = read_ms(snapshot)
        log(f"round {rnd}: SIGTERM → exit {exit_s:.2f} s; snapshot "
            f"{res.get('save_ms')} ms, {res.get('save_bytes', 0) / (1 << 20):,.0f} MiB "
            f"(a plain read of it: {res.get('read_ms', 0):.0f} ms)")

        # Restart over the same DIR.
        steal0, idle0 = host_ms()
        spawn_mono, spawn_wall = node.spawn(f"r{rnd}-warm")
        c, hello_s = connect_when_up(node, secret, spawn_mono)
        steal1, idle1 = host_ms()
        user, system, faults = proc_cpu(node.proc.pid)
        res.update(warm_user_ms=user, warm_sys_ms=system, warm_minflt=faults,
                   warm_steal_ms=steal1 - steal0, warm_idle_ms=idle1 - idle0)
        after = {}
        try:
            served = first_get(c, pool, n_keys, salt, rng, after)
            res["warm_get_error"] = None
        except fc.StatusError as err:
            served, res["warm_get_error"] = time.monotonic(), fc.status_name(err.status)
        res.update(warm_hello_s=hello_s, warm_serving_s=served - spawn_mono,
                   warm_node_id=c.node_id, same_node_id=c.node_id == res["node_id"],
                   rss_after_restore=rss_bytes(node.proc.pid),
                   snapshot_left=os.path.exists(snapshot))
        log(f"round {rnd}: warm restart: HELLO at {hello_s:.3f} s, serving at "
            f"{res['warm_serving_s']:.3f} s, same node id: {res['same_node_id']}; RSS "
            f"{res['rss_after_restore'] / (1 << 20):,.0f} MiB; the node's CPU until HELLO: "
            f"{user:.0f} ms user, {system:.0f} ms system, {faults:,} minor faults; "
            f"all CPUs: {steal1 - steal0:.0f} ms stolen, {idle1 - idle0:.0f} ms idle")
        if res["warm_get_error"] is None:
            random_gets(c, pool, n_keys, salt, spawn_mono + args.seconds, rng, after)
        res["after"] = after
        res["rss_after_window"] = rss_bytes(node.proc.pid)
        ev = log_events(node.log_path)
        started = ev[0] if ev else None
        budget = find(ev, "lending a fixed budget")
        restored = find(ev, "restored the snapshot")
        ready = find(ev, "fallow node ready")
        if started:
            res["warm_first_log_s"] = started[0] - spawn_wall
        if restored:
            ms = int(restored[2]["elapsed_ms"])
            res.update(restore_ms=ms, restore_pages=int(restored[2]["pages"]),
                       restore_done_s=restored[0] - spawn_wall)
            if budget:
                res["check_ms"] = (restored[0] - ms / 1000 - budget[0]) * 1000
        if ready:
            res["warm_ready_s"] = ready[0] - spawn_wall
        log(f"round {rnd}: after: {after.get('gets', 0):,} gets, hit ratio "
            f"{after.get('hits', 0) / max(after.get('gets', 0), 1):.4f}, "
            f"{after.get('wrong', 0)} wrong; check {res.get('check_ms', 0):.0f} ms, restore "
            f"{res.get('restore_ms')} ms ({res.get('restore_pages', 0):,} pages)")

        if args.perf and rnd == args.rounds:
            c.close()
            c = profiled_restart(args, node, secret, res, rnd)

        # SIGKILL: a persistent pool is filled first. The node comes back from its state
        # file and journal: the same node id, every persistent page, the ephemeral pool
        # known and empty, nothing wrong.
        per_salt = salt + 7000
        per_pool = c.create_pool(persistent=True)
        n_per = int(capacity * args.persistent_share)
        per_fill_s, per_out = fill(c, per_pool, n_per, per_salt)
        res.update(per_pool=per_pool, per_keys=n_per, per_stored=per_out[fc.STORED],
                   per_fill_s=per_fill_s)
        log(f"round {rnd}: persistent pool {per_pool}: {per_out[fc.STORED]:,} of {n_per:,} "
            f"pages stored in {per_fill_s:.1f} s")
        journal = os.path.join(state_dir, "journal")
        _, kill_exit_s = node.signal_and_wait(signal.SIGKILL)
        c.close()
        res["snapshot_after_kill"] = os.path.exists(snapshot)
        res["journal_bytes_at_kill"] = sum(
            os.path.getsize(os.path.join(journal, f)) for f in os.listdir(journal))
        spawn_mono, spawn_wall = node.spawn(f"r{rnd}-killed")
        c, hello_s = connect_when_up(node, secret, spawn_mono)
        res.update(kill_hello_s=hello_s, kill_node_id=c.node_id,
                   kill_same_node_id=c.node_id == res["node_id"])
        first = {}
        served = first_get(c, per_pool, n_per, per_salt, rng, first)
        res.update(kill_serving_s=served - spawn_mono, kill_first=first)
        per = scan(c, per_pool, n_per, per_salt, {})
        res["kill_persistent"] = per
        # The ephemeral pool's old keys: the pool is known again, and empty.
        eph = {}
        random_gets(c, pool, n_keys, salt, time.monotonic() + args.kill_seconds, rng, eph)
        res["kill_ephemeral"] = eph
        recovered = find(log_events(node.log_path), "restored the state and the journaled")
        if recovered:
            f = recovered[2]
            res.update(recover_ms=int(f["elapsed_ms"]), recover_pages=int(f["pages"]),
                       recover_journal_bytes=int(f["journal_bytes"]),
                       recover_done_s=recovered[0] - spawn_wall)
        c.close()
        log(f"round {rnd}: SIGKILL: serving at {res['kill_serving_s']:.3f} s (recovery "
            f"{res.get('recover_ms')} ms of {res.get('recover_pages', 0):,} pages, journal "
            f"{res['journal_bytes_at_kill'] / (1 << 20):,.0f} MiB), same node id: "
            f"{res['kill_same_node_id']}; persistent: {per['hits']:,} of {per['gets']:,} "
            f"keys back, {per['wrong']} wrong; ephemeral: {eph['hits']} hits of "
            f"{eph['gets']:,} old keys, {eph['wrong']} wrong")
    finally:
        node.stop()
        shutil.rmtree(state_dir, ignore_errors=True)
    return res


def profiled_restart(args, node, secret, res, rnd):
    """One more clean restart, not in the table, with `perf record -p` attached to the new
    process from just after its spawn until it serves: where the restart's CPU time goes."""
    node.signal_and_wait(signal.SIGTERM)
    data = os.path.join(node.work, "perf.data")
    spawn_mono, _ = node.spawn(f"r{rnd}-profiled")
    perf = subprocess.Popen(["perf", "record", "-q", "-F", "2000", "-o", data, "-p",
                             str(node.proc.pid)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL,
                            stderr=open(os.path.join(node.work, "perf.log"), "w"),
                            start_new_session=True)
    try:
        c, serving = connect_when_up(node, secret, spawn_mono)
    finally:
        perf.send_signal(signal.SIGINT)
        try:
            perf.wait(60)
        except subprocess.TimeoutExpired:
            perf.kill()
            perf.wait()
    restored = find(log_events(node.log_path), "restored the snapshot")
    res["perf"] = {"serving_s": serving,
                   "restore_ms": int(restored[2]["elapsed_ms"]) if restored else None,
                   "top": perf_top(data)}
    log(f"round {rnd}: profiled restart: serving at {serving:.3f} s; top: "
        + ", ".join(f"{sym} {pct:.1f} %" for pct, sym in res["perf"]["top"][:4]))
    return c


def run(args):
    stamp = time.strftime("%Y-%m-%d-%H%M")
    os.makedirs(os.path.join(ROOT, "bench/out"), exist_ok=True)
    out_path = os.path.join(ROOT, f"bench/out/node-restart-{stamp}.jsonl")
    work = tempfile.mkdtemp(prefix="fallow-node-restart-bench-", dir="/dev/shm")

    def stop(signum, _frame):
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        # A copy of the binary: a rebuild of target/ during the run changes nothing here.
        binary = os.path.join(work, "fallow")
        shutil.copy2(args.fallow, binary)
        args.fallow = binary
        secret_path = os.path.join(work, "secret")
        with open(secret_path, "w") as f:
            f.write(os.urandom(24).hex() + "\n")
        secret = fc.read_secret(secret_path)
        rng = random.Random(30)
        with open(out_path, "w") as out:
            head = {"cpus": os.cpu_count(), "date": stamp, "load": os.getloadavg()[0],
                    "commit": git_commit(), "python": sys.version.split()[0],
                    "command": " ".join(["python3", "bench/node_restart.py", *sys.argv[1:]]),
                    "lend": args.lend, "seconds": args.seconds,
                    "keys_factor": args.keys_factor, "kill_seconds": args.kill_seconds,
                    "persistent_share": args.persistent_share,
                    "rounds": args.rounds}
            out.write(json.dumps({"machine": head}) + "\n")
            log(f"commit {head['commit']}, {head['cpus']} CPUs, load {head['load']:.1f}; "
                f"raw lines in {os.path.relpath(out_path, ROOT)}")
            for rnd in range(1, args.rounds + 1):
                res = one_round(args, work, secret, secret_path, rnd, rng)
                out.write(json.dumps(res) + "\n")
                out.flush()
            out.write(json.dumps({"end": {"load": os.getloadavg()[0],
                                          "date": time.strftime("%Y-%m-%d-%H%M")}}) + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log(f"raw results in {os.path.relpath(out_path, ROOT)}")
    return out_path


# --- the section -------------------------------------------------------------------------

def fmt(x, digits=0):
    return "–" if x is None else f"{x:,.{digits}f}"


def ratio(t):
    return t["hits"] / t["gets"] if t and t.get("gets") else None


def section(path):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    head = lines[0]["machine"]
    end = lines[-1].get("end", {})
    rounds = [l for l in lines if "round" in l]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    mib = 1 << 20
    for r in rounds:
        r["ratio_before"] = ratio(r["before"])
        r["ratio_after"] = ratio(r["after"])
        served = max(0.0, head["seconds"] - r["warm_serving_s"]) / head["seconds"]
        r["ratio_after_outage"] = r["ratio_after"] * served if r["ratio_after"] else None
        r["ratio_rel"] = r["ratio_after"] / r["ratio_before"] if r["ratio_after"] else None
        r["ratio_rel_outage"] = (r["ratio_after_outage"] / r["ratio_before"]
                                 if r["ratio_after_outage"] else None)
        r["fill_rate"] = r["keys"] / r["fill_s"]
    col = lambda k: [r[k] for r in rounds if r.get(k) is not None]  # noqa: E731
    o = []
    o.append("## Warm restarts of a node (issue #30)\n")
    o.append(f"**Command:** `{head['command']}`; commit `{head['commit']}`, "
             f"{head['date']}, {head['cpus']} CPUs, load average {head['load']:.1f} at the "
             f"start and {end.get('load', 0):.1f} at the end; Python {head['python']} "
             f"client (tests/compliance/fallow_client.py), {len(rounds)} rounds, medians "
             f"of per-round values.\n")
    cap = rounds[0]["capacity_pages"]
    keys = rounds[0]["keys"]
    o.append(f"A node with `--lend {head['lend']} --state-dir` (under /dev/shm), one "
             f"ephemeral pool filled by one client (fixed client id) with {keys:,} pages "
             f"({head['keys_factor']} × the {cap:,} the budget holds: full, and evicting), "
             f"each derived from its key; GETs of {BATCH} random keys (uniform over all "
             f"{keys:,}), {WINDOW} in flight, every hit checked, for {head['seconds']:g} s "
             f"before the stop and for the first {head['seconds']:g} s from the new "
             f"process's spawn. Filling took {fmt(med(col('fill_s')), 1)} s "
             f"({fmt(med(col('fill_rate')))} pages/s from Python).\n")

    o.append("| round | hit ratio before | SIGTERM → exit, s (snapshot written, ms) | "
             "snapshot, MiB | spawn → HELLO, s | spawn → serving (first GET), s | "
             "CRC check, ms | restore, ms | hit ratio, first "
             f"{head['seconds']:g} s | after / before | wrong pages before / after | "
             "same node id | node RSS before stop / after restore, MiB |")
    o.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def row(name, r):
        return (f"| {name} | {fmt(r['ratio_before'], 4)} | {fmt(r['term_exit_s'], 2)} "
                f"({fmt(r.get('save_ms'))}) | {fmt((r.get('snapshot_file_bytes') or 0) / mib)} "
                f"| {fmt(r['warm_hello_s'], 3)} | {fmt(r['warm_serving_s'], 3)} | "
                f"{fmt(r.get('check_ms'))} | {fmt(r.get('restore_ms'))} | "
                f"{fmt(r['ratio_after'], 4)} | {fmt(r['ratio_rel'], 3)} | "
                f"{r['before']['wrong']} / {r['after'].get('wrong', 0)} | "
                f"{'yes' if r['same_node_id'] else '**no**'} | "
                f"{fmt(r['rss_before_stop'] / mib)} / {fmt(r['rss_after_restore'] / mib)} |")

    for r in rounds:
        o.append(row(str(r["round"]), r))
    m = {k: med(col(k)) for k in ("ratio_before", "term_exit_s", "save_ms",
                                  "snapshot_file_bytes", "warm_hello_s", "warm_serving_s",
                                  "check_ms", "restore_ms", "ratio_after", "ratio_rel",
                                  "rss_before_stop", "rss_after_restore")}
    m["before"] = {"wrong": sum(r["before"]["wrong"] for r in rounds)}
    m["after"] = {"wrong": sum(r["after"].get("wrong", 0) for r in rounds)}
    m["same_node_id"] = all(r["same_node_id"] for r in rounds)
    o.append(row("**median** (wrong: sum)", m))
    o.append("")

    o.append("| round (SIGKILL) | persistent pages at the kill | journal, MiB | spawn → "
             "HELLO, s | spawn → serving (first GET), s | recovery, ms | same node id | "
             "persistent keys read: GETs / hits / wrong | ephemeral old keys: GETs / hits / "
             "wrong |")
    o.append("|---|---|---|---|---|---|---|---|---|")
    for r in rounds:
        p, e = r["kill_persistent"], r["kill_ephemeral"]
        o.append(f"| {r['round']} | {r['per_stored']:,} | "
                 f"{fmt(r['journal_bytes_at_kill'] / mib)} | {fmt(r['kill_hello_s'], 3)} | "
                 f"{fmt(r['kill_serving_s'], 3)} | {fmt(r.get('recover_ms'))} | "
                 f"{'yes' if r['kill_same_node_id'] else '**no**'} | "
                 f"{p['gets']:,} / {p['hits']:,} / {p['wrong']} | "
                 f"{e['gets']:,} / {e['hits']:,} / {e['wrong']} |")
    o.append(f"| **median** | | {fmt(med(col('journal_bytes_at_kill')) / mib)} | "
             f"{fmt(med(col('kill_hello_s')), 3)} | {fmt(med(col('kill_serving_s')), 3)} | "
             f"{fmt(med(col('recover_ms')))} | | | |")
    o.append("")

    wrong_kill = sum(r["kill_persistent"]["wrong"] + r["kill_ephemeral"]["wrong"]
                     + r["kill_first"]["wrong"] for r in rounds)
    lost_kill = sum(r["per_stored"] - r["kill_persistent"]["hits"] for r in rounds)
    status = lambda ok: "met" if ok else "**not met**"  # noqa: E731
    worst_serving = max(col("warm_serving_s"))
    worst_kill = max(col("kill_serving_s"))
    o.append("| target (issue #30) | measured | status |")
    o.append("|---|---|---|")
    o.append(f"| clean restart: serving again ≤ {CLEAN_SERVING_S:g} s | median "
             f"{fmt(m['warm_serving_s'], 2)} s, worst {fmt(worst_serving, 2)} s | "
             f"{status(worst_serving <= CLEAN_SERVING_S)} |")
    worst_rel = min(col("ratio_rel"))
    outage = med(col("ratio_rel_outage"))
    o.append(f"| clean restart: hit ratio over the first {head['seconds']:g} s ≥ "
             f"{RATIO_AFTER * 100:.0f} % of before | of the GETs made: median "
             f"{fmt(m['ratio_rel'] * 100, 1)} %, worst {fmt(worst_rel * 100, 1)} %; counting "
             f"the time before serving as misses: median {fmt(outage * 100, 1)} % | "
             f"{status(worst_rel >= RATIO_AFTER)} (counting the outage as misses: "
             f"{status(outage >= RATIO_AFTER)}) |")
    wrong_clean = m["before"]["wrong"] + m["after"]["wrong"]
    o.append(f"| clean restart: no wrong page, same node and pool ids | {wrong_clean} wrong; "
             f"node id kept in {sum(r['same_node_id'] for r in rounds)}/{len(rounds)}, pool "
             f"answered in {sum(r['warm_get_error'] is None for r in rounds)}/{len(rounds)} "
             f"| {status(wrong_clean == 0 and m['same_node_id'])} |")
    o.append(f"| SIGKILL: serving again ≤ {KILL_SERVING_S:g} s | median "
             f"{fmt(med(col('kill_serving_s')), 2)} s, worst {fmt(worst_kill, 2)} s | "
             f"{status(worst_kill <= KILL_SERVING_S)} |")
    same_ids = sum(r["kill_same_node_id"] for r in rounds)
    o.append(f"| SIGKILL: nothing wrong served, no persistent page lost | {wrong_kill} wrong, "
             f"{lost_kill} persistent pages lost; node id kept in {same_ids}/{len(rounds)} | "
             f"{status(wrong_kill == 0 and lost_kill == 0 and same_ids == len(rounds))} |")
    o.append("")

    # Where the time goes.
    o.append(f"* **Stop:** SIGTERM → exit median {fmt(m['term_exit_s'], 2)} s, of which "
             f"writing the snapshot ({fmt(med(col('save_pages')))} pages, "
             f"{fmt(m['snapshot_file_bytes'] / mib)} MiB to /dev/shm) "
             f"{fmt(m['save_ms'])} ms; the rest is the stop before it (the node stops "
             f"serving and closes its connections) and the process's exit after it.")
    o.append(f"* **Start:** spawn → first log line median "
             f"{fmt(med(col('warm_first_log_s')) * 1000)} ms; the CRC check (a whole read "
             f"of the file) {fmt(m['check_ms'])} ms; the restore {fmt(m['restore_ms'])} ms "
             f"(per round: {', '.join(fmt(x) for x in col('restore_ms'))}), which reads "
             f"the file a second time and puts {fmt(med(col('restore_pages')))} pages "
             f"back in batches of 256 into an arena whose memory is faulted in as it is "
             f"written; ready (listening) at {fmt(med(col('warm_ready_s')), 3)} s, the "
             f"client's first HELLO at {fmt(m['warm_hello_s'], 3)} s and first GET at "
             f"{fmt(m['warm_serving_s'], 3)} s. For scale: a plain read of the snapshot "
             f"(Python, 1 MiB at a time) {fmt(med(col('read_ms')))} ms.")
    if col("warm_sys_ms"):
        o.append(f"* **CPU of the new process** until the first HELLO (median; per round "
                 f"wall / user / system ms: "
                 + "; ".join(f"{fmt(r['warm_hello_s'] * 1000)} / {fmt(r['warm_user_ms'])} / "
                             f"{fmt(r['warm_sys_ms'])}" for r in rounds)
                 + f"): {fmt(med(col('warm_user_ms')))} ms user and "
                 f"{fmt(med(col('warm_sys_ms')))} ms system (the kernel: reading the file "
                 f"and faulting in the arena), {fmt(med(col('warm_minflt')))} minor faults; "
                 f"over the same span the machine's CPUs were idle for "
                 f"{fmt(med(col('warm_idle_ms')))} ms and stolen (by the hypervisor) for "
                 f"{fmt(med(col('warm_steal_ms')))} ms.")
    prof = [r["perf"] for r in rounds if r.get("perf")]
    if prof:
        pr = prof[0]
        o.append(f"* **Profile** of one more clean restart (`perf record -F 2000 -p`, "
                 f"attached just after the spawn, so the first milliseconds of the check "
                 f"are missed; not in the table): serving at {fmt(pr['serving_s'], 3)} s, "
                 f"restore {fmt(pr['restore_ms'])} ms; "
                 + ("the symbols with the most samples: "
                    + ", ".join(f"`{sym}` {pct:.1f} %" for pct, sym in pr["top"][:6])
                    if pr["top"] else "no samples (perf attached too late for a restart "
                    "this short)") + ".")
    o.append(f"* **Memory:** the node's RSS {fmt(m['rss_before_stop'] / mib)} MiB before "
             f"the stop and {fmt(m['rss_after_restore'] / mib)} MiB after the restore; "
             f"between the stop and the restore's end the snapshot "
             f"({fmt(m['snapshot_file_bytes'] / mib)} MiB) is memory too (tmpfs), and the "
             f"file is gone once restored (left behind in "
             f"{sum(r['snapshot_left'] for r in rounds)}/{len(rounds)} rounds).")
    o.append(f"* **SIGKILL:** before the kill a persistent pool takes "
             f"{head.get('persistent_share', 0.5) * 100:.0f} % of the budget "
             f"({fmt(med(col('per_stored')))} pages, put in "
             f"{fmt(med(col('per_fill_s')), 1)} s; the ephemeral pool gives way). A kill "
             f"leaves no snapshot (found in {sum(r['snapshot_after_kill'] for r in rounds)}"
             f"/{len(rounds)} rounds): the new process reads the state file and the journal "
             f"(median {fmt(med(col('journal_bytes_at_kill')) / mib)} MiB, between one and "
             f"two records per persistent page), puts "
             f"{fmt(med(col('recover_pages')))} pages back in "
             f"{fmt(med(col('recover_ms')))} ms, and serves the same node id, every "
             f"persistent key (read back in full, every page checked), and the ephemeral "
             f"pool, known and empty, for {head['kill_seconds']:g} s of random GETs of its "
             f"old keys.")
    if worst_serving > CLEAN_SERVING_S:
        share = {}
        for pct, sym in (prof[0]["top"] if prof else []):
            for part in ("clear_page", "_copy_to_iter", "put_locked", "crc32c"):
                if part in sym:
                    share[part] = share.get(part, 0) + pct
        why = ""
        if share:
            why = (f" In the profiled restart, the kernel zeroing the arena's fresh huge "
                   f"pages (`clear_page_erms`, on the engine's first write into each) took "
                   f"{share.get('clear_page', 0):.0f} % of the samples, copying the file "
                   f"out of tmpfs (`_copy_to_iter`, both reads) "
                   f"{share.get('_copy_to_iter', 0):.0f} %, the engine's put "
                   f"{share.get('put_locked', 0):.0f} % and the CRC "
                   f"{share.get('crc32c', 0):.0f} %.")
        o.append("")
        o.append(f"**Why serving again takes about {CLEAN_SERVING_S:g} s or more here:** the "
                 f"node serves only once the snapshot is checked and restored, one thread "
                 f"doing both, and both scale with the {fmt(m['snapshot_file_bytes'] / mib)} "
                 f"MiB it holds: the check reads it whole for its CRC "
                 f"({fmt(m['check_ms'])} ms), then the restore reads it again (a plain read: "
                 f"{fmt(med(col('read_ms')))} ms) and writes every page into a fresh arena, "
                 f"whose memory the kernel faults in and zeroes on that first write. Until "
                 f"the first HELLO the new process used {fmt(med(col('warm_user_ms')))} ms "
                 f"of user and {fmt(med(col('warm_sys_ms')))} ms of system CPU (median; "
                 f"system {fmt(min(col('warm_sys_ms')))} to {fmt(max(col('warm_sys_ms')))} "
                 f"ms across rounds for the same file and the same pages: the variable "
                 f"part is the kernel's, faulting memory in on this VM), most of its wall "
                 f"time.{why} Checking the CRC while restoring instead of before (dropping "
                 f"what was restored if it fails) would save the first read "
                 f"(~{fmt(m['check_ms'])} ms); faulting the arena in on other threads while "
                 f"the file is read would overlap the zeroing with the reads.")
    return "\n".join(o) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lend", default="1G", help="the node's --lend")
    p.add_argument("--seconds", type=float, default=10,
                   help="GETs before the stop, and from the spawn after it")
    p.add_argument("--keys-factor", type=float, default=1.25,
                   help="keys put, as a multiple of the pages the budget holds")
    p.add_argument("--persistent-share", type=float, default=0.5,
                   help="persistent pages put before the SIGKILL, as a share of the budget")
    p.add_argument("--kill-seconds", type=float, default=3,
                   help="GETs of the old keys after the SIGKILL restart")
    p.add_argument("--no-perf", dest="perf", action="store_false",
                   help="skip the profiled restart (perf record) of the last round")
    p.add_argument("--quick", action="store_true",
                   help="1 round, --lend 128M, 3 s (no section)")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--fallow", default=os.path.join(ROOT, "target/release/fallow"))
    p.add_argument("--table", help="print the section of an earlier run's JSON lines")
    args = p.parse_args()
    if args.table:
        print(section(args.table), end="")
        return
    if args.quick:
        args.rounds, args.lend, args.seconds, args.kill_seconds = 1, "128M", 3, 1
    if args.perf and shutil.which("perf") is None:
        log("no perf on PATH: no profiled restart")
        args.perf = False
    if not os.access(args.fallow, os.X_OK):
        raise SystemExit(f"{args.fallow}: no such binary (cargo build --release -p fallow)")
    text = section(run(args))
    print(text, end="")
    if not args.no_write and not args.quick:
        write_section(MARKER, text)
        log("wrote the node-restart section of BENCHMARKS.md")


if __name__ == "__main__":
    main()
