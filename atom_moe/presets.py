"""MoE layer presets from the models' public HuggingFace configs, and the seed models as they are served.

The first five are the routed-experts part of one decoder layer at TP = EP = 1. Field names
follow the configs: hidden_size, moe_intermediate_size (intermediate_size for gpt-oss),
n_routed_experts / num_local_experts / num_experts, num_experts_per_tok, n_group,
topk_group, routed_scaling_factor, norm_topk_prob, scoring_func.

The `-tpN` presets are the layer one rank holds when the engine shards every expert over TP N
ranks (SGLang / vLLM `--tp-size N` without EP): I = moe_intermediate_size / N, all experts.
These are the shapes the project's seed notes serve (/work/shared/seeds).
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

# GLM-5.2 (GlmMoeDsa): H 6144 and 256 routed experts, top-8, one shared expert (pegainfer #568 in
# /work/shared/research/refresh-2026-12.md: "GLM-5.2 (6144/2048/256/8)"). Served MXFP4 on SGLang with
# --enforce-shared-experts-fusion: the shared expert is a 257th routed one and every token's 9th slot
# (seed 002, aiter #4344: "FSE=1, e=257/k=9", inter_dim 256 at TP8 and 512 at TP4 = 2048 / TP).
# Router: sigmoid scores with a correction bias, one group (slime's GLM-5 recipe: router score function
# sigmoid; mlx-lm's glm_moe_dsa: noaux_tc, n_group = topk_group = 1); routed_scaling_factor 2.5 is
# GLM-4.5's: GLM-5.2's own config.json was not available to check it.
# MXFP4 runs as a16w4 (the plugins' default for MXFP4 layers, docs/sglang.md).
_GLM52 = dict(hidden_size=6144, num_experts=257, top_k=9, shared_experts=1, scheme=Scheme.A16W4,
              routing=Routing(Scoring.SIGMOID, renormalize=True, correction_bias=True, routed_scaling_factor=2.5))
# DeepSeek-V4.1-Flash: H 5120, 384 routed experts, top-6, per-rank inter 640 at TP4 and 1152 at TP2,
# run A8W4 (MXFP4 experts, fp8 activations, interleaved gate/up): seed 003 (aiter "gfx950 A8W4 fused_moe
# configs for DSv4.1 TP-sharded experts"). 1152 x 2 = 2304 but 640 x 4 = 2560: the seed's TP4 size is
# kept as given (2304 / 4 = 576, padded to 640 there, is our guess, unchecked).
# Activation: V4 clamps its SiLU at swiglu_limit (docs/sglang.md); the core has no clamped SiLU yet,
# so these presets run plain SiLU until it lands. Router: V4's sqrt-softplus scores and hash-routed
# first layers are not modelled here (the engines hand the experts step its ids); sigmoid + bias stands in.
_V41_FLASH = dict(hidden_size=5120, num_experts=384, top_k=6, scheme=Scheme.A8W4,
                  routing=Routing(Scoring.SIGMOID, renormalize=True, correction_bias=True))
# The seed models as they are served: each is one TP rank's layer (see the module docstring).
SERVED = ("glm-5.2-tp8", "glm-5.2-tp4", "deepseek-v4.1-flash-tp4", "deepseek-v4.1-flash-tp2")
PRESETS.update({
    "glm-5.2-tp8": MoESpec(intermediate_size=256, **_GLM52),
    "glm-5.2-tp4": MoESpec(intermediate_size=512, **_GLM52),
    "deepseek-v4.1-flash-tp4": MoESpec(intermediate_size=640, **_V41_FLASH),
    "deepseek-v4.1-flash-tp2": MoESpec(intermediate_size=1152, **_V41_FLASH),
})

# Decoder layers that carry this MoE layer (num_hidden_layers minus first_k_dense_replace); None: not
# known here. GLM-5.2: 78 layers, the first 3 dense (NVIDIA Megatron-Bridge's GLM-5/5.1/5.2 page; slime's
# GLM-5 recipe: N_DENSE_LAYERS=3, N_MOE_LAYERS=75). DeepSeek-V4.1-Flash: no config seen (V4-Flash has 43,
# all MoE, but V4.1-Flash's H and E differ, so its depth may too).
PRESET_MOE_LAYERS: dict[str, int | None] = {
    "deepseek-v3": 58, "kimi-k2": 60, "gpt-oss-120b": 36, "qwen3-235b-a22b": 94, "glm-4.5": 89,
    "glm-5.2-tp8": 75, "glm-5.2-tp4": 75, "deepseek-v4.1-flash-tp4": None, "deepseek-v4.1-flash-tp2": None,
}


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
