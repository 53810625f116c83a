#!/usr/bin/env python3
"""Records and tables of bench/nbd_vs_nbdkit.sh (the NBD benchmark of issue #4).

    nbd_table.py record FIO.json [--metrics BEFORE AFTER] [--field K=V ...]   one JSON line
    nbd_table.py brief < LINE                                                one line of progress
    nbd_table.py table RESULTS.jsonl META.json                               the markdown section
    nbd_table.py write-section SECTION.md DOC                                put it between the markers of DOC

`table` can be rerun on the .jsonl and .meta.json files a run left in bench/out/.
"""

import json
import re
import statistics
import sys
from collections import defaultdict

START, END = "<!-- nbd-vs-nbdkit:start -->", "<!-- nbd-vs-nbdkit:end -->"

# The baselines and what each fallow configuration is compared with.
PAIRS = [
    ("f1_in", "mem", "fallow, all hits (working set inside the cache) / nbdkit memory"),
    ("f1_in", "store1", "fallow over the 1 ms store, working set inside the cache / the 1 ms store"),
    ("proxy1", "store1", "nbdkit's nbd plugin (a plain proxy) over the 1 ms store / the 1 ms store"),
    ("relay1", "store1", "a plain TCP relay (no NBD work) over the 1 ms store / the 1 ms store"),
    ("f1_x2", "store1", "fallow over the 1 ms store, working set 2 x the cache / the 1 ms store"),
    ("f1_empty", "store1", "fallow over the 1 ms store, no cache / the 1 ms store"),
    ("f1_empty", "relay1", "fallow over the 1 ms store, no cache / the plain TCP relay over it"),
    ("f5_in", "store5", "fallow over the 5 ms store, working set inside the cache / the 5 ms store"),
    ("f5_x2", "store5", "fallow over the 5 ms store, working set 2 x the cache / the 5 ms store"),
    ("f5_empty", "store5", "fallow over the 5 ms store, no cache / the 5 ms store"),
    ("f1_q", "store1", "fallow over the 1 ms store, working set 1/4 x the cache / the 1 ms store"),
    ("f1_c", "store1", "fallow over the 1 ms store, working set 1 x the cache / the 1 ms store"),
    ("f1_x4", "store1", "fallow over the 1 ms store, working set 4 x the cache / the 1 ms store"),
]
ORDER = ["mem", "store1", "proxy1", "relay1", "store5", "f1_q", "f1_in", "f1_c", "f1_x2", "f1_x4", "f1_empty",
         "f5_in", "f5_x2", "f5_empty"]
BUSY = 0.3  # CPUs kept busy by other work above which a run is flagged


def parse_metrics(path):
    tiers = {}
    for line in open(path):
        m = re.match(r'fallow_nbd_cache_pages_read_total\{[^}]*tier="(\w+)"[^}]*\}\s+(\d+)', line)
        if m:
            tiers[m.group(1)] = int(m.group(2))
    return tiers


