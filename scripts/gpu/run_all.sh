#!/usr/bin/env bash
# Every GPU check and measurement in two parts, run from the repository root on the H200 (carry
# .whl with the humming-kernels wheel; results land in $OUT):
#     bash scripts/gpu/run_all.sh tune    # correctness suites on CUDA, MoE bench + launch-config
#                                         # sweep (tuned configs in $OUT/tuned_configs.json)
#     bash scripts/gpu/run_all.sh bench   # the same with the committed configs (no sweep);
#                                         # CHECKS="files" narrows the correctness suites
#     bash scripts/gpu/run_all.sh profile # kernel-by-kernel profile A/B: the committed configs
#                                         # against each override of PROFILE_AB (space-separated,
#                                         # e.g. "pdl=false"), over SHAPES, FORMATS, MS
#     bash scripts/gpu/run_all.sh humming # the humming backend's GPU tests, and the parity suite
#                                         # with --moe-backend humming (its MXFP4 cases)
#     bash scripts/gpu/run_all.sh gate    # FP8 head bench, then the main job `pytest --moe-bench`
#                                         # on CUDA, gated against (FREEZE=1: frozen into) a copy
#                                         # of baselines/ in $OUT/baselines.tar; GATE_ARGS adds
#                                         # pytest arguments (e.g. "-m moe_bench --moe-strict")
#     bash scripts/gpu/run_all.sh trust   # scripts/gate_trust.py on CUDA with TRUST_ARGS (its
#                                         # phases), everything it wrote in $OUT/trust.tar.gz
# With no argument both parts run. Commit the tuned configs before the gate part, since the gate
# times the kernels with the committed configs.
set -u
OUT=${OUT:-/tmp/moeperf-out}
PART=${1:-all}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" HUMMING_COMPILER=nvrtc PYTHONUNBUFFERED=1
. scripts/gpu/pytest_cmd.sh  # PYTEST
CHECKS=${CHECKS:-suites/test_moe_parity.py suites/test_head_parity.py tests/test_triton_moe.py tests/test_fp8_gemv.py \
tests/test_triton_routing.py suites/test_moe_fuzz.py}
if [ "$PART" = tune ] || [ "$PART" = bench ] || [ "$PART" = all ]; then
  TUNE_FLAGS=""
  [ "$PART" = bench ] || TUNE_FLAGS="--tune --write-configs"
  timeout "${MOE_SECONDS:-330}" python3 scripts/gpu/bench_moe.py $TUNE_FLAGS --ms 1,4 --out "$OUT" \
    > "$OUT/moe.log" 2>&1; echo "bench_moe rc=$?"
  [ -n "$TUNE_FLAGS" ] && cp impl/moe/tuned_configs.json "$OUT/"
  # shellcheck disable=SC2086  # CHECKS is a list of paths
  timeout "${CHECK_SECONDS:-200}" $PYTEST -rf --durations=15 $CHECKS > "$OUT/checks.log" 2>&1
  echo "gpu checks rc=$?"
  grep -A60 "== summary" "$OUT/moe.log" | grep -v "^TUNED"; tail -25 "$OUT/checks.log"
fi
if [ "$PART" = profile ]; then
  overrides=(--override "")
  for o in ${PROFILE_AB:-pdl=false}; do overrides+=(--override "$o"); done
  timeout "${AB_SECONDS:-300}" python3 scripts/gpu/profile_kernels.py --model= \
    --moe-shapes "${SHAPES:-ling-3.0-flash,ling-flash-2.0}" --formats "${FORMATS:-mxfp4,bf16}" --ms "${MS:-1,4}" \
    "${overrides[@]}" > "$OUT/profile-ab${TAG:-}.log" 2>&1; echo "profile rc=$?"
  grep "^== " "$OUT/profile-ab${TAG:-}.log"
fi
if [ "$PART" = humming ]; then
  timeout "${CHECK_SECONDS:-240}" $PYTEST -rfs tests/test_moe_humming.py > "$OUT/humming-checks.log" 2>&1
  echo "humming tests rc=$?"; tail -4 "$OUT/humming-checks.log"
  timeout "${PARITY_SECONDS:-200}" $PYTEST -rf --moe-backend humming -k mxfp4 suites/test_moe_parity.py \
    > "$OUT/humming-parity.log" 2>&1; echo "humming parity rc=$?"; tail -4 "$OUT/humming-parity.log"
fi
if [ "$PART" = gate ] || [ "$PART" = all ]; then
  timeout "${HEAD_SECONDS:-100}" python3 scripts/gpu/bench_head.py --quick > "$OUT/head.log" 2>&1
  echo "bench_head rc=$?"
  # The main job on this GPU. The gate compares against the committed figures; FREEZE=1 records
  # new ones into a copy that keeps every other device's entries.
  cp -r baselines "$OUT/gate-baselines"
  # shellcheck disable=SC2086  # GATE_ARGS is a list of arguments
  timeout "${GATE_SECONDS:-300}" $PYTEST --moe-bench ${FREEZE:+--moe-freeze} --moe-baselines "$OUT/gate-baselines" \
    -rs ${GATE_ARGS:-} suites > "$OUT/gate.log" 2>&1; echo "gate rc=$?"
  tar -cf "$OUT/baselines.tar" -C "$OUT" gate-baselines && rm -rf "$OUT/gate-baselines"
  tail -30 "$OUT/head.log"; grep -E "^suites|PASS|FAIL|REGRESS|FROZEN|SKIP|passed|failed|agreement" "$OUT/gate.log" | tail -60
fi
if [ "$PART" = trust ]; then
  # shellcheck disable=SC2086  # TRUST_ARGS is a list of arguments
  timeout "${TRUST_SECONDS:-540}" python3 scripts/gate_trust.py --out /tmp/trust ${TRUST_ARGS:-} -- \
    --moe-device cuda > "$OUT/trust.log" 2>&1; echo "trust rc=$?"
  tar -czf "$OUT/trust.tar.gz" -C /tmp trust; tail -60 "$OUT/trust.log"
fi
