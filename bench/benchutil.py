"""What the Python benchmark drivers share: free ports on 127.0.0.1, the commit, tools'
versions, the processes a driver starts (stopped by PID on the way out), and the section
of BENCHMARKS.md between a driver's markers."""

import os
import signal
import socket
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port(kind=socket.SOCK_STREAM):
    """A port of 127.0.0.1 the OS has just handed out (TCP, or UDP with SOCK_DGRAM)."""
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port):
    """Whether something accepts TCP connections on 127.0.0.1:PORT."""
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def fio_verify_job(name, uri, seconds):
    """fio job `name` against NBD `uri` for `seconds`: random 4 KiB reads and writes at QD 8 over
    256 MiB, every block written read back and checked (crc32c) within 1,024 writes, JSON
    out. The load of the soak and of the threads A/B."""
    return ["fio", f"--name={name}", "--thread", "--ioengine=nbd", f"--uri={uri}",
            "--rw=randrw", "--bs=4k", "--iodepth=8", "--size=256M", "--verify=crc32c",
            "--verify_backlog=1024", "--verify_fatal=1", "--verify_state_save=0",
            "--time_based", f"--runtime={seconds}", "--output-format=json"]


def wb_wt_exports(work, size=256 << 20):
    """Two exports of `fallow nbd` over fresh sparse files of `size` bytes in `work`: `wb`,
    write-back, from the flags, and `wt`, write-through, in a config file section of its
    own. Returns the files by export name and the arguments that serve them."""
    images = {}
    for export in ("wb", "wt"):
        images[export] = os.path.join(work, f"{export}.img")
        with open(images[export], "wb") as f:
            f.truncate(size)
    config = os.path.join(work, "nbd.toml")
    with open(config, "w") as f:
        f.write('[exports.wt]\nbacking = "file:%s"\nwrite_policy = "through"\n' % images["wt"])
    return images, ["--export", f"wb=file:{images['wb']}", "--write-policy", "back",
                    "--config", config]


def git_commit():
    """The short hash of the checkout's HEAD."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True)
    return out.stdout.strip()


def version(argv):
    """The first line a tool prints of its version, or None."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


class Procs:
    """Processes a driver starts, each with its log in the scratch directory `work`,
    stopped by PID (or by their own process group, for one whose children must go too,
    such as a guest's QEMU) on the way out: call `stop_all` in a `finally`."""

    def __init__(self, work, log=None):
        self.work, self.log, self.procs = work, log, []

    def start(self, name, argv, port=None, group=False):
        """Starts `argv`, its output in WORK/NAME.log; with `port`, waits until it listens
        there (30 s at most)."""
        logf = open(os.path.join(self.work, f"{name}.log"), "w")
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True)
        self.procs.append((proc, group))
        deadline = time.time() + 30
        while port is not None and not port_open(port):
            if proc.poll() is not None or time.time() > deadline:
                logf.flush()
                raise RuntimeError(f"{name} did not listen on {port}: "
                                   f"{open(logf.name).read()[-2000:]}")
            time.sleep(0.05)
        if self.log and port is not None:
            self.log(f"{name}: pid {proc.pid}, 127.0.0.1:{port}")
        return proc

    def adopt(self, proc, group=False):
        """Stops `proc`, started elsewhere, with the others."""
        self.procs.append((proc, group))
        return proc

    @staticmethod
    def stop(proc, group=False, timeout=15):
        """SIGTERM, then SIGKILL after `timeout` s; for a group, the whole group."""
        def send(sig):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        try:
            if proc.poll() is None:
                send(signal.SIGTERM)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    send(signal.SIGKILL)
                    proc.wait()
            elif group:
                # Its children (QEMU) may outlive it: the group is its own.
                os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def stop_all(self):
        for proc, group in reversed(self.procs):
            self.stop(proc, group)
        self.procs = []


def write_section(marker, text):
    """Puts `text` between `<!-- MARKER:start -->` and `<!-- MARKER:end -->` in
    BENCHMARKS.md; a driver's first run adds the markers at the end."""
    path = os.path.join(ROOT, "BENCHMARKS.md")
    doc = open(path).read()
    start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
    if start not in doc or end not in doc:
        doc += ("" if doc.endswith("\n") else "\n") + f"\n{start}{end}\n"
    head, rest = doc.split(start, 1)
    _, tail = rest.split(end, 1)
    open(path, "w").write(head + start + text + end + tail)
