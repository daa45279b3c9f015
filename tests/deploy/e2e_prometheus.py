#!/usr/bin/env python3
"""End-to-end check of the deploy/ monitoring files against a real daemon and a real Prometheus.

1. Starts graphpoold (host backend, loopback only) with the shipped example configuration
   deploy/graphpoold.toml, overriding only what a test must (socket paths, group, backend,
   metrics port), and checks the systemd readiness protocol: READY=1 on NOTIFY_SOCKET.
2. Creates sessions from separate client processes (tests/deploy/client_worker.py, over stubs
   generated from proto/graphpool/v1): two jobs, several ranks and GPUs, grants, plans with a
   reservation, a detach, a process that exits, refusals by device budget and by job quota.
3. Starts Prometheus (Debian's package) on loopback, scraping the daemon every second with the
   scrape settings docs/deploy.md prescribes (job "graphpoold") and loading
   deploy/prometheus/rules.yml; waits for scrapes.
4. Evaluates through Prometheus's HTTP API:
   - every target expression and template-variable query of deploy/grafana/graphpool.json,
     with $node, $gpu and $__rate_interval replaced as Grafana would (a node and all GPUs
     found in the data; 30s), as an instant query and, for range panels, a range query. Each
     must parse and return at least one sample. Expressions that use metrics this setup
     cannot produce are parse-only: dcgm-exporter's DCGM_* series (no dcgm-exporter here) and
     graphpool_device_driver_used_bytes (NVML, cuda backend only). They must still be accepted
     by the parser (HTTP 200, status success).
   - every rule of deploy/prometheus/rules.yml: a recording rule's expression must return data;
     an alert's expression must parse and may be empty when its condition is false. Then
     every vector selector inside it (found by a small PromQL tokenizer) must return data on
     its own, which proves that the alert watches series that exist with the labels it
     names; selectors of recording-rule outputs are waited for until Prometheus has recorded
     them. Prometheus must report every rule group healthy.
   - label names and values, which a query that returns data can still get wrong: every label
     a dashboard query or a rule groups, joins or matches by, and every label of a legend,
     must be carried by the series it selects (labels taken from the daemon's own /metrics);
     a legend's labels must be on every series its query returns; an alert's annotations may
     print only labels its result keeps; matchers on `reason`, `code`, `method`, `transport`
     and `backend` may name only values found in the daemon's source. The series that
     tests/deploy/rules_test.yml feeds promtool must have the daemon's names, labels and
     values, and every alert must have a unit test in which it fires.
5. Sends SIGTERM and checks STOPPING=1 and a clean exit; then starts the daemon once more with
   the Kubernetes configuration (deploy/k8s/core/graphpoold.toml) to prove it loads.

Prints one line per check and "N passed, M failed" at the end; exits 1 on any failure.
Usage: e2e_prometheus.py --bin-dir DIR [--prometheus /usr/bin/prometheus] [--keep]
"""
import argparse
import json
import os
import pathlib
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/graphpool.json"
RULES = ROOT / "deploy/prometheus/rules.yml"
EXAMPLE_CONFIG = ROOT / "deploy/graphpoold.toml"
K8S_CONFIG = ROOT / "deploy/k8s/core/graphpoold.toml"
# Metrics that cannot exist in this test: expressions using them are checked for parsing only.
PARSE_ONLY = (re.compile(r"\bDCGM_[A-Z0-9_]+"), re.compile(r"\bgraphpool_device_driver_used_bytes\b"))
RATE_INTERVAL = "30s"

passed = 0
failed = 0


def result(ok, msg):
    global passed, failed
    if ok:
        passed += 1
        print(f"ok   {msg}", flush=True)
    else:
        failed += 1
        print(f"FAIL {msg}", flush=True)
    return ok


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- PromQL: vector selectors of an expression ---------------------------------------------

_SKIP_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
    "offset", "inf", "nan", "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk",
    "bottomk", "quantile", "count_values", "group", "atan2",
}
_LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}


def _skip_string(expr, i):
    q = expr[i]
    i += 1
    while i < len(expr) and expr[i] != q:
        i += 2 if expr[i] == "\\" else 1
    return i + 1


def _matching(expr, i, open_c, close_c):
    depth = 0
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            i = _skip_string(expr, i)
            continue
        if c == open_c:
            depth += 1
        elif c == close_c:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ValueError(f"unbalanced {open_c} in {expr!r}")


