"""Compile every GEMM variant the tile tables or the heuristic can pick for AMD GPUs, on this
machine, no GPU needed: Triton's HIP target builds an hsaco for gfx942 (MI300X) and gfx950
(MI355X) from the same kernels that run on NVIDIA.

    python scripts/hip_compile.py                 # gfx942 and gfx950, every variant
    python scripts/hip_compile.py --arch gfx950 --schemes a8w4

The variants: every row of kernels/configs/*.csv, and the heuristic's pick for every preset
(and the seed shapes of the bench) at every token bucket, per scheme. On AMD the a8w4 e4m3
decode takes its portable path (kernels/mxfp4.py's PRMT switch is PTX-only: off on a ROCm
torch), so this script turns that switch off for the HIP build, as a ROCm torch would.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import kernel_sass  # noqa: E402  (the kernels' signatures and compile-time switches, shared with the SASS counter)

from atom_moe.kernels import mxfp4, tuning  # noqa: E402
from atom_moe.presets import PRESETS  # noqa: E402

ARCHS = ("gfx942", "gfx950")
SCHEMES = ("bf16", "fp8", "a16w4", "a8w4")
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)


def variants(schemes: tuple[str, ...]) -> set[tuple]:
    """(kernel, scheme, block_m, block_n, block_k, warps, stages) for every config the lookup can return."""
    configs: set[tuple[str, tuning.TileConfig]] = set()
    for path in sorted(tuning.CONFIG_DIR.glob("*.csv")):
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                if row["scheme"] in schemes:
                    configs.add((row["scheme"], tuning.TileConfig(
                        *(int(row[c]) for c in tuning.CONFIG_COLUMNS))))
    for spec in PRESETS.values():
        for scheme in schemes:
            for tokens in TOKENS:
                configs.add((scheme, tuning.heuristic(scheme, spec.hidden_size, spec.intermediate_size,
                                                      spec.num_experts, spec.top_k, tokens)))
    out = set()
    for scheme, c in configs:
        out.add(("gemm1", scheme, c.block_m, c.block_n1, c.block_k1, c.warps1, c.stages1))
        out.add(("gemm2", scheme, c.block_m, c.block_n2, c.block_k2, c.warps2, c.stages2))
    return out


def compile_hip(kernel: str, scheme: str, bm: int, bn: int, bk: int, warps: int, stages: int, arch: str) -> int:
    """Build one variant for `arch`; return the hsaco's size in bytes."""
    fn, sig, div = kernel_sass.signature(kernel, scheme)
    ce = kernel_sass.constexprs(kernel, scheme, bm, bn, bk, 8)
    names = list(sig) + list(ce)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div}
    src = ASTSource(fn, {**sig, **{k: "constexpr" for k in ce}}, constexprs=ce, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("hip", arch, 64), options=dict(num_warps=warps, num_stages=stages))
    hsaco = compiled.asm.get("hsaco", b"")
    if not hsaco:
        raise RuntimeError("no hsaco produced")
    return len(hsaco)


def main(argv: list[str] | None = None) -> int:
    """Compile every variant for every arch; print one line each and a summary; exit 1 on any failure."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    args = p.parse_args(argv)
    mxfp4.PRMT_OK = tl.constexpr(False)  # what a ROCm torch sets: the PTX byte permute does not exist there
    todo = sorted(variants(tuple(args.schemes)))
    failed = 0
    start = time.time()
    for arch in args.arch:
        for v in todo:
            try:
                size = compile_hip(*v, arch)
                print(f"{arch} {' '.join(map(str, v))}: hsaco {size} B", flush=True)
            except Exception as exc:  # report every failing variant, then fail the run
                failed += 1
                print(f"{arch} {' '.join(map(str, v))}: FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    total = len(todo) * len(args.arch)
    print(f"{total - failed} of {total} variants built for {', '.join(args.arch)} in {time.time() - start:.0f} s "
          f"(triton {triton.__version__})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
