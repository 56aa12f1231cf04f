"""Fused shared experts in tests: the reference with each shared expert computed on its own, and the engines'
shared-slot weights.

A layer with S fused shared experts has num_experts = R + S (the shared ones last) and
top_k = k + S (the shared slots last, as vLLM and SGLang append them). The reference here
never sees that layout: it runs the R routed experts through `reference_moe` on a routed-only
layer with the first k slots, and each shared expert as a dense MLP (a one-expert layer)
weighted by its own slot's weight. A routing sort or padding pass that drops the shared
ids, or a wrong shared weight, shows up against it.
"""

from __future__ import annotations

import torch

from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import MoESpec
from atom_moe.weights import prepare_stacked

ROUTED_SCALING = 2.5  # DeepSeek-V3's routed_scaling_factor


def shared_weight_variants(T: int, k: int, routed_w: torch.Tensor, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """The shared-slot weights [T] the engines hand over.

    one: 1.0 (scaling already folded into the routed weights, or none);
    inv_scale: 1 / routed_scaling_factor (SGLang's fused_shared_expert_weight: its runner scales the whole sum later);
    per_token: the routed weights' sum / routed_scaling_factor (SGLang's un-renormalized grouped top-k), a
    different weight per token, so a kernel that took one weight for all would fail.
    """
    return {"one": torch.ones(T), "inv_scale": torch.full((T,), 1.0 / ROUTED_SCALING),
            "per_token": routed_w[:, :k].sum(dim=1) / ROUTED_SCALING + 0.1 * torch.rand(T, generator=gen)}


def with_shared_weight(w: torch.Tensor, spec: MoESpec, shared_w: torch.Tensor) -> torch.Tensor:
    """topk_weights with every shared slot set to shared_w [T] (fp32, contiguous)."""
    k = spec.top_k - spec.shared_experts
    out = w.clone().float()
    out[:, k:] = shared_w[:, None]
    return out.contiguous()


def split_reference_weights(spec: MoESpec, w13: torch.Tensor, w2: torch.Tensor):
    """(routed-only ReferenceWeights, one ReferenceWeights per shared expert) of a layer's stacked bf16 weights."""
    S, R = spec.shared_experts, spec.num_experts - spec.shared_experts
    routed = MoESpec.create(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, num_experts=R,
                            top_k=spec.top_k - S, scheme=spec.scheme, activation=spec.activation)
    one = MoESpec.create(hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size, num_experts=1,
                         top_k=1, scheme=spec.scheme, activation=spec.activation)
    routed_ref = ReferenceWeights.from_prepared(prepare_stacked(routed, w13[:R], w2[:R], layout="separated"))
    shared_refs = [ReferenceWeights.from_prepared(prepare_stacked(one, w13[R + s:R + s + 1], w2[R + s:R + s + 1],
                                                                  layout="separated")) for s in range(S)]
    return routed_ref, shared_refs


def split_reference(spec: MoESpec, refs, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                    act_quant=None) -> torch.Tensor:
    """fp32 [T, H]: the routed experts on the first k slots, plus each shared expert alone times its slot's weight.

    A shared slot counts only where it holds its shared id (a sentinel there contributes nothing).
    """
    routed_ref, shared_refs = refs
    S, R = spec.shared_experts, spec.num_experts - spec.shared_experts
    k = spec.top_k - S
    out = reference_moe(x, w[:, :k].contiguous(), ids[:, :k].contiguous(), routed_ref, spec.activation,
                        act_quant=act_quant)
    for s, ref in enumerate(shared_refs):
        col = ids[:, k + s:k + s + 1]
        here = torch.where(col == R + s, 0, -1)  # the one-expert layer's id 0, or nothing
        out += reference_moe(x, w[:, k + s:k + s + 1].contiguous(), here.contiguous(), ref, spec.activation,
                             act_quant=act_quant)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||."""
    return float((out.float() - ref).norm() / ref.norm())
