"""Random layers and inputs for the demo, the benchmark and the tests.

Weights are drawn like trained ones are scaled (std 1/sqrt(fan_in)), so a layer's output
is O(1) and relative errors mean what they say. Nothing here is zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..routing import route
from ..spec import MoESpec


@dataclass
class RawLayer:
    """One layer's checkpoint-form expert weights: SEPARATED w13 [E, 2I, H], w2 [E, H, I], bf16."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_bias: torch.Tensor | None
    w2_bias: torch.Tensor | None
    correction_bias: torch.Tensor | None  # router e_score_correction_bias, when the routing uses one


def random_layer(spec: MoESpec, *, generator: torch.Generator, device: str | torch.device = "cpu") -> RawLayer:
    """Random bf16 checkpoint weights for all spec.num_experts experts, drawn on the generator's device."""
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size

    def randn(*shape: int, std: float) -> torch.Tensor:
        # drawn where the generator lives: a CUDA generator keeps a real-size layer off the host
        return (torch.randn(*shape, generator=generator, device=generator.device) * std).to(
            device=device, dtype=torch.bfloat16)

    w13 = randn(E, 2 * I, H, std=H**-0.5)
    w2 = randn(E, H, I, std=I**-0.5)
    b13 = randn(E, 2 * I, std=0.05).float() if spec.has_bias else None
    b2 = randn(E, H, std=0.05).float() if spec.has_bias else None
    bias = randn(E, std=0.1).float() if spec.routing.correction_bias else None
    return RawLayer(w13, w2, b13, b2, bias)


def random_tokens(spec: MoESpec, num_tokens: int, *, generator: torch.Generator,
                  device: str | torch.device = "cpu", correction_bias: torch.Tensor | None = None,
                  skew: float = 0.0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x bf16 [T, H], topk_weights fp32 [T, k], topk_ids int64 [T, k]) routed by the spec's router.

    skew > 0 adds skew * log-rank to the logits so low expert ids are chosen more often.
    Fused shared experts (spec.shared_experts) follow the routed slots, with weight 1.
    """
    draw = dict(generator=generator, device=generator.device)
    routed, S = spec.num_experts - spec.shared_experts, spec.shared_experts
    x = torch.randn(num_tokens, spec.hidden_size, **draw).to(device=device, dtype=torch.bfloat16)
    logits = torch.randn(num_tokens, routed, **draw).to(device)
    if skew:
        logits = logits - skew * torch.log1p(torch.arange(routed, device=device, dtype=torch.float32))
    if spec.routing.correction_bias and correction_bias is None:
        correction_bias = torch.zeros(routed, device=device)
    bias = None if correction_bias is None else correction_bias[:routed]  # shared experts are not routed
    weights, ids = route(logits, spec.routing, spec.top_k - S, bias)
    if S:  # fused shared experts: appended after the routed slots with weight 1, as the engines do
        shared = torch.arange(routed, spec.num_experts, device=device).expand(num_tokens, S)
        weights = torch.cat([weights, torch.ones(num_tokens, S, device=device)], dim=1)
        ids = torch.cat([ids, shared], dim=1)
    return x, weights, ids
