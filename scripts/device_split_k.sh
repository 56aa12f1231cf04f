#!/usr/bin/env bash
# One GPU call for split-K at decode on the MXFP4 schemes (GEMM1 and GEMM2, kernels/common.py):
#   1. `atom-moe tune --space split` at T = 1 (every (GEMM1, GEMM2) split of
#   the table's row and the heuristic; --trials keeps each candidate's time)   2.-3. `atom-moe bench` at
#   T = 1 with the shipped table, then with the sweep's picks (ATOM_MOE_CONFIG_DIR)   4. the split-K GPU tests.
# Each step has its own timeout; logs and CSVs go to $OUT.
# Usage: bash scripts/device_split_k.sh [MODEL...]   (default: gpt-oss-120b deepseek-v3)
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
models=("${@:-gpt-oss-120b deepseek-v3}")
read -ra models <<<"${models[*]}"
mkdir -p "$out" "$out/split"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
quiet() { grep -v "no tuned config\|no measured fused\|RuntimeWarning\|warnings.warn"; }
step() { echo "== $1 [$(date +%T)]"; }
for model in "${models[@]}"; do
  for scheme in a16w4 a8w4; do
    step "tune --space split $model $scheme T=1"
    timeout 110 python3 -m atom_moe.tools.cli tune "$model" --scheme "$scheme" --tokens 1 --space split --iters 20 \
        --out "$out/split/split.csv" --trials "$out/split-trials.csv" 2>&1 | quiet | tail -4
  done
done
step "bench T=1, shipped table"
timeout 80 python3 -m atom_moe.tools.cli bench --shapes "${models[@]}" --schemes a16w4 a8w4 --tokens 1 --iters 20 \
    --no-baseline --csv "$out/bench-table.csv" 2>&1 | quiet | tail -8
step "bench T=1, the sweep's picks"
ATOM_MOE_CONFIG_DIR="$out/split" timeout 80 python3 -m atom_moe.tools.cli bench --shapes "${models[@]}" \
    --schemes a16w4 a8w4 --tokens 1 --iters 20 --no-baseline --csv "$out/bench-split.csv" 2>&1 | quiet | tail -8
step "split-K GPU tests"
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/test_split_k.py 2>&1 | tail -6
step "done"
