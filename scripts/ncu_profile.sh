#!/usr/bin/env bash
# One GPU call: Nsight Compute over the fused experts layer's kernels (scripts/ncu_layer.py), then
# a one-row-per-launch summary (scripts/ncu_summary.py). Clocks left as found (--clock-control none).
# Usage: bash scripts/ncu_profile.sh SHAPE "SCHEMES" "TOKENS" [uniform|skewed]   (outputs in $OUT)
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
mkdir -p "$out"
shape=${1:-deepseek-v3}; schemes=${2:-"a16w4 a8w4"}; tokens=${3:-"1 128 2048"}; routing=${4:-uniform}
tag="$shape-${schemes// /_}"
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { tail -5 "$out/install.log"; exit 1; }
ncu --version | tail -1
# the sections behind the summary's columns (a full set replays each kernel ~40 times: minutes)
timeout 420 ncu --profile-from-start off --clock-control none --nvtx \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section InstructionStats \
    --metrics dram__bytes_read.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum,smsp__inst_executed.sum \
    -f -o "$out/ncu-$tag" python3 scripts/ncu_layer.py --shape "$shape" --scheme $schemes --tokens $tokens \
    --routing "$routing" 2>&1 | grep -v "^==PROF==" | tail -15
ncu --import "$out/ncu-$tag.ncu-rep" --csv --page raw --print-units base > "$out/ncu-$tag-raw.csv"
python3 scripts/ncu_summary.py "$out/ncu-$tag-raw.csv" --csv "$out/ncu-$tag.csv"
