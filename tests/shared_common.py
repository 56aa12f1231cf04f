"""Fused shared experts in tests: the reference with each shared expert computed on its own, and the engines'
shared-slot weights.

A layer with S fused shared experts has num_experts = R + S (the shared ones last) and
top_k = k + S (the shared slots last, as vLLM and SGLang append them). The reference here
runs the R routed experts through `reference_moe` on the first k slots only, and each shared
expert as a dense MLP over every token,
weighted by its own slot's weight, never both in one pass. A routing sort or padding pass that drops the shared
ids, or a wrong shared weight, shows up against it.
"""

from __future__ import annotations

import torch

from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import MoESpec

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


def split_reference(ref: ReferenceWeights, activation, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                    num_routed: int, shared: int, act_quant=None) -> torch.Tensor:
    """fp32 [T, H]: the routed experts on the first k slots, plus each shared expert alone times its slot's weight.

    `ref` holds every expert (the shared ones last); each shared expert runs as a dense MLP over
    all tokens on its own, so the routed pass never sees a shared id. A shared slot counts only
    where it holds its shared id (a sentinel there contributes nothing).
    """
    k = ids.shape[1] - shared
    ids = ids.long()
    out = reference_moe(x, w[:, :k].contiguous(), ids[:, :k].contiguous(), ref, activation,
                        experts=range(num_routed), act_quant=act_quant)
    for s in range(shared):
        e = num_routed + s
        col = torch.where(ids[:, k + s:k + s + 1] == e, e, -1)
        out += reference_moe(x, w[:, k + s:k + s + 1].contiguous(), col.contiguous(), ref, activation,
                             experts=(e,), act_quant=act_quant)
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||."""
    return float((out.float() - ref).norm() / ref.norm())
