#!/usr/bin/env python3
"""Offline checks of deploy/k8s.

1. Builds deploy/k8s and deploy/k8s/core with kustomize (`kubectl kustomize`, offline).
2. Validates the built resources, every resource file and the examples against the
   Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields are errors) for
   the oldest and the newest Kubernetes versions given.
3. Validates the Prometheus Operator resources (ServiceMonitor, PrometheusRule) against
   schemas of the fields they may use, written here (the CRDs' schemas are not shipped).
4. Checks that every YAML file under deploy/k8s is a kustomization, is referenced by one, or
   is an example; and that the DaemonSet, Service and ServiceMonitor fit together (selectors,
   named port, hostPID, no GPU request, probes through the CLI, the socket hostPath, config).

Usage: validate_k8s.py --kubectl PATH [--k8s-versions 1.29,1.37]
Needs kubernetes-validate and PyYAML. Exits non-zero on the first class of failures.
"""
import argparse
import pathlib
import subprocess
import sys
import tomllib

import jsonschema
import kubernetes_validate
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy/k8s"

failures = []


def fail(msg):
    failures.append(msg)
    print("FAIL", msg)


def ok(msg):
    print("ok  ", msg)


# ---- schemas of the two Prometheus Operator kinds, for the fields graphpool uses ----------

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_META = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                   "namespace": {"type": "string"}, "labels": _LABELS, "annotations": _LABELS},
    "additionalProperties": False,
}
_SELECTOR = {"type": "object", "properties": {"matchLabels": _LABELS, "matchExpressions": {"type": "array"}},
             "additionalProperties": False}
_RELABEL = {
    "type": "object",
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "separator": {"type": "string"}, "targetLabel": {"type": "string"}, "regex": {"type": "string"},
        "modulus": {"type": "integer"}, "replacement": {"type": "string"},
        "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                            "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep"]},
    },
    "additionalProperties": False,
}
_DURATION = {"type": "string", "pattern": "^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
SERVICEMONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": _META,
        "spec": {
            "type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"}, "targetLabels": {"type": "array", "items": {"type": "string"}},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "selector": _SELECTOR,
                "namespaceSelector": {"type": "object", "properties": {
                    "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}},
                    "additionalProperties": False},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "targetPort": {}, "path": {"type": "string"},
                        "scheme": {"enum": ["http", "https"]}, "interval": _DURATION, "scrapeTimeout": _DURATION,
                        "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"},
                        "relabelings": {"type": "array", "items": _RELABEL},
                        "metricRelabelings": {"type": "array", "items": _RELABEL},
                    }}},
            },
        },
    },
    "additionalProperties": False,
}
_RULE = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "record": {"type": "string"}, "alert": {"type": "string"},
        "expr": {"type": ["string", "integer"]}, "for": _DURATION, "keep_firing_for": _DURATION,
        "labels": _LABELS, "annotations": _LABELS,
    },
    "required": ["expr"],
    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
}
PROMETHEUSRULE = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
        "metadata": _META,
        "spec": {"type": "object", "additionalProperties": False, "required": ["groups"], "properties": {
            "groups": {"type": "array", "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False,
                "properties": {"name": {"type": "string"}, "interval": _DURATION, "limit": {"type": "integer"},
                               "rules": {"type": "array", "items": _RULE}}}}}},
    },
    "additionalProperties": False,
}
CRD_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICEMONITOR,
               ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUSRULE}


def load_docs(text, where):
    docs = [d for d in yaml.safe_load_all(text) if d is not None]
    if not docs:
        fail(f"{where}: no YAML documents")
    return docs


