#!/usr/bin/env bash
# One GPU call: a16w4 against triton_kernels (the copy vLLM 0.33 ships, 3.5.1 API) on the same inputs,
# shape by shape (scripts/tk_baseline.py --ours), after its --diagnose report. Each shape checks its layer
# against the fp32 reference before timing; where vLLM's Hopper-swizzled layout fails that, the plain one runs.
# Needs .cache/vllm-0.33.0 (python3 scripts/vllm_baseline_src.py; carry it to the GPU machine).
# Usage: bash scripts/device_tk.sh [ROUTING] [SHAPE...]   (default: uniform, the five presets and the four served
# shapes; at GLM-5.2's top-k 9 and V4.1's 6 triton_kernels' routing metadata is built before timing: see tk_baseline.py)
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
routing=${1:-uniform}
shift || true
shapes=("${@:-gpt-oss-120b deepseek-v3 kimi-k2 qwen3-235b-a22b glm-4.5 glm-5.2-tp8 glm-5.2-tp4 deepseek-v4.1-flash-tp4 deepseek-v4.1-flash-tp2}")
read -ra shapes <<<"${shapes[*]}"
mkdir -p "$out/tk"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/.cache/vllm-0.33.0/vllm/third_party
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
quiet() { grep -v "no tuned config\|no measured fused\|RuntimeWarning\|warnings.warn"; }
step() { echo "== $1 [$(date +%T)]"; }
step "diagnose"
timeout 120 python3 scripts/tk_baseline.py --diagnose 2>&1 | quiet | tail -20  # informational: each shape checks its own layer before timing
for s in "${shapes[@]}"; do
  step "tk_baseline $s $routing"
  for layout in hopper strided; do
    timeout "${TK_STEP_S:-100}" python3 scripts/tk_baseline.py --ours --shapes "$s" --routing "$routing" --iters 10 \
        --layout "$layout" --csv "$out/tk/$s-$routing-$layout.csv" 2>&1 | quiet | grep -v "^triton " | tail -16 && break
  done
done
step "done"
