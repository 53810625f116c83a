#!/usr/bin/env python3
"""What the journal of persistent pages costs (docs/operations.md, "fallow node"): puts
into a persistent pool of a node with --state-dir (every put journaled under its shard's
lock: one writev of the page into a file in /dev/shm) against the same puts into a node
without it, side by side in one run.

Each configuration starts a fresh `fallow node --lend 1G` (the journaled one over a new
directory under /dev/shm) and runs `fallow bench pages --workload put --persistent` for
--seconds over 65,536 keys (256 MiB, a quarter of the budget: puts overwrite, so the
journal grows, compacts, and grows again, as it does in use), in two shapes:

  put-batched  2 connections, QD 4, batch 32: throughput (pages/s);
  put-qd1      1 connection, QD 1, batch 1: latency (p50, p99).

Each round runs the four (shape × node) runs in an order that rotates between rounds; a
ratio is taken within a round, then the median over the rounds. The journal's size,
records and compactions come from the node's /metrics at the end of each journaled run.

    python3 bench/journal.py [--rounds 5] [--seconds 5] [--no-write] [--fallow BIN]

Raw lines go to bench/out/journal-DATE.jsonl, progress to stderr; the section goes between
the journal markers of BENCHMARKS.md (and to stdout). Every process it starts is stopped
by PID, and its directories under /dev/shm are removed.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

from benchutil import Procs, free_port, git_commit, version, write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "journal"
KEYS = 65536
SHAPES = {
    "put-batched": ["--connections", "2", "--queue-depth", "4", "--batch", "32"],
    "put-qd1": ["--connections", "1", "--queue-depth", "1", "--batch", "1"],
}
NODES = ("plain", "journaled")
SECRET = "journal-bench-secret-0123456789"


def log(msg):
    print(f"[journal {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def metrics_of(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    values = {}
    for line in text.decode().splitlines():
        m = re.match(r"^(fallow_node_journal_\w+) (\S+)$", line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def one_run(args, procs, work, shape, node_kind, rnd):
    port, metrics_port = free_port(), free_port()
    secret = os.path.join(work, "secret")
    argv = [args.fallow, "node", "--listen", f"127.0.0.1:{port}", "--lend", "1G",
            "--secret-file", secret, "--metrics", f"127.0.0.1:{metrics_port}"]
    state = None
    if node_kind == "journaled":
        state = tempfile.mkdtemp(prefix="fallow-journal-bench-", dir="/dev/shm")
        argv += ["--state-dir", state]
    name = f"r{rnd}-{shape}-{node_kind}"
    node = procs.start(name, argv, port=port)
    try:
        bench = subprocess.Popen(
            [args.fallow, "bench", "pages", "--target", f"fallow://127.0.0.1:{port}",
             "--secret-file", secret, "--workload", "put", "--persistent",
             "--keys", str(KEYS), *SHAPES[shape], "--duration", f"{args.seconds}s",
             "--server-pid", str(node.pid), "--json", "--quiet"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # The journal's size while the run puts (the run destroys its pool at the end,
        # which empties the journal): sampled every half second, the largest kept.
        journal, peak = {}, 0.0
        deadline = time.monotonic() + args.seconds * 10 + 60
        while bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
            if state and bench.poll() is None:
                try:
                    journal = metrics_of(metrics_port)
                    peak = max(peak, journal.get("fallow_node_journal_bytes", 0))
                except OSError:
                    pass
        out, err = bench.communicate(timeout=60)
        if bench.returncode != 0:
            raise RuntimeError(f"{name}: bench pages failed: {err[-2000:]}")
        report = json.loads(out)
        if state:
            journal = metrics_of(metrics_port)
            journal["fallow_node_journal_bytes"] = peak
        return {"round": rnd, "shape": shape, "node": node_kind,
                "pages_per_s": report["pages_per_s"], "stored": report["stored"],
                "not_stored": report["not_stored"], "p50_us": report["latency_us"]["p50"],
                "p99_us": report["latency_us"]["p99"],
                "journal_bytes": journal.get("fallow_node_journal_bytes"),
                "journal_records": journal.get("fallow_node_journal_records_total"),
                "journal_compactions": journal.get("fallow_node_journal_compactions_total"),
                "journal_failed": journal.get("fallow_node_journal_failed_shards")}
    finally:
        Procs.stop(node)
        if state:
            shutil.rmtree(state, ignore_errors=True)


def section(results, head):
    med = statistics.median
    o = [f"Run {head['date']} at commit `{head['commit']}`, {head['rounds']} rounds × "
         f"{head['seconds']} s per run, `python3 bench/journal.py`. A persistent pool of "
         f"{KEYS:,} keys (256 MiB) on a node lending 1 GiB, puts only; \"journaled\" is the "
         f"node with `--state-dir` in /dev/shm.", "",
         "| shape | plain: pages/s | journaled: pages/s | journaled / plain (median of "
         "rounds) | plain p50 / p99, µs | journaled p50 / p99, µs |",
         "|---|---|---|---|---|---|"]
    for shape in SHAPES:
        rows = {n: [r for r in results if r["shape"] == shape and r["node"] == n]
                for n in NODES}
        ratios = [j["pages_per_s"] / p["pages_per_s"]
                  for p, j in zip(rows["plain"], rows["journaled"])]
        cell = {n: (med([r["pages_per_s"] for r in rows[n]]),
                    med([r["p50_us"] for r in rows[n]]), med([r["p99_us"] for r in rows[n]]))
                for n in NODES}
        o.append(f"| {shape} | {cell['plain'][0]:,.0f} | {cell['journaled'][0]:,.0f} | "
                 f"{med(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}) | "
                 f"{cell['plain'][1]:.1f} / {cell['plain'][2]:.1f} | "
                 f"{cell['journaled'][1]:.1f} / {cell['journaled'][2]:.1f} |")
    journaled = [r for r in results if r["node"] == "journaled"]
    o.append("")
    o.append("The journal at its largest during each journaled run (sampled every 0.5 s): "
             f"{med([r['journal_bytes'] or 0 for r in journaled]) / (1 << 20):,.0f} MiB "
             f"(median) for 256 MiB of live pages; "
             f"{sum(r['journal_compactions'] or 0 for r in journaled):,.0f} compactions in "
             f"all, {sum(r['journal_failed'] or 0 for r in journaled):.0f} failed shards, "
             f"{sum(r['not_stored'] for r in results):,} puts refused over every run.")
    o.append("")
    o.append("Every put here overwrites a live key, the journal's worst case: each put appends "
             "a page record (a copy into the file's shared mapping, under the shard's lock), "
             "and every time a shard's file passes twice its live pages a compaction copies "
             "them all again; so each page is copied into tmpfs about twice, where an "
             "ephemeral or unjournaled put copies it once, into the arena. Puts of new keys "
             "append without compacting. Gets do not touch the journal.")
    return "\n".join(o) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=int, default=5)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--fallow", default=os.path.join(ROOT, "target/release/fallow"))
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="fallow-journal-bench-")
    procs = Procs(work, log)
    signal.signal(signal.SIGTERM, lambda s, _f: sys.exit(f"signal {s}"))
    results = []
    try:
        binary = os.path.join(work, "fallow")
        shutil.copy2(args.fallow, binary)
        args.fallow = binary
        built = version([binary, "--version"])
        with open(os.path.join(work, "secret"), "w") as f:
            f.write(SECRET)
        runs = [(s, n) for s in SHAPES for n in NODES]
        for rnd in range(1, args.rounds + 1):
            shift = (rnd - 1) % len(runs)
            for shape, node_kind in runs[shift:] + runs[:shift]:
                r = one_run(args, procs, work, shape, node_kind, rnd)
                results.append(r)
                log(f"round {rnd} {shape} {node_kind}: {r['pages_per_s']:,.0f} pages/s, "
                    f"p50 {r['p50_us']:.1f} µs, p99 {r['p99_us']:.1f} µs"
                    + (f", journal {r['journal_bytes'] / (1 << 20):,.0f} MiB, "
                       f"{r['journal_compactions']:.0f} compactions"
                       if r["journal_bytes"] is not None else ""))
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    head = {"date": datetime.date.today().isoformat(), "commit": git_commit(),
            "rounds": args.rounds, "seconds": args.seconds, "version": built}
    os.makedirs(os.path.join(ROOT, "bench/out"), exist_ok=True)
    with open(os.path.join(ROOT, f"bench/out/journal-{head['date']}.jsonl"), "w") as f:
        for r in [head] + results:
            f.write(json.dumps(r) + "\n")
    text = section(results, head)
    print(text)
    if not args.no_write:
        write_section(MARKER, text)


if __name__ == "__main__":
    main()
