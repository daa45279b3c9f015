#!/usr/bin/env python3
"""Wrap deploy/prometheus/rules.yml into a Prometheus Operator PrometheusRule.

Usage: to-prometheusrule.py [--check]
Writes deploy/k8s/prometheusrule.yaml; with --check, exits 1 when that file is out of date.
Needs PyYAML.
"""
import pathlib
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
SRC = ROOT / "deploy/prometheus/rules.yml"
DST = ROOT / "deploy/k8s/prometheusrule.yaml"

HEADER = """\
# GENERATED from deploy/prometheus/rules.yml by deploy/prometheus/to-prometheusrule.py;
# edit the rules there and run the script again (CI checks that this file is up to date).
# kube-prometheus-stack selects PrometheusRules by the label `release: <helm release>` by
# default: add it here or set prometheus.prometheusSpec.ruleSelectorNilUsesHelmValues=false.
"""


class _Literal(str):
    pass


def _literal(dumper, data):
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")


def _str(dumper, data):
    style = "|" if "\n" in data else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


def render() -> str:
    rules = yaml.safe_load(SRC.read_text())
    doc = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {
            "name": "graphpool",
            "labels": {
                "app.kubernetes.io/name": "graphpool",
                "app.kubernetes.io/component": "daemon",
            },
        },
        "spec": {"groups": rules["groups"]},
    }
    dumper = yaml.SafeDumper
    dumper.add_representer(str, _str)
    return HEADER + yaml.dump(doc, Dumper=dumper, sort_keys=False, width=100)


def main() -> int:
    text = render()
    if "--check" in sys.argv[1:]:
        if not DST.exists() or DST.read_text() != text:
            print(f"{DST.relative_to(ROOT)} is out of date: run {pathlib.Path(__file__).relative_to(ROOT)}")
            return 1
        print(f"{DST.relative_to(ROOT)} is up to date")
        return 0
    DST.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
