#!/usr/bin/env python3
"""The tables of bench/node_vs_memcached.sh, from its raw JSON lines (one `fallow bench
pages --json` report per run, plus the script's `config`, `round` and CPU fields).

    python3 bench/node_vs_memcached_table.py RESULTS.jsonl [--configs FILE] [--load-end TEXT]

--configs names the configurations in table order, one `name|description` a line (the
script passes its list); without it, they come from the results in order of appearance.
Prints markdown on stdout: the figures of each node (`fallow`, and `fallow-poll` when the
run had a polling node) with its ratios to memcached, the CPU use of each side and the
servers' CPU per page, and the targets of DESIGN.md and issue #27 with a verdict each.
"""

import argparse
import json
import statistics

LATENCY = ("p50", "p99", "p999")
# The nodes a run may have measured, in table order, and what each is.
NODES = {"fallow": "sleeps between requests", "fallow-poll": "polls its sockets (`--poll-us`)"}
# Other work, in CPUs, above which a row is flagged as disturbed.
BUSY = 0.25


def field(r, name):
    if name in LATENCY:
        return r["latency_us"][name]
    if name == "cpu_us_per_page":
        return (r.get("server_cpu") or {}).get("us_per_page")
    return r.get(name)


def fmt(x, nd=0):
    return "n/a" if x is None else f"{x:,.{nd}f}"


class Results:
    def __init__(self, rows):
        self.rows = rows

    def median(self, config, server, name):
        vals = [field(r, name) for r in self.rows if r["config"] == config and r["server"] == server]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    def nodes(self):
        servers = {r["server"] for r in self.rows}
        return [n for n in NODES if n in servers]

    def paired(self, config, name, node="fallow"):
        """Median over rounds of node / memcached within one round: the two ran one just
        after the other, so a slow spell of the shared machine mostly cancels out."""
        by_round = {}
        for r in self.rows:
            if r["config"] == config:
                by_round.setdefault(r["round"], {})[r["server"]] = field(r, name)
        ratios = [v[node] / v["memcached"] for v in by_round.values() if v.get(node) is not None and v.get("memcached")]
        return statistics.median(ratios) if ratios else None

    def best(self, server, configs):
        """(median pages/s, config) of the server's best configuration among `configs`."""
        scored = [(self.median(c, server, "pages_per_s"), c) for c in configs]
        scored = [s for s in scored if s[0] is not None]
        return max(scored, default=(None, None))


