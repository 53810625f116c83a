#!/usr/bin/env python3
"""Pool exports (`fallow nbd --export NAME=pool:SIZE`), measured three ways:

  writes       fio 4 KiB random writes at QD 16 (its nbd engine, one connection) to
               `nbdkit memory` (the ideal user-space RAM disk), to a pool export in the
               process (`--pool local:`) and to one on a node (`--pool fallow://`), in an
               order that rotates between rounds; ratios taken within a round, then the
               median over the rounds;
  memory       what a pool export costs the process that holds it: its resident memory
               grown by writing 512 MiB of random pages, and by 512 MiB of zero pages;
  compression  the Debian root file system of the guest tests (`fallow-guest image
               --debian`) copied with nbdcopy into a pool export with --compress, then
               into a second one (a clone, as VMs cloned from one image); once the
               compressor has caught up after each, the pool's apparent capacity (pages
               held per byte of memory) as `fallow stat --nbd` reports it.

    python3 bench/pool_export.py [--rounds N] [--duration S] [--quick] [--no-write]
                                 [--fallow BIN] [--guest BIN]
    python3 bench/pool_export.py --table RESULTS.jsonl

Raw lines go to bench/out/pool-export-DATE.jsonl; the section goes between the
pool-export markers of BENCHMARKS.md (unless --no-write or --quick) and to stdout. Every
process it starts is stopped by PID.
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

from benchutil import Procs, free_port, git_commit, port_open, write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 1 << 20
# What each measurement is held to (issue #28).
WRITES_VS_NBDKIT = 0.8
MEMORY_OVERHEAD = 1.05
APPARENT = 2.0


def log(msg):
    print(f"[pool-export {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_bytes(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def fio(uri, rw, bs, qd, size, duration=None, extra=()):
    argv = ["fio", "--name=p", "--ioengine=nbd", f"--uri={uri}", f"--rw={rw}", f"--bs={bs}",
            f"--iodepth={qd}", f"--size={size}", "--output-format=json", *extra]
    if duration:
        argv += ["--time_based", f"--runtime={duration}", "--ramp_time=1"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=(duration or 60) + 120)
    if out.returncode != 0:
        raise SystemExit(f"fio failed: {out.stderr.strip()}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    side = job["write"] if "write" in rw else job["read"]
    return {"iops": side["iops"], "p50": side["clat_ns"]["percentile"]["50.000000"] / 1000,
            "p99": side["clat_ns"]["percentile"]["99.000000"] / 1000}


def stat_nbd(fallow, metrics):
    out = subprocess.run([fallow, "stat", "--nbd", metrics, "--json"], capture_output=True,
                         text=True, timeout=30, check=True)
    return json.loads(out.stdout)


def writes(args, procs, work, out):
    """fio random writes: nbdkit memory against pool exports, rotating."""
    secret = os.path.join(work, "secret")
    with open(secret, "w") as f:
        f.write(os.urandom(24).hex() + "\n")
    ports = {name: free_port() for name in ("nbdkit", "local", "node", "node-nbd")}
    procs.start("nbdkit", ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(ports["nbdkit"]),
                           "memory", "1G"], ports["nbdkit"])
    procs.start("fallow-local", [args.fallow, "nbd", "--listen", f"127.0.0.1:{ports['local']}",
                                 "--export", "d=pool:1G", "--pool", "local:1280M",
                                 "--local-tier", "0"], ports["local"])
    procs.start("fallow-node", [args.fallow, "node", "--listen", f"127.0.0.1:{ports['node']}",
                                "--lend", "1280M", "--secret-file", secret], ports["node"])
    procs.start("fallow-node-nbd", [args.fallow, "nbd", "--listen",
                                    f"127.0.0.1:{ports['node-nbd']}", "--export", "d=pool:1G",
                                    "--pool", f"fallow://127.0.0.1:{ports['node']}",
                                    "--secret-file", secret, "--local-tier", "0"],
                ports["node-nbd"])
    uris = {"nbdkit-memory": f"nbd://127.0.0.1:{ports['nbdkit']}",
            "pool-local": f"nbd://127.0.0.1:{ports['local']}/d",
            "pool-node": f"nbd://127.0.0.1:{ports['node-nbd']}/d"}
    configs = list(uris)
    for round_no in range(args.rounds):
        shift = round_no % len(configs)
        for config in configs[shift:] + configs[:shift]:
            r = fio(uris[config], "randwrite", "4k", 16, "256m", args.duration)
            row = {"part": "writes", "round": round_no, "config": config, **r}
            out.write(json.dumps(row) + "\n")
            out.flush()
            log(f"round {round_no + 1}/{args.rounds} {config}: {r['iops']:.0f} IOPS, "
                f"p50 {r['p50']:.1f} µs")


def memory(args, procs, work, out):
    """The resident memory a pool export's pages cost the process that holds them."""
    port, metrics = free_port(), free_port()
    proc = procs.start("fallow-memory", [
        args.fallow, "nbd", "--listen", f"127.0.0.1:{port}", "--export", "d=pool:2G",
        "--pool", "local:2G", "--local-tier", "0", "--metrics", f"127.0.0.1:{metrics}"], port)
    uri = f"nbd://127.0.0.1:{port}/d"
    base = rss_bytes(proc.pid)
    # 512 MiB of random pages (fio refills its buffers with random bytes for every write).
    fio(uri, "write", "64k", 8, "512m", extra=["--refill_buffers", "--offset=0"])
    random_rss = rss_bytes(proc.pid)
    # 512 MiB of zero pages, after the random ones.
    fio(uri, "write", "64k", 8, "512m", extra=["--zero_buffers", "--offset=512m"])
    zero_rss = rss_bytes(proc.pid)
    stat = stat_nbd(args.fallow, f"127.0.0.1:{metrics}")
    row = {"part": "memory", "base_rss": base, "random_rss": random_rss, "zero_rss": zero_rss,
           "bytes": 512 * MIB, "pool": stat.get("pool")}
    out.write(json.dumps(row) + "\n")
    log(f"memory: +{(random_rss - base) / MIB:.1f} MiB for 512 MiB of random pages, "
        f"+{(zero_rss - random_rss) / MIB:.1f} MiB for 512 MiB of zeros")
    procs.stop(proc)


