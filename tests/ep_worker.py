"""One EP rank of a multi-process test: `python tests/ep_worker.py SCENARIO` under torchrun-style env or mpiexec.

Every rank builds the same random layers from EP_TEST_SEED, checks its own outputs against
the single-rank fp32 reference, prints one `RESULT {json}` line per check and exits 0 only
if every check passed. tests/test_ep_multiproc.py launches it with a hard timeout.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from atom_moe.balance import balanced_placement
from atom_moe.ep import BufferLimitError, MegaMoE, MegaMoEError, buffer_sizes, init_distributed
from atom_moe.ep.rebalance import slot_tensors
from atom_moe.formats import dequantize_fp8_per_group, quantize_fp8_per_group
from atom_moe.placement import ExpertPlacement
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import MoESpec, SpecError
from atom_moe.tools.synthetic import random_layer, random_tokens
from atom_moe.weights import PreparedWeights, prepare_stacked

H, I, E, K, C = 160, 64, 8, 3, 12  # H=160: one full and one partial fp8 group, a multiple of 32 for MXFP4
SCHEMES = ("bf16", "fp8", "a16w4", "a8w4")
CASES = ("random", "skewed", "one_expert", "rank_gets_nothing")
TOL = 1e-2  # relative Frobenius error vs the fp32 reference: bf16 rounding of x/intermediate, fp8 requant


class Checks:
    """Collects pass/fail per check; prints each as a RESULT line."""

    def __init__(self, rank: int) -> None:
        self.rank, self.failed = rank, []
        out_dir = os.environ.get("EP_TEST_OUT")  # one file per rank: launchers interleave stdout lines
        self.file = open(os.path.join(out_dir, f"rank{rank}.jsonl"), "a") if out_dir else None

    def record(self, name: str, ok: bool, **info) -> None:
        line = json.dumps(dict(rank=self.rank, check=name, ok=bool(ok), **info), default=str)
        print("RESULT " + line, flush=True)
        if self.file:
            self.file.write(line + "\n")
            self.file.flush()
        if not ok:
            self.failed.append(name)

    def expect_error(self, name: str, fn, *needles: str, kind: type = MegaMoEError) -> None:
        try:
            fn()
        except kind as exc:
            msg = str(exc)
            self.record(name, all(n in msg for n in needles), message=msg, needles=needles)
            return
        except Exception as exc:  # the wrong kind of error is a failure too
            self.record(name, False, message=f"{type(exc).__name__}: {exc}")
            return
        self.record(name, False, message="no error raised")


def placement(kind: str, world: int) -> list[list[int]]:
    """Per-rank expert lists: linear, or uneven and non-contiguous (e mod (W+1) mod W)."""
    if kind == "linear":
        per = E // world
        return [list(range(r * per, (r + 1) * per)) for r in range(world)]
    return [[e for e in range(E) if (e % (world + 1)) % world == r] for r in range(world)]


def full_layer(spec_full: MoESpec, seed: int) -> PreparedWeights:
    """The whole layer's PreparedWeights (all experts on one rank) of the random layer `make_layer` builds."""
    raw = random_layer(spec_full, generator=torch.Generator().manual_seed(seed))
    return prepare_stacked(spec_full, raw.w13, raw.w2, layout="separated")


def make_layer(spec_full: MoESpec, spec_rank: MoESpec, seed: int):
    """(this rank's PreparedWeights, full-layer ReferenceWeights) of one random layer."""
    raw = random_layer(spec_full, generator=torch.Generator().manual_seed(seed))
    mine = prepare_stacked(spec_rank, raw.w13, raw.w2, layout="separated")
    full = prepare_stacked(spec_full, raw.w13, raw.w2, layout="separated")
    return mine, ReferenceWeights.from_prepared(full)


def on_wire(spec: MoESpec, x: torch.Tensor, wire: str) -> torch.Tensor:
    """x as the experts see it (fp32 where the wire changed it): an fp8 wire quantizes it once, which bf16/a16w4
    kernels take as is (fp8 activations are quantized the same way by the kernels themselves)."""
    if wire == "fp8" and not spec.scheme.fp8_activations and x.shape[0]:
        return dequantize_fp8_per_group(*quantize_fp8_per_group(x, 128), 128)
    return x


def reference(spec: MoESpec, ref, x, w, ids, wire: str) -> torch.Tensor:
    """The single-rank fp32 reference for what this op computes (see docs/ep.md, accuracy)."""
    if x.shape[0] == 0:  # (quantize_fp8_per_group rejects 0 rows, so the reference cannot run on none)
        return torch.zeros(0, spec.hidden_size, device=x.device)
    act_quant = spec.scheme if spec.scheme.fp8_activations else None
    return reference_moe(on_wire(spec, x, wire), w, ids, ref, spec.activation, act_quant=act_quant)


