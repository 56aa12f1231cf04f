#!/usr/bin/env bash
# One GPU call: install this checkout into the machine's Python (torch/triton preinstalled, no
# network), then run what is named: `tests` (every gpu-marked test plus the given files in full)
# or `transformers` (tests/test_transformers_gpu.py, one process per case) or `demo` (the demo cold, with an empty Triton cache, then warm; and a short bench).
# Logs go to $OUT. Usage: bash scripts/device_verify.sh tests [FILES...] | transformers | demo
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import sys, setuptools, torch, triton; print('python', sys.version.split()[0], 'setuptools', setuptools.__version__, 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { tail -5 "$out/install.log"; exit 1; }
case "${1:-tests}" in
tests)
    shift || true
    echo "== gpu-marked tests [$(date +%T)]"
    timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/ 2>&1 | tee "$out/gpu.log" | tail -6
    if [ $# -gt 0 ]; then
        echo "== $* in full on the GPU [$(date +%T)]"
        timeout 220 python3 -m pytest -q -p no:cacheprovider -rs "$@" 2>&1 | tee "$out/files.log" | tail -6
    fi ;;
transformers)
    # each case in its own process, so a crash (a segfault in a compiler) cannot hide the others;
    # the own-experts control runs only for a model whose case with our experts failed
    for model in qwen3_moe deepseek_v3; do
        echo "== transformers $model, our experts [$(date +%T)]"
        if ! timeout 270 python3 -m pytest -q -s -p no:cacheprovider tests/test_transformers_gpu.py \
                -k "our_experts and $model" >"$out/tf-$model.log" 2>&1; then
            tail -25 "$out/tf-$model.log"
            echo "== transformers $model, own experts control [$(date +%T)]"
            ATOM_MOE_GPU_CONTROL=1 timeout 80 python3 -m pytest -q -s -p no:cacheprovider tests/test_transformers_gpu.py \
                -k "control and $model" >"$out/tf-$model-control.log" 2>&1
            echo "control exit $?"; tail -12 "$out/tf-$model-control.log"
        else
            grep -E "measured bound|worst|passed|failed" "$out/tf-$model.log" | tail -8
        fi
    done ;;
demo)
    export TRITON_CACHE_DIR=$(mktemp -d)
    for run in cold warm; do
        echo "== demo, $run [$(date +%T)]"
        start=$(date +%s)
        ATOM_MOE_PYTHON=python3 timeout 240 ./scripts/demo.sh 2>"$out/demo-$run.err" | tee "$out/demo-$run.log" | tail -14
        echo "demo $run: $(( $(date +%s) - start )) s wall"
    done
    echo "== bench [$(date +%T)]"
    timeout 150 python3 -m atom_moe.tools.cli bench --shapes deepseek-v3 --schemes bf16 fp8 a16w4 a8w4 --tokens 1 128 \
        --iters 20 --no-baseline --csv "$out/bench.csv" 2>&1 | grep -v "no tuned\|warn" | tail -9 ;;
esac
echo "== done [$(date +%T)]"
