#!/usr/bin/env python3
"""The vhost-user-blk benchmark: `fallow bench blk` (the vhost-user frontend driver, no
guest) against
  null         the driver's own floor: an in-process responder on the same rings;
  qsd          qemu-storage-daemon's vhost-user-blk export of an image on tmpfs (the
               reference; its default aio=threads);
  fallow       `fallow vhost` over the same image, every read a hit of its local tier
               (warmed first), queue threads that sleep on the kick;
  fallow-poll  the same with --poll-us (queue threads that keep looking at the ring);
  fallow-nbd   the same export over fallow's NBD front end (`fallow vhost --nbd`), driven by
               fio's nbd engine (the NBD reference) and by `fallow bench blk nbd://`;
4 KiB random reads at QD 1 and QD 16. The configurations run one after the other in each
round, in an order that rotates between rounds; every ratio is taken within a round before
the median over the rounds. The servers' CPU time per request (utime + stime from
/proc/PID/stat across the run, divided by the requests) is recorded too.

    python3 bench/vhost.py [--rounds N] [--duration S] [--quick] [--no-write] [--fallow BIN]
    python3 bench/vhost.py --table RESULTS.jsonl      # the section again, from a run's lines

Raw lines go to bench/out/vhost-DATE.jsonl; the section goes between the vhost markers of
BENCHMARKS.md (unless --no-write) and to stdout. Every process it starts is stopped by PID.
"""

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchutil import free_port, git_commit, port_open, write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
IMAGE_BYTES = 256 * MIB
RANGE = "64M"
POLL_US = 50
CLK_TCK = os.sysconf("SC_CLK_TCK")
# What each configuration is held to (issue #27).
QD1_P50_VS_QSD = 1.2
QD16_IOPS_VS_QSD = 1.0
ADDED_US = 7.0
NBD_OVER_VHOST = 3.0


def log(msg):
    print(f"[vhost {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def wait_for(what, proc, ready, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before it was ready")
        time.sleep(0.05)
    raise SystemExit(f"{what} not ready after {timeout} s")


