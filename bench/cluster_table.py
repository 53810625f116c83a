#!/usr/bin/env python3
"""Markdown tables (and a plot) from the JSON lines bench/cluster.sh writes.

    python3 bench/cluster_table.py RESULTS.jsonl [--plot docs/img/cluster-kill-latency.png]
    python3 bench/cluster_table.py --kill-round RESULTS.jsonl ROUND   (one line, for progress)

Parts (the `part` field of each line):
  capacity    get runs after a warm-up of twice the lent pages: pages still there
  throughput  batched puts and gets, pages/s
  kill        1-page gets at a bounded rate with a node SIGKILLed: latency windows from the
              per-request timeline (CSV: start_unix_ns,latency_ns,op), split at the kill
              and at the client's first sight of the node's failure (its `events`)
  metadata    the cluster client's summary bytes per page, and RSS growth over the warm-up
              against a plain Client
Every figure is the median over rounds; ranges are min-max.
"""

import argparse
import csv
import json
import statistics
import sys

PAGE = 4096


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def spread(values, fmt):
    """'median (min-max)' of values with fmt, or the one value."""
    values = [v for v in values if v is not None]
    if not values:
        return "–"
    m = fmt(statistics.median(values))
    if len(values) == 1:
        return m
    return f"{m} ({fmt(min(values))}–{fmt(max(values))})"


def thousands(v):
    return f"{v:,.0f}"


