"""Compile every GEMM variant the tile tables or the heuristic can pick for AMD GPUs, on this
machine, no GPU needed: Triton's HIP target builds an hsaco for gfx942 (MI300X) and gfx950
(MI355X) from the same kernels that run on NVIDIA.

    python scripts/hip_compile.py                 # gfx942 and gfx950, every variant
    python scripts/hip_compile.py --arch gfx950 --schemes a8w4

The variants: every row of kernels/configs/*.csv (a8w4's GEMM1 also at 128-k steps, the K step
that runs tl.dot_scaled on gfx950; a row that splits K also as its split-K launches), and the heuristic's
pick for every preset (and the seed shapes of the bench) at every token bucket, per scheme, GEMM2 built at
top-k 8 with the separate combine; and for the served presets (atom_moe.presets.SERVED: top-k 9 and 6) GEMM2 exactly as
their heuristic picks launch it in their schemes (a8w4 too for GLM-5.2's MXFP4), with the combine each
token bucket takes (kernels/gemm2.py's SEPARATE_MIN_PAIRS); and both GEMMs as T = 1 launches them, with
pair blocks (no routing launch: GEMM1 specializes on the row's 128-groups and top-k, kernels/routing.py),
for the T = 1 pick of every preset. On AMD the a8w4 e4m3
decode takes its portable path (kernels/mxfp4.py's PRMT switch is PTX-only: off on a ROCm
torch), so this script turns that switch off for the HIP build, as a ROCm torch would; on
gfx950 a8w4 is built with SCALED (tl.dot_scaled) where `mxfp4.scaled_dot` picks it (128-k steps). a8w4 is built
as it runs by default (one scale per token on GEMM2's input, unless ATOM_MOE_A8W4_INTER=group): GEMM1 stores
bf16, a launch quantizes it (kernels/inter_quant.py), and GEMM2 keeps one accumulator.
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
from atom_moe.spec import Scheme  # noqa: E402

ARCHS = ("gfx942", "gfx950")
SCHEMES = compile_all.SCHEMES


def split_variants(kernel: str, scheme: str, c, top_k: int, separate: bool, pairs_hidden: int) -> set[tuple]:
    """One GEMM of config c as it launches unsplit and, where c splits its K (decode batches), split: GEMM1's
    two phases, GEMM2's one launch with the counter combine (split-K's only combine)."""
    if kernel == "gemm1":
        tile, split = (c.block_m, c.block_n1, c.block_k1, c.warps1, c.stages1), c.split_k1
        split_launches = {(top_k, separate, pairs_hidden, split, phase) for phase in (1, 2)}
    else:
        tile, split = (c.block_m, c.block_n2, c.block_k2, c.warps2, c.stages2), c.split_k2
        split_launches = {(top_k, False, pairs_hidden, split, 0)}
    launches = {(top_k, separate, pairs_hidden, 1, 0)} | (split_launches if split > 1 else set())
    return {(kernel, scheme, *tile, *launch) for launch in launches}


def variants(schemes: tuple[str, ...]) -> set[tuple]:
    """(kernel, scheme, block_m, block_n, block_k, warps, stages, top_k, separate, pairs_hidden, split, phase) for
    every config the lookup can return, split-K launches included, and a8w4's GEMM1 also at 128-k steps (GEMM1
    specializes on neither top_k nor separate: 8, True; pairs_hidden 0: the routing launch ran), then the T = 1
    pair-block launches."""
    out = set()
    for scheme, configs in compile_all.table_configs(schemes).items():
        for c in configs:
            out |= split_variants("gemm1", scheme, c, 8, True, 0) | split_variants("gemm2", scheme, c, 8, True, 0)
    # a8w4 GEMM1 at 128-k steps too: a pick `atom-moe tune` may make, and on gfx950 the one that runs
    # tl.dot_scaled (the tables and the heuristic step by 64)
    out |= {u[:4] + (128,) + u[5:] for u in out if u[:2] == ("gemm1", "a8w4")}
    return out | served_variants(schemes) | pair_variants(schemes)


def pair_variants(schemes: tuple[str, ...]) -> set[tuple]:
    """Both GEMMs with pair blocks (T = 1) for each preset's T = 1 pick, its table row or the heuristic's. GEMM1
    specializes on the row's 128-groups (rounded up to a power of two) and top-k, GEMM2 on top-k: one
    shape stands for each distinct pair of those."""
    from atom_moe.kernels.tuning import lookup
    from atom_moe.presets import PRESETS
    out, seen = set(), set()
    for s in PRESETS.values():
        for scheme in schemes:
            c = lookup("nvidia h200", scheme, s.hidden_size, s.intermediate_size, s.num_experts, s.top_k, 1)
            key = (scheme, c, s.top_k, triton.next_power_of_2(-(-s.hidden_size // 128)))
            if key in seen:
                continue
            seen.add(key)
            out |= split_variants("gemm1", scheme, c, s.top_k, False, s.hidden_size)
            out |= split_variants("gemm2", scheme, c, s.top_k, False, s.hidden_size)
    return out


def served_variants(schemes: tuple[str, ...]) -> set[tuple]:
    """GEMM2 as the heuristic's picks for the served presets launch it: their top-k, the combine by pair count."""
    from atom_moe.kernels.gemm2 import SEPARATE_MIN_PAIRS
    from atom_moe.kernels.tuning import heuristic
    from atom_moe.presets import PRESETS, SERVED
    out = set()
    for s in (PRESETS[name] for name in SERVED):
        for scheme in compile_all.served_schemes(s):
            if scheme not in schemes:
                continue
            for tokens in compile_all.TOKENS:
                c = heuristic(scheme, s.hidden_size, s.intermediate_size, s.num_experts, s.top_k, tokens)
                out.add(("gemm2", scheme, c.block_m, c.block_n2, c.block_k2, c.warps2, c.stages2, s.top_k,
                         tokens * s.top_k >= SEPARATE_MIN_PAIRS, 0, 1, 0))
    return out


