"""Checkpoint loading: a model's config.json -> MoESpec, and its expert tensors -> prepared weights.

Engines that already hold stacked expert tensors call `atom_moe.weights.prepare_stacked`
directly; the readers here turn on-disk key layouts into those stacks.
"""

from .config import ModelLayer, config_scheme, load_model, model_family, spec_from_config
from .gpt_oss import prepare_gpt_oss, prepare_gpt_oss_bf16
from .hf import prepare_hf_experts
from .load import prepare_experts, read_experts, reference_experts
from .transformers5 import prepare_fused_experts

__all__ = ["ModelLayer", "config_scheme", "load_model", "model_family", "prepare_experts", "prepare_fused_experts",
           "prepare_gpt_oss", "prepare_gpt_oss_bf16", "prepare_hf_experts", "read_experts", "reference_experts",
           "spec_from_config"]
