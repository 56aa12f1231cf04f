"""Greedy balanced placement: recorded per-expert token counts -> an ExpertPlacement over P slots.

1. Replicas: every expert gets one slot; each of the P - N extra slots goes to the expert
   with the highest load per replica (ties: lower id), so the hottest experts are split.
2. Slots to ranks: replicas in decreasing order of their expected load (count / replicas,
   what routing's round robin gives each) go to the rank with the least expected load that
   still has a free slot, avoiding a rank that already holds a replica of the same expert.
Each rank's slots are then listed by expert id. The result is deterministic.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from .placement import ExpertPlacement, PlacementError


def _counts_list(counts: torch.Tensor | Sequence[float]) -> list[float]:
    t = torch.as_tensor(counts).detach().cpu()
    if t.dim() != 1 or t.numel() == 0:
        raise PlacementError(f"expert counts must be a non-empty 1-D list (one count per logical expert), "
                             f"got shape {tuple(t.shape)}")
    t = t.double()
    if not torch.isfinite(t).all() or (t < 0).any():
        raise PlacementError("expert counts must be finite and >= 0")
    return t.tolist()


def balanced_placement(counts: torch.Tensor | Sequence[float], num_slots: int, world_size: int) -> ExpertPlacement:
    """Greedy balanced packing of len(counts) experts into num_slots slots over world_size ranks (module docstring)."""
    load = _counts_list(counts)
    N = len(load)
    for name, v in (("num_slots", num_slots), ("world_size", world_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlacementError(f"{name} must be a positive int, got {v!r}")
    if num_slots < N or num_slots % world_size:
        raise PlacementError(f"num_slots={num_slots} must be >= the {N} experts and a multiple of the EP size "
                             f"{world_size}")
    replicas = [1] * N
    heap = [(-load[e], e) for e in range(N)]  # max-heap on load per replica
    heapq.heapify(heap)
    for _ in range(num_slots - N):
        _, e = heapq.heappop(heap)
        replicas[e] += 1
        heapq.heappush(heap, (-load[e] / replicas[e], e))
    per = num_slots // world_size
    items = sorted(((load[e] / replicas[e], e) for e in range(N) for _ in range(replicas[e])),
                   key=lambda x: (-x[0], x[1]))
    rank_load, rank_slots = [0.0] * world_size, [[] for _ in range(world_size)]
    for share, e in items:
        free = [r for r in range(world_size) if len(rank_slots[r]) < per]
        fresh = [r for r in free if e not in rank_slots[r]] or free
        r = min(fresh, key=lambda q: (rank_load[q], q))
        rank_slots[r].append(e)
        rank_load[r] += share
    return ExpertPlacement.from_map([e for r in range(world_size) for e in sorted(rank_slots[r])], N)


def rank_loads(placement: ExpertPlacement, counts: torch.Tensor | Sequence[float], world_size: int) -> list[float]:
    """Expected load per rank: each expert's count spread evenly over its replicas."""
    load = _counts_list(counts)
    phys = placement.physical_to_logical.tolist()
    reps = placement.replica_count.tolist()
    if len(load) != len(reps):
        raise PlacementError(f"{len(load)} counts for a placement of {len(reps)} experts")
    per = len(phys) // world_size
    out = [0.0] * world_size
    for s, e in enumerate(phys):
        out[s // per] += load[e] / reps[e]
    return out