def compare(checks: Checks, name: str, out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    """Every element: shape, dtype, finite, and relative Frobenius error <= TOL (exact zero for a zero ref)."""
    if tuple(out.shape) != tuple(ref.shape) or out.dtype != x.dtype:
        checks.record(name, False, shape=tuple(out.shape), dtype=str(out.dtype))
        return
    err = (out.float() - ref).norm().item()
    scale = ref.norm().item()
    ok = bool(torch.isfinite(out).all()) and (err <= TOL * scale if scale > 0 else err == 0.0)
    checks.record(name, ok, tokens=out.shape[0], rel=err / scale if scale else err)


def compare_elements(checks: Checks, name: str, out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor) -> None:
    """compare(), and every element within 3e-2 of the largest |ref| (a wrong row cannot hide in the norm)."""
    compare(checks, name, out, ref, x)
    if tuple(out.shape) != tuple(ref.shape):
        checks.record(f"{name} every element", False, shape=tuple(out.shape))
        return
    worst = float((out.float() - ref).abs().max()) if out.numel() else 0.0
    limit = 3e-2 * float(ref.abs().max()) if out.numel() else 0.0
    checks.record(f"{name} every element", worst <= limit, worst=worst, limit=limit)


def make_case(case: str, spec: MoESpec, rank: int, world: int, owners: list[list[int]], seed: int, *,
              experts: int = E, top_k: int = K, capacity: int = C):
    """(x, topk_weights, topk_ids) of this rank for one routing case; token counts differ per rank, one is 0."""
    E, K, C = experts, top_k, capacity  # noqa: N806 (the module's defaults, or the caller's layer)
    shared = torch.Generator().manual_seed(seed)  # same on every rank: counts, the chosen expert and rank
    counts = torch.randint(1, C + 1, (world,), generator=shared)
    perm = torch.randperm(world, generator=shared)
    if case in ("random", "rank_gets_nothing"):
        counts[perm[0]] = 0
    counts[perm[-1]] = C
    T = int(counts[rank])
    chosen = int(torch.randint(0, E, (1,), generator=shared))
    victim = int(perm[1 % world])
    g = torch.Generator().manual_seed(seed * 7919 + rank + 1)
    x, w, ids = random_tokens(spec, T, generator=g, skew=3.0 if case == "skewed" else 0.0)
    if case == "skewed":
        x = x.float()  # fp32 activations: bf16 on the wire, fp32 back out
    if case == "random":  # sprinkle sentinel ids (-1 and E): they must contribute nothing
        r = torch.rand(ids.shape, generator=g)
        ids = torch.where(r < 0.08, -1, torch.where(r < 0.16, E, ids))
    elif case == "one_expert":
        ids = torch.full_like(ids, chosen)
    elif case == "rank_gets_nothing":
        allowed = torch.tensor([e for e in range(E) if e not in owners[victim]])
        pick = torch.rand(T, allowed.numel(), generator=g).argsort(dim=1)[:, :K]
        ids = allowed[pick]
    return x, w.contiguous(), ids.contiguous()


def scenario_correctness(checks: Checks, rank: int, world: int, seed: int, schemes=SCHEMES, wires=("bf16", "fp8")):
    for si, scheme in enumerate(schemes):
        for wi, wire in enumerate(wires):
            kind = "uneven" if (si + wi) % 2 else "linear"
            owners = placement(kind, world)
            spec_full = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme=scheme,
                                       max_tokens_per_rank=C)
            spec_rank = spec_full.for_rank(rank, world, tuple(owners[rank]) if kind == "uneven" else None)
            layers = [make_layer(spec_full, spec_rank, seed + 100 * si + li) for li in range(2)]
            op = MegaMoE(spec_rank, None, max_tokens_per_rank=C, transport="auto", wire=wire,
                         experts_backend="torch", device="cpu")
            tag = f"{scheme}/{wire}/{kind}"
            planned = buffer_sizes(spec_rank, world, C, wire)
            got = {n: t.numel() * t.element_size() for n, t in op.buffers.items()}
            checks.record(f"bytes {tag}", got == planned and op.allocated_bytes() == sum(planned.values())
                          and op.transport_name == "torch", planned=sum(planned.values()), got=op.allocated_bytes())
            for ci, case in enumerate(CASES):
                x, w, ids = make_case(case, spec_full, rank, world, owners, seed + 1000 * (si * 8 + wi * 4 + ci))
                mine, ref = layers[ci % 2]  # one op serves both layers, alternately bound
                out = op(x, w, ids, mine)
                compare(checks, f"{tag} {case}", out, reference(spec_full, ref, x, w, ids, wire), x)
                # each token was sent once to each rank owning any of its experts; every other slot holds ids -1
                owner = {e: r for r, es in enumerate(owners) for e in es}
                sent = op.buffers["send_meta"][:world * C, :K].reshape(world, C, K)
                for r in range(world):
                    want = sum(any(owner.get(int(e), -1) == r for e in row) for row in ids)
                    used = (sent[r] != -1).any(dim=1)
                    ok = int(used.sum()) == want and bool(used[:want].all())
                    checks.record(f"{tag} {case} slots to rank {r}", ok, want=want, used=int(used.sum()))
            mine, ref = layers[0]
            for wc in op.warmup(mine, seed=seed):
                compare(checks, f"{tag} warmup {wc.name}", wc.out,
                        reference(spec_full, ref, wc.x, wc.topk_weights, wc.topk_ids, wire), wc.x)
            op.close()