def compile_hip(kernel: str, scheme: str, bm: int, bn: int, bk: int, warps: int, stages: int, top_k: int,
                separate: bool, pairs_hidden: int, split: int, phase: int, arch: str) -> int:
    """Build one variant for `arch`; return the hsaco's size in bytes."""
    fn, sig, div = kernel_sass.signature(kernel, scheme)
    if kernel == "gemm2" and not separate:  # the counter combine's partials are the fp32 workspace
        sig = {**sig, "partial_ptr": "*fp32"}
    # a8w4 as it runs by default (one scale per token on GEMM2's input): GEMM1 stores bf16, GEMM2 keeps one
    # accumulator
    row_scale = scheme == "a8w4" and Scheme.A8W4.inter_per_token
    if row_scale and kernel == "gemm1":
        sig = {**sig, "out_ptr": "*bf16"}
    # a8w4 through tl.dot_scaled where kernels/mxfp4.py's scaled_dot picks it by default (gfx950, 128-k steps)
    ce = kernel_sass.constexprs(kernel, scheme, bm, bn, bk, top_k, separate,
                                scaled=mxfp4.scaled_by_default(arch, bk), pairs_hidden=pairs_hidden, split=split,
                                phase=phase, row_scale=row_scale)
    names = list(sig) + list(ce)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div}
    src = ASTSource(fn, {**sig, **{k: "constexpr" for k in ce}}, constexprs=ce, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("hip", arch, 64), options=dict(num_warps=warps, num_stages=stages))
    hsaco = compiled.asm.get("hsaco", b"")
    if not hsaco:
        raise RuntimeError("no hsaco produced")
    if ce["SCALED"] and phase != 2 and "v_mfma_scale_" not in compiled.asm["amdgcn"]:  # phase 2 only adds slices
        raise RuntimeError("tl.dot_scaled did not become the scaled MFMA (v_mfma_scale_*)")
    return len(hsaco)


def label(variant: tuple, arch: str) -> str:
    """A variant's report line up to its size: arch, the ten fields up to pairs_hidden, then its split and marks."""
    split, phase = variant[10:12]
    split_mark = f" split {split} phase {phase}" if split > 1 else ""
    return f"{arch} {' '.join(map(str, variant[:10]))}{split_mark}{scaled_mark(variant, arch)}: hsaco"


def scaled_mark(variant: tuple, arch: str) -> str:
    """" scaled" for a variant built with tl.dot_scaled on `arch` (a8w4 where mxfp4.scaled_by_default holds)."""
    return " scaled" if variant[1] == "a8w4" and mxfp4.scaled_by_default(arch, variant[4]) else ""


def main(argv: list[str] | None = None) -> int:
    """Compile every variant for every arch; print one line each and a summary; exit 1 on any failure."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", nargs="+", default=list(ARCHS), choices=list(ARCHS))
    p.add_argument("--schemes", nargs="+", default=list(SCHEMES), choices=list(SCHEMES))
    args = p.parse_args(argv)
    mxfp4.PRMT_OK = tl.constexpr(False)  # what a ROCm torch sets: the PTX byte permute does not exist there
    todo = sorted(variants(tuple(args.schemes)))
    jobs = [(label(v, arch), lambda v=v, arch=arch: compile_hip(*v, arch)) for arch in args.arch for v in todo]
    return 1 if compile_all.run_builds(jobs, f"variants built for {', '.join(args.arch)}") else 0


if __name__ == "__main__":
    sys.exit(main())
