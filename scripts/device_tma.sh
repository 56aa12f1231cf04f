#!/usr/bin/env bash
# One GPU call for the MXFP4 GEMM2 rows through TMA (ATOM_MOE_TMA=1, kernels/gemm2.py): the GPU tests, then
# scripts/launch_ab.py's `sorted` against `sorted+tma` (same process, same weights, bit-equal outputs checked before
# timing) for a16w4 and a8w4, then (PROFILE=1) Nsight Compute's summary of DeepSeek-V3's a8w4 GEMMs at T = 2048 and
# 8192 with and without TMA (the LSU pipe share that 2026-12-06's profile found fullest), then (SOURCE=1) ncu's
# per-SASS-line counters of DeepSeek-V3's a8w4 GEMMs at SOURCE_T (default 1 128 512) with per-thread rows. Logs and
# CSVs go to $OUT.
#   bash scripts/device_tma.sh                        # GPU suite, A/B on four shapes, T = 512 2048 8192
#   TESTS=tests/test_tma.py SHAPES="deepseek-v3" PROFILE=1 bash scripts/device_tma.sh
# SHAPES, TOKENS ("none" skips the A/B), TESTS (pytest paths; "none" skips the tests), AB_S / TEST_S / NCU_S (step
# timeouts in seconds).
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
shapes=(${SHAPES:-deepseek-v3 kimi-k2 gpt-oss-120b glm-5.2-tp4})
tokens=(${TOKENS:-512 2048 8192})
tests=${TESTS:-tests/}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 ||
  { cat "$out/install.log"; exit 1; }
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
step() { echo "== $1 [$(date +%T)]"; }
if [ "$tests" != none ]; then
  step "GPU tests: $tests"
  # -v logs each test as it ends, so a timeout still shows which ran
  timeout "${TEST_S:-240}" python3 -m pytest -v -p no:cacheprovider -m gpu -rs -n 8 $tests >"$out/gpu.log" 2>&1
  grep "FAILED\|ERROR\|passed\|failed" "$out/gpu.log" | grep -v "^\[gw.\] PASSED" | tail -12
fi
if [ "${tokens[*]}" != none ]; then
  step "launch_ab: sorted vs sorted+tma"
  timeout "${AB_S:-300}" python3 scripts/launch_ab.py --shapes "${shapes[@]}" --schemes a16w4 a8w4 \
      --tokens "${tokens[@]}" --arms sorted sorted+tma --rounds 3 --iters 10 --csv "$out/tma-ab.csv" 2>&1 |
    grep -v "no tuned config\|RuntimeWarning\|warnings.warn" | sed 's/ routing=uniform//; s/ read_tbps=[0-9.]*//'
fi
if [ "${PROFILE:-0}" = 1 ]; then
  for flag in 0 1; do
    step "ncu a8w4 ATOM_MOE_TMA=$flag"
    ATOM_MOE_TMA=$flag NCU_TIMEOUT_S=${NCU_S:-150} OUT=$out/ncu$flag \
      bash scripts/ncu_profile.sh deepseek-v3 a8w4 "2048 8192"
    cp "$out/ncu$flag/ncu-deepseek-v3-a8w4.csv" "$out/ncu-tma$flag.csv" && rm -rf "$out/ncu$flag"
  done
fi
if [ "${SOURCE:-0}" = 1 ]; then
  step "ncu source counters, a8w4 T = ${SOURCE_T:-1 128 512}"
  NCU_TIMEOUT_S=${NCU_S:-150} bash scripts/ncu_profile.sh --source deepseek-v3 a8w4 "${SOURCE_T:-1 128 512}"
fi
step "done"