SYMM_CASES = (("bf16", "bf16"), ("fp8", "fp8"), ("a8w4", "bf16"), ("a16w4", "bf16"))


def scenario_symm(checks: Checks, rank: int, world: int, seed: int):
    """The symm transport through the real op: shared-file heaps, Triton kernels under the interpreter."""
    from atom_moe.ep.symm import FUSED, SPLIT
    for si, (scheme, wire) in enumerate(SYMM_CASES):
        kind = "uneven" if si % 2 else "linear"
        owners = placement(kind, world)
        spec_full = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme=scheme,
                                   max_tokens_per_rank=C)
        spec_rank = spec_full.for_rank(rank, world, tuple(owners[rank]) if kind == "uneven" else None)
        layers = [make_layer(spec_full, spec_rank, seed + 100 * si + li) for li in range(2)]
        op = MegaMoE(spec_rank, None, max_tokens_per_rank=C, transport="symm", wire=wire,
                     experts_backend="triton", device="cpu")
        tag = f"symm {scheme}/{wire}/{kind}"
        planned = buffer_sizes(spec_rank, world, C, wire, transport="symm", experts_backend="triton")
        checks.record(f"bytes {tag}", op.allocated_bytes() == sum(planned.values()),
                      planned=sum(planned.values()), got=op.allocated_bytes())
        for ci, case in enumerate(CASES):
            x, w, ids = make_case(case, spec_full, rank, world, owners, seed + 1000 * (si * 4 + ci))
            mine, ref = layers[ci % 2]
            # ranks choose their combine mode independently: mix them
            op.combine_override = FUSED if (ci + rank) % 2 else SPLIT
            out = op(x, w, ids, mine)
            compare(checks, f"{tag} {case} mode {op.combine_override}", out,
                    reference(spec_full, ref, x, w, ids, wire), x)
        op.combine_override = None
        mine, ref = layers[0]
        for wc in op.warmup(mine, seed=seed):
            compare(checks, f"{tag} warmup {wc.name}", wc.out,
                    reference(spec_full, ref, wc.x, wc.topk_weights, wc.topk_ids, wire), wc.x)
        checks.record(f"{tag} no barrier timeouts", op.transport.errors() == 0)
        if si == 0:  # a wait that gave up on rank 0 (the counter a real timeout raises) fails warm-up everywhere
            if rank == 0:
                op.buffers["error"].fill_(1)
            checks.expect_error(f"{tag} barrier give-up reaches every rank", lambda: op.warmup(mine, seed=seed),
                                "symm barrier waits gave up", "rank 0: 1")
        op.close()


def random_placement(world: int, gen: torch.Generator) -> ExpertPlacement:
    """P = E + 4 slots (divisible by 2 and 4): two hot experts get 4 and 2 replicas, slots shuffled, and each
    expert's replica order in logical_to_physical shuffled too (routing must follow the table, not slot order)."""
    hot = torch.randperm(E, generator=gen)[:2].tolist()
    phys = list(range(E)) + [hot[0]] * 3 + [hot[1]]
    phys = [phys[i] for i in torch.randperm(len(phys), generator=gen).tolist()]
    p = ExpertPlacement.from_map(phys, E)
    table = p.logical_to_physical.clone()
    for e in range(E):
        c = int(p.replica_count[e])
        table[e, :c] = table[e, :c][torch.randperm(c, generator=gen)]
    return ExpertPlacement(p.physical_to_logical, table, p.replica_count)


def expected_slots(ids: torch.Tensor, p: ExpertPlacement, rank: int) -> torch.Tensor:
    """The slot routing must pick for each (token, slot), computed here with plain loops (docs/ep.md)."""
    out = torch.full(ids.shape, p.num_slots, dtype=torch.int64)
    for t in range(ids.shape[0]):
        for j in range(K):
            e = int(ids[t, j])
            if 0 <= e < E:
                out[t, j] = p.logical_to_physical[e, ((rank * C + t) * K + j) % int(p.replica_count[e])]
    return out


def buffer_ptrs(op: MegaMoE, layers) -> dict[str, int]:
    """data_ptr of every persistent buffer of the op and every slot tensor of the layers."""
    ptrs = {n: t.data_ptr() for n, t in op.buffers.items()}
    for li, w in enumerate(layers):
        ptrs.update({f"layer{li}.{i}": t.data_ptr() for i, t in enumerate(slot_tensors(w) + [w.expert_map])})
    return ptrs


REDUNDANT_CASES = (("bf16", "bf16"), ("fp8", "fp8"), ("a16w4", "bf16"))


