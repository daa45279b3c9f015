#!/usr/bin/env bash
# Runs every test of graphpool and installs what they need (the Rust toolchain aside):
# formatting, lints, API docs, Rust unit/property/integration tests, the Python client's
# tests against a real daemon, and the deployment checks. Tests that need a GPU skip here;
# bench/gpu/run.sh runs them on a GPU machine.
#
#   scripts/test.sh            everything
#   scripts/test.sh rust       one part: rust | python | deploy | fuzz
set -euo pipefail
cd "$(dirname "$0")/.."

parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(rust python deploy fuzz)
want() { local p; for p in "${parts[@]}"; do [ "$p" = "$1" ] && return 0; done; return 1; }
step() { printf '\n==> %s\n' "$*"; }

export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-never}
export CARGO_INCREMENTAL=0
# Where cargo puts what it builds (absolute: the steps below change directory).
TARGET=${CARGO_TARGET_DIR:-target}
case $TARGET in /*) ;; *) TARGET=$PWD/$TARGET ;; esac

if want rust; then
  step "toolchain components"
  if command -v rustup >/dev/null; then
    rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
    rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
  fi
  step "cargo fmt --check"
  cargo fmt --all -- --check
  step "cargo clippy -D warnings"
  cargo clippy --workspace --all-targets --locked -- -D warnings
  step "cargo doc -D warnings"
  RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps --document-private-items --locked
  step "cargo test (unit, property, integration)"
  cargo test --workspace --locked
  step "load benchmark builds (bench/load: a workspace of its own, with its own lockfile)"
  cargo clippy --locked --manifest-path bench/load/Cargo.toml --target-dir "$TARGET" -- -D warnings
fi

if want python; then
  step "python client tests (real graphpoold, host backend)"
  cargo build --locked --bins
  GRAPHPOOL_DAEMON_BIN="$TARGET/debug/graphpoold" GRAPHPOOL_BIN="$TARGET/debug/graphpool" \
    bash client-py/tools/test.sh
fi

if want deploy; then
  step "deployment checks (manifests, rules, dashboard, Prometheus end to end)"
  cargo build --locked --bins
  GRAPHPOOL_BIN_DIR="$TARGET/debug" bash .ci/deploy-checks.sh
fi

if want fuzz && [ -x fuzz/run.sh ]; then
  step "short fuzz run"
  bash fuzz/run.sh short
fi

step "all tests passed"
