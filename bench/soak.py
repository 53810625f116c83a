#!/usr/bin/env python3
"""A soak of fallow (issue #31): a three-node cluster, two exports and mixed load for an
hour (--minutes), with a node killed and restarted every few minutes; errors, verify
failures, wrong pages, and every process's resident memory and open files over time,
plotted. Not part of the test command: docs/reliability.md, "Soak", has the last run.

The parts, all on 127.0.0.1:
  nodes    three `fallow node --lend 256M --state-dir DIR` (DIR under /dev/shm) that
           gossip into one cluster;
  exports  one `fallow nbd --pool fallow://N1,N2,N3` process with two exports over sparse
           files of 256 MiB: `wb` with --write-policy back, `wt` with write-through;
  load     per export, fio's nbd engine (libnbd) in a loop of --fio-seconds runs of
           random 4 KiB reads and writes at QD 8, every written block read back and
           checked (verify=crc32c, verify_fatal); and `fallow bench pages --workload
           mix:0.5 --persistent` against the cluster in a loop of 30 s runs, every hit
           checked against what was put (its `wrong` and `errors` must stay 0);
  faults   every --kill-every seconds one node (in turn) gets SIGKILL and is restarted
           over its state directory 5 s later;
  samples  every 10 s: VmRSS and the number of open file descriptors of each fallow
           process (a restarted node starts a new series).

After a warm-up (--warmup-minutes, default 10), the `fallow nbd` process's RSS must stay
within 5 % of its first post-warm-up sample; a node, which fills up again after each
restart, must stay under a bound (its budget, its journal, metadata); no process's file
descriptors may grow. The verdict, the counts and a plot go to stdout, to
bench/out/soak-DATE.{jsonl,png} and to the soak markers of BENCHMARKS.md (not with
--no-write).

    python3 bench/soak.py [--minutes 60] [--kill-every 300] [--fio-seconds 60]
                          [--warmup-minutes 10] [--no-write] [--fallow BIN]

Every process it starts is stopped by PID; its directories are removed.
"""

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from benchutil import (Procs, fio_verify_job, free_port, git_commit, version, wb_wt_exports,
                       write_section)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = "soak"
SECRET = "soak-secret-0123456789abcdef"
SAMPLE_EVERY = 10
RSS_BAND = 0.05
# A node lends 256 MiB; its resident memory may add the journal of its persistent pages
# (mapped, so resident: up to twice its ~22 MiB share of the cluster pool's two copies)
# and its metadata.
NODE_RSS_BOUND = int(256 * 1.1 + 128) << 20


def log(msg):
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def rss_and_fds(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
        return rss, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration):
        return None, None


class Cluster:
    """Three nodes that gossip; each can be killed and started again over its state."""

    def __init__(self, args, procs, work):
        self.args, self.procs, self.work = args, procs, work
        self.ports = [(free_port(), free_port(socket.SOCK_DGRAM)) for _ in range(3)]
        self.states = [tempfile.mkdtemp(prefix=f"fallow-soak-n{i}-", dir="/dev/shm")
                       for i in range(3)]
        self.nodes = [None] * 3
        self.lives = [0] * 3

    def start(self, i):
        listen, gossip = self.ports[i]
        seeds = [f"127.0.0.1:{g}" for j, (_, g) in enumerate(self.ports) if j != i]
        self.lives[i] += 1
        self.nodes[i] = self.procs.start(
            f"node{i}-{self.lives[i]}",
            [self.args.fallow, "node", "--listen", f"127.0.0.1:{listen}",
             "--gossip", f"127.0.0.1:{gossip}", "--join", ",".join(seeds), "--lend", "256M",
             "--secret-file", os.path.join(self.work, "secret"),
             "--state-dir", self.states[i]], port=listen)

    def kill(self, i):
        self.nodes[i].send_signal(signal.SIGKILL)
        self.nodes[i].wait()

    def uri(self):
        return "fallow://" + ",".join(f"127.0.0.1:{p}" for p, _ in self.ports)

    def cleanup(self):
        for d in self.states:
            shutil.rmtree(d, ignore_errors=True)


