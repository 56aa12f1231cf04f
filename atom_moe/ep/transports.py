"""Transports: how token rows reach the ranks owning their experts and how results come back.

A transport owns its persistent buffers (allocated once, from `buffer_plan`) and does two
things per forward, both with static shapes and no host sync:
  dispatch(x, topk_weights, topk_ids) -> (rows, weights, ids) for this rank's experts step
  combine(expert_out, num_tokens)     -> [T, H] fp32 per-token sum of the ranks' results
The op runs the experts step between them. A later `symm` transport (one-sided pushes into
symmetric memory) implements the same two calls.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.distributed as dist

from ..formats import dequantize_fp8_per_group, quantize_fp8_per_group, quantize_fp8_per_token_grouped
from ..spec import FP8_BLOCK, MoESpec
from .buffers import BufferSpec


def allocate(plan: dict[str, BufferSpec], device: torch.device) -> dict[str, torch.Tensor]:
    """Allocate the planned buffers outside inference mode and autograd (CUDA-graph updatable)."""
    with torch.inference_mode(False), torch.no_grad():
        return {name: torch.empty(b.shape, dtype=b.dtype, device=device) for name, b in plan.items()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The same memory as a uint8 tensor (collectives and copies move bytes, whatever the dtype)."""
    return t.view(torch.uint8)


class Transport(ABC):
    """Moves token rows to expert owners and results back; see the module docstring."""

    name: str
    rows: int  # rows the experts step sees per forward (static)

    @abstractmethod
    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Send this rank's tokens; return (x, weights, global ids) rows for this rank's experts."""

    @abstractmethod
    def combine(self, expert_out: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Return expert results to their source ranks; [num_tokens, H] summed over ranks."""

    def close(self) -> None:
        """Release what the transport created (buffers are dropped with it)."""


class LocalTransport(Transport):
    """EP size 1: the experts step reads the caller's tensors directly; nothing moves."""

    name = "local"

    def __init__(self, max_tokens_per_rank: int) -> None:
        self.rows = max_tokens_per_rank

    def dispatch(self, x, topk_weights, topk_ids):
        return x, topk_weights, topk_ids

    def combine(self, expert_out, num_tokens):
        return expert_out


