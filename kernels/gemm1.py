"""GEMM1: grouped x @ w13^T over expert row blocks, SwiGLU in the epilogue, optional fp8 output.

Weights: bf16, fp8 (128x128 block scales) or MXFP4 (a16w4 / a8w4: e2m1 bytes + e8m0 per 32,
decoded in registers by kernels/mxfp4.py).

Token rows are read through the sorted pair list (no permuted copy of x). w13 rows are
INTERLEAVED (row 2j = gate j, row 2j+1 = up j), so a tile of BLOCK_N rows holds BLOCK_N/2
complete (gate, up) pairs and the activation runs in registers. For fp8 the tile spans
exactly one 128-group of GEMM2's input (BLOCK_N = 256), so the epilogue also quantizes it
per token-group-128: GEMM2 then streams e4m3 and needs no prologue work.

SWAP (MXFP4 at BLOCK_M <= 16): the K loop computes out^T = W @ x^T, the decoded weight tile
[BLOCK_N, BLOCK_K] as the dot's left operand (measured up to 1.8x faster for a8w4 on an H200,
docs/perf/mxfp4-lab-h200.md), and transposes the accumulator once after the loop, so the
epilogue is the same for both orientations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_moe.layout import GateUpLayout, GateUpTensor, require

from .common import FP8_MAX, QGROUP, cast, dot, interpreting, tile_ids
from .mxfp4 import tile_bf16, tile_bf16_nk, tile_e4m3, tile_e4m3_nk

GROUP = 128  # host-side twin of common.QGROUP


@triton.jit
def _gemm1_kernel(x_ptr, stride_x, xs_ptr, w_ptr, ws_ptr, bias_ptr, sorted_ptr, block_expert_ptr,
                  out_ptr, outs_ptr, num_pairs, top_k, hidden, inter, n_blocks, alpha, limit,
                  FP8: tl.constexpr, W4: tl.constexpr, SWAP: tl.constexpr, OAI: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, INTERP: tl.constexpr):
    n_out = 2 * inter
    pid_m, pid_n = tile_ids(n_blocks, tl.cdiv(n_out, BLOCK_N), GROUP_M)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    row_ok = pair < num_pairs
    tok = (pair // top_k).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    kk = tl.arange(0, BLOCK_K)
    if SWAP:  # x^T tiles [BLOCK_K, BLOCK_M]
        a_ptrs = x_ptr + tok[None, :] * stride_x + kk[:, None]
    else:
        a_ptrs = x_ptr + tok[:, None] * stride_x + kk[None, :]
    n64 = n.to(tl.int64)
    if W4:
        # MXFP4: bytes [E, 2I, H/2] and e8m0 [E, 2I, H/32], decoded in registers (kernels/mxfp4.py)
        kh = tl.arange(0, BLOCK_K // 2)
        kg = tl.arange(0, BLOCK_K // 32)
        w_rows = w_ptr + e64 * n_out * (hidden // 2) + n64 * (hidden // 2)
        ws_rows = ws_ptr + e64 * n_out * (hidden // 32) + n64 * (hidden // 32)
        if SWAP:  # tiles [BLOCK_N, BLOCK_K / 2] and [BLOCK_N, BLOCK_K / 32]
            w_ptrs = w_rows[:, None] + kh[None, :]
            ws_ptrs = ws_rows[:, None] + kg[None, :]
        else:
            w_ptrs = w_rows[None, :] + kh[:, None]
            ws_ptrs = ws_rows[None, :] + kg[:, None]
    else:
        w_ptrs = w_ptr + e64 * n_out * hidden + n64[None, :] * hidden + kk[:, None]
    if FP8:
        k_groups = tl.cdiv(hidden, QGROUP)
        as_ptrs = xs_ptr + tok * k_groups
        if not W4:
            # output pair j = n // 2 uses scale [e, j // 128, n % 2, kb]
            ws_ptrs = ws_ptr + e64 * (tl.cdiv(inter, QGROUP) * 2 * k_groups) \
                + (n // 2 // QGROUP) * (2 * k_groups) + (n % 2) * k_groups
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # out^T
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = (k0 + kk) < hidden
        if SWAP:
            a = tl.load(a_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W4:
            kh_ok = (k0 // 2 + kh) < hidden // 2
            kg_ok = (k0 // 32 + kg) < hidden // 32
            if SWAP:
                wb = tl.load(w_ptrs, mask=n_ok[:, None] & kh_ok[None, :], other=0)
                sb = tl.load(ws_ptrs, mask=n_ok[:, None] & kg_ok[None, :], other=0)
                if FP8:
                    w, w_s = tile_e4m3_nk(wb, sb, BLOCK_N, BLOCK_K, INTERP)
                else:
                    w = tile_bf16_nk(wb, sb, BLOCK_N, BLOCK_K, INTERP)
            else:
                wb = tl.load(w_ptrs, mask=kh_ok[:, None] & n_ok[None, :], other=0)
                sb = tl.load(ws_ptrs, mask=kg_ok[:, None] & n_ok[None, :], other=0)
                if FP8:  # a8w4: e4m3 x e4m3 dot, per-32 scales factored into base x residual
                    w, w_s = tile_e4m3(wb, sb, BLOCK_K, BLOCK_N, INTERP)
                else:  # a16w4: bf16 dot on the dequantized tile
                    w = tile_bf16(wb, sb, BLOCK_K, BLOCK_N, INTERP)
        else:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if FP8:
            kb = k0 // QGROUP
            a_s = tl.load(as_ptrs + kb, mask=row_ok, other=0.0)
            if not W4:
                w_s = tl.load(ws_ptrs + kb, mask=n_ok, other=0.0)
            if SWAP:  # same product order as below: dot * a_s * w_s
                acc += tl.dot(w, a) * a_s[None, :] * w_s[:, None]
            else:
                acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
        else:
            if x_ptr.dtype.element_ty != tl.bfloat16:  # the bf16 scheme computes in bf16
                a = cast(a.to(tl.float32), tl.bfloat16, INTERP)
            if SWAP:
                acc = dot(w, a, acc, INTERP)
            else:
                acc = dot(a, w, acc, INTERP)
        a_ptrs += BLOCK_K
        if W4:
            w_ptrs += BLOCK_K // 2
            ws_ptrs += BLOCK_K // 32
        else:
            w_ptrs += BLOCK_K
    if SWAP:
        acc = tl.trans(acc)  # the epilogue works on [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e64 * n_out + n, mask=n_ok, other=0.0)[None, :]
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    if OAI:
        gate = tl.minimum(gate, limit)
        up = tl.clamp(up, -limit, limit)
        act = gate * tl.sigmoid(alpha * gate) * (up + 1.0)
    else:
        act = gate * tl.sigmoid(gate) * up
    j = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    j_ok = j < inter
    act = tl.where(j_ok[None, :], act, 0.0)
    rows64 = rows.to(tl.int64)
    o_mask = row_ok[:, None] & j_ok[None, :]
    o_ptrs = out_ptr + rows64[:, None] * inter + j[None, :]
    if FP8:
        # BLOCK_N // 2 == QGROUP: this tile holds the whole group pid_n of each row
        amax = tl.max(tl.abs(act), 1)
        scale = tl.where(amax > 0, amax / FP8_MAX, 1.0)
        q = tl.clamp(act / scale[:, None], -FP8_MAX, FP8_MAX)
        tl.store(o_ptrs, cast(q, out_ptr.dtype.element_ty, INTERP), mask=o_mask)
        tl.store(outs_ptr + rows64 * tl.cdiv(inter, QGROUP) + pid_n, scale, mask=row_ok)
    else:
        tl.store(o_ptrs, cast(act, out_ptr.dtype.element_ty, INTERP), mask=o_mask)


def gemm1(x: torch.Tensor, x_scale: torch.Tensor | None, w13_t: GateUpTensor, w13_scale_t: GateUpTensor | None,
          w13_bias_t: GateUpTensor | None, sorted_ids: torch.Tensor, block_expert: torch.Tensor, n_blocks: int,
          top_k: int, out: torch.Tensor, out_scale: torch.Tensor | None, *, oai: bool, alpha: float,
          limit: float, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
          group_m: int = 8) -> None:
    """out[row, :I] = act(x[token(row)] @ w13[expert(row)]^T (+bias)), fp8-quantized when out_scale is given."""
    # The pairing of gate and up rows is checked, never assumed: a mispaired layout runs fine
    # and silently ruins accuracy.
    w13 = require(w13_t, GateUpLayout.INTERLEAVED, "w13")
    w13_scale = None if w13_scale_t is None else require(w13_scale_t, GateUpLayout.INTERLEAVED, "w13_scale")
    w13_bias = None if w13_bias_t is None else require(w13_bias_t, GateUpLayout.INTERLEAVED, "w13_bias")
    fp8 = x_scale is not None  # e4m3 activations (fp8, a8w4): quantized output too
    w4 = w13.dtype == torch.uint8  # MXFP4 weights (a16w4, a8w4)
    if fp8 != (out_scale is not None) or (w4 or fp8) != (w13_scale is not None):
        raise ValueError("GEMM1: x_scale and out_scale go with e4m3 activations, w13_scale with fp8 or MXFP4 weights")
    num_tokens, hidden = x.shape
    inter = w13.shape[1] // 2
    if fp8 and (block_n != 2 * GROUP or block_k != GROUP):
        raise ValueError(f"fp8 GEMM1 needs block_n=256 and block_k=128 (one 128-group per tile), "
                         f"got block_n={block_n}, block_k={block_k}")
    if w4 and (block_k < 32 or hidden % 32):
        raise ValueError(f"MXFP4 GEMM1 needs block_k >= 32 and H % 32 == 0, got block_k={block_k}, H={hidden}")
    if block_n % 2:
        raise ValueError(f"GEMM1 block_n must be even (gate/up pairs), got {block_n}")
    # MXFP4 at few rows per expert: weight tile as the dot's left operand (see the module docstring)
    swap = w4 and block_m <= 16
    grid = (n_blocks * triton.cdiv(2 * inter, block_n),)
    _gemm1_kernel[grid](
        x, x.stride(0), x_scale if fp8 else x, w13, w13_scale if w13_scale is not None else w13,
        w13_bias if w13_bias is not None else w13, sorted_ids, block_expert,
        out, out_scale if fp8 else out, num_tokens * top_k, top_k, hidden, inter, n_blocks,
        float(alpha), float(limit),
        FP8=fp8, W4=w4, SWAP=swap, OAI=oai, HAS_BIAS=w13_bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=group_m, INTERP=interpreting(), num_warps=num_warps, num_stages=num_stages,
    )
