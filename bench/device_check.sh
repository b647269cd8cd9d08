#!/usr/bin/env bash
# The GPU checks in one prepared run, for a machine with a CUDA GPU and its own torch (run from the repo root):
#   1. the engine tests on CUDA: tests/engine/test_cuda.py (bf16 shipped models, CUDA-event timing, bf16 greedy)
#      and the loop's exactness tests with their float64 pairs on the GPU (SPECTUNE_TEST_DEVICE=cuda);
#   2. the exported HF Llama directories against spectune's forward under that machine's transformers, on the GPU;
#   3. a probe of the host's cost per kernel launch and of one xl forward, plain and as a CUDA graph;
#   4. `bench engine --quick --device cuda`, repeated with seeds 0, 1, 2 while time allows (BENCH_SEEDS).
# Output under $OUT (default /tmp/spectune-device): check.log and engine_cuda_quick_seedN.{json,png}.
# Packages the GPU machine lacks travel as wheels in .whl/ (msgspec); see bench/results/README.md.
set -u
OUT=${OUT:-/tmp/spectune-device}
BUDGET_S=${BUDGET_S:-420}  # start no further bench repeat after this many seconds
BENCH_SEEDS=${BENCH_SEEDS-0 1 2}  # BENCH_SEEDS= runs no bench
# The loop tests whose float64 pairs move to the GPU (the whole file takes minutes when every launch is slow).
LOOP_TESTS=${LOOP_TESTS:-equals_plain_greedy or on_off_schedule or per_row_k or preserves_target or swap_target}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:.
fi
start=$(date +%s)
log="$OUT/check.log"
{
  echo "== machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  echo "== launch probe"
  timeout 60 python3 -m bench.device_probe 2>&1 | tail -3
  echo "== engine tests on CUDA"
  timeout 60 python3 -m pytest -q -s -p no:cacheprovider -o addopts=-ra tests/engine/test_cuda.py 2>&1 | tail -20
  SPECTUNE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider -o addopts=-ra --timeout 40 \
    --durations 5 tests/engine/test_loop.py -k "$LOOP_TESTS" 2>&1 | tail -30
  echo "== exported models under transformers on CUDA"
  timeout 60 python3 -m bench.device_hf "$OUT/hf" 2>&1 | tail -3
  rm -rf "$OUT/hf"
} >"$log" 2>&1
for seed in $BENCH_SEEDS; do
  if (( $(date +%s) - start > BUDGET_S )); then echo "== seed $seed not run: time budget" >>"$log"; break; fi
  echo "== bench engine --quick --device cuda --seed $seed ($(( $(date +%s) - start )) s in)" >>"$log"
  timeout 200 python3 -m bench.engine --quick --device cuda --seed "$seed" \
    --json "$OUT/engine_cuda_quick_seed$seed.json" >>"$log" 2>&1
  echo "rc=$?" >>"$log"
done
echo "== done in $(( $(date +%s) - start )) s" >>"$log"
cat "$log"
