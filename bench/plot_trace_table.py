#!/usr/bin/env python3
"""Plots the miss-ratio table printed by bench/trace_compare.py: one panel per trace, miss
ratio against cache size for each of our policies, with libCacheSim's best online policy
as a dashed reference.

    python3 bench/trace_compare.py ... > bench/out/traces.md
    python3 bench/plot_trace_table.py bench/out/traces.md docs/img/trace-miss-ratios.png

Needs matplotlib (`pip install matplotlib`).
"""

import sys
from collections import defaultdict

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

# The traces that rank policies (the SNIA samples are too short to), in a readable order.
PANELS = ["arc_OLTP", "arc_P2", "arc_P3", "cloudPhysicsIO", "cloudPhysicsIO (reads only)",
          "lirs_2_pools", "lirs_cpp", "lirs_cs", "lirs_gli", "lirs_loop", "lirs_multi1",
          "lirs_multi2", "lirs_multi3", "lirs_ps", "lirs_scan", "lirs_sprite", "lirs_zigzag"]


def read(path):
    header, rows, default = None, defaultdict(list), "adaptive"
    for line in open(path):
        if line.startswith("Default policy `"):
            default = line.split("`")[1]
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] == "trace":
            header = cells
            continue
        if header is None or set(cells[0]) <= set("-: "):
            continue
        rows[cells[0]].append(dict(zip(header, cells)))
    return header, rows, default


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    header, rows, default = read(sys.argv[1])
    ours = [h for h in header if h.startswith("ours ")]
    panels = [p for p in PANELS if p in rows]
    cols = 6
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols,
                             figsize=(3.2 * cols, 2.7 * ((len(panels) + cols - 1) // cols)))
    for ax, name in zip(axes.flat, panels):
        data = rows[name]
        x = [int(r["pages"]) for r in data]
        ax.plot(x, [float(r["ref best online"]) for r in data], "--", color="grey", lw=1.2,
                label="ref best online")
        for h in ours:
            style = dict(lw=2.4, color="black", zorder=5) if h == f"ours {default}" else dict(lw=1)
            ax.plot(x, [float(r[h]) for r in data], marker=".", label=h[5:], **style)
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_title(name, fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower right", fontsize=9)
    fig.supxlabel("cache size (4 KiB pages, log scale)")
    fig.supylabel("miss ratio")
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=72)


if __name__ == "__main__":
    main()