def validate_docs(docs, where, versions):
    for doc in docs:
        kind, api = doc.get("kind"), doc.get("apiVersion")
        name = f"{where}: {kind}/{doc.get('metadata', {}).get('name')}"
        schema = CRD_SCHEMAS.get((api, kind))
        if schema is not None:
            try:
                jsonschema.validate(doc, schema)
                ok(f"{name} matches the {kind} schema")
            except jsonschema.ValidationError as e:
                fail(f"{name}: {e.message} at {'/'.join(map(str, e.absolute_path))}")
            continue
        for v in versions:
            try:
                kubernetes_validate.validate(doc, v, strict=True)
                ok(f"{name} is valid for Kubernetes {v} (strict)")
            except kubernetes_validate.ValidationError as e:
                fail(f"{name} is invalid for Kubernetes {v}: {e.message} at {'/'.join(map(str, e.path))}")
            except kubernetes_validate.utils.SchemaNotFoundError as e:
                fail(f"{name}: no schema for Kubernetes {v}: {e}")


def kustomize(kubectl, path):
    r = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        fail(f"kustomize build {path.relative_to(ROOT)}: {r.stderr.strip()}")
        return []
    ok(f"kustomize build {path.relative_to(ROOT)}")
    return load_docs(r.stdout, f"kustomize({path.relative_to(ROOT)})")


def check_references():
    """Every YAML file is a kustomization, listed by one, or an example."""
    listed = set()
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        for res in k.get("resources", []):
            p = (kfile.parent / res).resolve()
            if not p.exists():
                fail(f"{kfile.relative_to(ROOT)} lists {res}, which does not exist")
            listed.add(p)
        for gen in k.get("configMapGenerator", []):
            for f in gen.get("files", []):
                p = (kfile.parent / f.split("=")[-1]).resolve()
                if not p.exists():
                    fail(f"{kfile.relative_to(ROOT)} generates from {f}, which does not exist")
                listed.add(p)
    for f in sorted(K8S.rglob("*")):
        if f.is_dir() or f.name == "kustomization.yaml" or "examples" in f.relative_to(K8S).parts:
            continue
        if f.resolve() not in listed:
            fail(f"{f.relative_to(ROOT)} is not referenced by any kustomization.yaml")
    ok("every file under deploy/k8s is referenced by a kustomization or is an example")


