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
STALL_NS = 1_000_000
MARK_START = "<!-- governor:start -->"
MARK_END = "<!-- governor:end -->"


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
    print(
        json.dumps(
            {
                "event": "done",
                "t": t2,
                "touch_s": (t1 - t0) / 1e9,
                "work_s": (t2 - t1) / 1e9,
                "total_s": (t2 - t0) / 1e9,
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
        start = time.monotonic()
        told = False
        while True:
            others = self.others()
            if not others:
                if told:
                    log(f"quiet after {time.monotonic() - start:.0f} s")
                return
            if time.monotonic() - start >= QUIET_LIMIT_S:
                desc = describe(others)
                log(f"gave up waiting after 15 min; {what} runs alongside: {desc}")
                self.notes.append(f"{what}: ran alongside other benchmarks after a 15 min wait ({desc})")
                return
            if not told:
                log(f"waiting for other benchmarks to end before {what}: {describe(others)}")
                told = True
            time.sleep(QUIET_POLL_S)


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


def start_hog(ctx, nbytes, hold, passes=0):
    argv = [sys.executable, str(Path(__file__).resolve()), "hog", "--bytes", str(nbytes),
            "--passes", str(passes)]
    if hold:
        argv.append("--hold")
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


def overlapping(rows, intervals):
    """Gets in flight during any of `intervals` (start, end)."""
    out = []
    for start, lat in rows:
        end = start + lat
        if any(start < hi and end > lo for lo, hi in intervals):
            out.append(lat)
    return out


# ------------------------------------------------------------------- 1: give back 1 GiB


def give_back(ctx, mode, window_ns=None):
    """One run: a node lending `auto` (or a fixed size, the control), filled, read at QD1,
    and a hog starting ~3 s into the reads."""
    tag = f"giveback-{mode}"
    ctx.quiet.wait(f"give-back ({mode})")
    avail = available()
    need = ctx.fill + ctx.hog + MIN_AVAILABLE
    if avail < need:
        raise SystemExit(f"MemAvailable {avail / GIB:.1f} GiB < {need / GIB:.1f} GiB needed: not run")
    reserve = avail - ctx.lend
    lend_args = ["--lend", "auto", "--reserve", str(reserve)] if mode == "auto" else ["--lend", str(ctx.lend)]
    log(f"give-back ({mode}): MemAvailable {avail / GIB:.2f} GiB, "
        + (f"reserve {reserve / GIB:.2f} GiB" if mode == "auto" else f"fixed lend {ctx.lend / GIB:.2f} GiB"))
    node = Node(ctx, tag, lend_args)
    keys = ctx.fill // PAGE
    reader = Reader(ctx, node, tag, keys, ctx.read_s)
    log(f"give-back ({mode}): warm-up puts {keys} pages ({ctx.fill / GIB:.2f} GiB)")
    reader.wait_measuring()
    before = node.stat()
    log(f"give-back ({mode}): reading at QD1; mapped {before['mapped_bytes'] / GIB:.3f} GiB, "
        f"lent {before['lent_bytes'] / GIB:.3f} GiB; hog of {ctx.hog / GIB:.2f} GiB in 2 s")
    time.sleep(2.0)
    hog = start_hog(ctx, ctx.hog, hold=True)
    started = hog_event(hog, "start")["t"]
    touched = hog_event(hog, "touched")["t"]
    log(f"give-back ({mode}): hog touched its memory in {(touched - started) / 1e6:.0f} ms")
    time.sleep(2.0)
    after = node.stat()
    report = reader.finish()
    PROCS.stop(hog)
    changes = node.stop()
    rows = read_timeline(reader.timeline)
    shrinks = [c for c in changes if c["new"] < c["old"] and c["t_end"] >= started]
    result = {
        "mode": mode,
        "available": avail,
        "reserve": reserve if mode == "auto" else None,
        "hog_start": started,
        "hog_touched": touched,
        "before": {k: before.get(k) for k in ("lent_bytes", "mapped_bytes", "pages", "process_rss_bytes", "host_available_bytes")},
        "after": {k: after.get(k) for k in ("lent_bytes", "mapped_bytes", "pages", "process_rss_bytes", "host_available_bytes", "budget_shrinks")},
        "reader": {k: report[k] for k in ("requests", "hits", "misses", "wrong", "seconds", "latency_us")},
        "shrinks": shrinks,
        "reader_command": " ".join(reader.command[1:]),
    }
    if shrinks:
        released = 0
        t_gib = None
        for c in shrinks:
            released += c["segments_released"] * SEGMENT
            if t_gib is None and released >= GIB:
                t_gib = c["t_end"]
        first_budget = shrinks[0]["old"]
        t_budget_gib = next((c["t_end"] for c in shrinks if first_budget - c["new"] >= GIB), None)
        result.update({
            "set_budget_sum_ms": sum(c["elapsed_ns"] for c in shrinks) / 1e6,
            "set_budget_max_ms": max(c["elapsed_ns"] for c in shrinks) / 1e6,
            "longest_hold_ms": max((c["longest_hold_ns"] or 0) for c in shrinks) / 1e6,
            "released_bytes": released,
            "dropped_pages": sum(c["pages_dropped"] for c in shrinks),
            "wall_to_1gib_released_ms": (t_gib - started) / 1e6 if t_gib else None,
            "wall_to_budget_minus_1gib_ms": (t_budget_gib - started) / 1e6 if t_budget_gib else None,
            "last_shrink_after_touched_ms": (shrinks[-1]["t_end"] - touched) / 1e6,
            "episode_ms": (shrinks[-1]["t_end"] - started) / 1e6,
            "reasons": sorted({c["reason"] for c in shrinks}),
        })
        window_ns = window_ns or (shrinks[-1]["t_end"] - started + 10_000_000)
        in_calls = overlapping(rows, [(c["t_start"], c["t_end"]) for c in shrinks])
        result["during_set_budget"] = {
            "gets": len(in_calls),
            "max_us": max(in_calls) / 1000 if in_calls else None,
            "over_1ms": sum(1 for x in in_calls if x > STALL_NS),
        }
    window_ns = window_ns or 1_000_000_000
    result["window_ms"] = window_ns / 1e6
    result["window"] = window_stats(rows, started, started + window_ns)
    result["window_before"] = window_stats(rows, started - window_ns, started)
    first = rows[0][0] if rows else started
    result["before_available_ms"] = (started - first) / 1e6
    (ctx.out / f"{tag}.json").write_text(json.dumps(result, indent=1))
    w, b = result["window"], result["window_before"]
    log(f"give-back ({mode}): {len(shrinks)} shrinks"
        + (f", set_budget {result['set_budget_sum_ms']:.2f} ms in total, {result['released_bytes'] / GIB:.2f} GiB released"
           if shrinks else "")
        + f"; window {window_ns / 1e6:.0f} ms: max {w['max_us']} µs, >1 ms {w['over_1ms']}"
        f" (before: max {b['max_us']} µs, >1 ms {b['over_1ms']})")
    return result


# ----------------------------------------------------------------------- 2: slowdown


def slowdown_run(ctx, side, i):
    ctx.quiet.wait(f"slowdown run {i} ({side})")
    avail = available()
    need = ctx.slow + (ctx.fill if side == "with" else 0) + MIN_AVAILABLE
    if avail < need:
        raise SystemExit(f"MemAvailable {avail / GIB:.1f} GiB < {need / GIB:.1f} GiB needed: not run")
    node = None
    out = {"side": side, "run": i, "available": avail}
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
    hog = start_hog(ctx, ctx.slow, hold=False, passes=ctx.passes)
    done = hog_event(hog, "done", timeout=600)
    hog.wait()
    PROCS.live.remove(hog)
    out["wall_s"] = time.monotonic() - t0
    out.update({k: done[k] for k in ("touch_s", "work_s", "total_s")})
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


def slowdown(ctx):
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


def section(ctx, m, a, c, runs, load):
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
        f"{load[0]} at the start, {load[1]} at the end (the machine is shared). Memory PSI at the end: "
        f"`{m['psi']}`.")
    add("")
    add("```text")
    add(m["free"])
    add("```")
    add("")
    add("### Against the targets")
    add("")
    add("| target | measured | met? |")
    add("|---|---|---|")
    if a.get("shrinks"):
        gib_ok = a["set_budget_sum_ms"] <= 10 and a["released_bytes"] >= GIB
        add(f"| give back 1 GiB ≤ 10 ms | `set_budget` took {fnum(a['set_budget_sum_ms'])} ms in total "
            f"({len(a['shrinks'])} shrinks, longest {fnum(a['set_budget_max_ms'])} ms, longest store-lock hold "
            f"{fnum(a['longest_hold_ms'], 3)} ms) to release {fnum(a['released_bytes'] / GIB)} GiB; in wall time, "
            f"{fnum(a['wall_to_1gib_released_ms'], 0)} ms from the hog's start to 1 GiB released, the last shrink "
            f"{fnum(a['last_shrink_after_touched_ms'], 0)} ms after the hog finished touching "
            f"(it took {(a['hog_touched'] - a['hog_start']) / 1e6:.0f} ms) | "
            f"{'met' if gib_ok else '**not met**'} for the work of giving back; the wall time follows the hog |")
        d = a["during_set_budget"]
        w, b, cw = a["window"], a["window_before"], c["window"] if c else None
        stall_ok = d["over_1ms"] == 0
        add(f"| no get stalled > 1 ms | gets in flight during a `set_budget`: {d['gets']}, slowest "
            f"{fnum(d['max_us'], 0)} µs, {d['over_1ms']} over 1 ms. Over the whole episode "
            f"({a['window_ms']:.0f} ms from the hog's start): {w['over_1ms']} gets over 1 ms of {w['gets']} "
            f"(equal window before: {b['over_1ms']} of {b['gets']}"
            + (f"; fixed-lend control with the same hog: {cw['over_1ms']} of {cw['gets']}" if cw else "")
            + ") | " + ("met" if stall_ok else "**not met**") + " by the gets that overlapped a shrink |")
    else:
        add("| give back 1 GiB ≤ 10 ms | no shrink was logged | **not measured** |")
    if runs:
        alone = [r["wall_s"] for r in runs if r["side"] == "alone"]
        withn = [r["wall_s"] for r in runs if r["side"] == "with"]
        ratio = statistics.median(withn) / statistics.median(alone)
        add(f"| memory-hungry program slowed ≤ 2 % | median {statistics.median(withn):.3f} s with a filled "
            f"`auto` node vs {statistics.median(alone):.3f} s without: ×{ratio:.3f} "
            f"({(ratio - 1) * 100:+.1f} %) | {'met' if ratio <= 1.02 else '**not met**'} |")
    add("")
    add("### 1. Giving back while a client reads")
    add("")
    if a:
        add(f"A node (`--lend auto --reserve {a['reserve'] / GIB:.2f}GiB`, MemAvailable was "
            f"{a['available'] / GIB:.2f} GiB, so it lends {ctx.lend / GIB:.2f} GiB), a QD1 reader "
            f"(`fallow {a['reader_command'].replace(str(ctx.secret), 'SECRET')}`) whose warm-up puts "
            f"{ctx.fill / GIB:.2f} GiB of pages; {a['before_available_ms'] / 1000:.1f} s into the reads a hog "
            f"writes {ctx.hog / GIB:.2f} GiB and holds it. The control is the same with `--lend "
            f"{ctx.lend / GIB:.2f}GiB` fixed: the same hog, nothing given back.")
        add("")
        add("| | auto | fixed (control) |")
        add("|---|---:|---:|")
        row = lambda name, f: add(f"| {name} | {f(a)} | {f(c) if c else 'n/a'} |")
        row("lent before → after", lambda r: f"{r['before']['lent_bytes'] / GIB:.3f} → {r['after']['lent_bytes'] / GIB:.3f} GiB")
        row("mapped before → after", lambda r: f"{r['before']['mapped_bytes'] / GIB:.3f} → {r['after']['mapped_bytes'] / GIB:.3f} GiB")
        row("node RSS before → after", lambda r: f"{(r['before']['process_rss_bytes'] or 0) / GIB:.3f} → {(r['after']['process_rss_bytes'] or 0) / GIB:.3f} GiB")
        row("shrinks (reasons)", lambda r: f"{len(r['shrinks'])} ({', '.join(r.get('reasons', [])) or '-'})")
        row("`set_budget` total / longest", lambda r: f"{fnum(r.get('set_budget_sum_ms'))} / {fnum(r.get('set_budget_max_ms'))} ms" if r.get("shrinks") else "-")
        row("longest store-lock hold", lambda r: f"{fnum(r.get('longest_hold_ms'), 3)} ms" if r.get("shrinks") else "-")
        row("pages dropped, segments released", lambda r: f"{r.get('dropped_pages', 0):,}, {r.get('released_bytes', 0) // SEGMENT:,}")
        row("hog start → 1 GiB released", lambda r: f"{fnum(r.get('wall_to_1gib_released_ms'), 0)} ms" if r.get("shrinks") else "-")
        row("hog start → budget 1 GiB lower", lambda r: f"{fnum(r.get('wall_to_budget_minus_1gib_ms'), 0)} ms" if r.get("shrinks") else "-")
        row("hog's own time to touch its memory", lambda r: f"{(r['hog_touched'] - r['hog_start']) / 1e6:.0f} ms")
        row("hog touched → last shrink", lambda r: f"{fnum(r.get('last_shrink_after_touched_ms'), 0)} ms" if r.get("shrinks") else "-")
        row("reader, whole run: gets, p50 / p99.9 / max", lambda r: f"{r['reader']['requests']:,}, {r['reader']['latency_us']['p50']:.1f} / {r['reader']['latency_us']['p999']:.0f} / {r['reader']['latency_us']['max']:.0f} µs")
        row("reader, hits / misses / wrong", lambda r: f"{r['reader']['hits']:,} / {r['reader']['misses']:,} / {r['reader']['wrong']}")
        for key, name in (("window_before", "equal window before the hog"), ("window", "window from the hog's start")):
            row(f"{name} ({a['window_ms']:.0f} ms): gets, p50 / p99.9 / max",
                lambda r, key=key: f"{r[key]['gets']:,}, {fnum(r[key]['p50_us'], 1)} / {fnum(r[key]['p999_us'], 0)} / {fnum(r[key]['max_us'], 0)} µs")
            row(f"{name}: gets over 1 ms", lambda r, key=key: f"{r[key]['over_1ms']}")
        row("gets in flight during a `set_budget`: count, max, > 1 ms",
            lambda r: f"{r['during_set_budget']['gets']}, {fnum(r['during_set_budget']['max_us'], 0)} µs, {r['during_set_budget']['over_1ms']}" if r.get("during_set_budget") else "-")
        add("")
        if a.get("shrinks"):
            add("The shrinks (auto run), times from the hog's start:")
            add("")
            add("| at (ms) | reason | budget before → after (MiB) | pages dropped | segments released | `set_budget` (ms) | longest hold (ms) |")
            add("|---:|---|---|---:|---:|---:|---:|")
            for s in a["shrinks"]:
                add(f"| {(s['t_end'] - a['hog_start']) / 1e6:.0f} | {s['reason']} | {s['old'] // MIB:,} → {s['new'] // MIB:,} | "
                    f"{s['pages_dropped']:,} | {s['segments_released']:,} | {s['elapsed_ns'] / 1e6:.2f} | "
                    f"{fnum((s['longest_hold_ns'] or 0) / 1e6, 3)} |")
            add("")
    if runs:
        add("### 2. Slowdown of a memory-hungry program")
        add("")
        add(f"The program (`python3 bench/governor.py hog --bytes {ctx.slow} --passes {ctx.passes}`) maps "
            f"{ctx.slow / GIB:.2f} GiB, writes every page, then makes {ctx.passes} passes of CRC-32 + rewrite "
            f"over it; timed by wall clock, {ctx.runs} times alone and {ctx.runs} times next to a node "
            f"(`--lend auto --reserve MemAvailable−{ctx.lend / GIB:.2f}GiB`) filled with {ctx.fill / GIB:.2f} GiB of "
            "pages and idle (its client killed after the warm-up; the pool outlives it), alternating which goes first. "
            "The hog's memory is what the node lent, so the node must give it all back while the hog runs.")
        add("")
        add("| | alone | with a filled `auto` node | ratio |")
        add("|---|---:|---:|---:|")
        for key, name in (("wall_s", "wall clock, median (s)"), ("touch_s", "allocate + touch, median (s)"), ("work_s", "work passes, median (s)")):
            al = statistics.median(r[key] for r in runs if r["side"] == "alone")
            wi = statistics.median(r[key] for r in runs if r["side"] == "with")
            add(f"| {name} | {al:.3f} | {wi:.3f} | ×{wi / al:.3f} |")
        al = sorted(r["wall_s"] for r in runs if r["side"] == "alone")
        wi = sorted(r["wall_s"] for r in runs if r["side"] == "with")
        add(f"| wall clock, min–max (s) | {al[0]:.3f}–{al[-1]:.3f} | {wi[0]:.3f}–{wi[-1]:.3f} | |")
        w = [r for r in runs if r["side"] == "with"]
        add(f"| node: released during the hog, median | | {statistics.median(r['released_bytes'] for r in w) / GIB:.2f} GiB in "
            f"{statistics.median(r['shrinks'] for r in w):.0f} shrinks, {statistics.median(r['set_budget_sum_ms'] for r in w):.1f} ms of `set_budget` | |")
        add(f"| node: CPU time during the hog, median | | {statistics.median(r['node_cpu_ms'] for r in w):.0f} ms | |")
        add("")
        add("Per run (s), in the order run: " + ", ".join(f"{r['side']} {r['wall_s']:.3f}" for r in runs) + ".")
        add("")
    if ctx.notes:
        add("### Notes")
        add("")
        for n in ctx.notes:
            add(f"* {n}")
        add("")
    add(MARK_END)
    return "\n".join(L) + "\n"


def write_section(text, path="BENCHMARKS.md"):
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


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd")
    h = sub.add_parser("hog")
    h.add_argument("--bytes", type=int, required=True)
    h.add_argument("--passes", type=int, default=2)
    h.add_argument("--hold", action="store_true")
    ap.add_argument("--fallow-bin", default="target/release/fallow")
    ap.add_argument("--command", default="bash bench/governor.sh")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--lend-gib", type=float, default=1.5)
    ap.add_argument("--fill-gib", type=float, default=1.25)
    ap.add_argument("--hog-gib", type=float, default=1.25)
    ap.add_argument("--slow-gib", type=float, default=None)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--read-s", type=float, default=10)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--skip", choices=["giveback", "slowdown"], action="append", default=[])
    args = ap.parse_args()
    if args.cmd == "hog":
        return hog(args)

    def terminate(signum, _frame):
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, terminate)
    signal.signal(signal.SIGINT, terminate)
    if args.quick:
        args.runs, args.lend_gib, args.fill_gib, args.hog_gib, args.read_s = 2, 0.375, 0.25, 0.3125, 8
    ctx = Ctx()
    ctx.bin = args.fallow_bin
    ctx.command = args.command.strip()
    ctx.runs = args.runs
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
        a = c = None
        runs = []
        if "giveback" not in args.skip:
            a = give_back(ctx, "auto")
            c = give_back(ctx, "fixed", window_ns=int(a["window_ms"] * 1e6))
        if "slowdown" not in args.skip:
            runs = slowdown(ctx)
        load1 = Path("/proc/loadavg").read_text().split()[0]
        ctx.notes = ctx.quiet.notes
        if args.quick:
            ctx.notes.append("--quick: small sizes, not numbers to publish")
        text = section(ctx, machine(), a or {}, c, runs, (load0, load1))
        (ctx.out / "section.md").write_text(text)
        print(text)
        if not args.no_write and not args.quick:
            write_section(text)
            log("wrote the section into BENCHMARKS.md")
    finally:
        PROCS.stop_all()


if __name__ == "__main__":
    sys.exit(main())
