#!/usr/bin/env python3
"""The experiments of the systems fallow descends from, in real QEMU guests, each with and
without fallow in the same run (bench/vm.sh builds the binaries and calls this).

  puma-fio       Puma: a guest whose working set is 3 x its RAM, random 4 KiB O_DIRECT reads
                 (fio, QD1 and QD16) on a 1 ms and a 5 ms store, fallow in exclusive and
                 inclusive mode, after one warm-up pass.
  puma-postmark  Puma: Postmark on a fresh ext4 of a disk on the 1 ms store.
  puma-sqlite    Puma: point lookups in a sqlite3 database larger than the guest's RAM, on the
                 1 ms store: a warm-up pass, the guest's page cache dropped, the timed pass.
  tmem-clones    tmem: N guests booted at once from clones of one root file system, each
                 reading /usr (tar) several times; bytes the store served with and without
                 fallow, and the pool memory N clones use against one (dedup).
  cached-rados   Archipelago's cached: fio in a guest on a Ceph RADOS image through fallow
                 (write-through and write-back) against QEMU's own rbd driver, one-node cluster.
  swap           frontswap: a 128 MiB guest runs a memory hog as large as its RAM, more than
                 it has free, so nearly every page goes out to swap and comes back
                 (fallow-guest-tool memhog, every page verified), swapping to a disk on the
                 5 ms store, to nbdkit memory (the same store with no delay), and to a
                 `pool:` export of fallow nbd on one node and on a three-node cluster.

The store is nbdkit's file plugin behind its delay filter (and its stats filter, which counts
what reached the store); fallow is `fallow nbd` over that store with its pool in a separate
`fallow node` process (another machine's idle memory) and a 16 MiB local tier (for swap,
the store is nbdkit's memory plugin, and fallow's disk lives only in the pool). Every guest
has 1 vCPU and a time limit; the configurations of an experiment run one after the other in
each round, in an order that rotates between rounds, and every ratio is taken within a round
before the median over rounds.

Output: one JSON line per experiment on stdout ({"experiment", "baseline_s", "fallow_s",
"speedup", ...}), progress on stderr, every line also in bench/out/vm-DATE.jsonl.

    python3 bench/vm.py [--quick] [--rounds N] [--only NAMES] [--fallow BIN] [--guest BIN]
"""

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = ["puma-fio", "puma-postmark", "puma-sqlite", "tmem-clones", "cached-rados",
               "swap"]
MIB = 1 << 20


def log(msg):
    print(f"[vm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Lab:
    """Processes started for one configuration, stopped by PID when it closes, and a scratch
    directory for their logs."""

    def __init__(self, work, name):
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir, exist_ok=True)
        self.procs = []

    def spawn(self, name, argv, env=None):
        logf = open(os.path.join(self.dir, f"{name}.log"), "w")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                env=env, start_new_session=True)
        self.procs.append((name, proc, logf))
        return proc

    def log_of(self, name):
        with open(os.path.join(self.dir, f"{name}.log")) as f:
            return f.read()

    def stop(self, proc, sig=signal.SIGTERM, timeout=30):
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self):
        for _, proc, logf in reversed(self.procs):
            self.stop(proc)
            logf.close()
        self.procs = []

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


