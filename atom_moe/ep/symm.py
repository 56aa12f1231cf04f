"""The `symm` transport: one-sided pushes into peer-mapped buffers (kernels/transport.py).

Per forward, on every rank, all on the stream with no host sync:
  dispatch  push each token row once to every rank owning one of its experts, with its
            metadata, into row (rank * C + t) of that rank's receive buffers
  barrier   epoch flags: every peer's pushes have landed
  experts   routing + GEMM1 + GEMM2 over the receive rows; GEMM2's epilogue pushes the
            results back to the source ranks (fused: one row per (token, slot); split:
            one row per (token, rank), the rank's slots combined first)
  barrier   every result has landed
  combine   sum what came back, in a fixed order, into the caller's [T, H]
Each source announces its mode with its token count, so ranks may choose differently.

The peer mappings come from a `SymmetricHeap`: torch symmetric memory on CUDA, shared
files between processes on the CPU (tests run the real multi-process path under the
Triton interpreter), or several heaps inside one process (`simulated_heaps`: tests and
one-GPU runs of W ranks).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..spec import MoESpec
from .buffers import SYMM_ALIGN, BufferSpec

FUSED, SPLIT = 1, 0  # twins of kernels.transport.FUSED / SPLIT (that module needs Triton)


@dataclass
class SymmetricHeap:
    """One rank's heap (uint8) and every rank's mapping base of its own heap, as seen here."""

    local: torch.Tensor
    bases: list[int]
    rank: int
    keepalive: list = field(default_factory=list)  # peer mappings / handles that must outlive the heap

    def views(self, layout: dict[str, BufferSpec]) -> dict[str, torch.Tensor]:
        """Typed views of the heap, one per buffer, in layout order at SYMM_ALIGN-byte offsets."""
        out, offset = {}, 0
        for name, b in layout.items():
            out[name] = self.local[offset:offset + b.nbytes].view(b.dtype).view(b.shape)
            offset += -(-b.nbytes // SYMM_ALIGN) * SYMM_ALIGN
        return out

    def deltas(self, device: torch.device) -> torch.Tensor:
        """int64 [W]: byte distance from this heap to each rank's mapping of its heap."""
        mine = self.local.data_ptr()
        return torch.tensor([b - mine for b in self.bases], dtype=torch.int64, device=device)

    def close(self) -> None:
        """Drop the mappings (torch symmetric memory frees with its last reference)."""
        self.keepalive.clear()
        self.local = torch.empty(0, dtype=torch.uint8)


