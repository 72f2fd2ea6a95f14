#!/usr/bin/env bash
# One H200 pass in one command: GPU tests, verify runner at real shapes, headline numbers, one MTP round.
# Every GPU test (modules that import the SDKs the H200 lacks fail to collect and are skipped), the verify runner at
# real 27B shapes (lab/check_verify_shapes.py), the headline numbers of the given presets (lab/gpu_quick.py) and
# the cost of one MTP round (lab/gpu_spec_bench.py). Logs go to $OUT.
# Usage (repo root, .whl carried): bash lab/gpu_round.sh qwen3.6-27b [qwen3.6-35b-a3b]
set -uo pipefail
OUT=${OUT:-/tmp/ninfer-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
step() {  # step NAME SECONDS CMD...: run CMD under a timeout, log to $OUT/NAME.log, print its tail
  local name=$1 limit=$2 started=$SECONDS; shift 2
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - started)) s"; tail -n "${TAIL:-15}" "$OUT/$name.log"
}
[ -n "${SKIP_TESTS:-}" ] || step gpu_tests "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -m gpu --continue-on-collection-errors tests/
[ -n "${SKIP_SHAPES:-}" ] || step verify_shapes 100 python3 lab/check_verify_shapes.py --layers 64 --vocab 248320
step quick "${QUICK_TIMEOUT:-150}" python3 lab/gpu_quick.py "$OUT" "$@"
[ -n "${SKIP_SPEC:-}" ] || step spec "${SPEC_TIMEOUT:-120}" python3 lab/gpu_spec_bench.py "$OUT" qwen3.6-27b --rows 1 --tests ''