def free_port(kind=socket.SOCK_STREAM):
    """A free port of 127.0.0.1 for TCP (or `kind` = socket.SOCK_DGRAM: UDP), chosen by
    the OS (free when asked: the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what, proc, ready, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = ready()
        if value:
            return value
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}) before it was ready")
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready within {timeout} s")


def port_open(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


class Setup:
    """The binaries, images and settings shared by every experiment."""

    def __init__(self, args, work):
        self.args = args
        self.work = work
        self.fallow = args.fallow
        self.guest = args.guest
        images = json.loads(subprocess.run([self.guest, "image", "--debian"], check=True,
                                           stdout=subprocess.PIPE, text=True).stdout)
        self.root = images["debian_root"]
        self.versions = images["versions"] + images["debian_versions"]
        self.accel = subprocess.run([self.guest, "accel"], check=True, stdout=subprocess.PIPE,
                                    text=True).stdout.strip()
        self.secret = os.path.join(work, "secret")
        with open(self.secret, "w") as f:
            f.write(os.urandom(32).hex() + "\n")
        os.chmod(self.secret, 0o600)

    # ---- processes -----------------------------------------------------------------------

    def store(self, lab, target, delay_ms, name="store"):
        """nbdkit's file plugin over `target` (a file, or dir=DIR: one export per file),
        behind the delay filter and the stats filter. Returns (uri prefix, stats file)."""
        port = free_port()
        stats = os.path.join(lab.dir, f"{name}.stats")
        file_arg = target if target.startswith("dir=") else f"file={target}"
        argv = ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(port), "--filter=stats",
                "--filter=delay", "file", file_arg, f"statsfile={stats}",
                f"delay-read={delay_ms}ms", f"delay-write={delay_ms}ms"]
        proc = lab.spawn(name, argv)
        wait_for("nbdkit", proc, lambda: port_open(port))
        return f"nbd://127.0.0.1:{port}/", stats, proc

    def mem_store(self, lab, size_mib, delay_ms=0, name="store"):
        """nbdkit's memory plugin (a RAM disk in user space: the ideal store) of `size_mib`,
        behind the delay filter when `delay_ms`; returns its URI."""
        port = free_port()
        argv = ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(port)]
        delay = [f"delay-read={delay_ms}ms", f"delay-write={delay_ms}ms"] if delay_ms else []
        argv += (["--filter=delay"] if delay_ms else []) + ["memory", f"{size_mib}M"] + delay
        proc = lab.spawn(name, argv)
        wait_for("nbdkit", proc, lambda: port_open(port))
        return f"nbd://127.0.0.1:{port}/"

    def node(self, lab, lend="3G", name="node", extra=(), port=None):
        """A `fallow node` lending `lend`; returns (its address, its metrics address)."""
        port, mport = port or free_port(), free_port()
        env = dict(os.environ, FALLOW_LOG="warn")
        proc = lab.spawn(name, [self.fallow, "node", "--listen", f"127.0.0.1:{port}",
                                "--lend", lend, "--secret-file", self.secret,
                                "--metrics", f"127.0.0.1:{mport}", *extra], env)
        wait_for("fallow node", proc, lambda: port_open(port))
        return f"127.0.0.1:{port}", f"127.0.0.1:{mport}"

    def cluster(self, lab, n=3, lend="1G", timeout=30):
        """`n` nodes that gossip (each joins the others), once the first sees all `n`
        alive; returns [(address, metrics address)], the first first."""
        ports = [(free_port(), free_port(socket.SOCK_DGRAM)) for _ in range(n)]
        nodes = []
        for i, (port, _) in enumerate(ports):
            join = ",".join(f"127.0.0.1:{udp}" for j, (_, udp) in enumerate(ports) if j != i)
            extra = ["--gossip", f"127.0.0.1:{ports[i][1]}", "--join", join]
            nodes.append(self.node(lab, lend, name=f"node{i}", extra=extra, port=port))

        def alive():
            out = subprocess.run([self.fallow, "stat", "--cluster", "--json", "--timeout", "2",
                                  "--node", nodes[0][0], "--secret-file", self.secret],
                                 stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            try:
                return json.loads(out.stdout).get("alive") == n
            except ValueError:
                return False
        deadline = time.time() + timeout
        while not alive():
            if time.time() > deadline:
                raise RuntimeError(f"{n} nodes did not converge within {timeout} s")
            time.sleep(0.5)
        return nodes

    def export(self, lab, exports, node, mode="exclusive", policy="through", extra=()):
        """`fallow nbd` with `exports` ([(name, backing)]) caching in `node`'s pool; returns
        {name: uri}, its metrics address and its process."""
        port, mport = free_port(), free_port()
        argv = [self.fallow, "nbd", "--listen", f"127.0.0.1:{port}", "--pool",
                f"fallow://{node}", "--secret-file", self.secret, "--local-tier", "16M",
                "--mode", mode, "--write-policy", policy, "--metrics", f"127.0.0.1:{mport}",
                *extra]
        for name, backing in exports:
            argv += ["--export", f"{name}={backing}"]
        proc = lab.spawn("nbd", argv, dict(os.environ, FALLOW_LOG="warn"))
        wait_for("fallow nbd", proc, lambda: port_open(port))
        return {name: f"nbd://127.0.0.1:{port}/{name}" for name, _ in exports}, mport, proc

    def boot(self, lab, tag, script, disks, memory_mib, time_limit=1800, debian=True):
        """Boots the Debian guest (root = the first disk), or with `debian=False` the
        minimal one (busybox and fallow-guest-tool in its initramfs, every disk free for
        the script), and returns what it reported."""
        path = os.path.join(lab.dir, f"{tag}.sh")
        with open(path, "w") as f:
            f.write(PROLOGUE + script)
        console = os.path.join(lab.dir, f"{tag}.console")
        argv = [self.guest, "run", "--script", path, "--memory-mib",
                str(memory_mib), "--time-limit", str(time_limit), "--console", console]
        if debian:
            argv += ["--root", "/dev/vda"]
        for d in disks:
            argv += ["--disk", d]
        out = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if out.returncode != 0:
            tail = ""
            if os.path.exists(console):
                with open(console) as f:
                    tail = "".join(f.readlines()[-40:])
            raise RuntimeError(f"guest {tag} failed: {out.stderr.strip()}\n{out.stdout}\n{tail}")
        return json.loads(out.stdout)

    def root_disk(self):
        return f"file-ro:{self.root}"


def metric(addr, name, labels=""):
    """The sum of the samples of `name` (whose labels contain `labels`) at http://ADDR/metrics."""
    import urllib.request
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {") and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


UNITS = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}


def store_read_bytes(stats_path, proc, lab, clients=()):
    """Bytes read from the store, from nbdkit's stats file. nbdkit writes it when it exits,
    and exits only once its clients are gone, so `clients` (processes) are stopped first."""
    for client in clients:
        lab.stop(client)
    lab.stop(proc)
    with open(stats_path) as f:
        for line in f:
            m = re.match(r"read: \d+ ops, [\d.]+ s, ([\d.]+) (\w+)", line)
            if m:
                return float(m.group(1)) * UNITS[m.group(2)]
    return 0.0


