#!/usr/bin/env bash
# One call on the GPU machine (torch and triton preinstalled, no network): versions, the
# CPU test subset on that machine's Python, the GPU tests, and the demo on the GPU.
# Logs go to $OUT (the device tool brings them back). Extra args: pytest -k filter.
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
filter=()
[ $# -gt 0 ] && filter=(-k "$*")
echo "== CPU subset (interpreter) on this machine's Python"
TRITON_INTERPRET=1 python3 -m pytest -q -p no:cacheprovider -m "not gpu" "${filter[@]}" 2>&1 | tee "$out/cpu_subset.log" | tail -6
echo "== GPU tests"
python3 -m pytest -q -p no:cacheprovider -m gpu -rs "${filter[@]}" 2>&1 | tee "$out/gpu.log" | tail -25
echo "== demo"
python3 -m atom_moe.cli demo --device cuda 2>&1 | tee "$out/demo.log"
python3 -m atom_moe.cli demo --device cuda --model gpt-oss-120b --ep 2 --tokens 128 2>&1 | tee -a "$out/demo.log"