def wait_for_compressor(fallow, metrics):
    """Polls `fallow stat --nbd` until two looks 5 s apart find the pool's memory unchanged
    (the compressor has caught up), or 10 minutes; returns the last pool figures and the
    seconds waited."""
    start, last, still, pool = time.time(), None, 0, None
    while time.time() - start < 600 and still < 2:
        time.sleep(5)
        pool = stat_nbd(fallow, metrics)["pool"]
        still = still + 1 if pool["used_bytes"] == last else 0
        last = pool["used_bytes"]
        log(f"  {pool['pages']} pages in {pool['used_bytes'] / MIB:.1f} MiB: "
            f"apparent capacity {pool['apparent_capacity']:.2f}")
    return pool, time.time() - start


def compression(args, procs, work, out):
    """A Debian root file system in a compressed pool export, then a clone of it in a
    second one (as VMs cloned from one image): the pool's apparent capacity after each."""
    images = json.loads(subprocess.run([args.guest, "image", "--debian"], check=True,
                                       capture_output=True, text=True).stdout)
    root = images["debian_root"]
    size = os.path.getsize(root)
    port, metrics = free_port(), free_port()
    proc = procs.start("fallow-compress", [
        args.fallow, "nbd", "--listen", f"127.0.0.1:{port}", "--export", f"a=pool:{size}",
        "--export", f"b=pool:{size}", "--pool", f"local:{2 * size}", "--local-tier", "0",
        "--compress", "--metrics", f"127.0.0.1:{metrics}"], port)
    for copies, export in ((1, "a"), (2, "b")):
        subprocess.run(["nbdcopy", root, f"nbd://127.0.0.1:{port}/{export}"], check=True,
                       timeout=600)
        log(f"root file system copied into export {export}; waiting for the compressor")
        pool, seconds = wait_for_compressor(args.fallow, f"127.0.0.1:{metrics}")
        row = {"part": "compression", "copies": copies, "image_bytes": size,
               "seconds": seconds, "pool": pool}
        out.write(json.dumps(row) + "\n")
    procs.stop(proc)


def run(args):
    stamp = time.strftime("%Y-%m-%d-%H%M")
    os.makedirs(os.path.join(ROOT, "bench/out"), exist_ok=True)
    out_path = os.path.join(ROOT, f"bench/out/pool-export-{stamp}.jsonl")
    work = tempfile.mkdtemp(prefix="fallow-pool-bench-", dir="/dev/shm")
    procs = Procs(work)

    def stop(signum, _frame):
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        with open(out_path, "w") as out:
            head = {"cpus": os.cpu_count(), "date": stamp, "load": os.getloadavg()[0],
                    "commit": git_commit(), "command": " ".join(sys.argv),
                    "duration_s": args.duration, "rounds": args.rounds}
            out.write(json.dumps({"machine": head}) + "\n")
            writes(args, procs, work, out)
            procs.stop_all()
            memory(args, procs, work, out)
            compression(args, procs, work, out)
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    log(f"raw results in {os.path.relpath(out_path, ROOT)}")
    return out_path


