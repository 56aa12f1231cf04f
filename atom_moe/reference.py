"""The pure-torch oracle: experts in fp32 on SEPARATED weights, then the weighted sum.

Every later test compares against this. It reads gate and up as separate tensors (the
checkpoint semantics), so it cannot share a layout bug with the kernels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from . import formats
from .inputs import check_call
from .layouts.gate_up import separate
from .spec import FP8_BLOCK, Activation, ActivationKind, Scheme
from .weights import PreparedWeights, plain_mxfp4


@dataclass
class ReferenceWeights:
    """fp32 expert weights in checkpoint form; row j of each tensor is global expert experts[j]."""

    gate: torch.Tensor  # [E', I, H]
    up: torch.Tensor  # [E', I, H]
    down: torch.Tensor  # [E', H, I]
    experts: tuple[int, ...]
    gate_bias: torch.Tensor | None = None  # [E', I]
    up_bias: torch.Tensor | None = None  # [E', I]
    down_bias: torch.Tensor | None = None  # [E', H]

    @staticmethod
    def from_separated(w13: torch.Tensor, w2: torch.Tensor, w13_bias: torch.Tensor | None = None,
                       w2_bias: torch.Tensor | None = None, experts: Iterable[int] | None = None
                       ) -> "ReferenceWeights":
        """From float w13 [E, 2I, H] with gate rows first, w2 [E, H, I], optional biases."""
        inter = w13.shape[1] // 2
        ids = tuple(range(w13.shape[0])) if experts is None else tuple(experts)
        gb = ub = None
        if w13_bias is not None:
            gb, ub = w13_bias[:, :inter].float(), w13_bias[:, inter:].float()
        return ReferenceWeights(w13[:, :inter].float(), w13[:, inter:].float(), w2.float(), ids, gb, ub,
                                None if w2_bias is None else w2_bias.float())

    @staticmethod
    def from_prepared(p: PreparedWeights) -> "ReferenceWeights":
        """Dequantize prepared weights back to fp32 checkpoint form (local experts only)."""
        if p.scheme.is_mxfp4:  # MX tiles -> plain MXFP4 first (rows of w13 come back INTERLEAVED)
            q13, s13, q2, s2 = plain_mxfp4(p)
            full13 = formats.dequantize_mxfp4(separate(q13).data, separate(s13).data)
            full2 = formats.dequantize_mxfp4(q2, s2)
            del q13, s13, q2, s2
        elif p.scheme is Scheme.BF16:
            w13 = separate(p.w13).data
            full13, full2 = w13.float(), p.w2.float()
        else:  # fp8
            w13 = separate(p.w13).data
            s13 = separate(p.w13_scale).data
            I, nb = p.intermediate_size, s13.shape[1] // 2
            full13 = torch.cat((formats.dequantize_fp8_block(w13[:, :I], s13[:, :nb]),
                                formats.dequantize_fp8_block(w13[:, I:], s13[:, nb:])), dim=1)
            full2 = formats.dequantize_fp8_block(p.w2, p.w2_scale)
        b13 = None if p.w13_bias is None else separate(p.w13_bias).data
        return ReferenceWeights.from_separated(full13, full2, b13, p.w2_bias, p.local_experts)


def apply_activation(gate: torch.Tensor, up: torch.Tensor, activation: Activation) -> torch.Tensor:
    """SwiGLU (silu(g) * u), clamped SwiGLU (DeepSeek-V4) or gpt-oss's variant, in fp32."""
    g, u = gate.float(), up.float()
    if activation.clamped:  # gate from above only, up both sides (torch.clamp keeps NaN)
        g = g.clamp(max=activation.limit)
        u = u.clamp(-activation.limit, activation.limit)
    if activation.kind is ActivationKind.SWIGLU_OAI:
        return g * torch.sigmoid(activation.alpha * g) * (u + 1)
    return torch.nn.functional.silu(g) * u


def quant_dequant_activations(a: torch.Tensor, scheme: Scheme, *, inter: bool = False) -> torch.Tensor:
    """What the scheme does to an activation before a GEMM, as fp32 values (inter: GEMM2's input)."""
    if scheme.x_per_token and not inter:
        q, s = formats.quantize_fp8_per_token(a)
        return q.float() * s
    if inter and scheme.inter_per_token:  # GEMM1 stores bf16, a launch quantizes each row (kernels/inter_quant.py)
        q, s = formats.quantize_fp8_per_token(a.bfloat16())
        return q.float() * s
    if scheme.fp8_activations:
        group = scheme.inter_group if inter else FP8_BLOCK
        q, s = formats.quantize_fp8_per_group(a, group)
        return formats.dequantize_fp8_per_group(q, s, group)
    return a.float()


def reference_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  weights: ReferenceWeights, activation: Activation, *,
                  experts: Iterable[int] | None = None, act_quant: Scheme | None = None) -> torch.Tensor:
    """fp32 [T, H]: sum over k of topk_weights * expert(x), for experts in `experts` (default all).

    Ids outside the weights' experts (e.g. -1 or E sentinels) contribute nothing, so the
    shares of disjoint expert sets add up to the full layer. With `act_quant`, activations
    are quantized and dequantized the way that scheme's kernels see them.
    """
    check_call(x, topk_weights, topk_ids, weights.gate.shape[2], None, where="reference_moe",
               device=weights.gate.device)
    wanted = None if experts is None else set(int(e) for e in experts)
    xf = x.float() if act_quant is None else quant_dequant_activations(x, act_quant)
    out = torch.zeros(x.shape[0], weights.down.shape[1], dtype=torch.float32, device=x.device)
    for row, e in enumerate(weights.experts):
        if wanted is not None and e not in wanted:
            continue
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        if tokens.numel() == 0:
            continue
        xt = xf[tokens]
        g = xt @ weights.gate[row].T
        u = xt @ weights.up[row].T
        if weights.gate_bias is not None:
            g, u = g + weights.gate_bias[row], u + weights.up_bias[row]
        a = apply_activation(g, u, activation)
        if act_quant is not None:
            a = quant_dequant_activations(a, act_quant, inter=True)
        y = a @ weights.down[row].T
        if weights.down_bias is not None:
            y = y + weights.down_bias[row]
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float().unsqueeze(1))
    return out


def local_experts_hit(p: PreparedWeights, topk_ids: torch.Tensor) -> list[int]:
    """The local expert indices of `p` that topk_ids name, ascending (-1 / E sentinels and other ranks' experts
    hit none)."""
    ids = topk_ids.long()
    ids = ids[(ids >= 0) & (ids < p.num_experts)]
    local = p.expert_map[torch.unique(ids)]
    return local[local >= 0].tolist()


def reference_moe_prepared(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, p: PreparedWeights,
                           activation: Activation, *, act_quant: Scheme | None = None,
                           chunk: int = 16) -> torch.Tensor:
    """`reference_moe` on prepared weights, dequantizing only the local experts the ids hit, `chunk` at a time.

    The shares of disjoint expert sets add up, so the result is the whole layer's; no more than
    `chunk` experts are held in fp32 at once (all of Kimi-K2's 384 would take 68 GB).
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk}; allowed: a positive number of experts")
    hit = local_experts_hit(p, topk_ids)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for start in range(0, len(hit), chunk):
        ref = ReferenceWeights.from_prepared(p.restricted(hit[start:start + chunk]))
        out += reference_moe(x, topk_weights, topk_ids, ref, activation, act_quant=act_quant)
        del ref
    return out

