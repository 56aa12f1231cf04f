#!/usr/bin/env bash
# One GPU call (about 9 minutes) for the code built while no GPU was lent (2026-12-07, sixth and seventh
# sessions), in priority order, each step under its own timeout; logs and CSVs go to $OUT:
#   1. the GPU tests of that code: a8w4's finish launch (inter_quant.finish_rows), GEMM2's lookahead prefetch
#      (ahead2), and the pair-block and split-K tests that run them
#   2. the finish launch timed against the launch sequence before it (atom_moe/experts.py of 51b0461: GEMM1's
#      second launch, then the quant launch), new / old / new, a8w4 and fp8 at T = 1 on the split shapes
#   3. `atom-moe tune --space ahead`: GEMM2's lookahead at 256-2048 programs beside today's rows, fp8 and a8w4 at
#      T = 8 and 128 on the small-I shapes and DeepSeek-V3 (every candidate's time in $OUT/tune-trials.csv)
# Before the call, on this machine: mkdir -p .cache/old && git show 51b0461:atom_moe/experts.py > .cache/old/experts.py,
# then carry .cache/old. Usage: bash scripts/device_pending.sh
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
mkdir -p "$out"
[ -f .cache/old/experts.py ] || { echo "device_pending: .cache/old/experts.py is missing (see the header)"; exit 2; }
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
step() { echo "== $1 [$(date +%T), ${SECONDS} s in]"; }
step "GPU tests"
# -m "gpu or not gpu" would be every test: the files' unmarked tests run on the GPU too where there is one
timeout 170 python3 -m pytest -q -p no:cacheprovider -rf -n 4 tests/test_gemm2_ahead.py tests/test_inter_quant.py \
    tests/test_pair_blocks.py tests/test_split_k.py >"$out/gpu-tests.log" 2>&1
grep "FAILED\|ERROR\|passed\|failed" "$out/gpu-tests.log" | tail -12
step "finish launch A/B"
AB_STEP_S=80 bash scripts/device_ab.sh atom_moe/experts.py --shapes glm-5.2-tp8 glm-5.2-tp4 deepseek-v4.1-flash-tp4 \
    deepseek-v4.1-flash-tp2 --schemes fp8 a8w4 --tokens 1 --iters 20
step "GEMM2 lookahead sweep"
SPACE=ahead SCHEMES="fp8 a8w4" MODELS="glm-5.2-tp8 glm-5.2-tp4 deepseek-v4.1-flash-tp4 deepseek-v3" TOKENS="8 128" \
    bash scripts/tune_served.sh .cache/ahead/tuned-ahead.csv $((570 - SECONDS))
step "done"