def scenario_redundant(checks: Checks, rank: int, world: int, seed: int, transport: str = "torch"):
    """Redundant experts over the torch (or symm) transport: random placements and replica tables, the load
    statistic, rebalancing mid-run (random and from the recorded load), then wrong tables at build and at rebalance."""
    shared = torch.Generator().manual_seed(seed)  # the same placements on every rank
    backend = "triton" if transport == "symm" else "torch"
    for si, (scheme, wire) in enumerate(REDUNDANT_CASES if transport == "torch" else REDUNDANT_CASES[:1]):
        spec_full = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme=scheme,
                                   max_tokens_per_rank=C)
        placed = random_placement(world, shared)
        spec = spec_full.for_rank(rank, world, physical_experts=placed.slots())
        raws = [random_layer(spec_full, generator=torch.Generator().manual_seed(seed + 100 * si + li))
                for li in range(2)]
        layers = [prepare_stacked(spec, r.w13, r.w2, layout="separated") for r in raws]
        refs = [ReferenceWeights.from_prepared(prepare_stacked(spec_full, r.w13, r.w2, layout="separated"))
                for r in raws]
        op = MegaMoE(spec, None, max_tokens_per_rank=C, transport=transport, wire=wire, experts_backend=backend,
                     device="cpu", placement=placed, record_load=True)
        tag = f"redundant {transport} {scheme}/{wire}"
        planned = buffer_sizes(spec, world, C, wire, transport=transport, experts_backend=backend, record_load=True)
        checks.record(f"bytes {tag}", op.allocated_bytes() == sum(planned.values())
                      and planned.get("expert_owner", planned.get("owner", 0) * 2) == 8 * (placed.num_slots + 1),
                      planned=sum(planned.values()))
        load = torch.zeros(E, dtype=torch.int64)
        owners = [[] for _ in range(world)]

        def run_cases(phase: str, p: ExpertPlacement, offset: int) -> None:
            for ci, case in enumerate(("random", "skewed", "one_expert")):
                x, w, ids = make_case(case, spec_full, rank, world, owners, seed + offset + 1000 * (si * 4 + ci))
                if case == "one_expert":  # the expert with the most replicas
                    ids = torch.full_like(ids, int(p.replica_count.argmax()))
                out = op(x, w, ids, layers[ci % 2])
                compare_elements(checks, f"{tag} {phase} {case}", out,
                                 reference(spec_full, refs[ci % 2], x, w, ids, wire), x)
                slots = op.buffers["slot_ids"][:x.shape[0]]
                checks.record(f"{tag} {phase} {case} replica choice", torch.equal(slots, expected_slots(ids, p, rank)))
                load.add_(torch.bincount(ids[(ids >= 0) & (ids < E)].flatten().long(), minlength=E))
                checks.record(f"{tag} {phase} {case} load", torch.equal(op.expert_load(), load),
                              got=op.expert_load().tolist(), want=load.tolist())
                if case == "one_expert" and x.shape[0]:  # one expert's pairs are consecutive: round robin exactly
                    e = int(ids[0, 0])
                    per = torch.bincount(slots.flatten(), minlength=p.num_slots + 1)[p.logical_to_physical[e, :int(
                        p.replica_count[e])]]
                    checks.record(f"{tag} {phase} balanced replicas", int(per.max() - per.min()) <= 1,
                                  per=per.tolist())

        run_cases("before", placed, 0)
        # the next placement: from the recorded load of every rank (greedy), or random
        total = op.expert_load().clone()
        dist.all_reduce(total)
        new = balanced_placement(total, placed.num_slots, world) if si % 2 == 0 else random_placement(world, shared)
        before = buffer_ptrs(op, layers)
        op.rebalance(new, layers)
        checks.record(f"{tag} rebalance keeps addresses", buffer_ptrs(op, layers) == before)
        want = [prepare_stacked(spec_full.for_rank(rank, world, physical_experts=new.slots()), r.w13, r.w2,
                                layout="separated") for r in raws]
        checks.record(f"{tag} rebalanced slots hold their experts",
                      all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for lw, ww in zip(layers, want)
                          for a, b in zip(slot_tensors(lw), slot_tensors(ww))))
        run_cases("after", new, 7)
        for wc in op.warmup(layers[0], seed=seed):  # the engines' dummy batches, sentinels included
            compare_elements(checks, f"{tag} warmup {wc.name}", wc.out,
                             reference(spec_full, refs[0], wc.x, wc.topk_weights, wc.topk_ids, wire), wc.x)
        op.reset_load()
        checks.record(f"{tag} load reset", int(op.expert_load().sum()) == 0)
        # a bad placement on the last rank: every rank refuses, nothing moved
        bad = ExpertPlacement(new.physical_to_logical, new.logical_to_physical,
                              new.replica_count + (rank == world - 1))
        snapshot = [t.clone() for w in layers for t in slot_tensors(w)]
        checks.expect_error(f"{tag} bad rebalance reaches every rank", lambda: op.rebalance(bad, layers),
                            "rebalance refused", f"rank {world - 1}: replica tables: replica_count disagrees")
        swapped = new.logical_to_physical.clone()
        hot = int(new.replica_count.argmax())
        swapped[hot, :2] = swapped[hot, :2].flip(0)
        mixed = ExpertPlacement(new.physical_to_logical, swapped, new.replica_count) if rank == world - 1 else new
        checks.expect_error(f"{tag} rebalance tables differing between ranks", lambda: op.rebalance(mixed, layers),
                            "same placement (map and replica tables)", f"differing ranks [{world - 1}]")
        checks.record(f"{tag} bad rebalance moved nothing",
                      all(torch.equal(a, b) for a, b in zip(snapshot, (t for w in layers for t in slot_tensors(w)))))
        op.close()
    if transport == "torch":
        redundant_build_errors(checks, rank, world)


