#!/usr/bin/env python3
"""TLS against plaintext (issue #29), side by side in one run:

  node  `fallow bench pages` against two `fallow node`s, one in the clear and one with
        --node-tls, in the two configurations of bench/node_vs_memcached.sh the targets
        name: get hits at QD 1 (`get-qd1`: 1 connection, QD 1, batch 1) and batched get
        hits (`get-batched`: 2 connections, QD 4, batch 32), 65,536 keys; the node's CPU
        per page (--server-pid) and the load generator's;
  nbd   fio 4 KiB random reads at QD 16 (its nbd engine: libnbd, one connection) of a
        256 MiB export filled with random data, against `fallow nbd` (every read a hit of
        its local tier or pool, warmed first) and `nbdkit memory`, each in the clear and
        with TLS required;
  why   (unless --no-why, and only where perf works) one more run of each node
        configuration in both transports, of `fallow nbd` in both and of nbdkit with TLS,
        with perf attached to the server and to the client: system calls per page or read,
        and CPU per page or read by where it went (AES-GCM, the rest of the TLS library,
        memcpy, the kernel, the program); and `openssl speed` of the TLS 1.3 ciphers.

Each round runs every configuration of a part once, in an order that rotates between
rounds; a ratio is taken within a round, then the median over the rounds.

The certificates are made with the openssl commands of docs/security.md in a temporary
directory (a CA, a server certificate for DNS:localhost and IP:127.0.0.1; the clients get
ca-cert.pem only), which is removed at the end, as is the copy of the fallow binary the
run uses (so that a rebuild during the run changes nothing).

fio's nbd engine cannot name a certificates directory: libnbd refuses `?tls-certificates=`
in a URI unless the program calls nbd_set_uri_allow_local_file, which fio does not. So fio
runs where libnbd looks by default: as a user other than root (nobody, through setpriv,
when this script runs as root; root's default is /etc/pki/libnbd) whose $HOME is a
temporary directory holding .pki/libnbd/ca-cert.pem. The plaintext runs use the same user.

    python3 bench/tls.py [--rounds N] [--seconds S] [--only node|nbd] [--binary PATH]
                         [--commit REV] [--no-why] [--no-write]
    python3 bench/tls.py --table RESULTS.jsonl     # the section again, from a run's lines

Raw lines go to bench/out/tls-DATE.jsonl, progress to stderr; the section goes between the
tls markers of BENCHMARKS.md (added at its end if missing; not with --no-write or --only)
and to stdout. Every process it starts is stopped by PID.
"""

import argparse
import bisect
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

from benchutil import Procs, free_port, git_commit, port_open, version, write_section

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLK_TCK = os.sysconf("SC_CLK_TCK")
MARKER = "tls"
SECTION_TITLE = "## TLS against plaintext (issue #29)"

# What TLS is held to (issue #29).
NODE_THROUGHPUT = 0.85   # batched node gets with TLS ≥ this × plaintext pages/s
NODE_ADDED_US = 10.0     # QD 1 get p50 with TLS ≤ plaintext + this
NBD_VS_NBDKIT = 0.9      # fallow nbd --tls require ≥ this × nbdkit memory --tls=require

KEYS = 65536
LEND = "512M"
EXPORT = "256M"
POOL = "512M"
QD = 16
RAMP_S = 1
# The configurations of bench/node_vs_memcached.sh that the targets name.
NODE_CONFIGS = {
    "get-qd1": ["--workload", "get", "-c", "1", "-q", "1", "-b", "1", "--warmup"],
    "get-batched": ["--workload", "get", "-c", "2", "-q", "4", "-b", "32", "--warmup"],
}
NODE_LABELS = {"get-qd1": "get hit, 1 conn, QD 1, batch 1",
               "get-batched": "get hit, 2 conns, QD 4, batch 32"}
TRANSPORTS = ["plaintext", "tls"]
NBD_CONFIGS = ["fallow", "fallow-tls", "nbdkit", "nbdkit-tls"]
NBD_LABELS = {
    "fallow": f"`fallow nbd --export d=mem:{EXPORT} --pool local:{POOL}`",
    "fallow-tls": "the same with `--tls require`",
    "nbdkit": f"`nbdkit memory {EXPORT}`",
    "nbdkit-tls": "the same with `--tls=require`",
}
# `fallow bench pages` progress: "measure   1.0 s:    357717 pages/s, 357856 pages".
PROGRESS = re.compile(r"measure\s+([\d.]+) s:.*?(\d+) pages\s*$")
# System calls counted by `perf stat` in the why part, by what they do.
SYSCALLS = {
    "recv": ["read", "recvfrom", "recvmsg"],
    "send": ["write", "writev", "sendto", "sendmsg"],
    "wait": ["epoll_wait", "epoll_pwait", "poll", "ppoll", "futex"],
}
CATEGORIES = ["AES-GCM", "TLS library, other", "memcpy/memset", "kernel: copies",
              "kernel, other", "the program", "other"]
TLS_DSOS = ("libcrypto", "libssl", "libgnutls", "libnettle", "libhogweed", "libgcrypt")
CIPHER_SYMBOL = re.compile(r"aes|gcm|ghash|gmac|pclmul|chacha|poly1305|ctr32", re.I)
CIPHER_INSN = re.compile(r"^\s*([0-9a-f]+):\s+(v?aes(enc|dec)\w*|v?pclmul\w*)\b")
CIPHER_WINDOW = 96  # bytes either side of a sampled instruction


