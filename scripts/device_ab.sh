#!/usr/bin/env bash
# One GPU call: changed files against their committed versions, in one process per run, order new, old, new
# (`atom-moe bench`), after the GPU tests TESTS selects. Logs and CSVs ($OUT/ab-{new,old,new2}.csv) go to $OUT.
# FILES is one path or several joined by commas (a layout and its decoder change together).
# Before the call, on this machine: mkdir -p .cache/old && for f in FILES: git show HEAD:$f > .cache/old/$(basename $f),
# then carry .cache/old.
# Usage: TESTS="-k 'mxfp4 or a16w4'" bash scripts/device_ab.sh FILES BENCH_ARGS...
#   e.g. bash scripts/device_ab.sh kernels/mxfp4.py,atom_moe/layouts/mx_tiles.py --shapes deepseek-v3 --schemes a16w4 \
#        --tokens 1 8 128 --iters 10
# Or a switch instead of files: "new" runs with the variable set, "old" without (no .cache/old needed):
#   bash scripts/device_ab.sh --env ATOM_MOE_A8W4_INTER=token --shapes deepseek-v3 --schemes a8w4 --tokens 512 8192
set -uo pipefail
ab_env=
if [ "${1:-}" = --env ]; then
  ab_env=$2; shift 2; files=()
else
  IFS=, read -r -a files <<<"$1"; shift
fi
for f in "${files[@]}"; do
  [ -f ".cache/old/$(basename "$f")" ] || { echo "device_ab: .cache/old/$(basename "$f") is missing: git show HEAD:$f > it, and carry .cache/old"; exit 2; }
done
out=${OUT:-/tmp/atom_moe_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
quiet() { grep -v "no tuned config\|no measured fused\|RuntimeWarning\|warnings.warn"; }
step() { echo "== $1 [$(date +%T)]"; }
if [ -n "${TESTS:-}" ]; then
  step "GPU tests: $TESTS"
  eval "timeout 200 python3 -m pytest -q -p no:cacheprovider -rs $TESTS" 2>&1 | tail -4
fi
new=$(mktemp -d)
for f in "${files[@]}"; do cp "$f" "$new/$(basename "$f")"; done
for v in new old new2; do
  step "bench $v"
  src=$new; [ "$v" = old ] && src=.cache/old
  for f in "${files[@]}"; do cp "$src/$(basename "$f")" "$f"; done
  switch=(); [ -n "$ab_env" ] && [ "$v" != old ] && switch=("$ab_env")
  env "${switch[@]}" timeout "${AB_STEP_S:-150}" python3 -m atom_moe.tools.cli bench --no-baseline "$@" \
      --csv "$out/ab-$v.csv" 2>&1 | quiet | grep " T=" | cut -c1-120
done
for f in "${files[@]}"; do cp "$new/$(basename "$f")" "$f"; done
step "done"