def fmt(x, digits=2):
    return "–" if x is None else f"{x:,.{digits}f}"


def verdict(value, bound, at_least):
    if value is None:
        return "–"
    return "met" if (value >= bound if at_least else value <= bound) else "**not met**"


def section(path):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    head = lines[0]["machine"]
    rows = [l for l in lines if l.get("part") == "writes"]
    rounds = {}
    for r in rows:
        rounds.setdefault(r["round"], {})[r["config"]] = r
    full = [by for by in rounds.values() if len(by) == 3]
    med = lambda xs: statistics.median(xs) if xs else None
    get = lambda config, key: med([by[config][key] for by in full])
    ratio = lambda config: med([by[config]["iops"] / by["nbdkit-memory"]["iops"] for by in full])
    out = [f"**Command:** `python3 bench/pool_export.py` "
           f"({head['command'].split('pool_export.py', 1)[-1].strip() or 'defaults'}); "
           f"commit `{head['commit']}`, {head['date']}, {head['cpus']} CPUs, load average "
           f"{head['load']:.1f} at the start, {len(full)} rounds of {head['duration_s']} s, "
           "medians of per-round values.", ""]
    out.append("| fio 4 KiB random writes, QD 16 | IOPS | p50 µs | p99 µs | IOPS / nbdkit memory |")
    out.append("|---|---|---|---|---|")
    names = {"nbdkit-memory": "`nbdkit memory 1G`", "pool-local": "`pool:1G`, `--pool local:`",
             "pool-node": "`pool:1G` on a node"}
    for config, name in names.items():
        out.append(f"| {name} | {fmt(get(config, 'iops'), 0)} | {fmt(get(config, 'p50'), 1)} | "
                   f"{fmt(get(config, 'p99'), 1)} | {fmt(ratio(config))} |")
    mem = next((l for l in lines if l.get("part") == "memory"), None)
    comps = {l["copies"]: l for l in lines if l.get("part") == "compression"}
    out.append("")
    out.append("| target | measured | status |")
    out.append("|---|---|---|")
    best = max((x for x in (ratio("pool-local"), ratio("pool-node")) if x is not None),
               default=None)
    out.append(f"| 4 KiB random writes at QD 16 ≥ {WRITES_VS_NBDKIT} × nbdkit memory | "
               f"local pool {fmt(ratio('pool-local'))} ×, node {fmt(ratio('pool-node'))} × | "
               f"{verdict(best, WRITES_VS_NBDKIT, True)} |")
    if mem:
        grown = (mem["random_rss"] - mem["base_rss"]) / mem["bytes"]
        zeros = (mem["zero_rss"] - mem["random_rss"]) / MIB
        out.append(f"| pages held at ≤ {MEMORY_OVERHEAD} × their size, metadata included | "
                   f"{fmt(grown, 3)} × (resident memory grown by 512 MiB of random pages) | "
                   f"{verdict(grown, MEMORY_OVERHEAD, False)} |")
        out.append(f"| zero pages cost nothing | {fmt(zeros, 1)} MiB for 512 MiB of zero pages | "
                   f"{verdict(zeros, 16, False)} (index entries only) |")
    for copies, label in ((1, "a Debian root file system"), (2, "the same and a clone of it")):
        comp = comps.get(copies)
        if not comp:
            continue
        pool = comp["pool"]
        out.append(f"| with --compress, {label} holds ≥ {APPARENT:g} × its memory | "
                   f"{fmt(pool['apparent_capacity'])} × ({pool['pages']:,} pages in "
                   f"{pool['used_bytes'] / MIB:.1f} MiB, {comp['seconds']:.0f} s after the "
                   f"copy) | {verdict(pool['apparent_capacity'], APPARENT, True)} |")
    return "\n".join(out) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--duration", type=int, default=5, help="seconds of each fio run")
    p.add_argument("--quick", action="store_true", help="1 round of 2 s: a smoke run")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--fallow", default=os.path.join(ROOT, "target/release/fallow"))
    p.add_argument("--guest", default=os.path.join(ROOT, "target/release/fallow-guest"))
    p.add_argument("--table", help="print the section of an earlier run's JSON lines")
    args = p.parse_args()
    if args.table:
        print(section(args.table), end="")
        return
    if args.quick:
        args.rounds, args.duration = 1, 2
    text = section(run(args))
    print(text, end="")
    if not args.no_write and not args.quick:
        write_section("pool-export", text)


if __name__ == "__main__":
    main()
