"""transformers 5 fused experts (Qwen3-MoE, DeepSeek-V3, ... saved with save_original_format=False) -> prepared weights.

transformers 5 holds a layer's experts as two 3-D parameters and writes them under these
names when asked not to convert back to the per-expert checkpoint format:
`{prefix}.gate_up_proj` [E, 2I, H] (output x input, the I gate rows first, then the I up
rows: the SEPARATED layout) and `{prefix}.down_proj` [E, H, I].
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from ..layouts.gate_up import GateUpLayout
from ..spec import MoESpec
from ..weights import PreparedWeights
from .tensors import FLOAT_DTYPES, StackedExperts, check_tensor, pop_tensor


def prepare_fused_experts(spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str,
                          device: torch.device | str | None = None) -> PreparedWeights:
    """transformers-5 fused gate_up_proj [E, 2I, H] (gate rows first) and down_proj [E, H, I] -> PreparedWeights.

    Consumes both entries; `prefix` is e.g. "model.layers.0.mlp.experts". Float (bf16/fp16/fp32) only.
    """
    return read_fused_experts(spec, tensors, prefix).prepare(spec, device)


def read_fused_experts(spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str) -> StackedExperts:
    """The checked tensors prepare_fused_experts reads (consumed from `tensors`)."""
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    k13, k2 = f"{prefix}.gate_up_proj", f"{prefix}.down_proj"
    w13 = check_tensor(k13, pop_tensor(tensors, k13), FLOAT_DTYPES, (E, 2 * I, H),
                       f" (transformers-5 fused experts: [E={E}, 2I={2 * I}, H={H}], gate rows first)")
    w2 = check_tensor(k2, pop_tensor(tensors, k2), FLOAT_DTYPES, (E, H, I),
                      f" (transformers-5 fused experts: [E={E}, H={H}, I={I}])")
    return StackedExperts(w13, w2, GateUpLayout.SEPARATED)
