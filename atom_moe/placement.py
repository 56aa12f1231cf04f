"""Redundant experts: the tables that map N logical experts onto P physical slots, and routing onto them.

An `ExpertPlacement` holds three int64 tables (the shapes vLLM's EPLB uses too):
    physical_to_logical  [P]        slot s holds logical expert physical_to_logical[s]
    logical_to_physical  [N, R]     the slots of expert e, first replica_count[e] entries, then -1;
                                    R = P - N + 1, the most replicas one expert can have
    replica_count        [N]        replicas of each expert (>= 1)
Slot s lives on EP rank s // (P / W). Routing picks, for the pair (token t, slot j) of a
rank r with capacity C, replica ((r * C + t) * k + j) mod replica_count[e]: deterministic,
spread evenly over the replicas, and pure tensor ops (no host sync, static shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .spec import physical_map_problem


class PlacementError(ValueError):
    """Replica tables that do not describe a valid placement of the experts over the slots."""


@dataclass(frozen=True, eq=False)  # tensors: compare with .slots() or torch.equal, not ==
class ExpertPlacement:
    """One placement of N logical experts over P physical slots (see the module docstring); host tensors."""

    physical_to_logical: torch.Tensor
    logical_to_physical: torch.Tensor
    replica_count: torch.Tensor

    @classmethod
    def from_map(cls, physical_to_logical: Sequence[int], num_experts: int) -> "ExpertPlacement":
        """The tables of a slot -> expert map, each expert's replicas listed in slot order."""
        phys = [int(e) for e in physical_to_logical]
        bad = [e for e in phys if not 0 <= e < num_experts]
        if bad or len(phys) < num_experts:
            raise PlacementError(f"physical_to_logical needs >= {num_experts} slots holding ids in "
                                 f"[0, {num_experts}); got {len(phys)} slots, bad ids {bad[:8]}")
        R = len(phys) - num_experts + 1
        table = torch.full((num_experts, R), -1, dtype=torch.int64)
        count = torch.zeros(num_experts, dtype=torch.int64)
        for s, e in enumerate(phys):
            if count[e] < R:  # an expert past R replicas means another has none: validate() names it
                table[e, count[e]] = s
            count[e] += 1
        return cls(torch.tensor(phys, dtype=torch.int64), table, count)

    @classmethod
    def identity(cls, num_experts: int) -> "ExpertPlacement":
        """One slot per expert: slot e holds expert e."""
        return cls.from_map(range(num_experts), num_experts)

    @property
    def num_slots(self) -> int:
        return int(self.physical_to_logical.shape[0])

    def slots(self) -> tuple[int, ...]:
        """physical_to_logical as a tuple (for MoESpec's Placement.physical_experts)."""
        return tuple(int(e) for e in self.physical_to_logical.tolist())

    def problem(self, num_experts: int, world_size: int) -> str | None:
        """What is wrong with these tables for N experts over W ranks, or None (host-side, no device)."""
        names = ("physical_to_logical", "logical_to_physical", "replica_count")
        tables = [getattr(self, n) for n in names]
        for name, t in zip(names, tables):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
                got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
                return f"{name} is {got}; allowed: an int64 tensor"
        phys, table, count = (t.detach().cpu() for t in tables)
        if phys.dim() != 1:
            return f"physical_to_logical must be 1-D [P], got shape {tuple(phys.shape)}"
        P = phys.shape[0]
        problem = physical_map_problem(tuple(phys.tolist()), num_experts, world_size)
        if problem:
            return problem.replace("physical_experts", "physical_to_logical")
        R = P - num_experts + 1
        if tuple(table.shape) != (num_experts, R):
            return (f"logical_to_physical is {tuple(table.shape)}; allowed: [num_experts, P - num_experts + 1] = "
                    f"[{num_experts}, {R}], padded with -1")
        if tuple(count.shape) != (num_experts,):
            return f"replica_count is {tuple(count.shape)}; allowed: [num_experts] = [{num_experts}]"
        held = torch.bincount(phys, minlength=num_experts)
        wrong = (count != held).nonzero().flatten()[:8].tolist()
        if wrong:
            return (f"replica_count disagrees with physical_to_logical for experts {wrong}: counts "
                    f"{count[wrong].tolist()}, slots holding them {held[wrong].tolist()}")
        for e in range(num_experts):
            c = int(count[e])
            row = table[e]
            used, pad = row[:c].tolist(), row[c:]
            out = [s for s in used if not 0 <= s < P]
            if out:
                return f"logical_to_physical[{e}] has slot ids {out} outside [0, P={P})"
            if len(set(used)) != c or any(int(phys[s]) != e for s in used):
                return (f"logical_to_physical[{e}] = {used} must list {c} distinct slots holding expert {e}; "
                        f"those slots hold {[int(phys[s]) for s in used]}")
            if (pad != -1).any():
                return f"logical_to_physical[{e}] entries past replica_count {c} must be -1, got {pad.tolist()}"
        return None

    def check(self, num_experts: int, world_size: int) -> "ExpertPlacement":
        """Raise PlacementError naming what is wrong; return self."""
        problem = self.problem(num_experts, world_size)
        if problem:
            raise PlacementError(problem)
        return self


