#!/usr/bin/env python3
"""Threads, memory and throughput of two `fallow nbd` binaries under the same fio load.

Each round starts each binary in turn (the order alternates) with a write-back and a
write-through export over fresh files, runs one fio job of random 4 KiB reads and writes
with crc32c verification against each export at once, and samples the server's thread
count and RSS every second from /proc. Prints per-run figures and the medians, and the
ratios NEW/OLD.

    python3 bench/threads_ab.py OLD_BINARY NEW_BINARY [--rounds 3] [--seconds 30]
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchutil import Procs, fio_verify_job, free_port, wb_wt_exports


def status(pid):
    """(threads, RSS bytes) of a live process, from /proc/PID/status."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return int(fields["Threads"][0]), int(fields["VmRSS"][0]) * 1024


def fio(port, export, seconds, results):
    out = subprocess.run(fio_verify_job("ab", f"nbd://127.0.0.1:{port}/{export}", seconds),
                         capture_output=True, text=True, timeout=seconds * 5 + 60)
    try:
        job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
        results[export] = {"ios": job["read"]["total_ios"] + job["write"]["total_ios"],
                           "error": job["error"] or out.returncode}
    except (ValueError, KeyError, IndexError):
        results[export] = {"ios": 0, "error": out.stderr[-500:] or "no JSON from fio"}


def run(binary, seconds, work):
    """One run of `binary`: its peak and last thread count, median and peak RSS, I/Os."""
    images, exports = wb_wt_exports(work)
    port = free_port()
    procs = Procs(work)
    try:
        server = procs.start("nbd", [binary, "nbd", "--listen", f"127.0.0.1:{port}", *exports,
                                     "--pool", "local:64M"], port=port)
        results = {}
        jobs = [threading.Thread(target=fio, args=(port, e, seconds, results))
                for e in ("wb", "wt")]
        for j in jobs:
            j.start()
        samples = []
        while any(j.is_alive() for j in jobs):
            samples.append(status(server.pid))
            time.sleep(1)
        for j in jobs:
            j.join()
        if any(r["error"] for r in results.values()):
            sys.exit(f"fio failed against {binary}: {results}")
        rss = [r for _, r in samples]
        return {
            "threads_peak": max(t for t, _ in samples),
            "threads_last": samples[-1][0],
            "rss_median": statistics.median(rss),
            "rss_peak": max(rss),
            "ios": sum(r["ios"] for r in results.values()),
        }
    finally:
        procs.stop_all()
        for path in images.values():
            os.remove(path)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=30)
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="fallow-threads-ab-")
    runs = {"old": [], "new": []}
    try:
        for r in range(args.rounds):
            order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
            for which in order:
                result = run(os.path.abspath(getattr(args, which)), args.seconds, work)
                runs[which].append(result)
                print(f"round {r} {which}: threads peak {result['threads_peak']} last "
                      f"{result['threads_last']}, RSS median {result['rss_median'] / 2**20:.1f} "
                      f"MiB peak {result['rss_peak'] / 2**20:.1f} MiB, {result['ios']:,} I/Os",
                      flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n| figure | OLD median | NEW median | NEW/OLD |\n|---|---:|---:|---:|")
    for key, unit in [("threads_peak", 1), ("threads_last", 1), ("rss_median", 2**20),
                      ("rss_peak", 2**20), ("ios", 1)]:
        old = statistics.median(x[key] for x in runs["old"]) / unit
        new = statistics.median(x[key] for x in runs["new"]) / unit
        print(f"| {key} | {old:,.1f} | {new:,.1f} | {new / old:.2f} |")


if __name__ == "__main__":
    main()
