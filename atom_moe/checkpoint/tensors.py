"""Reading a checkpoint's tensor mapping: missing keys are clear errors."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass

import torch

from ..layouts.gate_up import GateUpLayout
from ..spec import MoESpec
from ..weights import PreparedWeights, WeightError, prepare_stacked


@dataclass
class StackedExperts:
    """A layer's checkpoint expert tensors as prepare_stacked takes them (w13 [E', 2I, K'], w2 [E', H, I'])."""

    w13: torch.Tensor
    w2: torch.Tensor
    layout: GateUpLayout
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    w13_bias: torch.Tensor | None = None
    w2_bias: torch.Tensor | None = None
    expert_ids: Sequence[int] | None = None  # global id of each stacked expert; None: all, in order

    def prepare(self, spec: MoESpec, device: torch.device | str | None = None) -> PreparedWeights:
        """prepare_stacked on these tensors: the kernels' format for spec's scheme, local experts only."""
        return prepare_stacked(spec, self.w13, self.w2, layout=self.layout, w13_scale=self.w13_scale,
                               w2_scale=self.w2_scale, w13_bias=self.w13_bias, w2_bias=self.w2_bias,
                               expert_ids=self.expert_ids, device=device)


def pop_tensor(tensors: MutableMapping[str, torch.Tensor], key: str) -> torch.Tensor:
    """Remove and return `key`; a missing key names it and a few that are present."""
    try:
        return tensors.pop(key)
    except KeyError:
        sample = ", ".join(sorted(tensors)[:4])
        raise WeightError(f"missing checkpoint tensor {key!r} (have e.g. {sample or 'nothing'})") from None


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_tensor(key: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], shape: tuple[int, ...] | None = None,
                 what: str = "") -> torch.Tensor:
    """Return t if its dtype is one of `dtypes` (and its shape is `shape`); else a WeightError naming `key`."""
    allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    if not isinstance(t, torch.Tensor):
        raise WeightError(f"{key} is a {type(t).__name__}; expected a torch.Tensor")
    if t.dtype not in dtypes:
        raise WeightError(f"{key} has dtype {str(t.dtype).removeprefix('torch.')}; allowed: {allowed}{what}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise WeightError(f"{key} has shape {tuple(t.shape)}, expected [{', '.join(map(str, shape))}]{what}")
    return t