def vector_selectors(expr):
    """Metric selectors (name plus optional {matchers}) in a PromQL expression."""
    out, i, n = [], 0, len(expr)
    while i < n:
        c = expr[i]
        if c in "\"'`":
            i = _skip_string(expr, i)
        elif c == "[":
            i = _matching(expr, i, "[", "]") + 1
        elif c.isdigit() or (c == "." and i + 1 < n and expr[i + 1].isdigit()):
            while i < n and (expr[i].isalnum() or expr[i] == "."):
                i += 1
        elif c.isalpha() or c in "_:":
            j = i
            while j < n and (expr[j].isalnum() or expr[j] in "_:"):
                j += 1
            word, k = expr[i:j], j
            while k < n and expr[k].isspace():
                k += 1
            if word.lower() in _SKIP_WORDS:
                if word.lower() in _LABEL_LISTS and k < n and expr[k] == "(":
                    k = _matching(expr, k, "(", ")") + 1
                i = k
            elif k < n and expr[k] == "(":
                i = k  # a function
            else:
                sel = word
                if k < n and expr[k] == "{":
                    m = _matching(expr, k, "{", "}")
                    sel, j = word + expr[k:m + 1], m + 1
                out.append(sel)
                i = j
        else:
            i += 1
    return out


# ---- the label names and values that queries rely on -----------------------------------------

_MATCHER = re.compile(r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"')
_SAMPLE = re.compile(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+\S+")
_CLAUSE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_TOP_AGGREGATION = re.compile(
    r"^\s*(?:sum|min|max|avg|count|group|stddev|stdvar|topk|bottomk|quantile)\s+by\s*\(([^)]*)\)")
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}
# dcgm-exporter's labels (no dcgm-exporter here).
DCGM_LABELS = {"gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id", "DCGM_FI_DRIVER_VERSION"}
# Gauges only the cuda backend renders, and a gauge of this run labelled the same way.
CUDA_ONLY = {"graphpool_device_driver_used_bytes": "graphpool_device_capacity_bytes"}
# Labels whose values are fixed strings in the daemon's source: a matcher or a test series with
# another value watches something that never happens.
ENUM_LABELS = ("reason", "code", "method", "transport", "backend")


def exposition_labels(text):
    """{series name: label names} of a Prometheus text exposition."""
    out = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line) if line and not line.startswith("#") else None
        if m:
            out.setdefault(m.group(1), set()).update(n for n, _, _ in _MATCHER.findall(m.group(2) or ""))
    return out


def source_strings():
    """Every short string literal of the daemon's source (label values are among them)."""
    out = set()
    for f in (ROOT / "src").rglob("*.rs"):
        out.update(re.findall(r'"([A-Za-z0-9_.-]+)"', f.read_text()))
    return out


def matchers(expr):
    """(label, op, value) of every matcher of every selector in expr."""
    return [m for sel in vector_selectors(expr) if "{" in sel for m in _MATCHER.findall(sel[sel.index("{"):])]


def grouping_labels(expr):
    return [n.strip() for m in _CLAUSE.finditer(expr) for n in m.group(2).split(",") if n.strip()]


def enum_values(op, value):
    """The literal values a matcher names (regex alternatives of plain words only)."""
    if op in ("=~", "!~"):
        alts = value.split("|")
        return alts if all(re.fullmatch(r"[\w.-]+", a) for a in alts) else []
    return [value]


# ---- processes -----------------------------------------------------------------------------

class Procs:
    def __init__(self):
        self.procs = []

    def start(self, name, argv, log, **kw):
        f = open(log, "wb")
        p = subprocess.Popen(argv, stdout=kw.pop("stdout", f), stderr=f, start_new_session=True, **kw)
        self.procs.append((name, p))
        return p

    def stop_all(self):
        for _, p in reversed(self.procs):
            if p.poll() is None:
                try:
                    p.stdin and p.stdin.close()
                except OSError:
                    pass
                p.terminate()
        deadline = time.monotonic() + 15
        for _, p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def wait_for(pred, timeout, interval=0.2):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    return None


def notify_messages(sock, timeout):
    msgs = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not r:
            break
        msgs.append(sock.recv(4096).decode(errors="replace"))
        if any("READY=1" in m or "STOPPING=1" in m for m in msgs):
            break
    return "\n".join(msgs)


def cli_ok(bin_dir, sock, *args):
    r = subprocess.run([str(bin_dir / "graphpool"), "--socket", str(sock), *args],
                       capture_output=True, text=True, timeout=20)
    return r.returncode == 0, r.stdout + r.stderr


