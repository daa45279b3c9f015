#!/usr/bin/env python3
"""Generates deploy/grafana/graphpool.json, the graphpool Grafana dashboard.

Usage: gen_dashboard.py [--check]
The JSON is committed; edit this file and run it again. With --check, exits 1 when the
committed JSON differs from what this script produces (CI runs that). Standard library only.

Conventions of the queries:
- Template variables: $datasource (Prometheus), $node (the `Hostname` label graphpoold and
  dcgm-exporter both put on their series) and $gpu (the `gpu` label, the device index).
- Series without a Hostname label (requests, latency, sessions ended) are tied to a node through
  the scrape target: `... and on (instance) graphpool_sessions{Hostname=~"$node"}`.
- The training job is the `job_id` label of graphpool's series (the scrape job keeps Prometheus's
  own `job` label, so no `honor_labels` is needed).
- dcgm-exporter series are joined on `UUID` (unique per GPU), filtered by graphpool's own
  Hostname and gpu labels.
"""
import json
import pathlib
import sys

OUT = pathlib.Path(__file__).resolve().parent / "graphpool.json"

DS = {"type": "prometheus", "uid": "${datasource}"}
NODE = 'Hostname=~"$node"'
NODE_GPU = 'Hostname=~"$node", gpu=~"$gpu"'
ON_NODE = f"and on (instance) graphpool_sessions{{{NODE}}}"

_next_id = [0]


def pid():
    _next_id[0] += 1
    return _next_id[0]


def target(expr, legend="", ref="A", instant=False, fmt="time_series"):
    t = {"datasource": DS, "expr": expr, "refId": ref, "legendFormat": legend or "__auto"}
    if instant:
        t.update({"instant": True, "range": False, "format": fmt})
    else:
        t.update({"range": True, "instant": False, "format": fmt})
    return t


def refs(targets):
    for i, t in enumerate(targets):
        t["refId"] = chr(ord("A") + i)
    return targets


def row(title, y):
    return {"type": "row", "title": title, "id": pid(), "collapsed": False,
            "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []}


def stat(title, expr, unit, x, y, w=4, h=4, desc="", thresholds=None):
    steps = thresholds or [{"color": "green", "value": None}]
    return {
        "type": "stat", "title": title, "id": pid(), "description": desc, "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": y},
        "targets": [target(expr, instant=True)],
        "fieldConfig": {"defaults": {"unit": unit, "thresholds": {"mode": "absolute", "steps": steps},
                                      "color": {"mode": "thresholds"}}, "overrides": []},
        "options": {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                    "colorMode": "value", "graphMode": "area", "textMode": "auto",
                    "justifyMode": "auto", "orientation": "auto"},
    }


def timeseries(title, targets, unit, x, y, w=12, h=8, desc="", stack=False, overrides=None):
    custom = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10, "showPoints": "never",
              "spanNulls": False, "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
    return {
        "type": "timeseries", "title": title, "id": pid(), "description": desc, "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": y},
        "targets": refs(targets),
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom, "color": {"mode": "palette-classic"}},
                        "overrides": overrides or []},
        "options": {"legend": {"displayMode": "table", "placement": "bottom", "showLegend": True,
                               "calcs": ["lastNotNull", "max"]},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
    }


def table(title, targets, x, y, w=12, h=8, desc="", units=None, renames=None, hide=()):
    sort_field = list((units or {"Value": None}).keys())[0]
    overrides = [{"matcher": {"id": "byName", "options": name},
                  "properties": [{"id": "unit", "value": unit}]} for name, unit in (units or {}).items()]
    return {
        "type": "table", "title": title, "id": pid(), "description": desc, "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": y},
        "targets": refs(targets),
        "fieldConfig": {"defaults": {}, "overrides": overrides},
        # Grafana matches sortBy against the column's display name, which is the renamed one.
        "options": {"showHeader": True, "cellHeight": "sm",
                    "sortBy": [{"displayName": (renames or {}).get(sort_field, sort_field), "desc": True}]},
        "transformations": [
            {"id": "merge", "options": {}},
            {"id": "organize", "options": {
                "excludeByName": {name: True for name in ("Time", "__name__", "instance", *hide)},
                "renameByName": renames or {}}},
        ],
    }


def bargauge(title, expr, legend, x, y, w=12, h=8, desc=""):
    return {
        "type": "bargauge", "title": title, "id": pid(), "description": desc, "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": y},
        "targets": [target(expr, legend, instant=True)],
        "fieldConfig": {"defaults": {"unit": "percentunit", "min": 0, "max": 1,
                                      "thresholds": {"mode": "absolute", "steps": [
                                          {"color": "green", "value": None},
                                          {"color": "orange", "value": 0.8},
                                          {"color": "red", "value": 0.95}]},
                                      "color": {"mode": "thresholds"}}, "overrides": []},
        "options": {"orientation": "horizontal", "displayMode": "gradient", "showUnfilled": True,
                    "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}},
    }


