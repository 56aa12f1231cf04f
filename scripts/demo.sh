#!/usr/bin/env bash
# Set up what the demo needs (cached) and run `atom-moe demo`. Extra args go to the demo.
source "$(dirname "$0")/env.sh"
ensure_python demo  # torch, triton, tqdm: not the test extra's lm-eval, pandas, mpich
exec "$PY" -m atom_moe.tools.cli demo "$@"
