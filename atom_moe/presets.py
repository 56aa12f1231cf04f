"""MoE layer presets from the models' public HuggingFace configs.

Each preset is the routed-experts part of one decoder layer at TP = EP = 1. Field names
follow the configs: hidden_size, moe_intermediate_size (intermediate_size for gpt-oss),
n_routed_experts / num_local_experts / num_experts, num_experts_per_tok, n_group,
topk_group, routed_scaling_factor, norm_topk_prob, scoring_func.
"""

from __future__ import annotations

from dataclasses import replace

from .spec import Activation, ActivationKind, MoESpec, Placement, Routing, Scheme, Scoring, SpecError

PRESETS: dict[str, MoESpec] = {
    # deepseek-ai/DeepSeek-V3 config.json (fp8 block-128 checkpoint)
    "deepseek-v3": MoESpec(
        hidden_size=7168, intermediate_size=2048, num_experts=256, top_k=8, scheme=Scheme.FP8,
        routing=Routing(Scoring.SIGMOID, renormalize=True, n_group=8, topk_group=4,
                        correction_bias=True, routed_scaling_factor=2.5),
    ),
    # moonshotai/Kimi-K2-Instruct config.json (DeepSeek-V3 architecture, fp8 block-128)
    "kimi-k2": MoESpec(
        hidden_size=7168, intermediate_size=2048, num_experts=384, top_k=8, scheme=Scheme.FP8,
        routing=Routing(Scoring.SIGMOID, renormalize=True, n_group=1, topk_group=1,
                        correction_bias=True, routed_scaling_factor=2.827),
    ),
    # openai/gpt-oss-120b config.json (MXFP4 experts, interleaved gate_up_proj with biases)
    "gpt-oss-120b": MoESpec(
        hidden_size=2880, intermediate_size=2880, num_experts=128, top_k=4, scheme=Scheme.A16W4,
        activation=Activation(ActivationKind.SWIGLU_OAI, alpha=1.702, limit=7.0),
        routing=Routing(Scoring.SOFTMAX, renormalize=True), has_bias=True,
    ),
    # Qwen/Qwen3-235B-A22B config.json (norm_topk_prob = true)
    "qwen3-235b-a22b": MoESpec(
        hidden_size=4096, intermediate_size=1536, num_experts=128, top_k=8, scheme=Scheme.BF16,
        routing=Routing(Scoring.SOFTMAX, renormalize=True),
    ),
    # zai-org/GLM-4.5 config.json (sigmoid + correction bias, n_group = topk_group = 1)
    "glm-4.5": MoESpec(
        hidden_size=5120, intermediate_size=1536, num_experts=160, top_k=8, scheme=Scheme.BF16,
        routing=Routing(Scoring.SIGMOID, renormalize=True, n_group=1, topk_group=1,
                        correction_bias=True, routed_scaling_factor=2.5),
    ),
}


# Decoder layers that carry this MoE layer (num_hidden_layers minus first_k_dense_replace).
PRESET_MOE_LAYERS = {"deepseek-v3": 58, "kimi-k2": 60, "gpt-oss-120b": 36, "qwen3-235b-a22b": 94, "glm-4.5": 89}


def preset(name: str, **overrides) -> MoESpec:
    """A preset by name, with optional field overrides (e.g. scheme="bf16")."""
    key = name.lower()
    if key not in PRESETS:
        raise SpecError(f"unknown preset {name!r}; allowed: {', '.join(sorted(PRESETS))}")
    spec = PRESETS[key]
    if "scheme" in overrides:
        overrides["scheme"] = Scheme.parse(overrides["scheme"])
    if "num_experts" in overrides and "placement" not in overrides:
        overrides["placement"] = Placement(spec.placement.rank, spec.placement.world_size)
    return replace(spec, **overrides)


def scaled_down(spec: MoESpec, *, hidden_size: int, intermediate_size: int, num_experts: int,
                top_k: int | None = None) -> MoESpec:
    """The same kind of layer at a smaller size: routing kind, activation and scheme kept.

    Grouped routing keeps its group structure where the new expert count allows it.
    """
    routing = spec.routing
    if routing.n_group > 1 and (num_experts % routing.n_group or num_experts // routing.n_group < 2):
        routing = replace(routing, n_group=1, topk_group=1)
    k = min(top_k or spec.top_k, num_experts)
    if routing.n_group > 1:
        k = min(k, (num_experts // routing.n_group) * routing.topk_group)
    return replace(spec, hidden_size=hidden_size, intermediate_size=intermediate_size,
                   num_experts=num_experts, top_k=k, routing=routing,
                   placement=Placement(spec.placement.rank, spec.placement.world_size))
