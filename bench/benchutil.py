"""What the Python benchmark drivers share: free ports on 127.0.0.1, the commit, and the
section of BENCHMARKS.md between a driver's markers."""

import os
import socket
import subprocess

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


def git_commit():
    """The short hash of the checkout's HEAD."""
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True)
    return out.stdout.strip()


def write_section(marker, text):
    """Puts `text` between `<!-- MARKER:start -->` and `<!-- MARKER:end -->` in
    BENCHMARKS.md."""
    path = os.path.join(ROOT, "BENCHMARKS.md")
    doc = open(path).read()
    start, end = f"<!-- {marker}:start -->\n", f"<!-- {marker}:end -->"
    if start not in doc or end not in doc:
        raise SystemExit(f"BENCHMARKS.md has no {marker} markers")
    head, rest = doc.split(start, 1)
    _, tail = rest.split(end, 1)
    open(path, "w").write(head + start + text + end + tail)
