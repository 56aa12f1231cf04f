"""gpt-oss checkpoints (MXFP4 blocks and scales, interleaved gate/up, biases) -> prepared weights."""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from ..layouts.gate_up import GateUpLayout
from ..spec import MoESpec
from ..weights import PreparedWeights, WeightError, prepare_stacked
from .tensors import pop_tensor


def prepare_gpt_oss(spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str,
                    device: torch.device | str | None = None) -> PreparedWeights:
    """gpt-oss checkpoint tensors -> PreparedWeights; consumes the entries it reads.

    Keys under `prefix` (e.g. "model.layers.0.mlp.experts"): gate_up_proj_blocks uint8
    [E, 2I, H/32, 16], gate_up_proj_scales uint8 [E, 2I, H/32], gate_up_proj_bias [E, 2I]
    (rows INTERLEAVED: gate even, up odd), down_proj_blocks [E, H, I/32, 16],
    down_proj_scales [E, H, I/32], down_proj_bias [E, H].
    """
    if not spec.has_bias:
        raise WeightError("gpt-oss experts carry biases: build the spec with has_bias=True")
    get = lambda name: pop_tensor(tensors, f"{prefix}.{name}")  # noqa: E731
    blocks13, scales13, bias13 = get("gate_up_proj_blocks"), get("gate_up_proj_scales"), get("gate_up_proj_bias")
    blocks2, scales2, bias2 = get("down_proj_blocks"), get("down_proj_scales"), get("down_proj_bias")
    for name, t in (("gate_up_proj_blocks", blocks13), ("down_proj_blocks", blocks2)):
        if t.dim() != 4 or t.shape[-1] != 16:
            raise WeightError(f"{prefix}.{name} must be [E, N, K/32, 16] uint8, got {tuple(t.shape)}")
    return prepare_stacked(
        spec, blocks13.flatten(-2), blocks2.flatten(-2), layout=GateUpLayout.INTERLEAVED,
        w13_scale=scales13, w2_scale=scales2, w13_bias=bias13, w2_bias=bias2, device=device,
    )