# ---- Prometheus HTTP API -------------------------------------------------------------------

class Prom:
    def __init__(self, port):
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path, **params):
        url = f"{self.base}{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=15) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            try:
                return e.code, json.loads(body)
            except ValueError:
                return e.code, {"status": "error", "error": body}
        except (urllib.error.URLError, ConnectionError, TimeoutError) as e:
            return 0, {"status": "error", "error": str(e)}

    def query(self, q):
        code, body = self.get("/api/v1/query", query=q)
        ok = code == 200 and body.get("status") == "success"
        return ok, (body.get("data", {}).get("result", []) if ok else body.get("error"))

    def query_range(self, q, seconds=60, step=5):
        end = time.time()
        code, body = self.get("/api/v1/query_range", query=q, start=f"{end - seconds:.3f}", end=f"{end:.3f}", step=str(step))
        ok = code == 200 and body.get("status") == "success"
        return ok, (body.get("data", {}).get("result", []) if ok else body.get("error"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True, type=pathlib.Path)
    ap.add_argument("--prometheus", default="/usr/bin/prometheus")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory")
    args = ap.parse_args()
    bin_dir = args.bin_dir.resolve()
    for b in ("graphpoold", "graphpool"):
        if not (bin_dir / b).is_file():
            print(f"FAIL {bin_dir / b} does not exist (cargo build --release --bins)")
            return 1

    tmp = pathlib.Path(tempfile.mkdtemp(prefix="gp-deploy-"))
    procs = Procs()
    try:
        return run(args, bin_dir, tmp, procs)
    finally:
        procs.stop_all()
        if args.keep or failed:
            print(f"logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"deploy-e2e: {passed} passed, {failed} failed")


def start_daemon(procs, bin_dir, tmp, name, config, metrics_port):
    sock = tmp / name / "g.sock"
    sock.parent.mkdir()
    notify_path = tmp / name / "notify.sock"
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    env = {k: v for k, v in os.environ.items() if not k.startswith("GRAPHPOOL_")}
    env.update({"NOTIFY_SOCKET": str(notify_path), "RUST_LOG": "info", "GRAPHPOOL_HOSTNAME": "e2e-node"})
    argv = [str(bin_dir / "graphpoold"), "--config", str(config), "--backend", "host",
            "--socket", str(sock), "--socket-group", str(os.getgid()),
            "--metrics-listen", f"127.0.0.1:{metrics_port}",
            "--host-devices", "2", "--host-capacity", "256MiB"]
    p = procs.start(name, argv, tmp / f"{name}.log", env=env, stdin=subprocess.DEVNULL)
    return p, sock, notify


def run(args, bin_dir, tmp, procs):
    # Stubs for the client workers.
    stubs = tmp / "stubs"
    stubs.mkdir()
    r = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT / 'proto'}",
                        f"--python_out={stubs}", f"--grpc_python_out={stubs}",
                        "graphpool/v1/graphpool.proto", "graphpool/v1/plan.proto"],
                       capture_output=True, text=True, timeout=120)
    if not result(r.returncode == 0, f"python stubs generated from proto/graphpool/v1 {r.stderr.strip()}"):
        return 1
    for d in (stubs / "graphpool", stubs / "graphpool/v1"):
        (d / "__init__.py").touch()

    # 1. The daemon, with the shipped example configuration.
    metrics_port = free_port()
    daemon, sock, notify = start_daemon(procs, bin_dir, tmp, "graphpoold", EXAMPLE_CONFIG, metrics_port)
    msgs = notify_messages(notify, 30)
    if not result("READY=1" in msgs, f"graphpoold with deploy/graphpoold.toml sent READY=1 to NOTIFY_SOCKET ({msgs!r})"):
        print((tmp / "graphpoold.log").read_text()[-3000:])
        return 1
    ok = wait_for(lambda: cli_ok(bin_dir, sock, "health")[0], 15)
    result(bool(ok), "`graphpool health` succeeds once READY=1 was sent")
    ok, out = cli_ok(bin_dir, sock, "status")
    result(ok, "`graphpool status` succeeds")

    # A job quota, so that a job-quota refusal can happen (admin call: this process is the
    # daemon's uid).
    sys.path.insert(0, str(stubs))
    import grpc
    from graphpool.v1 import graphpool_pb2 as pb
    from graphpool.v1 import graphpool_pb2_grpc as rpc
    with grpc.insecure_channel(f"unix://{sock}", options=[("grpc.default_authority", "localhost")]) as ch:
        rpc.AdminStub(ch).SetLimits(pb.SetLimitsRequest(jobs=[pb.JobLimit(job_id="quota-job", quota_bytes=32 << 20)]), timeout=10)

    # 2. Sessions.
    env = dict(os.environ, PYTHONPATH=str(stubs))
    worker = str(ROOT / "tests/deploy/client_worker.py")
    plan = [  # name, job, rank, device, mode, MiB...
        ("a0", "llm-a", "0", "0", "hold", "64", "16"),
        ("a1", "llm-a", "1", "1", "hold", "64"),
        ("b0", "llm-b", "0", "0", "hold", "32"),
        ("c0", "llm-c", "0", "1", "detach", "8"),
        ("d0", "llm-d", "0", "1", "exit", "8"),
        ("r0", "llm-r", "0", "0", "refuse", "200"),
        ("q0", "quota-job", "0", "1", "refuse", "16", "64"),
    ]
    workers = []
    no_planner = False
    refusals = {"r0": "alloc200=RESOURCE_EXHAUSTED", "q0": "alloc64=RESOURCE_EXHAUSTED"}
    # One after the other, so that the refusals happen against the holders' grants.
    for name, *wargs in plan:
        p = procs.start(name, [sys.executable, worker, str(sock), *wargs], tmp / f"{name}.log",
                        env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        workers.append((name, p))
        r, _, _ = select.select([p.stdout], [], [], 60)
        line = p.stdout.readline().decode().strip() if r else "(no answer in 60 s)"
        result(line.startswith("READY") and refusals.get(name, "") in line, f"client {name}: {line}")
        no_planner |= "plan=UNIMPLEMENTED" in line
    if no_planner:
        print("note: this graphpoold build has no planner (PlanCapture is UNIMPLEMENTED): "
              "expressions on graphpool_plan_* are checked for parsing only", flush=True)
    ok, out = cli_ok(bin_dir, sock, "status")
    print(out.rstrip())

    # 3. Prometheus.
    prom_port = free_port()
    prom_cfg = tmp / "prometheus.yml"
    prom_cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{
            "job_name": "graphpoold",
            "static_configs": [{"targets": [f"127.0.0.1:{metrics_port}"]}],
        }],
    }))
    procs.start("prometheus", [args.prometheus, f"--config.file={prom_cfg}",
                               f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}",
                               "--storage.tsdb.retention.time=1h", "--log.level=warn"],
                tmp / "prometheus.log", stdin=subprocess.DEVNULL)
    prom = Prom(prom_port)
    up = wait_for(lambda: (lambda r: r[0] and r[1] and r[1][0]["value"][1] == "1")(prom.query('up{job="graphpoold"}')), 60, 0.5)
    if not result(bool(up), "Prometheus scrapes graphpoold (up{job=\"graphpoold\"} == 1)"):
        print((tmp / "prometheus.log").read_text()[-3000:])
        return 1
    # Enough samples for rates over RATE_INTERVAL, and the process-exit of client d0 seen.
    time.sleep(12)

    # 4a. Dashboard.
    dash = json.loads(DASHBOARD.read_text())
    _, nodes = prom.get("/api/v1/label/Hostname/values", **{"match[]": "graphpool_sessions"})
    _, gpus = prom.get("/api/v1/label/gpu/values", **{"match[]": "graphpool_device_capacity_bytes"})
    nodes, gpus = nodes.get("data", []), gpus.get("data", [])
    result(nodes == ["e2e-node"], f"node variable values {nodes}")
    result(gpus == ["0", "1"], f"gpu variable values {gpus}")
    subst = {"node": f"({'|'.join(nodes[:1])})", "gpu": f"({'|'.join(gpus)})",
             "__rate_interval": RATE_INTERVAL, "__interval": "5s", "__range": "1m"}

    def expand(expr):
        expr = re.sub(r"\$\{(\w+)(?::\w+)?\}", lambda m: subst.get(m.group(1), m.group(0)), expr)
        return re.sub(r"\$(\w+)", lambda m: subst.get(m.group(1), m.group(0)), expr)

    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", q.strip())
        ok = bool(m)
        if m:
            qok, res = prom.query(f"count by ({m.group(2)}) ({expand(m.group(1))})")
            ok = qok and bool(res)
        result(ok, f"variable {var['name']}: {q} returns values")

    targets = [(p["title"], t) for p in dash["panels"] for t in p.get("targets", [])]
    skipped = []
    for title, t in targets:
        expr = expand(t["expr"])
        parse_only = any(p.search(expr) for p in PARSE_ONLY)
        qok, res = prom.query(expr)
        if parse_only:
            result(qok, f"[{title}] parses (parse-only: needs dcgm-exporter or the cuda backend): {expr}")
            continue
        if no_planner and "graphpool_plan_" in expr:
            result(qok, f"[{title}] parses (parse-only: no planner in this build): {expr}")
            skipped.append(title)
            continue
        if not qok:
            result(False, f"[{title}] does not evaluate: {expr}: {res}")
            continue
        ok = bool(res)
        if ok and not t.get("instant"):
            rok, rres = prom.query_range(expr)
            ok = rok and bool(rres)
        result(ok, f"[{title}] returns {len(res)} series{'' if t.get('instant') else ' (instant and range)'}: {expr}")
        legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", "")))
        missing = sorted({name for s in res for name in legend if name not in s["metric"]})
        if legend and res:
            result(not missing, f"[{title}] legend {t['legendFormat']!r} names labels of its series"
                                f"{' (missing: ' + ', '.join(missing) + ')' if missing else ''}")

    # 4b. Rules.
    rules = yaml.safe_load(RULES.read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    for g in rules["groups"]:
        for rule in g["rules"]:
            expr = rule["expr"].strip()
            if "record" in rule:
                qok, res = prom.query(expr)
                result(qok and bool(res), f"recording rule {rule['record']} returns {len(res) if qok else res} series")
                continue
            name = rule["alert"]
            qok, res = prom.query(expr)
            if not result(qok, f"alert {name} parses and evaluates ({'condition true: ' + str(len(res)) + ' series' if qok and res else 'condition false now'})"):
                continue
            for sel in vector_selectors(expr):
                metric = sel.split("{")[0]
                timeout = 70 if metric in recorded else 5
                got = wait_for(lambda: (lambda r: r[0] and bool(r[1]))(prom.query(f"count({sel})")), timeout, 1)
                if got or "{" not in sel:
                    result(bool(got), f"alert {name}: its selector {sel} returns data")
                    continue
                # The matchers select events that have not happened (e.g. code="INTERNAL"):
                # then the metric must exist and carry every label the matchers name.
                labels = re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", sel[len(metric):])
                qok, res = prom.query(f"count by ({', '.join(labels)}) ({metric})")
                ok = qok and bool(res) and all(all(l in s["metric"] for l in labels) for s in res)
                result(ok, f"alert {name}: its selector {sel} is empty now (no such events), "
                           f"but {metric} exists with label(s) {', '.join(labels)}")
    code, body = prom.get("/api/v1/rules")
    groups = body.get("data", {}).get("groups", [])
    bad = [(r.get("name"), r.get("lastError")) for gr in groups for r in gr["rules"] if r.get("health") not in ("ok",)]
    result(code == 200 and len(groups) == len(rules["groups"]) and not bad,
           f"Prometheus loaded {len(groups)} rule groups, every rule healthy {bad or ''}")

    # 4c. Label names and values: every label a query groups, joins, matches or labels its
    # legend by, and every label an alert's annotations print, must be carried by the series it
    # selects (a misspelt label still returns data, only wrong or empty); enum values must be
    # values the daemon emits; and the promtool unit tests must feed series shaped like the
    # daemon's.
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        exported = exposition_labels(r.read().decode())
    literals = source_strings()
    metrics_rs = (ROOT / "src/metrics.rs").read_text()

    def labels_of(metric):
        if metric in exported:
            return exported[metric] | TARGET_LABELS
        if metric == "up":
            return set(TARGET_LABELS)
        if metric.startswith("DCGM_"):
            return DCGM_LABELS | TARGET_LABELS
        if metric in CUDA_ONLY and f'"{metric}"' in metrics_rs:
            return labels_of(CUDA_ONLY[metric])
        if metric in recorded:
            _, body = prom.get("/api/v1/series", **{"match[]": metric})
            return {k for s in body.get("data", []) for k in s if k != "__name__"} or None
        return None

    def check_expr(where, expr, extra=()):
        metrics = sorted({sel.split("{")[0] for sel in vector_selectors(expr)})
        known = {m: labels_of(m) for m in metrics}
        problems = [f"{m} is neither exported nor recorded" for m, l in known.items() if l is None]
        have = set().union(*(l for l in known.values() if l is not None))
        used = set(grouping_labels(expr)) | {n for n, _, _ in matchers(expr)} | set(extra)
        problems += [f"no series of it has label {n}" for n in sorted(used - have)]
        problems += [f"the daemon never emits {n}={v!r}" for n, op, value in matchers(expr)
                     if n in ENUM_LABELS for v in enum_values(op, value) if v not in literals]
        result(not problems, f"{where}: labels {sorted(used)} and matcher values exist on "
                             f"{', '.join(metrics)}{' (' + '; '.join(problems) + ')' if problems else ''}")
        return None if any(l is None for l in known.values()) else have

    for title, t in targets:
        legend = re.findall(r"\{\{\s*(\w+)\s*\}\}", t.get("legendFormat", ""))
        check_expr(f"[{title}] {t['refId']}", expand(t["expr"]), legend)
    for g in rules["groups"]:
        for rule in g["rules"]:
            expr = rule["expr"].strip()
            where = f"rule {rule.get('record') or rule.get('alert')}"
            have = check_expr(where, expr)
            if "alert" not in rule or have is None:
                continue
            m = _TOP_AGGREGATION.match(expr)
            if m:
                out = {n.strip() for n in m.group(1).split(",") if n.strip()}
            elif expr.startswith("absent("):
                out = {n for n, op, _ in matchers(expr) if op == "="}
            else:
                out = have
            printed = set(re.findall(r"\$labels\.(\w+)", json.dumps(rule.get("annotations", {}))))
            result(printed <= out, f"alert {rule['alert']}: its annotations print labels its result has"
                                   f"{' (not: ' + ', '.join(sorted(printed - out)) + ')' if not printed <= out else ''}")
    unit_tests = yaml.safe_load((ROOT / "tests/deploy/rules_test.yml").read_text())
    for case in unit_tests["tests"]:
        for series in case.get("input_series", []):
            m = re.fullmatch(r"([a-zA-Z_:][\w:]*)(?:\{(.*)\})?", series["series"].strip())
            name, lab = m.group(1), _MATCHER.findall(m.group(2) or "")
            have = labels_of(name)
            bad = [n for n, _, _ in lab if have is None or n not in have]
            bad += [f"{n}={v!r}" for n, _, v in lab if n in ENUM_LABELS and v not in literals]
            result(have is not None and not bad,
                   f"rules_test series {series['series']} is shaped like the daemon's {bad or ''}")
    tested = {t["alertname"] for case in unit_tests["tests"] for t in case.get("alert_rule_test", [])
              if t.get("exp_alerts")}
    for g in rules["groups"]:
        for rule in g["rules"]:
            if "alert" in rule:
                result(rule["alert"] in tested, f"alert {rule['alert']} has a unit test in which it fires")

    # 5. Graceful stop, and the Kubernetes configuration.
    for name, p in workers:
        if p.poll() is None and p.stdin:
            p.stdin.close()
    for name, p in workers:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pass
    daemon.send_signal(signal.SIGTERM)
    msgs = notify_messages(notify, 20)
    result("STOPPING=1" in msgs, "graphpoold sent STOPPING=1 on SIGTERM")
    try:
        rc = daemon.wait(timeout=30)
    except subprocess.TimeoutExpired:
        rc = None
    result(rc == 0, f"graphpoold exited cleanly on SIGTERM (exit status {rc})")

    k8s_daemon, k8s_sock, k8s_notify = start_daemon(procs, bin_dir, tmp, "graphpoold-k8s", K8S_CONFIG, free_port())
    msgs = notify_messages(k8s_notify, 30)
    ok = "READY=1" in msgs and wait_for(lambda: cli_ok(bin_dir, k8s_sock, "health")[0], 15)
    result(bool(ok), "graphpoold starts with deploy/k8s/core/graphpoold.toml and `graphpool health` succeeds")
    k8s_daemon.send_signal(signal.SIGTERM)
    try:
        rc = k8s_daemon.wait(timeout=30)
    except subprocess.TimeoutExpired:
        rc = None
    result(rc == 0, f"graphpoold (Kubernetes configuration) exited cleanly on SIGTERM (exit status {rc})")
    if skipped:
        print(f"note: {len(skipped)} plan queries were checked for parsing only (no planner in this build)")
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    code = main()
    sys.exit(1 if failed else code)
