#!/usr/bin/env python3
"""Plots IOPS at QD 16 against working-set size from the results of bench/nbd_vs_nbdkit.sh:
fallow over the 1 ms store (medians over the rounds, each point labelled with its hit
ratio), with the 1 ms store alone and nbdkit memory as reference lines.

    python3 bench/plot_nbd.py bench/out/nbd-vs-nbdkit-DATE.jsonl docs/img/nbd-iops-vs-working-set.png

Needs matplotlib (`pip install matplotlib`).
"""

import json
import statistics
import sys
from collections import defaultdict

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

CURVE = ["f1_q", "f1_in", "f1_c", "f1_x2", "f1_x4"]  # fallow over the 1 ms store, by size
QD = 16


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    runs = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
    by = defaultdict(list)
    for r in runs:
        if r["qd"] == QD:
            by[r["config"]].append(r)

    def med(cfg, key):
        xs = [r[key] for r in by[cfg] if r.get(key) is not None]
        return statistics.median(xs) if xs else None

    points = sorted((by[c][0]["ws_mib"], med(c, "iops"), med(c, "hit_ratio"))
                    for c in CURVE if by.get(c))
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    x = [p[0] for p in points]
    ax.plot(x, [p[1] for p in points], marker="o", lw=2.2, color="black",
            label="fallow over the 1 ms store")
    for ws, iops, hit in points:
        if hit is not None:
            ax.annotate(f"hits {hit:.2f}", (ws, iops), textcoords="offset points", xytext=(0, 7),
                        ha="center", fontsize=8)
    for cfg, name, style in (("mem", "nbdkit memory", dict(color="tab:green", ls="--")),
                             ("store1", "nbdkit + 1 ms delay (the store alone)",
                              dict(color="tab:red", ls=":"))):
        v = med(cfg, "iops")
        if v is not None:
            ax.axhline(v, lw=1.4, label=name, **style)
    cache = [r for r in runs if r["config"] == "f1_c"]  # the working set equal to the cache
    if cache:
        ax.axvline(cache[0]["ws_mib"], color="grey", lw=0.8)
        ax.annotate("cache size", (cache[0]["ws_mib"], 0), textcoords="offset points",
                    xytext=(3, 3), fontsize=8, color="grey")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    top = max([p[1] for p in points] + [med(c, "iops") or 0 for c in ("mem", "store1")])
    ax.set_ylim(0, top * 1.3)  # room for the legend above the lines
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v / 1000:g}k"))
    ax.set_xlabel("working set (MiB, log scale)")
    ax.set_ylabel(f"4 KiB random reads per second, QD {QD}")
    ax.set_title("fallow nbd: IOPS against working-set size", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=72)


if __name__ == "__main__":
    main()
