#!/usr/bin/env bash
# Set up what the tests need (cached) and run the CPU test suite. Extra args go to pytest.
# Kernels run under Triton's interpreter on the CPU; GPU-marked tests skip with a reason.
source "$(dirname "$0")/env.sh"
ensure_python test
cd "$repo"
if [ -z "${ATOM_MOE_PYTHON:-}" ] || ! "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    export TRITON_INTERPRET=1
fi
exec "$PY" -m pytest "$@"
