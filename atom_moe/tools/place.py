"""`atom-moe place`: propose a redundant-expert placement from recorded per-expert token counts.

COUNTS is a JSON file holding a list of per-logical-expert counts (or {"counts": [...]}),
e.g. MegaMoE.expert_load() summed over the EP ranks. The greedy balanced packing
(atom_moe.balance) gives the hottest experts extra replicas until --slots are filled and
spreads the slots over --ep ranks by expected load. Prints each rank's expected load next
to the linear placement's, and writes the placement JSON (physical_to_logical,
logical_to_physical, replica_count: ExpertPlacement's tables) to --out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from ..balance import balanced_placement, rank_loads
from ..placement import ExpertPlacement, PlacementError
from .args import UsageError, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `atom-moe place`."""
    parser.add_argument("counts", help="JSON file: per-expert token counts, a list or {\"counts\": [...]}")
    parser.add_argument("--ep", type=positive_int, required=True, help="EP size (ranks the slots spread over)")
    parser.add_argument("--slots", type=positive_int, default=None,
                        help="physical slots P (>= experts, a multiple of --ep); none: the expert count "
                             "(rearrangement only)")
    parser.add_argument("--out", default=None, help="write the placement JSON here; none: print it")


def read_counts(path: str) -> list[float]:
    """The per-expert counts of a COUNTS file; UsageError naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"counts file {path!r} is not readable JSON: {exc}") from None
    if isinstance(data, dict):
        data = data.get("counts")
    if not isinstance(data, list) or not data or not all(
            isinstance(c, (int, float)) and not isinstance(c, bool) for c in data):
        raise UsageError(f"counts file {path!r} must hold a non-empty list of numbers (one per expert), or "
                         f"{{\"counts\": [...]}}")
    return [float(c) for c in data]


def placement_json(p: ExpertPlacement) -> dict:
    """The tables as JSON lists."""
    return {name: getattr(p, name).tolist() for name in ("physical_to_logical", "logical_to_physical", "replica_count")}


def run(args: argparse.Namespace) -> int:
    """Entry point of `atom-moe place`; returns the exit code."""
    counts = read_counts(args.counts)
    N = len(counts)
    slots = N if args.slots is None else args.slots
    try:
        proposed = balanced_placement(counts, slots, args.ep)
    except PlacementError as exc:
        raise UsageError(str(exc)) from None
    loads = rank_loads(proposed, counts, args.ep)
    linear = rank_loads(ExpertPlacement.identity(N), counts, args.ep) if N % args.ep == 0 else None
    print(f"atom-moe place: {N} experts, {slots} slots over EP {args.ep} ({slots // args.ep} per rank)")
    print(f"{'rank':>4}  {'proposed load':>14}  {'linear load':>12}")
    for r in range(args.ep):
        print(f"{r:>4}  {loads[r]:>14.1f}  {'-' if linear is None else format(linear[r], '12.1f'):>12}")
    mean = sum(counts) / args.ep
    print(f"max / mean rank load: proposed {max(loads) / mean if mean else 0:.3f}"
          + ("" if linear is None else f", linear {max(linear) / mean if mean else 0:.3f}"))
    text = json.dumps(placement_json(proposed))
    if args.out:
        Path(args.out).write_text(text + "\n")
        print(f"placement written to {args.out}")
    else:
        print(text)
    return 0


def load_placement(path: str) -> ExpertPlacement:
    """An ExpertPlacement from the JSON `atom-moe place` writes (validate it with .check(N, W))."""
    data = json.loads(Path(path).read_text())
    return ExpertPlacement(*(torch.tensor(data[k], dtype=torch.int64)
                             for k in ("physical_to_logical", "logical_to_physical", "replica_count")))
