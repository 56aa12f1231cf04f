#!/usr/bin/env bash
# Tune the served presets (atom_moe/presets.py SERVED) on one GPU, resuming a table, within a time budget:
# first each preset's own scheme (GLM-5.2 a16w4, DeepSeek-V4.1-Flash a8w4), then the other MXFP4 scheme
# (a8w4 for GLM-5.2 under ATOM_MOE_MXFP4_ACT=fp8, a16w4 for V4.1), every default token bucket.
# `atom-moe tune` appends each finished key, so a call stopped by the budget loses only the key it was on;
# run it again with the same table to go on. The table and the logs are copied to $OUT after each preset.
# Usage: bash scripts/tune_served.sh [TABLE] [SECONDS]   (default .cache/served/tuned-served.csv, 540 s)
# SCHEMES="fp8 bf16" tunes those schemes instead of the MXFP4 passes; TOKENS="512 2048" limits the buckets;
# MODELS="kimi-k2 glm-4.5" tunes those presets instead of the served ones (with SCHEMES, e.g. SCHEMES=a16w4).
# SPACE=split|ahead|full sweeps that candidate space (docs/tune.md; default tied). Every candidate's time goes to
# $OUT/tune-trials.csv too.
set -uo pipefail
table=${1:-.cache/served/tuned-served.csv}
budget=${2:-540}
out=${OUT:-/tmp/atom_moe_out}
mkdir -p "$out" "$(dirname "$table")"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
end=$((SECONDS + budget))
tokens=()
[ -n "${TOKENS:-}" ] && read -ra tokens <<<"--tokens $TOKENS"
space=()
[ -n "${SPACE:-}" ] && space=(--space "$SPACE")
for pass in ${SCHEMES:-own other}; do
  for model in ${MODELS:-glm-5.2-tp8 glm-5.2-tp4 deepseek-v4.1-flash-tp4 deepseek-v4.1-flash-tp2}; do
    case "$model/$pass" in
      glm*/own|deepseek*/other) scheme=a16w4 ;;
      */own|*/other) scheme=a8w4 ;;
      *) scheme=$pass ;;
    esac
    left=$((end - SECONDS))
    if [ "$left" -lt 30 ]; then echo "== budget spent before $model $scheme: run again with $table"; break 2; fi
    echo "== $model $scheme [$(date +%T), ${left} s left]"
    timeout "$left" python3 -m atom_moe.tools.cli tune "$model" --scheme "$scheme" "${tokens[@]}" "${space[@]}" --iters 10 \
      --out "$table" --trials "$out/tune-trials.csv" 2>&1 \
      | grep -v "no tuned config" | tee -a "$out/tune-served.log" | tail -12
    cp "$table" "$out/tuned-served.csv"
  done
done
echo "== done [$(date +%T)]: $(($(wc -l <"$table") - 1)) rows in $table (copied to \$OUT/tuned-served.csv)"
