#!/usr/bin/env bash
# One GPU call that re-checks and measures what a session changed, in priority order, each
# step under its own timeout so a slow one cannot eat the rest; logs and CSVs go to $OUT.
#   1. every gpu-marked test   2. atom-moe bench --ep 2 (stage by stage)   3. atom-moe accuracy
#   on the GPU (op paths and the symm transport)   4. atom-moe tune, resuming a table
#   5. atom-moe breakdown for the shapes not broken down yet
# Usage: bash scripts/device_session.sh [TUNE_TABLE]   (TUNE_TABLE: a CSV to resume; optional)
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
quiet() { grep -v "no tuned config\|no measured fused\|RuntimeWarning\|warnings.warn"; }
step() { echo "== $1 [$(date +%T)]"; }
step "GPU tests"
# four workers: the suite took 269 s on an H100 this way (2026-12-06); -v logs each test as it ends, so a timeout
# still shows which ran
timeout 330 python3 -m pytest -v -p no:cacheprovider -m gpu -rs -n 4 tests/ >"$out/gpu.log" 2>&1
grep "FAILED\|ERROR\|passed\|failed" "$out/gpu.log" | grep -v "^\[gw.\] PASSED" | tail -12
step "bench --ep 2"
timeout 110 python3 -m atom_moe.tools.cli bench --ep 2 --shapes deepseek-v3 --schemes bf16 fp8 --tokens 1 128 --iters 10 \
    --csv "$out/bench-ep2.csv" 2>&1 | quiet | tail -8
step "accuracy on the GPU"
timeout 90 python3 -m atom_moe.tools.cli accuracy deepseek-v3 gpt-oss-120b --scheme bf16 --scheme fp8 --scheme a8w4 \
    --tokens 512 --ep 2 --paths triton,torch,symm-fused,symm-split --compare symm-fused,triton \
    --out "$out/accuracy-h200" 2>&1 | quiet | tail -16
if [ -n "${1:-}" ]; then
  step "tune (resume)"
  cp "$1" "$out/tuned.csv"
  timeout 100 python3 -m atom_moe.tools.cli tune gpt-oss-120b --scheme a16w4 --scheme a8w4 --tokens 1 128 2048 --iters 10 \
      --out "$out/tuned.csv" 2>&1 | quiet | tee "$out/tune.log" | tail -14
fi
step "breakdown, the other shapes"
timeout 120 python3 -m atom_moe.tools.cli breakdown --shapes kimi-k2 qwen3-235b-a22b glm-4.5 --schemes bf16 fp8 \
    --ceilings 4.54 798 1480 --csv "$out/breakdown-more.csv" 2>&1 | quiet | grep "layer" | cut -c1-140
timeout 60 python3 -m atom_moe.tools.cli breakdown --shapes gpt-oss-120b --schemes a16w4 a8w4 --tokens 1 128 \
    --ceilings 4.54 798 1480 --csv "$out/breakdown-mxfp4.csv" 2>&1 | quiet | grep "gemm\|layer" | cut -c1-140
step "done"