def fio_json(results, key):
    raw = results.get(key)
    if raw is None:
        raise RuntimeError(f"the guest reported no {key}")
    return json.loads(raw[raw.index("{"):])


# Every guest script starts with this. Debian's fio links librbd, whose libceph-common maps
# more zero-filled pages than the kernel's heuristic overcommit allows a 128 MiB guest; the
# pages are never touched, so overcommit is turned on.
PROLOGUE = "echo 1 > /proc/sys/vm/overcommit_memory\n"


def fio_summary(job, rw="read"):
    side = job["jobs"][0][rw]
    pct = side["clat_ns"].get("percentile", {})
    return {"ios": side["total_ios"], "seconds": side["runtime"] / 1000.0,
            "iops": side["iops"], "p50_us": pct.get("50.000000", 0) / 1000.0,
            "p99_us": pct.get("99.000000", 0) / 1000.0}


FIO = ("fio --name={name} --filename=/dev/vdb --direct=1 --rw={rw} --bs={bs} "
       "--ioengine={engine} --iodepth={qd} --size={size} {limit} --randseed=7 "
       "--output-format=json --output=/tmp/{name}.json >/dev/null || exit 1\n"
       "echo \"FALLOW-RESULT fio_{name} $(tr -d '\\n' < /tmp/{name}.json)\"\n")


def fio_cmd(name, rw, bs, qd, size, ios=None):
    engine = "psync" if qd == 1 else "libaio"
    limit = f"--number_ios={ios}" if ios else ""
    return FIO.format(name=name, rw=rw, bs=bs, engine=engine, qd=qd, size=size, limit=limit)


def rotate(configs, round_no):
    k = round_no % len(configs)
    return configs[k:] + configs[:k]


def ratio(a, b):
    return a / b if b else None


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


# ---- Puma: random reads ------------------------------------------------------------------

def puma_fio(setup, work, sizes):
    mem, ws, ios = sizes["fio_guest_mib"], sizes["fio_ws_mib"], sizes["fio_ios"]
    data = os.path.join(work, "fio-data.img")
    with open(data, "wb") as f:
        for _ in range(ws):
            f.write(os.urandom(MIB))
    script = ("echo none > /sys/block/vdb/queue/scheduler\n"
              + fio_cmd("warm", "randread", "64k", 16, f"{ws}M")
              + fio_cmd("qd1", "randread", "4k", 1, f"{ws}M", ios)
              + fio_cmd("qd16", "randread", "4k", 16, f"{ws}M", ios * 4))
    rows = []
    for delay in (1, 5):
        per_round = []
        # "floor": the same store with no delay, what a guest's read costs here whatever
        # serves it (measured once, with the 1 ms group).
        configs = ["store", "exclusive", "inclusive"] + (["floor"] if delay == 1 else [])
        for r in range(setup.args.rounds):
            got = {}
            for config in rotate(configs, r):
                with Lab(work, f"puma-fio-{delay}-{config}-{r}") as lab:
                    uri, _, _ = setup.store(lab, data, 0 if config == "floor" else delay)
                    disk = uri
                    if config in ("exclusive", "inclusive"):
                        node, _ = setup.node(lab)
                        disk = setup.export(lab, [("d", uri)], node, mode=config)[0]["d"]
                    out = setup.boot(lab, "guest", script, [setup.root_disk(), disk], mem)
                res = out["results"]
                got[config] = {k: fio_summary(fio_json(res, f"fio_{k}")) for k in
                               ("warm", "qd1", "qd16")}
                q1, q16 = got[config]["qd1"], got[config]["qd16"]
                log(f"puma-fio {delay} ms, {config}, round {r + 1}: QD1 {q1['iops']:.0f} IOPS "
                    f"(p50 {q1['p50_us']:.0f} us), QD16 {q16['iops']:.0f} IOPS")
            per_round.append(got)
        if delay == 1:
            floor_p50 = median([g["floor"]["qd1"]["p50_us"] for g in per_round])
        for mode in ("exclusive", "inclusive"):
            def med(config, key, field, rounds=per_round):
                return median([g[config][key][field] for g in rounds])
            rows.append({
                "experiment": f"puma-fio-{delay}ms-{mode}",
                "baseline_s": med("store", "qd1", "seconds"),
                "fallow_s": med(mode, "qd1", "seconds"),
                "speedup": median([ratio(g["store"]["qd1"]["seconds"], g[mode]["qd1"]["seconds"])
                                   for g in per_round]),
                "qd1_ios": ios,
                "qd1_p50_us": {"store": med("store", "qd1", "p50_us"),
                               "fallow": med(mode, "qd1", "p50_us"), "floor": floor_p50},
                "qd16_iops": {"store": med("store", "qd16", "iops"),
                              "fallow": med(mode, "qd16", "iops")},
                "qd16_speedup": median([ratio(g[mode]["qd16"]["iops"], g["store"]["qd16"]["iops"])
                                        for g in per_round]),
                "guest_mib": mem, "working_set_mib": ws, "store_ms": delay,
            })
    os.remove(data)
    return rows


