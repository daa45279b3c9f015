#!/usr/bin/env bash
# Compares two builds of the planner on the same lists, each list planned by one build and
# then the other (so that both meet the same machine state), and prints each list's two
# ratios (footprint / lower bound), then per family the medians, the means, how many lists B
# planned lower and higher, and the counts within the target.
#
#   bench/lists/ab.sh lists   A B [lists.py arguments, e.g. --sizes 100000 --seeds 1-10]
#   bench/lists/ab.sh figures A B ROW [SEEDS]
#
# `lists`: A and B are `graphpool` CLIs (`cargo build --release --bins`, one per build);
# the lists come from bench/lists/lists.py and are planned with `graphpool plan --buffers`.
# `figures`: A and B are builds of the planner's `figures` example (`cargo build --release
# -p graphpool-planner --example figures`); ROW selects its rows as the example's filter
# does (e.g. "packed n=100000 "), SEEDS is FROM-TO (default 1-10), one seed per run.
# Nothing is built here.
#
# Environment: BUDGET_MS, the planning budget per list (lists: default 1000; figures: each
# row's own unless given); OUT, a directory to keep the lists and per-list results in
# (default: a temporary one, removed).
set -euo pipefail

usage() {
  sed -n '7,8p' "$0" | sed 's/^# *//' >&2
  exit 2
}
[ $# -ge 3 ] || usage
MODE=$1 A=$2 B=$3
shift 3
for bin in "$A" "$B"; do
  [ -x "$bin" ] || { echo "ab.sh: $bin is not an executable; build it first (nothing is built here)" >&2; exit 2; }
done
# Paths as given, from where the script was called (it runs from the repository's root).
A=$(readlink -f "$A") B=$(readlink -f "$B")
[ -n "${OUT:-}" ] && OUT=$(readlink -m "$OUT")
cd "$(dirname "$0")/../.."
BUDGET_GIVEN=${BUDGET_MS:-}
BUDGET_MS=${BUDGET_MS:-1000}
if [ -n "${OUT:-}" ]; then
  DIR=$OUT
  mkdir -p "$DIR"
else
  DIR=$(mktemp -d)
  trap 'rm -rf "$DIR"' EXIT
fi
: > "$DIR/ab.txt"

case $MODE in
lists)
  python3 bench/lists/lists.py --out "$DIR" "$@" > "$DIR/lists.txt"
  echo "graphpool plan --buffers FILE --time-budget-ms $BUDGET_MS, $(nproc) cores; A=$A B=$B"
  while read -r csv; do
    name=$(basename "$csv" .csv)
    line="$name"
    for bin in "$A" "$B"; do
      ratio=$("$bin" plan --buffers "$csv" --time-budget-ms "$BUDGET_MS" --json |
        python3 -c 'import json, sys; print("%.4f" % json.load(sys.stdin)["ratio"])')
      line="$line $ratio"
    done
    echo "$line" | tee -a "$DIR/ab.txt"
  done < "$DIR/lists.txt"
  ;;
figures)
  [ $# -ge 1 ] || usage
  ROW=$1
  SEEDS=${2:-1-10}
  # Rows keep their own budgets unless BUDGET_MS is given.
  [ -n "${BUDGET_GIVEN:-}" ] && export FIGURES_BUDGET_MS=$BUDGET_MS
  echo "figures \"$ROW\", seeds $SEEDS, budget ${FIGURES_BUDGET_MS:-as each row says}${FIGURES_BUDGET_MS:+ ms}, $(nproc) cores; A=$A B=$B"
  for seed in $(seq "${SEEDS%-*}" "${SEEDS#*-}"); do
    # Each build prints a row per list the filter selects: its name (with spaces), then the
    # buffers' count, floor, greedy and ratio. One build after the other, never side by side.
    for side in A B; do
      bin=$A
      [ "$side" = B ] && bin=$B
      FIGURES_SEEDS=$seed-$seed "$bin" "$ROW" 2>/dev/null |
        awk 'NR > 1 { for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]+$/) break;
                     name = $1; for (j = 2; j < i; j++) name = name "_" $j; print name, $(i + 3) }' \
          > "$DIR/$side.txt"
    done
    paste -d' ' "$DIR/A.txt" <(cut -d' ' -f2 "$DIR/B.txt") | tee -a "$DIR/ab.txt"
  done
  ;;
*) usage ;;
esac

python3 - "$DIR/ab.txt" <<'PY'
import re, statistics, sys
from collections import defaultdict
from pathlib import Path

rows = defaultdict(list)
for line in Path(sys.argv[1]).read_text().splitlines():
    fields = line.split()
    if len(fields) != 3:
        continue
    name, a, b = fields[0], float(fields[1]), float(fields[2])
    # lists.py names end in -N-SEED; figures rows carry _seed=S.
    family = re.sub(r"_seed=\d+", "", name) if "_seed=" in name else name.rsplit("-", 1)[0]
    rows[family].append((a, b))
if not rows:
    sys.exit("ab.sh: no list was planned; check the arguments")
print()
print(f"{'family':32} {'lists':>5}  {'median A':>8} {'median B':>8}  {'mean A':>7} {'mean B':>7}"
      f"  {'B lower':>7} {'B higher':>8}  within A / B")
for family, pairs in sorted(rows.items()):
    a = [p[0] for p in pairs]
    b = [p[1] for p in pairs]
    # The issue's targets: tightly packed lists (tilings, arenas) 1.10, random lists 1.035.
    packed = family.startswith(("packed", "tiling", "skyline", "recut", "arena"))
    target = 1.10 if packed else 1.035
    lower = sum(y < x - 5e-5 for x, y in pairs)
    higher = sum(y > x + 5e-5 for x, y in pairs)
    print(f"{family:32} {len(pairs):5}  {statistics.median(a):8.4f} {statistics.median(b):8.4f}"
          f"  {statistics.mean(a):7.4f} {statistics.mean(b):7.4f}  {lower:7} {higher:8}"
          f"  {sum(x <= target for x in a)} / {sum(y <= target for y in b)} (≤ {target})")
PY