def log(msg):
    print(f"[tls {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_seconds(pid):
    """utime + stime of process `pid` (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def rotate(items, n):
    n %= len(items)
    return items[n:] + items[:n]


class Certs:
    """A CA, a server certificate for localhost and 127.0.0.1, and the clients' directory
    (ca-cert.pem only), made as docs/security.md says; and a $HOME for fio whose
    .pki/libnbd is libnbd's default certificates directory."""

    def __init__(self, work):
        pki = os.path.join(work, "pki")
        os.makedirs(pki)
        run = lambda *argv: subprocess.run(argv, cwd=pki, check=True, capture_output=True)
        run("openssl", "req", "-x509", "-new", "-newkey", "ec", "-pkeyopt",
            "ec_paramgen_curve:P-256", "-noenc", "-keyout", "ca-key.pem", "-out", "ca-cert.pem",
            "-subj", "/CN=fallow-bench-CA", "-days", "3650",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        with open(os.path.join(pki, "server.ext"), "w") as f:
            f.write("basicConstraints = critical, CA:FALSE\n"
                    "keyUsage = critical, digitalSignature, keyEncipherment\n"
                    "extendedKeyUsage = serverAuth\n"
                    "subjectAltName = DNS:localhost, IP:127.0.0.1\n")
        run("openssl", "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-noenc", "-keyout", "server-key.pem", "-out", "server.csr", "-subj", "/CN=localhost")
        run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca-cert.pem", "-CAkey",
            "ca-key.pem", "-days", "365", "-extfile", "server.ext", "-out", "server-cert.pem")
        run("openssl", "verify", "-CAfile", "ca-cert.pem", "-verify_ip", "127.0.0.1",
            "server-cert.pem")
        self.server = os.path.join(work, "server")
        self.client = os.path.join(work, "client")
        self.home = os.path.join(work, "home")
        libnbd = os.path.join(self.home, ".pki", "libnbd")
        for d in (self.server, self.client, libnbd):
            os.makedirs(d)
        for name in ("ca-cert.pem", "server-cert.pem", "server-key.pem"):
            shutil.copy2(os.path.join(pki, name), self.server)
        for d in (self.client, libnbd):
            shutil.copy2(os.path.join(pki, "ca-cert.pem"), d)
        # fio runs as nobody: it must reach its $HOME (the work directory is traversable,
        # not listable; the server's key stays readable by its owner only).
        os.chmod(work, 0o711)
        for d, _, files in os.walk(self.home):
            os.chmod(d, 0o755)
            for name in files:
                os.chmod(os.path.join(d, name), 0o644)

    def fio_prefix(self):
        """How fio is run: as nobody when we are root, with $HOME at self.home."""
        env = ["env", f"HOME={self.home}", "XDG_CONFIG_HOME=" + os.path.join(self.home, ".config")]
        if os.geteuid() == 0:
            return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *env]
        return env


# --- perf: the why part ----------------------------------------------------------------------

def perf_works():
    if not shutil.which("perf") or not shutil.which("objdump"):
        return False
    out = subprocess.run(["perf", "stat", "-x,", "-e", "raw_syscalls:sys_enter,cpu-clock",
                          "--", "true"], capture_output=True, text=True)
    return out.returncode == 0 and "raw_syscalls" in out.stderr


def syscall_events():
    base = "/sys/kernel/tracing/events/syscalls"
    if not os.path.isdir(base):
        base = "/sys/kernel/debug/tracing/events/syscalls"
    names = [n for group in SYSCALLS.values() for n in group
             if os.path.isdir(os.path.join(base, f"sys_enter_{n}"))]
    return ["raw_syscalls:sys_enter"] + [f"syscalls:sys_enter_{n}" for n in names]