# ---- Puma: Postmark ----------------------------------------------------------------------

POSTMARK = """set -e
up() {{ cut -d' ' -f1 /proc/uptime; }}
echo none > /sys/block/vdb/queue/scheduler
mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0,nodiscard /dev/vdb
mount -o noatime /dev/vdb /mnt
mkdir -p /mnt/pm
cat > /tmp/pm.cfg <<CFG
set location /mnt/pm
set seed 42
set number {number}
set transactions {transactions}
set size 5000 150000
set read 4096
set write 4096
set buffering false
set report terse
run
quit
CFG
sync; echo 3 > /proc/sys/vm/drop_caches
t0=$(up)
postmark /tmp/pm.cfg > /tmp/pm.out
sync
t1=$(up)
echo "FALLOW-RESULT postmark_s $(awk "BEGIN {{print $t1 - $t0}}")"
echo "FALLOW-RESULT postmark_terse $(tail -n 1 /tmp/pm.out)"
echo "FALLOW-RESULT vdb_stat $(cat /sys/block/vdb/stat)"
umount /mnt
"""


def puma_postmark(setup, work, sizes):
    mem = sizes["pm_guest_mib"]
    script = POSTMARK.format(number=sizes["pm_number"], transactions=sizes["pm_transactions"])
    per_round, traffic = [], None
    for r in range(setup.args.rounds):
        got = {}
        # "floor": the store with no delay, the most any cache could give.
        for config in rotate(["store", "through", "back", "floor"], r):
            data = os.path.join(work, "pm.img")
            with open(data, "wb") as f:
                f.truncate(sizes["pm_disk_mib"] * MIB)
            with Lab(work, f"puma-postmark-{config}-{r}") as lab:
                uri, _, _ = setup.store(lab, data, 0 if config == "floor" else 1)
                disk = uri
                if config in ("through", "back"):
                    node, _ = setup.node(lab)
                    disk = setup.export(lab, [("d", uri)], node, policy=config)[0]["d"]
                out = setup.boot(lab, "guest", script, [setup.root_disk(), disk], mem)
            os.remove(data)
            got[config] = float(out["results"]["postmark_s"])
            if config == "store":
                # /sys/block/vdb/stat: reads, merged, sectors read, ms, writes, merged, sectors
                # written, ...: what the guest asked of its disk.
                f = [int(x) for x in out["results"]["vdb_stat"].split()]
                traffic = {"reads": f[0], "read_mib": f[2] * 512 / MIB, "writes": f[4],
                           "written_mib": f[6] * 512 / MIB}
            log(f"puma-postmark {config} round {r + 1}: {got[config]:.1f} s")
        per_round.append(got)
    return [{
        "experiment": f"puma-postmark-1ms-{policy}",
        "baseline_s": median([g["store"] for g in per_round]),
        "fallow_s": median([g[policy] for g in per_round]),
        "speedup": median([ratio(g["store"], g[policy]) for g in per_round]),
        "guest_mib": mem, "files": sizes["pm_number"], "transactions": sizes["pm_transactions"],
        "floor_s": median([g["floor"] for g in per_round]),
        "guest_disk_traffic": traffic, "store_ms": 1,
    } for policy in ("through", "back")]


# ---- Puma: sqlite3 -----------------------------------------------------------------------

SQLITE_GEN = """PRAGMA page_size=4096;
PRAGMA journal_mode=OFF;
PRAGMA synchronous=OFF;
CREATE TABLE t(id INTEGER PRIMARY KEY, v BLOB NOT NULL);
WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x+1 FROM c WHERE x < {rows})
INSERT INTO t(id, v) SELECT x, randomblob(1000) FROM c;
"""

# The keys come from a fixed LCG, so every pass and every configuration looks up the same.
SQLITE_QUERY = """.timer on
PRAGMA cache_size=-2000;
WITH RECURSIVE q(i, s) AS (SELECT 1, 12345 UNION ALL
    SELECT i+1, (s*1103515245+12345) % 2147483648 FROM q WHERE i < {lookups})
SELECT 'point', count(*), sum(length(v)) FROM q JOIN t ON t.id = (q.s % {rows}) + 1;
"""

SQLITE = """set -e
up() {{ cut -d' ' -f1 /proc/uptime; }}
mount -o ro,noatime /dev/vdb /mnt
cat > /tmp/q.sql <<'SQL'
{query}SQL
t0=$(up)
sqlite3 -readonly /mnt/bench.db < /tmp/q.sql > /tmp/warm.out
t1=$(up)
echo 3 > /proc/sys/vm/drop_caches
sqlite3 -readonly /mnt/bench.db < /tmp/q.sql > /tmp/timed.out
t2=$(up)
echo "FALLOW-RESULT warm_s $(awk "BEGIN {{print $t1 - $t0}}")"
echo "FALLOW-RESULT timed_s $(awk "BEGIN {{print $t2 - $t1}}")"
echo "FALLOW-RESULT answer $(grep point /tmp/timed.out | head -n 1)"
umount /mnt
"""


