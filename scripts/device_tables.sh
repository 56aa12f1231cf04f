#!/usr/bin/env bash
# One GPU call that remeasures an issue's whole table. Each shape is its own bench process, so each one measures
# its own ceilings and gets its own timeout. The CSVs are merged, and the required-comparison tables and rooflines
# are written, all into $OUT (at most eight files come back from a device call). Needs .cache/vllm-0.33.0 carried
# (python3 scripts/vllm_baseline_src.py).
#   bash scripts/device_tables.sh kernels   # issue 22: bf16 / fp8 beside vLLM, uniform and skewed, T = 1-8192
#   bash scripts/device_tables.sh mxfp4     # issue 19: a16w4 / a8w4, triton_kernels beside our a16w4, both routings
# The same commands, run by hand on an H200 on 2026-12-05, took 7-8 minutes a part (docs/perf/kernels-h200.md).
# `TK=0 ... mxfp4` ran on an H200 on 2026-12-06: nine shapes uniform (fp8, a16w4, a8w4) and skewed (fp8, a8w4) in
# 297 s (docs/perf/mxfp4-h200.md). On an H100 on 2026-12-07 the kernels part took 319 + 233 s over two calls
# (five shapes, then four) and the mxfp4 part 460 s with triton_kernels cut by the deadline after three shapes
# (docs/perf/tables-h100-2026-12-07.md).
# SHAPES (default: the five presets and the four seed shapes), STEP_S (seconds per shape and step, default 60),
# DEADLINE_S (no new shape starts after this many seconds, default 540: a device call ends at 600 s), TK=0 (mxfp4:
# skip triton_kernels). Each shape's rows are merged into $OUT as soon as it ends, so a call cut short still returns
# the shapes it finished; split the shapes over calls with SHAPES and merge the CSVs on the CPU (bench_tables.py).
set -uo pipefail
part=${1:-}
case "$part" in
  kernels|mxfp4) ;;
  *) echo "device_tables.sh: part '$part': allowed are kernels or mxfp4" >&2; exit 2 ;;
esac
out=${OUT:-/tmp/atom_moe_out}
shapes=(${SHAPES:-deepseek-v3 kimi-k2 gpt-oss-120b qwen3-235b-a22b glm-4.5 glm-5.2-tp8 glm-5.2-tp4
        deepseek-v4.1-flash-tp4 deepseek-v4.1-flash-tp2})
step_s=${STEP_S:-60}
deadline_s=${DEADLINE_S:-540}
vllm=.cache/vllm-0.33.0
if [ ! -d "$vllm" ]; then
  echo "device_tables.sh: $vllm missing: run python3 scripts/vllm_baseline_src.py, carry it" >&2
  exit 2
fi
work=$(mktemp -d)
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$work/install.log" 2>&1 \
  || { cat "$work/install.log"; exit 1; }
