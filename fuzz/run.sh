#!/usr/bin/env bash
# Runs every graphpool fuzz target for a bounded time and prints the executions of each.
#
#   bash fuzz/run.sh short          # CI: ~15 s per target, ~60 s of fuzzing in total
#   bash fuzz/run.sh long [SECONDS] # report: SECONDS per target (default 120)
#
# Needs a stable toolchain and cargo-fuzz (installed when missing), no nightly: cargo-fuzz runs
# with RUSTC_BOOTSTRAP=1 (for the -Z flags it passes) and without a sanitizer (-s none);
# coverage instrumentation (sancov) and libFuzzer work the same. Debug assertions and overflow
# checks are on (-a). Builds go to FUZZ_TARGET_DIR (default fuzz/target, ignored by git).
# Crashes are written to fuzz/artifacts/<target>/ and make this script fail; replay one with
#   RUSTC_BOOTSTRAP=1 cargo fuzz run -s none -a <target> fuzz/artifacts/<target>/<file>
set -euo pipefail
mode=${1:-short}
cd "$(dirname "$0")/.."
case "$mode" in
  short) per=15 ;;
  long) per=${2:-120} ;;
  *) echo "usage: $0 short|long [seconds-per-target]" >&2; exit 2 ;;
esac
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1
tdir=${FUZZ_TARGET_DIR:-$PWD/fuzz/target}
targets=(grpc_requests fd_socket plan_input plan_files)
flags=(-s none -a --target-dir "$tdir")
cargo fuzz build "${flags[@]}"
mkdir -p fuzz/logs
# The targets' temporary files (the fd socket target's socket) go to a directory removed at
# exit: a fuzz run ends by exiting, which leaves them behind.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
status=0
summary=()
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  log="fuzz/logs/$t.log"
  if TMPDIR=$scratch cargo fuzz run "${flags[@]}" "$t" "fuzz/corpus/$t" -- \
      -max_total_time="$per" -timeout=10 -rss_limit_mb=2048 -max_len=4096 -print_final_stats=1 >"$log" 2>&1; then
    result=ok
  else
    result=FAILED
    status=1
    tail -n 40 "$log" >&2
  fi
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -n1)
  rate=$(grep -o 'exec/s: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -n1)
  cov=$(grep -o 'cov: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -n1)
  summary+=("$(printf '%-14s %-7s %10s execs %7s exec/s  cov %6s  (%s s)' "$t" "$result" "${execs:-?}" "${rate:-?}" "${cov:-?}" "$per")")
done
echo "fuzz ($mode):"
printf '  %s\n' "${summary[@]}"
exit $status