def puma_sqlite(setup, work, sizes):
    mem, rows, lookups = sizes["sql_guest_mib"], sizes["sql_rows"], sizes["sql_lookups"]
    tree = os.path.join(work, "sqlite-tree")
    os.makedirs(tree, exist_ok=True)
    db = os.path.join(tree, "bench.db")
    subprocess.run(["sqlite3", db], input=SQLITE_GEN.format(rows=rows), text=True, check=True,
                   stdout=subprocess.DEVNULL)
    image = os.path.join(work, "sqlite.img")
    size_mib = os.path.getsize(db) // MIB + 128
    subprocess.run(["mke2fs", "-q", "-F", "-t", "ext4", "-E",
                    "lazy_itable_init=0,lazy_journal_init=0,nodiscard", "-d", tree, image,
                    f"{size_mib}M"], check=True, stdout=subprocess.DEVNULL)
    shutil.rmtree(tree)
    script = SQLITE.format(query=SQLITE_QUERY.format(lookups=lookups, rows=rows))
    per_round, answers = [], set()
    for r in range(setup.args.rounds):
        got = {}
        # "floor": the store with no delay, the most any cache could give.
        for config in rotate(["store", "fallow", "floor"], r):
            with Lab(work, f"puma-sqlite-{config}-{r}") as lab:
                uri, _, _ = setup.store(lab, image, 0 if config == "floor" else 1)
                disk = uri
                if config == "fallow":
                    node, _ = setup.node(lab)
                    disk = setup.export(lab, [("d", uri)], node)[0]["d"]
                out = setup.boot(lab, "guest", script, [setup.root_disk(), disk], mem)
            res = out["results"]
            got[config] = float(res["timed_s"])
            answers.add(res["answer"])
            log(f"puma-sqlite {config} round {r + 1}: timed pass {got[config]:.1f} s "
                f"(warm-up {float(res['warm_s']):.1f} s)")
        per_round.append(got)
    os.remove(image)
    if len(answers) != 1:
        raise RuntimeError(f"the configurations answered differently: {answers}")
    return [{
        "experiment": "puma-sqlite-1ms",
        "baseline_s": median([g["store"] for g in per_round]),
        "fallow_s": median([g["fallow"] for g in per_round]),
        "speedup": median([ratio(g["store"], g["fallow"]) for g in per_round]),
        "floor_s": median([g["floor"] for g in per_round]),
        "guest_mib": mem, "db_mib": size_mib - 128, "lookups": lookups, "store_ms": 1,
    }]


# ---- tmem: clones sharing one pool -------------------------------------------------------

TMEM = """up() { cut -d' ' -f1 /proc/uptime; }
t0=$(up)
for pass in PASSES; do
    bytes=$(tar cf - /usr 2>/dev/null | wc -c)
    echo "FALLOW-RESULT pass_${pass} $(awk "BEGIN {print $(up) - $t0}") $bytes"
done
echo "FALLOW-RESULT job_s $(awk "BEGIN {print $(up) - $t0}")"
"""


def boot_many(setup, lab, script, disk_sets, mem):
    """Boots one guest per disk set at once; returns their reports and the wall time."""
    import concurrent.futures
    t0 = time.time()
    with concurrent.futures.ThreadPoolExecutor(len(disk_sets)) as pool:
        futures = [pool.submit(setup.boot, lab, f"clone{i}", script, disks, mem)
                   for i, disks in enumerate(disk_sets)]
        outs = [f.result() for f in futures]
    return outs, time.time() - t0


def tmem_clones(setup, work, sizes):
    n, mem, passes = sizes["tmem_clones"], sizes["tmem_guest_mib"], sizes["tmem_passes"]
    clones = os.path.join(work, "clones")
    os.makedirs(clones, exist_ok=True)
    for i in range(n):
        subprocess.run(["cp", "--sparse=always", setup.root, os.path.join(clones, f"c{i}")],
                       check=True)
    script = TMEM.replace("PASSES", " ".join(str(p + 1) for p in range(passes)))
    # One clone alone fills the pool in its first pass; the later passes would re-read it.
    one_pass = TMEM.replace("PASSES", "1")
    per_round = []
    for r in range(setup.args.rounds):
        got = {}
        for config in rotate(["store", "fallow", "fallow-one"], r):
            count = 1 if config == "fallow-one" else n
            with Lab(work, f"tmem-{config}-{r}") as lab:
                uri, stats, store_proc = setup.store(lab, f"dir={clones}", 1)
                disks = [f"{uri}c{i}" for i in range(count)]
                node_metrics, clients = None, []
                if config != "store":
                    node, node_metrics = setup.node(lab)
                    uris, _, export = setup.export(
                        lab, [(f"c{i}", f"{uri}c{i}") for i in range(count)], node)
                    disks = [uris[f"c{i}"] for i in range(count)]
                    clients.append(export)
                job = script if config != "fallow-one" else one_pass
                outs, wall = boot_many(setup, lab, job, [[d] for d in disks], mem)
                used = metric(node_metrics, "fallow_node_used_bytes") if node_metrics else None
                saved = metric(node_metrics, "fallow_node_dedup_saved_bytes") if node_metrics else None
                read = store_read_bytes(stats, store_proc, lab, clients)
            got[config] = {"wall_s": wall, "store_read_bytes": read, "pool_used_bytes": used,
                           "dedup_saved_bytes": saved,
                           "job_s": [float(o["results"]["job_s"]) for o in outs]}
            log(f"tmem-clones {config} ({count} guests) round {r + 1}: {wall:.1f} s, store read "
                f"{read / MIB:.0f} MiB, pool used "
                f"{'-' if used is None else f'{used / MIB:.0f} MiB'}")
        per_round.append(got)
    shutil.rmtree(clones)

    def med(config, field):
        return median([g[config][field] for g in per_round])
    return [{
        "experiment": "tmem-clones",
        "baseline_s": med("store", "wall_s"),
        "fallow_s": med("fallow", "wall_s"),
        "speedup": median([ratio(g["store"]["wall_s"], g["fallow"]["wall_s"]) for g in per_round]),
        "clones": n, "passes": passes, "guest_mib": mem,
        "store_read_mib": {"store": med("store", "store_read_bytes") / MIB,
                           "fallow": med("fallow", "store_read_bytes") / MIB},
        "read_reduction": median([1 - ratio(g["fallow"]["store_read_bytes"],
                                            g["store"]["store_read_bytes"]) for g in per_round]),
        "pool_used_mib": {"one": med("fallow-one", "pool_used_bytes") / MIB,
                          "all": med("fallow", "pool_used_bytes") / MIB},
        "pool_ratio_n_to_one": median([ratio(g["fallow"]["pool_used_bytes"],
                                             g["fallow-one"]["pool_used_bytes"])
                                       for g in per_round]),
        "store_ms": 1,
    }]


