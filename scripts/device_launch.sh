#!/usr/bin/env bash
# One GPU call for the launch-chaining changes (pair blocks at T = 1, programmatic dependent launch): their GPU
# tests first (bits against the sorted path / plain stream order, in CUDA graphs), then scripts/launch_ab.py
# shape by shape, each under its own timeout so a slow shape cannot eat the rest. Logs and CSVs go to $OUT.
# Usage: bash scripts/device_launch.sh [SHAPE...]   (default: the five presets and the four served shapes)
#   AB_TOKENS (default "1 8"), AB_STEP_S (seconds per shape, default 90)
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
shapes=("${@:-gpt-oss-120b deepseek-v3 kimi-k2 qwen3-235b-a22b glm-4.5 glm-5.2-tp8 glm-5.2-tp4 deepseek-v4.1-flash-tp4 deepseek-v4.1-flash-tp2}")
read -ra shapes <<<"${shapes[*]}"
mkdir -p "$out/ab"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
quiet() { grep -v "no tuned config\|no measured fused\|RuntimeWarning\|warnings.warn"; }
step() { echo "== $1 [$(date +%T)]"; }
step "GPU tests: pair blocks, PDL"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_pair_blocks.py tests/test_pdl.py 2>&1 \
    | tee "$out/gpu-launch.log" | tail -6
grep -q " failed" "$out/gpu-launch.log" && { echo "launch_ab skipped: a GPU test failed"; exit 1; }
for s in "${shapes[@]}"; do
  step "launch_ab $s"
  # shellcheck disable=SC2086
  timeout "${AB_STEP_S:-90}" python3 scripts/launch_ab.py --shapes "$s" --tokens ${AB_TOKENS:-1 8} --iters 20 \
      --csv "$out/ab/$s.csv" 2>&1 | quiet | tail -20
done
step "done"