def fio_loop(args, work, export, port, stop, tally, lock):
    """fio runs against one export until `stop` is set; counts runs, I/Os and failures."""
    n = 0
    while not stop.is_set():
        n += 1
        out = subprocess.run(
            fio_verify_job("soak", f"nbd://127.0.0.1:{port}/{export}", args.fio_seconds),
            capture_output=True, text=True, timeout=args.fio_seconds * 5 + 120)
        verify = len([l for l in out.stderr.splitlines()
                      if "verify" in l.lower() and ("fail" in l or "bad" in l)])
        ios = errors = 0
        try:
            job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
            ios = job["read"]["total_ios"] + job["write"]["total_ios"]
            errors = 1 if job["error"] else 0
        except (ValueError, KeyError, IndexError):
            errors = 1
        if out.returncode != 0 and not errors and not verify:
            errors = 1
        with lock:
            t = tally[export]
            t["runs"] += 1
            t["ios"] += ios
            t["errors"] += errors
            t["verify_failures"] += verify
            if errors or verify:
                t["first_failure"] = t.get("first_failure") or out.stderr[-1500:]
        if errors or verify:
            log(f"fio on {export}, run {n}: {errors} error, {verify} verify failures: "
                f"{out.stderr.strip()[-300:]}")


def pages_loop(args, cluster, stop, tally, lock):
    """`fallow bench pages` against the cluster until `stop`; counts wrong pages, errors."""
    while not stop.is_set():
        out = subprocess.run(
            [args.fallow, "bench", "pages", "--target", cluster.uri(), "--secret-file",
             os.path.join(cluster.work, "secret"), "--workload", "mix:0.5", "--persistent",
             "--keys", "8192", "--connections", "2", "--queue-depth", "4", "--batch", "8",
             "--duration", "30s", "--warmup", "--json", "--quiet"],
            capture_output=True, text=True, timeout=300)
        with lock:
            t = tally["pages"]
            t["runs"] += 1
            try:
                r = json.loads(out.stdout)
                t["requests"] += r["requests"]
                t["wrong"] += r["wrong"]
                t["errors"] += r["errors"]
                if r["errors"]:
                    t["first_failure"] = t.get("first_failure") or r.get("first_error")
                    log(f"bench pages, run {t['runs']}: {r['errors']} errors, the first: "
                        f"{r.get('first_error')}")
            except (ValueError, KeyError):
                t["failed_runs"] += 1
                t["first_failure"] = t.get("first_failure") or out.stderr[-1500:]
                log(f"bench pages failed: {out.stderr.strip()[-300:]}")


def judge(samples, warmup_s, node_bound):
    """The `fallow nbd` process: RSS within the band of its first sample after the
    warm-up. A node, restarted every few kills and filling up again each time: RSS never
    above `node_bound` (its budget, the journal of its persistent pages, metadata). Every
    process: open files not growing (a few of slack, for connections coming and going)."""
    series = {}
    for s in samples:
        for name, (rss, fds) in s["procs"].items():
            if rss is not None:
                series.setdefault(name, []).append((s["t"], rss, fds))
    verdicts = {}
    for name, points in series.items():
        after = [p for p in points if p[0] >= warmup_s] or points
        if len(after) < 3:
            continue
        base = after[0][1]
        worst = max(abs(p[1] - base) / base for p in after)
        peak = max(p[1] for p in points)
        fd_growth = after[-1][2] - min(p[2] for p in after)
        if name.startswith("node"):
            ok = peak <= node_bound
        else:
            ok = worst <= RSS_BAND
        verdicts[name] = {"rss_base": base, "rss_worst_rel": worst, "rss_peak": peak,
                          "rss_ok": ok, "fds_first": after[0][2], "fds_last": after[-1][2],
                          "fd_growth": fd_growth, "fds_ok": fd_growth <= 8,
                          "samples": len(after)}
    return verdicts


