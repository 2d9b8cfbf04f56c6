#!/usr/bin/env bash
# The A/B ladder on the H200, from the repository root (results in $OUT): the serving loop's GPU
# tests, then suites/test_ab_ladder.py with --moe-bench, gated against (FREEZE=1: frozen into) a
# copy of baselines/ in $OUT/baselines.tar, the A/B report in $OUT/ab/.
set -u
OUT=${OUT:-/tmp/moeperf-out}
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
. scripts/gpu/pytest_cmd.sh  # PYTEST
timeout "${TEST_SECONDS:-150}" $PYTEST -rf tests/test_serve_gpu.py > "$OUT/serve-gpu.log" 2>&1
echo "serve gpu tests rc=$?"; tail -3 "$OUT/serve-gpu.log"
cp -r baselines "$OUT/gate-baselines"
# shellcheck disable=SC2086  # LADDER_ARGS is a list of arguments
timeout "${LADDER_SECONDS:-300}" $PYTEST --moe-bench ${FREEZE:+--moe-freeze} --moe-baselines "$OUT/gate-baselines" \
  --moe-ab-report "$OUT/ab" -rs ${LADDER_ARGS:-} suites/test_ab_ladder.py > "$OUT/ladder.log" 2>&1
echo "ladder rc=$?"
tar -cf "$OUT/baselines.tar" -C "$OUT" gate-baselines && rm -rf "$OUT/gate-baselines"
grep -E "ab_|passed|failed" "$OUT/ladder.log" | tail -30