def heap_nbytes(layout: dict[str, BufferSpec]) -> int:
    """Bytes of a heap holding `layout` (each buffer starts SYMM_ALIGN-aligned)."""
    return sum(-(-b.nbytes // SYMM_ALIGN) * SYMM_ALIGN for b in layout.values())


def cuda_heap(nbytes: int, group: dist.ProcessGroup, device: torch.device) -> SymmetricHeap:
    """A heap in torch symmetric memory, mapped on every rank of `group` (collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    with torch.inference_mode(False), torch.no_grad(), torch.cuda.device(device):
        local = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(local, group)
        local.zero_()
    return SymmetricHeap(local, list(handle.buffer_ptrs), dist.get_rank(group), [handle])


def shm_heap(nbytes: int, group: dist.ProcessGroup) -> SymmetricHeap:
    """A heap in a shared file per rank, mapped by every process of the gloo `group` (collective)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    token = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    paths = [os.path.join(root, f"atom_moe-{token[0]}-{r}") for r in range(world)]
    with torch.inference_mode(False), torch.no_grad():
        mine = torch.from_file(paths[rank], shared=True, size=nbytes, dtype=torch.uint8)  # zero-filled
        dist.barrier(group=group)
        maps = [mine if r == rank else torch.from_file(paths[r], shared=True, size=nbytes, dtype=torch.uint8)
                for r in range(world)]
    dist.barrier(group=group)  # every process mapped every file: the names can go
    os.unlink(paths[rank])
    return SymmetricHeap(mine, [m.data_ptr() for m in maps], rank, maps)


def simulated_heaps(nbytes: int, world: int, device: torch.device) -> list[SymmetricHeap]:
    """W heaps in this process, each seeing the others (tests and one-GPU runs of W ranks)."""
    with torch.inference_mode(False), torch.no_grad():
        locals_ = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(world)]
    bases = [t.data_ptr() for t in locals_]
    return [SymmetricHeap(t, bases, r, [locals_]) for r, t in enumerate(locals_)]


class SymmTransport:
    """One rank's side of the symm transport: the five steps of the module docstring."""

    name = "symm"

    def __init__(self, spec: MoESpec, rank: int, world: int, max_tokens_per_rank: int, wire: str,
                 owner: list[int], buffers: dict[str, torch.Tensor], heap: SymmetricHeap) -> None:
        if wire == "fp8" and not spec.scheme.fp8_activations:
            raise ValueError(f"the symm transport's fp8 wire feeds fp8-activation schemes (fp8, a8w4) as they are; "
                             f"scheme {spec.scheme.value} computes on bf16 activations: use wire='bf16'")
        self.spec, self.rank, self.world, self.wire = spec, rank, world, wire
        self.capacity = max_tokens_per_rank
        self.rows = world * max_tokens_per_rank
        self.heap = heap
        self.b = buffers
        with torch.inference_mode(False), torch.no_grad():
            self.b["owner"].copy_(torch.tensor(owner + [-1], dtype=torch.int32))  # slot E: sentinel ids
            self.b["peer_delta"].copy_(heap.deltas(self.b["peer_delta"].device))
            self.b["epoch"].zero_()
            self.b["error"].zero_()
        self._remote = self.remote_output()

    def remote_output(self):
        """Where GEMM2 pushes its results (kernels.gemm2.RemoteOutput)."""
        from atom_moe.kernels.gemm2 import RemoteOutput
        b = self.b
        return RemoteOutput(b["peer_delta"], b["symm.recv_info"], b["symm.slots"], b["symm.returned"],
                            self.capacity, self.rank)

    def dispatch(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, mode: int) -> None:
        """Push this rank's tokens (and mode) to the ranks owning their experts."""
        from atom_moe.kernels import transport
        b = self.b
        transport.dispatch(x, topk_weights, topk_ids, b["owner"], b["peer_delta"], b["symm.recv_x"],
                           b.get("symm.recv_scale"), b["symm.recv_ids"], b["symm.recv_w"], b["symm.recv_info"],
                           rank=self.rank, capacity=self.capacity, mode=mode, row_scale=self.spec.scheme.x_per_token)

    def barrier(self, *, signal: bool = True, wait: bool = True) -> None:
        """Epoch barrier over the peers (signal and wait may run separately: simulated ranks)."""
        from atom_moe.kernels import transport
        b = self.b
        transport.barrier(b["symm.flags"], b["epoch"], b["error"], b["peer_delta"], rank=self.rank,
                          signal=signal, wait=wait)

    def received(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """(rows, e4m3 scales or None, weights, global ids) of the receive buffers for the experts step (a8w4's
        scales: the first of each row's, which all hold the row's one scale)."""
        b = self.b
        scales = b.get("symm.recv_scale")
        if scales is not None and self.spec.scheme.x_per_token:
            scales = scales[:, :1]
        return b["symm.recv_x"], scales, b["symm.recv_w"], b["symm.recv_ids"]

    def combine(self, topk_ids: torch.Tensor, out: torch.Tensor, mode: int) -> torch.Tensor:
        """Sum what came back for this rank's tokens into out ([T, H]) and return it."""
        from atom_moe.kernels import transport
        b = self.b
        transport.combine(topk_ids, b["owner"], b["symm.slots"], b["symm.returned"], out,
                          capacity=self.capacity, world=self.world, mode=mode)
        return out

    def steps(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor,
              mode: int, experts) -> list[tuple[str, object]]:
        """One forward as (kind, callable) steps, run in order; a simulator of several ranks in one
        process runs each step on every rank before the next, and splits 'barrier' into signal and wait.

        experts(rows, scales, weights, ids, remote) runs the experts step on the receive buffers.
        """
        return [
            ("dispatch", lambda: self.dispatch(x, topk_weights, topk_ids, mode)),
            ("barrier", self.barrier),
            ("experts", lambda: experts(*self.received(), self._remote)),
            ("barrier", self.barrier),
            ("combine", lambda: self.combine(topk_ids, out, mode)),
        ]

    def errors(self) -> int:
        """Barrier waits that gave up on a peer since build (reads the device: a host sync)."""
        return int(self.b["error"].item())

    def close(self) -> None:
        """Release the heap mappings."""
        self.heap.close()
