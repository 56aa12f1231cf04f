"""gpt-oss checkpoints -> prepared weights: MXFP4 (as released) and bf16 (as transformers holds and writes it).

Both keep gate/up INTERLEAVED (gate even, up odd) and carry fp32-or-float biases.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from ..layouts.gate_up import GateUpLayout
from ..spec import MoESpec
from ..weights import PreparedWeights, WeightError
from .tensors import FLOAT_DTYPES, StackedExperts, check_tensor, pop_tensor


def prepare_gpt_oss(spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str,
                    device: torch.device | str | None = None) -> PreparedWeights:
    """gpt-oss MXFP4 checkpoint tensors -> PreparedWeights; consumes the entries it reads.

    Keys under `prefix` (e.g. "model.layers.0.mlp.experts"): gate_up_proj_blocks uint8
    [E, 2I, H/32, 16], gate_up_proj_scales uint8 [E, 2I, H/32], gate_up_proj_bias [E, 2I]
    (rows INTERLEAVED: gate even, up odd), down_proj_blocks [E, H, I/32, 16],
    down_proj_scales [E, H, I/32], down_proj_bias [E, H].
    """
    return read_gpt_oss(spec, tensors, prefix).prepare(spec, device)


def read_gpt_oss(spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str) -> StackedExperts:
    """The checked tensors prepare_gpt_oss reads (consumed from `tensors`)."""
    if not spec.has_bias:
        raise WeightError("gpt-oss experts carry biases: build the spec with has_bias=True")
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    if H % 32 or I % 32:
        raise WeightError(f"gpt-oss MXFP4 needs H and I divisible by 32, got H={H}, I={I}")
    shapes = {"gate_up_proj_blocks": ((E, 2 * I, H // 32, 16), (torch.uint8,)),
              "gate_up_proj_scales": ((E, 2 * I, H // 32), (torch.uint8,)),
              "gate_up_proj_bias": ((E, 2 * I), FLOAT_DTYPES),
              "down_proj_blocks": ((E, H, I // 32, 16), (torch.uint8,)),
              "down_proj_scales": ((E, H, I // 32), (torch.uint8,)),
              "down_proj_bias": ((E, H), FLOAT_DTYPES)}
    got = {name: check_tensor(f"{prefix}.{name}", pop_tensor(tensors, f"{prefix}.{name}"), dtypes, shape,
                              " (gpt-oss MXFP4: e2m1 blocks and e8m0 scales as uint8)")
           for name, (shape, dtypes) in shapes.items()}
    return StackedExperts(got["gate_up_proj_blocks"].flatten(-2), got["down_proj_blocks"].flatten(-2),
                          GateUpLayout.INTERLEAVED, w13_scale=got["gate_up_proj_scales"],
                          w2_scale=got["down_proj_scales"], w13_bias=got["gate_up_proj_bias"],
                          w2_bias=got["down_proj_bias"])


def prepare_gpt_oss_bf16(spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str,
                         device: torch.device | str | None = None) -> PreparedWeights:
    """gpt-oss float experts (transformers' GptOssExperts, dequantized) -> PreparedWeights; consumes the entries.

    Keys under `prefix`: gate_up_proj [E, H, 2I] (input x output: x @ W, columns INTERLEAVED,
    gate even, up odd), gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias [E, H].
    """
    return read_gpt_oss_bf16(spec, tensors, prefix).prepare(spec, device)


def read_gpt_oss_bf16(spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str) -> StackedExperts:
    """The checked tensors prepare_gpt_oss_bf16 reads (consumed from `tensors`)."""
    if not spec.has_bias:
        raise WeightError("gpt-oss experts carry biases: build the spec with has_bias=True")
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    shapes = {"gate_up_proj": (E, H, 2 * I), "gate_up_proj_bias": (E, 2 * I),
              "down_proj": (E, I, H), "down_proj_bias": (E, H)}
    got = {name: check_tensor(f"{prefix}.{name}", pop_tensor(tensors, f"{prefix}.{name}"), FLOAT_DTYPES, shape,
                              " (gpt-oss float experts are input x output)")
           for name, shape in shapes.items()}
    # input x output -> the output x input rows prepare_stacked reads; the interleaved columns become rows
    return StackedExperts(got["gate_up_proj"].transpose(1, 2), got["down_proj"].transpose(1, 2),
                          GateUpLayout.INTERLEAVED, w13_bias=got["gate_up_proj_bias"], w2_bias=got["down_proj_bias"])
