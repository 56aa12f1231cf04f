"""One MoE layer's experts from a checkpoint's tensors, whatever on-disk format it has.

`prepare_experts` gives the kernels' PreparedWeights, `reference_experts` the fp32 oracle's
ReferenceWeights, both through the same reader (`read_experts`).

The model family comes from the config (model_type / architectures, config.model_family);
within a family the on-disk style is the one whose tensors are there:

| family | on-disk style | keys under `{prefix}` (e.g. model.layers.3.mlp.experts) | reader |
|---|---|---|---|
| deepseek, qwen | HF per-expert (released checkpoints; transformers' save_pretrained default) | `.{e}.gate_proj/up_proj/down_proj.weight` (+ `.weight_scale_inv` for fp8) | hf.prepare_hf_experts |
| deepseek, qwen | transformers-5 fused (save_original_format=False) | `.gate_up_proj` [E, 2I, H] gate rows first, `.down_proj` [E, H, I] | transformers5.prepare_fused_experts |
| gpt_oss | MXFP4 (released) | `.gate_up_proj_blocks/_scales/_bias`, `.down_proj_blocks/_scales/_bias` | gpt_oss.prepare_gpt_oss |
| gpt_oss | float (transformers, dequantized) | `.gate_up_proj` [E, H, 2I] interleaved columns, `.down_proj` [E, I, H], biases | gpt_oss.prepare_gpt_oss_bf16 |
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from .. import formats
from ..layouts.gate_up import GateUpLayout
from ..reference import ReferenceWeights
from ..spec import FP8_BLOCK, MoESpec
from ..weights import PreparedWeights
from .config import model_family
from .gpt_oss import read_gpt_oss, read_gpt_oss_bf16
from .hf import read_hf_experts
from .tensors import StackedExperts
from .transformers5 import read_fused_experts


def read_experts(config: dict, spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str
                 ) -> StackedExperts:
    """The layer's expert tensors under `prefix`, read (and consumed) by its format's reader (table above)."""
    family = model_family(config)
    if family == "gpt_oss":
        mxfp4 = f"{prefix}.gate_up_proj_blocks" in tensors
        return (read_gpt_oss if mxfp4 else read_gpt_oss_bf16)(spec, tensors, prefix)
    fused = f"{prefix}.gate_up_proj" in tensors
    return (read_fused_experts if fused else read_hf_experts)(spec, tensors, prefix)


def prepare_experts(config: dict, spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str,
                    device: torch.device | str | None = None) -> PreparedWeights:
    """The layer's experts under `prefix` -> PreparedWeights in spec's scheme (local experts only)."""
    return read_experts(config, spec, tensors, prefix).prepare(spec, device)


def reference_experts(config: dict, spec: MoESpec, tensors: MutableMapping[str, torch.Tensor], prefix: str
                      ) -> ReferenceWeights:
    """The local experts in fp32 checkpoint form (SEPARATED gate/up), dequantized but never rounded to a scheme."""
    st = read_experts(config, spec, tensors, prefix)
    ids = list(range(spec.num_experts)) if st.expert_ids is None else [int(e) for e in st.expert_ids]
    rows = torch.tensor([ids.index(e) for e in spec.local_experts], device=st.w13.device)
    pick = lambda t: None if t is None else t.index_select(0, rows.to(t.device))  # noqa: E731
    w13, s13, w2, s2 = pick(st.w13), pick(st.w13_scale), pick(st.w2), pick(st.w2_scale)
    I = spec.intermediate_size
    if w13.dtype == formats.FP8_DTYPE:  # DeepSeek: gate and up blocked separately (SEPARATED rows)
        nb = -(-I // FP8_BLOCK)
        full13 = torch.cat((formats.dequantize_fp8_block(w13[:, :I], s13[:, :nb], FP8_BLOCK),
                            formats.dequantize_fp8_block(w13[:, I:], s13[:, nb:], FP8_BLOCK)), dim=1)
        full2 = formats.dequantize_fp8_block(w2, s2, FP8_BLOCK)
    elif w13.dtype == torch.uint8:  # MXFP4
        full13, full2 = formats.dequantize_mxfp4(w13, s13), formats.dequantize_mxfp4(w2, s2)
    else:
        full13, full2 = w13.float(), w2.float()
    b13, b2 = pick(st.w13_bias), pick(st.w2_bias)
    if st.layout is GateUpLayout.INTERLEAVED:  # rows g0, u0, g1, ... -> gate rows, then up rows
        full13 = torch.cat((full13[:, 0::2], full13[:, 1::2]), dim=1)
        b13 = None if b13 is None else torch.cat((b13[:, 0::2], b13[:, 1::2]), dim=1)
    return ReferenceWeights.from_separated(full13, full2, b13, b2, spec.local_experts)