def record(argv):
    fio_path, rest = argv[0], argv[1:]
    rec = {}
    metrics = None
    i = 0
    while i < len(rest):
        if rest[i] == "--metrics":
            metrics = rest[i + 1], rest[i + 2]
            i += 3
        elif rest[i] == "--field":
            k, v = rest[i + 1].split("=", 1)
            rec[k] = v
            i += 2
        else:
            sys.exit(f"unknown argument {rest[i]}")
    text = open(fio_path).read()
    job = json.loads(text[text.index("{"):])["jobs"][0]
    read = job["read"]
    pct = read["lat_ns"].get("percentile", {})
    rec.update({
        "round": int(rec["round"]), "qd": int(rec["qd"]), "ws_mib": int(rec["ws_mib"]),
        "others": int(rec.get("others", 0)),
        "iops": read["iops"],
        "ios": read["total_ios"],
        "lat_mean_us": read["lat_ns"]["mean"] / 1e3,
        "lat_p50_us": pct.get("50.000000", 0) / 1e3,
        "lat_p99_us": pct.get("99.000000", 0) / 1e3,
        "fio_cpus": (job["usr_cpu"] + job["sys_cpu"]) / 100,
        "error": job["error"],
    })
    # CPUs kept busy during the run: by the servers (fallow and its store, or nbdkit), by fio,
    # and by everything else (other processes, steal; interrupts are left out).
    clk = int(rec.pop("clk"))
    w0, b0, s0 = (float(x) for x in rec.pop("cpu_before").split())
    w1, b1, s1 = (float(x) for x in rec.pop("cpu_after").split())
    wall = max(w1 - w0, 1e-3)
    rec["wall_s"] = wall
    rec["server_cpus"] = (s1 - s0) / clk / wall
    rec["busy_cpus"] = (b1 - b0) / clk / wall
    rec["other_cpus"] = max(0.0, rec["busy_cpus"] - rec["server_cpus"] - rec["fio_cpus"])
    if metrics:
        m0, m1 = parse_metrics(metrics[0]), parse_metrics(metrics[1])
        d = {t: m1.get(t, 0) - m0.get(t, 0) for t in ("local", "pool", "dirty", "backing")}
        total = sum(d.values())
        rec["pages"] = d
        rec["hit_ratio"] = (total - d["backing"]) / total if total else None
    print(json.dumps(rec))


def brief():
    r = json.loads(sys.stdin.readline())
    hit = f", hits {r['hit_ratio']:.3f}" if r.get("hit_ratio") is not None else ""
    print(f"{r['config']:9} QD{r['qd']:<2} round {r['round']}: {r['iops']:9,.0f} IOPS, "
          f"p50 {r['lat_p50_us']:8.1f} µs{hit}, other CPUs {r['other_cpus']:.2f}")


def load(path):
    return [json.loads(line) for line in open(path) if line.strip()]


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def f_int(x):
    return "–" if x is None else f"{x:,.0f}"


def f_us(x):
    return "–" if x is None else (f"{x:,.0f}" if x >= 1000 else f"{x:.1f}")


def f_cpu(x):
    return "–" if x is None else (f"{x:.0f}" if x >= 10 else f"{x:.1f}")


def f_r(x):
    return "–" if x is None else f"{x:.2f}"