def check_consistency(docs):
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    ds = by_kind["DaemonSet"][0]
    svc = by_kind["Service"][0]
    sm = by_kind["ServiceMonitor"][0]
    cm = by_kind["ConfigMap"][0]
    pod = ds["spec"]["template"]["spec"]
    labels = ds["spec"]["template"]["metadata"]["labels"]
    c = pod["containers"][0]

    def check(cond, msg):
        (ok if cond else fail)(msg)

    check(all(labels.get(k) == v for k, v in ds["spec"]["selector"]["matchLabels"].items()),
          "DaemonSet selector matches its pod labels")
    check(all(labels.get(k) == v for k, v in svc["spec"]["selector"].items()),
          "Service selector matches the DaemonSet's pods")
    check(all(svc["metadata"]["labels"].get(k) == v for k, v in sm["spec"]["selector"]["matchLabels"].items()),
          "ServiceMonitor selector matches the Service")
    port_names = {p["name"] for p in c.get("ports", [])}
    check(all(p["targetPort"] in port_names for p in svc["spec"]["ports"]), "Service targets the container's named port")
    check(all(e["port"] in {p["name"] for p in svc["spec"]["ports"]} for e in sm["spec"]["endpoints"]),
          "ServiceMonitor scrapes a named port of the Service")
    check(all(not e.get("honorLabels") for e in sm["spec"]["endpoints"]),
          "ServiceMonitor keeps Prometheus's own labels (the training job is `job_id`)")
    check(svc["metadata"]["name"] == "graphpoold", "Service is named graphpoold (job=\"graphpoold\" in the rules)")
    check(pod.get("hostPID") is True, "DaemonSet uses hostPID")
    check(pod.get("priorityClassName") == "system-node-critical", "DaemonSet is system-node-critical")
    check(any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", [])), "DaemonSet tolerates the nvidia.com/gpu taint")
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    check(len(terms) > 0, "DaemonSet has node affinity for GPU nodes")
    res = c.get("resources", {})
    check(not any("nvidia.com" in k for part in ("requests", "limits") for k in res.get(part, {})),
          "DaemonSet requests no GPU from the device plugin")
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    check(env.get("NVIDIA_VISIBLE_DEVICES") == "all", "NVIDIA_VISIBLE_DEVICES=all")
    check(env.get("NVIDIA_DRIVER_CAPABILITIES") == "compute,utility", "NVIDIA_DRIVER_CAPABILITIES=compute,utility")
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        cmd = c.get(probe, {}).get("exec", {}).get("command", [])
        check(cmd[:1] == ["graphpool"] and cmd[-1:] == ["health"], f"{probe} runs `graphpool ... health`")
    vols = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    sockvol = vols.get(mounts.get("/run/graphpool"), {})
    check(sockvol.get("hostPath", {}).get("path") == "/run/graphpool", "socket directory is the hostPath /run/graphpool")
    confvol = vols.get(mounts.get("/etc/graphpool"), {})
    check(confvol.get("configMap", {}).get("name") == cm["metadata"]["name"], "config is mounted from the generated ConfigMap")
    conf = tomllib.loads(cm["data"]["graphpoold.toml"])
    check(conf.get("socket") == "/run/graphpool/graphpool.sock", "config: socket in the hostPath directory")
    port = int(conf.get("metrics_listen", "127.0.0.1:9478").rsplit(":", 1)[1])
    check(conf.get("metrics_listen", "").startswith("0.0.0.0:") and any(p["containerPort"] == port for p in c["ports"]),
          "config: metrics listen on the pod network at the container port")
    gid = c.get("securityContext", {}).get("runAsGroup")
    check(str(gid) == str(conf.get("socket_group")), "config: socket_group is the daemon's own gid (no CAP_CHOWN needed)")
    example = load_docs((K8S / "examples/training-job.yaml").read_text(), "example")[0]
    epod = example["spec"]["template"]["spec"]
    check(str(conf.get("socket_group")) in map(str, epod.get("securityContext", {}).get("supplementalGroups", [])),
          "example job joins the sockets' group")
    evol = [v for v in epod["volumes"] if v.get("hostPath", {}).get("path") == "/run/graphpool"]
    check(len(evol) == 1, "example job mounts the socket hostPath")
    eenv = {e["name"]: e.get("value") for e in epod["containers"][0].get("env", [])}
    check(eenv.get("GRAPHPOOL_SOCKET") == conf.get("socket"), "example job sets GRAPHPOOL_SOCKET to the daemon's socket")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kubectl", required=True)
    ap.add_argument("--k8s-versions", default="1.29,1.37")
    args = ap.parse_args()
    versions = [v.strip() for v in args.k8s_versions.split(",") if v.strip()]

    full = kustomize(args.kubectl, K8S)
    core = kustomize(args.kubectl, K8S / "core")
    validate_docs(full, "kustomize(deploy/k8s)", versions)
    kinds_full = sorted(d["kind"] for d in full)
    kinds_core = sorted(d["kind"] for d in core)
    expected = ["ConfigMap", "DaemonSet", "Namespace", "PrometheusRule", "Service", "ServiceAccount", "ServiceMonitor"]
    (ok if kinds_full == expected else fail)(f"deploy/k8s builds {kinds_full}")
    (ok if kinds_core == [k for k in expected if k not in ("PrometheusRule", "ServiceMonitor")] else fail)(
        f"deploy/k8s/core builds {kinds_core}")
    ns = {d["metadata"].get("namespace") for d in full if d["kind"] != "Namespace"}
    (ok if ns == {"graphpool-system"} else fail)(f"every namespaced resource is in graphpool-system ({ns})")

    for f in sorted(K8S.rglob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        validate_docs(load_docs(f.read_text(), str(f.relative_to(ROOT))), str(f.relative_to(ROOT)), versions)
    check_references()
    if full:
        check_consistency(full)

    if failures:
        print(f"{len(failures)} check(s) failed")
        return 1
    print("deploy/k8s: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
