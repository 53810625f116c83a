#!/usr/bin/env python3
"""The lending governor, measured: run by bench/governor.sh (which builds the binary and
describes the measurements). Also the memory hog the measurements use:
`python3 bench/governor.py hog --bytes N [--passes P] [--hold]`.

Clocks: the node's log, the load generator's timeline (--timeline) and the hog's events
are all stamped with the wall clock (ns since the Unix epoch), so they line up.
"""

import argparse
import datetime
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

GIB = 1 << 30
MIB = 1 << 20
PAGE = 4096
SEGMENT = 2 * MIB
BUSY_PATTERN = "fallow bench pages|memcached|node_vs_memcached"
QUIET_POLL_S = 10
QUIET_LIMIT_S = 15 * 60
MIN_AVAILABLE = 3 * GIB
# Besides waiting for other benchmarks, wait (at most CPU_WAIT_S) for the CPUs to be less
# than CPU_IDLE_PERCENT busy: builds and tests are not benchmarks, but they are noise.
CPU_IDLE_PERCENT = 30
CPU_WAIT_S = 120
STALL_NS = 1_000_000
MARK_START = "<!-- governor:start -->"
MARK_END = "<!-- governor:end -->"
# Where the section goes: the full tables of each script's latest run (BENCHMARKS.md
# summarises them).
RUNS_DOC = "docs/benchmarks-runs.md"


def log(msg):
    print(f"==> [{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------- the hog


def hog(args):
    """Allocates `bytes`, writes every page (non-zero, so nothing can share it), then runs
    `passes` passes of checksum + rewrite over it. Prints JSON events with wall-clock times
    on stdout; with --hold, sleeps until killed once the memory is touched."""
    import mmap
    import zlib

    n = args.bytes
    chunk = MIB
    pattern = bytes(range(1, 256)) * (chunk // 255 + 1)
    pattern = pattern[:chunk]
    t0 = time.time_ns()
    print(json.dumps({"event": "start", "t": t0}), flush=True)
    if args.populate:
        # The kernel faults every page in at once (zero-filled, but private: real pages).
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
    else:
        m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        for off in range(0, n, chunk):
            m[off : off + chunk] = pattern[: min(chunk, n - off)]
    t1 = time.time_ns()
    print(json.dumps({"event": "touched", "t": t1}), flush=True)
    if args.hold:
        signal.pause()
        return
    mv = memoryview(m)
    crc = 0
    for p in range(args.passes):
        for off in range(0, n, chunk):
            crc = zlib.crc32(mv[off : off + chunk], crc)
        rotated = pattern[p + 1 :] + pattern[: p + 1]
        for off in range(0, n, chunk):
            m[off : off + chunk] = rotated[: min(chunk, n - off)]
    t2 = time.time_ns()
    mv.release()
    m.close()
    import resource
    ru = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "event": "done",
                "t": t2,
                "touch_s": (t1 - t0) / 1e9,
                "work_s": (t2 - t1) / 1e9,
                "total_s": (t2 - t0) / 1e9,
                "cpu_s": ru.ru_utime + ru.ru_stime,
                "crc": crc,
            }
        ),
        flush=True,
    )


# ------------------------------------------------------------------------- processes