def percentile(sorted_values, q):
    """Nearest-rank percentile of an ascending list (q in 0..1)."""
    if not sorted_values:
        return None
    rank = max(1, int(-(-q * len(sorted_values) // 1)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


# ---------------------------------------------------------------- capacity and throughput


def capacity_table(rows):
    by = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)
    out = [
        "| cluster | lent (gossiped) | pages put | get hit ratio | pages still there (hit ratio × keys) | pages the nodes hold (`fallow stat`) | evicted / refused by the nodes | summary entries after the put | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, runs in by.items():
        lent = [sum(n["lendable"] or 0 for n in r["cluster"]["connected"]["nodes"]) for r in runs]
        ratio = [r["hits"] / max(r["hits"] + r["misses"], 1) for r in runs]
        resident = [q * r["keys"] for q, r in zip(ratio, runs)]
        held = [sum(s["pages"] for s in r["node_stats"] if s) for r in runs]
        evicted = [sum(s["evictions"] for s in r["node_stats"] if s) for r in runs]
        refused = [sum(s["puts_refused"] for s in r["node_stats"] if s) for r in runs]
        entries = [r["cluster"]["after_warmup"]["summary_pages"] for r in runs]
        lent_mib = med(lent) / 2**20
        out.append(
            f"| {name} | {lent_mib:.0f} MiB = {med(lent) / PAGE:,.0f} pages | {thousands(med([r['warmup_pages'] for r in runs]))} "
            f"| {spread(ratio, lambda v: f'{v:.3f}')} | {spread(resident, thousands)} "
            f"({med(resident) / (med(lent) / PAGE):.0%} of lent) | {spread(held, thousands)} "
            f"| {thousands(med(evicted))} / {thousands(med(refused))} | {thousands(med(entries))} "
            f"| {sum(r['errors'] for r in runs)} |"
        )
    return out


def throughput_table(rows):
    names, cols = [], []
    cell = {}
    for r in rows:
        name = r["target_name"]
        col = r["config"][len(name) + 1:]
        if name not in names:
            names.append(name)
        if col not in cols:
            cols.append(col)
        cell.setdefault((name, col), []).append(r)
    out = [
        "| target | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for name in names:
        cells = []
        for col in cols:
            runs = cell.get((name, col), [])
            cells.append(spread([r["pages_per_s"] for r in runs], lambda v: f"{v / 1000:.0f} k"))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    out.append("")
    out.append("Latency per request of 32 pages, p50 / p99 in µs (medians over rounds):")
    out.append("")
    out.append("| target | " + " | ".join(cols) + " |")
    out.append("|---|" + "---:|" * len(cols))
    for name in names:
        cells = []
        for col in cols:
            runs = cell.get((name, col), [])
            p50 = med([r["latency_us"]["p50"] for r in runs])
            p99 = med([r["latency_us"]["p99"] for r in runs])
            cells.append("–" if p50 is None else f"{p50:,.0f} / {p99:,.0f}")
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    bad = sum(r["errors"] + r["wrong"] for r in rows)
    out.append("")
    out.append(f"Errors and wrong pages over all throughput runs: {bad}.")
    return out


# ---------------------------------------------------------------- a node killed


def kill_analysis(r):
    """Windows of one kill round, by completion time of each request."""
    kill = r["kill_unix_ns"]
    port = r["victim"]
    events = [e for e in r["cluster"]["events"] if e["node"] == port and e["unix_ns"] >= kill - 50_000_000]
    seen = next((e["unix_ns"] for e in events if e["state"] != "alive"), None)
    dropped = next((e["unix_ns"] for e in events if e["state"] in ("suspect", "gone")), None)
    reqs = []
    with open(r["timeline_csv"]) as f:
        for row in csv.DictReader(f):
            start, lat = int(row["start_unix_ns"]), int(row["latency_ns"])
            reqs.append((start + lat, lat))
    reqs.sort()
    first = reqs[0][0] if reqs else kill
    end = reqs[-1][0] if reqs else kill
    # Skip the first half second: connections and caches settle.
    settle = first + 500_000_000
    detect = seen if seen is not None else end
    windows = {
        "before": [lat for t, lat in reqs if settle <= t < kill],
        "during": [lat for t, lat in reqs if kill <= t < detect],
        "after": [lat for t, lat in reqs if t >= detect],
        "after_membership": [lat for t, lat in reqs if dropped is not None and t >= dropped],
    }
    stats = {}
    for name, lats in windows.items():
        lats.sort()
        stats[name] = {
            "n": len(lats),
            "p50": percentile(lats, 0.50),
            "p99": percentile(lats, 0.99),
            "max": lats[-1] if lats else None,
        }
    return {
        "detect_ms": None if seen is None else (seen - kill) / 1e6,
        "dropped_ms": None if dropped is None else (dropped - kill) / 1e6,
        "windows": stats,
        "reqs": reqs,
        "kill": kill,
        "seen": seen,
        "dropped": dropped,
    }


def us(ns):
    return "–" if ns is None else f"{ns / 1000:,.0f}"


def kill_line(r, a):
    w = a["windows"]
    return (
        f"    kill round {r['round']}: client saw it {a['detect_ms'] if a['detect_ms'] is None else round(a['detect_ms'], 1)} ms "
        f"after the kill, membership dropped it after {a['dropped_ms'] if a['dropped_ms'] is None else round(a['dropped_ms'])} ms; "
        f"p50/p99/max µs before {us(w['before']['p50'])}/{us(w['before']['p99'])}/{us(w['before']['max'])}, "
        f"during ({w['during']['n']} req) max {us(w['during']['max'])}, "
        f"after {us(w['after']['p50'])}/{us(w['after']['p99'])}/{us(w['after']['max'])}; "
        f"errors {r['errors']}, misses {r['misses']}, wrong {r['wrong']}"
    )


def kill_table(rows):
    out = [
        "| round | kill → client skips the node | kill → membership drops it | before: n, p50 / p99 / max | kill → detection: n, max | after detection: n, p50 / p99 / max | after membership's verdict: p50 / p99 / max | added wait after detection, p50 / p99 | hits / misses / errors / wrong |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    analyses = []
    for r in sorted(rows, key=lambda r: r["round"]):
        a = kill_analysis(r)
        analyses.append((r, a))
        w = a["windows"]
        b, d, af, am = w["before"], w["during"], w["after"], w["after_membership"]
        add50 = None if af["p50"] is None or b["p50"] is None else af["p50"] - b["p50"]
        add99 = None if af["p99"] is None or b["p99"] is None else af["p99"] - b["p99"]
        detect = "–" if a["detect_ms"] is None else f"{a['detect_ms']:.1f} ms"
        dropped = "–" if a["dropped_ms"] is None else f"{a['dropped_ms']:.0f} ms"
        out.append(
            f"| {r['round']} | {detect} | {dropped} "
            f"| {b['n']:,}: {us(b['p50'])} / {us(b['p99'])} / {us(b['max'])} µs "
            f"| {d['n']}: {us(d['max'])} µs "
            f"| {af['n']:,}: {us(af['p50'])} / {us(af['p99'])} / {us(af['max'])} µs "
            f"| {us(am['p50'])} / {us(am['p99'])} / {us(am['max'])} µs "
            f"| {signed_us(add50)} / {signed_us(add99)} µs "
            f"| {r['hits']:,} / {r['misses']:,} / {r['errors']} / {r['wrong']} |"
        )
    if len(analyses) > 1:
        def m(key, window):
            return med([a["windows"][window][key] for _, a in analyses])
        add50 = med([
            a["windows"]["after"]["p50"] - a["windows"]["before"]["p50"]
            for _, a in analyses if a["windows"]["after"]["p50"] is not None
        ])
        add99 = med([
            a["windows"]["after"]["p99"] - a["windows"]["before"]["p99"]
            for _, a in analyses if a["windows"]["after"]["p99"] is not None
        ])
        det = med([a["detect_ms"] for _, a in analyses])
        drop = med([a["dropped_ms"] for _, a in analyses])
        out.append(
            f"| **median** | {'–' if det is None else f'{det:.1f} ms'} | {'–' if drop is None else f'{drop:.0f} ms'} "
            f"| {us(m('p50', 'before'))} / {us(m('p99', 'before'))} / {us(m('max', 'before'))} µs "
            f"| {us(m('max', 'during'))} µs "
            f"| {us(m('p50', 'after'))} / {us(m('p99', 'after'))} / {us(m('max', 'after'))} µs "
            f"| {us(m('p50', 'after_membership'))} / {us(m('p99', 'after_membership'))} / {us(m('max', 'after_membership'))} µs "
            f"| {signed_us(add50)} / {signed_us(add99)} µs "
            f"| errors in all rounds: {sum(r['errors'] for r, _ in analyses)} |"
        )
    return out, analyses


def signed_us(ns):
    return "–" if ns is None else f"{ns / 1000:+,.0f}"


def plot_kill(analyses, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no matplotlib: {path} not drawn)", file=sys.stderr)
        return False
    fig, axes = plt.subplots(len(analyses), 1, figsize=(9, 2.6 * len(analyses)), sharex=True,
                             squeeze=False)
    bucket = 50_000_000
    for ax, (r, a) in zip(axes[:, 0], analyses):
        kill = a["kill"]
        groups = {}
        for t, lat in a["reqs"]:
            groups.setdefault((t - kill) // bucket, []).append(lat)
        xs, p50, p99, mx = [], [], [], []
        for k in sorted(groups):
            lats = sorted(groups[k])
            xs.append((k + 0.5) * bucket / 1e9)
            p50.append(percentile(lats, 0.5) / 1000)
            p99.append(percentile(lats, 0.99) / 1000)
            mx.append(lats[-1] / 1000)
        ax.plot(xs, mx, ".", color="0.6", markersize=3, label="max")
        ax.plot(xs, p99, "-", color="tab:red", linewidth=1, label="p99")
        ax.plot(xs, p50, "-", color="tab:blue", linewidth=1, label="p50")
        ax.axvline(0, color="black", linestyle="--", linewidth=1)
        if a["dropped"] is not None:
            ax.axvline((a["dropped"] - kill) / 1e9, color="tab:green", linestyle=":", linewidth=1)
        ax.set_yscale("log")
        ax.set_ylabel("µs per get")
        ax.set_title(f"round {r['round']}: SIGKILL at 0 (dashed); membership drops the node (dotted)",
                     fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0, 0].legend(loc="upper left", fontsize=8)
    axes[-1, 0].set_xlabel("seconds from the SIGKILL (50 ms buckets, by completion time)")
    fig.suptitle("1-page gets through the cluster client, 3 nodes on 127.0.0.1, one SIGKILLed",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ---------------------------------------------------------------- metadata


def metadata_table(rows):
    cluster = [r for r in rows if r["config"] == "cluster"]
    plain = [r for r in rows if r["config"] == "plain"]
    out = [
        "| round | pages in the summary | summary heap bytes | bytes per page (summary's count) | RSS growth over the warm-up, cluster client | same, plain `Client` | difference per page |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def growth(r):
        rss = r.get("rss", {})
        if rss.get("connected") is None or rss.get("after_warmup") is None:
            return None
        return rss["after_warmup"] - rss["connected"]

    per, diffs = [], []
    for c in sorted(cluster, key=lambda r: r["round"]):
        p = next((x for x in plain if x["round"] == c["round"]), None)
        s = c["cluster"]["after_warmup"]
        bpp = s["summary_heap_bytes"] / max(s["summary_pages"], 1)
        per.append(bpp)
        gc, gp = growth(c), growth(p) if p else None
        diff = None if gc is None or gp is None else (gc - gp) / max(s["summary_pages"], 1)
        diffs.append(diff)
        out.append(
            f"| {c['round']} | {s['summary_pages']:,} | {s['summary_heap_bytes']:,} | {bpp:.2f} "
            f"| {'–' if gc is None else f'{gc / 2**20:.1f} MiB'} | {'–' if gp is None else f'{gp / 2**20:.1f} MiB'} "
            f"| {'–' if diff is None else f'{diff:.1f} B'} |"
        )
    out.append(
        f"| **median** | | | **{med(per):.2f}** | | | **{'–' if med(diffs) is None else f'{med(diffs):.1f} B'}** |"
    )
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results")
    p.add_argument("round", nargs="?", type=int)
    p.add_argument("--kill-round", action="store_true", help="print one line for kill round ROUND")
    p.add_argument("--plot", help="draw the kill rounds' latency over time to this PNG")
    args = p.parse_args()
    rows = load(args.results)
    if args.kill_round:
        r = next(r for r in rows if r["part"] == "kill" and r["round"] == args.round)
        print(kill_line(r, kill_analysis(r)))
        return
    parts = {}
    for r in rows:
        parts.setdefault(r["part"], []).append(r)
    out = []
    if "capacity" in parts:
        out += ["#### Capacity", "", *capacity_table(parts["capacity"]), ""]
    if "throughput" in parts:
        out += ["#### Throughput, pages/s (batches of 32 pages, 1 connection per node, QD = requests in flight)", "",
                *throughput_table(parts["throughput"]), ""]
    if "kill" in parts:
        table, analyses = kill_table(parts["kill"])
        out += ["#### A node SIGKILLed mid-run", "", *table, ""]
        if args.plot and plot_kill(analyses, args.plot):
            out += [f"![latency of 1-page gets around the kill]({args.plot})", ""]
    if "metadata" in parts:
        out += ["#### Metadata per placed page in the client", "", *metadata_table(parts["metadata"]), ""]
    print("\n".join(out))


if __name__ == "__main__":
    main()
