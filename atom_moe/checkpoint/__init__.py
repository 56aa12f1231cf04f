"""Checkpoint loading: a model's config.json -> MoESpec, and its expert tensors -> prepared weights.

Engines that already hold stacked expert tensors call `atom_moe.weights.prepare_stacked`
directly; the readers here turn on-disk key layouts into those stacks.
"""

from .config import ModelLayer, config_scheme, load_model, spec_from_config
from .gpt_oss import prepare_gpt_oss
from .hf import prepare_hf_experts

__all__ = ["ModelLayer", "config_scheme", "load_model", "prepare_gpt_oss", "prepare_hf_experts", "spec_from_config"]
