"""GEMM1: grouped x @ w13^T over expert row blocks, SwiGLU in the epilogue, optional fp8 output.

Weights: bf16, fp8 (128x128 block scales) or MXFP4 (a16w4 / a8w4: MX tiles, int32 words of
e2m1 codes + e8m0 scales, decoded in registers by kernels/mxfp4.py).

Token rows are read through the sorted pair list (no permuted copy of x). Small batches can split
K (split_k): decode's few row blocks give fp8's 256-wide tiles fewer programs than SMs (DeepSeek-V3
at T = 1: 128), so each slice of K gets its own program and a second launch adds the slices. w13 rows are
INTERLEAVED (row 2j = gate j, row 2j+1 = up j), so a tile of BLOCK_N rows holds BLOCK_N/2
complete (gate, up) pairs and the activation runs in registers. With e4m3 activations the
tile spans whole quant groups of GEMM2's input, so the epilogue also quantizes it per token
group (IGROUP: 128 for fp8, so BLOCK_N = 256; 64 for a8w4, so BLOCK_N = 128 or 256): GEMM2
then streams e4m3 and needs no prologue work.

MXFP4 (a16w4, a8w4) runs "swapped" at every BLOCK_M: the K loop computes out^T = W @ x^T,
the decoded weight tile [BLOCK_N, BLOCK_K] as the dot's left operand, straight from the
registers the MX tile layout fills, with no shared-memory staging of the weights, and
transposes the accumulator once after the loop, so the epilogue is the same as for bf16/fp8.
On an H200 this beat the weight-as-right-operand orientation 2.3-3.4x at T = 2048 and 8192
(docs/perf/mxfp4-h200.md). a8w4 reads MX quads instead and dots in fp8 (kernels/mxfp4.py) into one
accumulator over all of K: its x has one scale per token (atom_moe.spec.Scheme.x_per_token), applied
with each output row's exponent after the loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_moe.layouts.gate_up import GateUpKind, GateUpLayout, GateUpTensor, LayoutError, require
from atom_moe.spec import A8W4_INTER_GROUP

from .common import (FP8_MAX, QGROUP, cast, check_split, e4m3_scale, interpreting, pdl_options, pdl_release, pdl_wait,
                     register_cap, scale_strides, swapped, tile_desc)
from .mainloop import gated_act, k_loop, tile_expert, tile_finish, tile_rows, tile_start
from .mxfp4 import launch_args, rowexp_arg, scaled_dot
from .routing import PairBlocks, local_slots, quant_row, row_scale, zero_counters, zero_row

GROUP = 128  # host-side twin of common.QGROUP


@triton.jit
def _gemm1_kernel(x_ptr, stride_x, xs_ptr, stride_xs, stride_xs_k, w_ptr, ws_ptr, rowexp_ptr, bias_ptr, sorted_ptr,
                  block_expert_ptr, out_ptr, outs_ptr, stride_os, stride_os_k, num_pairs, top_k, hidden, inter,
                  n_blocks, alpha, limit, row_blocks, k_blocks,
                  part_ptr, k_span, ids_ptr, emap_ptr, num_experts, src_ptr, stride_src, counters_ptr, n_counters,
                  layer_out_ptr, stride_layer_out, w_desc,
                  SPLIT: tl.constexpr, PHASE: tl.constexpr, FP8: tl.constexpr, W4: tl.constexpr,
                  BIG: tl.constexpr, OAI: tl.constexpr, CLAMP: tl.constexpr,
                  HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, IGROUP: tl.constexpr, INTERP: tl.constexpr, SCALED: tl.constexpr,
                  PAIRS: tl.constexpr, KP2: tl.constexpr, HG: tl.constexpr, PDL_WAIT: tl.constexpr,
                  PDL_RELEASE: tl.constexpr, TMA_W: tl.constexpr, QOUT: tl.constexpr, SWAP: tl.constexpr):
    # PDL (kernels/common.py): wait for the launch before (it may still run), then let GEMM2 start; GEMM2 reads
    # nothing of ours before its own wait
    pdl_wait(PDL_WAIT)
    pdl_release(PDL_RELEASE)
    n_out = 2 * inter
    pid_m, pid_n, expert = tile_expert(block_expert_ptr, n_blocks, tl.cdiv(n_out, BLOCK_N), GROUP_M, ids_ptr,
                                       emap_ptr, num_experts, PAIRS)
    # a8w4's pair blocks read the bf16 row and round it in the K loop to the row's one scale (k_loop QUANT_A): with
    # a quantized copy, every program stored the same row before a barrier and read it back (fp8 still does: its
    # scale per 128-group would cost each K step a reduction)
    QUANT_A: tl.constexpr = PAIRS and FP8 and W4 and PHASE != 2
    if PAIRS and PHASE != 2:  # no routing launch ran: its per-token work is done here (kernels/routing.py)
        token_duties(pid_m, pid_n, expert, ids_ptr, emap_ptr, num_experts, src_ptr, stride_src, x_ptr, xs_ptr,
                     counters_ptr, n_counters, layer_out_ptr, stride_layer_out, hidden, top_k, KP2,
                     FP8 and not W4, HG, INTERP)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    rows, pair, row_ok = tile_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M, PAIRS)
    tok = (pair // top_k).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    a_scale = 1.0
    if QUANT_A:
        a_scale = row_scale((pid_m // top_k).to(tl.int64), src_ptr, stride_src, hidden, QGROUP, HG)
        a_ptrs, as_ptrs, w_ptrs, w_off, s_off, nb_ok, kb = tile_start(
            src_ptr, tok, stride_src, xs_ptr, stride_xs, w_ptr, e64, pid_n, n, n_out, hidden, row_blocks, k_blocks,
            QGROUP, FP8, W4, BLOCK_N, BLOCK_K, SCALED, PAIRED=True)
    else:
        a_ptrs, as_ptrs, w_ptrs, w_off, s_off, nb_ok, kb = tile_start(
            x_ptr, tok, stride_x, xs_ptr, stride_xs, w_ptr, e64, pid_n, n, n_out, hidden, row_blocks, k_blocks,
            QGROUP, FP8, W4, BLOCK_N, BLOCK_K, SCALED, PAIRED=FP8 and W4, SWAP=SWAP)  # a8w4: residuals paired
    ws_lo = ws_ptr  # read only by the fp8 scheme
    ws_hi = ws_ptr
    ws_sel = tl.arange(0, BLOCK_N) % 2 == 1
    if FP8 and not W4:
        # output pair j = n // 2 uses scale [e, j // 128, n % 2, kb]; the tile (BLOCK_N = 256) is pair group
        # pid_n: its gate rows (even n) share one scale per K group, its up rows (ws_sel) another
        k_groups = tl.cdiv(hidden, QGROUP)
        ws_lo = ws_ptr + e64 * (tl.cdiv(inter, QGROUP) * 2 * k_groups) + pid_n * (2 * k_groups)
        ws_hi = ws_lo + k_groups
    # PHASE 0: the whole K. Split-K (decode: too few tiles to fill the SMs), PHASE 1: program (tile, s)
    # stores the fp32 sum over its K slice [s * k_span, (s + 1) * k_span) to part[s, pair]; PHASE 2 (a
    # second launch, one program per tile) adds the SPLIT slices in order s = 0, 1, ... (deterministic)
    # and runs the epilogue below.
    # MXFP4's (and SWAP's) accumulator is out^T [BLOCK_N, BLOCK_M] until tile_finish: its slices go through part
    # transposed, so the slice sum is exact in either orientation.
    if W4 or SWAP:
        p_ptrs = part_ptr + pair.to(tl.int64)[None, :] * n_out + n[:, None]
        p_mask = n_ok[:, None] & row_ok[None, :]
    else:
        p_ptrs = part_ptr + pair.to(tl.int64)[:, None] * n_out + n[None, :]
        p_mask = row_ok[:, None] & n_ok[None, :]
    slab = num_pairs.to(tl.int64) * n_out  # one K slice's rows
    if PHASE == 2:
        if W4 or SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(SPLIT):
            acc += tl.load(p_ptrs + s * slab, mask=p_mask, other=0.0)
    else:
        k_lo = 0
        k_hi = hidden
        if PHASE == 1:
            k_lo = tl.program_id(1) * k_span
            k_hi = tl.minimum(k_lo + k_span, hidden)
        acc = k_loop(a_ptrs, as_ptrs, stride_xs_k, row_ok, w_ptr, ws_ptr, w_ptrs, ws_lo, ws_hi, ws_sel, n_ok, w_off,
                     s_off, nb_ok, kb, k_blocks, hidden, k_lo, k_hi, x_ptr, 0, w_desc,
                     (expert * n_out + pid_n * BLOCK_N).to(tl.int32),
                     QGROUP, FP8, W4, BIG, BLOCK_M, BLOCK_N, BLOCK_K, INTERP, SCALED, TMA_W=TMA_W,
                     PAIRED=FP8 and W4, ROW_SCALE=FP8 and W4, a_scale=a_scale, QUANT_A=QUANT_A, SWAP=SWAP)
        if PHASE == 1:
            tl.store(p_ptrs + tl.program_id(1) * slab, acc, mask=p_mask)
            return
    acc = tile_finish(acc, rowexp_ptr, bias_ptr, e64, n, n_ok, n_out, FP8, W4, HAS_BIAS, SWAP)
    j = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    j_ok = j < inter
    act = gated_act(acc, alpha, limit, j_ok, OAI, CLAMP, BLOCK_M, BLOCK_N)
    rows64 = rows.to(tl.int64)
    o_mask = row_ok[:, None] & j_ok[None, :]
    o_ptrs = out_ptr + rows64[:, None] * inter + j[None, :]
    if QOUT:
        # this tile holds the whole groups pid_n * NG .. + NG - 1 of each row
        NG: tl.constexpr = BLOCK_N // 2 // IGROUP
        grouped = tl.reshape(act, [BLOCK_M, NG, IGROUP])
        amax = tl.max(tl.abs(grouped), 2)
        scale = e4m3_scale(amax, tl.sum(tl.abs(grouped) * 0.0, 2))
        q = tl.reshape(tl.clamp(grouped / scale[:, :, None], -FP8_MAX, FP8_MAX), [BLOCK_M, BLOCK_N // 2])
        tl.store(o_ptrs, cast(q, out_ptr.dtype.element_ty, INTERP), mask=o_mask)
        g = pid_n * NG + tl.arange(0, NG)
        tl.store(outs_ptr + rows64[:, None] * stride_os + g[None, :] * stride_os_k, scale,
                 mask=row_ok[:, None] & (g < tl.cdiv(inter, IGROUP))[None, :])
    else:
        tl.store(o_ptrs, cast(act, out_ptr.dtype.element_ty, INTERP), mask=o_mask)


@triton.jit
def token_duties(pid_m, pid_n, expert, ids_ptr, emap_ptr, num_experts, src_ptr, stride_src, xq_ptr, xs_ptr,
                 counters_ptr, n_counters, out_ptr, stride_out, hidden, top_k, KP2: tl.constexpr,
                 QUANT: tl.constexpr, HG: tl.constexpr, INTERP: tl.constexpr):
    """The routing launch's per-token work for pair block pid_m (pair pid_m, token pid_m // top_k).

    The token's first pair, column tile 0, first K slice zeroes the token's combine counters and,
    when no slot is local, its output row. With fp8's e4m3 activations (QUANT) every program with work
    quantizes the token's row into xq / xs itself (the same bytes whichever program writes them) and reads it
    back after a barrier: no program waits on another. (a8w4 rounds the row in its K loop: k_loop QUANT_A.)
    """
    tok = (pid_m // top_k).to(tl.int64)
    if (pid_m % top_k == 0) & (pid_n == 0) & (tl.program_id(1) == 0):
        zero_counters(tok, counters_ptr, n_counters, 256)
        if local_slots(tok, ids_ptr, emap_ptr, num_experts, ids_ptr, 1, top_k, KP2, False) == 0:
            zero_row(tok, 0, out_ptr, stride_out, hidden, QGROUP, HG)
    if QUANT:
        if expert >= 0:
            quant_row(tok, 0, src_ptr, stride_src, xq_ptr, xs_ptr, hidden, QGROUP, HG, INTERP)
            tl.debug_barrier()  # this program's K loop reads the row back


def gemm1(x: torch.Tensor, x_scale: torch.Tensor | None, w13_t: GateUpTensor, w13_scale_t: GateUpTensor | None,
          w13_bias_t: GateUpTensor | None, sorted_ids: torch.Tensor, block_expert: torch.Tensor, n_blocks: int,
          top_k: int, out: torch.Tensor, out_scale: torch.Tensor | None, *, oai: bool, alpha: float,
          limit: float, block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int,
          group_m: int = 8, mx_big: bool = False, w13_rowexp_t: GateUpTensor | None = None,
          mx_flush: bool = False, clamp: bool = False, split_k: int = 1,
          partial: torch.Tensor | None = None, maxnreg: int = 0, pairs: PairBlocks | None = None,
          pdl: bool = False, tma: bool = False, slices_only: bool = False) -> None:
    """out[row, :I] = act(x[token(row)] @ w13[expert(row)]^T (+bias)), fp8-quantized when out_scale is given.

    act: silu(gate) * up; with clamp (DeepSeek-V4) gate <= limit and |up| <= limit first; with oai
    gpt-oss's clamped gate * sigmoid(alpha * gate) * (up + 1).

    MXFP4 w13 comes as MX tiles (a16w4; mx_big: some e8m0 scale is above 128) or, with e4m3
    activations (a8w4: one scale per token, x_scale's first column, the only one read), as MX quads with
    paired residuals and their row exponents w13_rowexp_t (mx_flush: some
    blocks are flushed, atom_moe/layouts/mx_quads.py). split_k > 1 splits K that many
    ways over a second grid axis and adds the slices in a second launch, through `partial` (fp32,
    >= split_k * T * top_k * 2I elements: GEMM2's scratch, free while GEMM1 runs; allocate_workspace
    sizes it for split-K at decode batches). maxnreg > 0 caps the registers per thread (NVIDIA).
    pairs: no routing launch ran (kernels/routing.py `PairBlocks`); sorted_ids / block_expert are
    unread, n_blocks is T * top_k, and with fp8's e4m3 activations x / x_scale are the buffers GEMM1 fills
    from pairs.x (a8w4's K loop rounds pairs.x itself and reads neither).
    pdl: programmatic dependent launch (kernels/common.py `pdl`): the launch waits on the routing launch
    before it (not with pairs: its predecessor is not ours) and releases the next (GEMM2, or split-K's
    second launch) at its start.
    slices_only: with split_k > 1, the first launch alone: `partial` then holds the K slices and `out` is unwritten
    (a8w4 with a bf16 out: kernels/inter_quant.py `finish_rows` adds, activates and quantizes them in one launch).
    tma: bf16 / fp8 weight tiles through a TMA descriptor (kernels/common.py `tma`) where TMA can address
    w13 (else, and for MXFP4, per-thread loads); token rows are gathered, so x is always read per thread.
    """
    # The pairing of gate and up rows is checked, never assumed: a mispaired layout runs fine
    # and silently ruins accuracy.
    w13 = require(w13_t, GateUpLayout.INTERLEAVED, "w13")
    w13_scale = None if w13_scale_t is None else require(w13_scale_t, GateUpLayout.INTERLEAVED, "w13_scale")
    w13_bias = None if w13_bias_t is None else require(w13_bias_t, GateUpLayout.INTERLEAVED, "w13_bias")
    fp8 = x_scale is not None  # e4m3 activations (fp8, a8w4): quantized output too, but a8w4's may be bf16
    w4 = w13.dtype == torch.uint8  # MXFP4 weights (a16w4, a8w4)
    qout = out_scale is not None
    wide = fp8 and w4 and not qout  # a8w4, Scheme.inter_per_token: bf16 out, kernels/inter_quant.py quantizes it
    if (fp8 != qout and not wide) or (w4 or fp8) != (w13_scale is not None):
        raise ValueError("GEMM1: x_scale and out_scale go with e4m3 activations (a8w4 may leave out_scale out for a "
                         "bf16 out), w13_scale with fp8 or MXFP4 weights")
    if out.dtype != (torch.float8_e4m3fn if qout else torch.bfloat16):
        raise ValueError(f"GEMM1: out must be {'e4m3' if qout else 'bf16'} here, got {out.dtype}")
    num_tokens, hidden = x.shape
    inter = out.shape[1] if w4 else w13.shape[1] // 2
    row_blocks = k_blocks = 0
    rowexp = w13
    if w4:
        kind = GateUpKind.MX_QUADS if fp8 else GateUpKind.MX_TILES
        if w13_t.kind is not kind or w13_scale_t.kind is not kind:
            raise LayoutError(f"GEMM1: MXFP4 w13 and w13_scale must be {kind.value} for "
                              f"{'a8w4' if fp8 else 'a16w4'} (built by atom_moe.weights for that scheme), "
                              f"got {w13_t.kind.value} / {w13_scale_t.kind.value}")
        w13, w13_scale, row_blocks, k_blocks = launch_args("GEMM1", "w13", w13, w13_scale, 2 * inter, hidden,
                                                           block_n, block_k, quads=fp8, paired=fp8)
        if fp8:
            rowexp = rowexp_arg("GEMM1", "w13_rowexp", None if w13_rowexp_t is None else
                                require(w13_rowexp_t, GateUpLayout.INTERLEAVED, "w13_rowexp"), w13.shape[0], 2 * inter)
    # the output tile holds whole quant groups of GEMM2's input; a8w4 may step K by 64 (its scale is
    # applied per step)
    igroup = A8W4_INTER_GROUP if w4 else GROUP
    if fp8 and (block_n not in ((128, 256) if w4 else (256,)) or block_k not in ((64, GROUP) if w4 else (GROUP,))):
        raise ValueError(f"{'a8w4' if w4 else 'fp8'} GEMM1 needs block_n={'128 or 256' if w4 else '256'} and "
                         f"block_k={'64 or 128' if w4 else '128'} (whole {igroup}-groups of its output per tile), "
                         f"got block_n={block_n}, block_k={block_k}")
    if qout and out_scale.shape != (out.shape[0], triton.cdiv(inter, igroup)):
        raise ValueError(f"GEMM1: out_scale must be [{out.shape[0]}, ceil(I/{igroup})] for "
                         f"{'a8w4' if w4 else 'fp8'}, got {tuple(out_scale.shape)}")
    if oai and clamp:
        raise ValueError("GEMM1: oai already clamps; pass clamp only for clamped SiLU (swiglu_clamp)")
    if block_n % 2:
        raise ValueError(f"GEMM1 block_n must be even (gate/up pairs), got {block_n}")
    split = check_split("GEMM1", split_k, num_tokens * top_k, 2 * inter, hidden, block_k, partial)
    if slices_only and (split == 1 or not wide):
        raise ValueError(f"GEMM1 slices_only leaves the slice sum to inter_quant.finish_rows: it needs split_k > 1 "
                         f"and a8w4 with a bf16 out, got split_k={split_k}"
                         f"{'' if wide else ' and a scheme or output other than that'}")
    if pairs is not None:
        _check_pairs(pairs, num_tokens, top_k, hidden, n_blocks)
        if fp8 and not w4 and (x.stride(0) != hidden or not x_scale.is_contiguous()):
            raise ValueError("GEMM1 pair blocks: fp8's x and x_scale are the e4m3 buffers GEMM1 fills; they must be "
                             "contiguous")
    # BIG is each MX layout's one compile-time switch: a16w4's scales above 128, a8w4's flushed blocks
    tiles = n_blocks * triton.cdiv(2 * inter, block_n)
    w_desc = tile_desc(w13, w13.shape[0] * w13.shape[1], (block_n, block_k)) if tma and not w4 else None
    xs_strides = scale_strides("GEMM1", "x_scale", x_scale)
    os_strides = scale_strides("GEMM1", "out_scale", out_scale)
    args = (x, x.stride(0), x_scale if fp8 else x, *xs_strides, w13, w13_scale if w13_scale is not None else w13,
            rowexp, w13_bias if w13_bias is not None else w13, sorted_ids, block_expert,
            out, out_scale if qout else out, *os_strides, num_tokens * top_k, top_k, hidden, inter, n_blocks,
            float(alpha), float(limit), row_blocks, k_blocks,
            partial if split > 1 else out, triton.cdiv(triton.cdiv(hidden, block_k), split) * block_k,
            *_pair_args(pairs, out), w_desc if w_desc is not None else w13)
    meta = dict(SPLIT=split, FP8=fp8, W4=w4, BIG=w4 and (mx_flush if fp8 else mx_big), OAI=oai,
                CLAMP=clamp, HAS_BIAS=w13_bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                GROUP_M=group_m, IGROUP=igroup, INTERP=interpreting(),
                SCALED=w4 and fp8 and scaled_dot(x.device, block_k), PAIRS=pairs is not None,
                # the token's slots and its row in 128-groups (pair blocks only: 1 keeps other launches as they were)
                KP2=1 if pairs is None else triton.next_power_of_2(top_k),
                HG=1 if pairs is None else triton.next_power_of_2(triton.cdiv(hidden, GROUP)),
                TMA_W=w_desc is not None, QOUT=qout, SWAP=not w4 and swapped(block_m, fp8),
                num_warps=num_warps, num_stages=num_stages,
                **register_cap(maxnreg))
    first = pdl and pairs is None  # the routing launch came just before
    phases = [(0, (tiles,))] if split == 1 else [(1, (tiles, split))] if slices_only else \
        [(1, (tiles, split)), (2, (tiles,))]
    for phase, grid in phases:
        wait = first if phase < 2 else pdl
        _gemm1_kernel[grid](*args, PHASE=phase, PDL_WAIT=wait, PDL_RELEASE=pdl, **meta, **pdl_options(wait))


def _pair_args(pairs: PairBlocks | None, unused: torch.Tensor) -> tuple:
    """The kernel's pair-block arguments (unread placeholders without pair blocks)."""
    if pairs is None:
        return unused, unused, 0, unused, 0, unused, 0, unused, 0
    return (pairs.topk_ids, pairs.expert_map, pairs.expert_map.shape[0], pairs.x, pairs.x.stride(0), pairs.counters,
            pairs.n_counters, pairs.out, pairs.out.stride(0))


def _check_pairs(pairs: PairBlocks, num_tokens: int, top_k: int, hidden: int, n_blocks: int) -> None:
    """Raise ValueError unless `pairs` fits a GEMM1 call over num_tokens tokens of width hidden."""
    x, out, ids = pairs.x, pairs.out, pairs.topk_ids
    if tuple(ids.shape) != (num_tokens, top_k) or n_blocks != num_tokens * top_k:
        raise ValueError(f"GEMM1 pair blocks: topk_ids {tuple(ids.shape)} and n_blocks={n_blocks} must be "
                         f"[{num_tokens}, {top_k}] and T * top_k = {num_tokens * top_k}")
    if x.shape != (num_tokens, hidden) or out.shape != (num_tokens, hidden) or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"GEMM1 pair blocks: x {tuple(x.shape)} and out {tuple(out.shape)} must be [{num_tokens}, "
                         f"{hidden}] with a contiguous last dim")
    if pairs.counters.dtype != torch.int32 or pairs.counters.numel() < num_tokens * pairs.n_counters:
        raise ValueError(f"GEMM1 pair blocks: counters must be int32 with >= {num_tokens} * {pairs.n_counters} "
                         f"elements, got {pairs.counters.dtype} {pairs.counters.numel()}")
