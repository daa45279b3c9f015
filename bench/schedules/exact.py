#!/usr/bin/env python3
"""An independent check of a plan: an exact solver on the same buffers.

Reads the JSON of `graphpool plan --json` (a schedule's plan or a buffer list's), builds the
placement problem again -- one offset per alias group, shared by its members, no two buffers
live at one step overlapping in bytes -- and asks CP-SAT (OR-tools) for the lowest footprint
within a time limit, starting from nothing the planner found. Prints the planner's footprint
over its lower bound, and CP-SAT's best placement and proved bound over the same lower bound:
a best below the planner's is a placement the planner missed; a proved bound above 1.0 shows
how far the lower bound is from the optimum.

    pip install ortools
    graphpool plan --schedule case.json --json > plan.json
    python3 bench/schedules/exact.py plan.json [SECONDS] [WORKERS]

CP-SAT proves optimality on small cases only (tens of alias groups at most, where offsets are
in bytes); on larger ones it is a second search, not a proof.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from ortools.sat.python import cp_model


def main() -> int:
    if len(sys.argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    plan: dict[str, Any] = json.loads(Path(sys.argv[1]).read_text())
    seconds = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
    workers = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    buffers = [b for b in plan["buffers"] if b["size_bytes"] > 0]
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for b in buffers:
        groups[b["alias_group"] or "#" + b["name"]].append(b)
    footprint: int = plan["footprint_bytes"]
    bound: int = plan["lower_bound_bytes"]

    model = cp_model.CpModel()
    height = model.new_int_var(0, footprint, "height")
    steps, bytes_ = [], []
    for name, members in groups.items():
        offset = model.new_int_var(0, footprint, name)
        for b in members:
            steps.append(model.new_fixed_size_interval_var(b["start"], b["end"] - b["start"], ""))
            bytes_.append(model.new_fixed_size_interval_var(offset, b["size_bytes"], ""))
            model.add(offset + b["size_bytes"] <= height)
    model.add_no_overlap_2d(steps, bytes_)
    model.minimize(height)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = workers
    status = solver.solve(model)
    found = solver.objective_value / bound if status in (cp_model.OPTIMAL, cp_model.FEASIBLE) else None
    print(
        f"{len(buffers)} buffers in {len(groups)} groups; planner {footprint / bound:.4f} of its bound; "
        f"CP-SAT {solver.status_name(status)} in {solver.wall_time:.1f} s: best "
        f"{'none' if found is None else f'{found:.4f}'}, proved {solver.best_objective_bound / bound:.4f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