def plot(samples, kills, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    series = {}
    for s in samples:
        for name, (rss, fds) in s["procs"].items():
            if rss is not None:
                series.setdefault(name, []).append((s["t"] / 60, rss / (1 << 20), fds))
    for name, pts in sorted(series.items()):
        a1.plot([p[0] for p in pts], [p[1] for p in pts], label=name)
        a2.plot([p[0] for p in pts], [p[2] for p in pts], label=name)
    for t, i in kills:
        for ax in (a1, a2):
            ax.axvline(t / 60, color="grey", alpha=0.3, linewidth=0.8)
    a1.set_ylabel("resident memory, MiB")
    a2.set_ylabel("open file descriptors")
    a2.set_xlabel("minutes (grey: a node SIGKILLed)")
    a1.legend(fontsize=7, ncol=3)
    a1.set_title("fallow soak: three nodes, two exports, mixed load, periodic kills")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def section(head, tally, verdicts, kills, png):
    o = [f"Run {head['date']} at commit `{head['commit']}`: `{head['command']}`, "
         f"{head['minutes']} minutes, a node SIGKILLed every {head['kill_every']} s "
         f"({len(kills)} kills), warm-up {head['warmup_minutes']} minutes.", ""]
    o.append("| load | runs | I/Os or requests | errors | verify failures / wrong pages |")
    o.append("|---|---|---|---|---|")
    for export in ("wb", "wt"):
        t = tally[export]
        o.append(f"| fio on `{export}` | {t['runs']} | {t['ios']:,} | {t['errors']} | "
                 f"{t['verify_failures']} |")
    t = tally["pages"]
    o.append(f"| bench pages, persistent, cluster | {t['runs']} | {t['requests']:,} | "
             f"{t['errors'] + t['failed_runs']} | {t['wrong']} |")
    o.append("")
    o.append(f"| process | RSS after warm-up, MiB | drift after warm-up (nbd: ≤ "
             f"{RSS_BAND * 100:.0f} %) | peak, MiB (nodes: ≤ {NODE_RSS_BOUND >> 20}) | "
             f"file descriptors first → last |")
    o.append("|---|---|---|---|---|")
    for name, v in sorted(verdicts.items()):
        flag = "" if v["rss_ok"] else " **over**"
        o.append(f"| {name} | {v['rss_base'] / (1 << 20):,.0f} | "
                 f"{v['rss_worst_rel'] * 100:.1f} % | {v['rss_peak'] / (1 << 20):,.0f}{flag} | "
                 f"{v['fds_first']} → {v['fds_last']}{'' if v['fds_ok'] else ' **growing**'} |")
    o.append("")
    o.append("A node's series restarts with each life (`node1.2`: node 1's second process); "
             "nodes fill up again after each restart, so they are judged by their peak, the "
             "`fallow nbd` process, which lives throughout, by its drift.")
    o.append(f"Plot: `{png}` (the last run's is docs/img/soak-rss-fds.png).")
    return "\n".join(o) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=60)
    p.add_argument("--kill-every", type=float, default=300)
    p.add_argument("--fio-seconds", type=int, default=60)
    p.add_argument("--warmup-minutes", type=float, default=10)
    p.add_argument("--no-write", action="store_true")
    p.add_argument("--fallow", default=os.path.join(ROOT, "target/release/fallow"))
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="fallow-soak-")
    procs = Procs(work, log)
    signal.signal(signal.SIGTERM, lambda s, _f: sys.exit(f"signal {s}"))
    stop = threading.Event()
    lock = threading.Lock()
    tally = {e: {"runs": 0, "ios": 0, "errors": 0, "verify_failures": 0} for e in ("wb", "wt")}
    tally["pages"] = {"runs": 0, "requests": 0, "wrong": 0, "errors": 0, "failed_runs": 0}
    samples, kills, threads = [], [], []
    cluster = None
    try:
        binary = os.path.join(work, "fallow")
        shutil.copy2(args.fallow, binary)
        args.fallow = binary
        built = version([binary, "--version"])
        with open(os.path.join(work, "secret"), "w") as f:
            f.write(SECRET)
        cluster = Cluster(args, procs, work)
        for i in range(3):
            cluster.start(i)
        time.sleep(3)  # gossip settles
        _, exports = wb_wt_exports(work)
        nbd_port = free_port()
        nbd = procs.start("nbd", [
            args.fallow, "nbd", "--listen", f"127.0.0.1:{nbd_port}", *exports,
            "--pool", cluster.uri(), "--secret-file", os.path.join(work, "secret"),
            "--local-tier", "32M"], port=nbd_port)
        for export in ("wb", "wt"):
            threads.append(threading.Thread(
                target=fio_loop, args=(args, work, export, nbd_port, stop, tally, lock),
                daemon=True))
        threads.append(threading.Thread(target=pages_loop,
                                        args=(args, cluster, stop, tally, lock), daemon=True))
        for t in threads:
            t.start()
        started = time.monotonic()
        end = started + args.minutes * 60
        next_kill = started + args.kill_every
        victim = 0
        while time.monotonic() < end:
            now = time.monotonic()
            if now >= next_kill:
                log(f"SIGKILL node {victim}")
                cluster.kill(victim)
                kills.append((now - started, victim))
                time.sleep(5)
                cluster.start(victim)
                victim = (victim + 1) % 3
                next_kill = now + args.kill_every
            procs_now = {"nbd": rss_and_fds(nbd.pid)}
            for i, node in enumerate(cluster.nodes):
                procs_now[f"node{i}.{cluster.lives[i]}"] = rss_and_fds(node.pid)
            samples.append({"t": time.monotonic() - started, "procs": procs_now})
            with lock:
                brief = {k: (v.get("errors", 0), v.get("verify_failures", v.get("wrong", 0)))
                         for k, v in tally.items()}
            log(f"{(time.monotonic() - started) / 60:.1f} min: (errors, wrong) {brief}; "
                f"nbd RSS {(procs_now['nbd'][0] or 0) / (1 << 20):.0f} MiB")
            time.sleep(SAMPLE_EVERY)
        stop.set()
        for t in threads:
            t.join(timeout=args.fio_seconds * 5 + 180)
    finally:
        stop.set()
        procs.stop_all()
        if cluster:
            cluster.cleanup()
        shutil.rmtree(work, ignore_errors=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d-%H%M")
    head = {"date": stamp, "commit": git_commit(), "version": built,
            "command": " ".join(["python3", "bench/soak.py", *sys.argv[1:]]),
            "minutes": args.minutes, "kill_every": args.kill_every,
            "warmup_minutes": args.warmup_minutes}
    verdicts = judge(samples, args.warmup_minutes * 60, NODE_RSS_BOUND)
    out_dir = os.path.join(ROOT, "bench/out")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"soak-{stamp}.jsonl"), "w") as f:
        for line in [head, {"tally": tally}, {"kills": kills}, {"verdicts": verdicts}] + samples:
            f.write(json.dumps(line) + "\n")
    png = f"bench/out/soak-{stamp}.png"
    plot(samples, kills, os.path.join(ROOT, png))
    text = section(head, tally, verdicts, kills, png)
    print(text)
    if not args.no_write:
        write_section(MARKER, text)
    bad = (sum(tally[e]["errors"] + tally[e]["verify_failures"] for e in ("wb", "wt"))
           + tally["pages"]["wrong"] + tally["pages"]["errors"] + tally["pages"]["failed_runs"]
           + sum(not (v["rss_ok"] and v["fds_ok"]) for v in verdicts.values()))
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
