#!/usr/bin/env bash
# Checks what deploy/ gives operators: the Prometheus alerting rules
# (deploy/prometheus/fallow-alerts.yml), their unit tests (fallow-alerts.test.yml), and the
# Grafana dashboard (deploy/grafana/fallow-dashboard.json).
#
#   1. promtool check rules: the rules parse, every expression is valid PromQL;
#   2. promtool test rules: each alert fires on the series meant to fire it, and on no other;
#   3. the dashboard is JSON with a ${DS_PROMETHEUS} input, the variables it uses, unique
#      panel ids, and queries that are valid PromQL (checked by promtool, as recording rules);
#   4. every metric name in the three files is one that a real `fallow node` and
#      `fallow nbd` serve: both are started on 127.0.0.1, given a little traffic, and
#      scraped; and every label those files match on a metric is one its samples carry.
#
# Usage: scripts/check-deploy.sh [FALLOW_BINARY]   (default: target/debug/fallow)
# Needs promtool (Debian package prometheus) and python3; installs nothing. Exits non-zero
# with a message on the first failure. crates/fallow/tests/deploy_rules.rs runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

bin=${1:-target/debug/fallow}
rules=deploy/prometheus/fallow-alerts.yml
tests=deploy/prometheus/fallow-alerts.test.yml
dashboard=deploy/grafana/fallow-dashboard.json

step() { printf '==> %s\n' "$*"; }
fail() {
    printf 'check-deploy: %s\n' "$*" >&2
    exit 1
}

command -v promtool >/dev/null ||
    fail "promtool not found: install it with apt-get install --no-install-recommends prometheus (Debian), or from https://prometheus.io/download/"
command -v python3 >/dev/null || fail "python3 not found: install it (Debian package python3)"
[ -x "$bin" ] || fail "no fallow binary at $bin: build it (cargo build -p fallow) or pass its path"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

step "promtool check rules $rules"
promtool check rules "$rules"

step "promtool test rules $tests"
(cd "$(dirname "$tests")" && promtool test rules "$(basename "$tests")")

step "dashboard $dashboard"
python3 -m json.tool "$dashboard" >/dev/null || fail "$dashboard is not valid JSON"
python3 - "$dashboard" "$tmp/dashboard-rules.yml" <<'PY'
"""Checks the dashboard's structure; writes its queries as recording rules for promtool."""
import json
import re
import sys

path, rules_out = sys.argv[1], sys.argv[2]
dash = json.load(open(path))
problems = []
DS = "${DS_PROMETHEUS}"

if not any(i.get("name") == "DS_PROMETHEUS" and i.get("pluginId") == "prometheus"
           for i in dash.get("__inputs", [])):
    problems.append("no __inputs entry DS_PROMETHEUS for the prometheus plugin")
if not isinstance(dash.get("schemaVersion"), int) or dash["schemaVersion"] < 36:
    problems.append(f"schemaVersion {dash.get('schemaVersion')!r}: expected 36 or later")
variables = {v.get("name"): v for v in dash.get("templating", {}).get("list", [])}
for name in ("instance", "export"):
    if name not in variables:
        problems.append(f"no templating variable {name!r}")
builtin = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s", "__range_ms"}

queries = []  # (where, PromQL)
ids = set()
def panels(items):
    for p in items:
        yield p
        yield from panels(p.get("panels", []))
for p in panels(dash.get("panels", [])):
    title = p.get("title", "?")
    if p.get("id") in ids:
        problems.append(f"panel {title!r}: id {p.get('id')} used twice")
    ids.add(p.get("id"))
    if p.get("type") == "row":
        continue
    if p.get("datasource", {}).get("uid") != DS:
        problems.append(f"panel {title!r}: datasource is not {DS}")
    if not p.get("targets"):
        problems.append(f"panel {title!r}: no queries")
    for t in p.get("targets", []):
        if t.get("datasource", {}).get("uid") != DS:
            problems.append(f"panel {title!r}, query {t.get('refId')}: datasource is not {DS}")
        queries.append((f"panel {title!r} query {t.get('refId')}", t.get("expr", "")))