def figures(res, desc):
    print("| configuration | node | node pages/s | memcached pages/s | ratio | node p50 µs | memcached p50 µs "
          "| p50 ratio | node p99 / p99.9 µs | memcached p99 / p99.9 µs |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for config, what in desc.items():
        med = lambda server, name, nd=0: fmt(res.median(config, server, name), nd)
        tail = lambda s: f"{med(s, 'p99', 1)} / {med(s, 'p999', 1)}"
        for node in res.nodes() or ["fallow"]:
            print(f"| `{config}`: {what} | `{node}` | {med(node, 'pages_per_s')} | {med('memcached', 'pages_per_s')} "
                  f"| {fmt(res.paired(config, 'pages_per_s', node), 2)} | {med(node, 'p50', 1)} "
                  f"| {med('memcached', 'p50', 1)} | {fmt(res.paired(config, 'p50', node), 2)} "
                  f"| {tail(node)} | {tail('memcached')} |")


def cpu(res, desc):
    if not any("server_cpus" in r for r in res.rows):
        return False
    print("CPUs kept busy during a run (medians, in CPU-seconds per second, warm-up included): by")
    print("the server under test, by the load generator, and by everything else on the machine")
    print("(other processes, and the steal time of this VM; interrupt time is left out, as our own")
    print("loopback traffic fills it).")
    print()
    servers = res.nodes() + ["memcached"]
    print("| configuration | " + " | ".join(f"`{s}` | its client | other" for s in servers) + " |")
    print("|---|" + "---:|---:|---:|" * len(servers))
    for config in desc:
        cells = [fmt(res.median(config, s, name), 2) for s in servers
                 for name in ("server_cpus", "client_cpus", "other_cpus")]
        print(f"| `{config}` | " + " | ".join(cells) + " |")
    busy = [f"`{c}` ({s}, {res.median(c, s, 'other_cpus'):.2f})" for c in desc for s in servers
            if (res.median(c, s, "other_cpus") or 0) > BUSY]
    if busy:
        print()
        print(f"**The machine was busy:** other work kept more than {BUSY} CPUs busy (median) during the "
              f"runs of {', '.join(busy)}. Those rows measure the machine as much as the servers, and "
              f"not always for the worse: in a VM a QD 1 round trip can be faster while other work keeps "
              f"the CPUs awake, as an idle vCPU is slow to wake. Rerun on a quiet machine before quoting "
              f"them.")
    if any(r.get("server_cpu") for r in res.rows):
        print()
        print("Server CPU per page served (user + system time of the server's process over the measured "
              "phase only, from `--server-pid`, divided by the pages it served; medians, µs), and each "
              "node's per-round ratio to memcached:")
        print()
        nodes = res.nodes()
        print("| configuration | " + " | ".join(f"`{s}`" for s in servers) + " | "
              + " | ".join(f"`{n}` / memcached" for n in nodes) + " |")
        print("|---|" + "---:|" * (len(servers) + len(nodes)))
        for config in desc:
            cells = [fmt(res.median(config, s, "cpu_us_per_page"), 2) for s in servers]
            cells += [fmt(res.paired(config, "cpu_us_per_page", n), 2) for n in nodes]
            print(f"| `{config}` | " + " | ".join(cells) + " |")
    return True


def targets(res, desc):
    throughput = [c for c in desc if not c.endswith("qd1")]
    m_best, m_cfg = res.best("memcached", throughput)
    print("| target | node | measured (medians) | met? |")
    print("|---|---|---|---|")
    for node in res.nodes() or ["fallow"]:
        for label, prefix in (("", ""), (" with dedup on", "dup-")):
            q = f"{prefix}get-qd1"
            if q not in desc:
                continue
            p = res.paired(q, "p50", node)
            met = "n/a" if p is None else ("yes" if p <= 1 else "**no**")
            print(f"| get hit at QD 1{label}: p50 ≤ memcached's | `{node}` | {fmt(res.median(q, node, 'p50'), 1)} µs, "
                  f"memcached {fmt(res.median(q, 'memcached', 'p50'), 1)} µs; per-round ratio {fmt(p, 2)} | {met} |")
        for label, prefix in (("", ""), (" with dedup on", "dup-")):
            mine = [c for c in throughput if c.startswith("dup-") == bool(prefix)]
            f_best, f_cfg = res.best(node, mine)
            if f_best is not None and m_best:
                met = "yes" if f_best >= 250_000 and f_best >= 2 * m_best else "**no**"
                verdict = f"{fmt(f_best)} (`{f_cfg}`), memcached's best {fmt(m_best)} (`{m_cfg}`): {f_best / m_best:.2f} ×"
            else:
                met, verdict = "n/a", f"n/a, memcached's best {fmt(m_best)} (`{m_cfg}`)"
            print(f"| pipelined/batched{label}: ≥ 250 k pages/s and ≥ 2 × memcached's best | `{node}` | {verdict} | {met} |")
        if "get-batched" in desc:
            c = res.paired("get-batched", "cpu_us_per_page", node)
            met = "n/a" if c is None else ("yes" if c <= 0.8 else "**no**")
            mine, theirs = (fmt(res.median("get-batched", s, "cpu_us_per_page"), 2) for s in (node, "memcached"))
            print(f"| server CPU per page at the same batched load (`get-batched`) ≤ 0.8 × memcached's | `{node}` "
                  f"| {mine} µs, memcached {theirs} µs; per-round ratio {fmt(c, 2)} | {met} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results")
    ap.add_argument("--configs")
    ap.add_argument("--load-end", default="")
    args = ap.parse_args()
    rows = [json.loads(line) for line in open(args.results) if line.strip()]
    if args.configs:
        desc = dict(line.split("|", 1) for line in open(args.configs).read().splitlines() if line)
    else:
        desc = {r["config"]: r["config"] for r in rows}
    res = Results(rows)
    figures(res, desc)
    print()
    n_rounds = max((r["round"] for r in rows), default=0)
    wrong = sum(r["wrong"] for r in rows)
    misses = sum(r["misses"] for r in rows if r["workload"] == "get")
    end = f" Load average at the end: {args.load_end}." if args.load_end else ""
    print(f"Medians of {n_rounds} round{'s' if n_rounds != 1 else ''}. A ratio is fallow / memcached within "
          f"one round (the two ran back to back), then the median over the rounds, so it need not equal "
          f"the ratio of the medians beside it; above 1 is better for fallow in pages/s and worse in "
          f"latency. Wrong pages read back: {wrong}; misses in the warmed get runs: {misses}.{end}")
    print()
    if cpu(res, desc):
        print()
    targets(res, desc)


if __name__ == "__main__":
    main()