# ---- Archipelago's cached: a guest on RADOS ----------------------------------------------

def ceph_cluster(work):
    """A one-monitor, one-OSD cluster (tests/ceph/ceph-up.sh, BlueStore on a sparse file);
    returns its directory and configuration file."""
    cdir = os.path.join(work, "ceph")
    # Every configuration of every round writes an image of its own: 16 GiB, sparse.
    env = dict(os.environ, STORE="bluestore", POOL="vm", MON_PORT=str(free_port()),
               BLOCK_BYTES=str(16 << 30))
    subprocess.run(["bash", os.path.join(ROOT, "tests/ceph/ceph-up.sh"), cdir], check=True,
                   env=env, stdout=sys.stderr)
    return cdir, os.path.join(cdir, "ceph.conf")


def cached_rados(setup, work, sizes):
    mem, ws, ios = sizes["rados_guest_mib"], sizes["rados_ws_mib"], sizes["rados_ios"]
    cdir, conf = ceph_cluster(work)
    env = dict(os.environ, CEPH_CONF=conf)
    try:
        subprocess.run(["rbd", "create", "--size", f"{ws + 64}M", "vm/qemu"], env=env, check=True)
        loads = [("read-4k-qd4", "randread", "4k", 4), ("read-64k-qd16", "randread", "64k", 16),
                 ("write-4k-qd16", "randwrite", "4k", 16), ("write-64k-qd16", "randwrite", "64k", 16)]
        script = ("echo none > /sys/block/vdb/queue/scheduler\n"
                  + fio_cmd("fill", "write", "1M", 4, f"{ws}M")
                  + fio_cmd("warm", "randread", "64k", 16, f"{ws}M")
                  + "".join(fio_cmd(name.replace("-", "_"), rw, bs, qd, f"{ws}M", ios)
                            for name, rw, bs, qd in loads))
        configs = ["rbd", "through", "back"]
        per_round = []
        for r in range(setup.args.rounds):
            got = {}
            for config in rotate(configs, r):
                with Lab(work, f"cached-{config}-{r}") as lab:
                    if config == "rbd":
                        disk = f"drive:file=rbd:vm/qemu:conf={conf}:id=admin,cache=writeback"
                    else:
                        node, _ = setup.node(lab)
                        backing = f"rados:vm/fallow-{config}-{r},size={ws + 64}M,conf={conf}"
                        disk = setup.export(lab, [("d", backing)], node, policy=config)[0]["d"]
                    out = setup.boot(lab, "guest", script, [setup.root_disk(), disk], mem)
                res = out["results"]
                got[config] = {}
                for name, rw, _, _ in loads:
                    side = "write" if rw == "randwrite" else "read"
                    got[config][name] = fio_summary(fio_json(res, f"fio_{name.replace('-', '_')}"),
                                                    side)
                log(f"cached-rados {config} round {r + 1}: " + ", ".join(
                    f"{n} {got[config][n]['iops']:.0f} IOPS" for n, _, _, _ in loads))
            per_round.append(got)
    finally:
        subprocess.run(["bash", os.path.join(ROOT, "tests/ceph/ceph-down.sh"), cdir],
                       stdout=sys.stderr, stderr=sys.stderr)
    rows = []
    for name, rw, bs, qd in loads:
        policies = ["back"] if rw == "randread" else ["through", "back"]
        for policy in policies:
            rows.append({
                "experiment": f"cached-rados-{name}-{policy}",
                "baseline_s": median([g["rbd"][name]["seconds"] for g in per_round]),
                "fallow_s": median([g[policy][name]["seconds"] for g in per_round]),
                "speedup": median([ratio(g["rbd"][name]["seconds"], g[policy][name]["seconds"])
                                   for g in per_round]),
                "iops": {"rbd": median([g["rbd"][name]["iops"] for g in per_round]),
                         "fallow": median([g[policy][name]["iops"] for g in per_round])},
                "p50_us": {"rbd": median([g["rbd"][name]["p50_us"] for g in per_round]),
                           "fallow": median([g[policy][name]["p50_us"] for g in per_round])},
                "ios": ios, "bs": bs, "qd": qd, "guest_mib": mem, "working_set_mib": ws,
            })
    return rows


