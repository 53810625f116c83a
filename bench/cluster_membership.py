#!/usr/bin/env python3
"""Cluster membership on 127.0.0.1: gossip bandwidth per node at three nodes, and how long
the others take to see a SIGKILLed node dead (and a restarted one alive again).

Starts three `fallow node` processes that join each other, reads each node's gossip
counters from its /metrics twice, RUNS times kills one node with SIGKILL, and times:
  * the `member failed` line in a survivor's log, against the moment of the kill;
  * the first `fallow stat --cluster --json` on a survivor that lists it dead (polled
    every 20 ms: one process start per poll, a few ms each);
then restarts it on the same addresses and times until a survivor lists it alive.
Every process started is stopped by its PID before the script exits.

    python3 bench/cluster_membership.py [--runs 5] [--bin target/release/fallow]
"""

import argparse
import json
import os
import platform
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime, timezone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port(kind):
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    def __init__(self, binary, secret, logdir, name, peers_gossip, listen, gossip, metrics):
        self.args = [binary, "node", "--listen", listen, "--gossip", gossip,
                     "--join", ",".join(peers_gossip), "--lend", "64M",
                     "--secret-file", secret, "--metrics", metrics]
        self.listen, self.gossip, self.metrics = listen, gossip, metrics
        self.log = os.path.join(logdir, name + ".log")
        self.proc = None

    def start(self):
        log = open(self.log, "a")
        env = dict(os.environ, FALLOW_LOG="info", NO_COLOR="1")
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=log,
                                     stdin=subprocess.DEVNULL, env=env)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", int(self.listen.split(":")[1])), 0.2).close()
                return
            except OSError:
                time.sleep(0.02)
        raise SystemExit(f"node {self.listen} did not start; see {self.log}")

    def stop(self, sig=signal.SIGTERM):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def gossip_counters(self):
        text = urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5).read().decode()
        values = {}
        for name in ("gossip_sent_bytes", "gossip_sent_datagrams", "gossip_received_bytes"):
            m = re.search(rf"^fallow_{name} (\d+)$", text, re.M)
            values[name] = int(m.group(1)) if m else 0
        return values


def stat(binary, secret, node):
    out = subprocess.run([binary, "stat", "--cluster", "--json", "--timeout", "2", "--node", node,
                          "--secret-file", secret], capture_output=True, check=True)
    return json.loads(out.stdout)


def state_of(listing, member_id):
    for m in listing["members"]:
        if m["id"] == member_id:
            return m["state"], m["generation"]
    return None, None


def log_time(path, pattern, after):
    """The timestamp of the first line of `path` matching `pattern` logged after `after`."""
    ansi = re.compile(r"\x1b\[[0-9;]*m")
    with open(path) as f:
        for line in f:
            line = ansi.sub("", line)
            if pattern not in line:
                continue
            stamp = datetime.strptime(line.split()[0], "%Y-%m-%dT%H:%M:%S.%fZ")
            t = stamp.replace(tzinfo=timezone.utc).timestamp()
            if t >= after:
                return t
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/debug/fallow"))
    ap.add_argument("--settle", type=float, default=2.0, help="seconds between runs")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="fallow-cluster-bench-")
    secret = os.path.join(tmp, "secret")
    with open(secret, "w") as f:
        f.write("cluster-bench-secret-0123456789abcdef\n")
    addrs = [(f"127.0.0.1:{free_port(socket.SOCK_STREAM)}", f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}",
              f"127.0.0.1:{free_port(socket.SOCK_STREAM)}") for _ in range(3)]
    nodes = []
    for i, (listen, gossip, metrics) in enumerate(addrs):
        peers = [g for j, (_, g, _) in enumerate(addrs) if j != i]
        nodes.append(Node(args.bin, secret, tmp, f"n{i}", peers, listen, gossip, metrics))
    try:
        for n in nodes:
            n.start()
        survivor, victim = nodes[0], nodes[1]
        deadline = time.time() + 10
        while stat(args.bin, secret, survivor.listen)["alive"] != 3:
            if time.time() > deadline:
                raise SystemExit("the three nodes did not converge")
            time.sleep(0.05)
        time.sleep(2)
        window = 10.0
        before = [n.gossip_counters() for n in nodes]
        time.sleep(window)
        after = [n.gossip_counters() for n in nodes]
        print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} cores, "
              f"kernel {platform.release()}; binary {args.bin}")
        print(f"\ngossip at 3 idle nodes, over {window:.0f} s (UDP payload; +28 B IP/UDP "
              "header per datagram on the wire):")
        for n, b, a in zip(nodes, before, after):
            sent = (a["gossip_sent_bytes"] - b["gossip_sent_bytes"]) / window
            dgrams = (a["gossip_sent_datagrams"] - b["gossip_sent_datagrams"]) / window
            recv = (a["gossip_received_bytes"] - b["gossip_received_bytes"]) / window
            print(f"  {n.listen}: sent {sent:,.0f} B/s in {dgrams:.0f} datagrams/s "
                  f"({sent / max(dgrams, 1):.0f} B each), received {recv:,.0f} B/s")
        logged, polled, rejoined = [], [], []
        for run in range(args.runs):
            _, generation = state_of(stat(args.bin, secret, survivor.listen), victim.listen)
            killed = time.time()
            victim.stop(signal.SIGKILL)
            seen = None
            while time.time() - killed < 10:
                state, _ = state_of(stat(args.bin, secret, survivor.listen), victim.listen)
                if state == "dead":
                    seen = time.time() - killed
                    break
                time.sleep(0.02)
            failed_at = log_time(survivor.log, "member failed", killed)
            log_delay = failed_at - killed if failed_at else None
            victim.start()
            restarted = time.time()
            back = None
            while time.time() - restarted < 10:
                state, gen = state_of(stat(args.bin, secret, survivor.listen), victim.listen)
                if state == "alive" and gen != generation:
                    back = time.time() - restarted
                    break
                time.sleep(0.02)
            print(f"run {run + 1}: failure logged after {log_delay:.3f} s, "
                  f"`stat --cluster` shows it dead after {seen:.3f} s, "
                  f"alive again {back:.3f} s after the restart's TCP port opened")
            logged.append(log_delay)
            polled.append(seen)
            rejoined.append(back)
            time.sleep(args.settle)
        print(f"\nmedian over {args.runs} runs: failure logged {statistics.median(logged):.3f} s "
              f"(min {min(logged):.3f}, max {max(logged):.3f}); "
              f"stat shows dead {statistics.median(polled):.3f} s; "
              f"rejoin {statistics.median(rejoined):.3f} s")
    finally:
        for n in nodes:
            n.stop()
        for name in os.listdir(tmp):
            os.remove(os.path.join(tmp, name))
        os.rmdir(tmp)


if __name__ == "__main__":
    sys.exit(main())
