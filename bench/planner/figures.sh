#!/usr/bin/env bash
# Measures every row of README's "Planner figures" on this machine, one run after the other
# (never side by side: plans use every core), and writes each part's output to a directory:
#
#   figures.txt    the planner's generated lists and tilings, seeds $SEEDS, with a summary per
#                  workload (median [min-max], count within the target, slowest plan)
#   schedules.txt  random pipeline schedules planned as PlanCapture plans them (200 ms): the
#                  sweeps of varied, measured-looking and long pipelines, explicit step
#                  orders, 1F1B with workspaces and layers of several inputs and outputs,
#                  each ending with its count above 1.001
#   lists.txt      bench/lists/lists.py's families (drawn outside the planner) at 10k and 100k,
#                  planned by `graphpool plan --buffers` in 1 s
#   recorded.txt   bench/lists/recorded/'s eager training steps (recorded from PyTorch), at the
#                  CLI's default budget and with 1 s
#   together.txt   (only when PARTS names it) ranks planning at once: $TOGETHER sweeps of
#                  `uneven 1-3000 200`, a slice each, side by side, first with a thread per core
#                  in every plan, then with each plan on its share of the cores (what graphpoold
#                  gives each PlanCapture while that many run), then with the shares of plans
#                  that started together (16, 8, 5, ... on 16 cores)
#   env.txt        date, commit, CPU and core count
#
#   bench/planner/figures.sh [OUT_DIR]          (default: bench-out/planner-figures)
#
# Environment: SEEDS (default 1-20) for the generated lists, FILTER (default: every row) to
# keep the rows whose name contains it (e.g. "n=100000"), LIST_SEEDS (default 1-10) for
# bench/lists, PARTS (default "figures schedules lists"; add "together" for together.txt) to
# run some parts only, TOGETHER (default 8) and TOGETHER_CASES (default 3000) for the plans
# at once, SCHEDULES to run some of the schedule sweeps only (their arguments, separated by
# commas), BIN_DIR (default target/release) holding the `graphpool` CLI and the planner's
# `figures` and `schedules` examples, built first with
#   cargo build --release --locked -p graphpool --bins -p graphpool-planner --example figures --example schedules
# Nothing is built here. About 20 minutes on two cores with every part (17-20 measured).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=$(readlink -m "${1:-bench-out/planner-figures}")
BIN_DIR=$(readlink -m "${BIN_DIR:-target/release}")
SEEDS=${SEEDS:-1-20}
LIST_SEEDS=${LIST_SEEDS:-1-10}
PARTS=${PARTS:-figures schedules lists}
has() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }

FIGURES_BIN=$BIN_DIR/examples/figures
SCHEDULES_BIN=$BIN_DIR/examples/schedules
CLI=$BIN_DIR/graphpool
for bin in "$FIGURES_BIN" "$SCHEDULES_BIN" "$CLI"; do
  [ -x "$bin" ] || {
    echo "figures.sh: no $bin; build it first (see the header of $0) or set BIN_DIR" >&2
    exit 2
  }
done
mkdir -p "$OUT"
{
  date -u
  git rev-parse --short HEAD 2>/dev/null || echo "(not a git checkout)"
  grep -m1 'model name' /proc/cpuinfo | sed 's/.*: //'
  echo "$(nproc) cores"
} > "$OUT/env.txt"
cat "$OUT/env.txt"

if has figures; then
  echo "== generated lists and tilings, seeds $SEEDS -> $OUT/figures.txt"
  FIGURES_SEEDS=$SEEDS "$FIGURES_BIN" "${FILTER:-}" > "$OUT/figures.txt"
  sed -n '/^summary/,$p' "$OUT/figures.txt"
fi

if has schedules; then
  echo "== pipeline schedules, 200 ms each -> $OUT/schedules.txt"
  : > "$OUT/schedules.txt"
  IFS=, read -r -a sweeps <<< "${SCHEDULES:-1000 200,explicit 1000 200,workspaces 200,uneven 1-3000 200,large 1-100 200,uneven large 1-40 200,inputs 300 200}"
  for args in "${sweeps[@]}"; do
    # shellcheck disable=SC2086 # the arguments are words
    sweep=$("$SCHEDULES_BIN" $args)
    printf '### schedules -- %s\n%s\n\n' "$args" "$sweep" >> "$OUT/schedules.txt"
    # Each sweep ends with its count above 1.001 and its worst plan.
    echo "schedules -- $args: ${sweep##*$'\n'}"
  done
fi

if has lists; then
  echo "== bench/lists families, seeds $LIST_SEEDS -> $OUT/lists.txt"
  GRAPHPOOL_BIN=$CLI bench/lists/run.sh --sizes 10000,100000 --seeds "$LIST_SEEDS" > "$OUT/lists.txt"
  tail -n 25 "$OUT/lists.txt"
  echo "== bench/lists/recorded (eager steps as PyTorch's allocator saw them) -> $OUT/recorded.txt"
  GRAPHPOOL_BIN=$CLI bench/lists/recorded.sh > "$OUT/recorded.txt"
  cat "$OUT/recorded.txt"
fi

if has together; then
  k=${TOGETHER:-8}
  cases=${TOGETHER_CASES:-3000}
  cores=$(nproc)
  share=$(( cores / k > 0 ? cores / k : 1 ))
  echo "== $k sweeps at once, uneven 1-$cases 200 in slices -> $OUT/together.txt"
  : > "$OUT/together.txt"
  # Three ways to give out the cores: a thread per core in every plan ("every"); each plan
  # its share once all run ("share"); slice i on cores / (i + 1), the shares graphpoold gives
  # plans that start at one moment and keep while they run ("burst": 16, 8, 5, ... on 16 cores).
  for mode in every share burst; do
    dir=$(mktemp -d)
    for ((i = 0; i < k; i++)); do
      from=$(( i * cases / k + 1 )); to=$(( (i + 1) * cases / k ))
      case $mode in
        every) threads=0 ;;
        share) threads=$share ;;
        burst) threads=$(( cores / (i + 1) > 0 ? cores / (i + 1) : 1 )) ;;
      esac
      "$SCHEDULES_BIN" uneven "$from-$to" 200 "$threads" > "$dir/$i.txt" &
    done
    wait
    # Each slice ends with "N schedules, ...: A above 1.001 × the bound, worst W, slowest plan S ms".
    summary=$(sed -n 's/^\([0-9]*\) schedules, 200 ms each: \([0-9]*\) above 1.001 × the bound, worst \([0-9.]*\), slowest plan \([0-9.]*\) ms.*/\1 \2 \3 \4/p' "$dir"/*.txt |
      awk '{ n += $1; a += $2; if ($3 > w) w = $3; if ($4 > s) s = $4 }
           END { printf "%d schedules: %d above 1.001, worst %.4f, slowest plan %.1f ms", n, a, w, s }')
    # The example lists every plan that took over 1.25 × its budget ("planned in ...").
    late=$(cat "$dir"/*.txt | grep -c ': planned in ' || true)
    summary="$summary, $late past 1.25 × the budget"
    case $mode in
      every) label="a thread per core ($cores) in each plan" ;;
      share) label="each plan on $share of the $cores cores" ;;
      burst) label="slice i on $cores / (i + 1) threads, as plans started together keep them" ;;
    esac
    { printf '### %d at once, %s: %s\n' "$k" "$label" "$summary"; cat "$dir"/*.txt; echo; } >> "$OUT/together.txt"
    echo "$k at once, $label: $summary"
    rm -r "$dir"
  done
fi
