"""Checks of a layer call's inputs (x, topk_weights, topk_ids), shared by the torch entry points.

Every check reads shapes, dtypes and devices only: no tensor values, so no host sync, and
they are safe on every call, inside a CUDA graph capture too. Messages name the tensor and
what is allowed. fused_experts keeps its own launch checks (atom_moe/experts.py); MegaMoE
checks on every rank before its collectives (atom_moe/ep/op.py).
"""

from __future__ import annotations

import warnings

import torch

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ID_DTYPES = (torch.int32, torch.int64)
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_call(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, hidden_size: int,
               top_k: int | None, *, where: str, device: torch.device | None = None) -> None:
    """Raise ValueError unless x is [T, hidden_size] float and topk_* are [T, top_k] ids / weights on x's device.

    top_k None accepts any k (the reference, which has no spec). device: where x must be (default: anywhere).
    """
    for name, t in (("x", x), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{where}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if x.dim() != 2 or x.shape[1] != hidden_size:
        raise ValueError(f"{where}: x must be [T, H={hidden_size}], got {tuple(x.shape)}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"{where}: x dtype {x.dtype} not supported; allowed: {_names(X_DTYPES)}")
    k = topk_ids.shape[-1] if top_k is None and topk_ids.dim() == 2 else top_k
    expect = (x.shape[0], k)
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if tuple(t.shape) != expect:
            want = f"[T={x.shape[0]}, top_k={k}]" if top_k is not None else f"[T={x.shape[0]}, k] like topk_ids"
            raise ValueError(f"{where}: {name} must be {want}, got {tuple(t.shape)}")
    if topk_ids.dtype not in ID_DTYPES:
        raise ValueError(f"{where}: topk_ids dtype {topk_ids.dtype} not supported; allowed: {_names(ID_DTYPES)}")
    if topk_weights.dtype not in WEIGHT_DTYPES:
        raise ValueError(f"{where}: topk_weights dtype {topk_weights.dtype} not supported; allowed: "
                         f"{_names(WEIGHT_DTYPES)}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{where}: {name} is on {t.device}, x on {x.device}; they must share a device")
    if device is not None and x.device != device:
        raise ValueError(f"{where}: x is on {x.device}, the weights on {device}; they must share a device")


def warn_fp32(x: torch.Tensor, where: str) -> None:
    """Warn (once per call site, host only) that fp32 x is computed with bf16 activations."""
    if x.dtype == torch.float32:
        # the kernels' activations are bf16 (or e4m3): fp32 x is rounded to bf16 first, which puts the
        # result ~2-3e-3 away from an fp32 layer; say so instead of looking like an fp32 layer
        warnings.warn(f"{where}: x is float32, but atom_moe computes with bf16 activations (x is rounded to "
                      f"bf16; expect ~3e-3 relative error against an fp32 layer); the output is float32. "
                      f"Pass bf16 x to silence this, or use reference_moe for fp32 accuracy",
                      Fp32InputWarning, stacklevel=3)


class Fp32InputWarning(UserWarning):
    """fp32 x given to a path that computes with bf16 activations."""
