"""Quant between GEMM1 and GEMM2 for a8w4 with one scale per token (the default; Scheme.inter_per_token).

With ATOM_MOE_A8W4_INTER=group GEMM1's epilogue quantizes its output per (token, 64-group), the groups its tile
holds, and GEMM2 applies each K step's scales to that step's product, which costs it a second accumulator. By
default GEMM1 stores bf16 instead and this launch gives each row one e4m3 scale: one program
per row of GEMM1's output, the whole row in registers, its amax, the e4m3 row and the scale in column 0 of
GEMM2's (group-major) scale buffer, the only column GEMM2 then reads (k_loop's ROW_SCALE). Rows that hold no
pair (padding, row blocks of no expert, pair blocks of another rank's expert) are skipped, as GEMM2 skips them.
The torch twin is `formats.quantize_fp8_per_token` of the bf16 row (atom_moe.reference).

Where GEMM1 splits its K (decode batches), `finish_rows` takes the place of GEMM1's second launch and this one: one
program per row adds the row's K slices in order, runs GEMM1's epilogue (row exponents, bias, activation) on the
whole row, rounds it to bf16 and quantizes it, so the row never goes through memory as bf16. The same operations in
the same order as the two launches, so the same bytes (tests/test_inter_quant.py); one launch less.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_moe.layouts.gate_up import GateUpLayout, GateUpTensor, require

from .common import FP8_MAX, cast, checked_ids, e4m3_scale, interpreting
from .mainloop import gated_act, tile_finish
from .mxfp4 import rowexp_arg


@triton.jit
def _row_owner(row, sorted_ptr, block_expert_ptr, ids_ptr, emap_ptr, num_pairs, num_experts, BLOCK_M: tl.constexpr,
               PAIRS: tl.constexpr):
    """(pair, local expert) of GEMM1's output row `row`; expert -1 where GEMM1 wrote nothing there (padding, row
    blocks of no expert, pair blocks of another rank's expert), which then stays unread by GEMM2 too."""
    if PAIRS:  # row p is pair p's (kernels/mainloop.py tile_rows)
        ok, gid = checked_ids(tl.load(ids_ptr + row), num_experts)
        expert = tl.where(ok, tl.load(emap_ptr + gid, mask=ok, other=-1), -1)
        pair = row
    else:
        pair = tl.load(sorted_ptr + row)
        expert = tl.where(pair < num_pairs, tl.load(block_expert_ptr + row // BLOCK_M), -1)
    return pair, expert


@triton.jit
def _quant_store(v, k, k_ok, dst_ptr, scale_ptr, r64, inter, EMULATE: tl.constexpr):
    """Row r64 of dst = e4m3(v / s), its scale s = amax(v) / 448 in column 0 of the group-major scales."""
    amax = tl.max(tl.abs(v), 0)
    scale = e4m3_scale(amax, tl.sum(tl.abs(v) * 0.0, 0))
    q = tl.clamp(v / scale, -FP8_MAX, FP8_MAX)
    tl.store(dst_ptr + r64 * inter + k, cast(q, dst_ptr.dtype.element_ty, EMULATE), mask=k_ok)
    tl.store(scale_ptr + r64, scale)


@triton.jit
def _inter_quant_kernel(src_ptr, dst_ptr, scale_ptr, sorted_ptr, block_expert_ptr, ids_ptr, emap_ptr, num_pairs,
                        num_experts, inter, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, PAIRS: tl.constexpr,
                        EMULATE: tl.constexpr):
    row = tl.program_id(0)
    _, expert = _row_owner(row, sorted_ptr, block_expert_ptr, ids_ptr, emap_ptr, num_pairs, num_experts, BLOCK_M,
                           PAIRS)
    if expert < 0:
        return
    r64 = row.to(tl.int64)
    k = tl.arange(0, BLOCK_I)
    k_ok = k < inter
    v = tl.load(src_ptr + r64 * inter + k, mask=k_ok, other=0.0).to(tl.float32)
    _quant_store(v, k, k_ok, dst_ptr, scale_ptr, r64, inter, EMULATE)


@triton.jit
def _finish_kernel(part_ptr, rowexp_ptr, bias_ptr, dst_ptr, scale_ptr, sorted_ptr, block_expert_ptr, ids_ptr,
                   emap_ptr, num_pairs, num_experts, inter, alpha, limit, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAIRS: tl.constexpr, OAI: tl.constexpr, CLAMP: tl.constexpr,
                   HAS_BIAS: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0)
    pair, expert = _row_owner(row, sorted_ptr, block_expert_ptr, ids_ptr, emap_ptr, num_pairs, num_experts, BLOCK_M,
                              PAIRS)
    if expert < 0:
        return
    n_out = 2 * inter
    n = tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    # kernels/gemm1.py PHASE 2: slice s of pair p at part[s, p, :2I], added in order s = 0, 1, ... onto zeros
    ptrs = part_ptr + pair.to(tl.int64) * n_out + n
    slab = num_pairs.to(tl.int64) * n_out
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for s in range(SPLIT):
        acc += tl.load(ptrs + s * slab, mask=n_ok, other=0.0)
    # the row as a [BLOCK_N, 1] tile in MXFP4's swapped orientation: GEMM1's epilogue, one row high
    acc = tile_finish(tl.reshape(acc, [BLOCK_N, 1]), rowexp_ptr, bias_ptr, expert.to(tl.int64), n, n_ok, n_out,
                      True, True, HAS_BIAS)
    j = tl.arange(0, BLOCK_N // 2)
    j_ok = j < inter
    act = gated_act(acc, alpha, limit, j_ok, OAI, CLAMP, 1, BLOCK_N)
    v = cast(tl.reshape(act, [BLOCK_N // 2]), tl.bfloat16, EMULATE).to(tl.float32)  # what GEMM1 would have stored
    _quant_store(v, j, j_ok, dst_ptr, scale_ptr, row.to(tl.int64), inter, EMULATE)


def quantize_rows(src: torch.Tensor, dst: torch.Tensor, dst_scale: torch.Tensor, sorted_ids: torch.Tensor,
                  block_expert: torch.Tensor, n_blocks: int, block_m: int, num_pairs: int,
                  pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """dst[r] = e4m3(src[r] / s_r), dst_scale[r, 0] = s_r = amax(src[r]) / 448, for every row GEMM1 wrote.

    src: GEMM1's bf16 output [rows, I]; dst: e4m3 [rows, I]; dst_scale: GEMM2's fp32 scales [rows, groups],
    group-major (row stride 1). Rows as GEMM1 ran: n_blocks row blocks of block_m rows through sorted_ids /
    block_expert, or with pairs = (topk_ids, expert_map) one row per (token, slot) pair (T = 1's pair blocks)."""
    inter = src.shape[1]
    if src.dtype != torch.bfloat16 or src.stride(0) != inter:
        raise ValueError(f"inter_quant: src must be bf16 with contiguous rows, got {src.dtype} {tuple(src.shape)}")
    rows = _check_dst(dst, dst_scale, inter, src.shape[0], n_blocks, block_m, num_pairs, pairs)
    if rows == 0:
        return
    ids, emap = pairs if pairs is not None else (sorted_ids, sorted_ids)
    block_i = triton.next_power_of_2(inter)
    _inter_quant_kernel[(rows,)](src, dst, dst_scale, sorted_ids, block_expert, ids, emap, num_pairs,
                                 emap.shape[0], inter, BLOCK_M=block_m, BLOCK_I=block_i, PAIRS=pairs is not None,
                                 EMULATE=interpreting(), num_warps=_warps(block_i))


def finish_rows(part: torch.Tensor, split: int, w13_rowexp_t: GateUpTensor, w13_bias_t: GateUpTensor | None,
                dst: torch.Tensor, dst_scale: torch.Tensor, sorted_ids: torch.Tensor, block_expert: torch.Tensor,
                n_blocks: int, block_m: int, num_pairs: int, *, oai: bool, clamp: bool, alpha: float, limit: float,
                pairs: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """a8w4 after a split-K GEMM1 (kernels/gemm1.py, slices_only): for every row GEMM1 wrote, its K slices in
    `part` (fp32 [split, num_pairs, 2I]) added, GEMM1's epilogue applied (w13's row exponents, bias, the
    activation: oai / clamp / alpha / limit as GEMM1 takes them), the row rounded to bf16 and quantized as
    `quantize_rows` does: what GEMM1's second launch followed by `quantize_rows` writes, in one launch."""
    inter = dst.shape[1]
    if not isinstance(split, int) or split < 2:
        raise ValueError(f"inter_quant.finish_rows: split must be an int >= 2 (GEMM1's K slices), got {split!r}")
    if part.dtype != torch.float32 or part.numel() < split * num_pairs * 2 * inter:
        raise ValueError(f"inter_quant.finish_rows: part must be fp32 with split * pairs * 2I = "
                         f"{split * num_pairs * 2 * inter} elements, got {part.dtype} {part.numel()}")
    # the epilogue reads the row exponents and bias by GEMM1's output column: they must pair gate and up as w13 does
    rowexp = require(w13_rowexp_t, GateUpLayout.INTERLEAVED, "w13_rowexp")
    rowexp_arg("inter_quant.finish_rows", "w13_rowexp", rowexp, rowexp.shape[0], 2 * inter)
    bias = None if w13_bias_t is None else require(w13_bias_t, GateUpLayout.INTERLEAVED, "w13_bias")
    if bias is not None and (bias.shape != rowexp.shape or bias.dtype != torch.float32 or not bias.is_contiguous()):
        raise ValueError(f"inter_quant.finish_rows: w13_bias must be contiguous fp32 {tuple(rowexp.shape)}, got "
                         f"{bias.dtype} {tuple(bias.shape)}")
    if oai and clamp:
        raise ValueError("inter_quant.finish_rows: oai already clamps; pass clamp only for clamped SiLU")
    rows = _check_dst(dst, dst_scale, inter, dst.shape[0], n_blocks, block_m, num_pairs, pairs)
    if rows == 0:
        return
    ids, emap = pairs if pairs is not None else (sorted_ids, sorted_ids)
    block_n = triton.next_power_of_2(2 * inter)
    _finish_kernel[(rows,)](part, rowexp, bias if bias is not None else rowexp, dst, dst_scale, sorted_ids,
                            block_expert, ids, emap, num_pairs, emap.shape[0], inter, float(alpha), float(limit),
                            SPLIT=split, BLOCK_M=block_m, BLOCK_N=block_n, PAIRS=pairs is not None, OAI=oai,
                            CLAMP=clamp, HAS_BIAS=bias is not None, EMULATE=interpreting(),
                            num_warps=_warps(block_n))


def _check_dst(dst: torch.Tensor, dst_scale: torch.Tensor, inter: int, src_rows: int, n_blocks: int, block_m: int,
               num_pairs: int, pairs: tuple | None) -> int:
    """The number of rows to write, after checking the e4m3 output and its group-major scales hold them."""
    if dst.dtype != torch.float8_e4m3fn or dst.shape[1] != inter or dst.stride(0) != inter:
        raise ValueError(f"inter_quant: dst must be e4m3 [rows, {inter}] with contiguous rows, got {dst.dtype} "
                         f"{tuple(dst.shape)}")
    if dst_scale.dtype != torch.float32 or dst_scale.stride(0) != 1:
        raise ValueError(f"inter_quant: dst_scale must be fp32 and group-major (row stride 1), got {dst_scale.dtype} "
                         f"strides {dst_scale.stride()}")
    rows = num_pairs if pairs is not None else n_blocks * block_m
    if rows > min(src_rows, dst.shape[0], dst_scale.shape[0]):
        raise ValueError(f"inter_quant: {rows} rows to quantize, the buffers hold "
                         f"{min(src_rows, dst.shape[0], dst_scale.shape[0])}")
    return rows


def _warps(width: int) -> int:
    """Warps for one program per row of `width` elements."""
    return 4 if width <= 2048 else 8