def physical_ids(topk_ids: torch.Tensor, replica_slots: torch.Tensor, replica_count: torch.Tensor,
                 pair_index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Logical ids [T, k] -> physical slot ids written into out[:T] (sentinel ids -> slot P); no host sync.

    replica_slots int64 [N + 1, R] and replica_count int64 [N + 1] carry a sentinel row N
    (one replica: slot P, which no rank owns); pair_index int64 [C, k] the pair numbers.
    """
    T = topk_ids.shape[0]
    N = replica_slots.shape[0] - 1
    valid = (topk_ids >= 0) & (topk_ids < N)
    e = torch.where(valid, topk_ids, N).long()
    choice = torch.remainder(pair_index[:T], replica_count[e])  # int64: (r*C + t)*k + j can pass int32
    dst = out[:T]
    dst.copy_(replica_slots[e, choice])
    return dst


def home_tables(placement: ExpertPlacement, rank: int, world_size: int,
                home: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(logical_to_physical, replica_count) as rank `rank` routes: each expert in `home` takes its replica here.

    Fused shared experts have a replica on every rank; a token's shared slot then stays on
    its own rank instead of crossing the wire. Experts without a slot here keep every replica.
    """
    table, count = placement.logical_to_physical.clone(), placement.replica_count.clone()
    per = placement.num_slots // world_size
    for e in home:
        mine = [s for s in table[e, :int(count[e])].tolist() if s // per == rank]
        if mine:
            table[e] = -1
            table[e, 0], count[e] = mine[0], 1
    return table, count


def slot_moves(old: Sequence[int], new: Sequence[int], world_size: int) -> list[tuple[int, int]]:
    """(source slot under `old`, destination slot under `new`) for every slot whose expert changes.

    A source on the destination's own rank is preferred (a local copy); otherwise the
    replicas of the expert take turns as sources. Every rank computes the same list.
    """
    if len(old) != len(new):
        raise PlacementError(f"a new placement must keep the slot count: {len(old)} slots before, {len(new)} after")
    per = len(old) // world_size
    holders: dict[int, list[int]] = {}
    for s, e in enumerate(old):
        holders.setdefault(int(e), []).append(s)
    moves = []
    for d, e in enumerate(new):
        e = int(e)
        if int(old[d]) == e:
            continue
        if e not in holders:
            raise PlacementError(f"expert {e} has no slot in the current placement to copy its weights from")
        same = [s for s in holders[e] if s // per == d // per]
        moves.append((same[0] if same else holders[e][len(moves) % len(holders[e])], d))
    return moves