# ---- frontswap: a guest swaps to the pool ------------------------------------------------

# In the minimal guest (busybox, fallow-guest-tool): /dev/vda is the swap device, and the
# memory hog writes a pattern into every page of more memory than the guest has free, in a
# random order, then reads every page back in another and checks it (it exits 1 on a bad
# page, and the script with it). Timed inside the guest; what the kernel swapped, from
# /proc/vmstat. The hog is the guest's RAM, not twice it: the guest has far less than its
# RAM free, so every page goes out and comes back about once either way (measured), and
# twice the RAM made one run on the 5 ms disk take 9 minutes under TCG.
SWAP = """mkswap /dev/vda > /dev/null || exit 10
swapon /dev/vda || exit 11
echo "FALLOW-RESULT available_kib $(grep MemAvailable /proc/meminfo | tr -s ' ' | cut -d' ' -f2)"
up() {{ cut -d' ' -f1 /proc/uptime; }}
t0=$(up)
fallow-guest-tool memhog {hog} 7 > /tmp/memhog.out
status=$?
t1=$(up)
echo "FALLOW-RESULT memhog $(cat /tmp/memhog.out)"
echo "FALLOW-RESULT job_s $(awk "BEGIN {{print $t1 - $t0}}")"
echo "FALLOW-RESULT pswpout $(grep '^pswpout ' /proc/vmstat | cut -d' ' -f2)"
echo "FALLOW-RESULT pswpin $(grep '^pswpin ' /proc/vmstat | cut -d' ' -f2)"
exit $status
"""

SWAP_CONFIGS = ["disk-5ms", "nbdkit-memory", "pool-node", "pool-node-poll", "pool-cluster"]
# The pool configurations, and the flags of their nodes and of `fallow nbd`.
SWAP_POOLS = {"pool-node": (), "pool-node-poll": ("--poll-us", "50"), "pool-cluster": ()}


def swap(setup, work, sizes):
    mem, hog, size = sizes["swap_guest_mib"], sizes["swap_hog_mib"], sizes["swap_disk_mib"]
    script = SWAP.format(hog=hog)
    want = f"FALLOW-MEMHOG ok={hog * 256} bad=0"
    per_round = []
    for r in range(setup.args.rounds):
        got = {}
        for config in rotate(SWAP_CONFIGS, r):
            with Lab(work, f"swap-{config}-{r}") as lab:
                nodes = []
                if config == "disk-5ms":
                    # An HDD's seek for every request: the store alone, straight to QEMU.
                    disk = setup.mem_store(lab, size, 5)
                elif config == "nbdkit-memory":
                    disk = setup.mem_store(lab, size)
                else:
                    # A disk that lives only in the pool: one node, or three that gossip
                    # (two copies of every page), reached through the first.
                    # `pool-node-poll`: the node and `fallow nbd` poll their sockets between
                    # requests (--poll-us), for the swap-ins that come one at a time.
                    flags = list(SWAP_POOLS[config])
                    if config == "pool-cluster":
                        nodes = setup.cluster(lab)
                    else:
                        nodes = [setup.node(lab, extra=flags)]
                    disk = setup.export(lab, [("swap", f"pool:{size}M")], nodes[0][0],
                                        extra=flags)[0]["swap"]
                out = setup.boot(lab, "guest", script, [disk], mem, time_limit=1200,
                                 debian=False)
                res = out["results"]
                if res.get("memhog") != want:
                    raise RuntimeError(f"swap {config}: the hog did not get its memory back "
                                       f"intact: {res.get('memhog')!r}, want {want!r}")
                pages = (sum(metric(m, "fallow_node_stored_pages") for _, m in nodes)
                         if nodes else None)
            got[config] = {"job_s": float(res["job_s"]), "guest_s": out["elapsed_s"],
                           "pswpout": int(res["pswpout"]), "pswpin": int(res["pswpin"]),
                           "available_kib": int(res["available_kib"]),
                           "pool_pages": pages}
            g = got[config]
            log(f"swap {config} round {r + 1}: {g['job_s']:.1f} s (guest {g['guest_s']:.0f} s), "
                f"swapped out {g['pswpout'] * 4 / 1024:.0f} MiB, in {g['pswpin'] * 4 / 1024:.0f} "
                f"MiB" + ("" if pages is None else f", pool holds {pages:.0f} pages"))
        per_round.append(got)

    def med(config, field):
        return median([g[config][field] for g in per_round])
    return [{
        "experiment": f"swap-{config}",
        "baseline_s": med("disk-5ms", "job_s"),
        "fallow_s": med(config, "job_s"),
        # x faster than the disk, and x the speed of nbdkit memory (the same store with no
        # delay: what the guest gets from an ideal user-space RAM disk).
        "speedup": median([ratio(g["disk-5ms"]["job_s"], g[config]["job_s"])
                           for g in per_round]),
        "floor_s": med("nbdkit-memory", "job_s"),
        "memory_speed": median([ratio(g["nbdkit-memory"]["job_s"], g[config]["job_s"])
                                for g in per_round]),
        "job_s": {c: [g[c]["job_s"] for g in per_round] for c in SWAP_CONFIGS},
        "swapped_out_mib": med(config, "pswpout") * 4 / 1024,
        "swapped_in_mib": med(config, "pswpin") * 4 / 1024,
        "pool_pages": med(config, "pool_pages"),
        "guest_available_mib": med(config, "available_kib") / 1024,
        # Pages the cluster held over those one node held: the copies of every page.
        "copies": ratio(med(config, "pool_pages"), med("pool-node", "pool_pages")),
        "nodes": 3 if config == "pool-cluster" else 1,
        "poll_us": 50 if "--poll-us" in SWAP_POOLS[config] else 0,
        "guest_mib": mem, "hog_mib": hog, "swap_mib": size, "store_ms": 5, "local_tier_mib": 16,
    } for config in SWAP_POOLS]