def table(results_path, meta_path):
    runs = load(results_path)
    meta = json.load(open(meta_path))
    by = defaultdict(list)  # (config, qd) -> runs
    for r in runs:
        # reads over the whole run (ramp included): IOPS x wall time is close enough
        r["cpu_us_per_read"] = r["server_cpus"] / r["iops"] * 1e6 if r["iops"] else None
        by[(r["config"], r["qd"])].append(r)
    # Variants (--variant TAG=...): CONFIG+TAG, shown after CONFIG and paired like it.
    tags = [v.split("=", 1)[0] for v in meta.get("variants", [])]
    order = [c + t for c in ORDER for t in [""] + [f"+{t}" for t in tags]]
    pairs = []
    for a, b, what in PAIRS:
        pairs.append((a, b, what))
        for t in tags:
            pairs.append((f"{a}+{t}", b, f"{what} [{t}]"))
    for c in ORDER:
        for t in tags:
            pairs.append((c, f"{c}+{t}", f"this build / [{t}]"))
    label = {r["config"]: r["label"] for r in runs}
    ws = {r["config"]: r["ws_mib"] for r in runs}
    cmd = {r["config"]: r["command"] for r in runs}

    def stat(cfg, qd, key):
        return med([r.get(key) for r in by.get((cfg, qd), [])])

    def ratio(a, b, qd, key):
        """Median over rounds of a/b, both from the same round."""
        ra = {r["round"]: r[key] for r in by.get((a, qd), [])}
        rb = {r["round"]: r[key] for r in by.get((b, qd), [])}
        return med([ra[k] / rb[k] for k in ra if k in rb and rb[k]])

    out = []
    p = out.append
    p(START)
    p("## NBD export against nbdkit (issue #4)")
    p("")
    p("`bench/nbd_vs_nbdkit.sh`: fio 4 KiB random reads (`ioengine=nbd`, one job, one connection) "
      "at QD 1 and QD 16 against `nbdkit memory` (the ceiling), nbdkit memory behind the delay "
      "filter at 1 ms and 5 ms (the backing store alone), and `fallow nbd` over that same "
      "delayed store. The stores hold random data (no zero pages). fallow's cache is an "
      f"in-process pool of {meta['pool']} plus a local tier of {meta['local_tier']} "
      f"(exclusive mode): {meta['cache_mib']} MiB. \"Inside the cache\" is a working set of half "
      f"of it ({meta['cache_mib'] // 2} MiB), \"2 x\" twice it ({meta['cache_mib'] * 2} MiB); "
      "cached instances were warmed by reading their working set once (64 KiB reads) before "
      "the rounds. \"No cache\" (the empty-pool row) is `--pool none --local-tier 0`: every "
      "read goes to the store, which is the worst case of an empty pool (an empty pool that "
      "fills up during the run would turn into one of the cached rows).")
    p("")
    p(f"| machine | {meta['nproc']} vCPUs ({meta['cpu']}), {meta['mem']}, kernel {meta['kernel']}; "
      "client and servers share the CPUs |")
    p("|---|---|")
    dirty = ""
    if meta["dirty"]:
        dirty = (" plus uncommitted changes to " + ", ".join(f"`{d}`" for d in meta["dirty"]))
    p(f"| commit | `{meta['commit']}`{dirty} |")
    p(f"| command | `{meta['command']}` |")
    for v in meta.get("variants", []):
        tag, spec = v.split("=", 1)
        binary, _, params = spec.partition(",")
        p(f"| variant `{tag}` | binary {'`' + binary + '`' if binary else 'the same'}"
          f"{', URI parameters `' + params + '`' if params else ''}: rows `CONFIG+{tag}` |")
    p(f"| tools | {meta['fio']}, {meta['nbdkit']} |")
    p(f"| fio | `rw=randread bs=4k iodepth=1/16 norandommap randrepeat=0 time_based "
      f"runtime={meta['runtime']} ramp_time={meta['ramp']} lat_percentiles=1 offset=0 size=WS` |")
    p(f"| rounds | {meta['rounds']}; within a round, the configurations of a group "
      "(ceiling + 1 ms, 5 ms, plot points) ran back to back, in an order rotated each round |")
    p(f"| date | {meta['date']} |")
    p("")

    # Medians per configuration.
    p("| configuration | working set | QD 1 IOPS | QD 1 latency p50 / p99 µs | QD 16 IOPS | "
      "QD 16 latency p50 / p99 µs | hit ratio QD 1 / QD 16 | server CPU µs per read QD 1 / QD 16 "
      "| other CPUs QD 1 / QD 16 |")
    p("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cfg in order:
        if not (by.get((cfg, 1)) or by.get((cfg, 16))):
            continue
        hit = [stat(cfg, q, "hit_ratio") for q in (1, 16)]
        hit_s = "–" if cfg in ("mem", "store1", "store5", "proxy1", "relay1") else " / ".join(
            "–" if h is None else f"{h:.3f}" for h in hit)
        p(f"| `{cfg}`: {label[cfg]} | {ws[cfg]} MiB | {f_int(stat(cfg, 1, 'iops'))} | "
          f"{f_us(stat(cfg, 1, 'lat_p50_us'))} / {f_us(stat(cfg, 1, 'lat_p99_us'))} | "
          f"{f_int(stat(cfg, 16, 'iops'))} | "
          f"{f_us(stat(cfg, 16, 'lat_p50_us'))} / {f_us(stat(cfg, 16, 'lat_p99_us'))} | {hit_s} | "
          f"{f_cpu(stat(cfg, 1, 'cpu_us_per_read'))} / {f_cpu(stat(cfg, 16, 'cpu_us_per_read'))} | "
          f"{f_r(stat(cfg, 1, 'other_cpus'))} / {f_r(stat(cfg, 16, 'other_cpus'))} |")
    p("")
    p(f"Medians of {meta['rounds']} rounds. Latency is fio's total latency (submission to "
      "completion). The hit ratio is (local-tier + pool hits) / pages read, from fallow's "
      "metrics over the whole run (ramp included). Server CPU per read: the CPU time of the "
      "processes serving the reads (nbdkit; or fallow plus its store; or nbdkit's proxy plus "
      "the store) over the run, divided by the reads. \"Other CPUs\": CPU-seconds per second "
      "used by everything but those servers and fio during the run (other processes, steal "
      "time; interrupts left out).")
    p("")

    # Ratios per pair.
    p("| pair (per-round ratio, median) | QD 1 IOPS | QD 1 latency p50 | QD 1 mean latency | "
      "QD 16 IOPS | QD 16 latency p50 |")
    p("|---|---:|---:|---:|---:|---:|")
    for a, b, what in pairs:
        if not any(by.get((a, q)) and by.get((b, q)) for q in (1, 16)):
            continue
        p(f"| `{a}` / `{b}`: {what} | {f_r(ratio(a, b, 1, 'iops'))} | "
          f"{f_r(ratio(a, b, 1, 'lat_p50_us'))} | {f_r(ratio(a, b, 1, 'lat_mean_us'))} | "
          f"{f_r(ratio(a, b, 16, 'iops'))} | {f_r(ratio(a, b, 16, 'lat_p50_us'))} |")
    p("")
    p("A ratio is taken within one round (the two ran a few seconds apart), then the median "
      "over the rounds; it need not equal the ratio of the medians above. Above 1 is better "
      "for fallow in IOPS and worse in latency.")
    p("")

    busy = sorted({f"`{r['config']}` QD {r['qd']} round {r['round']} ({r['other_cpus']:.2f})"
                   for r in runs if r["other_cpus"] > BUSY},
                  key=lambda s: s)
    others = sorted({f"`{r['config']}` QD {r['qd']} round {r['round']}" for r in runs if r["others"]})
    notes = []
    if busy:
        notes.append(f"**The machine was busy:** other work kept more than {BUSY} CPUs busy during "
                     f"{len(busy)} of {len(runs)} runs: " + ", ".join(busy) + ".")
    if others:
        notes.append("Another benchmark (`fallow bench pages`, memcached, governor.py or "
                      "node_vs_memcached) was running at the end of: " + ", ".join(others) + ".")
    if meta["gave_up"]:
        notes.append(f"Waiting for other benchmarks to finish gave up {meta['gave_up']} time(s) "
                     "(after 15 min for one block, or once 30 min of waiting in all had passed); "
                     "those blocks ran alongside them.")
    if "redone" in meta:
        notes.append(f"{meta['redone']} run(s) were redone because other work took more than "
                     f"{meta['busy_limit']} CPUs during them (at most twice per run; the "
                     "discarded runs are kept in the `.discarded.jsonl` file next to the "
                     f"results), after waiting for an idle machine ({meta['idle_waited_s']} s "
                     "in all).")
    notes.append(f"Waited {meta['waited_s']} s in all for other benchmarks to finish before "
                 f"measurement blocks. Load average at the end: {meta['loadavg_end']}.")
    p(" ".join(notes))
    p("")

    # What a miss costs fallow, and what a plain proxy loses.
    fe, st, px = (stat(c, 16, "cpu_us_per_read") for c in ("f1_empty", "store1", "proxy1"))
    fi, mm = stat("f1_in", 16, "cpu_us_per_read"), stat("mem", 16, "cpu_us_per_read")
    if None not in (fe, st, fi, mm):
        txt = (f"At QD 16, a read that misses costs fallow about {fe - st:.0f} µs of CPU "
               f"(fallow + store {fe:.0f} µs per read against the store's own {st:.0f} µs), "
               f"a hit about {fi:.0f} µs (nbdkit memory: {mm:.0f} µs). ")
        if px is not None:
            txt += (f"nbdkit's own nbd plugin, a plain proxy, costs {px - st:.0f} µs per read "
                    f"and reaches {f_r(ratio('proxy1', 'store1', 16, 'iops'))} × the store "
                    f"alone at QD 16 ({f_r(ratio('proxy1', 'store1', 1, 'iops'))} × at QD 1). ")
        rl = stat("relay1", 16, "cpu_us_per_read")
        if rl is not None:
            txt += (f"A plain TCP relay, which copies bytes and does no NBD work at all, costs "
                    f"{rl - st:.0f} µs per read and reaches "
                    f"{f_r(ratio('relay1', 'store1', 16, 'iops'))} × the store alone at QD 16 "
                    f"({f_r(ratio('relay1', 'store1', 1, 'iops'))} × at QD 1): what the extra "
                    "hop alone costs on this machine, the floor for anything in front of the "
                    "store. ")
        txt += ("The client, the servers and the store share 2 vCPUs, so CPU per read "
                "is what bounds QD 16 here.")
        p(txt)
        p("")

    # Hits from the pool cost more than hits from the local tier (exclusive mode: a pool hit
    # is a take, and the page the local tier evicts for it goes back into the pool).
    def pool_share(cfg):
        xs = [r["pages"]["pool"] / max(1, sum(r["pages"].values()))
              for r in by.get((cfg, 16), []) if r.get("pages")]
        return med(xs)
    rows = [(c, stat(c, 16, "iops"), stat(c, 16, "cpu_us_per_read"), pool_share(c),
             stat(c, 16, "hit_ratio")) for c in ("f1_q", "f1_in", "f1_c")]
    rows = [r for r in rows if None not in r]
    if len(rows) >= 2:
        p("All hits, but not all alike (QD 16, fallow over the 1 ms store): " + "; ".join(
            f"`{c}` {ps * 100:.0f} % of reads from the pool, {iops:,.0f} IOPS, {cpu:.0f} µs "
            f"of CPU per read" for c, iops, cpu, ps, _ in rows) + ". In exclusive mode a pool "
            "hit takes the page out of the pool, and the page the local tier evicts for it is "
            "put back by the demoter: two pool operations per pool hit, against none for a "
            "local-tier hit.")
        p("")

    # Targets.
    hit_in = [stat("f1_in", q, "hit_ratio") for q in (1, 16)]
    q16 = ratio("f1_in", "mem", 16, "iops")
    l1 = ratio("f1_in", "mem", 1, "lat_p50_us")
    l1m = ratio("f1_in", "mem", 1, "lat_mean_us")

    def yes(ok):
        return "–" if ok is None else ("yes" if ok else "**no**")

    def hr(h):
        return "–" if h is None else f"{h:.3f}"

    p("| target (DESIGN.md) | measured (per-round ratios, medians) | met? |")
    p("|---|---|---|")
    p(f"| all hits: QD 16 IOPS ≥ 0.8 × nbdkit memory | `f1_in` / `mem` at QD 16: {f_r(q16)} "
      f"(hit ratio {hr(hit_in[1])}) | {yes(None if q16 is None else q16 >= 0.8)} |")
    p(f"| all hits: QD 1 latency ≤ 1.3 × nbdkit memory | `f1_in` / `mem` at QD 1: p50 {f_r(l1)}, "
      f"mean {f_r(l1m)} (hit ratio {hr(hit_in[0])}) | "
      f"{yes(None if l1 is None else (l1 <= 1.3 and (l1m or 0) <= 1.3))} |")
    five = []
    for cfg in ("f1_q", "f1_in", "f1_c", "f1_x2", "f1_x4"):
        for q in (1, 16):
            h = stat(cfg, q, "hit_ratio")
            x = ratio(cfg, "store1", q, "iops")
            if h is not None and h >= 0.85 and x is not None:
                five.append((cfg, q, h, x))
    if five:
        txt = "; ".join(f"`{c}` QD {q}: {x:.2f} × (hit ratio {h:.3f})" for c, q, h, x in five)
        ok_q = {q: all(x >= 5 for c, qq, h, x in five if qq == q)
                for q in (1, 16) if any(qq == q for _, qq, _, _ in five)}
        if all(ok_q.values()):
            met = "yes"
        elif any(ok_q.values()):
            met = "at QD " + " and ".join(str(q) for q in ok_q if ok_q[q]) + " only"
        else:
            met = "**no**"
        p(f"| ≥ 5 × the 1 ms store at hit ratio ≥ 0.85 | {txt} | {met} |")
    else:
        p("| ≥ 5 × the 1 ms store at hit ratio ≥ 0.85 | no run reached a hit ratio of 0.85 "
          "(or no hit ratios: fallow without --metrics) | – |")
    empty = []
    for cfg, base in (("f1_empty", "store1"), ("f5_empty", "store5")):
        for q in (1, 16):
            x = ratio(cfg, base, q, "iops")
            if x is not None:
                empty.append((cfg, base, q, x))
    if empty:
        txt = "; ".join(f"`{c}` / `{b}` QD {q}: {x:.2f}" for c, b, q, x in empty)
        floor = [(q, ratio("relay1", "store1", q, "iops")) for q in (1, 16)]
        floor = [(q, x) for q, x in floor if x is not None]
        if floor:
            txt += " (a plain TCP relay, `relay1` / `store1`: " + "; ".join(
                f"QD {q} {x:.2f}" for q, x in floor) + ")"
        p(f"| no cache: ≥ 0.98 × the store alone | {txt} | "
          f"{yes(all(x >= 0.98 for *_, x in empty))} |")
    p("")
    # The section lives in docs/benchmarks-runs.md: the link is relative to docs/.
    p("![IOPS against working-set size](img/nbd-iops-vs-working-set.png)")
    p("")
    p("The plot: fallow over the 1 ms store at QD 16, median IOPS against the working-set size "
      f"(1/4 to 4 × its {meta['cache_mib']} MiB cache), each point labelled with its hit ratio; "
      "the store alone and nbdkit memory (same QD) are the reference lines.")
    p("")
    p("Commands (PORT: a free port of 127.0.0.1, PORT_1MS / PORT_5MS: the delayed stores; "
      "the stores are filled first with "
      f"`nbdcopy --no-extents -- [ nbdkit random {meta['export_mib']}M seed=42 ] nbd://127.0.0.1:PORT/`; "
      "cached fallow instances are warmed with `fio --rw=read --bs=64k --iodepth=4 --size=WS`):")
    p("")
    p("```sh")
    seen = set()
    for cfg in order:
        if cfg in cmd and cmd[cfg] not in seen:
            seen.add(cmd[cfg])
            p(cmd[cfg])
    p("fio --name=r --ioengine=nbd --uri=nbd://127.0.0.1:PORT/[d] --rw=randread --bs=4k "
      f"--iodepth=QD --offset=0 --size=WS --norandommap --randrepeat=0 --time_based "
      f"--runtime={meta['runtime']} --ramp_time={meta['ramp']} --lat_percentiles=1 "
      "--output-format=json")
    p("```")
    p(END)
    print("\n".join(out))


def write_section(section_path, target):
    section = open(section_path).read().strip() + "\n"
    text = open(target).read()
    if START in text and END in text:
        a = text.index(START)
        b = text.index(END) + len(END)
        text = text[:a] + section.rstrip("\n") + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n" + section
    with open(target, "w") as f:
        f.write(text)


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "record":
        record(args)
    elif cmd == "brief":
        brief()
    elif cmd == "table" and len(args) == 2:
        table(*args)
    elif cmd == "write-section" and len(args) == 2:
        write_section(*args)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