def redundant_build_errors(checks: Checks, rank: int, world: int) -> None:
    """Wrong replica tables on the last rank: every rank's build raises, naming the rank and the problem."""
    spec_full = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, max_tokens_per_rank=C)
    good = random_placement(world, torch.Generator().manual_seed(5))
    spec = spec_full.for_rank(rank, world, physical_experts=good.slots())
    P, R = good.num_slots, good.num_slots - E + 1
    table_out = good.logical_to_physical.clone()
    table_out[1, 0] = P
    no_replica = list(good.slots())
    no_replica[no_replica.index(2)] = 3
    cases = (
        ("replica count", ExpertPlacement(good.physical_to_logical, good.logical_to_physical,
                                          good.replica_count + 1), "replica_count disagrees"),
        ("slot out of range", ExpertPlacement(good.physical_to_logical, table_out, good.replica_count),
         f"outside [0, P={P})"),
        ("table dtype", ExpertPlacement(good.physical_to_logical, good.logical_to_physical.int(), good.replica_count),
         "logical_to_physical is torch.int32; allowed: an int64 tensor"),
        ("table shape", ExpertPlacement(good.physical_to_logical, good.logical_to_physical[:, :R - 1],
                                        good.replica_count), f"[num_experts, P - num_experts + 1] = [{E}, {R}]"),
        ("expert without replica", ExpertPlacement.from_map(no_replica, E), "experts [2] have no physical slot"),
    )
    for name, bad, needle in cases:
        mine = bad if rank == world - 1 else good
        checks.expect_error(f"build: {name}", lambda: MegaMoE(spec, max_tokens_per_rank=C, experts_backend="torch",
                                                             device="cpu", placement=mine),
                            f"rank {world - 1}: replica tables:", needle)
    swapped = good.logical_to_physical.clone()
    hot = int(good.replica_count.argmax())
    swapped[hot, :2] = swapped[hot, :2].flip(0)
    mine = ExpertPlacement(good.physical_to_logical, swapped, good.replica_count) if rank == world - 1 else good
    checks.expect_error("build: tables differ between ranks", lambda: MegaMoE(
        spec, max_tokens_per_rank=C, experts_backend="torch", device="cpu", placement=mine),
        "same physical map and replica tables", f"[{world - 1}]")
    checks.expect_error("build: P not divisible by the EP size", lambda: spec_full.for_rank(
        rank, world, physical_experts=tuple(range(E)) + (0,)), f"9 slots, not divisible by the EP world size {world}",
        kind=SpecError)


SHARED_CASES = (("bf16", "bf16", 1), ("fp8", "fp8", 1), ("a16w4", "bf16", 2))
SHARED_C = 48  # tokens per rank: every element of long outputs is compared


