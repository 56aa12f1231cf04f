"""GEMM2: grouped act @ w2^T over expert row blocks, routing weight and top-k combine in the epilogue.

Combine choice: deterministic, in one launch. Each tile writes its rows' weighted fp32
partials to partial[pair, n-tile] and bumps a per-(token, n-tile) counter; the program
that brings a token's counter to its number of local slots sums that token's partials
in slot order 0..k-1 and writes out[token, n-tile]. The result is bitwise independent
of the programs' finishing order (float atomics would not be), and needs no zeroed
output: the routing launch (or, with pair blocks at T = 1, GEMM1) zeroes the counters, so the
layer stays at three launches (two with pair blocks).

SEPARATE (large T, local output only): the epilogue only stores each weighted (token, slot)
row, in the output dtype, to partial[pair]; a fourth launch (`combine`) sums each token's
local slots in slot order 0..k-1. Same order, so still deterministic; it drops the counter
atomics, the last program's serial k-row read and their registers from GEMM2, and halves
the partial traffic for bf16 output. Below SEPARATE_MIN_PAIRS pairs the counter combine
keeps the layer at three launches.

SPLIT (decode batches, local output, counter combine): program (tile, slice) runs the K slice
[slice * k_span, ...) and stores its weighted rows to partial[slice * pairs + pair]; a token's
counter then completes at SPLIT times its local slots, and the last program sums slot by slot,
slice by slice: still one fixed order. The bias is added by slice 0 only.

REMOTE (symm transport, kernels/transport.py): the rows are other ranks' tokens. For a
source in fused mode each weighted (token, slot) row goes straight into that source's
`slots` row t*k + j; for a source in split mode the token's local slots are combined as
above and the sum goes into the source's `returned` row rank*C + t. `delta[s]` (bytes)
turns a local buffer address into rank s's mapping of it.

MXFP4 weights are MX tiles (kernels/mxfp4.py), decoded in registers, and run swapped as in
GEMM1: the K loop computes out^T = W @ act^T with the decoded weight tile as the dot's left
operand and the accumulator is transposed once after the loop; a8w4 reads MX quads and dots in
fp8 as in GEMM1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from atom_moe.spec import A8W4_INTER_GROUP

from .common import (QGROUP, cast, check_ahead, check_split, checked_ids, interpreting, pdl_options, pdl_wait,
                     prefetch_l2, register_cap, scale_strides, swapped, tile_desc)
from .mainloop import k_loop, tile_expert, tile_finish, tile_rows, tile_start
from .mxfp4 import launch_args, rowexp_arg, scaled_dot

GROUP = 128  # host-side twin of common.QGROUP
# Pair count from which fused_experts combines in a separate launch: on an H200 the separate
# combine won at every point measured, down to 256 pairs (docs/perf/kernels-breakdown-h200.md);
# below that it is unmeasured, and T = 1 must stay at three launches (two with pair blocks, kernels/routing.py).
SEPARATE_MIN_PAIRS = 256
# Bytes of its weight tile a GEMM2 program asks L2 for before it waits under PDL: the programs that start
# while GEMM1 runs (one per free slot, ~132-264 on an H200) then ask for at most ~17-34 MB of its 50 MB L2.
# Untimed: `scripts/launch_ab.py` is the experiment that sets it.
PREFETCH_BYTES = tl.constexpr(128 * 1024)


@dataclass(frozen=True)
class RemoteOutput:
    """Where GEMM2 pushes results for the symm transport (kernels/transport.py layout)."""

    delta: torch.Tensor  # int64 [W]: byte distance to each rank's mapping of this rank's heap
    info: torch.Tensor  # int32 [W, 2]: (tokens sent, combine mode) per source rank
    slots: torch.Tensor  # bf16 [C*k, H]
    returned: torch.Tensor  # bf16 [W*C, H]
    capacity: int
    rank: int

    def args(self) -> tuple:
        """The kernel arguments, in order."""
        return self.delta, self.info, self.slots, self.returned, self.capacity, self.rank


@triton.jit
def _gemm2_kernel(a_ptr, as_ptr, stride_as, stride_as_k, w_ptr, ws_ptr, rowexp_ptr, bias_ptr, sorted_ptr,
                  block_expert_ptr, ids_ptr, emap_ptr, topk_w_ptr, partial_ptr, counters_ptr, n_counters, out_ptr,
                  stride_out, num_pairs, num_experts, hidden, inter, n_blocks,
                  delta_ptr, info_ptr, slots_ptr, returned_ptr, capacity, rank, row_blocks, k_blocks, k_span,
                  a_desc, w_desc, SPLIT: tl.constexpr, FP8: tl.constexpr, W4: tl.constexpr, BIG: tl.constexpr,
                  HAS_BIAS: tl.constexpr, TOPK: tl.constexpr, KP2: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, IGROUP: tl.constexpr, INTERP: tl.constexpr, REMOTE: tl.constexpr,
                  SEPARATE: tl.constexpr, SCALED: tl.constexpr, PAIRS: tl.constexpr, PDL: tl.constexpr,
                  TMA_A: tl.constexpr, TMA_W: tl.constexpr, ROW_SCALE: tl.constexpr, SWAP: tl.constexpr,
                  AHEAD: tl.constexpr):
    pid_m, pid_n, expert = tile_expert(block_expert_ptr, n_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M, ids_ptr,
                                       emap_ptr, num_experts, PAIRS, PDL)
    if AHEAD > 0:  # ask L2 for the weight tile of the program AHEAD places later, so it finds them there
        ahead_n, ahead_expert = ahead_tile(block_expert_ptr, n_blocks, tl.cdiv(hidden, BLOCK_N), GROUP_M, ids_ptr,
                                           emap_ptr, num_experts, PAIRS, AHEAD, PDL)
        if (ahead_expert >= 0) & (SPLIT == 1) & (not INTERP):  # the interpreter runs no PTX; SPLIT: gemm2 refuses
            prefetch_weights(w_ptr, ahead_expert.to(tl.int64), ahead_n, hidden, inter, row_blocks, k_blocks, W4,
                             BLOCK_N)
    if PDL:  # launched while GEMM1 runs: ask L2 for this tile's weights, then wait for GEMM1's output
        if (expert >= 0) & (SPLIT == 1):
            prefetch_weights(w_ptr, expert.to(tl.int64), pid_n, hidden, inter, row_blocks, k_blocks, W4, BLOCK_N)
        pdl_wait(PDL)
    if expert < 0:
        return
    e64 = expert.to(tl.int64)
    rows, pair, row_ok = tile_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M, PAIRS)
    pair64 = pair.to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    # a8w4's activation groups are 64 columns, a K step each (IGROUP)
    a_ptrs, as_ptrs, w_ptrs, w_off, s_off, nb_ok, kb = tile_start(
        a_ptr, rows.to(tl.int64), inter, as_ptr, stride_as, w_ptr, e64, pid_n, n, hidden, inter, row_blocks, k_blocks,
        IGROUP, FP8, W4, BLOCK_N, BLOCK_K, SCALED, SWAP=SWAP)
    ws_lo = ws_ptr  # read only by the fp8 scheme
    ws_hi = ws_ptr
    ws_sel = tl.arange(0, BLOCK_N) >= QGROUP
    if FP8 and not W4:
        # the tile's columns (BLOCK_N <= 256) lie in one or two 128-row blocks of w2: ws_sel marks the second's
        k_groups = tl.cdiv(inter, IGROUP)
        first = pid_n * BLOCK_N // QGROUP
        ws_lo = ws_ptr + e64 * (tl.cdiv(hidden, QGROUP) * k_groups) + first * k_groups
        ws_hi = ws_lo + tl.where((first + 1) * QGROUP < hidden, k_groups, 0)  # no second block: its columns are past H
    tok = pair64 // TOPK
    j = tl.arange(0, KP2)
    if not SEPARATE:
        # Which of this token's slots are local (read before the K loop so the latency hides):
        # their count is the counter value that completes the token.
        slot_ok = row_ok[:, None] & (j[None, :] < TOPK)
        id_ok, gid = checked_ids(tl.load(ids_ptr + tok[:, None] * TOPK + j[None, :], mask=slot_ok, other=-1),
                                 num_experts)
        slot_ok = slot_ok & id_ok
        slot_ok = slot_ok & (tl.load(emap_ptr + gid, mask=slot_ok, other=-1) >= 0)
        needed = tl.sum(slot_ok.to(tl.int32), 1) * SPLIT
    k_lo = 0
    k_hi = inter
    if SPLIT > 1:
        k_lo = tl.program_id(1) * k_span
        k_hi = tl.minimum(k_lo + k_span, inter)
    acc = k_loop(a_ptrs, as_ptrs, stride_as_k, row_ok, w_ptr, ws_ptr, w_ptrs, ws_lo, ws_hi, ws_sel, n_ok, w_off, s_off,
                 nb_ok, kb, k_blocks, inter, k_lo, k_hi, a_desc, pid_m * BLOCK_M, w_desc,
                 (expert * hidden + pid_n * BLOCK_N).to(tl.int32),
                 IGROUP, FP8, W4, BIG, BLOCK_M, BLOCK_N, BLOCK_K, INTERP, SCALED, TMA_A, TMA_W, ROW_SCALE=ROW_SCALE,
                 SWAP=SWAP)
    acc = tile_finish(acc, rowexp_ptr, bias_ptr, e64, n, n_ok, hidden, FP8, W4, HAS_BIAS and SPLIT == 1, SWAP)
    if HAS_BIAS and SPLIT > 1:  # once per row: by slice 0 (the flag as a vector: triton 3.9's interpreter)
        first = (tl.zeros([BLOCK_N], tl.int32) + tl.program_id(1)) == 0
        acc += tl.load(bias_ptr + e64 * hidden + n, mask=n_ok & first, other=0.0)[None, :]
    weight = tl.load(topk_w_ptr + pair64, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * weight[:, None]
    if SEPARATE:  # `combine` sums the rows in a later launch
        tl.store(partial_ptr + pair64[:, None] * hidden + n[None, :], cast(acc, partial_ptr.dtype.element_ty, INTERP),
                 mask=row_ok[:, None] & n_ok[None, :])
    else:
        combine_rows = row_ok
        if REMOTE:
            src = tok // capacity
            t_src = tok - src * capacity
            # heaps are page-aligned and their buffers SYMM_ALIGN-aligned: say so, or the stores go scalar
            d = tl.multiple_of(tl.load(delta_ptr + src, mask=row_ok, other=0) // 2, 16)  # bf16 elements
            fused = row_ok & (tl.load(info_ptr + src * 2 + 1, mask=row_ok, other=0) == 1)
            dst = slots_ptr + d + (t_src * TOPK + (pair64 - tok * TOPK)) * hidden
            tl.store(dst[:, None] + n[None, :], cast(acc, slots_ptr.dtype.element_ty, INTERP),
                     mask=fused[:, None] & n_ok[None, :])
            combine_rows = row_ok & (fused == 0)
            dst_row = returned_ptr + d + (rank * capacity + t_src) * hidden
        else:
            dst_row = out_ptr + tok * stride_out
        tile_mask = combine_rows[:, None] & n_ok[None, :]
        slice_row = pair64
        if SPLIT > 1:
            slice_row += tl.program_id(1) * num_pairs
        tl.store(partial_ptr + slice_row[:, None] * hidden + n[None, :], acc, mask=tile_mask)

        tl.debug_barrier()  # every thread's partial stores precede the release below
        seen = tl.atomic_add(counters_ptr + tok * n_counters + pid_n, tl.full([BLOCK_M], 1, tl.int32),
                             mask=combine_rows, sem="acq_rel", scope="gpu")
        last = combine_rows & (seen == needed - 1)
        if tl.sum(last.to(tl.int32), 0) > 0:
            tl.debug_barrier()  # the acquire above precedes every thread's partial loads
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            # Not unrolled: k live [BLOCK_M, BLOCK_N] tiles would spill. Validity comes from
            # slot_ok (registers), so each step is a single load.
            for s in range(0, TOPK):
                ok = last & (tl.sum(tl.where(j[None, :] == s, slot_ok, False).to(tl.int32), 1) > 0)
                for sl in tl.static_range(SPLIT):
                    p_ptrs = partial_ptr + (tok * TOPK + s + sl * num_pairs)[:, None] * hidden + n[None, :]
                    total += tl.load(p_ptrs, mask=ok[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg")
            tl.store(dst_row[:, None] + n[None, :], cast(total, dst_row.dtype.element_ty, INTERP),
                     mask=last[:, None] & n_ok[None, :])


@triton.jit
def ahead_tile(block_expert_ptr, n_blocks, n_col_tiles, GROUP_M: tl.constexpr, ids_ptr, emap_ptr, num_experts,
               PAIRS: tl.constexpr, AHEAD: tl.constexpr, L2_ONLY: tl.constexpr = False):
    """(pid_n, expert) of the program AHEAD places after this one in the launch; expert -1 where that program is
    idle or past the grid's last. L2_ONLY: read past L1, as tile_expert."""
    ahead_n = 0
    ahead_expert = -1
    if tl.program_id(0) + AHEAD < n_blocks * n_col_tiles:
        _, ahead_n, ahead_expert = tile_expert(block_expert_ptr, n_blocks, n_col_tiles, GROUP_M, ids_ptr, emap_ptr,
                                               num_experts, PAIRS, L2_ONLY, AHEAD)
    return ahead_n, ahead_expert


