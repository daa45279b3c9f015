#!/usr/bin/env bash
# Everything GPU-related of graphpool, in one go, building nothing:
#   1. bench/gpu/cuda_backend.py  (grant imported in another process, latency, daemon memory)
#   2. a graphpoold --backend cuda on a socket under /tmp, then bench/gpu/shim_latency.py
#   3. the GPU pytest suite (client-py/tests/gpu) against that daemon, and
#      bench/gpu/generator_replay.py (what a generator registered with a graph costs a replay)
# Binaries come from $GRAPHPOOL_BIN_DIR, the directory holding graphpoold, graphpool and
# libgraphpool_shim.so (default <repo>/.carry, ignored by git), built elsewhere with
# `cargo build --release -p graphpool --bins` and `cargo build --release -p graphpool-shim`.
# Results go to $OUT (default /tmp/graphpool-bench-out): env.txt, cuda_backend.json,
# shim_latency.json, gpu_tests.json, pytest.log, generator_replay.txt, seed.json, seed.log,
# traces/ (each eager step's allocations as a gzipped buffer list, planned in seed.log),
# poison.log, graphpoold.log, run.log; a short table is printed last.
#
# STAGES (default "backend shim tests seed poison") picks what runs; SEED_ARGS adds arguments to
# the seed reproduction (bench/gpu/seed_repro.py), e.g. SEED_ARGS="--m 8,128 --deadline 200".
# Durations on one H200 with 16 cores: backend and shim under a minute, tests 1.5 min, seed
# 5.3 min, poison 6.3 min; about 14 minutes for all of them. Where one command may run 10
# minutes at most, run "backend shim tests seed" and "poison" apart.
set -u
STAGES=${STAGES:-backend shim tests seed poison}
has() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
OUT=${OUT:-/tmp/graphpool-bench-out}
BIN=${GRAPHPOOL_BIN_DIR:-$ROOT/.carry}
mkdir -p "$OUT"
export PYTHONPATH="$ROOT/client-py/src${PYTHONPATH:+:$PYTHONPATH}"
export GRAPHPOOL_SHIM="$BIN/libgraphpool_shim.so"
export PYTHONUNBUFFERED=1
cd "$ROOT"
exec > >(tee -a "$OUT/run.log") 2>&1

{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 -c 'import sys, torch, grpc, google.protobuf as pb; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "grpcio", grpc.__version__, "protobuf", pb.__version__, "gpus", torch.cuda.device_count())' 2>&1
  "$BIN/graphpoold" --version 2>&1
  nproc; uname -r
} > "$OUT/env.txt"
cat "$OUT/env.txt"

if has backend; then
echo "== cuda backend"
python3 bench/gpu/cuda_backend.py --graphpoold "$BIN/graphpoold" --out "$OUT/cuda_backend.json" \
  --log "$OUT/graphpoold.log" > /dev/null || echo "cuda_backend.py failed: $?"
fi

echo "== daemon for the shim bench and the tests"
SOCKDIR=$(mktemp -d /tmp/graphpool-gpu.XXXXXX)
SOCK=$SOCKDIR/g.sock
"$BIN/graphpoold" --backend cuda --socket "$SOCK" --metrics-listen off >> "$OUT/graphpoold.log" 2>&1 &
DPID=$!
for _ in $(seq 200); do [ -S "$SOCK" ] && break; sleep 0.05; done
sleep 0.3

if has shim; then
echo "== shim latency"
python3 bench/gpu/shim_latency.py --socket "$SOCK" --out "$OUT/shim_latency.json" || echo "shim_latency.py failed: $?"
fi

if has tests; then
echo "== GPU tests"
rm -f "$OUT/gpu_tests.json"
GRAPHPOOL_GPU_SOCKET=$SOCK GRAPHPOOL_BENCH_OUT="$OUT/gpu_tests.json" GRAPHPOOL_CLI_BIN="$BIN/graphpool" timeout 300 \
  python3 -m pytest client-py/tests/gpu -v -p no:cacheprovider > "$OUT/pytest.log" 2>&1
echo "pytest exit $?"; tail -15 "$OUT/pytest.log"
echo "== replay cost of generators registered for rng_generators"
timeout 120 python3 bench/gpu/generator_replay.py > "$OUT/generator_replay.txt" 2>&1
echo "generator_replay exit $?"; cat "$OUT/generator_replay.txt"
fi

