#!/usr/bin/env bash
# Runs the graphpool Python package's checks: mypy --strict on the package and pytest against
# a real graphpoold (host backend). Creates client-py/.venv on first use.
#
#   client-py/tools/test.sh [pytest args...]
#
# Environment:
#   PYTHON                 interpreter for the venv (default: python3)
#   GRAPHPOOL_SKIP_SHIM=1  install without building the native shim (no cargo build)
#   GRAPHPOOL_SHIM_PROFILE debug (default here) or release
#   GRAPHPOOL_DAEMON_BIN   graphpoold to test against (default: target/debug/graphpoold,
#                          built with `cargo build --bins` when missing)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
CLIENT="$(dirname "$HERE")"
VENV="$CLIENT/.venv"
PY="${PYTHON:-python3}"

# Pinned so that CI is reproducible; grpcio-tools must match tools/gen_stubs.py.
# grpcio is pinned to the release the fork figures of README.md were measured on, so that a
# new release does not change them (or the fork tests) unseen.
DEPS=(
  "grpcio==1.85.3"
  "grpcio-tools==1.62.3"
  "pytest==9.2.0"
  "mypy==2.4.1"
  "types-protobuf==7.35.1.20260906"
  "types-grpcio==1.85.0.20261028"
  "setuptools>=68"
  "setuptools-rust>=1.9"
  "wheel"
)

if [ ! -x "$VENV/bin/python" ]; then
  # Debian and Ubuntu ship venv's pip bootstrap separately: install it where we may.
  if ! "$PY" -c 'import ensurepip' 2>/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "== installing python3-venv"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv >/dev/null
  fi
  echo "== creating $VENV"
  "$PY" -m venv "$VENV"
fi
echo "== installing test dependencies"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "${DEPS[@]}"

# The shim crate builds with the package unless GRAPHPOOL_SKIP_SHIM=1 or cargo is missing.
if [ -z "${GRAPHPOOL_SKIP_SHIM:-}" ] && ! command -v cargo >/dev/null 2>&1; then
  echo "== cargo not found: installing without the native shim (GRAPHPOOL_SKIP_SHIM=1)"
  export GRAPHPOOL_SKIP_SHIM=1
fi
# A debug build of the shim: it shares compiled dependencies with `cargo build --bins`
# (the daemon the tests run against) in the workspace's target/ (or $CARGO_TARGET_DIR).
export GRAPHPOOL_SHIM_PROFILE="${GRAPHPOOL_SHIM_PROFILE:-debug}"
echo "== installing graphpool (editable${GRAPHPOOL_SKIP_SHIM:+, without the shim})"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e "$CLIENT"

cd "$CLIENT"
echo "== mypy --strict"
"$VENV/bin/mypy" --strict   # every module of src/graphpool (pyproject.toml: [tool.mypy] files)

echo "== pytest"
set +e
"$VENV/bin/python" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