class TorchTransport(Transport):
    """Static-capacity all-to-all over torch.distributed (gloo on CPU, NCCL on GPU).

    Each rank reserves C = max_tokens_per_rank rows for every destination rank, so no
    routing can overflow and every shape is fixed (NCCL all-to-all captures into CUDA
    graphs). A token goes to a rank once, however many of its experts live there; the
    receiver's experts step sums its local experts with the routing weights, and the
    source adds the (at most W) partial results of each token.
    """

    name = "torch"

    def __init__(self, spec: MoESpec, group: dist.ProcessGroup, rank: int, world: int, max_tokens_per_rank: int,
                 wire: str, owner: list[int], buffers: dict[str, torch.Tensor]) -> None:
        self.spec, self.group, self.rank, self.world = spec, group, rank, world
        self.capacity = max_tokens_per_rank
        self.rows = world * max_tokens_per_rank
        self.wire = wire
        self.b = buffers
        k, N = spec.top_k, self.rows
        with torch.inference_mode(False), torch.no_grad():
            # sentinel slot E (ids outside [0, E)) maps to rank W: no rank, never sent
            self.b["expert_owner"].copy_(torch.tensor(owner + [world], dtype=torch.int64))
            self.b["rank_offsets"].copy_(torch.arange(world, dtype=torch.int64) * max_tokens_per_rank)
            for name in ("send_x", "recv_x"):
                _bytes(self.b[name]).zero_()  # never-sent slots hold zeros, not uninitialized bits
            self.b["send_meta"].zero_()
            self.b["recv_meta"].zero_()
            self.b["combine_recv"].zero_()  # row N is the dummy row: it must stay zero
        self._ids = self.b["send_meta"][:, :k]
        self._w = self.b["send_meta"][:, k:2 * k].view(torch.float32)
        self._scales = self.b["send_meta"][:, 2 * k:].view(torch.float32)
        self._rank_ids = self.b["rank_offsets"] // max_tokens_per_rank  # [W] 0..W-1, built once
        self._N = N

    def dispatch(self, x, topk_weights, topk_ids):
        spec, b, T, N, k = self.spec, self.b, x.shape[0], self._N, self.spec.top_k
        E = spec.num_experts
        valid = (topk_ids >= 0) & (topk_ids < E)
        owner = b["expert_owner"][torch.where(valid, topk_ids, E).long()]  # [T, k] in [0, W]
        mask = (owner.unsqueeze(-1) == self._rank_ids).any(dim=1)  # [T, W]: token t goes to rank r
        slot = torch.cumsum(mask, dim=0) - 1  # slot < C always, because T <= C
        dest = b["dest_index"][:T]
        dest.copy_(torch.where(mask, b["rank_offsets"] + slot, N))
        self._ids[:N].fill_(-1)  # unused slots: no expert anywhere
        if self.wire == "fp8" and T == 0:  # quantize_fp8_per_group cannot reshape 0 rows; nothing to send
            payload = torch.empty(0, self.spec.hidden_size, dtype=torch.uint8, device=x.device)
            scales = torch.empty(0, self._scales.shape[1], dtype=torch.float32, device=x.device)
        elif self.wire == "fp8":
            # a8w4 sends what its GEMM1 reads: one scale per token (Scheme.x_per_token)
            quant = quantize_fp8_per_token_grouped if self.spec.scheme.x_per_token else quantize_fp8_per_group
            q, s = quant(x, FP8_BLOCK)
            payload, scales = _bytes(q), s
        else:
            payload, scales = _bytes(x.to(torch.bfloat16)), None
        W = self.world
        _bytes(b["send_x"]).index_put_((dest,), payload.unsqueeze(1).expand(T, W, payload.shape[1]))
        self._ids.index_put_((dest,), topk_ids.to(torch.int32).unsqueeze(1).expand(T, W, k))
        self._w.index_put_((dest,), topk_weights.float().unsqueeze(1).expand(T, W, k))
        if scales is not None:
            self._scales.index_put_((dest,), scales.unsqueeze(1).expand(T, W, scales.shape[1]))
        dist.all_to_all_single(_bytes(b["recv_x"]), _bytes(b["send_x"][:N]), group=self.group)
        dist.all_to_all_single(b["recv_meta"], b["send_meta"][:N], group=self.group)
        b["expert_ids"].copy_(b["recv_meta"][:, :k])
        b["expert_w"].copy_(b["recv_meta"][:, k:2 * k].view(torch.float32))
        if self.wire == "fp8":
            rscales = b["recv_meta"][:, 2 * k:].view(torch.float32)
            b["expert_x"].copy_(dequantize_fp8_per_group(b["recv_x"], rscales, FP8_BLOCK))
            xin = b["expert_x"]
        else:
            xin = b["recv_x"]
        return xin, b["expert_w"], b["expert_ids"]

    def combine(self, expert_out, num_tokens):
        b, T, N = self.b, num_tokens, self._N
        if tuple(expert_out.shape) != (N, self.spec.hidden_size):
            raise RuntimeError(f"experts step returned {tuple(expert_out.shape)}, "
                               f"expected {(N, self.spec.hidden_size)}")
        send = expert_out if expert_out.dtype == b["combine_recv"].dtype else expert_out.to(b["combine_recv"].dtype)
        dist.all_to_all_single(_bytes(b["combine_recv"][:N]), _bytes(send.contiguous()), group=self.group)
        acc, tmp, dest = b["combine_acc"][:T], b["combine_tmp"][:T], b["dest_index"][:T]
        acc.zero_()
        for r in range(self.world):  # static loop: W gathers of T rows (the dummy row N is zero)
            torch.index_select(b["combine_recv"], 0, dest[:, r], out=tmp)
            acc.add_(tmp)
        return acc