if has seed; then
echo "== seed reproduction (daemon-backed graphpool pools)"
GRAPHPOOL_SOCKET=$SOCK timeout 600 python3 bench/gpu/seed_repro.py --pools graphpool --steps 2 --timeout 60 \
  --graphpool-cli "$BIN/graphpool" --plan-eager-step --trace-dir "$OUT/traces" --order schedule-major --out "$OUT/seed.json" ${SEED_ARGS:-} \
  > "$OUT/seed.log" 2>&1
echo "seed_repro exit $?"; tail -40 "$OUT/seed.log"
fi

if has poison; then
echo "== poison test (replay in schedule order cannot overwrite live data; layers of other shapes)"
# test_poison.py (a stack of blocks) and test_models.py (multi-tensor, token/loss, aliasing,
# mixed widths and dtypes, dropout, batchnorm, refusals): each case a child process
GRAPHPOOL_SOCKET=$SOCK timeout 540 python3 -m pytest client-py/tests/capture -v -p no:cacheprovider \
  ${POISON_ARGS:-} > "$OUT/poison.log" 2>&1
echo "poison exit $?"; tail -25 "$OUT/poison.log"
fi

kill "$DPID" 2>/dev/null; wait "$DPID" 2>/dev/null

echo "== the same shim bench against a host-backend daemon (gRPC + fd cost without the driver)"
"$BIN/graphpoold" --backend host --socket "$SOCKDIR/h.sock" --metrics-listen off >> "$OUT/graphpoold.log" 2>&1 &
HPID=$!
for _ in $(seq 200); do [ -S "$SOCKDIR/h.sock" ] && break; sleep 0.05; done
sleep 0.3
python3 bench/gpu/shim_latency.py --host --socket "$SOCKDIR/h.sock" --sizes-mib 20,1024 > "$OUT/host_latency.txt" 2>&1
cat "$OUT/host_latency.txt"
kill "$HPID" 2>/dev/null; wait "$HPID" 2>/dev/null

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
def load(n):
    p = os.path.join(out, n)
    return json.load(open(p)) if os.path.exists(p) else {}
cb, sl, gt = load("cuda_backend.json"), load("shim_latency.json"), load("gpu_tests.json")
rows = []
for label, key in (("warm stock", "grant_latency"), ("no stock", "grant_latency_cold")):
    for k, v in cb.get(key, {}).items():
        rows.append((f"grant e2e {k} ({label}) p50/p99 (us)", f"{v['grant_p50_us']:.0f} / {v['grant_p99_us']:.0f}"
                     f"  [rpc {v['rpc_p50_us']:.0f}, fd {v['fd_p50_us']:.0f}, import+map {v['import_map_p50_us']:.0f};"
                     f" free {v['free_p50_us']:.0f}]"))
wa = cb.get("warm_accounting")
if wa:
    rows.append(("warm stock: drop = granted + warm (MiB)", f"{wa['device_drop_bytes'] / 2**20:.1f} = {wa['granted_bytes'] / 2**20:.1f} + {wa['warm_bytes'] / 2**20:.1f}"))
if cb:
    rows.append(("daemon device memory, idle (MiB)", f"{cb.get('daemon_idle_device_bytes', 0) / 2**20:.1f}"))
    rows.append(("drop with 1 GiB granted (MiB)", f"{cb.get('drop_with_1GiB_granted_bytes', 0) / 2**20:.1f}"))
    rows.append(("NVML: daemon listed / used", f"{cb.get('nvml_holding', {}).get('daemon_listed')} / {cb.get('nvml_holding', {}).get('daemon_used_bytes')}"))
    rows.append(("readback ok", str(cb.get("readback"))))
    for k, v in cb.get("driver_calls", {}).items():
        rows.append((f"driver calls {k} (us)", str(v)))
for r in sl.get("results", []):
    rows.append((f"shim segment {r['size_mib']} MiB p50 (us)", f"{r['alloc_p50_us']:.0f} (free {r['free_p50_us']:.0f})"))
rt = gt.get("replay_time")
if rt:
    rows.append(("replay median torch / graphpool (ms)", f"{rt['torch_pool_median_ms']:.4f} / {rt['graphpool_median_ms']:.4f} ({100 * rt['relative_difference']:+.2f}%)"))
if gt.get("ledger_check"):
    rows.append(("ledger == pool reserved (bytes)", str(gt["ledger_check"])))
if gt.get("two_processes"):
    s = gt["two_processes"]["second"]
    rows.append(("2nd process refused", f"{s.get('limit')} requested {s.get('requested')} free {s.get('free')}"))
w = max((len(a) for a, _ in rows), default=10)
print("\n== summary")
for a, b in rows:
    print(f"{a:<{w}}  {b}")
PY
