"""One-sided expert-parallel transport kernels over peer-mapped ("symmetric") buffers.

Every rank owns one heap with the same layout; `delta[r]` is the byte distance from this
rank's heap to rank r's mapping of its heap, so `buf_ptr + delta[r] // elt` addresses
rank r's copy of `buf` (plain loads and stores: NVLink peer mappings on GPUs, shared
files on the CPU, or several heaps of one process in tests). With W ranks, capacity C
per source rank and top-k = k, the receive side of every rank holds, per source s and
token t, row s*C + t:
    recv_x     [W*C, H] wire dtype   token row (bf16, or e4m3 with recv_scale [W*C, G])
    recv_ids   [W*C, k] int32        global ids of the slots this rank owns, -1 elsewhere
    recv_w     [W*C, k] fp32         routing weights
    recv_info  [W, 2]   int32        (tokens sent by s, combine mode of s)
and the source side of every rank holds
    slots      [C*k, H] bf16         fused mode: weighted row of (token, slot), written by its owner
    returned   [W*C, H] bf16         split mode: row r*C + t = rank r's sum over its slots of token t
    flags      [W]      int64        barrier epochs signalled by each peer; epoch [1] this rank's count
Kernels here: `dispatch` (push rows and metadata), `barrier` (epoch flags) and `combine`
(sum what came back). GEMM2's epilogue (kernels/gemm2.py, REMOTE) does the pushes back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP8_MAX, cast, checked_ids, e4m3_scale, interpreting

FUSED, SPLIT = 1, 0  # combine modes, as stored in recv_info[:, 1]
SPIN_LIMIT = 1 << 30  # barrier polls before giving up and raising the error flag


@triton.jit
def _dispatch_kernel(x_ptr, stride_x, ids_ptr, w_ptr, owner_ptr, delta_ptr,
                     rx_ptr, rs_ptr, rid_ptr, rw_ptr, info_ptr,
                     num_tokens, num_experts, hidden, rank, world, capacity, mode,
                     TOPK: tl.constexpr, KP2: tl.constexpr, FP8: tl.constexpr, ROW_SCALE: tl.constexpr,
                     GP2: tl.constexpr, GROUP: tl.constexpr, EMULATE: tl.constexpr):
    # One program per token: read the row once (quantize once for the fp8 wire), then for
    # every rank write the metadata (always: ids not owned there become -1) and the row
    # (only where one of its experts lives: a token reaches a rank at most once).
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    j = tl.arange(0, KP2)
    # (j * 0 + t) < num_tokens: the program's bound as a [KP2] vector, since triton 3.9's interpreter
    # rejects a mask that mixes a vector with a 0-d comparison ('mask has unsupported dtype')
    jm = j < TOPK
    live = jm & ((j * 0 + t) < num_tokens)  # this program has a token to read
    valid, gid = checked_ids(tl.load(ids_ptr + t64 * TOPK + j, mask=live, other=-1), num_experts)
    owner = tl.load(owner_ptr + gid, mask=valid, other=-1)
    wt = tl.load(w_ptr + t64 * TOPK + j, mask=live, other=0.0).to(tl.float32)
    g = tl.arange(0, GP2)
    col = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    cm = col < hidden
    v = tl.load(x_ptr + t64 * stride_x + col, mask=cm & ((col * 0 + t) < num_tokens), other=0.0)
    n_groups = tl.cdiv(hidden, GROUP)
    if FP8:
        vf = v.to(tl.float32)
        amax = tl.max(tl.abs(vf), 1)
        nan = tl.sum(tl.abs(vf) * 0.0, 1)
        if ROW_SCALE:  # one scale for the whole row (a8w4), stored once per group
            amax = tl.zeros([GP2], tl.float32) + tl.max(amax, 0)
            nan = tl.zeros([GP2], tl.float32) + tl.sum(nan, 0)
        scale = e4m3_scale(amax, nan)
        row = cast(tl.clamp(vf / scale[:, None], -FP8_MAX, FP8_MAX), rx_ptr.dtype.element_ty, EMULATE)
    else:
        row = cast(v.to(tl.float32), rx_ptr.dtype.element_ty, EMULATE)
    slot = (rank * capacity + t).to(tl.int64)
    for r in range(0, world):
        d = tl.load(delta_ptr + r)
        if t < num_tokens:
            mine = owner == r
            tl.store(rid_ptr + d // 4 + slot * TOPK + j, tl.where(mine, gid, -1), mask=jm)
            tl.store(rw_ptr + d // 4 + slot * TOPK + j, wt, mask=jm)
            if tl.sum(mine.to(tl.int32), 0) > 0:
                if FP8:
                    tl.store(rx_ptr + d + slot * hidden + col, row, mask=cm)
                    tl.store(rs_ptr + d // 4 + slot * n_groups + g, scale, mask=g < n_groups)
                else:
                    tl.store(rx_ptr + d // 2 + slot * hidden + col, row, mask=cm)
        if t == 0:
            tl.store(info_ptr + d // 4 + rank * 2, num_tokens)
            tl.store(info_ptr + d // 4 + rank * 2 + 1, mode)


@triton.jit
def _barrier_kernel(flags_ptr, epoch_ptr, error_ptr, delta_ptr, rank, world,
                    SIGNAL: tl.constexpr, WAIT: tl.constexpr, SPIN: tl.constexpr):
    # Epochs only grow, so a peer that already signalled the next barrier still satisfies
    # this one; graph replays therefore run back to back with no reset.
    e = tl.load(epoch_ptr) + 1
    if SIGNAL:
        for r in range(0, world):
            d = tl.load(delta_ptr + r)
            tl.atomic_max(flags_ptr + d // 8 + rank, e, sem="release", scope="sys")
    if WAIT:
        for r in range(0, world):
            seen = tl.atomic_add(flags_ptr + r, 0, sem="acquire", scope="sys")
            polls = 0
            while (seen < e) & (polls < SPIN):
                seen = tl.atomic_add(flags_ptr + r, 0, sem="acquire", scope="sys")
                polls += 1
            if seen < e:  # a peer never arrived: flag it (checked on the host) instead of hanging
                tl.atomic_add(error_ptr, 1)
        tl.store(epoch_ptr, e)


@triton.jit
def _combine_kernel(ids_ptr, owner_ptr, slots_ptr, returned_ptr, out_ptr, stride_out,
                    num_experts, hidden, capacity, world,
                    TOPK: tl.constexpr, KP2: tl.constexpr, FUSED_MODE: tl.constexpr,
                    BLOCK_H: tl.constexpr, EMULATE: tl.constexpr):
    # Fixed summation order (slots 0..k-1, or ranks 0..W-1): the result does not depend on
    # which rank finished first.
    t = tl.program_id(0)
    t64 = t.to(tl.int64)
    n = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    nm = n < hidden
    j = tl.arange(0, KP2)
    valid, gid = checked_ids(tl.load(ids_ptr + t64 * TOPK + j, mask=j < TOPK, other=-1), num_experts)
    owner = tl.load(owner_ptr + gid, mask=valid, other=-1)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    if FUSED_MODE:
        for s in range(0, TOPK):
            ok = tl.sum(tl.where(j == s, owner >= 0, False).to(tl.int32), 0) > 0
            if ok:
                acc += tl.load(slots_ptr + (t64 * TOPK + s) * hidden + n, mask=nm, other=0.0).to(tl.float32)
    else:
        for r in range(0, world):
            if tl.sum((owner == r).to(tl.int32), 0) > 0:
                row = (r * capacity + t).to(tl.int64)
                acc += tl.load(returned_ptr + row * hidden + n, mask=nm, other=0.0).to(tl.float32)
    tl.store(out_ptr + t64 * stride_out + n, cast(acc, out_ptr.dtype.element_ty, EMULATE), mask=nm)


def dispatch(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, owner: torch.Tensor,
             delta: torch.Tensor, recv_x: torch.Tensor, recv_scale: torch.Tensor | None, recv_ids: torch.Tensor,
             recv_w: torch.Tensor, recv_info: torch.Tensor, *, rank: int, capacity: int, mode: int,
             row_scale: bool = False) -> None:
    """Push this rank's tokens into every owner's receive rows (s*C + t) and its token count.

    With recv_scale (the fp8 wire) rows go as e4m3, one scale per 128-group, or with row_scale one per row stored
    once per group (a8w4: atom_moe.spec.Scheme.x_per_token)."""
    num_tokens, top_k = topk_ids.shape
    hidden, world = x.shape[1], delta.shape[0]
    fp8 = recv_scale is not None
    # one program even for 0 tokens: it still tells every peer that nothing came
    _dispatch_kernel[(max(num_tokens, 1),)](
        x, x.stride(0), topk_ids, topk_weights, owner, delta,
        recv_x, recv_scale if fp8 else recv_ids, recv_ids, recv_w, recv_info,
        num_tokens, owner.shape[0] - 1, hidden, rank, world, capacity, mode,
        TOPK=top_k, KP2=triton.next_power_of_2(top_k), FP8=fp8, ROW_SCALE=fp8 and row_scale,
        GP2=triton.next_power_of_2(triton.cdiv(hidden, 128)), GROUP=128, EMULATE=interpreting(),
        num_warps=4,
    )


def barrier(flags: torch.Tensor, epoch: torch.Tensor, error: torch.Tensor, delta: torch.Tensor, *, rank: int,
            signal: bool = True, wait: bool = True, spin: int = SPIN_LIMIT) -> None:
    """Signal every peer that this rank reached the barrier and/or wait until all peers did."""
    _barrier_kernel[(1,)](flags, epoch, error, delta, rank, delta.shape[0],
                          SIGNAL=signal, WAIT=wait, SPIN=spin, num_warps=1)


def combine(topk_ids: torch.Tensor, owner: torch.Tensor, slots: torch.Tensor, returned: torch.Tensor,
            out: torch.Tensor, *, capacity: int, world: int, mode: int) -> None:
    """out[t] = sum of the expert results that came back for token t (fixed order)."""
    num_tokens, top_k = topk_ids.shape
    if num_tokens == 0:
        return
    hidden = out.shape[1]
    block_h = min(triton.next_power_of_2(hidden), 1024)
    _combine_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        topk_ids, owner, slots, returned, out, out.stride(0), owner.shape[0] - 1, hidden, capacity, world,
        TOPK=top_k, KP2=triton.next_power_of_2(top_k), FUSED_MODE=mode == FUSED, BLOCK_H=block_h,
        EMULATE=interpreting(), num_warps=4,
    )
