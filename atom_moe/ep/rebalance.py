"""Rebalancing in place: copy expert weights between physical slots, keeping every tensor's address.

A move (src, dst) copies the weights of global slot src (under the old placement) into
global slot dst; slot s lives on rank s // S (S slots per rank). Each slot tensor of a
layer (w13, w2 and their scales, biases, row exponents: leading dim S) is moved as rows of
bytes, so every dtype (fp8, MX tiles) travels alike. Sources are read before any row is
written, so a slot may be both a source and a destination. Captured CUDA graphs keep
reading the same addresses: they see the new weights after the copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..layouts.gate_up import GateUpTensor
from ..spec import Scheme
from ..weights import PreparedWeights, _scale_max


def slot_tensors(weights: PreparedWeights) -> list[torch.Tensor]:
    """Every tensor of a layer with one row per local slot (expert_map, which is static, excluded)."""
    out = []
    for t in (weights.w13, weights.w13_scale, weights.w2, weights.w2_scale, weights.w13_bias, weights.w2_bias,
              weights.w13_rowexp, weights.w2_rowexp):
        if t is not None:
            out.append(t.data if isinstance(t, GateUpTensor) else t)
    return out


def _rows(t: torch.Tensor, slots: int) -> torch.Tensor:
    """The same memory as uint8 [slots, bytes per slot] (a view: writes land in t)."""
    if not t.is_contiguous() or t.shape[0] != slots:
        raise ValueError(f"slot tensor {tuple(t.shape)} must be contiguous with {slots} rows (one per local slot)")
    return t.view(torch.uint8).view(slots, -1)


def move_slots(layers: Sequence[PreparedWeights], moves: list[tuple[int, int]], rank: int, world: int,
               slots_per_rank: int, group: dist.ProcessGroup | None = None) -> None:
    """Apply `moves` to this rank's layers in place; collective over `group` when world > 1."""
    S = slots_per_rank
    send_idx = [[s - rank * S for s, d in moves if s // S == rank and d // S == q] for q in range(world)]
    recv_idx = [[d - rank * S for s, d in moves if d // S == rank and s // S == q] for q in range(world)]
    for weights in layers:
        for t in slot_tensors(weights):
            rows = _rows(t, S)
            src = torch.tensor([i for idx in send_idx for i in idx], dtype=torch.int64, device=rows.device)
            dst = torch.tensor([i for idx in recv_idx for i in idx], dtype=torch.int64, device=rows.device)
            sent = rows.index_select(0, src)  # a copy: read before any slot is overwritten
            if world == 1:
                got = sent
            else:
                got = rows.new_empty(dst.numel(), rows.shape[1])
                dist.all_to_all_single(got, sent, [len(i) for i in recv_idx], [len(i) for i in send_idx],
                                       group=group)
            rows.index_copy_(0, dst, got)


def move_slots_in_process(layers_per_rank: Sequence[PreparedWeights], moves: list[tuple[int, int]],
                          slots_per_rank: int) -> None:
    """Apply `moves` to one layer held by W simulated ranks in this process (atom_moe.ep.simulate)."""
    S = slots_per_rank
    tensors = [slot_tensors(w) for w in layers_per_rank]
    for i in range(len(tensors[0])):
        rows = [_rows(ts[i], S) for ts in tensors]
        staged = [rows[s // S][s % S].clone() for s, _ in moves]  # read every source first
        for (_, d), row in zip(moves, staged):
            rows[d // S][d % S].copy_(row)


def refresh_kernel_flags(weights: PreparedWeights) -> bool:
    """Re-measure MXFP4's mx_scale_max / mx_flush after slots changed (never lowered); True if one rose.

    The kernels pick their scale decode by these host values, so a rise means graphs captured
    before the rebalance must be recaptured for this layer.
    """
    if weights.w13_scale is None or not Scheme(weights.scheme).is_mxfp4:
        return False
    scale_max = max(weights.mx_scale_max, _scale_max(weights.w13_scale.data, weights.w2_scale))
    flush = weights.mx_flush
    if weights.w13_rowexp is not None:  # MX quads: the conservative flush test of PreparedWeights
        flush = flush or any(bool((t - 1 > 11).any()) for t in (weights.w13_scale.data, weights.w2_scale))
    rose = scale_max != weights.mx_scale_max or flush != weights.mx_flush
    weights.mx_scale_max, weights.mx_flush = scale_max, flush
    return rose
