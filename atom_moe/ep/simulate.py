"""W ranks of the symm transport inside one process (CPU interpreter or one GPU).

Every rank gets its own heap, buffers and workspace exactly as `MegaMoE` builds them; the
heaps see each other through the same byte deltas as real peer mappings. `forward` runs
each step of `SymmTransport.steps` on every rank before the next step, with each barrier
split into signal-all then wait-all, so no rank ever waits for one that has not run. On a
GPU everything is on one stream, so a whole simulated forward captures into one CUDA graph.
Redundant experts (specs with physical_experts): each rank turns its logical ids into slot
ids with the op's routing tables first, and `rebalance` moves slots between the ranks' weights.
"""

from __future__ import annotations

import torch

from ..experts import Workspace, allocate_workspace, fused_experts
from ..placement import ExpertPlacement, home_tables, physical_ids, slot_moves
from ..spec import MoESpec, shared_map_problem
from ..weights import PreparedWeights
from .buffers import buffer_plan
from .rebalance import move_slots_in_process
from .symm import FUSED, SymmTransport, heap_nbytes, simulated_heaps
from .transports import allocate


class SimulatedSymmGroup:
    """The symm transport's W ranks in this process; `forward` returns every rank's output."""

    def __init__(self, specs: list[MoESpec], max_tokens_per_rank: int, wire: str = "bf16",
                 device: torch.device | str = "cpu") -> None:
        world = len(specs)
        self.logical = specs
        if len({s.placement.physical_experts for s in specs}) > 1:
            raise ValueError("every simulated rank must be built with the same physical_experts")
        specs = [s.kernel_spec for s in specs]  # with redundant experts the slots are the experts
        for r, s in enumerate(specs):
            if (s.placement.rank, s.placement.world_size) != (r, world):
                raise ValueError(f"specs[{r}] is placed as rank {s.placement.rank} of {s.placement.world_size}; "
                                 f"build it with spec.for_rank({r}, {world})")
        owner = [-1] * specs[0].num_experts
        for r, s in enumerate(specs):
            for e in s.local_experts:
                owner[e] = r
        if -1 in owner:
            raise ValueError(f"the placements leave experts {[e for e, o in enumerate(owner) if o < 0][:16]} unowned")
        self.specs, self.world, self.capacity = specs, world, max_tokens_per_rank
        device = torch.device(device)
        plan = buffer_plan(specs[0], world, max_tokens_per_rank, wire, transport="symm", experts_backend="triton")
        layout = {n: b for n, b in plan.items() if n.startswith("symm.")}
        heaps = simulated_heaps(heap_nbytes(layout), world, device)
        self.transports: list[SymmTransport] = []
        self.workspaces: list[Workspace] = []
        for r, spec in enumerate(specs):
            bufs = allocate({n: b for n, b in plan.items() if not n.startswith(("symm.", "workspace."))}, device)
            bufs.update(heaps[r].views(layout))
            self.transports.append(SymmTransport(spec, r, world, max_tokens_per_rank, wire, owner, bufs, heaps[r]))
            with torch.inference_mode(False), torch.no_grad():
                self.workspaces.append(allocate_workspace(spec, world * max_tokens_per_rank, device))
        self.placement = None
        if self.logical[0].redundant:
            self.placement = ExpertPlacement.from_map(self.logical[0].placement.physical_experts,
                                                      self.logical[0].num_experts)
            self.tables = [self._tables(r, device) for r in range(world)]

    def _tables(self, rank: int, device: torch.device) -> dict[str, torch.Tensor]:
        """One rank's routing tables, laid out as the op's (atom_moe.ep.buffers), filled by _write_tables."""
        s, C = self.logical[0], self.capacity
        N, P, k = s.num_experts, s.num_physical_experts, s.top_k
        pairs = torch.arange(C * k, dtype=torch.int64).view(C, k) + rank * C * k
        t = dict(replica_slots=torch.empty(N + 1, P - N + 1, dtype=torch.int64), replica_count=torch.empty(
            N + 1, dtype=torch.int64), pair_index=pairs, slot_ids=torch.empty(C, k, dtype=torch.int64))
        t = {n: v.to(device) for n, v in t.items()}
        self._write_tables(t, self.placement, rank)
        return t

    def _write_tables(self, t: dict[str, torch.Tensor], p: ExpertPlacement, rank: int) -> None:
        s = self.logical[0]
        N, P = s.num_experts, s.num_physical_experts
        table, count = home_tables(p, rank, self.world, s.shared_ids)  # shared experts served at home, as the op
        t["replica_slots"][:N].copy_(table)
        t["replica_slots"][N].fill_(-1)
        t["replica_slots"][N, 0] = P
        t["replica_count"][:N].copy_(count)
        t["replica_count"][N] = 1

    def rebalance(self, placement: ExpertPlacement, layers: list[list[PreparedWeights]]) -> None:
        """Apply a new placement in place: layers[i][r] is layer i on rank r (addresses unchanged)."""
        if self.placement is None:
            raise ValueError("rebalance needs specs with redundant experts (physical_experts)")
        s = self.logical[0]
        placement.check(s.num_experts, self.world)
        problem = shared_map_problem(placement.slots(), s.num_experts, s.shared_experts, self.world)
        if problem:
            raise ValueError(problem)
        moves = slot_moves(self.placement.slots(), placement.slots(), self.world)
        for per_rank in layers:
            move_slots_in_process(per_rank, moves, s.num_physical_experts // self.world)
        for r, t in enumerate(self.tables):
            self._write_tables(t, placement, r)
        self.placement = placement

    def forward(self, weights: list[PreparedWeights], xs: list[torch.Tensor], topk_weights: list[torch.Tensor],
                topk_ids: list[torch.Tensor], outs: list[torch.Tensor], modes: list[int] | None = None,
                config=None) -> list[torch.Tensor]:
        """One MoE forward on every rank (rank r's tokens xs[r] with global ids); writes and returns outs."""
        modes = modes or [FUSED] * self.world
        for r, x in enumerate(xs):
            if x.shape[0] > self.capacity:
                raise ValueError(f"rank {r}: {x.shape[0]} tokens exceed max_tokens_per_rank={self.capacity}")
        if self.placement is not None:  # logical ids -> slot ids, as the op does
            topk_ids = [physical_ids(ids, t["replica_slots"], t["replica_count"], t["pair_index"], t["slot_ids"])
                        for ids, t in zip(topk_ids, self.tables)]
        steps = []
        for r, tr in enumerate(self.transports):
            def experts(xin, x_scale, w, ids, remote, r=r):
                fused_experts(xin, w, ids, weights[r], self.specs[r], workspace=self.workspaces[r], config=config,
                              x_scale=x_scale, remote=remote)
            steps.append(tr.steps(xs[r], topk_weights[r], topk_ids[r], outs[r], modes[r], experts))
        for i, (kind, _) in enumerate(steps[0]):
            if kind == "barrier":
                for tr in self.transports:
                    tr.barrier(signal=True, wait=False)
                for tr in self.transports:
                    tr.barrier(signal=False, wait=True)
            else:
                for rank_steps in steps:
                    rank_steps[i][1]()
        return outs

    def errors(self) -> list[int]:
        """Barrier waits that gave up, per rank (a host sync)."""
        return [tr.errors() for tr in self.transports]