def scenario_shared(checks: Checks, rank: int, world: int, seed: int, transport: str = "torch"):
    """Fused shared experts over EP: E + S experts, k + S slots, the shared experts replicated on every rank.

    Every output element against the reference with each shared expert computed on its own, for the
    engines' shared weights (1.0, 1/routed_scaling_factor, per token); the shared slots routed to this
    rank's own replica; the same batch with the shared slot under-weighted 0.4x must fail the check; a
    rebalance that takes a rank's shared replica away is refused on every rank.
    """
    from shared_common import shared_weight_variants, split_reference, with_shared_weight
    backend = "triton" if transport == "symm" else "torch"
    cases = SHARED_CASES if transport == "torch" else SHARED_CASES[:1]
    for si, (scheme, wire, S) in enumerate(cases):
        spec_full = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E + S, top_k=K + S, scheme=scheme,
                                   shared_experts=S, max_tokens_per_rank=SHARED_C)
        spec = spec_full.for_rank(rank, world)  # the shared experts on every rank: P = E + S * world slots
        raw = random_layer(spec_full, generator=torch.Generator().manual_seed(seed + 100 * si))
        mine = prepare_stacked(spec, raw.w13, raw.w2, layout="separated")
        full = ReferenceWeights.from_prepared(prepare_stacked(spec_full, raw.w13, raw.w2, layout="separated"))
        op = MegaMoE(spec, None, max_tokens_per_rank=SHARED_C, transport=transport, wire=wire,
                     experts_backend=backend, device="cpu")  # one rank too: a 1-rank all-to-all over gloo
        tag = f"shared {transport} {scheme}/{wire} S={S}"
        per = spec.num_physical_experts // world
        home = torch.arange(rank * per + E // world, (rank + 1) * per)  # this rank's shared slots
        checks.record(f"{tag} placement", spec.redundant == (world > 1) and per == E // world + S
                      and spec.local_experts[-S:] == spec_full.shared_ids, local=spec.local_experts)
        g = torch.Generator().manual_seed(seed * 31 + 1000 * si + rank)
        T = SHARED_C - rank  # token counts differ per rank
        x, w, ids = random_tokens(spec_full, T, generator=g)
        act_quant = spec.scheme if spec.scheme.fp8_activations else None
        for name, sw in shared_weight_variants(T, K, w, g).items():
            wv = with_shared_weight(w, spec_full, sw)
            ref = split_reference(full, spec.activation, x, wv, ids, E, S, act_quant)
            compare_elements(checks, f"{tag} weight {name}", op(x, wv, ids, mine), ref, x)
            if transport == "torch" and world > 1:  # (one rank: no slot tables, every expert is local)
                slots = op.buffers["slot_ids"][:T, K:]
                checks.record(f"{tag} weight {name} shared slots at home", torch.equal(slots, home.expand(T, S)))
            planted = op(x, with_shared_weight(w, spec_full, 0.4 * sw), ids, mine).float()
            err, worst = (planted - ref).norm().item(), (planted - ref).abs().max().item()
            caught = err > TOL * ref.norm().item() or worst > 3e-2 * ref.abs().max().item()  # compare_elements fails
            checks.record(f"{tag} weight {name} 0.4x shared weight caught", caught, rel=err / ref.norm().item())
        for wc in op.warmup(mine, seed=seed):  # the engines' dummy batches over E + S ids, sentinels included
            compare_elements(checks, f"{tag} warmup {wc.name}", wc.out,
                             reference(spec_full, full, wc.x, wc.topk_weights, wc.topk_ids, wire), wc.x)
        if transport == "torch" and world > 1:
            bad = list(spec.placement.physical_experts)
            bad[per - 1], bad[per] = bad[per], bad[per - 1]  # rank 0's shared replica and rank 1's first expert swap
            checks.expect_error(f"{tag} rebalance without a home replica refused",
                                lambda: op.rebalance(ExpertPlacement.from_map(bad, E + S), [mine]),
                                "rebalance refused", "have no slot on rank")
        op.close()


def scenario_errors(checks: Checks, rank: int, world: int, seed: int):
    spec_full = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, max_tokens_per_rank=C)
    spec = spec_full.for_rank(rank, world)
    # mismatched max_tokens_per_rank: every rank raises, naming every rank's value
    checks.expect_error("mismatched max_tokens_per_rank", lambda: MegaMoE(
        spec, max_tokens_per_rank=8 + rank, experts_backend="torch", device="cpu"),
        "identical", *[f"rank {r}: {8 + r}" for r in range(world)])
    # a spec built for the wrong rank fails on every rank, naming the faulty rank
    bad_spec = spec_full.for_rank((rank + 1) % world if rank == world - 1 else rank, world)
    checks.expect_error("wrong placement rank", lambda: MegaMoE(
        bad_spec, max_tokens_per_rank=C, experts_backend="torch", device="cpu"), f"rank {world - 1}:")
    # placements that do not partition the experts: every rank raises, naming the shared expert
    dup = tuple(placement("linear", world)[rank]) + ((0,) if rank == world - 1 else ())
    checks.expect_error("expert on two ranks", lambda: MegaMoE(
        spec_full.for_rank(rank, world, dup), max_tokens_per_rank=C, experts_backend="torch", device="cpu"),
        f"experts on several ranks {{0: [0, {world - 1}]}}")
    gap = tuple(e for e in placement("linear", world)[rank] if e != E - 1)
    checks.expect_error("unowned expert", lambda: MegaMoE(
        spec_full.for_rank(rank, world, gap), max_tokens_per_rank=C, experts_backend="torch", device="cpu"),
        f"unowned experts [{E - 1}]")
    # buffers past the int32 range: every rank raises before allocating, naming the largest safe value
    safe = ((2**31 - 1) // (H * 2) - 1) // world  # send_x / combine_recv: (W*C + 1) rows of H bf16
    checks.expect_error("int32 limit at build", lambda: MegaMoE(
        spec, max_tokens_per_rank=10 * safe, experts_backend="torch", device="cpu"),
        f"largest safe max_tokens_per_rank is {safe}.", kind=BufferLimitError)
    mine, ref = make_layer(spec_full, spec, seed)
    op = MegaMoE(spec, max_tokens_per_rank=C, experts_backend="torch", device="cpu").bind(mine)
    x, w, ids = make_case("skewed", spec_full, rank, world, placement("linear", world), seed)
    # overflow on rank 0 only: every rank raises before anything is sent; no partial write
    before = {n: t.clone() for n, t in op.buffers.items()}
    T0 = C + 1 if rank == 0 else 2
    g = torch.Generator().manual_seed(seed + rank)
    xo = torch.randn(T0, H, generator=g).bfloat16()
    wo = torch.rand(T0, K, generator=g)
    io = torch.randint(0, E, (T0, K), generator=g)
    checks.expect_error("overflow on rank 0", lambda: op.forward(xo, wo, io), f"rank 0 ({C + 1} tokens)",
                        f"max_tokens_per_rank={C}")
    checks.record("overflow wrote nothing", all(torch.equal(before[n].view(torch.uint8), t.view(torch.uint8))
                                                for n, t in op.buffers.items()))
    # invalid input on the last rank: every rank raises, naming it
    xb = torch.randn(2, H + 1).bfloat16() if rank == world - 1 else x
    wb, ib = (torch.rand(2, K), torch.randint(0, E, (2, K))) if rank == world - 1 else (w, ids)
    checks.expect_error("bad input on last rank", lambda: op.forward(xb, wb, ib), f"rank {world - 1}: x must be")
    # the op still works afterwards
    compare(checks, "forward after errors", op.forward(x, w, ids), reference(spec_full, ref, x, w, ids, "bf16"), x)
    op.close()
    checks.expect_error("forward after close", lambda: op.forward(x, w, ids), "closed")
    # without the per-call agreement (check_tokens=False) valid calls give the same answer
    fast = MegaMoE(spec, max_tokens_per_rank=C, experts_backend="torch", device="cpu", check_tokens=False)
    compare(checks, "forward without agreement", fast(x, w, ids, mine), reference(spec_full, ref, x, w, ids, "bf16"), x)
    fast.close()


def scenario_peer_fails(checks: Checks, rank: int, world: int, seed: int, timeout_s: float, die: bool):
    spec_full = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, max_tokens_per_rank=C)
    spec = spec_full.for_rank(rank, world)
    mine, _ = make_layer(spec_full, spec, seed)
    op = MegaMoE(spec, max_tokens_per_rank=C, experts_backend="torch", device="cpu").bind(mine)
    x, w, ids = make_case("random", spec_full, rank, world, placement("linear", world), seed)
    dist.barrier()
    if rank == world - 1:  # this rank's own code fails before it reaches forward
        if die:
            os._exit(17)
        time.sleep(timeout_s + 4)
        return
    start = time.monotonic()
    checks.expect_error("peer failure surfaces", lambda: op.forward(x, w, ids), "did not all reach forward")
    elapsed = time.monotonic() - start
    checks.record("peer failure within timeout", elapsed < timeout_s + 6, elapsed=elapsed, timeout=timeout_s)


