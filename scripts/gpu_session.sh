#!/usr/bin/env bash
# One device session: GPU tests, then the synthetic benchmark of the given presets. Logs go to $OUT.
# Usage on the H200 (from the repo root, with .whl carried): bash scripts/gpu_session.sh qwen3.6-27b qwen3.6-35b-a3b
set -uo pipefail
OUT=${OUT:-/tmp/ninfer-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/cattrs-*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -p no:cacheprovider -x tests/test_triton_kernels.py tests/test_decode_graph.py tests/test_prefill_kernels.py tests/test_prefill_triton.py \
  > "$OUT/tests.log" 2>&1
echo "gpu tests exit $?"; tail -n 25 "$OUT/tests.log"
timeout "${BENCH_TIMEOUT:-420}" python3 scripts/gpu_bench.py "$OUT" "$@" 2>&1 | tee "$OUT/bench.log"
