"""The experts step in plain torch on prepared (INTERLEAVED, quantized) weights.

This is the torch twin of the fused Triton path (gemm1 + SwiGLU + quant + gemm2 +
weighted combine): the same weight formats, the same layout tags, the same working
precision (bf16 intermediate, or e4m3 activations per token group: 128, and 64 for a8w4's
intermediate), with fp32 accumulation.
It runs anywhere torch runs, so it is the path of last resort on machines without
Triton, and the per-stage oracle for the kernels' tests. It syncs with the host (it
loops over the experts that have tokens), so it is not CUDA-graph safe.
"""

from __future__ import annotations

import torch

from . import formats
from .inputs import check_call, warn_fp32
from .layouts import mx_quads, mx_tiles
from .layouts.gate_up import GateUpLayout, require
from .reference import apply_activation, quant_dequant_activations
from .spec import FP8_BLOCK, MoESpec, Scheme
from .weights import PreparedWeights


def dequantize_w13(weights: PreparedWeights, local: int) -> torch.Tensor:
    """fp32 [2I, H] INTERLEAVED rows of one local expert."""
    w13 = require(weights.w13, GateUpLayout.INTERLEAVED, "w13")[local]
    if weights.scheme is Scheme.BF16:
        return w13.float()
    scale = require(weights.w13_scale, GateUpLayout.INTERLEAVED, "w13_scale")[local]
    if weights.scheme is Scheme.FP8:
        # scale [nb, 2, kb]: interleaved row 2j+s uses block row j // 128, slot s
        nb, _, kb = scale.shape
        rows = torch.arange(w13.shape[0], device=w13.device)
        per_row = scale[rows // 2 // FP8_BLOCK, rows % 2]  # [2I, kb]
        return w13.float() * per_row.repeat_interleave(FP8_BLOCK, dim=1)[:, : w13.shape[1]]
    rowexp = None if weights.w13_rowexp is None else require(weights.w13_rowexp, GateUpLayout.INTERLEAVED,
                                                             "w13_rowexp")[local]
    return _dequantize_mx(w13, scale, rowexp, 2 * weights.intermediate_size, weights.hidden_size, paired=True)


def _dequantize_mx(values: torch.Tensor, scale: torch.Tensor, rowexp: torch.Tensor | None, n: int, k: int,
                   paired: bool = False) -> torch.Tensor:
    """fp32 [n, k] from one expert's MX tiles (a16w4), or MX quads (a8w4: with rowexp, residuals paired for
    w13, flushed blocks zeroed as the kernels do, atom_moe/layouts/mx_quads.py). Untiled per expert: rows come
    back INTERLEAVED."""
    if rowexp is None:
        return formats.dequantize_mxfp4(*mx_tiles.untile(values, scale, n, k))
    packed, scales = mx_quads.untile(values, scale, rowexp, n, k, paired)
    return formats.dequantize_mxfp4(mx_quads.flush(packed, scales), scales)


def dequantize_w2(weights: PreparedWeights, local: int) -> torch.Tensor:
    """fp32 [H, I] of one local expert."""
    if weights.scheme is Scheme.BF16:
        return weights.w2[local].float()
    if weights.scheme is Scheme.FP8:
        return formats.dequantize_fp8_block(weights.w2[local], weights.w2_scale[local], FP8_BLOCK)
    return _dequantize_mx(weights.w2[local], weights.w2_scale[local],
                          None if weights.w2_rowexp is None else weights.w2_rowexp[local],
                          weights.hidden_size, weights.intermediate_size)


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """Global ids [T, k] -> local ids, -1 for sentinels (outside [0, E)) and non-local experts."""
    num_experts = expert_map.shape[0]
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    mapped = expert_map[topk_ids.clamp(0, num_experts - 1).long()].long()
    return torch.where(valid, mapped, torch.full_like(mapped, -1))


def experts_torch(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  weights: PreparedWeights, spec: MoESpec) -> torch.Tensor:
    """[T, H] in x.dtype: this rank's local experts' weighted contribution for each token."""
    weights.check(spec)
    check_call(x, topk_weights, topk_ids, spec.hidden_size, spec.top_k, where="experts_torch", device=weights.w2.device)
    warn_fp32(x, "experts_torch")
    lids = local_ids(topk_ids, weights.expert_map)
    xin = quant_dequant_activations(x, spec.scheme) if spec.scheme.fp8_activations \
        else x.to(torch.bfloat16).float()
    out = torch.zeros(x.shape[0], spec.hidden_size, dtype=torch.float32, device=x.device)
    for local in torch.unique(lids[lids >= 0]).tolist():
        tokens, slots = (lids == local).nonzero(as_tuple=True)
        h = xin[tokens] @ dequantize_w13(weights, local).T
        if weights.w13_bias is not None:
            h = h + weights.w13_bias.data[local]
        a = apply_activation(h[:, 0::2], h[:, 1::2], spec.activation)
        a = quant_dequant_activations(a, spec.scheme, inter=True) if spec.scheme.fp8_activations \
            else a.to(torch.bfloat16).float()
        y = a @ dequantize_w2(weights, local).T
        if weights.w2_bias is not None:
            y = y + weights.w2_bias[local]
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float().unsqueeze(1))
    return out.to(x.dtype)