for name, v in variables.items():
    if v.get("type") != "query":
        continue
    if v.get("datasource", {}).get("uid") != DS:
        problems.append(f"variable {name!r}: datasource is not {DS}")
    q = v.get("query")
    q = q.get("query", "") if isinstance(q, dict) else q or ""
    m = re.fullmatch(r"\s*label_values\((.*),\s*([a-zA-Z_]\w*)\s*\)\s*", q, re.S)
    queries.append((f"variable {name!r}", m.group(1) if m else q))

rules = []
for i, (where, expr) in enumerate(queries):
    for var in re.findall(r"\$\{?(\w+)", expr):
        if var not in variables and var not in builtin:
            problems.append(f"{where}: uses ${var}, which is not a variable")
    promql = re.sub(r"\$\{?__rate_interval\}?|\$\{?__interval\}?|\$\{?__range\}?", "5m", expr)
    promql = re.sub(r"\$\{?\w+\}?", ".*", promql)
    rules.append({"record": f"dashboard:query:{i}", "expr": promql})
# JSON is YAML: promtool reads it as a rule file.
json.dump({"groups": [{"name": "dashboard", "rules": rules}]}, open(rules_out, "w"), indent=1)
with open(rules_out + ".where", "w") as f:
    f.write("\n".join(f"dashboard:query:{i}: {w}" for i, (w, _) in enumerate(queries)) + "\n")
if problems:
    sys.exit("dashboard problems:\n  " + "\n  ".join(problems))
shown = sum(1 for p in panels(dash.get("panels", [])) if p.get("type") != "row")
print(f"  {shown} panels, {len(queries)} queries, variables {', '.join(sorted(variables))}")
PY
promtool check rules "$tmp/dashboard-rules.yml" >"$tmp/promtool.out" 2>&1 || {
    cat "$tmp/promtool.out" "$tmp/dashboard-rules.yml.where" >&2
    fail "a dashboard query is not valid PromQL (rules numbered as listed above)"
}
echo "  every query is valid PromQL"

step "metric names against a running fallow node and fallow nbd ($bin)"
python3 - "$bin" "$tmp" "$rules" "$tests" "$dashboard" <<'PY'
"""Starts `fallow node` and `fallow nbd`, gives them some traffic, scrapes both, and checks
every metric name (and the labels matched on it) in the deploy files against the scrapes."""
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

binary, tmp, files = sys.argv[1], sys.argv[2], sys.argv[3:]
START = 30  # seconds a debug build on a busy machine may take to listen
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Labels Prometheus adds to every series of a target, not the exporter.
TARGET_LABELS = {"job", "instance"}

children = []

def start(name, args):
    log = open(os.path.join(tmp, name + ".log"), "w")
    env = dict(os.environ, FALLOW_LOG="info")
    child = subprocess.Popen([binary, *args], stdin=subprocess.DEVNULL, stdout=log,
                             stderr=subprocess.STDOUT, env=env)
    children.append(child)
    return child, os.path.join(tmp, name + ".log")

def wait_for(child, log, pattern):
    deadline = time.monotonic() + START
    while time.monotonic() < deadline:
        text = ANSI.sub("", open(log).read())
        m = re.search(pattern, text)
        if m:
            return m.group(1)
        if child.poll() is not None:
            break
        time.sleep(0.05)
    sys.exit(f"{' '.join(child.args)}: no line matching {pattern!r} within {START} s; "
             f"its log:\n{open(log).read()}")

def scrape(addr):
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        return r.read().decode()

def poke(addr, data):
    host, port = addr.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        if data:
            s.sendall(data)
            s.settimeout(2)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass

try:
    secret = os.path.join(tmp, "secret")
    with open(secret, "w") as f:
        f.write(os.urandom(24).hex())
    node, node_log = start("node", ["node", "--secret-file", secret, "--listen", "127.0.0.1:0",
                                    "--metrics", "127.0.0.1:0", "--lend", "16M"])
    nbd, nbd_log = start("nbd", ["nbd", "--export", "d=mem:16M", "--listen", "127.0.0.1:0",
                                 "--metrics", "127.0.0.1:0", "--pool", "local:16M",
                                 "--write-policy", "back"])
    node_addr = wait_for(node, node_log, r"listening on TCP addr=(\S+)")
    node_metrics = wait_for(node, node_log, r"serving metrics at http://([^/\s]+)/metrics")
    nbd_addr = wait_for(nbd, nbd_log, r"NBD listening addr=(\S+)")
    nbd_metrics = wait_for(nbd, nbd_log, r"serving metrics at http://([^/\s]+)/metrics")
    # Traffic, so that labelled families have samples: a bad frame for the node
    # (protocol_errors{kind}), a client that hangs up in the NBD handshake
    # (negotiation_failures{reason}), and NBD writes and reads (requests{cmd,result}).
    poke(node_addr, b"this is not a fallow frame\n" * 8)
    poke(nbd_addr, b"")
    for rw in ("write", "read"):
        subprocess.run([binary, "bench", "blk", "--target", f"nbd://{nbd_addr}/d", "--rw", rw,
                        "--duration", "200ms", "--range", "1M"],
                       check=True, stdout=subprocess.DEVNULL, timeout=60)
    texts = [scrape(node_metrics), scrape(nbd_metrics)]
finally:
    for child in children:
        child.terminate()
    for child in children:
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()

# Names: from the samples, and from each family's TYPE (a family may have no sample yet).
# prometheus-client writes a counter's TYPE without `_total`, its samples with it.
SUFFIXES = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"],
            "gauge": [""], "unknown": [""], "info": ["_info"]}
names, labels = set(), {}
for text in texts:
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(maxsplit=3)
            names.update(family + s for s in SUFFIXES.get(kind, [""]))
        elif line and not line.startswith("#"):
            m = re.match(r"([a-zA-Z_:][\w:]*)(\{(.*)\})?\s", line)
            if m:
                names.add(m.group(1))
                labels.setdefault(m.group(1), set()).update(
                    re.findall(r'(\w+)="', m.group(3) or ""))

# Every fallow_node_/fallow_nbd_ name in the files, and the labels matched on it.
SELECTOR = re.compile(r"\b(fallow_(?:node|nbd)_\w+)\s*(\{[^}]*\})?")
used = {}  # name -> {label: [file]}
for path in files:
    text = open(path).read()
    if path.endswith(".json"):
        strings = []
        def collect(v):
            if isinstance(v, str):
                strings.append(v)
            elif isinstance(v, dict):
                for x in v.values():
                    collect(x)
            elif isinstance(v, list):
                for x in v:
                    collect(x)
        collect(json.loads(text))
        text = "\n".join(strings)
    text = text.replace('\\"', '"')
    for m in SELECTOR.finditer(text):
        matchers = re.sub(r'"[^"]*"', '""', m.group(2) or "")
        found = used.setdefault(m.group(1), {})
        for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
            found.setdefault(label, set()).add(os.path.basename(path))

problems, unverified = [], []
for name in sorted(used):
    if name not in names:
        problems.append(f"{name}: no such metric in the scrapes of fallow node and fallow nbd")
        continue
    wanted = set(used[name]) - TARGET_LABELS
    if not wanted:
        continue
    if name not in labels:
        unverified.append(f"{name}{{{','.join(sorted(wanted))}}}")
        continue
    for label in sorted(wanted - labels[name]):
        problems.append(f"{name}: no label {label!r} (its samples carry "
                        f"{sorted(labels[name]) or 'none'}), matched in "
                        f"{', '.join(sorted(used[name][label]))}")
if not problems:
    print(f"  {len(used)} metric names used, all served")
if unverified:
    print("  labels not verified (no sample in the scrape): " + ", ".join(unverified))
served = {n for n in names if n.startswith(("fallow_node_", "fallow_nbd_"))}
base = lambda n: re.sub(r"_(total|bucket|sum|count)$", "", n)
unused = sorted({base(n) for n in served} - {base(n) for n in used})
if unused:
    print("  served but used nowhere in deploy/ (fine, for information): " + ", ".join(unused))
if problems:
    sys.exit("metric problems:\n  " + "\n  ".join(problems))
PY

echo "check-deploy: all checks passed"
