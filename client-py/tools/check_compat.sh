#!/usr/bin/env bash
# Checks that the package (and its checked-in stubs) works with several protobuf/grpcio
# runtimes: builds a pure-Python wheel, installs it into throwaway venvs, and runs a smoke
# session against a host-backend graphpoold. Needs network access to PyPI.
#
#   client-py/tools/check_compat.sh [python]      (default python3.12, else python3)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CLIENT="$(dirname "$HERE")"
REPO="$(dirname "$CLIENT")"
PY="${1:-$(command -v python3.12 || command -v python3)}"
WORK="$(mktemp -d)"
DAEMON="${GRAPHPOOL_DAEMON_BIN:-$REPO/target/debug/graphpoold}"
trap 'kill "$DPID" 2>/dev/null || true; rm -rf "$WORK"' EXIT

GRAPHPOOL_SKIP_SHIM=1 "$PY" -m pip wheel -q --no-deps -w "$WORK/whl" "$CLIENT"
"$DAEMON" --backend host --socket "$WORK/g.sock" --metrics-listen off --host-capacity 1GiB >"$WORK/d.log" 2>&1 &
DPID=$!

SMOKE='
import sys, warnings
warnings.filterwarnings("error", message=".*[Gg]encode")  # a gencode/runtime version warning fails the check
import google.protobuf, grpc, graphpool
c = graphpool.Client(sys.argv[1])
for _ in range(100):
    if c.health(): break
    import time; time.sleep(0.05)
with c.attach("compat", rank=0, budget="8MiB") as s:
    with s.allocate("2MiB") as seg:
        m = seg.map(); m[:2] = b"ok"; assert m[:2] == b"ok"
    try:
        s.allocate("16MiB"); raise SystemExit("no refusal")
    except graphpool.CapacityExceeded as e:
        assert e.limit == "session-budget", e
print(f"ok: python {sys.version.split()[0]} protobuf {google.protobuf.__version__} grpcio {grpc.__version__}")
'
fail=0
for combo in "protobuf==4.25.9 grpcio==1.60.0" "protobuf==5.26.1 grpcio==1.62.3" "protobuf==5.29.5 grpcio" \
             "protobuf==6.33.6 grpcio" "protobuf==7.36.2 grpcio"; do
  V="$WORK/venv"
  rm -rf "$V"
  "$PY" -m venv "$V"
  "$V/bin/pip" install -q --disable-pip-version-check $combo
  "$V/bin/pip" install -q --disable-pip-version-check --no-deps "$WORK"/whl/graphpool-*.whl
  if ! "$V/bin/python" -c "$SMOKE" "$WORK/g.sock"; then
    echo "FAILED with $combo" >&2
    fail=1
  fi
done
exit $fail