RUNNERS = {"puma-fio": puma_fio, "puma-postmark": puma_postmark, "puma-sqlite": puma_sqlite,
           "tmem-clones": tmem_clones, "cached-rados": cached_rados, "swap": swap}

SIZES = {
    "quick": {"fio_guest_mib": 128, "fio_ws_mib": 384, "fio_ios": 1000,
              "pm_guest_mib": 128, "pm_disk_mib": 512, "pm_number": 1500, "pm_transactions": 6000,
              "sql_guest_mib": 128, "sql_rows": 250000, "sql_lookups": 12000,
              "tmem_clones": 3, "tmem_guest_mib": 128, "tmem_passes": 3,
              "rados_guest_mib": 128, "rados_ws_mib": 256, "rados_ios": 4000,
              "swap_guest_mib": 128, "swap_hog_mib": 96, "swap_disk_mib": 512},
    "full": {"fio_guest_mib": 256, "fio_ws_mib": 768, "fio_ios": 2000,
             "pm_guest_mib": 256, "pm_disk_mib": 1024, "pm_number": 3000, "pm_transactions": 20000,
             "sql_guest_mib": 256, "sql_rows": 500000, "sql_lookups": 25000,
             "tmem_clones": 4, "tmem_guest_mib": 128, "tmem_passes": 3,
             "rados_guest_mib": 256, "rados_ws_mib": 512, "rados_ios": 8000,
             "swap_guest_mib": 128, "swap_hog_mib": 128, "swap_disk_mib": 512},
}


def stop_on_signal(signum, _frame):
    """SIGTERM and SIGINT unwind like an error, so that every Lab and the Ceph cluster
    stop the processes they started."""
    raise SystemExit(128 + signum)


def main():
    signal.signal(signal.SIGTERM, stop_on_signal)
    signal.signal(signal.SIGINT, stop_on_signal)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="experiments:\n" + __doc__.split("\n\n")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="every experiment at a small size, one round (~15 minutes)")
    parser.add_argument("--rounds", type=int, help="rounds of every configuration")
    parser.add_argument("--only", help="comma-separated experiments: " + ",".join(EXPERIMENTS))
    parser.add_argument("--fallow", default=os.path.join(ROOT, "target/release/fallow"))
    parser.add_argument("--guest", default=os.path.join(ROOT, "target/release/fallow-guest"))
    parser.add_argument("--out", help="where the JSON lines go too "
                        "(default bench/out/vm-DATE.jsonl)")
    args = parser.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    only = args.only.split(",") if args.only else EXPERIMENTS
    for name in only:
        if name not in RUNNERS:
            parser.error(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)}")
    sizes = SIZES["quick" if args.quick else "full"]
    out_path = args.out or os.path.join(ROOT, "bench/out",
                                        time.strftime("vm-%Y-%m-%d-%H%M%S.jsonl"))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    work = tempfile.mkdtemp(prefix="fallow-vm-")
    try:
        setup = Setup(args, work)
        log(f"guests run on {setup.accel}; results also in {out_path}")
        header = {"machine": {"cpus": os.cpu_count(), "accel": setup.accel,
                              "kernel": os.uname().release, "images": setup.versions,
                              "quick": args.quick, "rounds": args.rounds}}
        with open(out_path, "w") as out:
            out.write(json.dumps(header) + "\n")
            for name in only:
                log(f"{name}: starting")
                t0 = time.time()
                for row in RUNNERS[name](setup, work, sizes):
                    row["wall_s"] = round(time.time() - t0, 1)
                    line = json.dumps(row)
                    print(line, flush=True)
                    out.write(line + "\n")
                    out.flush()
                log(f"{name}: done in {time.time() - t0:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
