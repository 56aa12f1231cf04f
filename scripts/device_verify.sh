#!/usr/bin/env bash
# One GPU call: install this checkout into the machine's Python (torch/triton preinstalled, no
# network), then run what is named: `tests` (every gpu-marked test plus the given files in full)
# or `transformers` (tests/test_transformers_gpu.py, one process per case) or `demo` (the demo cold, with an empty Triton cache, then warm; and a short bench)
# or `all` (one call: the gpu-marked tests on 4 pytest workers beside the two transformers cases, then,
# alone on the GPU, the EPLB and decode/prefill measurements (with per-kernel times in ep-instances.log) and a vLLM-baseline bench when
# .cache/vllm-0.33.0 came along).
# Logs go to $OUT. Usage: bash scripts/device_verify.sh tests [FILES...] | transformers | demo | all
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
    timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -rs tests/ --ignore=tests/test_transformers_gpu.py \
        2>&1 | tee "$out/gpu.log" | tail -6
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
all)
    # functional checks in parallel (compiles are CPU-bound; 16 cores there), timings afterwards alone
    echo "== gpu-marked tests (4 workers) and the transformers cases [$(date +%T)]"
    for model in qwen3_moe deepseek_v3; do
        timeout 420 python3 -m pytest -q -s -p no:cacheprovider tests/test_transformers_gpu.py \
            -k "our_experts and $model" >"$out/tf-$model.log" 2>&1 &
    done
    timeout 400 python3 -m pytest -q -p no:cacheprovider -m gpu -rs -n 4 tests/ \
        --ignore=tests/test_transformers_gpu.py >"$out/gpu.log" 2>&1
    echo "gpu tests exit $?"; grep -E "passed|failed|SKIPPED|FAILED|ERROR" "$out/gpu.log" | tail -12
    wait
    for model in qwen3_moe deepseek_v3; do
        echo "-- transformers $model"; grep -E "noise|bound|of [0-9]|passed|failed|Error" "$out/tf-$model.log" | tail -12
    done
    echo "== EPLB measurement [$(date +%T)]"
    timeout 100 python3 scripts/eplb_bench.py --csv "$out/eplb-h200.csv" 2>&1 | tail -8
    echo "== decode/prefill instances [$(date +%T)]"
    timeout 150 python3 scripts/ep_instances_bench.py --kernels --out "$out/ep-instances-h200.csv" \
        >"$out/ep-instances.log" 2>&1
    grep -v "^ \|^kernels" "$out/ep-instances.log" | tail -12
    if [ -d .cache/vllm-0.33.0 ]; then
        echo "== vLLM baseline bench [$(date +%T)]"
        timeout 120 python3 -m atom_moe.tools.cli bench --shapes deepseek-v3 --schemes bf16 fp8 --tokens 1 128 \
            --iters 10 --vllm-src .cache/vllm-0.33.0 --csv "$out/bench-vllm-h200.csv" 2>&1 \
            | grep -v "no tuned\|warn" | tail -16
    fi ;;
esac
echo "== done [$(date +%T)]"
