"""Route: router logits -> (topk_weights, topk_ids), the first stage of the data flow.

Engines usually compute this themselves and hand MegaMoE the top-k; this module is the
torch definition used by the demo, the benchmark and the tests.
"""

from __future__ import annotations

import torch

from .spec import Routing, Scoring


def route(logits: torch.Tensor, routing: Routing, top_k: int,
          correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, E] logits -> (fp32 weights [T, k], int64 global expert ids [T, k])."""
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got {tuple(logits.shape)}")
    num_experts = logits.shape[1]
    if routing.correction_bias and correction_bias is None:
        raise ValueError("this routing uses a correction bias (e_score_correction_bias); pass it")
    scores = {Scoring.SOFTMAX: lambda v: v.softmax(-1), Scoring.SIGMOID: torch.sigmoid,
              Scoring.SQRTSOFTPLUS: lambda v: torch.nn.functional.softplus(v).sqrt()}[routing.scoring](logits.float())
    choice = scores
    if correction_bias is not None:
        choice = scores + correction_bias.float()
    if routing.n_group > 1:
        grouped = choice.view(-1, routing.n_group, num_experts // routing.n_group)
        group_score = grouped.topk(2, dim=-1).values.sum(-1)
        kept = group_score.topk(routing.topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, kept, True)
        expert_mask = group_mask.repeat_interleave(num_experts // routing.n_group, dim=1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * routing.routed_scaling_factor, ids