def cpu_seconds(pid):
    """utime + stime of process `pid` (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Servers:
    """qemu-storage-daemon and two `fallow vhost` processes over one tmpfs image."""

    def __init__(self, fallow, work):
        self.fallow, self.work, self.procs = fallow, work, {}
        self.image = os.path.join(work, "disk.img")
        with open("/dev/urandom", "rb") as src, open(self.image, "wb") as dst:
            for _ in range(IMAGE_BYTES // MIB):
                dst.write(src.read(MIB))
        self.nbd_port = free_port()
        self.qsd = self.start_qsd()
        self.fallow_event = self.start_fallow("event", ["--nbd", f"127.0.0.1:{self.nbd_port}"])
        self.fallow_poll = self.start_fallow("poll", ["--poll-us", str(POLL_US)])

    def spawn(self, name, argv):
        logf = open(os.path.join(self.work, f"{name}.log"), "w")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True)
        self.procs[name] = proc
        return proc

    def start_qsd(self):
        sock = os.path.join(self.work, "qsd.sock")
        proc = self.spawn("qsd", [
            "qemu-storage-daemon",
            "--blockdev", f"driver=file,node-name=file0,filename={self.image},cache.direct=off",
            "--blockdev", "driver=raw,node-name=disk,file=file0",
            "--export", "type=vhost-user-blk,id=exp0,node-name=disk,addr.type=unix,"
                        f"addr.path={sock},writable=on,num-queues=1",
        ])
        wait_for("qemu-storage-daemon", proc, lambda: os.path.exists(sock))
        return (proc, sock)

    def start_fallow(self, name, extra):
        sockets = os.path.join(self.work, f"sockets-{name}")
        sock = os.path.join(sockets, "disk.sock")
        # The local tier holds the whole image: every read after the warm-up is a hit.
        proc = self.spawn(f"fallow-{name}", [
            self.fallow, "vhost", "--export", f"disk=file:{self.image}",
            "--local-tier", "512M", "--socket-dir", sockets, *extra,
        ])
        wait_for(f"fallow vhost ({name})", proc, lambda: os.path.exists(sock))
        if "--nbd" in extra:
            wait_for("fallow's NBD", proc, lambda: port_open(self.nbd_port))
        return (proc, sock)

    def stop(self):
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs.items():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def bench_blk(fallow, target, qd, duration, rw="randread"):
    out = subprocess.run(
        [fallow, "bench", "blk", "--target", target, "--rw", rw, "--qd", str(qd),
         "--duration", f"{duration}s", "--range", RANGE, "--json"],
        capture_output=True, text=True, timeout=duration + 60)
    if out.returncode != 0:
        raise SystemExit(f"bench blk {target} failed: {out.stderr.strip()}")
    result = json.loads(out.stdout)
    if result.get("errors"):
        raise SystemExit(f"bench blk {target}: {result['errors']} errors: {result.get('first_error')}")
    return {"iops": result["iops"], "p50": result["latency_us"]["p50"],
            "p99": result["latency_us"]["p99"], "ops": result["ops"]}


def fio_nbd(port, qd, duration):
    out = subprocess.run(
        ["fio", "--name=r", "--ioengine=nbd", f"--uri=nbd://127.0.0.1:{port}/disk",
         "--rw=randread", "--bs=4k", f"--iodepth={qd}", f"--size={RANGE}", "--time_based",
         f"--runtime={duration}", "--ramp_time=1", "--output-format=json"],
        capture_output=True, text=True, timeout=duration + 60)
    if out.returncode != 0:
        raise SystemExit(f"fio failed: {out.stderr.strip()}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]["read"]
    pct = job["clat_ns"]["percentile"]
    return {"iops": job["iops"], "p50": pct["50.000000"] / 1000, "p99": pct["99.000000"] / 1000,
            "ops": job["total_ios"]}


def measure(fallow, servers, config, qd, duration):
    """One run of `config` at `qd`, with the CPU time its server used per request."""
    target, server = {
        "null": ("null", None),
        "qsd": (f"vhost-user:{servers.qsd[1]}", servers.qsd[0]),
        "fallow": (f"vhost-user:{servers.fallow_event[1]}", servers.fallow_event[0]),
        "fallow-poll": (f"vhost-user:{servers.fallow_poll[1]}", servers.fallow_poll[0]),
        "fallow-nbd-blk": (f"nbd://127.0.0.1:{servers.nbd_port}/disk", servers.fallow_event[0]),
        "fallow-nbd-fio": (None, servers.fallow_event[0]),
    }[config]
    before = cpu_seconds(server.pid) if server else None
    if config == "fallow-nbd-fio":
        result = fio_nbd(servers.nbd_port, qd, duration)
    else:
        result = bench_blk(fallow, target, qd, duration)
    if server:
        used = cpu_seconds(server.pid) - before
        result["server_cpu_us_per_op"] = used * 1e6 / max(result["ops"], 1)
    return result


CONFIGS = ["null", "qsd", "fallow", "fallow-poll", "fallow-nbd-blk", "fallow-nbd-fio"]


def run(args):
    fallow = args.fallow or os.path.join(ROOT, "target/release/fallow")
    if not args.fallow:
        log("building target/release/fallow")
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "fallow"], cwd=ROOT, check=True)
    stamp = time.strftime("%Y-%m-%d-%H%M")
    os.makedirs(os.path.join(ROOT, "bench/out"), exist_ok=True)
    out_path = os.path.join(ROOT, f"bench/out/vhost-{stamp}.jsonl")
    work = tempfile.mkdtemp(prefix="fallow-vhost-bench-", dir="/dev/shm")
    servers = None

    def stop(signum, _frame):
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        servers = Servers(fallow, work)
        for name in ("fallow-event", "fallow-poll"):
            sock = servers.fallow_event[1] if name == "fallow-event" else servers.fallow_poll[1]
            log(f"warming {name}: every block of the range read once")
            bench_blk(fallow, f"vhost-user:{sock}", 16, 3, rw="read")
        with open(out_path, "w") as out:
            out.write(json.dumps({"machine": {"cpus": os.cpu_count(), "date": stamp,
                                              "cpu": cpu_model(), "duration_s": args.duration,
                                              "load": os.getloadavg()[0],
                                              "commit": git_commit(),
                                              "command": " ".join(sys.argv),
                                              "qsd": qsd_version()}}) + "\n")
            for round_no in range(args.rounds):
                order = CONFIGS[round_no % len(CONFIGS):] + CONFIGS[:round_no % len(CONFIGS)]
                for qd in (1, 16):
                    for config in order:
                        result = measure(fallow, servers, config, qd, args.duration)
                        row = {"round": round_no, "qd": qd, "config": config, **result}
                        out.write(json.dumps(row) + "\n")
                        out.flush()
                        log(f"round {round_no + 1}/{args.rounds} qd {qd} {config}: "
                            f"{result['iops']:.0f} IOPS, p50 {result['p50']:.1f} µs")
    finally:
        if servers:
            servers.stop()
        shutil.rmtree(work, ignore_errors=True)
    log(f"raw results in {os.path.relpath(out_path, ROOT)}")
    return out_path


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def qsd_version():
    out = subprocess.run(["qemu-storage-daemon", "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0] if out.stdout else "?"


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def per_round(rows, qd, fn):
    """fn(results of one round by config) for every round, its median."""
    rounds = {}
    for r in rows:
        if r["qd"] == qd:
            rounds.setdefault(r["round"], {})[r["config"]] = r
    return median([fn(by) for by in rounds.values() if all(c in by for c in CONFIGS)])


def section(path):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    head = lines[0]["machine"]
    rows = [l for l in lines if "config" in l]
    rounds = len({r["round"] for r in rows})
    get = lambda qd, config, key: per_round(rows, qd, lambda by: by[config][key])
    ratio = lambda qd, a, b, key: per_round(rows, qd, lambda by: by[a][key] / by[b][key])
    diff = lambda qd, a, b, key: per_round(rows, qd, lambda by: by[a][key] - by[b][key])

    def verdict(value, bound, at_least):
        if value is None:
            return "–"
        return "met" if (value >= bound if at_least else value <= bound) else "**not met**"

    out = []
    out.append(f"**Command:** `python3 bench/vhost.py` ({head['command'].split('vhost.py', 1)[-1].strip() or 'defaults'}); "
               f"commit `{head['commit']}`, {head['date']}, {head['cpus']} CPUs ({head.get('cpu', '?')}), "
               f"load average {head.get('load', 0):.1f} at the start, {head['qsd']}, {rounds} rounds "
               f"of {head.get('duration_s', '?')} s per run, "
               "medians of per-round values.")
    out.append("")
    out.append("| configuration | QD 1 p50 µs | QD 1 p99 µs | QD 16 IOPS | QD 16 p50 µs | server CPU µs/op (QD 16) |")
    out.append("|---|---|---|---|---|---|")
    names = {"null": "driver's floor (null)", "qsd": "qemu-storage-daemon, tmpfs image",
             "fallow": "fallow vhost, hits", "fallow-poll": f"fallow vhost --poll-us {POLL_US}, hits",
             "fallow-nbd-blk": "fallow NBD (bench blk nbd://), hits",
             "fallow-nbd-fio": "fallow NBD (fio nbd engine), hits"}
    for c in CONFIGS:
        cpu = get(16, c, "server_cpu_us_per_op") if c != "null" else None
        out.append(f"| {names[c]} | {fmt(get(1, c, 'p50'), 1)} | {fmt(get(1, c, 'p99'), 1)} | "
                   f"{fmt(get(16, c, 'iops'), 0)} | {fmt(get(16, c, 'p50'), 1)} | {fmt(cpu, 2)} |")
    out.append("")
    out.append("| target | fallow vhost | with --poll-us | status |")
    out.append("|---|---|---|---|")
    p50 = (ratio(1, "fallow", "qsd", "p50"), ratio(1, "fallow-poll", "qsd", "p50"))
    iops = (ratio(16, "fallow", "qsd", "iops"), ratio(16, "fallow-poll", "qsd", "iops"))
    added = (diff(1, "fallow", "null", "p50"), diff(1, "fallow-poll", "null", "p50"))
    nbd = (ratio(1, "fallow-nbd-fio", "fallow", "p50"), ratio(1, "fallow-nbd-fio", "fallow-poll", "p50"))
    best = lambda pair, at_least: (max if at_least else min)(x for x in pair if x is not None) if any(x is not None for x in pair) else None
    out.append(f"| QD 1 p50 ≤ {QD1_P50_VS_QSD} × qemu-storage-daemon's | {fmt(p50[0])} × | {fmt(p50[1])} × | "
               f"{verdict(best(p50, False), QD1_P50_VS_QSD, False)} |")
    out.append(f"| QD 16 IOPS ≥ {QD16_IOPS_VS_QSD} × qemu-storage-daemon's | {fmt(iops[0])} × | {fmt(iops[1])} × | "
               f"{verdict(best(iops, True), QD16_IOPS_VS_QSD, True)} |")
    out.append(f"| added latency of a hit over the driver's floor ≤ {ADDED_US:g} µs (QD 1 p50) | "
               f"{fmt(added[0], 1)} µs | {fmt(added[1], 1)} µs | {verdict(best(added, False), ADDED_US, False)} |")
    out.append(f"| fallow's NBD path (fio) p50 ≥ {NBD_OVER_VHOST:g} × the vhost path's (QD 1) | {fmt(nbd[0])} × | "
               f"{fmt(nbd[1])} × | {verdict(best(nbd, True), NBD_OVER_VHOST, True)} |")
    return "\n".join(out) + "\n"


def fmt(x, digits=2):
    return "–" if x is None else f"{x:,.{digits}f}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--duration", type=int, default=5, help="seconds of each run")
    p.add_argument("--quick", action="store_true", help="1 round of 2 s: a smoke run")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--fallow", help="the fallow binary (default: build target/release/fallow)")
    p.add_argument("--table", help="print the section of an earlier run's JSON lines")
    args = p.parse_args()
    if args.table:
        print(section(args.table), end="")
        return
    if args.quick:
        args.rounds, args.duration = 1, 2
    path = run(args)
    text = section(path)
    print(text, end="")
    if not args.no_write and not args.quick:
        write_section("vhost", text)


if __name__ == "__main__":
    main()
