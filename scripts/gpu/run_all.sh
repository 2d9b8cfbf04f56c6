#!/usr/bin/env bash
# Every GPU check and measurement of issues 3 and 4 in one call: the correctness suites on CUDA,
# the MoE and head benchmarks with the launch-config sweep, then the --moe-bench gate frozen for
# this GPU. Run from the repository root on the H200 (carry .whl with the humming-kernels wheel):
#     bash scripts/gpu/run_all.sh
# Results land in $OUT: logs, bench JSON, tuned MoE configs, and baselines/ to commit.
set -u
OUT=${OUT:-/tmp/moeperf-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" HUMMING_COMPILER=nvrtc PYTHONUNBUFFERED=1
timeout "${CHECK_SECONDS:-150}" python3 -m pytest -q -p no:cacheprovider -p pytest_moeperf.plugin --moe-device cuda \
  suites/test_moe_parity.py suites/test_moe_fuzz.py suites/test_head_parity.py tests/test_triton_moe.py \
  tests/test_fp8_gemv.py > "$OUT/checks.log" 2>&1; echo "gpu checks rc=$?"
timeout "${MOE_SECONDS:-330}" python3 scripts/gpu/bench_moe.py --tune --write-configs --ms 1,4 --out "$OUT" \
  > "$OUT/moe.log" 2>&1; echo "bench_moe rc=$?"
cp impl/moe/tuned_configs.json "$OUT/" 2>/dev/null
timeout "${HEAD_SECONDS:-100}" python3 scripts/gpu/bench_head.py --quick > "$OUT/head.log" 2>&1; echo "bench_head rc=$?"
# The gate compares against the committed figures; FREEZE=1 records new ones (into a copy that
# keeps every other device's entries; commit $OUT/baselines/*.json after review).
cp -r baselines "$OUT/"
timeout "${GATE_SECONDS:-130}" python3 -m pytest -q -p no:cacheprovider -p pytest_moeperf.plugin --moe-bench \
  --moe-device cuda ${FREEZE:+--moe-freeze} --moe-baselines "$OUT/baselines" suites/test_moe_bench.py \
  $(ls suites/test_head_bench.py 2>/dev/null) > "$OUT/gate.log" 2>&1; echo "gate rc=$?"
tail -5 "$OUT/checks.log"; grep -A60 "== summary" "$OUT/moe.log" | grep -v "^TUNED"; tail -30 "$OUT/head.log"
tail -20 "$OUT/gate.log"
