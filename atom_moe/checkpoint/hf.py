"""HF per-expert checkpoints (DeepSeek, Qwen, GLM, Kimi) -> prepared weights."""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from .. import formats
from ..layouts.gate_up import GateUpLayout
from ..spec import MoESpec
from ..weights import PreparedWeights, WeightError, prepare_stacked
from .tensors import pop_tensor


def prepare_hf_experts(spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str,
                       device: torch.device | str | None = None) -> PreparedWeights:
    """HF per-expert tensors (DeepSeek, Qwen, GLM, Kimi) -> PreparedWeights; consumes the local entries.

    Keys: f"{prefix}.{e}.{gate_proj|up_proj|down_proj}.weight" ([I, H] / [H, I]) and, for
    fp8 checkpoints, the matching ".weight_scale_inv" block scales. `prefix` is e.g.
    "model.layers.3.mlp.experts". Non-local experts' entries are left in the mapping.
    """
    ws13, ws2, ss13, ss2 = [], [], [], []
    H, I = spec.hidden_size, spec.intermediate_size
    for e in spec.local_experts:
        base = f"{prefix}.{e}"
        gate, up, down = (pop_tensor(tensors, f"{base}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj"))
        for p, t, shape in (("gate_proj", gate, (I, H)), ("up_proj", up, (I, H)), ("down_proj", down, (H, I))):
            if tuple(t.shape) != shape:
                raise WeightError(f"{base}.{p}.weight has shape {tuple(t.shape)}, expected [{shape[0]}, {shape[1]}]")
        ws13.append(torch.cat((gate, up)))
        ws2.append(down)
        if gate.dtype == formats.FP8_DTYPE:
            scales = [pop_tensor(tensors, f"{base}.{p}.weight_scale_inv") for p in ("gate_proj", "up_proj", "down_proj")]
            ss13.append(torch.cat(scales[:2]))
            ss2.append(scales[2])
        del gate, up, down
    return prepare_stacked(
        spec, torch.stack(ws13), torch.stack(ws2), layout=GateUpLayout.SEPARATED,
        w13_scale=torch.stack(ss13) if ss13 else None, w2_scale=torch.stack(ss2) if ss2 else None,
        expert_ids=spec.local_experts, device=device,
    )