@triton.jit
def prefetch_weights(w_ptr, e64, pid_n, n_rows, k, row_blocks, k_blocks, W4: tl.constexpr, BLOCK_N: tl.constexpr):
    """L2 prefetch of the first PREFETCH_BYTES of rows [pid_n * BLOCK_N, +BLOCK_N) of expert e64's weight, all of
    K: contiguous bytes in both layouts ([E, N, K] row-major; MX tiles / quads [E, N/16, K/64, 128 words];
    their scales are not fetched)."""
    if W4:
        nb0 = pid_n * (BLOCK_N // 16)
        blocks = tl.minimum(BLOCK_N // 16, row_blocks - nb0)
        start = w_ptr + (e64 * row_blocks + nb0) * k_blocks * 128
        nbytes = blocks.to(tl.int64) * k_blocks * 512
    else:
        n0 = pid_n * BLOCK_N
        rows = tl.minimum(BLOCK_N, n_rows - n0)
        size: tl.constexpr = w_ptr.dtype.element_ty.primitive_bitwidth // 8
        start = w_ptr + (e64 * n_rows + n0) * k
        nbytes = rows.to(tl.int64) * k * size
    prefetch_l2(start, tl.minimum(nbytes, PREFETCH_BYTES), 128)


@triton.jit
def _combine_kernel(partial_ptr, ids_ptr, emap_ptr, out_ptr, stride_out, num_experts, hidden,
                    TOPK: tl.constexpr, KP2: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = h < hidden
    j = tl.arange(0, KP2)
    slot_ok = j < TOPK
    id_ok, gid = checked_ids(tl.load(ids_ptr + t * TOPK + j, mask=slot_ok, other=-1), num_experts)
    slot_ok = slot_ok & id_ok
    slot_ok = slot_ok & (tl.load(emap_ptr + gid, mask=slot_ok, other=-1) >= 0)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in tl.static_range(TOPK):  # slot order: the same sum as the counter combine
        # the slot's flag broadcast to [BLOCK_H] before the mask: triton 3.9's interpreter rejects a
        # mask built from a 0-d reduction result ('mask has unsupported dtype')
        local = (tl.sum(tl.where(j == s, slot_ok, False).to(tl.int32), 0) + tl.zeros([BLOCK_H], tl.int32)) > 0
        total += tl.load(partial_ptr + (t * TOPK + s) * hidden + h, mask=h_ok & local, other=0.0).to(tl.float32)
    # tokens with no local slot get zeros, as the routing launch gives them on the counter path
    tl.store(out_ptr + t * stride_out + h, cast(total, out_ptr.dtype.element_ty, INTERP), mask=h_ok)


def separate_partial(partial: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The fp32 partial workspace [P, H] reinterpreted as [P, H] rows of out's dtype (SEPARATE mode)."""
    if out.element_size() > partial.element_size():
        raise ValueError(f"out dtype {out.dtype} is wider than the partial workspace's {partial.dtype}")
    rows, hidden = partial.shape
    return partial.view(-1).view(out.dtype)[:rows * hidden].view(rows, hidden)


def combine(partial: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor, out: torch.Tensor) -> None:
    """out[t] = sum over t's local slots, in slot order, of partial[t*k + slot] (SEPARATE mode's last launch)."""
    num_tokens, top_k = topk_ids.shape
    hidden = out.shape[1]
    if partial.dtype != out.dtype or partial.shape[0] < num_tokens * top_k or partial.shape[1] != hidden:
        raise ValueError(f"combine: partial {partial.dtype} {tuple(partial.shape)} must be [>= T*k, H] rows of "
                         f"out's dtype {out.dtype} (T={num_tokens}, k={top_k}, H={hidden})")
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        partial, topk_ids, expert_map, out, out.stride(0), expert_map.shape[0], hidden,
        TOPK=top_k, KP2=triton.next_power_of_2(top_k), BLOCK_H=block_h, INTERP=interpreting(), num_warps=4,
    )


def gemm2(a: torch.Tensor, a_scale: torch.Tensor | None, w2: torch.Tensor, w2_scale: torch.Tensor | None,
          w2_bias: torch.Tensor | None, sorted_ids: torch.Tensor, block_expert: torch.Tensor, n_blocks: int,
          topk_ids: torch.Tensor, expert_map: torch.Tensor, topk_weights: torch.Tensor,
          partial: torch.Tensor, counters: torch.Tensor, n_counters: int, out: torch.Tensor, *,
          block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, group_m: int = 8,
          remote: "RemoteOutput | None" = None, separate: bool = False, hidden: int | None = None,
          mx_big: bool = False, w2_rowexp: torch.Tensor | None = None, mx_flush: bool = False,
          split_k: int = 1, maxnreg: int = 0, pairs: bool = False, pdl: bool = False, tma: bool = False,
          row_scale: bool = False, ahead: int = 0) -> None:
    """out[t] = sum_k w[t,k] * (act[row(t,k)] @ w2[e]^T (+bias)), deterministic combine.

    remote: push the results to the source ranks instead of `out` (see the module docstring).
    separate: only write the weighted rows to `partial` (from `separate_partial`); the
    caller then runs `combine`. hidden (H): required for MXFP4, whose MX tiles are padded;
    mx_big: some MXFP4 e8m0 scale is above 128 (a16w4). a8w4's w2 is MX quads, with its row
    exponents w2_rowexp (uint8 [E, H]) and mx_flush (atom_moe/layouts/mx_quads.py). split_k > 1
    splits K (I) that many ways over a second grid axis (decode batches, local counter combine:
    `partial` then holds split_k * T * k rows). maxnreg > 0 caps the registers per thread (NVIDIA).
    pairs: GEMM1 ran with pair blocks (kernels/routing.py `PairBlocks`): row block b is pair b, whose
    activation row is b; sorted_ids / block_expert are unread and n_blocks is T * top_k.
    pdl: launched with programmatic dependent launch after a GEMM1 that releases it early
    (kernels/common.py `pdl`): each program reads its expert and asks L2 for its weight tile
    before it waits for GEMM1. Local output only.
    tma: tiles through TMA descriptors (kernels/common.py `tma`) where TMA can address them: bf16 / fp8 w2's, and
    every scheme's activation rows unless pairs (a pair block's one row is not a run of consecutive rows).
    row_scale (a8w4, Scheme.inter_per_token): each row of `a` has one scale, a_scale's first column (the only one
    read; kernels/inter_quant.py writes it), so the K loop keeps one accumulator.
    ahead > 0: each program first asks L2 (`prefetch_weights`) for the weight tile of the program `ahead` places
    after it in the launch, so that program's loads find its weights in L2 while this one's latency chain (expert,
    rows, K loop, combine) keeps the DRAM stream busy: short-K decode tiles (docs/perf/seed-fp8-h200.md, GLM-5.2-TP8
    fp8 T = 8: 7296 programs of two K steps each, 1.83 TB/s). NVIDIA sm_90+ (or the interpreter, which computes the
    lookahead and skips the prefetch); unsplit only. A hint: the results are the same bytes as without it.
    """
    fp8 = a_scale is not None  # e4m3 activations (fp8, a8w4)
    w4 = w2.dtype == torch.uint8  # MXFP4 weights (a16w4, a8w4): MX tiles [E, H/16, I/64, 512]
    if (w4 or fp8) != (w2_scale is not None):
        raise ValueError("GEMM2: w2_scale goes with fp8 or MXFP4 weights")
    if row_scale and not (w4 and fp8):
        raise ValueError("GEMM2: row_scale (one activation scale per row) is a8w4's (e4m3 activations, MXFP4 weights)")
    num_tokens, top_k = topk_ids.shape
    inter = a.shape[1]
    row_blocks = k_blocks = 0
    if w4:
        if hidden is None:
            raise ValueError("GEMM2: MXFP4 (MX tile) weights need hidden=H: the tiles are padded to 16 rows")
        w2, w2_scale, row_blocks, k_blocks = launch_args("GEMM2", "w2", w2, w2_scale, hidden, inter, block_n, block_k,
                                                         quads=fp8)
        rowexp = rowexp_arg("GEMM2", "w2_rowexp", w2_rowexp, w2.shape[0], hidden) if fp8 else w2
    else:
        if hidden is not None and hidden != w2.shape[1]:
            raise ValueError(f"GEMM2: hidden={hidden} but w2 {tuple(w2.shape)} has {w2.shape[1]} rows")
        hidden = w2.shape[1]
    if not w4 and w2.shape[2] != inter:
        raise ValueError(f"GEMM2: w2 {tuple(w2.shape)} does not match the activation width I={inter}")
    igroup = A8W4_INTER_GROUP if w4 else GROUP
    if fp8 and block_k != igroup:  # one activation scale per K step
        raise ValueError(f"{'a8w4' if w4 else 'fp8'} GEMM2 needs block_k={igroup} (its activation's quant group), "
                         f"got {block_k}")
    if fp8 and not w4 and block_n > 2 * GROUP:  # kernel: the tile's two block scales per K group
        raise ValueError(f"fp8 GEMM2 needs block_n <= {2 * GROUP} (a tile spans at most two {GROUP}-row blocks of "
                         f"w2's scales), got {block_n}")
    if fp8 and a_scale.shape != (a.shape[0], triton.cdiv(inter, igroup)):
        raise ValueError(f"GEMM2: a_scale must be [{a.shape[0]}, ceil(I/{igroup})] for {'a8w4' if w4 else 'fp8'}, "
                         f"got {tuple(a_scale.shape)}")
    if triton.cdiv(hidden, block_n) > n_counters:
        raise ValueError(f"GEMM2 block_n={block_n} needs {triton.cdiv(hidden, block_n)} counters per token, "
                         f"the workspace has {n_counters}")
    if separate and (remote is not None or partial.dtype != out.dtype):
        raise ValueError("GEMM2 separate combine: local output only, partial in out's dtype (separate_partial)")
    if split_k != 1 and (separate or remote is not None):
        raise ValueError(f"GEMM2 split_k={split_k}: split-K runs with the local counter combine only "
                         f"(not separate, not remote)")
    split = check_split("GEMM2", split_k, num_tokens * top_k, hidden, inter, block_k, partial)
    check_ahead("GEMM2", ahead, split, a.device)
    if pdl and remote is not None:
        raise ValueError("GEMM2 pdl: local output only (the symm transport's push keeps plain stream order)")
    if pairs and (n_blocks != num_tokens * top_k or remote is not None):
        raise ValueError(f"GEMM2 pair blocks: n_blocks must be T * top_k = {num_tokens * top_k} (got {n_blocks}), "
                         f"local output only")
    # BIG is each MX layout's one compile-time switch: a16w4's scales above 128, a8w4's flushed blocks
    grid = (n_blocks * triton.cdiv(hidden, block_n), split)
    # MX weights are decoded from each thread's own words: only their activation rows go through TMA
    w_desc = tile_desc(w2, w2.shape[0] * hidden, (block_n, block_k)) if tma and not w4 else None
    a_desc = tile_desc(a, a.shape[0], (block_m, block_k)) if tma and not pairs else None
    _gemm2_kernel[grid](
        a, a_scale if fp8 else a, *scale_strides("GEMM2", "a_scale", a_scale), w2,
        w2_scale if w2_scale is not None else w2, rowexp if w4 else w2,
        w2_bias if w2_bias is not None else w2,
        sorted_ids, block_expert, topk_ids, expert_map, topk_weights, partial, counters, n_counters,
        out, out.stride(0), num_tokens * top_k, expert_map.shape[0], hidden, inter, n_blocks,
        *(remote.args() if remote is not None else (partial,) * 4 + (1, 0)), row_blocks, k_blocks,
        triton.cdiv(triton.cdiv(inter, block_k), split) * block_k, a if a_desc is None else a_desc,
        w2 if w_desc is None else w_desc, SPLIT=split, FP8=fp8, W4=w4, BIG=w4 and (mx_flush if fp8 else mx_big),
        HAS_BIAS=w2_bias is not None, TOPK=top_k,
        KP2=triton.next_power_of_2(top_k),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m, IGROUP=igroup, INTERP=interpreting(),
        REMOTE=remote is not None, SEPARATE=separate, SCALED=w4 and fp8 and scaled_dot(a.device, block_k), PAIRS=pairs,
        PDL=pdl, TMA_A=a_desc is not None, TMA_W=w_desc is not None, ROW_SCALE=row_scale,
        SWAP=not w4 and swapped(block_m, fp8), AHEAD=ahead, num_warps=num_warps,
        num_stages=num_stages,
        **register_cap(maxnreg), **pdl_options(pdl),
    )
