#!/usr/bin/env bash
# One call on the GPU machine (torch and triton preinstalled, no network): versions, the
# CPU test subset on that machine's Python, the GPU tests, and the demo on the GPU.
# Logs go to $OUT (the device tool brings them back). Extra args: the test files of the CPU
# subset (default: all of tests/).
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
echo "== CPU subset (interpreter) on this machine's Python: ${*:-tests/}"
TRITON_INTERPRET=1 timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not gpu" "${@:-tests/}" 2>&1 | tee "$out/cpu_subset.log" | tail -6
echo "== GPU tests"
# four workers: the suite took 269 s on an H100 this way (2026-12-06)
timeout 330 python3 -m pytest -v -p no:cacheprovider -m gpu -rs -n 4 --timeout 240 tests/ >"$out/gpu.log" 2>&1
grep "FAILED\|ERROR\|passed\|failed" "$out/gpu.log" | grep -v "^\[gw.\] PASSED" | tail -30
echo "== demo"
python3 -m atom_moe.tools.cli demo --device cuda 2>&1 | tee "$out/demo.log"
python3 -m atom_moe.tools.cli demo --device cuda --model gpt-oss-120b --ep 2 --tokens 128 2>&1 | tee -a "$out/demo.log"
