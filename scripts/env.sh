# Sourced by scripts/test.sh and scripts/demo.sh: find or build the Python environment.
#
# Default: a virtualenv cached outside the repo, in $ATOM_MOE_CACHE (~/.cache/atom_moe),
# keyed by this file and pyproject.toml's dependency tables, so repeated runs and fresh clones reuse it.
# ATOM_MOE_PYTHON=python3 uses that interpreter as it is (e.g. the GPU machine, which has
# torch and triton but no network): only this checkout is installed into it, offline.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${ATOM_MOE_CACHE:-$HOME/.cache/atom_moe}
torch_req=${ATOM_MOE_TORCH:-torch==2.13.0}
# the interpreter version CI tests against: the GPU machine has triton 3.6 too
triton_req=${ATOM_MOE_TRITON:-triton==3.6.0}

ensure_python() {  # ensure_python EXTRAS -> sets PY
    local extras=$1
    if [ -n "${ATOM_MOE_PYTHON:-}" ]; then
        PY=$ATOM_MOE_PYTHON
        install_editable
        return
    fi
    local key
    # keyed by what is installed (the dependencies, this extra's line and this file), not by the
    # rest of pyproject.toml: a new extra, the package list or pytest settings need no new venv
    key=$( (sed -n "/^dependencies/p; /^$extras = /p" "$repo/pyproject.toml"
            cat "$repo/scripts/env.sh") | sha256sum | cut -c1-12)
    # a triton other than the default gets its own venv beside the default one (CI runs the
    # interpreter tests under each triton the engines install: scripts/test_triton.sh)
    local flavour=$extras
    [ "$triton_req" = "triton==3.6.0" ] || flavour="$extras+${triton_req//=/}"
    local venv="$cache/venv-$(python3 -c 'import sys; print("py%d%d" % sys.version_info[:2])')-$flavour-$key"
    if [ ! -f "$venv/.ready" ]; then
        echo "atom_moe: building $venv (once)" >&2
        rm -rf "$venv"
        # drop envs built from older pyproject/env.sh versions: each is ~2.5 GB
        find "$cache" -maxdepth 1 -name "venv-*-$flavour-*" -type d -exec rm -rf {} + 2>/dev/null || true
        mkdir -p "$cache"
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q --upgrade pip setuptools wheel
        # torch first and pinned: a bare 'torch' requirement would pull a multi-GB CUDA build
        "$venv/bin/pip" install -q "$torch_req" "$triton_req"
        # no build isolation: the venv's own (just upgraded) setuptools builds it, in a temporary
        # folder; an isolated build leaves atom_moe.egg-info in the checkout, where it hides the plugin
        quietly "$venv/bin/pip" install -q --no-build-isolation -e "$repo[$extras]"
        touch "$venv/.ready"
    fi
    PY=$venv/bin/python
    # point the editable install at this checkout (CI clones into a new folder each run); skipped
    # when it already points here and pyproject.toml is unchanged
    local stamp
    stamp="$repo $(sha256sum < "$repo/pyproject.toml" | cut -c1-12)"
    if [ "$(cat "$venv/.editable" 2>/dev/null)" != "$stamp" ]; then
        install_editable
        echo "$stamp" > "$venv/.editable"
    fi
}

install_editable() {  # editable install of this checkout into $PY, offline
    quietly "$PY" -m pip install -q --no-deps --no-build-isolation -e "$repo"
}

quietly() {  # run a command, showing its output only if it fails (setuptools' notes are not for users)
    local log
    log=$(mktemp)
    if ! "$@" >"$log" 2>&1; then
        cat "$log" >&2
        rm -f "$log"
        echo "atom_moe: failed: $* (output above)" >&2
        return 1
    fi
    rm -f "$log"
}
