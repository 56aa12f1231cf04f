#!/usr/bin/env bash
# One GPU call: a changed kernel file against its committed version, in one process order new, old, new
# (`atom-moe bench`), after the GPU tests TESTS selects. Logs and CSVs ($OUT/ab-{new,old,new2}.csv) go to $OUT.
# Before the call, on this machine: mkdir -p .cache/old && git show HEAD:FILE > .cache/old/$(basename FILE),
# then carry .cache/old.
# Usage: TESTS="-k 'mxfp4 or a16w4'" bash scripts/device_ab.sh FILE BENCH_ARGS...
#   e.g. bash scripts/device_ab.sh kernels/mxfp4.py --shapes deepseek-v3 --schemes a16w4 --tokens 1 8 128 --iters 10
set -uo pipefail
file=$1; shift
old=.cache/old/$(basename "$file")
[ -f "$old" ] || { echo "device_ab: $old is missing: git show HEAD:$file > $old, and carry .cache/old"; exit 2; }
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
new=$(mktemp)
cp "$file" "$new"
for v in new old new2; do
  step "bench $v"
  if [ "$v" = old ]; then cp "$old" "$file"; else cp "$new" "$file"; fi
  timeout 150 python3 -m atom_moe.tools.cli bench --no-baseline "$@" --csv "$out/ab-$v.csv" 2>&1 | quiet | grep " T=" | cut -c1-120
done
cp "$new" "$file"
step "done"
