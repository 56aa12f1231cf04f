"""A layer preset or a HuggingFace `config.json` -> the MoESpec of one routed-experts layer.

Shared by `atom-moe plan`, `accuracy` and `tune`. The family comes from `model_type` (or,
without one, `architectures`), never from which keys are present; each family takes its
expert count from either spelling (n_routed_experts / num_experts / num_local_experts).
Understands the configs of
DeepSeek-V3 / Kimi-K2 / GLM-4.5 (n_routed_experts, moe_intermediate_size,
num_experts_per_tok, n_group, topk_group, routed_scaling_factor, scoring_func,
first_k_dense_replace), gpt-oss (num_local_experts, intermediate_size, experts_per_token,
swiglu_limit) and Qwen3-MoE (num_experts, moe_intermediate_size, num_experts_per_tok,
norm_topk_prob, decoder_sparse_step, mlp_only_layers), and DeepSeek-V4 / V4.1 (the
DeepSeek-V3 keys, scoring_func sqrtsoftplus, swiglu_limit -> clamped SiLU, expert_dtype;
V4.1 nests them under text_config). The scheme comes from `quantization_config` (fp8 with
128x128 blocks -> fp8, mxfp4 -> a16w4, none -> bf16; V4's experts by expert_dtype: fp4 ->
a16w4, fp8 -> fp8) unless the caller overrides it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..presets import PRESET_MOE_LAYERS, PRESETS, preset
from ..spec import Activation, ActivationKind, MoESpec, Routing, Scheme, Scoring, SpecError

# MoE decoder layers per preset (num_hidden_layers minus dense layers, from the same configs)


@dataclass(frozen=True)
class ModelLayer:
    """The MoE layer of one model: its spec (TP = EP = 1) and how many decoder layers carry it."""

    name: str
    spec: MoESpec
    moe_layers: int | None  # None: not known (a preset whose model config was not available)


def load_model(source: str, scheme: str | Scheme | None = None) -> ModelLayer:
    """A preset name or a path to a HF config.json (or its directory); `scheme` overrides the checkpoint's."""
    path = Path(source)
    if source.lower() in PRESETS:
        key = source.lower()
        spec = preset(key) if scheme is None else preset(key, scheme=scheme)
        return ModelLayer(key, spec, PRESET_MOE_LAYERS[key])
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise SpecError(f"{source!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a config.json file")
    try:
        config = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SpecError(f"{path}: not a readable JSON config ({exc})") from None
    if not isinstance(config, dict):
        raise SpecError(f"{path}: expected a JSON object (a HuggingFace config.json)")
    return spec_from_config(config, scheme, name=str(path))


def _get(config: dict, *names: str, where: str):
    for name in names:
        if name in config:
            return config[name]
    raise SpecError(f"{where}: missing {' / '.join(names)} (needed for the MoE layer)")


def config_scheme(config: dict, where: str = "config") -> Scheme:
    """The expert weights' scheme from quantization_config (none -> bf16)."""
    q = config.get("quantization_config")
    if not q:
        return Scheme.BF16
    method = str(q.get("quant_method", "")).lower()
    if method == "fp8":
        block = q.get("weight_block_size")
        if block is not None and list(block) != [128, 128]:
            raise SpecError(f"{where}: fp8 weight_block_size {block} not supported; allowed: [128, 128]")
        return Scheme.FP8
    if method == "mxfp4":
        return Scheme.A16W4
    raise SpecError(f"{where}: quantization_config quant_method {method!r} not supported; allowed: fp8 "
                    f"(128x128 blocks), mxfp4, or no quantization_config (bf16); or pass a scheme explicitly")


# The family is chosen from model_type, else from the architecture: never from the presence of one
# key (transformers 5 writes num_local_experts into Qwen3-MoE configs, once read as gpt-oss).
MODEL_TYPES = {"deepseek_v4": "deepseek_v4", "deepseek_v41": "deepseek_v4",
               "deepseek_v3": "deepseek", "deepseek_v2": "deepseek", "kimi_k2": "deepseek", "glm4_moe": "deepseek",
               "gpt_oss": "gpt_oss", "qwen3_moe": "qwen", "qwen2_moe": "qwen"}
ARCHITECTURES = {"DeepseekV4ForCausalLM": "deepseek_v4",
                 "DeepseekV3ForCausalLM": "deepseek", "DeepseekV2ForCausalLM": "deepseek",
                 "Glm4MoeForCausalLM": "deepseek", "GptOssForCausalLM": "gpt_oss",
                 "Qwen3MoeForCausalLM": "qwen", "Qwen2MoeForCausalLM": "qwen"}
# the expert-count key of each family first, then the other spellings configs use for it
EXPERT_KEYS = {"deepseek": ("n_routed_experts", "num_experts", "num_local_experts"),
               "deepseek_v4": ("n_routed_experts", "num_local_experts"),
               "gpt_oss": ("num_local_experts", "num_experts"),
               "qwen": ("num_experts", "num_local_experts")}


def model_family(config: dict, where: str = "config") -> str:
    """'deepseek' (DeepSeek-V2/V3, Kimi-K2, GLM), 'gpt_oss' or 'qwen' (Qwen2/3-MoE), by model_type or architecture."""
    model_type = str(config.get("model_type", "")).lower()
    if model_type in MODEL_TYPES:
        return MODEL_TYPES[model_type]
    archs = [a for a in (config.get("architectures") or ()) if a in ARCHITECTURES]
    if archs:
        return ARCHITECTURES[archs[0]]
    raise SpecError(f"{where}: model_type {model_type or None!r} / architectures {config.get('architectures')} "
                    f"is not a MoE family atom_moe reads; allowed model_type: {', '.join(sorted(MODEL_TYPES))} "
                    f"(or architectures: {', '.join(sorted(ARCHITECTURES))})")


