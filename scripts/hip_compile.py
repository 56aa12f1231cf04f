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
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
import compile_all  # noqa: E402  (the variants the tables and the heuristic can pick; the build report)
import kernel_sass  # noqa: E402  (the kernels' signatures and compile-time switches, shared with the SASS counter)

from atom_moe.kernels import mxfp4  # noqa: E402

ARCHS = ("gfx942", "gfx950")
SCHEMES = compile_all.SCHEMES


def variants(schemes: tuple[str, ...]) -> set[tuple]:
    """(kernel, scheme, block_m, block_n, block_k, warps, stages) for every config the lookup can return."""
    out = set()
    for scheme, configs in compile_all.table_configs(schemes).items():
        for c in configs:
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
    jobs = [(f"{arch} {' '.join(map(str, v))}: hsaco", lambda v=v, arch=arch: compile_hip(*v, arch))
            for arch in args.arch for v in todo]
    return 1 if compile_all.run_builds(jobs, f"variants built for {', '.join(args.arch)}") else 0


if __name__ == "__main__":
    sys.exit(main())