def scenario_gpu_graph(checks: Checks, rank: int, world: int, seed: int, local_rank: int, transport: str = "torch"):
    """NCCL + triton experts: warm-up, then capture the whole forward and replay with fresh routing each time."""
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    cases = (("bf16", "bf16"), ("fp8", "fp8")) + ((("a8w4", "fp8"), ("a16w4", "bf16")) if transport == "symm" else ())
    for scheme, wire in cases:
        spec_full = MoESpec.create(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2, scheme=scheme,
                                   max_tokens_per_rank=32)
        spec = spec_full.for_rank(rank, world)
        raw = random_layer(spec_full, generator=torch.Generator().manual_seed(seed))
        mine = prepare_stacked(spec, raw.w13, raw.w2, layout="separated", device=device)
        # the reference runs on the GPU too: fp32 matmuls on another device round the intermediate differently,
        # and near-tie fp8 roundings of it then flip (measured ~1% Frobenius at this size), hiding real errors
        ref = ReferenceWeights.from_prepared(prepare_stacked(spec_full, raw.w13, raw.w2, layout="separated",
                                                             device=device))
        op = MegaMoE(spec, max_tokens_per_rank=32, transport=transport, wire=wire, experts_backend="triton",
                     device=device)
        tag = f"gpu {transport} {scheme}/{wire}"
        planned = buffer_sizes(spec, world, 32, wire, transport=transport, experts_backend="triton")
        checks.record(f"{tag} bytes", op.allocated_bytes() == sum(planned.values()))
        for wc in op.warmup(mine, seed=seed):
            compare(checks, f"{tag} warmup {wc.name}", wc.out,
                    reference(spec_full, ref, wc.x, wc.topk_weights, wc.topk_ids, wire), wc.x)
        owners = [list(spec_full.for_rank(r, world).local_experts) for r in range(world)]
        for ci, case in enumerate(("random", "skewed", "one_expert", "rank_gets_nothing")):
            if world == 1 and case == "rank_gets_nothing":
                continue  # one rank owns every expert
            x, w, ids = make_case(case, spec_full, rank, world, owners, seed + 17 * ci, experts=8, top_k=2,
                                  capacity=32)
            x, w, ids = x.to(device), w.to(device), ids.to(device)
            if transport == "symm":
                from atom_moe.ep.symm import FUSED, SPLIT
                op.combine_override = FUSED if (ci + rank) % 2 else SPLIT
            out = op.forward(x, w, ids)
            compare(checks, f"{tag} {case}", out, reference(spec_full, ref, x, w, ids, wire), x)
        op.combine_override = None
        T = 29  # a batch size other than the warm-up's
        g = torch.Generator().manual_seed(seed + rank)
        x_s = torch.empty(T, 256, dtype=torch.bfloat16, device=device)
        w_s = torch.empty(T, 2, device=device)
        ids_s = torch.empty(T, 2, dtype=torch.int64, device=device)
        x, w, ids = random_tokens(spec_full, T, generator=g, device=device)
        x_s.copy_(x), w_s.copy_(w), ids_s.copy_(ids)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync in forward raises
        try:
            eager = op.forward(x_s, w_s, ids_s)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        compare(checks, f"{tag} eager no-sync", eager, reference(spec_full, ref, x, w, ids, wire), x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_s = op.forward(x_s, w_s, ids_s)
        for i in range(4):
            x, w, ids = random_tokens(spec_full, T, generator=g, skew=2.0 * i, device=device)
            if i == 3:
                ids = torch.full_like(ids, i)  # degenerate routing in a replay
            x_s.copy_(x), w_s.copy_(w), ids_s.copy_(ids)
            graph.replay()
            torch.cuda.synchronize()
            compare(checks, f"{tag} replay {i}", out_s, reference(spec_full, ref, x, w, ids, wire), x)
        del graph
        if scheme == "bf16":  # memory stays flat over 1000 calls across 61 bound layers
            layers = []
            for i in range(61):
                raw_i = random_layer(spec_full, generator=torch.Generator().manual_seed(seed + i))
                layers.append(prepare_stacked(spec, raw_i.w13, raw_i.w2, layout="separated", device=device))
            for i in range(61):
                op(x_s, w_s, ids_s, layers[i])
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated(device)
            for i in range(1000):
                op(x_s, w_s, ids_s, layers[i % 61])
            torch.cuda.synchronize()
            after = torch.cuda.memory_allocated(device)
            checks.record(f"{tag} memory flat", after <= before, before=before, after=after)
        op.close()


def main() -> int:
    scenario = sys.argv[1]
    timeout_s = float(os.environ.get("EP_TEST_PG_TIMEOUT", "60"))
    backend = "nccl" if scenario.startswith("gpu_") else "gloo"
    info = init_distributed(backend, timeout=timedelta(seconds=timeout_s))
    rank, world = info.rank, info.world_size
    seed = int(os.environ.get("EP_TEST_SEED", "1234"))
    torch.manual_seed(seed + rank)
    checks = Checks(rank)
    checks.record("launcher", info.launcher == os.environ.get("EP_TEST_LAUNCHER", info.launcher),
                  launcher=info.launcher, world=world)
    try:
        if scenario == "correctness":
            scenario_correctness(checks, rank, world, seed)
        elif scenario == "smoke":
            scenario_correctness(checks, rank, world, seed, schemes=("bf16", "a8w4"))
        elif scenario == "symm":
            scenario_symm(checks, rank, world, seed)
        elif scenario == "gpu_graph":
            scenario_gpu_graph(checks, rank, world, seed, info.local_rank)
        elif scenario == "gpu_symm":
            scenario_gpu_graph(checks, rank, world, seed, info.local_rank, transport="symm")
        elif scenario == "errors":
            scenario_errors(checks, rank, world, seed)
        elif scenario == "redundant":
            scenario_redundant(checks, rank, world, seed)
        elif scenario == "shared":
            scenario_shared(checks, rank, world, seed)
        elif scenario == "shared_symm":
            scenario_shared(checks, rank, world, seed, transport="symm")
        elif scenario == "redundant_symm":
            scenario_redundant(checks, rank, world, seed, transport="symm")
        elif scenario in ("peer_fails", "peer_dies"):
            scenario_peer_fails(checks, rank, world, seed, timeout_s, die=scenario == "peer_dies")
            print(f"DONE rank={rank} failed={checks.failed}", flush=True)
            os._exit(1 if checks.failed else 0)  # the group is broken on purpose: skip teardown
        else:
            raise SystemExit(f"unknown scenario {scenario!r}")
    except Exception:
        traceback.print_exc()
        checks.failed.append("exception")
    start = time.monotonic()
    dist.destroy_process_group()  # teardown must finish: the launching test has a hard timeout
    done = f"DONE rank={rank} failed={checks.failed} teardown_s={time.monotonic() - start:.2f}"
    print(done, flush=True)
    if checks.file:  # mpiexec may drop a rank's last stdout line as the rank exits (seen under pytest-xdist)
        checks.file.close()
        Path(checks.file.name).with_suffix(".done").write_text(done + "\n")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    code = main()
    # Everything is checked and the groups are destroyed; skip interpreter finalization, where
    # gloo's worker threads can abort the process ("terminate called without an active exception",
    # rc -6 after DONE: CI 2026-12-02; pytorch/pytorch#179291 describes the finalization race).
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)