def v4_expert_scheme(config: dict, where: str = "config") -> Scheme:
    """DeepSeek-V4 / V4.1 routed experts' scheme: `expert_dtype` (top level or in quantization_config;
    vLLM's default when absent is fp4) fp4 -> a16w4 (MXFP4), fp8 -> fp8; the fp8 quant_method covers
    attention and the shared experts."""
    q = config.get("quantization_config") or {}
    if not q:
        return Scheme.BF16
    if str(q.get("moe_quant_algo") or "").upper() == "NVFP4":
        raise SpecError(f"{where}: NVFP4 routed experts (moe_quant_algo NVFP4) are not supported; allowed: "
                        f"expert_dtype fp4 (MXFP4) or fp8; or pass a scheme explicitly")
    dtype = str(config.get("expert_dtype", q.get("expert_dtype", "fp4"))).lower()
    if dtype == "fp4":
        return Scheme.A16W4
    if dtype == "fp8":
        return config_scheme(config, where)
    raise SpecError(f"{where}: expert_dtype {dtype!r} not supported; allowed: fp4, fp8")


def v4_activation(config: dict, where: str = "config") -> Activation:
    """Clamped SiLU at `swiglu_limit` (transformers' DeepseekV4Config default 10.0 when absent; None or 0:
    no clamp, as in vLLM)."""
    limit = config.get("swiglu_limit", 10.0)
    if limit is None or limit == 0:
        return Activation(ActivationKind.SWIGLU)
    if isinstance(limit, bool) or not isinstance(limit, (int, float)):
        raise SpecError(f"{where}: swiglu_limit {limit!r} is not a number; allowed: a finite number > 0, 0 or null")
    return Activation(ActivationKind.SWIGLU_CLAMP, limit=float(limit))


def spec_from_config(config: dict, scheme: str | Scheme | None = None, *, name: str = "config") -> ModelLayer:
    """The MoE layer of a HF config dict (see the module docstring for the families understood)."""
    where = name
    model_type = str(config.get("model_type", "")).lower()
    family = model_family(config, where)
    if family == "deepseek_v4" and isinstance(config.get("text_config"), dict):
        config = {**config, **config["text_config"]}  # V4.1: the text model's fields under text_config
    H = int(_get(config, "hidden_size", where=where))
    layers = int(_get(config, "num_hidden_layers", where=where))
    if scheme is not None:
        sch = Scheme.parse(scheme)
    else:
        sch = v4_expert_scheme(config, where) if family == "deepseek_v4" else config_scheme(config, where)
    num_experts = int(_get(config, *EXPERT_KEYS[family], where=where))
    if family in ("deepseek", "deepseek_v4"):  # DeepSeek-V3 / V4, Kimi-K2, GLM-4.5
        v4 = family == "deepseek_v4"
        scoring = str(config.get("scoring_func", "sqrtsoftplus" if v4 else "sigmoid")).lower()
        allowed = ("sigmoid", "softmax", "sqrtsoftplus") if v4 else ("sigmoid", "softmax")
        if scoring not in allowed:
            raise SpecError(f"{where}: scoring_func {scoring!r} not supported; allowed: {', '.join(allowed)}")
        # noaux_tc (DeepSeek-V3, Kimi-K2) and GLM-4.5's router use e_score_correction_bias
        bias = str(config.get("topk_method", "noaux_tc")).lower() == "noaux_tc"
        routing = Routing(Scoring(scoring), renormalize=bool(config.get("norm_topk_prob", True)),
                          n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
                          correction_bias=bias,
                          routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)))
        spec = MoESpec(hidden_size=H, intermediate_size=int(_get(config, "moe_intermediate_size", where=where)),
                       num_experts=num_experts,
                       top_k=int(_get(config, "num_experts_per_tok", where=where)), scheme=sch, routing=routing,
                       activation=v4_activation(config, where) if v4 else Activation())
        every = int(config.get("moe_layer_freq", 1))
        first = int(config.get("first_k_dense_replace", 0))
        moe_layers = sum(1 for i in range(first, layers) if i % every == 0)
    elif family == "gpt_oss":
        spec = MoESpec(hidden_size=H, intermediate_size=int(_get(config, "intermediate_size", where=where)),
                       num_experts=num_experts,
                       top_k=int(_get(config, "experts_per_token", "num_experts_per_tok", where=where)), scheme=sch,
                       activation=Activation(ActivationKind.SWIGLU_OAI, alpha=1.702,
                                             limit=float(config.get("swiglu_limit", 7.0))),
                       routing=Routing(Scoring.SOFTMAX, renormalize=True), has_bias=True)
        moe_layers = layers
    else:  # Qwen3-MoE (and Qwen2-MoE-style configs)
        spec = MoESpec(hidden_size=H, intermediate_size=int(_get(config, "moe_intermediate_size", where=where)),
                       num_experts=num_experts,
                       top_k=int(_get(config, "num_experts_per_tok", where=where)), scheme=sch,
                       routing=Routing(Scoring.SOFTMAX, renormalize=bool(config.get("norm_topk_prob", False))))
        step = int(config.get("decoder_sparse_step", 1))
        dense = set(config.get("mlp_only_layers") or ())
        moe_layers = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
    if moe_layers < 1:
        raise SpecError(f"{where}: no MoE layers among num_hidden_layers={layers}")
    return ModelLayer(str(config.get("_name_or_path") or model_type or name), spec, moe_layers)

