#!/usr/bin/env bash
# One GPU call that remeasures an issue's whole table. Each shape is its own bench process, so each one measures
# its own ceilings and gets its own timeout. The CSVs are merged, and the required-comparison tables and rooflines
# are written, all into $OUT (at most eight files come back from a device call). Needs .cache/vllm-0.33.0 carried
# (python3 scripts/vllm_baseline_src.py).
#   bash scripts/device_tables.sh kernels   # issue 22: bf16 / fp8 beside vLLM, uniform and skewed, T = 1-8192
#   bash scripts/device_tables.sh mxfp4     # issue 19: a16w4 / a8w4, triton_kernels beside our a16w4, both routings
# The same commands, run by hand on an H200 on 2026-12-05, took 7-8 minutes a part (docs/perf/kernels-h200.md,
# mxfp4-h200.md); this script itself has not run on a GPU yet.
# SHAPES (default: the five presets and the four seed shapes) and STEP_S (seconds per shape and step, default 60).
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
# one bench per shape into $work/<tag>/<shape>.csv; prints how many rows each wrote
bench() {
  local tag=$1; shift
  mkdir -p "$work/$tag"
  for s in "${shapes[@]}"; do
    timeout "$step_s" python3 -m atom_moe.tools.cli bench --shapes "$s" --no-baseline --csv "$work/$tag/$s.csv" "$@" \
        >"$work/$tag/$s.log" 2>&1 || echo "  $tag $s: exit $? ($(tail -1 "$work/$tag/$s.log"))"
    echo "  $tag $s: $(grep -c 'us  floor' "$work/$tag/$s.log") rows"
  done
}
tk() {  # triton_kernels (the copy vLLM ships) and our a16w4 on the same inputs; the plain layout where Hopper's fails
  local routing=$1
  mkdir -p "$work/tk-$routing"
  for s in "${shapes[@]}"; do
    for layout in hopper strided; do
      PYTHONPATH=$PWD/$vllm/vllm/third_party timeout "$step_s" python3 scripts/tk_baseline.py --ours --shapes "$s" \
          --routing "$routing" --iters 5 --tokens 1 8 32 128 512 2048 8192 --layout "$layout" \
          --csv "$work/tk-$routing/$s.csv" >"$work/tk-$routing/$s.log" 2>&1 && break
      echo "  tk $routing $s: $layout failed ($(tail -1 "$work/tk-$routing/$s.log"))"
    done
    echo "  tk $routing $s: $(grep -c ' us ' "$work/tk-$routing/$s.log") rows"
  done
}
merge() {  # merge CSVs (later rows win for the same shape, scheme, T and impl) into $out/$1
  local name=$1; shift
  python3 scripts/bench_tables.py --write-csv "$out/$name" "$@" >/dev/null
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
    bench "$routing" --routing "$routing" --schemes bf16 fp8 "${tokens[@]}" --iters 10 --vllm-src "$vllm"
    step "bf16 / fp8 beside vLLM, $routing, T = 8192"
    bench "$routing-8192" --routing "$routing" --schemes bf16 fp8 --tokens 8192 --iters 5 --vllm-src "$vllm"
    merge "kernels-$routing.csv" "$work/$routing"/*.csv "$work/$routing-8192"/*.csv
    tables "kernels-$routing" "$out/kernels-$routing.csv"
  done
else
  step "a16w4 / a8w4, uniform"
  bench mx-uniform --schemes a16w4 a8w4 --tokens 1 8 32 128 512 2048 8192 --iters 5
  step "a8w4, skewed"
  bench mx-skewed --routing skewed --schemes a8w4 --tokens 1 8 32 128 512 2048 8192 --iters 5
  for routing in uniform skewed; do
    step "triton_kernels beside our a16w4, $routing"
    tk "$routing"
  done
  merge mxfp4-uniform.csv "$work/mx-uniform"/*.csv "$work/tk-uniform"/*.csv
  merge mxfp4-skewed.csv "$work/mx-skewed"/*.csv "$work/tk-skewed"/*.csv
  # a8w4 against our fp8 needs the kernels part's rows: bench_tables.py --ratios over both parts' CSVs, on the CPU
  for routing in uniform skewed; do
    tables "mxfp4-$routing" "$out/mxfp4-$routing.csv"
  done
fi
rm -rf "$work"
step "done"