class Perf:
    """perf record (CPU samples at 999 Hz) and perf stat (system calls) attached to each
    of `pids` for `window` seconds."""

    HZ = 999

    def __init__(self, work, tag, pids, window):
        self.window, self.files, self.procs = window, {}, []
        events = ",".join(syscall_events())
        for role, pid in pids.items():
            data = os.path.join(work, f"perf-{tag}-{role}.data")
            stat = os.path.join(work, f"perf-{tag}-{role}.stat")
            self.files[role] = (data, stat)
            self.procs.append(subprocess.Popen(
                ["perf", "record", "-q", "-F", str(self.HZ), "-e", "cpu-clock", "-o", data,
                 "-p", str(pid), "--", "sleep", str(window)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
            self.procs.append(subprocess.Popen(
                ["perf", "stat", "-x,", "-o", stat, "-e", events, "-p", str(pid), "--", "sleep",
                 str(window)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.started = time.time()

    def wait(self):
        for proc in self.procs:
            try:
                proc.wait(self.window + 60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []

    def results(self, ops):
        """Per role: system calls per op by kind, and CPU µs per op by category."""
        out = {}
        for role, (data, stat) in self.files.items():
            calls = {}
            if os.path.exists(stat):
                for line in open(stat):
                    parts = line.strip().split(",")
                    if len(parts) > 2 and parts[0].replace(".", "").isdigit():
                        calls[parts[2].split(":")[-1].replace("sys_enter_", "")] = float(parts[0])
            per_op = {kind: sum(calls.get(n, 0) for n in names) / ops
                      for kind, names in SYSCALLS.items()}
            per_op["all"] = calls.get("sys_enter", 0) / ops
            out[role] = {"syscalls_per_op": per_op, "cpu_us_per_op": categorize(data, ops)}
        return out


_cipher_code = {}


def cipher_addresses(path):
    """Sorted addresses of the AES and carry-less multiply instructions in a library."""
    if path not in _cipher_code:
        found = []
        try:
            out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", path],
                                 capture_output=True, text=True, timeout=300)
            for line in out.stdout.splitlines():
                m = CIPHER_INSN.match(line)
                if m:
                    found.append(int(m.group(1), 16))
        except (OSError, subprocess.SubprocessError):
            pass
        _cipher_code[path] = sorted(found)
    return _cipher_code[path]


def in_cipher_code(path, addr):
    """Whether `addr` lies among AES/GHASH instructions (within CIPHER_WINDOW bytes of
    one): the libraries are stripped, so their assembly routines have no names."""
    found = cipher_addresses(path)
    i = bisect.bisect_left(found, addr - CIPHER_WINDOW)
    return i < len(found) and found[i] <= addr + CIPHER_WINDOW


SAMPLE_LINE = re.compile(r"^\s*(\d+)\s+(\S+)\s+.*?\[([.k])\]\s+(\S+)")


def categorize(data, ops):
    """CPU µs per op of one process's samples, by category."""
    us = dict.fromkeys(CATEGORIES, 0.0)
    if not os.path.exists(data):
        return us
    out = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "-v",
                          "-F", "sample,dso,sym", "--percent-limit", "0"],
                         capture_output=True, text=True, timeout=600)
    for line in out.stdout.splitlines():
        if line.startswith("#"):
            continue
        m = SAMPLE_LINE.match(line)
        if not m:
            continue
        samples, dso, level, sym = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        base = os.path.basename(dso)
        if level == "k" or base.startswith("[kernel"):
            cat = "kernel: copies" if "copy" in sym else "kernel, other"
        elif base.startswith(TLS_DSOS):
            if sym.startswith("0x"):
                cipher = os.path.exists(dso) and in_cipher_code(dso, int(sym, 16))
            else:
                cipher = bool(CIPHER_SYMBOL.search(sym))
            cat = "AES-GCM" if cipher else "TLS library, other"
        elif base.startswith("libc.so") and re.search(r"mem(cpy|move|set)", sym):
            cat = "memcpy/memset"
        elif base.startswith(("libc.so", "ld-linux", "libm.so", "[vdso]", "libpthread")):
            cat = "other"
        else:
            cat = "the program"
        us[cat] += samples / Perf.HZ * 1e6 / ops
    return us


# --- the node part ---------------------------------------------------------------------------

def negotiated(port, client_dir):
    """The protocol and cipher suite OpenSSL's client defaults get from a TLS node (those
    of fallow's own client)."""
    try:
        out = subprocess.run(["openssl", "s_client", "-connect", f"127.0.0.1:{port}", "-CAfile",
                              os.path.join(client_dir, "ca-cert.pem")], input="",
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "?"
    m = re.search(r"New, (\S+), Cipher is (\S+)", out.stdout)
    return f"{m.group(1)} {m.group(2)}" if m else "?"


def bench_pages(fallow, target, extra, config, seconds, server_pid, on_measure=None):
    """One `fallow bench pages` run: its JSON, the client's CPU per page over the measured
    phase after its first second, and its progress marks (time, cumulative pages)."""
    argv = [fallow, "bench", "pages", "--target", target, *extra, *NODE_CONFIGS[config],
            "--keys", str(KEYS), "--duration", f"{seconds}s", "--server-pid", str(server_pid),
            "--json"]
    with tempfile.TemporaryFile("w+") as stdout:
        proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.PIPE, text=True)
        marks, other = [], []
        for line in proc.stderr:
            m = PROGRESS.search(line)
            if not m:
                other.append(line)
                continue
            try:
                cpu = cpu_seconds(proc.pid)
            except OSError:
                cpu = None
            marks.append((time.time(), cpu, int(m.group(2))))
            if len(marks) == 1 and on_measure:
                on_measure(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        stdout.seek(0)
        text = stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"bench pages {target} failed: {''.join(other)[-2000:]}")
    r = json.loads(text)
    if r.get("errors") or r.get("wrong"):
        raise SystemExit(f"bench pages {target}: {r.get('errors')} errors, {r.get('wrong')} wrong")
    client_us = None
    if marks and marks[0][1] is not None and r["pages"] > marks[0][2]:
        client = usage.ru_utime + usage.ru_stime - marks[0][1]
        client_us = client * 1e6 / (r["pages"] - marks[0][2])
    return {"pages_per_s": r["pages_per_s"], "p50": r["latency_us"]["p50"],
            "p99": r["latency_us"]["p99"], "pages": r["pages"], "misses": r["misses"],
            "server_us": r["server_cpu"]["us_per_page"], "server_cpus": r["server_cpu"]["cpus"],
            "client_us": client_us}, marks


def pages_between(marks, t0, t1):
    """Pages done between two times, from the progress marks (linear between them)."""
    def at(t):
        if not marks:
            return 0
        if t <= marks[0][0]:
            return marks[0][2]
        for (ta, _, pa), (tb, _, pb) in zip(marks, marks[1:]):
            if ta <= t <= tb:
                return pa + (pb - pa) * (t - ta) / max(tb - ta, 1e-9)
        return marks[-1][2]
    return max(at(t1) - at(t0), 1)


def node_part(args, procs, work, certs, out):
    secret = os.path.join(work, "secret")
    with open(secret, "w") as f:
        f.write(os.urandom(32).hex())
    os.chmod(secret, 0o600)
    servers = {}
    for transport in TRANSPORTS:
        port = free_port()
        tls = ["--node-tls", certs.server] if transport == "tls" else []
        proc = procs.start(f"node-{transport}", [
            args.fallow, "node", "--listen", f"127.0.0.1:{port}", "--lend", LEND,
            "--secret-file", secret, *tls], port)
        client = ["--secret-file", secret]
        if transport == "tls":
            client += ["--node-tls", certs.client]
        servers[transport] = (f"fallow://127.0.0.1:{port}", proc.pid, client)
        if transport == "tls":
            suite = negotiated(port, certs.client)
            out.write(json.dumps({"part": "suite", "node": suite}) + "\n")
            log(f"the TLS node negotiates {suite} with OpenSSL's defaults")
    configs = list(NODE_CONFIGS)
    for round_no in range(args.rounds):
        for config in configs:
            for transport in rotate(TRANSPORTS, round_no + configs.index(config)):
                target, pid, client = servers[transport]
                r, _ = bench_pages(args.fallow, target, client, config, args.seconds, pid)
                row = {"part": "node", "round": round_no, "config": config,
                       "transport": transport, **r}
                out.write(json.dumps(row) + "\n")
                out.flush()
                log(f"node round {round_no + 1}/{args.rounds} {config:<11} {transport:<9} "
                    f"{r['pages_per_s']:>9,.0f} pages/s  p50 {r['p50']:7.1f} µs  "
                    f"server {r['server_us']:.2f} µs/page  client {fmt(r['client_us'])} µs/page")
    if args.why:
        window = max(args.seconds - 2, 2)
        for config in configs:
            for transport in TRANSPORTS:
                target, pid, client = servers[transport]
                holder = {}

                def attach(client_pid, pid=pid, holder=holder, tag=f"node-{config}-{transport}"):
                    holder["perf"] = Perf(work, tag, {"server": pid, "client": client_pid}, window)

                r, marks = bench_pages(args.fallow, target, client, config, window + 2, pid,
                                       on_measure=attach)
                perf = holder.get("perf")
                if not perf:
                    continue
                perf.wait()
                pages = pages_between(marks, perf.started, perf.started + window)
                row = {"part": "why-node", "config": config, "transport": transport,
                       "pages_per_s": r["pages_per_s"], **perf.results(pages)}
                out.write(json.dumps(row) + "\n")
                out.flush()
                log(f"why node {config} {transport}: {brief_why(row)}")


# --- the NBD part ----------------------------------------------------------------------------

def fio(certs, uri, rw, bs, qd, seconds=None, extra=()):
    argv = [*certs.fio_prefix(), "fio", "--name=r", "--ioengine=nbd", f"--uri={uri}",
            f"--rw={rw}", f"--bs={bs}", f"--iodepth={qd}", f"--size={EXPORT}",
            "--output-format=json", *extra]
    if seconds:
        argv += ["--offset=0", "--norandommap", "--randrepeat=0", "--time_based",
                 f"--runtime={seconds}", f"--ramp_time={RAMP_S}", "--lat_percentiles=1"]
    out = subprocess.run(argv, capture_output=True, text=True, cwd=certs.home,
                         timeout=(seconds or 120) + 120)
    if out.returncode != 0 or "{" not in out.stdout:
        raise SystemExit(f"fio {rw} {uri} failed: {(out.stderr or out.stdout).strip()[-2000:]}")
    job = json.loads(out.stdout[out.stdout.index("{"):])["jobs"][0]
    if job.get("error"):
        raise SystemExit(f"fio {rw} {uri}: error {job['error']}")
    side = job["write"] if "write" in rw else job["read"]
    pct = side["lat_ns"].get("percentile", {})
    return {"iops": side["iops"], "p50": pct.get("50.000000", 0) / 1e3,
            "p99": pct.get("99.000000", 0) / 1e3, "ios": side["total_ios"],
            "fio_us": (job["usr_cpu"] + job["sys_cpu"]) / 100 / max(side["iops"], 1e-9) * 1e6}


def pages_read(metrics_port):
    """fallow's pages read by tier (local, pool, backing, dirty), from its metrics."""
    tiers = {}
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    except OSError:
        return tiers
    for line in text.decode().splitlines():
        m = re.match(r'fallow_nbd_cache_pages_read_total\{[^}]*tier="(\w+)"[^}]*\}\s+(\d+)', line)
        if m:
            tiers[m.group(1)] = int(m.group(2))
    return tiers


def hit_ratio(before, after):
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    total = sum(d.values())
    return (total - d.get("backing", 0)) / total if total else None


def nbd_part(args, procs, work, certs, out):
    servers = {}
    for config in NBD_CONFIGS:
        port = free_port()
        tls = config.endswith("-tls")
        if config.startswith("fallow"):
            metrics = free_port()
            argv = [args.fallow, "nbd", "--export", f"d=mem:{EXPORT}", "--pool", f"local:{POOL}",
                    "--listen", f"127.0.0.1:{port}", "--metrics", f"127.0.0.1:{metrics}"]
            if tls:
                argv += ["--tls", "require", "--tls-certificates", certs.server]
            uri = f"{'nbds' if tls else 'nbd'}://127.0.0.1:{port}/d"
        else:
            metrics = None
            argv = ["nbdkit", "-f", "-i", "127.0.0.1", "-p", str(port)]
            if tls:
                argv += ["--tls=require", f"--tls-certificates={certs.server}"]
            argv += ["memory", EXPORT]
            uri = f"{'nbds' if tls else 'nbd'}://127.0.0.1:{port}/"
        proc = procs.start(config, argv, port)
        servers[config] = (uri, proc.pid, metrics)
    for config, (uri, _, metrics) in servers.items():
        log(f"{config}: filling {EXPORT} with random data"
            + (", then reading it all once (warming the cache)" if metrics else ""))
        fio(certs, uri, "write", "1m", 4, extra=["--refill_buffers"])
        if metrics:
            # 64 KiB at a time: below the scan bypass, so that every page is kept.
            fio(certs, uri, "read", "64k", 4)
    for round_no in range(args.rounds):
        for config in rotate(NBD_CONFIGS, round_no):
            uri, pid, metrics = servers[config]
            tiers = pages_read(metrics) if metrics else None
            cpu = cpu_seconds(pid)
            r = fio(certs, uri, "randread", "4k", QD, args.seconds)
            used = cpu_seconds(pid) - cpu
            # The server's CPU over the whole fio run (its ramp included), per read at the
            # measured rate over that time: an estimate.
            r["server_us"] = used * 1e6 / max(r["iops"] * (args.seconds + RAMP_S), 1)
            r["hit_ratio"] = hit_ratio(tiers, pages_read(metrics)) if metrics else None
            row = {"part": "nbd", "round": round_no, "config": config, **r}
            out.write(json.dumps(row) + "\n")
            out.flush()
            hits = f"  hits {r['hit_ratio']:.3f}" if r["hit_ratio"] is not None else ""
            log(f"nbd round {round_no + 1}/{args.rounds} {config:<10} {r['iops']:>9,.0f} IOPS  "
                f"p50 {r['p50']:7.1f} µs  server {r['server_us']:.1f} µs/read  "
                f"fio {r['fio_us']:.1f} µs/read{hits}")
    if args.why:
        window = max(args.seconds - 2, 2)
        for config in ["fallow", "fallow-tls", "nbdkit-tls"]:
            uri, pid, _ = servers[config]
            argv = [*certs.fio_prefix(), "fio", "--name=r", "--ioengine=nbd", f"--uri={uri}",
                    "--rw=randread", "--bs=4k", f"--iodepth={QD}", f"--size={EXPORT}",
                    "--offset=0", "--norandommap", "--randrepeat=0", "--time_based",
                    f"--runtime={window + 3}", "--output-format=json"]
            with tempfile.TemporaryFile("w+") as stdout:
                proc = subprocess.Popen(argv, stdout=stdout, stderr=subprocess.DEVNULL,
                                        cwd=certs.home)
                time.sleep(1.5)
                fio_pid = fio_worker(proc.pid)
                perf = Perf(work, f"nbd-{config}", {"server": pid, "client": fio_pid}, window)
                perf.wait()
                proc.wait(window + 120)
                stdout.seek(0)
                text = stdout.read()
            job = json.loads(text[text.index("{"):])["jobs"][0]
            ops = job["read"]["iops"] * window
            row = {"part": "why-nbd", "config": config, "iops": job["read"]["iops"],
                   **perf.results(ops)}
            out.write(json.dumps(row) + "\n")
            out.flush()
            log(f"why nbd {config}: {brief_why(row)}")


def fio_worker(pid):
    """The fio process doing the I/O: setpriv and env exec in place, so `pid` is fio's;
    fio forks its job, which does the reads."""
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        children = []
    return int(children[0]) if children else pid


def cipher_speed():
    """`openssl speed` of the TLS 1.3 ciphers on 4 KiB: µs to seal one page, by cipher."""
    us = {}
    for cipher in ("aes-256-gcm", "aes-128-gcm", "chacha20-poly1305"):
        out = subprocess.run(["openssl", "speed", "-seconds", "1", "-bytes", "4096", "-evp",
                              cipher], capture_output=True, text=True, timeout=60)
        last = out.stdout.strip().splitlines()[-1:] or [""]
        m = re.search(r"([\d.]+)k\s*$", last[0])
        if m:
            us[cipher] = 4096 / (float(m.group(1)) * 1000) * 1e6
    return us


def brief_why(row):
    parts = []
    for role in ("server", "client"):
        if role not in row:
            continue
        calls = row[role]["syscalls_per_op"]
        cpu = row[role]["cpu_us_per_op"]
        parts.append(f"{role} {calls['recv']:.2f} recv + {calls['send']:.2f} send/op, "
                     f"{sum(cpu.values()):.2f} µs/op (AES-GCM {cpu['AES-GCM']:.2f})")
    return "; ".join(parts)


# --- the run ---------------------------------------------------------------------------------

def run(args):
    stamp = time.strftime("%Y-%m-%d-%H%M")
    os.makedirs(os.path.join(ROOT, "bench/out"), exist_ok=True)
    out_path = os.path.join(ROOT, f"bench/out/tls-{stamp}.jsonl")
    work = tempfile.mkdtemp(prefix="fallow-tls-bench-")
    procs = Procs(work, log)

    def stop(signum, _frame):
        raise SystemExit(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        # A copy of the binary: a rebuild of target/ during the run changes nothing here.
        binary = os.path.join(work, "fallow")
        shutil.copy2(args.binary, binary)
        os.chmod(binary, 0o755)
        args.fallow = binary
        certs = Certs(work)
        args.why = args.why and perf_works()
        with open(out_path, "w") as out:
            head = {"cpus": os.cpu_count(), "cpu": cpu_model(), "date": stamp,
                    "load": os.getloadavg()[0], "commit": args.commit or git_commit(),
                    "command": " ".join(["python3", "bench/tls.py", *sys.argv[1:]]),
                    "rounds": args.rounds, "seconds": args.seconds, "only": args.only,
                    "why": args.why, "openssl": version(["openssl", "version"]) or "?",
                    "nbdkit": version(["nbdkit", "--version"]) or "?",
                    "fio": version(["fio", "--version"]) or "?",
                    "libnbd": version(["nbdinfo", "--version"]) or "?"}
            out.write(json.dumps({"machine": head}) + "\n")
            log(f"commit {head['commit']}, {head['cpus']} CPUs, load {head['load']:.1f}; "
                f"raw lines in {os.path.relpath(out_path, ROOT)}"
                + ("" if args.why else "; no why part (perf not usable or --no-why)"))
            if args.why:
                speed = cipher_speed()
                out.write(json.dumps({"part": "cipher", "us_per_4k": speed}) + "\n")
                log("openssl speed, µs per 4 KiB: "
                    + ", ".join(f"{c} {us:.2f}" for c, us in speed.items()))
            if args.only in (None, "node"):
                node_part(args, procs, work, certs, out)
                procs.stop_all()
            if args.only in (None, "nbd"):
                nbd_part(args, procs, work, certs, out)
                procs.stop_all()
            out.write(json.dumps({"end": {"load": os.getloadavg()[0],
                                          "date": time.strftime("%Y-%m-%d-%H%M")}}) + "\n")
    finally:
        procs.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    log(f"raw results in {os.path.relpath(out_path, ROOT)}")
    return out_path


# --- the section -----------------------------------------------------------------------------

def fmt(x, digits=2):
    return "–" if x is None else f"{x:,.{digits}f}"


def spread(xs, digits=1):
    """'median (min–max)' of a list."""
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    med = statistics.median(xs)
    if len(xs) == 1:
        return fmt(med, digits)
    dash = " to " if min(xs) < 0 else "–"
    return f"{fmt(med, digits)} ({fmt(min(xs), digits)}{dash}{fmt(max(xs), digits)})"


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def verdict(value, bound, at_least):
    """met / not met; a median within 10 % of its bound says so (this machine's noise is
    larger than that)."""
    if value is None:
        return "–"
    met = value >= bound if at_least else value <= bound
    close = abs(value - bound) < 0.1 * abs(bound)
    if met:
        return "met, at the edge (within 10 % of the bound)" if close else "met"
    return "**not met**, at the edge (within 10 %)" if close else "**not met**"


def section(path):
    lines = [json.loads(l) for l in open(path) if l.strip()]
    head = lines[0]["machine"]
    end = next((l["end"] for l in lines if "end" in l), {})
    node = [l for l in lines if l.get("part") == "node"]
    nbd = [l for l in lines if l.get("part") == "nbd"]
    why_node = {(l["config"], l["transport"]): l for l in lines if l.get("part") == "why-node"}
    why_nbd = {l["config"]: l for l in lines if l.get("part") == "why-nbd"}
    speed = next((l["us_per_4k"] for l in lines if l.get("part") == "cipher"), {})
    suite = next((l["node"] for l in lines if l.get("part") == "suite"), None)

    node_rounds = {}
    for r in node:
        node_rounds.setdefault((r["round"], r["config"]), {})[r["transport"]] = r
    nbd_rounds = {}
    for r in nbd:
        nbd_rounds.setdefault(r["round"], {})[r["config"]] = r

    def node_vals(config, transport, key):
        return [r[key] for r in node if r["config"] == config and r["transport"] == transport]

    def node_per_round(config, fn):
        return [fn(by) for (_, c), by in sorted(node_rounds.items())
                if c == config and len(by) == len(TRANSPORTS)]

    def nbd_per_round(fn, needs):
        return [fn(by) for _, by in sorted(nbd_rounds.items()) if all(c in by for c in needs)]

    o = [SECTION_TITLE, ""]
    o.append("**Command:** `python3 bench/tls.py` (`--rounds N`, `--seconds S`, `--only node|nbd`, "
             "`--binary PATH`, `--commit REV`, `--no-why`, `--no-write`). It makes a CA and a server certificate "
             "(EC P-256, the openssl commands of docs/security.md) in a temporary directory, starts "
             "every server itself on 127.0.0.1 and runs, round after round with the order rotating: "
             "`fallow bench pages` against a `fallow node` in the clear and one with `--node-tls` "
             "(the `get-qd1` and `get-batched` configurations of bench/node_vs_memcached.sh, "
             f"{KEYS:,} keys, every get a hit), and fio 4 KiB random reads at QD {QD} (`ioengine=nbd`, "
             f"libnbd, one connection) over a {EXPORT[:-1]} MiB export filled with random data, against `fallow "
             f"nbd --export d=mem:{EXPORT} --pool local:{POOL}` (warmed: every read a hit) and `nbdkit "
             f"memory {EXPORT}`, each in the clear and with TLS required. A ratio is taken within a "
             "round, then the median over the rounds. fio runs as `nobody` with a `$HOME` holding "
             "`.pki/libnbd/ca-cert.pem`, because fio's nbd engine cannot pass `?tls-certificates=` "
             "(libnbd refuses local files in a URI unless the program allows them).")
    o.append("")
    o.append(f"**Run:** `{head['command']}`, commit `{head['commit']}`, {head['date']}, "
             f"{head['rounds']} rounds of {head['seconds']} s per run, {head['cpus']} CPUs "
             f"({head['cpu']}), load average {head['load']:.1f} at the start"
             + (f" and {end['load']:.1f} at the end" if end else "")
             + f"; {head['openssl']}, {head['nbdkit']}, {head['fio']}, {head['libnbd']}"
             + (f"; the TLS node's session: {suite} (`openssl s_client`)" if suite else "")
             + ". "
             "**Machine caveat:** a VM with 2 vCPUs shared with other engineers' builds, and "
             "every load generator runs on the same 2 CPUs as the server it measures. TLS costs "
             "the client as much as the server (it decrypts what the server encrypts), so the "
             "ratios include both sides' cryptography; only ratios are meant to travel.")
    o.append("")

    # The targets.
    o.append("| target (issue #29) | measured: median of per-round values (min–max) | status |")
    o.append("|---|---|---|")
    if node:
        thr = node_per_round("get-batched", lambda by: by["tls"]["pages_per_s"]
                             / by["plaintext"]["pages_per_s"])
        added = node_per_round("get-qd1", lambda by: by["tls"]["p50"] - by["plaintext"]["p50"])
        o.append(f"| node, batched gets (`get-batched`): TLS ≥ {NODE_THROUGHPUT} × plaintext pages/s "
                 f"| {spread(thr, 2)} × | {verdict(median(thr), NODE_THROUGHPUT, True)} |")
        o.append(f"| node, get at QD 1 (`get-qd1`): TLS adds ≤ {NODE_ADDED_US:g} µs to the p50 "
                 f"| {spread(added, 1)} µs | {verdict(median(added), NODE_ADDED_US, False)} |")
        best_plain, best_tls = node_vals("get-qd1", "plaintext", "p50"), node_vals("get-qd1", "tls", "p50")
        if best_plain and best_tls:
            best = min(best_tls) - min(best_plain)
            o.append(f"| (context) the same, lowest TLS p50 of the rounds − lowest plaintext p50 "
                     f"| {min(best_tls):.1f} − {min(best_plain):.1f} = {best:.1f} µs | — |")
    if nbd:
        vs = nbd_per_round(lambda by: by["fallow-tls"]["iops"] / by["nbdkit-tls"]["iops"],
                           ["fallow-tls", "nbdkit-tls"])
        o.append(f"| NBD, all-hit 4 KiB random reads at QD {QD}: `fallow nbd --tls require` ≥ "
                 f"{NBD_VS_NBDKIT} × `nbdkit memory --tls=require` | {spread(vs, 2)} × | "
                 f"{verdict(median(vs), NBD_VS_NBDKIT, True)} |")
        ctx = [("fallow / nbdkit, both in the clear", "fallow", "nbdkit"),
               ("fallow with TLS / fallow in the clear", "fallow-tls", "fallow"),
               ("nbdkit with TLS / nbdkit in the clear", "nbdkit-tls", "nbdkit")]
        for label, a, b in ctx:
            x = nbd_per_round(lambda by, a=a, b=b: by[a]["iops"] / by[b]["iops"], [a, b])
            o.append(f"| (context) NBD IOPS, {label} | {spread(x, 2)} × | — |")
    o.append("")

    qd1 = node_vals("get-qd1", "plaintext", "p50") + node_vals("get-qd1", "tls", "p50")
    if node and qd1 and max(qd1) > 2.5 * min(qd1):
        lo, hi = min(node_vals("get-qd1", "plaintext", "p50")), max(node_vals("get-qd1", "plaintext", "p50"))
        o.append(f"**QD 1 on this VM has two regimes:** in the clear a get's p50 was {lo:.1f} µs "
                 f"in some runs and {hi:.1f} µs in others, with nothing changed but the moment "
                 "(the node-against-memcached section measured 94 µs for a node that sleeps "
                 "between requests and 38 µs for one that polls: a wake-up on this VM costs tens "
                 "of microseconds, and how many a request meets depends on the moment). A round whose "
                 "two runs fall in different regimes gives a difference of tens of microseconds "
                 "either way, so the per-round median of the QD 1 difference says more about the "
                 "machine than about TLS; the lowest p50 of each side, both in the fast regime, "
                 "is the context row under the QD 1 target.")
        o.append("")
    if node:
        o.append(f"`fallow bench pages`, {KEYS:,} keys of 4 KiB, medians (min–max) over the rounds; "
                 "CPU per page is the process's user + system time over the measured phase "
                 "(the load generator's from its first second on):")
        o.append("")
        o.append("| configuration | transport | pages/s | p50 µs | p99 µs | node CPU µs/page "
                 "| load generator CPU µs/page |")
        o.append("|---|---|---|---|---|---|---|")
        for config in NODE_CONFIGS:
            for transport in TRANSPORTS:
                v = lambda key: node_vals(config, transport, key)
                o.append(f"| `{config}` ({NODE_LABELS[config]}) | {transport} | "
                         f"{spread(v('pages_per_s'), 0)} | {spread(v('p50'))} | {spread(v('p99'))} | "
                         f"{spread(v('server_us'), 2)} | {spread(v('client_us'), 2)} |")
        o.append("")
    if nbd:
        o.append(f"fio 4 KiB random reads at QD {QD}, medians (min–max) over the rounds; the "
                 "server's CPU per read is its CPU time over the fio run divided by the reads at "
                 "the measured rate (an estimate), fio's from its own usr + sys; the hit ratio "
                 "is fallow's (local tier + pool) / pages read, from its metrics:")
        o.append("")
        o.append("| server | IOPS | p50 µs | p99 µs | server CPU µs/read | fio CPU µs/read | hit ratio |")
        o.append("|---|---|---|---|---|---|---|")
        for config in NBD_CONFIGS:
            v = lambda key: [r[key] for r in nbd if r["config"] == config]
            hits = v("hit_ratio")
            hit = "–" if all(h is None for h in hits) else fmt(min(h for h in hits if h is not None), 3)
            o.append(f"| {NBD_LABELS[config]} | {spread(v('iops'), 0)} | {spread(v('p50'))} | "
                     f"{spread(v('p99'))} | {spread(v('server_us'))} | {spread(v('fio_us'))} | "
                     f"{hit if hit == '–' else 'lowest ' + hit} |")
        o.append("")
    if why_node or why_nbd:
        o.extend(why_section(why_node, why_nbd, speed))
    return "\n".join(o) + "\n"


def why_section(why_node, why_nbd, speed):
    o = ["**Where the time goes** (after the rounds, one more run of each with `perf record -F "
         "999 -e cpu-clock` and `perf stat` of the system calls attached to the server and to "
         "the client for the middle of the run; CPU per page or read by where the samples fell: "
         "AES-GCM is the AES-NI and carry-less-multiply code of libcrypto or GnuTLS/nettle, "
         "found by its instructions since the libraries are stripped; \"the program\" is "
         "fallow's, fio's or nbdkit's own code with libnbd):", ""]
    cats = CATEGORIES
    o.append("| run | side | recv / send / wait calls per op | CPU µs per op | "
             + " | ".join(cats) + " |")
    o.append("|---|---|---|---|" + "---|" * len(cats))
    rows = []
    for (config, transport), r in sorted(why_node.items()):
        unit = "page"
        rows.append((f"node `{config}`, {transport}", unit, r))
    for config in ["fallow", "fallow-tls", "nbdkit-tls"]:
        if config in why_nbd:
            rows.append((f"NBD QD {QD}, {config}", "read", why_nbd[config]))
    for label, unit, r in rows:
        for role in ("server", "client"):
            calls, cpu = r[role]["syscalls_per_op"], r[role]["cpu_us_per_op"]
            side = {"server": "server", "client": "client (fio)" if label.startswith("NBD")
                    else "client (bench)"}[role]
            o.append(f"| {label} | {side} | {calls['recv']:.2f} / {calls['send']:.2f} / "
                     f"{calls['wait']:.2f} | {sum(cpu.values()):.2f} | "
                     + " | ".join(f"{cpu[c]:.2f}" for c in cats) + " |")
    o.append("")
    o.extend(findings(why_node, why_nbd, speed))
    return o


def findings(why_node, why_nbd, speed):
    """What the why runs say, in words (only what their numbers show)."""
    o = []
    total = lambda r, role: sum(r[role]["cpu_us_per_op"].values())
    cat = lambda r, role, c: r[role]["cpu_us_per_op"][c]
    calls = lambda r, role, k: r[role]["syscalls_per_op"][k]
    plain, tls = why_node.get(("get-batched", "plaintext")), why_node.get(("get-batched", "tls"))
    if plain and tls:
        parts = []
        for role, name in (("server", "the node"), ("client", "the load generator")):
            extra = total(tls, role) - total(plain, role)
            aes = cat(tls, role, "AES-GCM") - cat(plain, role, "AES-GCM")
            lib = cat(tls, role, "TLS library, other") - cat(plain, role, "TLS library, other")
            kern = (cat(tls, role, "kernel, other") + cat(tls, role, "kernel: copies")
                    - cat(plain, role, "kernel, other") - cat(plain, role, "kernel: copies"))
            mem = cat(tls, role, "memcpy/memset") - cat(plain, role, "memcpy/memset")
            parts.append(f"{name} {extra:+.2f} µs per page ({total(plain, role):.2f} → "
                         f"{total(tls, role):.2f}): AES-GCM {aes:+.2f}, the rest of OpenSSL "
                         f"{lib:+.2f}, memcpy {mem:+.2f}, the kernel {kern:+.2f}, its system "
                         f"calls {calls(plain, role, 'all'):.2f} → {calls(tls, role, 'all'):.2f} "
                         "per page")
        text = "* **Node, batched gets:** TLS costs " + "; ".join(parts) + "."
        aes = cat(tls, "server", "AES-GCM") + cat(tls, "client", "AES-GCM")
        both = total(plain, "server") + total(plain, "client")
        both_ratio = both / (both + aes)
        node_ratio = total(plain, "server") / (total(plain, "server") + cat(tls, "server", "AES-GCM"))
        text += (f" The cipher alone is {aes:.2f} µs per page over both sides"
                 + (f" (`openssl speed`: AES-256-GCM seals 4 KiB in {speed['aes-256-gcm']:.2f} µs "
                    f"here, AES-128-GCM in {speed.get('aes-128-gcm', 0):.2f})"
                    if "aes-256-gcm" in speed else "")
                 + f". Were a run bound by CPU and TLS cost nothing but the cipher, batched gets "
                 f"would reach {both_ratio:.2f} × plaintext with the load generator on the same "
                 f"CPUs ({both:.2f} µs of CPU per page in the clear, node and load generator "
                 f"together), and {node_ratio:.2f} × with it on another host (the node's "
                 f"{total(plain, 'server'):.2f} µs).")
        if node_ratio < NODE_THROUGHPUT:
            text += (f" So the {NODE_THROUGHPUT} × target is out of reach with AES-GCM at this "
                     "speed, whatever else is cut, wherever the client runs.")
        elif both_ratio < NODE_THROUGHPUT:
            text += (f" So the {NODE_THROUGHPUT} × target is out of reach with the load "
                     "generator on the node's CPUs, whatever else is cut.")
        o.append(text)
    plain, tls = why_node.get(("get-qd1", "plaintext")), why_node.get(("get-qd1", "tls"))
    if plain and tls:
        text = (f"* **Node, QD 1:** each request and each reply is a TLS record of its own. "
                f"The node makes {calls(tls, 'server', 'recv'):.2f} receive calls per request "
                f"with TLS against {calls(plain, 'server', 'recv'):.2f} in the clear, the load "
                f"generator {calls(tls, 'client', 'recv'):.2f} against "
                f"{calls(plain, 'client', 'recv'):.2f}")
        if calls(tls, "server", "recv") >= 1.5 * calls(plain, "server", "recv"):
            text += (" (without read-ahead OpenSSL reads a record's 5-byte header, then its "
                     "body, then tries once more and finds nothing, where tokio's own reads "
                     "stop at a short read)")
        text += (f". OpenSSL's work around the cipher costs "
                 f"{cat(tls, 'server', 'TLS library, other'):.2f} µs per request on the node and "
                 f"{cat(tls, 'client', 'TLS library, other'):.2f} on the load generator, against "
                 f"AES-GCM's {cat(tls, 'server', 'AES-GCM'):.2f} and "
                 f"{cat(tls, 'client', 'AES-GCM'):.2f} (one run, under this machine's noise).")
        o.append(text)
    f, ft, kt = why_nbd.get("fallow"), why_nbd.get("fallow-tls"), why_nbd.get("nbdkit-tls")
    if f and ft:
        text = (f"* **NBD, fallow:** with TLS its server makes {calls(ft, 'server', 'recv'):.2f} "
                f"receive and {calls(ft, 'server', 'send'):.2f} send calls per read, against "
                f"{calls(f, 'server', 'recv'):.2f} and {calls(f, 'server', 'send'):.2f} in the "
                f"clear")
        if kt:
            text += (f" (nbdkit with TLS: {calls(kt, 'server', 'recv'):.2f} and "
                     f"{calls(kt, 'server', 'send'):.2f})")
        text += (f", and spends {total(ft, 'server'):.2f} µs of CPU per read against "
                 f"{total(f, 'server'):.2f}"
                 + (f" (nbdkit with TLS: {total(kt, 'server'):.2f})" if kt else "")
                 + f"; of the difference, AES-GCM is "
                 f"{cat(ft, 'server', 'AES-GCM') - cat(f, 'server', 'AES-GCM'):.2f} µs and the "
                 f"kernel {cat(ft, 'server', 'kernel, other') + cat(ft, 'server', 'kernel: copies') - cat(f, 'server', 'kernel, other') - cat(f, 'server', 'kernel: copies'):+.2f} µs.")
        o.append(text)
        tls_send, plain_send = calls(ft, "server", "send"), calls(f, "server", "send")
        tls_recv, plain_recv = calls(ft, "server", "recv"), calls(f, "server", "recv")
        if tls_send >= 1.5 and plain_send < 1.0:
            o.append("  Each reply leaves as two TLS records in two `send` calls (its header, then "
                     "its 4 KiB), one reply per turn of the connection's loop: the transmission "
                     "loop hands all ready replies to `poll_write_vectored`, which tokio-openssl's "
                     "`SslStream` does not implement, so tokio's default writes the first slice "
                     "only. In the clear the same call is one `writev` of every ready reply.")
        if tls_recv >= 1.5 and plain_recv < 1.0:
            o.append("  Each request comes in a TLS record of its own (libnbd sends each request "
                     "by itself), and OpenSSL, without read-ahead (`SSL_CTX_set_read_ahead`), "
                     "reads each record with two `recv` calls, its 5-byte header and then the "
                     "rest; in the clear one `recv` takes every request that has arrived.")
        if 0.8 <= tls_send < 1.5 and plain_send < 0.5:
            o.append("  Each reply still leaves in a record and a `send` of its own: libnbd sends "
                     "each request in a TLS record of its own, a read of the TLS stream returns "
                     "one record (one request), and the connection's loop answers that request "
                     "before it reads the next, so replies are ready one at a time. In the clear "
                     "one `recv` brings every request that has arrived, and their replies leave "
                     "together in one `writev`.")
        if tls_send >= 2 * max(plain_send, 0.05):
            o.append("  By hand (2026-11-29, not rerun by this script), on the tree of `9e320a1`: "
                     "(1) a vectored write gathered into one TLS write and (2) OpenSSL's "
                     "read-ahead on both TLS contexts (the two are in the code since `e6aad83`), "
                     "and (3) the transmission loop reading every record already readable before "
                     "it answers, together gave 1.01 × `nbdkit --tls=require` (0.86–1.51 over 5 "
                     "rounds of 5 s, side by side with `9e320a1`, which gave 0.46 ×) at 8.1 µs of "
                     "server CPU per read against 22.0, and 0.30 `send` calls per read; (1) and "
                     "(2) without (3) gave 0.67 × and 1.09 `send` calls per read.")
    return o


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seconds", type=int, default=5, help="measured seconds of each run")
    p.add_argument("--only", choices=["node", "nbd"], help="run one part only (no section)")
    p.add_argument("--binary", default=os.path.join(ROOT, "target/release/fallow"),
                   help="the fallow binary (default: target/release/fallow; build it first)")
    p.add_argument("--commit", help="the commit --binary was built from, when it is not the "
                   "checkout's HEAD (default: HEAD)")
    p.add_argument("--no-why", dest="why", action="store_false",
                   help="skip the perf runs that show where the time goes")
    p.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--table", help="print the section of an earlier run's JSON lines")
    args = p.parse_args()
    if args.table:
        print(section(args.table), end="")
        return
    if not os.access(args.binary, os.X_OK):
        raise SystemExit(f"{args.binary}: no such binary (cargo build --release -p fallow)")
    text = section(run(args))
    print(text, end="")
    if not args.no_write and not args.only:
        write_section(MARKER, text)
        log("wrote the tls section of BENCHMARKS.md")


if __name__ == "__main__":
    main()