python3 -c "import torch, triton
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
step() { echo "== $1 [$(date +%T)]"; }
late() {  # true (and says so) once the deadline has passed: the shape is skipped
  [ "$SECONDS" -lt "$deadline_s" ] && return 1
  echo "  $1: skipped, ${SECONDS} s >= DEADLINE_S $deadline_s"
}
# one bench per shape into $work/<tag>/<shape>.csv, merged into $out/<merged> after each; prints the rows each wrote
bench() {
  local tag=$1 merged=$2; shift 2
  mkdir -p "$work/$tag"
  for s in "${shapes[@]}"; do
    late "$tag $s" && continue
    timeout "$step_s" python3 -m atom_moe.tools.cli bench --shapes "$s" --no-baseline --csv "$work/$tag/$s.csv" "$@" \
        >"$work/$tag/$s.log" 2>&1 || echo "  $tag $s: exit $? ($(tail -1 "$work/$tag/$s.log"))"
    echo "  $tag $s: $(grep -c 'us  floor' "$work/$tag/$s.log") rows"
    merge_all "$merged"
  done
}
tk() {  # triton_kernels (the copy vLLM ships) and our a16w4 on the same inputs; the plain layout where Hopper's fails
  local routing=$1
  mkdir -p "$work/tk-$routing"
  for s in "${shapes[@]}"; do
    late "tk $routing $s" && continue
    for layout in hopper strided; do
      PYTHONPATH=$PWD/$vllm/vllm/third_party timeout "$step_s" python3 scripts/tk_baseline.py --ours --shapes "$s" \
          --routing "$routing" --iters 5 --tokens 1 8 32 128 512 2048 8192 --layout "$layout" \
          --csv "$work/tk-$routing/$s.csv" >"$work/tk-$routing/$s.log" 2>&1 && break
      echo "  tk $routing $s: $layout failed ($(tail -1 "$work/tk-$routing/$s.log"))"
    done
    echo "  tk $routing $s: $(grep -c ' us ' "$work/tk-$routing/$s.log") rows"
    merge_all "mxfp4-$routing"
  done
}
# merge every CSV written so far for one output (later rows win for the same shape, scheme, T and impl) into $out
merge_all() {
  local name=${1%.csv} csvs=()
  shopt -s nullglob
  case "$name" in
    kernels-*) csvs=("$work/${name#kernels-}"/*.csv "$work/${name#kernels-}"-8192/*.csv) ;;
    mxfp4-*) csvs=("$work/mx-${name#mxfp4-}"/*.csv "$work/tk-${name#mxfp4-}"/*.csv) ;;
  esac
  shopt -u nullglob
  name=$name.csv
  [ ${#csvs[@]} -eq 0 ] || python3 scripts/bench_tables.py --write-csv "$out/$name" "${csvs[@]}" >/dev/null
}
tables() {  # the fraction tables with the plot, then the required comparisons
  local name=$1; shift
  python3 scripts/bench_tables.py "$@" --plot "$out/$name.png" --ceilings $ceilings >"$out/$name.md"
  python3 scripts/bench_tables.py --ratios "$@" >>"$out/$name.md"
  grep "cells meet it" "$out/$name.md"
}
ceilings=$(python3 -c "
from atom_moe.tools import common
c = common.measure_ceilings(common.Timer(10))
print(round(c['read_tbps'], 2), round(c['bf16_tflops']), round(c['fp8_tflops']))")
echo "ceilings (read TB/s, bf16, fp8 TFLOP/s): $ceilings"
tokens=(--tokens 1 8 32 128 512 2048)
if [ "$part" = kernels ]; then
  for routing in uniform skewed; do
    step "bf16 / fp8 beside vLLM, $routing, T = 1-2048"
    bench "$routing" "kernels-$routing" --routing "$routing" --schemes bf16 fp8 "${tokens[@]}" --iters 10 \
        --vllm-src "$vllm"
    step "bf16 / fp8 beside vLLM, $routing, T = 8192"
    bench "$routing-8192" "kernels-$routing" --routing "$routing" --schemes bf16 fp8 --tokens 8192 --iters 5 \
        --vllm-src "$vllm"
    tables "kernels-$routing" "$out/kernels-$routing.csv"
  done
else
  # our fp8 in the same process as a8w4, for a8w4's required ratio over it
  step "fp8 / a16w4 / a8w4, uniform"
  bench mx-uniform mxfp4-uniform --schemes fp8 a16w4 a8w4 --tokens 1 8 32 128 512 2048 8192 --iters 5
  step "fp8 / a8w4, skewed"
  bench mx-skewed mxfp4-skewed --routing skewed --schemes fp8 a8w4 --tokens 1 8 32 128 512 2048 8192 --iters 5
  if [ "${TK:-1}" != 0 ]; then
    for routing in uniform skewed; do
      step "triton_kernels beside our a16w4, $routing"
      tk "$routing"
    done
  fi
  for routing in uniform skewed; do
    [ -f "$out/mxfp4-$routing.csv" ] && tables "mxfp4-$routing" "$out/mxfp4-$routing.csv"
  done
fi
rm -rf "$work"
step "done"
