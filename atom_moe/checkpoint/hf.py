"""HF per-expert checkpoints (DeepSeek, Qwen, GLM, Kimi) -> prepared weights."""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from .. import formats
from ..layouts.gate_up import GateUpLayout
from ..spec import MoESpec
from ..weights import PreparedWeights, WeightError
from .tensors import FLOAT_DTYPES, StackedExperts, check_tensor, pop_tensor


def prepare_hf_experts(spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str,
                       device: torch.device | str | None = None) -> PreparedWeights:
    """HF per-expert tensors (DeepSeek, Qwen, GLM, Kimi) -> PreparedWeights; consumes the local entries.

    Keys: f"{prefix}.{e}.{gate_proj|up_proj|down_proj}.weight" ([I, H] / [H, I]) and, for
    fp8 checkpoints, the matching ".weight_scale_inv" block scales. `prefix` is e.g.
    "model.layers.3.mlp.experts". Non-local experts' entries are left in the mapping.
    """
    return read_hf_experts(spec, tensors, prefix).prepare(spec, device)


def read_hf_experts(spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str) -> StackedExperts:
    """The checked, stacked local-expert tensors prepare_hf_experts reads (consumed from `tensors`)."""
    ws13, ws2, ss13, ss2 = [], [], [], []
    H, I = spec.hidden_size, spec.intermediate_size
    for e in spec.local_experts:
        base = f"{prefix}.{e}"
        gate, up, down = (pop_tensor(tensors, f"{base}.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj"))
        for p, t, shape in (("gate_proj", gate, (I, H)), ("up_proj", up, (I, H)), ("down_proj", down, (H, I))):
            # every tensor's dtype is checked by name: torch.cat would silently promote an odd one out
            check_tensor(f"{base}.{p}.weight", t, FLOAT_DTYPES + (formats.FP8_DTYPE,), shape,
                         " (float, or float8_e4m3fn with weight_scale_inv)")
            if t.dtype != gate.dtype:
                raise WeightError(f"{base}.{p}.weight is {str(t.dtype).removeprefix('torch.')} but "
                                  f"{base}.gate_proj.weight is {str(gate.dtype).removeprefix('torch.')}; one "
                                  f"expert's gate, up and down must share a dtype")
            if ws13 and (t.dtype == formats.FP8_DTYPE) != (ws13[0].dtype == formats.FP8_DTYPE):
                raise WeightError(f"{base}.{p}.weight is {str(t.dtype).removeprefix('torch.')} but expert "
                                  f"{spec.local_experts[0]} is {str(ws13[0].dtype).removeprefix('torch.')}; a layer's "
                                  f"experts are all fp8 or all float")
        ws13.append(torch.cat((gate, up)))
        ws2.append(down)
        if gate.dtype == formats.FP8_DTYPE:
            nb_i, nb_h = -(-I // 128), -(-H // 128)
            scales = [check_tensor(f"{base}.{p}.weight_scale_inv", pop_tensor(tensors, f"{base}.{p}.weight_scale_inv"),
                                   (torch.float32,), shape, " (fp32 128x128 block scales, DeepSeek weight_scale_inv)")
                      for p, shape in (("gate_proj", (nb_i, nb_h)), ("up_proj", (nb_i, nb_h)),
                                       ("down_proj", (nb_h, nb_i)))]
            ss13.append(torch.cat(scales[:2]))
            ss2.append(scales[2])
        del gate, up, down
    return StackedExperts(torch.stack(ws13), torch.stack(ws2), GateUpLayout.SEPARATED,
                          w13_scale=torch.stack(ss13) if ss13 else None, w2_scale=torch.stack(ss2) if ss2 else None,
                          expert_ids=spec.local_experts)