class Procs:
    """Every process this script starts, stopped by PID at the end."""

    def __init__(self):
        self.live = []

    def start(self, argv, **kw):
        p = subprocess.Popen(argv, **kw)
        self.live.append(p)
        return p

    def pids(self):
        return {p.pid for p in self.live if p.poll() is None}

    def stop(self, p, sig=signal.SIGTERM, timeout=10):
        if p.poll() is None:
            try:
                os.kill(p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        if p in self.live:
            self.live.remove(p)

    def stop_all(self):
        for p in list(self.live):
            self.stop(p)


PROCS = Procs()


def meminfo():
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, rest = line.split(":", 1)
            out[key] = int(rest.split()[0]) * 1024
    return out


def available():
    return meminfo()["MemAvailable"]


def percpu_free():
    """Free pages on the kernel's per-CPU lists (/proc/zoneinfo), which MemAvailable leaves
    out and the governor counts (docs/governor.md), in bytes."""
    pages, in_pagesets = 0, False
    for line in Path("/proc/zoneinfo").read_text().splitlines():
        item = line.strip()
        if line.startswith("Node "):
            in_pagesets = False
        elif item == "pagesets":
            in_pagesets = True
        elif in_pagesets and item.startswith("count:"):
            pages += int(item.split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Quiet:
    """Waits until no other benchmark runs; remembers when it gave up."""

    def __init__(self):
        self.notes = []

    def others(self):
        out = subprocess.run(
            ["pgrep", "-f", BUSY_PATTERN], capture_output=True, text=True
        ).stdout.split()
        mine = PROCS.pids() | {os.getpid()}
        found = [int(pid) for pid in out if int(pid) not in mine]
        # A memcached left running by someone else's finished run is not a benchmark: a
        # server counts only if it used CPU in the last second.
        servers = {pid: cpu_ticks(pid) for pid in found if is_server(pid)}
        if servers:
            time.sleep(1)
        return [pid for pid in found if pid not in servers or cpu_ticks(pid) - servers[pid] > 1]

    def wait(self, what):
        """Waits for the other benchmarks to end, then (at most CPU_WAIT_S more) for the
        CPUs to be mostly idle; returns the share of CPU time busy in the last second."""
        start = time.monotonic()
        told = False
        while True:
            others = self.others()
            if not others:
                if told:
                    log(f"quiet after {time.monotonic() - start:.0f} s")
                return self.idle_cpus(what)
            if time.monotonic() - start >= QUIET_LIMIT_S:
                desc = describe(others)
                log(f"gave up waiting after 15 min; {what} runs alongside: {desc}")
                self.notes.append(f"{what}: ran alongside other benchmarks after a 15 min wait ({desc})")
                return cpu_busy()
            if not told:
                log(f"waiting for other benchmarks to end before {what}: {describe(others)}")
                told = True
            time.sleep(QUIET_POLL_S)

    def idle_cpus(self, what):
        start = time.monotonic()
        told = False
        while True:
            busy = cpu_busy()
            if busy < CPU_IDLE_PERCENT:
                return busy
            if time.monotonic() - start >= CPU_WAIT_S:
                log(f"CPUs still {busy:.0f} % busy after {CPU_WAIT_S} s; {what} runs anyway")
                self.notes.append(f"{what}: CPUs still {busy:.0f} % busy (other work) after a {CPU_WAIT_S} s wait")
                return busy
            if not told:
                log(f"CPUs {busy:.0f} % busy (other work); waiting up to {CPU_WAIT_S} s before {what}")
                told = True
            time.sleep(4)


def cpu_busy(interval=1.0):
    """The share of all CPUs' time spent busy over `interval`, in percent."""
    def read():
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = f[3] + f[4]
        return sum(f), idle
    t0, i0 = read()
    time.sleep(interval)
    t1, i1 = read()
    return 100.0 * (1 - (i1 - i0) / max(1, t1 - t0))


def rss_bytes(pid):
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_ticks(pid):
    """utime + stime of `pid`, in clock ticks (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])


def is_server(pid):
    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return os.path.basename(argv0) == b"memcached"


def describe(pids):
    names = []
    for pid in pids:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        names.append(f"{pid} {cmd[:60].strip()}")
    return "; ".join(names) or "(gone)"


# ------------------------------------------------------------------------------ node


class Node:
    def __init__(self, ctx, tag, lend_args):
        self.ctx = ctx
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.log_path = ctx.out / f"node-{tag}.log"
        self.log_file = open(self.log_path, "w")
        env = dict(os.environ, FALLOW_LOG="info")
        self.proc = PROCS.start(
            [ctx.bin, "node", "--listen", self.addr, *lend_args,
             "--secret-file", str(ctx.secret), "--client-lease", "3600"],
            stdout=subprocess.DEVNULL, stderr=self.log_file, env=env,
        )
        deadline = time.monotonic() + 30
        while "fallow node ready" not in self.log_path.read_text():
            if self.proc.poll() is not None:
                raise SystemExit(f"node exited ({self.proc.returncode}): see {self.log_path}")
            if time.monotonic() > deadline:
                raise SystemExit(f"node not ready after 30 s: see {self.log_path}")
            time.sleep(0.05)
        if ctx.governor_nice is not None:
            # An experiment: the governor thread at another nice level than the threads
            # that serve requests.
            for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
                if (task / "comm").read_text().strip() == "fallow-governor":
                    os.setpriority(os.PRIO_PROCESS, int(task.name), ctx.governor_nice)

    def stat(self):
        out = subprocess.run(
            [self.ctx.bin, "stat", "--node", self.addr, "--secret-file", str(self.ctx.secret), "--json"],
            capture_output=True, text=True, check=True,
        )
        return json.loads(out.stdout)

    def cpu_ticks(self):
        return cpu_ticks(self.proc.pid)

    def stop(self):
        PROCS.stop(self.proc)
        self.log_file.close()
        return parse_log(self.log_path)


LINE = re.compile(r"^(\S+)\s+(\w+)\s+(\S+):\s(.*)$")
FIELD = re.compile(r'(\w+)=("(?:[^"\\]|\\.)*"|\S+)')


def parse_duration(text):
    """A Rust `Duration` in Debug form (`1.2ms`, `35.1µs`, `812ns`, `2.5s`), in ns."""
    m = re.match(r"^([0-9.]+)(ns|µs|us|ms|s)$", text)
    if not m:
        return None
    scale = {"ns": 1, "µs": 1e3, "us": 1e3, "ms": 1e6, "s": 1e9}[m.group(2)]
    return float(m.group(1)) * scale


def parse_time(text):
    t = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    return int(t.timestamp()) * 1_000_000_000 + t.microsecond * 1000


def parse_log(path):
    """The governor's budget changes, each with the engine's longest lock hold."""
    changes = []
    last_engine = None
    for line in Path(path).read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if not m:
            continue
        stamp, _level, _target, rest = m.groups()
        if rest.startswith("lent budget changed"):
            fields = dict(FIELD.findall(rest))
            last_engine = {
                "longest_hold_ns": parse_duration(fields.get("longest_hold", "")),
                "engine_elapsed_ns": parse_duration(fields.get("elapsed", "")),
            }
        elif rest.startswith("lending governor lowered") or rest.startswith("lending governor raised"):
            f = dict(FIELD.findall(rest))
            num = lambda k: int(float(f[k].strip('"'))) if k in f and f[k] != "None" else 0
            t_end = parse_time(stamp)
            elapsed_ns = num("elapsed_us") * 1000
            change = {
                "t_end": t_end,
                "t_start": t_end - elapsed_ns,
                "old": num("old_bytes"),
                "new": num("new_bytes"),
                "reason": f.get("reason", "").strip('"'),
                "used": num("used_bytes"),
                "free": num("free_bytes"),
                "reserve": num("reserve_bytes"),
                "pages_dropped": num("pages_dropped"),
                "segments_released": num("segments_released"),
                "elapsed_ns": elapsed_ns,
            }
            change.update(last_engine or {"longest_hold_ns": None, "engine_elapsed_ns": None})
            last_engine = None
            changes.append(change)
    return changes


# ---------------------------------------------------------------------- load and hog


class Reader:
    """`fallow bench pages` with a warm-up; reports when the measured phase is under way."""

    def __init__(self, ctx, node, tag, keys, duration_s, timeline=True):
        self.timeline = ctx.out / f"timeline-{tag}.csv" if timeline else None
        self.json_path = ctx.out / f"reader-{tag}.json"
        argv = [ctx.bin, "bench", "pages", "--target", f"fallow://{node.addr}",
                "--secret-file", str(ctx.secret), "--workload", "get", "--keys", str(keys),
                "--warmup", "-c", "1", "-q", "1", "-b", "1", "--duration", f"{duration_s}s", "--json"]
        if self.timeline:
            argv += ["--timeline", str(self.timeline)]
        self.command = argv
        self.measuring = threading.Event()
        self.stderr = []
        self.proc = PROCS.start(argv, stdout=open(self.json_path, "w"), stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self):
        for line in self.proc.stderr:
            self.stderr.append(line.rstrip())
            if line.startswith("measure"):
                self.measuring.set()

    def wait_measuring(self, timeout=600):
        deadline = time.monotonic() + timeout
        while not self.measuring.wait(0.2):
            if self.proc.poll() is not None:
                raise SystemExit("the load generator exited early:\n" + "\n".join(self.stderr[-10:]))
            if time.monotonic() > deadline:
                raise SystemExit("the load generator's warm-up did not end in time")

    def finish(self):
        rc = self.proc.wait()
        PROCS.live.remove(self.proc)
        if rc != 0:
            raise SystemExit(f"the load generator failed ({rc}):\n" + "\n".join(self.stderr[-10:]))
        return json.loads(self.json_path.read_text())


def start_hog(ctx, nbytes, hold, passes=0, populate=False):
    argv = [sys.executable, str(Path(__file__).resolve()), "hog", "--bytes", str(nbytes),
            "--passes", str(passes)]
    if hold:
        argv.append("--hold")
    if populate:
        argv.append("--populate")
    return PROCS.start(argv, stdout=subprocess.PIPE, text=True)


def hog_event(proc, name, timeout=120):
    deadline = time.monotonic() + timeout
    for line in proc.stdout:
        ev = json.loads(line)
        if ev["event"] == name:
            return ev
        if time.monotonic() > deadline:
            break
    raise SystemExit(f"the hog did not report {name!r} (exit {proc.poll()})")


def read_timeline(path):
    rows = []
    with open(path) as f:
        next(f)
        for line in f:
            start, lat, op = line.rstrip().split(",")
            if op == "get":
                rows.append((int(start), int(lat)))
    return rows


def window_stats(rows, lo, hi):
    """Gets sent in [lo, hi): count, max, p99.9, how many took over 1 ms."""
    lats = sorted(lat for start, lat in rows if lo <= start < hi)
    if not lats:
        return {"gets": 0, "max_us": None, "p999_us": None, "p50_us": None, "over_1ms": 0}
    q = lambda p: lats[min(len(lats) - 1, int(p * len(lats)))] / 1000
    return {
        "gets": len(lats),
        "max_us": lats[-1] / 1000,
        "p999_us": q(0.999),
        "p50_us": q(0.5),
        "over_1ms": sum(1 for x in lats if x > STALL_NS),
    }


def overlapping(rows, intervals, since=0):
    """Gets sent at or after `since` and in flight during any of `intervals` (start, end)."""
    out = []
    for start, lat in rows:
        if start < since:
            continue
        end = start + lat
        if any(start < hi and end > lo for lo, hi in intervals):
            out.append(lat)
    return out


# ------------------------------------------------------------------- 1: give back 1 GiB


def give_back(ctx, mode, kind, rnd, ref=None):
    """One run: a node lending `auto` (or a fixed size: the control), filled by a QD1
    reader's warm-up; ~3 s into the reads a hog takes ctx.hog bytes and holds them.

    kind "follow": the hog writes its memory page by page (~1 GB/s), the governor follows.
    kind "step": the node is stopped (SIGSTOP) while the hog populates its memory
    (MAP_POPULATE), then continued: the governor finds the whole demand at its next tick
    and gives it back in one `set_budget`, as if the demand had arrived within one tick.

    `ref`: the auto run of the same round, whose window and shrink intervals (relative to
    the hog) the control measures at the same places."""
    tag = f"{kind}-{mode}-{rnd}"
    what = f"{kind} {mode} (round {rnd})"
    busy = ctx.quiet.wait(what)
    avail = available()
    if avail < ctx.fill + ctx.hog + MIN_AVAILABLE:
        raise SystemExit(f"MemAvailable {avail / GIB:.1f} GiB is too little: not run")
    reserve = avail - ctx.lend
    lend_args = ["--lend", "auto", "--reserve", str(reserve)] if mode == "auto" else ["--lend", str(ctx.lend)]
    node = Node(ctx, tag, lend_args)
    reader = Reader(ctx, node, tag, ctx.fill // PAGE, ctx.read_s)
    reader.wait_measuring()
    before = node.stat()
    time.sleep(2.0)
    # The governor counts the free pages on per-CPU lists as free (MemAvailable does not):
    # the hog takes that much more, so that the node must still give back ctx.hog less its
    # unfilled budget. The control takes what its auto run took.
    pcp = percpu_free()
    hog_bytes = ref["hog_bytes"] if ref else ctx.hog + min(pcp, 2 * GIB)
    if available() < hog_bytes + MIN_AVAILABLE:
        PROCS.stop(reader.proc)
        node.stop()
        raise SystemExit(f"MemAvailable {available() / GIB:.1f} GiB is too little for a "
                         f"{hog_bytes / GIB:.2f} GiB hog: not run")
    stopped = None
    if kind == "step":
        stopped = time.time_ns()
        os.kill(node.proc.pid, signal.SIGSTOP)
    hog = start_hog(ctx, hog_bytes, hold=True, populate=kind == "step")
    started = hog_event(hog, "start")["t"]
    touched = hog_event(hog, "touched")["t"]
    if kind == "step":
        time.sleep(0.1)
        resumed = time.time_ns()
        os.kill(node.proc.pid, signal.SIGCONT)
        t_ref = resumed
    else:
        resumed = None
        t_ref = started
    time.sleep(2.0)
    after = node.stat()
    hog_rss = rss_bytes(hog.pid)
    report = reader.finish()
    PROCS.stop(hog)
    changes = node.stop()
    rows = read_timeline(reader.timeline)
    shrinks = [c for c in changes if c["new"] < c["old"] and c["t_end"] >= (stopped or started)]
    r = {
        "kind": kind, "mode": mode, "round": rnd,
        "available": avail, "reserve": reserve if mode == "auto" else None,
        "hog_start": started, "hog_touched": touched, "stopped": stopped, "resumed": resumed,
        "t_ref": t_ref,
        "before": {k: before.get(k) for k in ("lent_bytes", "mapped_bytes", "pages", "process_rss_bytes", "host_available_bytes")},
        "after": {k: after.get(k) for k in ("lent_bytes", "mapped_bytes", "pages", "process_rss_bytes", "host_available_bytes", "budget_shrinks")},
        "reader": {k: report[k] for k in ("requests", "hits", "misses", "wrong", "seconds", "latency_us")},
        "shrinks": shrinks,
        "reader_command": " ".join(reader.command[1:]),
        "cpu_busy_before": busy,
        "hog_rss": hog_rss,
        "hog_bytes": hog_bytes,
        "percpu_free_before": pcp,
    }
    if mode == "auto" and before.get("host_available_bytes") and after.get("host_available_bytes"):
        # What programs other than the node and the hog took meanwhile (negative: gave).
        r["others_took"] = (before["host_available_bytes"] - after["host_available_bytes"]
                            - hog_rss + (before["mapped_bytes"] - after["mapped_bytes"]))
    released, t_gib = 0, None
    for c in shrinks:
        released += c["segments_released"] * SEGMENT
        if t_gib is None and released >= GIB:
            t_gib = c["t_end"]
    r["released_bytes"] = released
    r["set_budget_sum_ms"] = sum(c["elapsed_ns"] for c in shrinks) / 1e6
    r["set_budget_max_ms"] = max((c["elapsed_ns"] for c in shrinks), default=0) / 1e6
    r["longest_hold_ms"] = max(((c["longest_hold_ns"] or 0) for c in shrinks), default=0) / 1e6
    r["dropped_pages"] = sum(c["pages_dropped"] for c in shrinks)
    r["to_1gib_ms"] = (t_gib - t_ref) / 1e6 if t_gib else None
    r["deficit_max"] = max((c["reserve"] - c["free"] for c in shrinks), default=None)
    low = [c for c in shrinks if c["reason"] == "low-memory"]
    r["first_shortfall"] = (low[0]["reserve"] - low[0]["free"]) if low else None
    biggest = max(shrinks, key=lambda c: c["segments_released"], default=None)
    r["biggest"] = biggest and {
        "released_bytes": biggest["segments_released"] * SEGMENT,
        "pages_dropped": biggest["pages_dropped"],
        "elapsed_ms": biggest["elapsed_ns"] / 1e6,
        "longest_hold_ms": (biggest["longest_hold_ns"] or 0) / 1e6,
        "after_ref_ms": (biggest["t_end"] - t_ref) / 1e6,
    }
    if shrinks:
        r["last_shrink_ms"] = (shrinks[-1]["t_end"] - t_ref) / 1e6
    # The window measured: from the hog (follow) or the node's resumption (step) to the
    # last shrink; the control measures the auto run's window, and its shrink intervals.
    if ref is not None:
        window_ns = int(ref["window_ms"] * 1e6)
        intervals = [(t_ref + lo, t_ref + hi) for lo, hi in ref["intervals_rel"]]
    elif kind == "step":
        # The give-back at once and what follows it closely; later shrinks (if any) follow
        # other programs' use.
        top = max(shrinks, key=lambda c: c["segments_released"], default=None)
        window_ns = max(100_000_000, (top["t_end"] - t_ref + 10_000_000) if top else 0)
        intervals = [(c["t_start"], c["t_end"]) for c in shrinks]
    else:
        # From the hog's start to the last shrink that follows it (shrinks more than 200 ms
        # after the hog has its memory follow other programs).
        follow = [c for c in shrinks if c["t_end"] <= touched + 200_000_000]
        window_ns = (follow[-1]["t_end"] - t_ref + 10_000_000) if follow else touched - started
        intervals = [(c["t_start"], c["t_end"]) for c in shrinks]
    r["window_ms"] = window_ns / 1e6
    r["intervals_rel"] = [(lo - t_ref, hi - t_ref) for lo, hi in intervals]
    r["window"] = window_stats(rows, t_ref, t_ref + window_ns)
    quiet_end = stopped or started
    r["window_before"] = window_stats(rows, quiet_end - window_ns, quiet_end)
    # In a step run, the gets sent before the resumption were stalled by the stop itself.
    in_calls = overlapping(rows, intervals, since=resumed or 0)
    r["during_set_budget"] = {
        "gets": len(in_calls),
        "max_us": max(in_calls) / 1000 if in_calls else None,
        "over_1ms": sum(1 for x in in_calls if x > STALL_NS),
    }
    r["reads_before_hog_ms"] = (quiet_end - rows[0][0]) / 1e6 if rows else None
    (ctx.out / f"{tag}.json").write_text(json.dumps(r, indent=1))
    w, b, d = r["window"], r["window_before"], r["during_set_budget"]
    log(f"{what}: {len(shrinks)} shrinks, set_budget {r['set_budget_sum_ms']:.2f} ms in total, "
        f"{released / GIB:.2f} GiB released"
        + (f" (biggest: {r['biggest']['released_bytes'] / GIB:.2f} GiB in {r['biggest']['elapsed_ms']:.2f} ms)" if biggest else "")
        + f"; gets during set_budget {d['gets']}, >1 ms {d['over_1ms']}, max {fnum(d['max_us'], 0)} µs"
        f"; window {window_ns / 1e6:.0f} ms: >1 ms {w['over_1ms']} of {w['gets']} (before: {b['over_1ms']} of {b['gets']})")
    return r


def give_backs(ctx):
    """ctx.rounds rounds of each kind, auto then its control, the kinds alternating."""
    runs = []
    for rnd in range(1, ctx.rounds + 1):
        for kind in [k for k in (("step", "follow") if rnd % 2 else ("follow", "step")) if k in ctx.kinds]:
            auto = give_back(ctx, "auto", kind, rnd)
            fixed = give_back(ctx, "fixed", kind, rnd, ref=auto)
            runs += [auto, fixed]
    return runs



# ----------------------------------------------------------------------- 2: slowdown


def slowdown_run(ctx, side, i):
    busy = ctx.quiet.wait(f"slowdown run {i} ({side})")
    avail = available()
    need = ctx.slow_bytes + (ctx.fill if side == "with" else 0) + MIN_AVAILABLE
    if avail < need:
        raise SystemExit(f"MemAvailable {avail / GIB:.1f} GiB < {need / GIB:.1f} GiB needed: not run")
    node = None
    out = {"side": side, "run": i, "available": avail, "cpu_busy_before": busy}
    if side == "with":
        node = Node(ctx, f"slowdown-{i}", ["--lend", "auto", "--reserve", str(avail - ctx.lend)])
        filler = Reader(ctx, node, f"fill-{i}", ctx.fill // PAGE, 600, timeline=False)
        filler.wait_measuring()
        # Killed, not finished: a finished run destroys its pool; a killed client's pool
        # stays for the lease (3600 s), so the node keeps its pages.
        PROCS.stop(filler.proc, signal.SIGKILL)
        time.sleep(1.0)
        out["before"] = node.stat()
        cpu0 = node.cpu_ticks()
    t0 = time.monotonic()
    hog = start_hog(ctx, ctx.slow_bytes, hold=False, passes=ctx.passes)
    done = hog_event(hog, "done", timeout=600)
    hog.wait()
    PROCS.live.remove(hog)
    out["wall_s"] = time.monotonic() - t0
    out.update({k: done[k] for k in ("touch_s", "work_s", "total_s", "cpu_s")})
    if node:
        time.sleep(0.2)
        out["node_cpu_ms"] = (node.cpu_ticks() - cpu0) * 1000 / os.sysconf("SC_CLK_TCK")
        out["after"] = node.stat()
        changes = node.stop()
        t_hog = done["t"] - int(done["total_s"] * 1e9)
        shrinks = [c for c in changes if c["new"] < c["old"] and c["t_end"] >= t_hog]
        out["shrinks"] = len(shrinks)
        out["set_budget_sum_ms"] = sum(c["elapsed_ns"] for c in shrinks) / 1e6
        out["released_bytes"] = sum(c["segments_released"] for c in shrinks) * SEGMENT
    log(f"slowdown run {i} {side:>5}: wall {out['wall_s']:.3f} s (touch {out['touch_s']:.3f} s, work {out['work_s']:.3f} s)"
        + (f"; node gave back {out['released_bytes'] / GIB:.2f} GiB in {out['shrinks']} shrinks"
           f" ({out['set_budget_sum_ms']:.1f} ms of set_budget), node CPU {out['node_cpu_ms']:.0f} ms"
           if node else ""))
    return out


def munmap_cost(ctx):
    ctx.quiet.wait("the munmap cost")
    out = subprocess.run([ctx.munmap_bin], capture_output=True, text=True, check=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.strip()]
    (ctx.out / "munmap.json").write_text(json.dumps(rows, indent=1))
    log("munmap: " + ", ".join(f"{'sibling' if r['sibling'] else 'alone'} x{r['per_call']} {r['ms_per_gib']} ms/GiB" for r in rows))
    return rows


def slowdown(ctx):
    # As in the give-back runs: the program takes what the node lent plus what the per-CPU
    # lists hold now, so that the node must give back what it filled. One size for all runs.
    ctx.slow_bytes = ctx.slow + min(percpu_free(), 2 * GIB)
    runs = []
    for i in range(ctx.runs):
        order = ("alone", "with") if i % 2 == 0 else ("with", "alone")
        for side in order:
            runs.append(slowdown_run(ctx, side, i + 1))
    (ctx.out / "slowdown.json").write_text(json.dumps(runs, indent=1))
    return runs


# ---------------------------------------------------------------------------- report


def sh(cmd):
    return subprocess.run(cmd, shell=True, capture_output=True, text=True).stdout.strip()


def machine():
    return {
        "nproc": sh("nproc"),
        "cpu": sh("lscpu | grep 'Model name' | sed 's/.*: *//'"),
        "free": sh("free -g"),
        "kernel": sh("uname -r"),
        "commit": sh("git rev-parse --short HEAD"),
        "dirty": bool(sh("git status --porcelain --untracked-files=no")),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "psi": sh("head -1 /proc/pressure/memory"),
    }


def fnum(x, nd=2, unit=""):
    return "n/a" if x is None else f"{x:,.{nd}f}{unit}"


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def pick(runs, kind, mode):
    return [r for r in runs if r["kind"] == kind and r["mode"] == mode]


def gib(v, nd=2):
    return "n/a" if v is None else f"{v / GIB:.{nd}f}"


def overlap_sum(rs):
    gets = sum(r["during_set_budget"]["gets"] for r in rs)
    over = sum(r["during_set_budget"]["over_1ms"] for r in rs)
    mx = max((r["during_set_budget"]["max_us"] or 0 for r in rs), default=0)
    return gets, over, mx


def window_sum(rs, key):
    gets = sum(r[key]["gets"] for r in rs)
    over = sum(r[key]["over_1ms"] for r in rs)
    mx = max((r[key]["max_us"] or 0 for r in rs), default=0)
    return gets, over, mx


def scenario_table(add, auto, fixed, kind):
    ref = "the node's resumption" if kind == "step" else "the hog's start"
    add("| | auto | fixed (control) |")
    add("|---|---:|---:|")

    def row(name, f):
        add(f"| {name} | {f(auto) if auto else 'n/a'} | {f(fixed) if fixed else 'n/a'} |")

    row("runs", lambda rs: str(len(rs)))
    row("CPUs busy in the second before the run, median", lambda rs: f"{fnum(med(r['cpu_busy_before'] for r in rs), 0)} %")
    row("lent before → after, median (GiB)", lambda rs: f"{gib(med(r['before']['lent_bytes'] for r in rs), 3)} → {gib(med(r['after']['lent_bytes'] for r in rs), 3)}")
    row("mapped before → after, median (GiB)", lambda rs: f"{gib(med(r['before']['mapped_bytes'] for r in rs), 3)} → {gib(med(r['after']['mapped_bytes'] for r in rs), 3)}")
    row("node RSS before → after, median (GiB; auto only)", lambda rs: f"{gib(med(r['before']['process_rss_bytes'] or None for r in rs), 3)} → {gib(med(r['after']['process_rss_bytes'] or None for r in rs), 3)}")
    row("shrinks per run, median (reasons)", lambda rs: f"{fnum(med(len(r['shrinks']) for r in rs), 0)} ({', '.join(sorted({c['reason'] for r in rs for c in r['shrinks']})) or '-'})")
    row("`set_budget` time per run, summed over its shrinks: median (each run)", lambda rs: f"{fnum(med(r['set_budget_sum_ms'] for r in rs))} ms ({', '.join(fnum(r['set_budget_sum_ms']) for r in rs)})")
    row("released per run, median", lambda rs: f"{gib(med(r['released_bytes'] for r in rs))} GiB")
    row("largest single shrink: released, `set_budget` time (each run)", lambda rs: "; ".join(f"{gib(r['biggest']['released_bytes'])} GiB in {r['biggest']['elapsed_ms']:.2f} ms" for r in rs if r["biggest"] and r["biggest"]["released_bytes"]) or "-")
    row("longest store-lock hold, max over runs", lambda rs: f"{fnum(max(r['longest_hold_ms'] for r in rs), 3)} ms" if any(r["shrinks"] for r in rs) else "-")
    if kind == "step":
        row(f"from {ref} to the end of the largest shrink, median", lambda rs: f"{fnum(med(r['biggest']['after_ref_ms'] for r in rs if r['biggest']), 0)} ms" if any(r["shrinks"] for r in rs) else "-")
    else:
        row(f"from {ref} to 1 GiB released, median", lambda rs: f"{fnum(med(r['to_1gib_ms'] for r in rs), 0)} ms" if any(r["shrinks"] for r in rs) else "-")
    row(f"from {ref} to the last shrink, median", lambda rs: f"{fnum(med(r.get('last_shrink_ms') for r in rs), 0)} ms" if any(r["shrinks"] for r in rs) else "-")
    row("memory other programs took meanwhile, median (auto only: MemAvailable drop − hog RSS + mapped bytes released)",
        lambda rs: f"{fnum(med(r.get('others_took') for r in rs) and med(r.get('others_took') for r in rs) / MIB, 0)} MiB")
    row("free pages on per-CPU lists before the hog, median", lambda rs: f"{gib(med(r['percpu_free_before'] for r in rs))} GiB")
    row("hog size, median", lambda rs: f"{gib(med(r['hog_bytes'] for r in rs))} GiB")
    row("hog's own time to take its memory, median", lambda rs: f"{med((r['hog_touched'] - r['hog_start']) / 1e6 for r in rs):.0f} ms")
    row("shortfall below the reserve at the first low-memory shrink → released, each run (GiB)",
        lambda rs: ", ".join(f"{gib(r['first_shortfall'])} → {gib(r['released_bytes'])}" for r in rs if r["first_shortfall"] is not None) or "-")
    row("deepest dip of free memory below the reserve seen by a shrink, median", lambda rs: f"{fnum(med(r['deficit_max'] for r in rs) and med(r['deficit_max'] for r in rs) / MIB, 0)} MiB" if any(r["shrinks"] for r in rs) else "-")

    def ov(rs):
        g, o, m = overlap_sum(rs)
        return f"{g:,} gets, {o} over 1 ms, slowest {m / 1000:.2f} ms"

    row("gets in flight during a `set_budget` (control: during the auto run's intervals, same offsets)", ov)
    for key, name in (("window_before", "window before the hog, same length"), ("window", f"window from {ref} to the last shrink")):
        def wf(rs, key=key):
            g, o, m = window_sum(rs, key)
            return f"{g:,} gets, {o} over 1 ms ({o / max(g, 1) * 100:.2f} %), slowest {m / 1000:.2f} ms, p99.9 median {fnum(med(r[key]['p999_us'] for r in rs), 0)} µs"
        row(f"{name} (median {fnum(med(r['window_ms'] for r in auto), 0)} ms), all runs", wf)
    row("reader, whole run: p50 / p99.9 / max, medians (µs)", lambda rs: f"{med(r['reader']['latency_us']['p50'] for r in rs):.1f} / {med(r['reader']['latency_us']['p999'] for r in rs):.0f} / {med(r['reader']['latency_us']['max'] for r in rs):.0f}")
    row("reader: hits / misses / wrong, all runs", lambda rs: f"{sum(r['reader']['hits'] for r in rs):,} / {sum(r['reader']['misses'] for r in rs):,} / {sum(r['reader']['wrong'] for r in rs)}")


def section(ctx, m, gb, runs, mm, load):
    L = []
    add = L.append
    add(MARK_START)
    add("## Lending governor (issue: give back 1 GiB; slowdown of a memory-hungry program)")
    add("")
    add(f"**Command:** `{ctx.command}` (commit `{m['commit']}`{', with uncommitted changes' if m['dirty'] else ''}, "
        f"{m['date']}). It builds `target/release/fallow`, runs `bench/governor.py` and writes "
        "this section; raw logs, latency timelines and JSON go to `bench/out/governor-<date>/`.")
    add("")
    add(f"**Machine:** {m['cpu']}, {m['nproc']} CPUs, kernel {m['kernel']}; load average "
        f"{load[0]} at the start, {load[1]} at the end (the machine is shared: other engineers' "
        f"builds and tests ran too). Memory PSI at the end: `{m['psi']}`.")
    add("")
    add("```text")
    add(m["free"])
    add("```")
    add("")
    step_a, step_f = pick(gb, "step", "auto"), pick(gb, "step", "fixed")
    fol_a, fol_f = pick(gb, "follow", "auto"), pick(gb, "follow", "fixed")
    add("### Against the targets")
    add("")
    add("| target | measured | met? |")
    add("|---|---|---|")
    if step_a:
        big = [r["biggest"] for r in step_a if r["biggest"]]
        ms = med(b["elapsed_ms"] for b in big)
        rel = med(b["released_bytes"] for b in big)
        per = med(b["elapsed_ms"] / (b["released_bytes"] / GIB) for b in big if b["released_bytes"])
        ok = per is not None and per <= 10
        add(f"| give back 1 GiB ≤ 10 ms | **at once** (scenario 1a): one `set_budget` released a median "
            f"{gib(rel)} GiB in a median {fnum(ms)} ms, **{fnum(per)} ms per GiB** (each run: "
            + ", ".join(f"{gib(b['released_bytes'])} GiB in {b['elapsed_ms']:.2f} ms" for b in big)
            + f"), ending {fnum(med(b['after_ref_ms'] for b in big), 0)} ms after the node resumed. "
            + (f"**Following a growing demand** (1b): {fnum(med(len(r['shrinks']) for r in fol_a), 0)} shrinks, one per tick, "
               f"{fnum(med(r['set_budget_sum_ms'] for r in fol_a))} ms of `set_budget` in total for "
               f"{gib(med(r['released_bytes'] for r in fol_a))} GiB; 1 GiB was back "
               f"{fnum(med(r['to_1gib_ms'] for r in fol_a), 0)} ms after the hog started (the hog took "
               f"{med((r['hog_touched'] - r['hog_start']) / 1e6 for r in fol_a):.0f} ms to write its memory)" if fol_a else "")
            + f" | {'met' if ok else '**not met**'} |")
    gb_auto = step_a + fol_a
    gb_ctrl = step_f + fol_f
    if gb_auto:
        g, o, mx = overlap_sum(gb_auto)
        cg, co, cmx = overlap_sum(gb_ctrl)
        sg, so, smx = overlap_sum(step_a)
        add(f"| no get stalled > 1 ms | gets in flight during a `set_budget`: {o} of {g:,} over 1 ms "
            f"(slowest {mx / 1000:.2f} ms), of which {so} of {sg} in the 1 GiB-at-once shrinks; the control "
            f"(fixed lend, same hog, same time intervals): {co} of {cg:,} over 1 ms (slowest {cmx / 1000:.2f} ms) | "
            f"{'met' if o == 0 else '**not met**'} |")
    if runs:
        alone = [r["wall_s"] for r in runs if r["side"] == "alone"]
        withn = [r["wall_s"] for r in runs if r["side"] == "with"]
        ratio = statistics.median(withn) / statistics.median(alone)
        pair = sorted(w["wall_s"] / a["wall_s"] for w in runs for a in runs
                      if w["side"] == "with" and a["side"] == "alone" and w["run"] == a["run"])
        noisy = pair and (pair[-1] - pair[0]) > 0.04
        verdict = "met" if ratio <= 1.02 else "**not met**"
        if noisy:
            verdict += " by the medians, but within this machine's noise: not resolved"
        add(f"| memory-hungry program slowed ≤ 2 % | median {statistics.median(withn):.3f} s with a filled "
            f"`auto` node vs {statistics.median(alone):.3f} s without: ×{ratio:.3f} "
            f"({(ratio - 1) * 100:+.1f} %); the pairs of runs range from ×{pair[0]:.2f} to ×{pair[-1]:.2f} "
            f"(median ×{statistics.median(pair):.3f}) | {verdict} |")
    add("")
    if step_a:
        big = [r["biggest"] for r in step_a if r["biggest"] and r["biggest"]["released_bytes"]]
        per_gib = med(b["elapsed_ms"] / (b["released_bytes"] / GIB) for b in big)
        hold = max((r["longest_hold_ms"] for r in step_a + fol_a), default=0)
        cost = {(r["sibling"], r["per_call"]): r["ms_per_gib"] for r in mm}
        add("**Why.** " + (
            f"Giving back costs {fnum(per_gib)} ms per GiB in one `set_budget` here (median). Little of it "
            f"is under the store lock (the longest step under it, waiting for it included, took {fnum(hold, 3)} ms "
            "in all runs): most is the kernel's `munmap`, which the engine does after releasing the lock, "
            "one call per extent of 8 adjacent 2 MiB segments (since 2026-11-22; one call per segment "
            "before). " if per_gib else "")
            + (f"On this machine unmapping one segment per call costs {fnum(cost.get((False, 1)))} ms/GiB, and "
               f"{fnum(cost.get((True, 1)))} ms/GiB when another thread of the process is running on the other "
               "CPU (each call is a TLB shootdown: an inter-processor interrupt, costly in a VM); 8 adjacent "
               f"segments per call, as the engine now does, cost {fnum(cost.get((False, 8)))} / "
               f"{fnum(cost.get((True, 8)))} ms/GiB (section 3). " if cost else "")
            + "The gets slowed past 1 ms during a shrink are not waiting for the lock either: while the "
            "governor thread spends those milliseconds in the kernel, it holds one of the two CPUs that the "
            "node's runtime threads, the reader and the hog (and, on this shared machine, other people's "
            "builds) compete for, and its shootdowns interrupt the other one; the control runs, with the "
            "same hog and no shrink, show how many slow gets the machine produces by itself.")
        add("")
    if gb:
        r0 = gb[0]
        add("### 1. Giving back while a client reads")
        add("")
        add(f"Each run: a node with `--lend auto --reserve <MemAvailable − {gib(ctx.lend)} GiB>` (so it lends "
            f"{gib(ctx.lend)} GiB; e.g. `--reserve {gib(r0['reserve'])}GiB` at MemAvailable {gib(r0['available'])} GiB), "
            f"and a QD1 reader, `fallow {r0['reader_command'].replace(str(ctx.secret), 'SECRET')}` (the timeline file "
            f"varies), whose warm-up puts {gib(ctx.fill)} GiB of pages; about {fnum(med(r['reads_before_hog_ms'] for r in gb) / 1000, 1)} s "
            f"into the reads a hog takes {gib(ctx.hog)} GiB plus what the kernel's per-CPU free lists hold at that "
            "moment (the governor counts those pages as free; MemAvailable leaves them out) and holds it, so the "
            f"node must give back ≈ {gib(ctx.hog - (ctx.lend - ctx.fill))} GiB (the rest of the demand is "
            "lent-but-unfilled budget), give or take what other programs do meanwhile. "
            f"Each auto run is followed by its control: the same with `--lend {gib(ctx.lend)}GiB` fixed (nothing "
            f"given back), measured over the same windows and at the same offsets. {ctx.rounds} rounds, "
            "the scenarios alternating. Gets that miss (their page was given back) count like hits. "
            "The governor counts the free pages on the kernel's per-CPU lists as free when it shrinks "
            "(docs/governor.md): reading `MemAvailable` alone it took the memory it had just unmapped, parked on "
            "those lists, for more demand, and gave back everything it held, whatever the shortfall.")
        add("")
        if step_a:
            add("**1a. 1 GiB at once.** The node is stopped (SIGSTOP) while the hog maps its memory with "
                "`MAP_POPULATE`, then continued 100 ms later: the governor finds the whole demand at its next tick, "
                "as if it had arrived within one tick. The reader's gets are stalled by the stop itself; the windows "
                "below start at the resumption.")
            add("")
            scenario_table(add, step_a, step_f, "step")
            add("")
            add("The shrinks of each auto run (time from the resumption, reason, MiB released, pages dropped, "
                "`set_budget` ms, longest lock hold ms):")
            add("")
            for r in step_a:
                add(f"* round {r['round']}: " + "; ".join(
                    f"{(c['t_end'] - r['t_ref']) / 1e6:.0f} ms {c['reason']} {c['segments_released'] * 2} MiB "
                    f"{c['pages_dropped']:,} p {c['elapsed_ns'] / 1e6:.2f} ms hold {fnum((c['longest_hold_ns'] or 0) / 1e6, 3)}"
                    for c in r["shrinks"]))
            add("")
        if fol_a:
            add("**1b. Following a growing demand.** The hog writes its memory page by page (about 1 GB/s); the "
                "governor follows it tick by tick: `host-use` shrinks while the reserve is still free, then "
                "`low-memory` shrinks that restore it.")
            add("")
            scenario_table(add, fol_a, fol_f, "follow")
            add("")
            sh = [c for r in fol_a for c in r["shrinks"] if c["segments_released"]]
            if sh:
                add(f"Shrinks that released memory, all auto runs: {len(sh)}, each "
                    f"{min(c['segments_released'] for c in sh) * 2}–{max(c['segments_released'] for c in sh) * 2} MiB in "
                    f"{min(c['elapsed_ns'] for c in sh) / 1e6:.2f}–{max(c['elapsed_ns'] for c in sh) / 1e6:.2f} ms "
                    f"(median {statistics.median(c['elapsed_ns'] for c in sh) / 1e6:.2f} ms); "
                    f"`set_budget` per GiB released, median over runs: "
                    f"{fnum(med(r['set_budget_sum_ms'] / (r['released_bytes'] / GIB) for r in fol_a if r['released_bytes']))} ms.")
                add("")
    if runs:
        add("### 2. Slowdown of a memory-hungry program")
        add("")
        add(f"The program (`python3 bench/governor.py hog --bytes {ctx.slow_bytes} --passes {ctx.passes}`) maps "
            f"{gib(ctx.slow_bytes)} GiB ({gib(ctx.slow)} GiB, what the node lends, plus the {gib(ctx.slow_bytes - ctx.slow)} GiB "
            f"of free pages on per-CPU lists at the start, which the governor counts as free), writes every page, then makes {ctx.passes} passes of CRC-32 + rewrite "
            f"over it; timed by wall clock, {ctx.runs} times alone and {ctx.runs} times next to a node "
            f"(`--lend auto --reserve <MemAvailable − {gib(ctx.lend)} GiB>`) filled with {gib(ctx.fill)} GiB of "
            "pages and otherwise idle (its client is killed after the warm-up; the pool outlives it), alternating which "
            "goes first. The program's memory is what the node lent, so the node gives it back while the program "
            "runs. (The host has far more memory than this, so without a node the program would not have had to "
            "wait for anything: this measures what the governor's giving back costs the program, not what it "
            "saves on a full host.)")
        add("")
        add("| | alone | with a filled `auto` node | ratio |")
        add("|---|---:|---:|---:|")
        for key, name in (("wall_s", "wall clock, median (s)"), ("touch_s", "allocate + write, median (s)"),
                          ("work_s", "work passes, median (s)"), ("cpu_s", "its CPU time (user + system), median (s)")):
            al = statistics.median(r[key] for r in runs if r["side"] == "alone")
            wi = statistics.median(r[key] for r in runs if r["side"] == "with")
            add(f"| {name} | {al:.3f} | {wi:.3f} | ×{wi / al:.3f} |")
        al = sorted(r["wall_s"] for r in runs if r["side"] == "alone")
        wi = sorted(r["wall_s"] for r in runs if r["side"] == "with")
        add(f"| wall clock, min–max (s) | {al[0]:.3f}–{al[-1]:.3f} | {wi[0]:.3f}–{wi[-1]:.3f} | |")
        w = [r for r in runs if r["side"] == "with"]
        add(f"| node: released during the program, median | | {gib(med(r['released_bytes'] for r in w))} GiB in "
            f"{fnum(med(r['shrinks'] for r in w), 0)} shrinks, {fnum(med(r['set_budget_sum_ms'] for r in w), 1)} ms of `set_budget` | |")
        add(f"| node: CPU time during the program, median | | {fnum(med(r['node_cpu_ms'] for r in w), 0)} ms | |")
        add("")
        pairs = [(w["wall_s"], a["wall_s"]) for w in runs for a in runs
                 if w["side"] == "with" and a["side"] == "alone" and w["run"] == a["run"]]
        if pairs:
            ratios = sorted(w / a for w, a in pairs)
            add(f"Wall-clock ratio within each pair of runs (with / alone, run back to back): median "
                f"×{statistics.median(ratios):.3f}, from ×{ratios[0]:.3f} to ×{ratios[-1]:.3f}.")
            add("")
        add("Per run (s), in the order run: " + ", ".join(f"{r['side']} {r['wall_s']:.3f}" for r in runs) + ".")
        add("")
    if mm:
        cost = {(r["sibling"], r["per_call"]): r["ms_per_gib"] for r in mm}
        add("### 3. What unmapping costs on this machine")
        add("")
        add("`target/munmap_cost` (`bench/munmap_cost.rs`) maps 1 GiB as 512 adjacent 2 MiB-aligned "
            "`MADV_HUGEPAGE` segments, faults them in, and unmaps them: one segment per `munmap` (as the "
            "engine's `set_budget` does) or several adjacent ones per call; alone, and with a second thread "
            "of the process running on the other CPU (as a node's runtime threads do while they serve), "
            "which turns every `munmap` into a TLB shootdown. Milliseconds per GiB, median of 5:")
        add("")
        add("| segments per `munmap` | alone | with a running sibling thread |")
        add("|---:|---:|---:|")
        for per in sorted({r["per_call"] for r in mm}):
            add(f"| {per} | {fnum(cost.get((False, per)))} | {fnum(cost.get((True, per)))} |")
        add("")
    notes = list(ctx.notes)
    if notes:
        add("### Notes")
        add("")
        for n in notes:
            add(f"* {n}")
        add("")
    add(MARK_END)
    return "\n".join(L) + "\n"



def write_section(text, path=RUNS_DOC):
    p = Path(path)
    doc = p.read_text() if p.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(MARK_START) + r".*?" + re.escape(MARK_END) + r"\n?", re.S)
    if pattern.search(doc):
        doc = pattern.sub(lambda _: text, doc, count=1)
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    p.write_text(doc)


# ------------------------------------------------------------------------------ main


class Ctx:
    pass


# What section() needs of the context, saved with the results for --render.
SAVED_CTX = ("command", "runs", "rounds", "lend", "fill", "hog", "slow", "slow_bytes", "passes",
             "read_s", "notes", "secret")


def render(directory, no_write):
    """Writes the section again from a run's saved results (after a change of wording)."""
    results = json.loads((Path(directory) / "results.json").read_text())
    ctx = Ctx()
    for k, v in results["ctx"].items():
        setattr(ctx, k, v)
    ctx.secret = Path(ctx.secret)
    text = section(ctx, results["machine"], results["giveback"], results["slowdown"],
                   results["munmap"], results["load"])
    print(text)
    if not no_write:
        write_section(text)
        log(f"wrote the section into {RUNS_DOC}")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd")
    h = sub.add_parser("hog")
    h.add_argument("--bytes", type=int, required=True)
    h.add_argument("--passes", type=int, default=2)
    h.add_argument("--hold", action="store_true")
    h.add_argument("--populate", action="store_true")
    ap.add_argument("--fallow-bin", default="target/release/fallow")
    ap.add_argument("--munmap-bin", default="target/munmap_cost")
    ap.add_argument("--command", default="bash bench/governor.sh")
    ap.add_argument("--runs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lend-gib", type=float, default=1.5)
    ap.add_argument("--fill-gib", type=float, default=1.25)
    ap.add_argument("--hog-gib", type=float, default=1.375)
    ap.add_argument("--slow-gib", type=float, default=None)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--read-s", type=float, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--render", metavar="DIR", help="write the section again from DIR/results.json")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--skip", choices=["giveback", "slowdown"], action="append", default=[])
    ap.add_argument("--kinds", default="step,follow", help="give-back scenarios to run")
    ap.add_argument("--governor-nice", type=int, default=None,
                    help="an experiment: renice the node's governor thread to this level")
    args = ap.parse_args()
    if args.cmd == "hog":
        return hog(args)
    if args.render:
        return render(args.render, args.no_write)

    def terminate(signum, _frame):
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    if args.quick:
        args.runs, args.rounds, args.lend_gib, args.fill_gib, args.hog_gib, args.read_s = 2, 1, 0.375, 0.25, 0.3125, 8
    ctx = Ctx()
    ctx.bin = args.fallow_bin
    ctx.munmap_bin = args.munmap_bin
    ctx.command = args.command.strip()
    ctx.runs = args.runs
    ctx.rounds = args.rounds
    ctx.kinds = args.kinds.split(",")
    ctx.governor_nice = args.governor_nice
    if ctx.governor_nice is not None:
        ctx.command += f"  (governor thread reniced to {ctx.governor_nice})"
    ctx.lend = int(args.lend_gib * GIB) // SEGMENT * SEGMENT
    ctx.fill = int(args.fill_gib * GIB)
    ctx.hog = int(args.hog_gib * GIB)
    ctx.slow = int((args.slow_gib or args.lend_gib) * GIB)
    ctx.passes = args.passes
    ctx.read_s = args.read_s
    ctx.quiet = Quiet()
    stamp = time.strftime("%Y-%m-%d-%H%M%S")
    ctx.out = Path("bench/out") / f"governor-{stamp}"
    ctx.out.mkdir(parents=True, exist_ok=True)
    ctx.secret = ctx.out / "secret"
    ctx.secret.write_text(os.urandom(24).hex() + "\n")
    ctx.secret.chmod(0o600)
    log(f"results in {ctx.out}")
    try:
        load0 = Path("/proc/loadavg").read_text().split()[0]
        gb, runs = [], []
        if "giveback" not in args.skip:
            gb = give_backs(ctx)
        if "slowdown" not in args.skip:
            runs = slowdown(ctx)
        mm = munmap_cost(ctx) if Path(ctx.munmap_bin).exists() else []
        load1 = Path("/proc/loadavg").read_text().split()[0]
        ctx.notes = ctx.quiet.notes
        if args.quick:
            ctx.notes.append("--quick: small sizes, not numbers to publish")
        saved = {k: getattr(ctx, k) for k in SAVED_CTX if hasattr(ctx, k)}
        results = {"ctx": saved, "machine": machine(), "giveback": gb, "slowdown": runs,
                   "munmap": mm, "load": [load0, load1]}
        (ctx.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
        text = section(ctx, results["machine"], gb, runs, mm, (load0, load1))
        (ctx.out / "section.md").write_text(text)
        print(text)
        if not args.no_write and not args.quick:
            write_section(text)
            log(f"wrote the section into {RUNS_DOC}")
    finally:
        PROCS.stop_all()


if __name__ == "__main__":
    sys.exit(main())
