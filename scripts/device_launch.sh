#!/usr/bin/env bash
# One GPU call for an A/B of how the layer launches and loads: its GPU tests first (bits against the default path,
# in CUDA graphs), then scripts/launch_ab.py shape by shape, each under its own timeout so a slow shape cannot eat
# the rest. Logs and CSVs go to $OUT. Two kinds (AB_KIND):
#   launch (default): pair blocks at T = 1 and programmatic dependent launch (tests/test_pair_blocks.py,
#     tests/test_pdl.py), every scheme at T = 1 and 8, arms sorted / pairs / sorted+pdl / pairs+pdl
#   tma: TMA tile descriptors (tests/test_tma.py), bf16 and fp8 at T = 512, 2048 and 8192, arms sorted / sorted+tma
#   scales: GEMM2's input scales group-major (the workspace's) or row-major (tests/test_kernels_gpu.py), fp8 and
#     a8w4 at T = 512, 2048 and 8192, arms sorted / sorted+rowscales
# A device command may run 10 minutes: the tests (up to 240 s) and three or four shapes fit in one call, six shapes
# without the tests (AB_SKIP_TESTS=1) in the next:
#   bash scripts/device_launch.sh                  # tests; deepseek-v3 gpt-oss-120b glm-5.2-tp8
#   AB_SKIP_TESTS=1 bash scripts/device_launch.sh kimi-k2 qwen3-235b-a22b glm-4.5 glm-5.2-tp4 \
#       deepseek-v4.1-flash-tp4 deepseek-v4.1-flash-tp2
#   AB_KIND=tma bash scripts/device_launch.sh      # tests; deepseek-v3 qwen3-235b-a22b glm-4.5 gpt-oss-120b
#   AB_TOKENS (default "1 8", tma "512 2048 8192"), AB_STEP_S (seconds per shape, default 90, tma 110)
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
kind=${AB_KIND:-launch}
case "$kind" in
  launch) tests="tests/test_pair_blocks.py tests/test_pdl.py"; defaults="deepseek-v3 gpt-oss-120b glm-5.2-tp8"
          ab=(--tokens ${AB_TOKENS:-1 8} --iters 20); step_s=${AB_STEP_S:-90} ;;
  tma) tests="tests/test_tma.py"; defaults="deepseek-v3 qwen3-235b-a22b glm-4.5 gpt-oss-120b"
       ab=(--schemes bf16 fp8 --tokens ${AB_TOKENS:-512 2048 8192} --arms sorted sorted+tma --iters 10)
       step_s=${AB_STEP_S:-110} ;;
  scales) tests="tests/test_kernels_gpu.py"; defaults="deepseek-v3 gpt-oss-120b"
          ab=(--schemes fp8 a8w4 --tokens ${AB_TOKENS:-512 2048 8192} --arms sorted sorted+rowscales --iters 10)
          step_s=${AB_STEP_S:-110} ;;
  *) echo "AB_KIND=$kind: allowed are launch (default), tma or scales" >&2; exit 2 ;;
esac
shapes=("${@:-$defaults}")
read -ra shapes <<<"${shapes[*]}"
mkdir -p "$out/ab"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
quiet() { grep -v "no tuned config\|no measured fused\|RuntimeWarning\|warnings.warn"; }
step() { echo "== $1 [$(date +%T)]"; }
if [ "${AB_SKIP_TESTS:-0}" != 1 ]; then
  step "GPU tests: $tests"
  # shellcheck disable=SC2086
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs -m gpu $tests 2>&1 | tee "$out/gpu-$kind.log" | tail -6
  grep -q " failed" "$out/gpu-$kind.log" && { echo "launch_ab skipped: a GPU test failed"; exit 1; }
fi
for s in "${shapes[@]}"; do
  step "launch_ab $kind $s"
  timeout "$step_s" python3 scripts/launch_ab.py --shapes "$s" "${ab[@]}" --csv "$out/ab/$kind-$s.csv" 2>&1 \
      | quiet | tail -20
done
step "done"
