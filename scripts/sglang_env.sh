#!/usr/bin/env bash
# Build (once) and print the Python of the SGLang test environment (CPU only).
#
#   scripts/sglang_env.sh [0.5.23]   ->  prints .../sglang-0.5.23/bin/python on stdout
#
# SGLang pins torch 2.14.1 (CUDA) and ~70 packages, over 10 GB with its kernels. The tests
# only need SGLang's Python (plugin loader, FusedMoE, quant methods, weight loaders,
# parallel state), so this builds the minimal set: the local CPU torch 2.13.0, triton,
# the light packages `import sglang.srt...` needs, then `sglang --no-deps`, plus a stub
# torchvision (PyPI's does not load beside the CPU torch; SGLang only imports it).
# Lives in ${ATOM_MOE_CACHE:-~/.cache/atom_moe}/sglang-<version>, reused across runs and
# clones; a half-built one has no .ready marker and is rebuilt. Progress to stderr.
set -euo pipefail
version=${1:-0.5.23}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${ATOM_MOE_CACHE:-$HOME/.cache/atom_moe}
env_dir="$cache/sglang-$version"
recipe="recipe-1"  # bump when the build steps below change: forces a rebuild

# What `import sglang.srt.{plugins,server_args,layers.moe...,distributed}` needs on the CPU.
light=(
    "numpy<2.4" "triton==3.6.0" aiohttp "apache-tvm-ffi==0.1.11" "transformers==5.19.0"
    "compressed-tensors==0.18.0" gguf "openai==2.8.0" einops msgspec fastapi uvicorn uvloop
    setproctitle orjson pybase64 pyzmq psutil requests pydantic packaging tqdm pillow regex
    partial_json_parser python-multipart prometheus-client sentencepiece interegular xxhash
    ipython dill pytest pytest-timeout
)

build() {
    local start pip site
    start=$(date +%s)
    echo "sglang_env: building $env_dir (sglang==$version, CPU torch 2.13.0); minutes, once" >&2
    rm -rf "$env_dir"
    mkdir -p "$cache"
    python3 -m venv "$env_dir"
    pip="$env_dir/bin/pip"
    "$pip" install -q --upgrade pip setuptools wheel >&2
    # torch first, then everything else constrained to it (no resolver may swap it for CUDA 2.14)
    "$pip" install -q "torch==2.13.0" >&2
    echo "torch==2.13.0" > "$env_dir/constraints.txt"
    "$pip" install -q -c "$env_dir/constraints.txt" "${light[@]}" >&2
    "$pip" install -q --no-deps "sglang==$version" >&2
    site=$("$env_dir/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # Stub torchvision: SGLang imports it at module level (configs, multimodal utils) but the
    # MoE path never calls it. A package, so `import torchvision.transforms` etc. resolve too.
    mkdir -p "$site/torchvision"
    cat > "$site/torchvision/__init__.py" <<'EOF'
"""Import-only stand-in for torchvision (atom_moe's SGLang test env; see scripts/sglang_env.sh)."""
import importlib.abc, importlib.machinery, sys, types

__version__ = "0.0.0+stub"


class _Any(types.ModuleType):
    """A module whose every attribute is another stub (classes and functions are never called)."""

    __path__ = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        full = f"{self.__name__}.{name}"
        mod = sys.modules.get(full) or _Any(full)
        sys.modules[full] = mod
        return mod

    def __call__(self, *a, **k):
        raise RuntimeError(f"{self.__name__} is a torchvision stub (atom_moe SGLang test env)")

    def __mro_entries__(self, bases):
        return (object,)


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return _Any(spec.name)

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Finder())
_self = sys.modules[__name__]
_self.__class__ = _Any
EOF
    "$env_dir/bin/python" -c "import sglang.srt.plugins, sglang.srt.server_args, \
sglang.srt.layers.moe.fused_moe_triton.layer, sglang.srt.layers.moe.ep_moe.layer, \
sglang.srt.layers.quantization.fp8, sglang.srt.layers.quantization.mxfp4, \
sglang.srt.layers.quantization.unquant" >&2
    echo "$recipe $(date -u +%FT%TZ) build_s=$(( $(date +%s) - start ))" > "$env_dir/.ready"
    echo "sglang_env: built in $(( $(date +%s) - start ))s, $(du -sh "$env_dir" | cut -f1)" >&2
}

if [ ! -f "$env_dir/.ready" ] || ! grep -q "^$recipe " "$env_dir/.ready"; then
    mkdir -p "$cache"
    exec 9>"$cache/.sglang-$version.lock"  # one builder at a time (parallel jobs)
    flock 9
    if [ ! -f "$env_dir/.ready" ] || ! grep -q "^$recipe " "$env_dir/.ready"; then
        build
    fi
fi
# re-point the editable install (and its sglang.srt.plugins entry point) at this checkout
"$env_dir/bin/pip" install -q --no-deps --no-build-isolation -e "$repo" >&2
echo "$env_dir/bin/python"
