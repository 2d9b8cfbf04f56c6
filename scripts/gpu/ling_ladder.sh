#!/usr/bin/env bash
# The full-depth Ling-3.0-flash ladder on the H200, from the repository root (results in $OUT):
# humming-kernels from .whl/ when there, GPU tests (TESTS), row 3's step under variants
# (AB_VARIANTS: scripts/gpu/ab_step.py), then suites/test_ling_ladder.py with --moe-bench, gated
# against (FREEZE=1: frozen into) a copy of baselines/ in $OUT/baselines.tar, the A/B reports and
# roofline tables in $OUT/ab.tar.
#   FREEZE=1 LING_K="not 32k" bash scripts/gpu/ling_ladder.sh
#   LING_ROWS="kernels=moe=triton,head=bf16;..." (--moe-ladder) GATE_AFTER=1 (gate in a second process)
#   AB_VARIANTS="gemv;cublas=projection:cublas" AB_CONTEXTS=1024,8192 NO_LADDER=1 (the A/B alone)
set -u
OUT=${OUT:-/tmp/moeperf-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" HUMMING_COMPILER=nvrtc PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  # the card is nearly full with two copies of the experts
. scripts/gpu/pytest_cmd.sh  # PYTEST
if [ -n "${TESTS:-}" ]; then
  # shellcheck disable=SC2086  # TESTS is a list of test files
  timeout "${TEST_SECONDS:-120}" $PYTEST -rf $TESTS > "$OUT/gpu-tests.log" 2>&1
  echo "gpu tests rc=$?"; tail -3 "$OUT/gpu-tests.log"
fi
if [ -n "${AB_VARIANTS:-}" ]; then
  timeout "${AB_SECONDS:-240}" python3 scripts/gpu/ab_step.py --contexts "${AB_CONTEXTS:-1024,8192,32768}" \
    --variants "$AB_VARIANTS" > "$OUT/ab-step.log" 2>&1
  echo "ab step rc=$?"; grep -E "^\||captured" "$OUT/ab-step.log" | tail -30
fi
[ -n "${NO_LADDER:-}" ] && exit 0
cp -r baselines "$OUT/gate-baselines"
timeout "${LADDER_SECONDS:-480}" $PYTEST --moe-bench ${FREEZE:+--moe-freeze} --moe-model ling-3.0-flash \
  --moe-baselines "$OUT/gate-baselines" --moe-ab-report "$OUT/ab" -rfs -s ${LING_K:+-k "$LING_K"} ${LING_ROWS:+--moe-ladder "$LING_ROWS"} \
  suites/test_ling_ladder.py > "$OUT/ling-ladder.log" 2>&1
echo "ling ladder rc=$?"
if [ -n "${GATE_AFTER:-}" ]; then  # a second process gates what the first froze
  timeout "${GATE_SECONDS:-300}" $PYTEST --moe-bench --moe-model ling-3.0-flash --moe-baselines "$OUT/gate-baselines" \
    --moe-ab-report "$OUT/ab-gate" -rfs -s ${LING_K:+-k "$LING_K"} ${LING_ROWS:+--moe-ladder "$LING_ROWS"} suites/test_ling_ladder.py > "$OUT/ling-gate.log" 2>&1
  echo "ling gate rc=$?"
  [ -d "$OUT/ab-gate" ] && tar -cf "$OUT/ab-gate.tar" -C "$OUT" ab-gate && rm -rf "$OUT/ab-gate"
  grep -E "PASS|FAIL|passed|failed" "$OUT/ling-gate.log" | tail -40
fi
tar -cf "$OUT/baselines.tar" -C "$OUT" gate-baselines && rm -rf "$OUT/gate-baselines"
[ -d "$OUT/ab" ] && tar -cf "$OUT/ab.tar" -C "$OUT" ab && rm -rf "$OUT/ab"
grep -E "^\| |roofline|ab_|passed|failed|Error|error" "$OUT/ling-ladder.log" | tail -60
