"""Reading a checkpoint's tensor mapping: missing keys are clear errors."""

from __future__ import annotations

from collections.abc import MutableMapping

import torch

from ..weights import WeightError


def pop_tensor(tensors: MutableMapping[str, torch.Tensor], key: str) -> torch.Tensor:
    """Remove and return `key`; a missing key names it and a few that are present."""
    try:
        return tensors.pop(key)
    except KeyError:
        sample = ", ".join(sorted(tensors)[:4])
        raise WeightError(f"missing checkpoint tensor {key!r} (have e.g. {sample or 'nothing'})") from None
