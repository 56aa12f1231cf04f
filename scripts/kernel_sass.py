"""Compile the fused-experts GEMMs for an H100/H200 (sm_90a) on this machine, no GPU needed, and count
the SASS of their K loop: registers, spills, instructions per weight, the mix, whether the
loads are pipelined (cp.async, LDGSTS) or plain (LDG) inside the loop, shared stores (a decoded
weight tile restaged for the mma shows up there) and the wgmma kind (HGMMA bf16, QGMMA fp8).

How the MXFP4 tile layout (atom_moe/layouts/mx_tiles.py) was found: the K loop went from 11-12.5 to
3.7-4.8 instructions per weight (kernels/mxfp4.py). Per-weight counts are per thread-instruction:
an H200 issues about 33e12 of them per second (132 SMs x 4 schedulers x 32 lanes x ~1.98 GHz),
so N instructions per weight cap weight streaming at about 33e12 / N weights per second.

    python scripts/kernel_sass.py gemm1 --scheme a16w4 --block-m 16 --block-n 64 --block-k 128
    python scripts/kernel_sass.py gemm2 --scheme bf16 --block-m 64 --block-n 128 --block-k 64 --sass out.sass

Integer arguments are specialized as the launcher does for real shapes (divisible by 16), so the
code matches what runs for H, I multiples of 16.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
if os.environ.get("TRITON_INTERPRET") == "1":  # @triton.jit would give interpreter functions, not compilable ones
    sys.exit("kernel_sass.py compiles the real kernels: run it without TRITON_INTERPRET=1")

from atom_moe.kernels.common import swapped  # noqa: E402
from atom_moe.kernels.gemm1 import _gemm1_kernel  # noqa: E402
from atom_moe.kernels.gemm2 import _gemm2_kernel  # noqa: E402
from atom_moe.spec import Scheme  # noqa: E402

TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
INSTR = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def _types(scheme: str) -> tuple[str, str, str]:
    """(activation, weight, weight scale) pointer types of a scheme, as the launchers pass them."""
    act = "*fp8e4nv" if scheme in ("fp8", "a8w4") else "*bf16"
    weight = {"bf16": "*bf16", "fp8": "*fp8e4nv"}.get(scheme, "*i32")  # MX tiles / quads: int32 words
    # fp8 block scales; MX quads' residual bytes; MX tiles' scale words (bf16: unused)
    scale = {"fp8": "*fp32", "a8w4": "*u8"}.get(scheme, "*i32")
    return act, weight, scale


def signature(kernel: str, scheme: str, tma: tuple[int, int, int, int] | None = None) -> tuple[object, dict, list[str]]:
    """(kernel, argument types, arguments specialized as divisible by 16); tma: (BLOCK_M, BLOCK_N, BLOCK_K, H): the
    TMA descriptor arguments: bf16 / fp8 weights, and GEMM2's activation rows of any scheme unless H > 0 (a
    pair-block call)."""
    act, weight, scale = _types(scheme)
    w4 = scheme in ("a16w4", "a8w4")  # MX weights: only GEMM2's activation rows have a descriptor
    w_desc = f"tensordesc<{weight[1:]}[{tma[1]}, {tma[2]}]>" if tma and not w4 else weight
    a_desc = f"tensordesc<{act[1:]}[{tma[0]}, {tma[2]}]>" if tma and not tma[3] else act
    if kernel == "gemm1":
        sig = {"x_ptr": act, "stride_x": "i32", "xs_ptr": "*fp32", "stride_xs": "i32", "stride_xs_k": "constexpr",
               "w_ptr": weight, "ws_ptr": scale,
               "rowexp_ptr": "*u8", "bias_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
               "out_ptr": act,
               "outs_ptr": "*fp32", "stride_os": "constexpr", "stride_os_k": "i32", "num_pairs": "i32",
               "top_k": "i32", "hidden": "i32", "inter": "i32",
               "n_blocks": "i32", "alpha": "fp32", "limit": "fp32", "row_blocks": "i32", "k_blocks": "i32",
               "part_ptr": "*fp32", "k_span": "i32", "ids_ptr": "*i32", "emap_ptr": "*i32", "num_experts": "i32",
               "src_ptr": "*bf16", "stride_src": "i32", "counters_ptr": "*i32", "n_counters": "i32",
               "layer_out_ptr": "*bf16", "stride_layer_out": "i32", "w_desc": w_desc}
        div = ["x_ptr", "stride_x", "xs_ptr", "stride_xs", "stride_os_k", "w_ptr", "ws_ptr", "bias_ptr",
               "sorted_ptr", "block_expert_ptr", "out_ptr", "outs_ptr", "hidden", "inter", "ids_ptr", "emap_ptr",
               "src_ptr", "stride_src", "counters_ptr", "layer_out_ptr", "stride_layer_out"]
        return _gemm1_kernel, sig, div
    sig = {"a_ptr": act, "as_ptr": "*fp32", "stride_as": "constexpr", "stride_as_k": "i32", "w_ptr": weight,
           "ws_ptr": scale, "rowexp_ptr": "*u8",
           "bias_ptr": "*fp32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "ids_ptr": "*i32",
           "emap_ptr": "*i32", "topk_w_ptr": "*fp32", "partial_ptr": "*bf16", "counters_ptr": "*i32",
           "n_counters": "i32", "out_ptr": "*bf16", "stride_out": "i32", "num_pairs": "i32", "num_experts": "i32",
           "hidden": "i32", "inter": "i32", "n_blocks": "i32", "delta_ptr": "*i64", "info_ptr": "*i32",
           "slots_ptr": "*bf16", "returned_ptr": "*bf16", "capacity": "i32", "rank": "i32", "row_blocks": "i32",
           "k_blocks": "i32", "k_span": "i32", "a_desc": a_desc, "w_desc": w_desc}
    div = ["a_ptr", "as_ptr", "stride_as_k", "w_ptr", "ws_ptr", "bias_ptr", "sorted_ptr", "block_expert_ptr",
           "ids_ptr", "emap_ptr", "topk_w_ptr", "partial_ptr", "counters_ptr", "out_ptr", "stride_out", "hidden",
           "inter"]
    return _gemm2_kernel, sig, div


def constexprs(kernel: str, scheme: str, block_m: int, block_n: int, block_k: int, top_k: int,
               separate: bool = True, scaled: bool = False, pairs_hidden: int = 0, pdl: bool = False,
               tma: bool = False, split: int = 1, phase: int = 0, row_scale: bool = False, ahead: int = 0) -> dict:
    """The launchers' compile-time switches for a local-output call (GEMM2: the separate combine's, or with
    separate=False the counter combine's of a three-launch call); scaled: a8w4 through tl.dot_scaled;
    pairs_hidden > 0: a pair-block call (T = 1, no routing launch, kernels/routing.py) of that H; pdl:
    with programmatic dependent launch (kernels/common.py); tma: tiles through TMA descriptors (bf16 / fp8 weights,
    GEMM2's activation rows);
    split > 1: a split-K launch (GEMM1's phase 1 computes the slices, phase 2 adds them; GEMM2 in one launch);
    row_scale: a8w4 with one scale per token on GEMM2's input (the default; off: ATOM_MOE_A8W4_INTER=group): GEMM1
    stores bf16, GEMM2 keeps one accumulator; ahead: GEMM2's lookahead prefetch distance (kernels/gemm2.py, NVIDIA
    only). bf16 / fp8 tiles are swapped as the launchers swap them
    (kernels/common.py `swapped`: ATOM_MOE_SWAP)."""
    common = dict(FP8=scheme in ("fp8", "a8w4"), W4=scheme in ("a16w4", "a8w4"), BIG=False, HAS_BIAS=True,
                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
                  IGROUP=Scheme(scheme).inter_group, INTERP=False, SCALED=scaled and scheme == "a8w4",
                  SWAP=scheme in ("bf16", "fp8") and swapped(block_m, scheme == "fp8"))
    if kernel == "gemm1":
        pairs = dict(PAIRS=True, KP2=triton.next_power_of_2(top_k), HG=triton.next_power_of_2(-(-pairs_hidden // 128))) \
            if pairs_hidden else dict(PAIRS=False, KP2=1, HG=1)
        # the unit strides Triton's launcher specializes: x_scale is row-major, GEMM2's input scales group-major
        return {**common, "stride_xs_k": 1, "stride_os": 1, "OAI": True, "CLAMP": False, "SPLIT": split, "PHASE": phase,
                **pairs, "PDL_WAIT": pdl and not pairs_hidden, "PDL_RELEASE": pdl, "TMA_W": tma,
                "QOUT": scheme in ("fp8", "a8w4") and not row_scale}
    return {**common, "stride_as": 1, "TOPK": top_k, "KP2": triton.next_power_of_2(top_k), "REMOTE": False,
            "SEPARATE": separate, "SPLIT": split, "PAIRS": pairs_hidden > 0, "PDL": pdl,
            "TMA_A": tma and not pairs_hidden,
            "TMA_W": tma and scheme in ("bf16", "fp8"), "ROW_SCALE": row_scale, "AHEAD": ahead}


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest loop closed by a conditional backward branch (the K loop; an unconditional
    one is a retry path's jump back, e.g. from an out-of-line TMA barrier wait)."""
    lines = sass.splitlines()
    labels = {line.rstrip(":"): i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:", line)}
    best = None
    for i, line in enumerate(lines):
        m = re.search(r"@!?U?P\w+\s+BRA `\((\.L_x_\d+)\)", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            if best is None or i - labels[m.group(1)] > best[1] - best[0]:
                best = (labels[m.group(1)], i)
    if best is None:
        raise RuntimeError("no loop found in the SASS")
    return [m.group(1) for line in lines[best[0]:best[1] + 1] if (m := INSTR.search(line))]


def compile_sass(args: argparse.Namespace) -> tuple[dict, str]:
    """Compile for sm_90a; return (report, SASS text)."""
    if args.tma and args.scheme not in ("bf16", "fp8") and args.kernel == "gemm1":
        raise SystemExit("--tma: MXFP4 GEMM1 has no descriptor (its weights are decoded from per-thread loads, its "
                         "rows gathered); GEMM2 takes its activation rows through one")
    fn, sig, div = signature(args.kernel, args.scheme,
                             (args.block_m, args.block_n, args.block_k, args.pairs_hidden) if args.tma else None)
    if args.kernel == "gemm2" and args.pairs_hidden:  # the counter combine's partials are the fp32 workspace
        sig = {**sig, "partial_ptr": "*fp32"}
    if args.row_scale and args.scheme != "a8w4":
        raise SystemExit(f"--row-scale: a8w4 only (one scale per token on GEMM2's input), got --scheme {args.scheme}")
    if args.row_scale and args.kernel == "gemm1":  # GEMM1 then stores bf16 (kernels/inter_quant.py quantizes it)
        sig = {**sig, "out_ptr": "*bf16"}
    ce = constexprs(args.kernel, args.scheme, args.block_m, args.block_n, args.block_k, args.top_k,
                    separate=not args.pairs_hidden, scaled=args.scaled, pairs_hidden=args.pairs_hidden, pdl=args.pdl,
                    tma=args.tma, row_scale=args.row_scale, ahead=args.ahead)
    names = list(sig) + list(ce)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div}
    src = ASTSource(fn, {**sig, **{k: "constexpr" for k in ce}}, constexprs=ce, attrs=attrs)
    options = dict(num_warps=args.warps, num_stages=args.stages)
    if args.pdl:
        options["launch_pdl"] = True
    if args.maxnreg:  # Triton writes it into the PTX (.maxnreg), so the ptxas -v below applies it too
        options["maxnreg"] = args.maxnreg
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = os.path.join(tmp, "k.ptx"), os.path.join(tmp, "k.cubin")
        Path(ptx).write_text(compiled.asm["ptx"])
        Path(cubin).write_bytes(compiled.asm["cubin"])
        # the ptxas triton itself picks for sm_90: triton 3.9 emits PTX 9.x, which only its bundled
        # CUDA 13 ptxas ("ptxas-blackwell") reads; 3.6 uses plain "ptxas"
        info = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", ptx, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(TOOLS / "nvdisasm"), "-c", cubin], capture_output=True, text=True, check=True).stdout
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    stack = re.search(r"(\d+) bytes cumulative stack", info)
    body = loop_body(sass)
    mix = collections.Counter(body)
    weights_per_thread = args.block_n * args.block_k / (args.warps * 32)
    report = {
        "registers": regs,
        "stack_bytes": int(stack.group(1)) if stack else 0,
        "spill_stores": int(re.search(r"(\d+) bytes spill stores", info).group(1)),
        "loop_instructions": len(body),
        "per_weight": len(body) / weights_per_thread,
        "pipelined_loads": sum(v for k, v in mix.items() if k.startswith("LDGSTS")),
        "tma_loads": sum(v for k, v in mix.items() if k.startswith("UTMALDG")),
        "plain_loads": sum(v for k, v in mix.items() if k.startswith("LDG.") or k == "LDG"),
        # shared stores in the loop: a decoded weight tile restaged for the mma would show here
        "shared_stores": sum(v for k, v in mix.items() if k.startswith("STS")),
        "wgmma": sorted({k.split(".")[0] for k in mix if k.startswith(("HGMMA", "QGMMA"))}),
        # byte permutes: the MX decodes' own (scale pairs, a8w4's lookups) plus any repacking LLVM adds
        "byte_permutes": mix["PRMT"],
        # ptxas C7515: it waits for every wgmma before the next (a non-wgmma write to their registers, e.g. an
        # accumulator zeroed on a path that skips the K loop, inside the pipeline); the mma latency is then exposed
        "wgmma_serialized": "C7515" in info,
        "weight_words": weights_per_thread / 8,  # int32 words of MX codes per thread and K step
        "mix": mix.most_common(args.top),
    }
    return report, sass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kernel", choices=["gemm1", "gemm2"])
    p.add_argument("--scheme", default="a16w4", choices=["bf16", "fp8", "a16w4", "a8w4"])
    p.add_argument("--block-m", type=int, default=16)
    p.add_argument("--block-n", type=int, default=64)
    p.add_argument("--block-k", type=int, default=128)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--top-k", type=int, default=4, help="GEMM2's combine width (and GEMM1's with --pairs-hidden)")
    p.add_argument("--pairs-hidden", type=int, default=0, help="compile the T = 1 pair-block variant (no routing "
                   "launch; GEMM1 quantizes x itself) for this H (0: the sorted path's)")
    p.add_argument("--maxnreg", type=int, default=0, help="register cap per thread, as a tile config's maxnreg1/2 (0: none)")
    p.add_argument("--pdl", action="store_true", help="with programmatic dependent launch (ATOM_MOE_PDL=1: GEMM2 "
                   "prefetches its weight tile into L2 and waits for GEMM1)")
    p.add_argument("--tma", action="store_true",
                   help="tiles through TMA descriptors (ATOM_MOE_TMA=1): bf16 / fp8 weights, GEMM2's rows")
    p.add_argument("--row-scale", action="store_true", help="a8w4 with one scale per token on GEMM2's input (what "
                   "runs by default; without it a8w4 compiles ATOM_MOE_A8W4_INTER=group's path): GEMM1 stores bf16, "
                   "GEMM2 keeps one accumulator")
    p.add_argument("--scaled", action="store_true", help="a8w4 through tl.dot_scaled (gfx950's path; on sm_90a "
                   "Triton decomposes it)")
    p.add_argument("--ahead", type=int, default=0, help="GEMM2's lookahead prefetch distance in programs (a tile "
                   "config's ahead2; 0: off)")
    p.add_argument("--top", type=int, default=16, help="most frequent instructions to list")
    p.add_argument("--sass", type=Path, help="also write the whole SASS here")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object instead")
    args = p.parse_args(argv)
    report, sass = compile_sass(args)
    if args.sass:
        args.sass.write_text(sass)
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.kernel} {args.scheme} BM{args.block_m} BN{args.block_n} BK{args.block_k} w{args.warps} "
          f"s{args.stages}{f' maxnreg {args.maxnreg}' if args.maxnreg else ''}: {report['registers']} registers, "
          f"{report['stack_bytes']} B stack, {report['spill_stores']} B spilled; K loop "
          f"{report['loop_instructions']} instructions = {report['per_weight']:.2f} per weight; loads in the loop: "
          f"{report['pipelined_loads']} cp.async, {report['tma_loads']} TMA, {report['plain_loads']} plain, {report['shared_stores']} shared "
          f"stores; wgmma: {', '.join(report['wgmma']) or 'none'}{' (serialized by ptxas)' * report['wgmma_serialized']}")
    print("  " + ", ".join(f"{name} {n}" for name, n in report["mix"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
