#!/usr/bin/env bash
# Plans the recorded buffer lists of bench/lists/recorded/ (eager training steps of the seed
# benchmark's pipeline stage, as PyTorch's caching allocator saw them) with `graphpool plan
# --buffers`, at the CLI's default budget and with 1 s, and prints buffers, footprint / lower
# bound and planning time per list.
#
#   bench/lists/recorded.sh
#
# Environment:
#   GRAPHPOOL_BIN  the CLI to run (default: target/release/graphpool; build it with
#                  `cargo build --release --bins`; nothing is built here)
set -euo pipefail
cd "$(dirname "$0")/../.."

BIN=${GRAPHPOOL_BIN:-target/release/graphpool}
if [ ! -x "$BIN" ]; then
  echo "no graphpool CLI at $BIN: run \`cargo build --release --bins\` or set GRAPHPOOL_BIN" >&2
  exit 2
fi
echo "graphpool plan --buffers FILE [--time-budget-ms 1000], $(nproc) cores"
printf '%-22s %8s %18s %18s\n' list buffers "default budget" "1 s"
for gz in bench/lists/recorded/*.csv.gz; do
  cells=()
  for budget in "" "--time-budget-ms 1000"; do
    # shellcheck disable=SC2086 # the budget is two words or none
    cells+=("$(gzip -dc "$gz" | "$BIN" plan --buffers - --json $budget | python3 -c '
import json, sys
p = json.load(sys.stdin)
print(len(p["buffers"]), "%.4f %6.1f ms" % (p["ratio"], 1000 * p["planning_seconds"]))')")
  done
  printf '%-22s %8s %18s %18s\n' "$(basename "$gz" .csv.gz)" "${cells[0]%% *}" "${cells[0]#* }" "${cells[1]#* }"
done
