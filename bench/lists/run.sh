#!/usr/bin/env bash
# Plans the buffer lists of bench/lists/lists.py (drawn outside the planner's own
# generators) with `graphpool plan --buffers` and prints footprint / lower bound and
# planning time per list, then the median, worst and count within a target per family.
#
#   bench/lists/run.sh [lists.py arguments, e.g. --sizes 10000 --seeds 1-10]
#
# Environment:
#   GRAPHPOOL_BIN  the CLI to run (default: target/release/graphpool; build it with
#                  `cargo build --release --bins`; nothing is built here)
#   BUDGET_MS      planning budget per list (default 1000)
set -euo pipefail
cd "$(dirname "$0")/../.."

BIN=${GRAPHPOOL_BIN:-target/release/graphpool}
BUDGET_MS=${BUDGET_MS:-1000}
if [ ! -x "$BIN" ]; then
  echo "no graphpool CLI at $BIN: run \`cargo build --release --bins\` or set GRAPHPOOL_BIN" >&2
  exit 2
fi
DIR=$(mktemp -d)
trap 'rm -rf "$DIR"' EXIT

python3 bench/lists/lists.py --out "$DIR" "$@" > "$DIR/lists.txt"
echo "graphpool plan --buffers FILE --time-budget-ms $BUDGET_MS, $(nproc) cores"
while read -r csv; do
  "$BIN" plan --buffers "$csv" --time-budget-ms "$BUDGET_MS" --json > "$DIR/plan.json"
  python3 - "$csv" "$DIR/plan.json" <<'PY'
import json, sys
from pathlib import Path
name = Path(sys.argv[1]).stem
plan = json.loads(Path(sys.argv[2]).read_text())
print(f"{name:32} {plan['ratio']:.4f} {1000 * plan['planning_seconds']:8.1f} ms")
PY
done < "$DIR/lists.txt" | tee "$DIR/results.txt"

python3 - "$DIR/results.txt" <<'PY'
import statistics, sys
from collections import defaultdict
from pathlib import Path
rows = defaultdict(list)
for line in Path(sys.argv[1]).read_text().splitlines():
    name, ratio = line.split()[:2]
    family, n, _seed = name.rsplit("-", 2)
    rows[(family, int(n))].append(float(ratio))
print()
print(f"{'family':20} {'buffers':>8} {'median':>7} {'worst':>7}  within (random 1.035, tilings 1.10)")
for (family, n), ratios in sorted(rows.items()):
    target = 1.10 if family.startswith("tiling") else 1.035
    within = sum(r <= target for r in ratios)
    print(f"{family:20} {n:8} {statistics.median(ratios):7.4f} {max(ratios):7.4f}  {within}/{len(ratios)}")
PY
