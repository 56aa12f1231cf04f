"""Quant between GEMM1 and GEMM2 for a8w4 with one scale per token (the default; Scheme.inter_per_token).

With ATOM_MOE_A8W4_INTER=group GEMM1's epilogue quantizes its output per (token, 64-group), the groups its tile
holds, and GEMM2 applies each K step's scales to that step's product, which costs it a second accumulator. By
default GEMM1 stores bf16 instead and this launch gives each row one e4m3 scale: one program
per row of GEMM1's output, the whole row in registers, its amax, the e4m3 row and the scale in column 0 of
GEMM2's (group-major) scale buffer, the only column GEMM2 then reads (k_loop's ROW_SCALE). Rows that hold no
pair (padding, row blocks of no expert, pair blocks of another rank's expert) are skipped, as GEMM2 skips them.
The torch twin is `formats.quantize_fp8_per_token` of the bf16 row (atom_moe.reference).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP8_MAX, cast, checked_ids, e4m3_scale, interpreting


@triton.jit
def _inter_quant_kernel(src_ptr, dst_ptr, scale_ptr, sorted_ptr, block_expert_ptr, ids_ptr, emap_ptr, num_pairs,
                        num_experts, inter, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, PAIRS: tl.constexpr,
                        EMULATE: tl.constexpr):
    row = tl.program_id(0)
    if PAIRS:  # row p is pair p's (kernels/mainloop.py tile_rows): GEMM1 wrote it only for a local expert
        ok, gid = checked_ids(tl.load(ids_ptr + row), num_experts)
        expert = tl.where(ok, tl.load(emap_ptr + gid, mask=ok, other=-1), -1)
        if expert < 0:
            return
    else:
        if tl.load(block_expert_ptr + row // BLOCK_M) < 0:
            return
        if tl.load(sorted_ptr + row) >= num_pairs:  # padding
            return
    r64 = row.to(tl.int64)
    k = tl.arange(0, BLOCK_I)
    k_ok = k < inter
    v = tl.load(src_ptr + r64 * inter + k, mask=k_ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(v), 0)
    scale = e4m3_scale(amax, tl.sum(tl.abs(v) * 0.0, 0))
    q = tl.clamp(v / scale, -FP8_MAX, FP8_MAX)
    tl.store(dst_ptr + r64 * inter + k, cast(q, dst_ptr.dtype.element_ty, EMULATE), mask=k_ok)
    tl.store(scale_ptr + r64, scale)


def quantize_rows(src: torch.Tensor, dst: torch.Tensor, dst_scale: torch.Tensor, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, n_blocks: int, block_m: int, num_pairs: int,
                  pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """dst[r] = e4m3(src[r] / s_r), dst_scale[r, 0] = s_r = amax(src[r]) / 448, for every row GEMM1 wrote.

    src: GEMM1's bf16 output [rows, I]; dst: e4m3 [rows, I]; dst_scale: GEMM2's fp32 scales [rows, groups],
    group-major (row stride 1). Rows as GEMM1 ran: n_blocks row blocks of block_m rows through sorted_ids /
    block_expert, or with pairs = (topk_ids, expert_map) one row per (token, slot) pair (T = 1's pair blocks)."""
    inter = src.shape[1]
    if src.dtype != torch.bfloat16 or dst.dtype != torch.float8_e4m3fn or dst.shape[1] != inter:
        raise ValueError(f"inter_quant: src must be bf16 and dst e4m3 of the same width, got {src.dtype} "
                         f"{tuple(src.shape)} and {dst.dtype} {tuple(dst.shape)}")
    if dst_scale.dtype != torch.float32 or dst_scale.stride(0) != 1:
        raise ValueError(f"inter_quant: dst_scale must be fp32 and group-major (row stride 1), got {dst_scale.dtype} "
                         f"strides {dst_scale.stride()}")
    if src.stride(0) != inter or dst.stride(0) != inter:
        raise ValueError("inter_quant: src and dst rows must be contiguous")
    rows = num_pairs if pairs is not None else n_blocks * block_m
    if rows > min(src.shape[0], dst.shape[0], dst_scale.shape[0]):
        raise ValueError(f"inter_quant: {rows} rows to quantize, the buffers hold "
                         f"{min(src.shape[0], dst.shape[0], dst_scale.shape[0])}")
    if rows == 0:
        return
    ids, emap = pairs if pairs is not None else (sorted_ids, sorted_ids)
    block_i = triton.next_power_of_2(inter)
    _inter_quant_kernel[(rows,)](src, dst, dst_scale, sorted_ids, block_expert, ids, emap, num_pairs,
                                 emap.shape[0], inter, BLOCK_M=block_m, BLOCK_I=block_i, PAIRS=pairs is not None,
                                 EMULATE=interpreting(), num_warps=4 if block_i <= 2048 else 8)
