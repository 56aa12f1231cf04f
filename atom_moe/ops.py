"""The experts step and the MegaMoE forward as torch custom ops, opaque to torch.compile.

Engines compile their models (vLLM's default mode, SGLang's --enable-torch-compile and
piecewise graphs, transformers under torch.compile). Traced, our torch twin's per-expert
loop is data-dependent and stops Dynamo, and the Triton launchers' host-side checks
would be baked into guards. As custom ops Dynamo and Inductor see one call with a fake
implementation (output shape and dtype only); the real implementation runs at run time,
so a CUDA-graph capture around it records the kernels themselves.

A layer binds its runtime once, at weight-processing time: `bind_experts` (prepared
weights, spec, backend, workspace) or `bind_mega_moe` (a MegaMoE op and its weights),
which returns a string handle. The forward passes tensors and that handle:

    h = bind_experts(weights, spec, backend="triton", workspace=ws)
    out = torch.ops.atom_moe.experts(x, topk_weights, topk_ids, h)

Buffers: the workspace and MegaMoE's transport buffers are scratch owned by the handle.
Each call overwrites them and the caller never reads them (the output is a new tensor),
so no argument of the ops is mutated and `mutates_args` is empty; `torch.library.opcheck`
checks that claim in the tests. Passing the scratch buffers as mutable arguments would
make Inductor functionalize them (a copy per call) and make cudagraph trees refuse the
graph (mutated non-static inputs), for no visible effect.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .spec import MoESpec
from .weights import PreparedWeights

if TYPE_CHECKING:
    from .ep.instances import MegaMoEInstances
    from .ep.op import MegaMoE
    from .experts import Workspace

BACKENDS = ("triton", "torch")

# handle -> the bound forward; held for the process (engine layers live as long), unbind() drops one
_bound: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {}
_ids = itertools.count()


def bind_experts(weights: PreparedWeights, spec: MoESpec, *, backend: str,
                 workspace: Workspace | None = None) -> str:
    """Bind one layer's experts step (backend 'triton': fused_experts, 'torch': experts_torch); return its handle."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    weights.check(spec)
    if backend == "triton":
        from .experts import fused_experts

        def run(x, topk_weights, topk_ids):
            return fused_experts(x, topk_weights, topk_ids, weights, spec, workspace=workspace)
    else:
        if workspace is not None:
            raise ValueError("backend 'torch' (experts_torch) takes no workspace")
        from .experts_torch import experts_torch

        def run(x, topk_weights, topk_ids):
            return experts_torch(x, topk_weights, topk_ids, weights, spec)
    return _add("experts", run)


def bind_mega_moe(op: MegaMoE | MegaMoEInstances, weights: PreparedWeights,
                  agreed_tokens: Callable[[], int | None] | None = None) -> str:
    """Bind one layer's weights to a (shared) MegaMoE op; return the handle for torch.ops.atom_moe.mega_moe.

    For a MegaMoEInstances pair, agreed_tokens (called at run time, once per call) gives the
    engine's largest token count across its DP ranks, the same on every rank, or None (the pair
    gathers it itself); it picks the decode or the prefill op.
    """
    op.bind(weights)  # checks the weights against the op's spec and device now, not at the first forward
    if agreed_tokens is not None:
        def run(x, topk_weights, topk_ids):
            return op.bind(weights).forward(x, topk_weights, topk_ids, agreed_tokens=agreed_tokens())
    else:
        def run(x, topk_weights, topk_ids):
            return op.bind(weights).forward(x, topk_weights, topk_ids)
    return _add("mega_moe", run)


def unbind(handle: str) -> None:
    """Forget a handle (its weights and buffers are freed once nothing else holds them)."""
    _bound.pop(handle, None)


def _add(kind: str, run) -> str:
    handle = f"{kind}:{next(_ids)}"
    _bound[handle] = run
    return handle


def _lookup(handle: str, kind: str):
    run = _bound.get(handle)
    if run is None or not handle.startswith(kind + ":"):
        raise ValueError(f"atom_moe::{kind}: unknown handle {handle!r}; bind the layer first "
                         f"(atom_moe.ops.bind_{kind})")
    return run


@torch.library.custom_op("atom_moe::experts", mutates_args=())
def experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, handle: str) -> torch.Tensor:
    """[T, H] in x.dtype: the bound layer's experts step (this rank's local experts) for x."""
    return _lookup(handle, "experts")(x, topk_weights, topk_ids)


@experts.register_fake
def _experts_fake(x, topk_weights, topk_ids, handle):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("atom_moe::mega_moe", mutates_args=())
def mega_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, handle: str) -> torch.Tensor:
    """[T, H] in x.dtype: the bound layer's MegaMoE forward (dispatch, experts, combine) for this rank's x."""
    return _lookup(handle, "mega_moe")(x, topk_weights, topk_ids)


@mega_moe.register_fake
def _mega_moe_fake(x, topk_weights, topk_ids, handle):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