def build():
    panels = []
    y = 0
    panels.append(row("Overview", y)); y += 1
    panels += [
        stat("Daemons", f"count(graphpool_sessions{{{NODE}}})", "none", 0, y,
             desc="graphpoold instances reporting for the selected nodes."),
        stat("Sessions", f"sum(graphpool_sessions{{{NODE}}})", "none", 4, y,
             desc="Training processes attached to graphpoold."),
        stat("Grants held", f"sum(graphpool_grants{{{NODE_GPU}}})", "none", 8, y,
             desc="Segments of capture memory handed out."),
        stat("Granted", f"sum(graphpool_device_granted_bytes{{{NODE_GPU}}})", "bytes", 12, y,
             desc="Device memory granted for CUDA graph capture."),
        stat("Saved by aliasing", f"sum(graphpool_plan_saved_bytes{{{NODE_GPU}}})", "bytes", 16, y,
             desc="Bytes the latest plans of live sessions saved by placing static buffers with disjoint lifetimes at the same address."),
        stat("Orphaned grants", f"sum(graphpool_orphaned_grants{{{NODE}}})", "none", 20, y,
             desc="Grants of sessions whose process is gone. Anything but 0 is a leak.",
             thresholds=[{"color": "green", "value": None}, {"color": "red", "value": 1}]),
    ]
    y += 4

    panels.append(row("Capacity per GPU", y)); y += 1
    cap_targets = [
        target(f"graphpool_device_capacity_bytes{{{NODE_GPU}}}", "{{Hostname}} gpu {{gpu}} capacity"),
        target(f"graphpool_device_budget_bytes{{{NODE_GPU}}}", "{{Hostname}} gpu {{gpu}} budget"),
        target(f"graphpool_device_granted_bytes{{{NODE_GPU}}}", "{{Hostname}} gpu {{gpu}} granted"),
        target(f"graphpool_device_planned_bytes{{{NODE_GPU}}}", "{{Hostname}} gpu {{gpu}} reserved by plans"),
        target(f"graphpool_device_free_bytes{{{NODE_GPU}}}", "{{Hostname}} gpu {{gpu}} free"),
    ]
    panels.append(timeseries(
        "Capacity vs granted vs free", cap_targets, "bytes", 0, y, w=16, h=9,
        desc="Per GPU: what graphpool may grant (capacity, and the budget set by limits), what it has granted, what plans reserve, and what is free."))
    panels.append(bargauge(
        "Budget used", f"1 - graphpool_device_free_bytes{{{NODE_GPU}}} / (graphpool_device_budget_bytes{{{NODE_GPU}}} > 0)",
        "{{Hostname}} gpu {{gpu}}", 16, y, w=8, h=9,
        desc="Share of each GPU's graph-memory budget that is granted or reserved by plans."))
    y += 9
    panels.append(timeseries(
        "Grants held", [target(f"graphpool_grants{{{NODE_GPU}}}", "{{Hostname}} gpu {{gpu}}")],
        "none", 0, y, w=12, h=7, desc="Number of segments held per GPU."))
    panels.append(timeseries(
        "Device memory in use (NVML)",
        [target(f"graphpool_device_driver_used_bytes{{{NODE_GPU}}}", "{{Hostname}} gpu {{gpu}} used (all processes)"),
         target(f"graphpool_device_granted_bytes{{{NODE_GPU}}}", "{{Hostname}} gpu {{gpu}} granted by graphpool")],
        "bytes", 12, y, w=12, h=7,
        desc="Memory the driver reports in use on the GPU by every process, next to graphpool's grants. The NVML figure exists with the cuda backend only."))
    y += 7

    panels.append(row("Holders", y)); y += 1
    panels.append(timeseries(
        "Granted by job", [target(f"sum by (job_id) (graphpool_job_granted_bytes{{{NODE}}})", "{{job_id}}")],
        "bytes", 0, y, w=12, h=8, stack=True, desc="Capture memory held by each training job on the selected nodes."))
    panels.append(table(
        "Holders by job and rank",
        [target(f"sum by (job_id, rank, Hostname, gpu) (graphpool_rank_granted_bytes{{{NODE_GPU}}})", instant=True, fmt="table")],
        12, y, w=12, h=8, units={"Value": "bytes"},
        renames={"Value": "granted", "job_id": "job", "rank": "rank", "Hostname": "node", "gpu": "gpu"},
        desc="Who holds capture memory, largest first."))
    y += 8

    panels.append(row("Plans and aliasing", y)); y += 1
    panels.append(timeseries(
        "Plan footprint and bytes saved by aliasing",
        [target(f"sum by (job_id) (graphpool_plan_bytes{{{NODE_GPU}}})", "{{job_id}} footprint"),
         target(f"sum by (job_id) (graphpool_plan_saved_bytes{{{NODE_GPU}}})", "{{job_id}} saved by aliasing")],
        "bytes", 0, y, w=12, h=8,
        desc="Latest plan of each live session: arena footprint, and the bytes saved by sharing memory between static buffers whose lifetimes do not overlap."))
    panels.append(table(
        "Plans by rank",
        [target(f"sum by (job_id, rank, Hostname, gpu) (graphpool_plan_bytes{{{NODE_GPU}}})", instant=True, fmt="table"),
         target(f"sum by (job_id, rank, Hostname, gpu) (graphpool_plan_saved_bytes{{{NODE_GPU}}})", instant=True, fmt="table"),
         target(f"sum by (job_id, rank, Hostname, gpu) (graphpool_plan_saved_bytes{{{NODE_GPU}}})"
                f" / (sum by (job_id, rank, Hostname, gpu) (graphpool_plan_bytes{{{NODE_GPU}}})"
                f" + sum by (job_id, rank, Hostname, gpu) (graphpool_plan_saved_bytes{{{NODE_GPU}}}))",
                instant=True, fmt="table")],
        12, y, w=12, h=8, units={"Value #A": "bytes", "Value #B": "bytes", "Value #C": "percentunit"},
        renames={"Value #A": "footprint", "Value #B": "saved", "Value #C": "saved share", "Hostname": "node"},
        desc="Footprint of each rank's latest plan, bytes saved by aliasing, and the share of the unaliased total that was saved."))
    y += 8

    panels.append(row("Refusals and requests", y)); y += 1
    panels.append(timeseries(
        "Refusals by reason",
        [target(f"sum by (reason) (rate(graphpool_refusals_total{{{NODE_GPU}}}[$__rate_interval]))", "{{reason}}")],
        "reqps", 0, y, w=12, h=8, stack=True,
        desc="Requests refused before capture because they would not fit: device-budget, job-quota, rank-quota, session-budget, session-grants (too many segments in one session), device-memory (the GPU has no physical memory left)."))
    panels.append(timeseries(
        "Requests by method and code",
        [target(f"sum by (method, code) (rate(graphpool_requests_total[$__rate_interval]) {ON_NODE})", "{{method}} {{code}}")],
        "reqps", 12, y, w=12, h=8, desc="gRPC requests per second, by method and status code."))
    y += 8
    lat = f"sum by (method, le) (rate(graphpool_request_duration_seconds_bucket[$__rate_interval]) {ON_NODE})"
    panels.append(timeseries(
        "Request latency",
        [target(f"histogram_quantile(0.99, {lat})", "p99 {{method}}"),
         target(f"histogram_quantile(0.5, {lat})", "p50 {{method}}"),
         target(f"sum by (method) (rate(graphpool_request_duration_seconds_sum[$__rate_interval]) {ON_NODE})"
                f" / sum by (method) (rate(graphpool_request_duration_seconds_count[$__rate_interval]) {ON_NODE})",
                "mean {{method}}")],
        "s", 0, y, w=12, h=8, desc="Latency of graphpoold's gRPC methods (histogram quantiles over the rate interval)."))
    panels.append(timeseries(
        "Sessions",
        [target(f"graphpool_sessions{{{NODE}}}", "{{Hostname}} attached"),
         target(f"sum by (reason) (rate(graphpool_sessions_ended_total[$__rate_interval]) {ON_NODE})", "ended: {{reason}}")],
        "none", 12, y, w=12, h=8,
        desc="Attached sessions per node, and sessions ending per second by reason (detach, stream-closed, process-exit, shutdown).",
        overrides=[{"matcher": {"id": "byFrameRefID", "options": "B"},
                    "properties": [{"id": "unit", "value": "ops"}, {"id": "custom.axisPlacement", "value": "right"}]}]))
    y += 8
    panels.append(timeseries(
        "Connections closed at accept",
        [target(f"sum by (transport) (rate(graphpool_peers_refused_total[$__rate_interval]) {ON_NODE})",
                "off the allow-list: {{transport}}"),
         target(f"sum by (transport) (rate(graphpool_connections_refused_total[$__rate_interval]) {ON_NODE})",
                "past a uid's cap: {{transport}}")],
        "ops", 0, y, w=24, h=6,
        desc="Connections the daemon closed before reading anything, per socket: from a uid that [access] does not admit, and past a uid's cap of 4 x [guards] max_sessions_per_uid connections. Those processes see the daemon as unreachable; its log names the uid."))
    y += 6

    panels.append(row("graphpoold itself", y)); y += 1
    # Series without a Hostname label get the node's from graphpool_sessions (value 1 per daemon).
    node_of = f"* on (instance) group_left (Hostname) group by (instance, Hostname) (graphpool_sessions{{{NODE}}})"
    panels.append(timeseries(
        "Daemon memory and open files",
        [target(f"graphpool_process_resident_memory_bytes {node_of}", "{{Hostname}} resident"),
         target(f"graphpool_process_open_fds {node_of}", "{{Hostname}} open fds"),
         target(f"graphpool_process_max_fds {node_of}", "{{Hostname}} open-file limit")],
        "bytes", 0, y, w=12, h=8,
        desc="graphpoold's own resident memory (left), and its open file descriptors against its open-file limit (right: the sockets of its sessions and the fds of the segments it has granted).",
        overrides=[{"matcher": {"id": "byFrameRefID", "options": ref},
                    "properties": [{"id": "unit", "value": "none"}, {"id": "custom.axisPlacement", "value": "right"}]}
                   for ref in ("B", "C")]))
    panels.append(table(
        "Daemon versions",
        [target(f"graphpool_build_info {node_of}", instant=True, fmt="table")],
        12, y, w=12, h=8, units={"version": "string"}, renames={"Hostname": "node"}, hide=("Value", "job"),
        desc="Version and backend (cuda or host) of the graphpoold on each node: during a rollout, which nodes run which."))
    y += 8

    panels.append(row("GPU memory with dcgm-exporter", y)); y += 1
    dcgm_used = "DCGM_FI_DEV_FB_USED * 1048576"
    panels.append(timeseries(
        "Framebuffer used (DCGM) vs graphpool grants",
        [target(f"{dcgm_used} and on (UUID) graphpool_device_capacity_bytes{{{NODE_GPU}}}",
                "{{Hostname}} gpu {{gpu}} used (DCGM)"),
         target(f"graphpool_device_granted_bytes{{{NODE_GPU}}}", "{{Hostname}} gpu {{gpu}} granted by graphpool")],
        "bytes", 0, y, w=12, h=8,
        desc="dcgm-exporter's DCGM_FI_DEV_FB_USED (MiB, shown in bytes) for the GPUs graphpool serves, joined on UUID, next to graphpool's grants. Needs dcgm-exporter scraped by the same Prometheus."))
    panels.append(timeseries(
        "Share of used GPU memory held for graph capture",
        [target(f"sum by (Hostname, gpu, UUID) (graphpool_device_granted_bytes{{{NODE_GPU}}})"
                f" / on (UUID) group_left () (max by (UUID) ({dcgm_used}) > 0)",
                "{{Hostname}} gpu {{gpu}}")],
        "percentunit", 12, y, w=12, h=8,
        desc="graphpool's grants over the framebuffer in use reported by dcgm-exporter, per GPU (joined on UUID)."))
    y += 8

    return {
        "title": "graphpool",
        "uid": "graphpool",
        "description": "GPU memory for CUDA graph capture owned by graphpoold: capacity, holders, aliasing, refusals, latency.",
        "tags": ["graphpool", "gpu", "cuda"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "fiscalYearStartMonth": 0,
        "liveNow": False,
        "links": [],
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
            "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
            "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [],
             "refresh": 1, "regex": "", "skipUrlSync": False},
            {"name": "node", "label": "Node", "type": "query", "datasource": DS,
             "definition": "label_values(graphpool_sessions, Hostname)",
             "query": {"query": "label_values(graphpool_sessions, Hostname)", "refId": "node"},
             "current": {}, "hide": 0, "includeAll": True, "multi": True, "options": [],
             "refresh": 2, "regex": "", "sort": 1, "skipUrlSync": False},
            {"name": "gpu", "label": "GPU", "type": "query", "datasource": DS,
             "definition": 'label_values(graphpool_device_capacity_bytes{Hostname=~"$node"}, gpu)',
             "query": {"query": 'label_values(graphpool_device_capacity_bytes{Hostname=~"$node"}, gpu)', "refId": "gpu"},
             "current": {}, "hide": 0, "includeAll": True, "multi": True, "options": [],
             "refresh": 2, "regex": "", "sort": 3, "skipUrlSync": False},
        ]},
        "panels": panels,
    }


def render():
    return json.dumps(build(), indent=2, sort_keys=False) + "\n"


def main():
    text = render()
    if "--check" in sys.argv[1:]:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT.name} is out of date: run deploy/grafana/gen_dashboard.py")
            return 1
        print(f"{OUT.name} is up to date")
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
