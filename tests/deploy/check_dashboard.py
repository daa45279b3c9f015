#!/usr/bin/env python3
"""Static checks of deploy/grafana/graphpool.json (the live evaluation of its queries is in
e2e_prometheus.py): structure Grafana needs to import it, the template variables, the data
source of every query, and the panels the dashboard promises."""
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
dash = json.loads((ROOT / "deploy/grafana/graphpool.json").read_text())
failures = []


def check(cond, msg):
    print(("ok   " if cond else "FAIL ") + msg)
    if not cond:
        failures.append(msg)


check(dash.get("uid") == "graphpool" and dash.get("title") == "graphpool", "uid and title")
check("__inputs" not in dash, "no __inputs (provisioning-friendly; the data source is a variable)")
variables = {v["name"]: v for v in dash["templating"]["list"]}
check(variables.get("datasource", {}).get("type") == "datasource"
      and variables["datasource"].get("query") == "prometheus", "variable datasource (Prometheus)")
check("Hostname" in json.dumps(variables.get("node", {}).get("query")), "variable node over the Hostname label")
check(", gpu)" in json.dumps(variables.get("gpu", {}).get("query")), "variable gpu over the gpu label")
panels = dash["panels"]
ids = [p["id"] for p in panels]
check(len(ids) == len(set(ids)), "panel ids are unique")
check(all(0 <= p["gridPos"]["x"] and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in panels), "panels fit the 24-column grid")
targets = [(p, t) for p in panels for t in p.get("targets", [])]
check(all(p.get("datasource", {}).get("uid") == "${datasource}" and t.get("datasource", {}).get("uid") == "${datasource}"
          for p, t in targets), "every panel and query uses ${datasource}")
check(all(t.get("refId") for _, t in targets) and all(
    len({t["refId"] for t in p.get("targets", [])}) == len(p.get("targets", [])) for p in panels), "refIds unique per panel")
for p in panels:
    if p["type"] != "table":
        continue
    # Grafana sorts by the column whose *display* name (after the organize transformation's
    # renames) equals sortBy's displayName; a name that was renamed or hidden sorts nothing.
    organize = next((t["options"] for t in p.get("transformations", []) if t["id"] == "organize"), {})
    renamed, hidden = organize.get("renameByName", {}), organize.get("excludeByName", {})
    for s in p.get("options", {}).get("sortBy", []):
        name = s.get("displayName")
        check(name not in renamed and not hidden.get(name),
              f"table {p['title']!r} sorts by {name!r}, a column it shows under that name")
exprs = " ".join(t["expr"] for _, t in targets)
for metric in ("graphpool_device_capacity_bytes", "graphpool_device_granted_bytes", "graphpool_device_free_bytes",
               "graphpool_rank_granted_bytes", "graphpool_job_granted_bytes", "graphpool_plan_saved_bytes",
               "graphpool_refusals_total", "graphpool_request_duration_seconds_bucket", "graphpool_sessions",
               "DCGM_FI_DEV_FB_USED", "graphpool_orphaned_grants", "graphpool_peers_refused_total",
               "graphpool_connections_refused_total", "graphpool_process_resident_memory_bytes",
               "graphpool_build_info"):
    check(metric in exprs, f"a panel shows {metric}")
check("histogram_quantile(" in exprs, "latency panel uses histogram_quantile")
check("on (UUID)" in exprs, "DCGM series are joined on UUID")
check(all('Hostname=~"$node"' in t["expr"] for _, t in targets if "graphpool_" in t["expr"]),
      "every graphpool query is filtered by $node")
print(f"dashboard: {len(panels)} panels, {len(targets)} queries")
sys.exit(1 if failures else 0)
