#!/usr/bin/env bash
# One GPU call: Nsight Compute over the fused experts layer's kernels (scripts/ncu_layer.py), then
# a one-row-per-launch summary (scripts/ncu_summary.py). Clocks left as found (--clock-control none).
# Usage: bash scripts/ncu_profile.sh SHAPE "SCHEMES" "TOKENS" [uniform|skewed]   (outputs in $OUT)
#        bash scripts/ncu_profile.sh --tk SHAPE "TOKENS" [uniform|skewed]
#        bash scripts/ncu_profile.sh --source SHAPE "SCHEMES" "TOKENS" [uniform|skewed]
#        bash scripts/ncu_profile.sh --vllm SHAPE "bf16 fp8" "TOKENS" [uniform|skewed]
# --vllm also profiles vLLM 0.33's fused_moe (default config, and its tuned table where vLLM ships one for the
# device) on the same inputs after ours, cases "<shape>/<scheme>/T<n>/vllm[-tuned]" (needs .cache/vllm-0.33.0).
# --tk profiles triton_kernels' a16w4 layer and ours on the same inputs (scripts/tk_baseline.py --profile;
# needs .cache/vllm-0.33.0 carried) and archives triton_kernels' compiled matmul kernels (cubin, ptx, ttgir)
# in $OUT/tk-kernels.tgz for SASS reading on a CPU.
# --source profiles the GEMM launches alone with ncu's per-instruction counters (SourceCounters: executed
# instructions, L1 wavefronts and sectors, warp stalls per SASS line) and exports them as CSV
# ($OUT/ncu-<tag>-source.csv): which loads fill the LSU pipe (docs/perf/mxfp4-h200.md, 2026-12-06). Not run yet.
set -uo pipefail
out=${OUT:-/tmp/atom_moe_out}
mkdir -p "$out"
tk=0 source=0 peer=()
[ "${1:-}" = "--tk" ] && { tk=1; shift; }
[ "${1:-}" = "--source" ] && { source=1; shift; }
[ "${1:-}" = "--vllm" ] && { peer=(--vllm-src "$PWD/.cache/vllm-0.33.0"); shift; }
shape=${1:-deepseek-v3}
if [ $tk = 1 ]; then
  tokens=${2:-"8 128"}; routing=${3:-uniform}; tag="$shape-tk"
  export PYTHONPATH=$PWD/.cache/vllm-0.33.0/vllm/third_party TRITON_CACHE_DIR=$out/triton-cache
  cmd=(python3 scripts/tk_baseline.py --profile --ours --shapes "$shape" --tokens $tokens --routing "$routing"
       --ceilings 4.54 795 1472)
else
  schemes=${2:-"a16w4 a8w4"}; tokens=${3:-"1 128 2048"}; routing=${4:-uniform}; tag="$shape-${schemes// /_}"
  [ ${#peer[@]} -gt 0 ] && tag="$tag-vllm"
  cmd=(python3 scripts/ncu_layer.py --shape "$shape" --scheme $schemes --tokens $tokens --routing "$routing"
       "${peer[@]}")
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { tail -5 "$out/install.log"; exit 1; }
ncu --version | tail -1
if [ $source = 1 ]; then
  timeout "${NCU_TIMEOUT_S:-420}" ncu --profile-from-start off --clock-control none --nvtx --kernel-name regex:gemm \
      --section SourceCounters --section LaunchStats -f -o "$out/ncu-$tag-source" "${cmd[@]}" 2>&1 |
    grep -v "^==PROF==" | tail -15
  ncu --import "$out/ncu-$tag-source.ncu-rep" --page source --csv --print-source sass > "$out/ncu-$tag-source.csv"
  rm -f "$out/ncu-$tag-source.ncu-rep"  # the CSV is what comes back (a device call returns at most 16 MiB a file)
  wc -l "$out/ncu-$tag-source.csv"
  exit 0
fi
# the sections behind the summary's columns (a full set replays each kernel ~40 times: minutes)
timeout "${NCU_TIMEOUT_S:-420}" ncu --profile-from-start off --clock-control none --nvtx \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
    --section WarpStateStats --section InstructionStats \
    --metrics dram__bytes_read.sum,l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum,l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum,lts__t_sectors_srcunit_tex_op_read.sum,lts__t_requests_srcunit_tex_op_read.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum,l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum,smsp__inst_executed.sum \
    -f -o "$out/ncu-$tag" "${cmd[@]}" 2>&1 | grep -v "^==PROF==" | tail -15
ncu --import "$out/ncu-$tag.ncu-rep" --csv --page raw --print-units base > "$out/ncu-$tag-raw.csv"
python3 scripts/ncu_summary.py "$out/ncu-$tag-raw.csv" --csv "$out/ncu-$tag.csv"
if [ $tk = 1 ]; then  # one archive: the device call returns a limited number of files
  kdir=$(mktemp -d)
  # one cache directory per specialisation: its hash prefixes the copies so none overwrites another
  find "$out/triton-cache" -name '_matmul_ogs*' \( -name '*.cubin' -o -name '*.ptx' -o -name '*.ttgir' -o -name '*.json' \) |
    while read -r f; do cp "$f" "$kdir/$(basename "$(dirname "$f")" | cut -c1-8)-$(basename "$f")"; done
  rm -rf "$out/triton-cache"
  tar czf "$out/tk-kernels.tgz" -C "$kdir" . && tar tzf "$out/tk-kernels.tgz"
fi
