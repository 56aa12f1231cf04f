"""Redundant experts in one process: tables and their validation, the greedy placement, the op at EP 1 (local
transport), W simulated symm ranks, the load statistic, rebalancing in place, `atom-moe place` and `plan`.

The multi-rank gloo runs are tests/test_ep_redundant.py.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from atom_moe.balance import balanced_placement, rank_loads
from atom_moe.ep import MegaMoE, MegaMoEError, buffer_plan, buffer_sizes
from atom_moe.ep.rebalance import slot_tensors
from atom_moe.placement import ExpertPlacement, PlacementError, physical_ids, slot_moves
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import MoESpec, SpecError
from atom_moe.tools.cli import main
from atom_moe.tools.plan import PlanError, make_plan
from atom_moe.checkpoint.config import load_model
from atom_moe.tools.synthetic import random_layer, random_tokens
from atom_moe.weights import prepare_stacked

H, I, E, K, C = 64, 32, 6, 2, 10


def spec_of(scheme: str = "bf16", experts: int = E) -> MoESpec:
    return MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=experts, top_k=K, scheme=scheme,
                          max_tokens_per_rank=C)


def random_map(gen: torch.Generator, experts: int, slots: int) -> list[int]:
    """Every expert once plus slots - experts extra replicas (of a few hot experts), shuffled."""
    hot = torch.randperm(experts, generator=gen)[:2]
    extra = hot[torch.randint(0, 2, (slots - experts,), generator=gen)].tolist()
    phys = list(range(experts)) + extra
    return [phys[i] for i in torch.randperm(slots, generator=gen).tolist()]


def shuffled(p: ExpertPlacement, gen: torch.Generator) -> ExpertPlacement:
    """The same map with each expert's replica order shuffled in logical_to_physical."""
    table = p.logical_to_physical.clone()
    for e in range(table.shape[0]):
        c = int(p.replica_count[e])
        table[e, :c] = table[e, :c][torch.randperm(c, generator=gen)]
    return ExpertPlacement(p.physical_to_logical, table, p.replica_count)


def zipf_counts(experts: int, gen: torch.Generator, tokens: int = 20000) -> torch.Tensor:
    """Token counts with popularity ~ 1 / rank^1.2 over a random order of the experts."""
    pop = 1.0 / torch.arange(1, experts + 1, dtype=torch.float64) ** 1.2
    pop = pop[torch.randperm(experts, generator=gen)]
    return torch.bincount(torch.multinomial(pop, tokens, replacement=True, generator=gen), minlength=experts)


# ---------------------------------------------------------------- tables
def test_from_map_and_validation(seed):
    gen = torch.Generator().manual_seed(seed)
    phys = random_map(gen, E, 10)
    p = ExpertPlacement.from_map(phys, E).check(E, 2)
    assert p.slots() == tuple(phys)
    for e in range(E):
        c = int(p.replica_count[e])
        assert c == phys.count(e) and sorted(p.logical_to_physical[e, :c].tolist()) == [
            s for s, x in enumerate(phys) if x == e]
        assert (p.logical_to_physical[e, c:] == -1).all()
    R = 10 - E + 1
    bad_slot = p.logical_to_physical.clone()
    bad_slot[0, 0] = 10
    dup = p.logical_to_physical.clone()
    hot = int(p.replica_count.argmax())
    dup[hot, 1] = dup[hot, 0]
    cases = [
        (ExpertPlacement(p.physical_to_logical, p.logical_to_physical, p.replica_count + 1), 2,
         "replica_count disagrees with physical_to_logical"),
        (ExpertPlacement(p.physical_to_logical, bad_slot, p.replica_count), 2, "slot ids [10] outside [0, P=10)"),
        (ExpertPlacement(p.physical_to_logical, dup, p.replica_count), 2, "distinct slots holding expert"),
        (ExpertPlacement(p.physical_to_logical.int(), p.logical_to_physical, p.replica_count), 2,
         "physical_to_logical is torch.int32; allowed: an int64 tensor"),
        (ExpertPlacement(p.physical_to_logical, p.logical_to_physical[:, :R - 1], p.replica_count), 2,
         f"allowed: [num_experts, P - num_experts + 1] = [{E}, {R}]"),
        (ExpertPlacement(p.physical_to_logical, p.logical_to_physical, p.replica_count[:-1]), 2,
         f"replica_count is ({E - 1},); allowed: [num_experts] = [{E}]"),
        (p, 4, "10 slots, not divisible by the EP world size 4"),
        (ExpertPlacement.from_map([0, 1, 2, 3, 4, 4, 4, 4, 0, 1], E), 2, "logical experts [5] have no physical slot"),
    ]
    for bad, world, needle in cases:
        with pytest.raises(PlacementError, match=None) as info:
            bad.check(E, world)
        assert needle in str(info.value), (needle, str(info.value))


def test_spec_physical_map_errors():
    s = spec_of()
    for phys, world, needle in (((0, 1, 2, 3, 4), 1, "fewer than the 6 logical experts"),
                                ((0, 1, 2, 3, 4, 5, 0), 2, "7 slots, not divisible by the EP world size 2"),
                                ((0, 1, 2, 3, 4, 6), 1, "ids outside [0, num_experts=6)"),
                                ((0, 1, 2, 3, 4, 4), 1, "logical experts [5] have no physical slot")):
        with pytest.raises(SpecError, match=None) as info:
            s.for_rank(0, world, physical_experts=phys)
        assert needle in str(info.value)
    r1 = s.for_rank(1, 2, physical_experts=(0, 1, 2, 3, 4, 5, 0, 0))
    assert r1.local_experts == (4, 5, 0, 0) and r1.num_physical_experts == 8 and r1.redundant
    assert r1.kernel_spec.num_experts == 8 and r1.kernel_spec.local_experts == (4, 5, 6, 7)


def test_physical_ids_follow_the_table(seed):
    gen = torch.Generator().manual_seed(seed)
    p = shuffled(ExpertPlacement.from_map(random_map(gen, E, 12), E), gen)
    N, P, rank, T = E, 12, 1, 7
    table = torch.cat([p.logical_to_physical, torch.full((1, P - N + 1), -1)])
    table[N, 0] = P
    count = torch.cat([p.replica_count, torch.ones(1, dtype=torch.int64)])
    pairs = torch.arange(C * K).view(C, K) + rank * C * K
    ids = torch.randint(-1, E + 1, (T, K), generator=gen)
    out = physical_ids(ids, table, count, pairs, torch.empty(C, K, dtype=torch.int64))
    for t in range(T):
        for j in range(K):
            e = int(ids[t, j])
            want = P if not 0 <= e < N else int(p.logical_to_physical[e, ((rank * C + t) * K + j)
                                                                          % int(p.replica_count[e])])
            assert int(out[t, j]) == want


def test_slot_moves_prefer_local_sources():
    old, new = [0, 1, 2, 3, 0, 4, 5, 1], [0, 0, 2, 3, 1, 4, 5, 5]
    moves = slot_moves(old, new, 2)
    assert moves == [(0, 1), (7, 4), (6, 7)]  # slot 1 from slot 0 (same rank); 4 from 7; 7 from 6
    with pytest.raises(PlacementError, match="keep the slot count"):
        slot_moves(old, new[:-1], 2)


# ---------------------------------------------------------------- greedy placement
@pytest.mark.parametrize("experts, world, extra", [(16, 4, 4), (32, 8, 8), (24, 4, 0), (64, 8, 16)])
def test_balanced_placement_on_zipf_counts(experts, world, extra, seed):
    gen = torch.Generator().manual_seed(seed)
    counts = zipf_counts(experts, gen)
    P = experts + extra
    p = balanced_placement(counts, P, world).check(experts, world)
    assert p.num_slots == P and int(p.replica_count.sum()) == P and bool((p.replica_count >= 1).all())
    assert set(p.slots()) == set(range(experts))
    loads, linear = rank_loads(p, counts, world), rank_loads(ExpertPlacement.identity(experts), counts, world)
    assert abs(sum(loads) - float(counts.sum())) < 1e-6 * float(counts.sum())
    assert max(loads) < max(linear), (loads, linear)
    if extra:  # the hottest expert got the most replicas
        assert int(p.replica_count[int(counts.argmax())]) == int(p.replica_count.max()) >= 2


def test_balanced_placement_rejects_bad_input():
    for counts, slots, world, needle in (([[1, 2]], 2, 1, "1-D"), ([], 2, 1, "non-empty"),
                                         ([1, -2, 3], 3, 1, ">= 0"), ([1, float("nan")], 2, 1, "finite"),
                                         ([1, 2, 3], 2, 1, "num_slots=2 must be >= the 3 experts"),
                                         ([1, 2, 3], 5, 2, "a multiple of the EP size 2"),
                                         ([1, 2], 4, 0, "world_size must be a positive int")):
        with pytest.raises(PlacementError, match=None) as info:
            balanced_placement(counts, slots, world)
        assert needle in str(info.value), (needle, str(info.value))


# ---------------------------------------------------------------- the op at EP 1
def close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Every element within tol of the largest |ref|, and the relative Frobenius error within tol / 3."""
    err = (out.float() - ref).abs()
    assert torch.isfinite(out).all() and out.shape == ref.shape
    if not out.numel():
        return
    assert float(err.max()) <= tol * float(ref.abs().max()), float(err.max())
    assert float(err.norm()) <= tol / 3 * float(ref.norm())


def layer(spec_full: MoESpec, spec: MoESpec, seed: int):
    raw = random_layer(spec_full, generator=torch.Generator().manual_seed(seed))
    return raw, prepare_stacked(spec, raw.w13, raw.w2, layout="separated"), \
        prepare_stacked(spec_full, raw.w13, raw.w2, layout="separated")


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a8w4"])
def test_local_op_matches_reference_and_plain_op(scheme, seed):
    """EP 1 with 10 slots for 6 experts: every element against the plain op and the reference.

    Not bit for bit: an expert's tokens split over its replicas reach the matmuls in other groups."""
    gen = torch.Generator().manual_seed(seed)
    full = spec_of(scheme)
    placed = shuffled(ExpertPlacement.from_map(random_map(gen, E, 10), E), gen)
    spec = full.for_rank(0, 1, physical_experts=placed.slots())
    raw, mine, plain_w = layer(full, spec, seed)
    ref = ReferenceWeights.from_prepared(plain_w)
    op = MegaMoE(spec, max_tokens_per_rank=C, experts_backend="torch", device="cpu", placement=placed)
    plain = MegaMoE(full, max_tokens_per_rank=C, experts_backend="torch", device="cpu")
    act_quant = full.scheme if full.scheme.fp8_activations else None
    for T in (C, 3, 0):
        x, w, ids = random_tokens(full, T, generator=gen)
        ids = torch.where(torch.rand(ids.shape, generator=gen) < 0.1, -1, ids)
        out = op(x, w, ids, mine)
        close(out, plain(x, w, ids, plain_w).float(), 1e-2)
        if T:
            close(out, reference_moe(x, w, ids, ref, full.activation, act_quant=act_quant), 3e-2)
    assert op.allocated_bytes() == sum(buffer_sizes(spec, 1, C).values()) > 0


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4"])
def test_identity_map_is_bit_for_bit_and_plain_spec_unchanged(scheme, seed):
    full = spec_of(scheme)
    ident = full.for_rank(0, 1, physical_experts=tuple(range(E)))
    _, mine, plain_w = layer(full, ident, seed)
    assert buffer_plan(full, 1, C) == {}  # without redundant experts the op allocates what it did before
    op = MegaMoE(ident, max_tokens_per_rank=C, experts_backend="torch", device="cpu")
    plain = MegaMoE(full, max_tokens_per_rank=C, experts_backend="torch", device="cpu")
    gen = torch.Generator().manual_seed(seed)
    for T in (C, 3):
        x, w, ids = random_tokens(full, T, generator=gen)
        ids[0, 0], ids[1, 1] = -1, E  # sentinels
        assert torch.equal(op(x, w, ids, mine), plain(x, w, ids, plain_w))
    with pytest.raises(MegaMoEError, match="needs a spec with redundant experts"):
        MegaMoE(full, max_tokens_per_rank=C, experts_backend="torch", device="cpu",
                placement=ExpertPlacement.identity(E))
    with pytest.raises(MegaMoEError, match="rebalance needs redundant experts"):
        plain.rebalance(ExpertPlacement.identity(E), [plain_w])


def test_wrong_tables_raise_at_build(seed):
    gen = torch.Generator().manual_seed(seed)
    full = spec_of()
    placed = ExpertPlacement.from_map(random_map(gen, E, 10), E)
    spec = full.for_rank(0, 1, physical_experts=placed.slots())
    other = ExpertPlacement.from_map(placed.slots()[1:] + placed.slots()[:1], E)  # rotated: never the same map
    for bad, needle in ((ExpertPlacement(placed.physical_to_logical, placed.logical_to_physical,
                                         placed.replica_count - 1), "replica_count disagrees"),
                        (other, "differs from the spec's physical_experts"),
                        ("tables", "placement must be an ExpertPlacement")):
        with pytest.raises(MegaMoEError, match=None) as info:
            MegaMoE(spec, max_tokens_per_rank=C, experts_backend="torch", device="cpu", placement=bad)
        assert "rank 0:" in str(info.value) and needle in str(info.value)


def test_load_statistic_counts_exactly(seed):
    gen = torch.Generator().manual_seed(seed)
    full = spec_of()
    spec = full.for_rank(0, 1, physical_experts=tuple(random_map(gen, E, 8)))
    _, mine, _ = layer(full, spec, seed)
    off = MegaMoE(spec, max_tokens_per_rank=C, experts_backend="torch", device="cpu")
    assert "expert_load" not in off.buffers
    with pytest.raises(MegaMoEError, match="record_load=True"):
        off.expert_load()
    for s in (spec, full):  # with and without redundant experts
        weights = mine if s is spec else layer(full, full, seed)[1]
        op = MegaMoE(s, max_tokens_per_rank=C, experts_backend="torch", device="cpu", record_load=True)
        assert op.allocated_bytes() == sum(buffer_sizes(s, 1, C, record_load=True).values())
        want = torch.zeros(E, dtype=torch.int64)
        for T in (C, 4, 0, 7):
            x, w, ids = random_tokens(full, T, generator=gen, skew=2.0)
            r = torch.rand(ids.shape, generator=gen)
            ids = torch.where(r < 0.1, E, torch.where(r < 0.2, -1, ids))  # sentinels count nowhere
            op(x, w, ids, weights)
            valid = ids[(ids >= 0) & (ids < E)]
            want += torch.bincount(valid.flatten(), minlength=E)
            assert torch.equal(op.expert_load(), want)
        ptr = op.buffers["expert_load"].data_ptr()
        op.reset_load()
        assert int(op.expert_load().sum()) == 0 and op.buffers["expert_load"].data_ptr() == ptr


def test_rebalance_in_place_at_ep1(seed):
    gen = torch.Generator().manual_seed(seed)
    full = spec_of("fp8")
    placed = ExpertPlacement.from_map(random_map(gen, E, 9), E)
    spec = full.for_rank(0, 1, physical_experts=placed.slots())
    made = [layer(full, spec, seed + i) for i in range(2)]
    layers = [m[1] for m in made]
    op = MegaMoE(spec, max_tokens_per_rank=C, experts_backend="torch", device="cpu", placement=placed,
                 record_load=True)
    x, w, ids = random_tokens(full, C, generator=gen, skew=3.0)
    op(x, w, ids, layers[0])
    new = balanced_placement(op.expert_load(), 9, 1)
    ptrs = {n: t.data_ptr() for n, t in op.buffers.items()} | {
        (i, j): t.data_ptr() for i, lw in enumerate(layers) for j, t in enumerate(slot_tensors(lw))}
    op.rebalance(new, layers)
    after = {n: t.data_ptr() for n, t in op.buffers.items()} | {
        (i, j): t.data_ptr() for i, lw in enumerate(layers) for j, t in enumerate(slot_tensors(lw))}
    assert after == ptrs
    assert torch.equal(op.buffers["slot_expert"], new.physical_to_logical)
    fresh = full.for_rank(0, 1, physical_experts=new.slots())
    for (raw, lw, plain_w) in made:
        want = prepare_stacked(fresh, raw.w13, raw.w2, layout="separated")
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(slot_tensors(lw), slot_tensors(want)))
        plain = MegaMoE(full, max_tokens_per_rank=C, experts_backend="torch", device="cpu")
        close(op(x, w, ids, lw), plain(x, w, ids, plain_w).float(), 1e-2)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the symm kernels run on the CPU only under "
                    "TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_simulated_symm_ranks_with_redundant_experts(seed):
    """2 simulated symm ranks in one process: random placement, then a rebalance; against the reference."""
    from atom_moe.ep.simulate import SimulatedSymmGroup
    gen = torch.Generator().manual_seed(seed)
    full = spec_of()
    placed = ExpertPlacement.from_map(random_map(gen, E, 10), E)
    specs = [full.for_rank(r, 2, physical_experts=placed.slots()) for r in range(2)]
    raw = random_layer(full, generator=torch.Generator().manual_seed(seed))
    ref = ReferenceWeights.from_prepared(prepare_stacked(full, raw.w13, raw.w2, layout="separated"))
    weights = [prepare_stacked(s, raw.w13, raw.w2, layout="separated") for s in specs]
    group = SimulatedSymmGroup(specs, C)
    for phase in range(2):
        toks = [random_tokens(full, T, generator=gen) for T in (C, 4)]
        outs = [torch.empty(t[0].shape, dtype=t[0].dtype) for t in toks]
        group.forward(weights, [t[0] for t in toks], [t[1] for t in toks], [t[2] for t in toks], outs)
        for (x, w, ids), out in zip(toks, outs):
            close(out, reference_moe(x, w, ids, ref, full.activation), 3e-2)
        if phase == 0:
            new = ExpertPlacement.from_map(random_map(gen, E, 10), E)
            ptrs = [t.data_ptr() for lw in weights for t in slot_tensors(lw)]
            group.rebalance(new, [weights])
            assert [t.data_ptr() for lw in weights for t in slot_tensors(lw)] == ptrs


def capture_rebalance_replay(device: torch.device, dims: tuple[int, int, int, int, int, int, int], scheme: str,
                             seed: int) -> None:
    """W simulated symm ranks with redundant experts: warm, capture (GPU) one forward of every rank, then
    three phases of new routing + replay, with a rebalance to a new random placement between phases.

    Checks per phase: every rank's output element by element against the fp32 reference, that each
    (token, slot) went to a slot holding its expert under the current placement (the replay read the
    rewritten tables), every slot's weights bit for bit those of a fresh build for the current map
    (the copies landed), and no weight, table or buffer address changed. On the CPU (interpreter)
    the "replay" is an eager forward on the same buffers.
    """
    from atom_moe.ep.simulate import SimulatedSymmGroup
    Hd, Id, Ed, Kd, Cd, W, P = dims
    gen = torch.Generator().manual_seed(seed)
    full = MoESpec.create(hidden_size=Hd, intermediate_size=Id, num_experts=Ed, top_k=Kd, scheme=scheme,
                          max_tokens_per_rank=Cd)
    placed = ExpertPlacement.from_map(random_map(gen, Ed, P), Ed)
    specs = [full.for_rank(r, W, physical_experts=placed.slots()) for r in range(W)]
    raw = random_layer(full, generator=torch.Generator().manual_seed(seed))
    ref = ReferenceWeights.from_prepared(prepare_stacked(full, raw.w13, raw.w2, layout="separated", device=device))
    weights = [prepare_stacked(s, raw.w13, raw.w2, layout="separated", device=device) for s in specs]
    wire = "fp8" if full.scheme.fp8_activations else "bf16"
    group = SimulatedSymmGroup(specs, Cd, wire, device)
    Ts = [Cd - 2 * r for r in range(W)]  # uneven token counts, static shapes for the graph
    xs = [torch.empty(T, Hd, dtype=torch.bfloat16, device=device) for T in Ts]
    ws = [torch.empty(T, Kd, device=device) for T in Ts]
    ids = [torch.empty(T, Kd, dtype=torch.int64, device=device) for T in Ts]
    outs = [torch.empty(T, Hd, dtype=torch.bfloat16, device=device) for T in Ts]

    def load(skew: float) -> None:
        for r, T in enumerate(Ts):
            x, w, i = random_tokens(full, T, generator=gen, skew=skew)
            i = torch.where(torch.rand(i.shape, generator=gen) < 0.05, -1, i)  # sentinels route nowhere
            xs[r].copy_(x), ws[r].copy_(w), ids[r].copy_(i)
            outs[r].fill_(float("nan"))  # an unwritten element fails below

    def addresses() -> list[int]:
        return [t.data_ptr() for lw in weights for t in slot_tensors(lw)] + [
            t.data_ptr() for tables in group.tables for t in tables.values()] + [o.data_ptr() for o in outs]

    load(0.0)
    group.forward(weights, xs, ws, ids, outs)  # compiles the kernels, outside any capture
    run = lambda: group.forward(weights, xs, ws, ids, outs)  # noqa: E731
    if device.type == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            group.forward(weights, xs, ws, ids, outs)
        run = graph.replay
    before = addresses()
    act_quant = full.scheme if full.scheme.fp8_activations else None
    for phase in range(3):
        if phase:  # a new placement between steps: slot copies and table rewrites in place
            if device.type == "cuda":
                torch.cuda.synchronize()
            placed = ExpertPlacement.from_map(random_map(gen, Ed, P), Ed)
            group.rebalance(placed, [weights])
            for r, s in enumerate(specs):
                fresh = prepare_stacked(full.for_rank(r, W, physical_experts=placed.slots()), raw.w13, raw.w2,
                                        layout="separated", device=device)
                assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                           for a, b in zip(slot_tensors(weights[r]), slot_tensors(fresh))), f"phase {phase} rank {r}"
        load(1.5 * phase)
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        slot_of = placed.physical_to_logical.to(device)
        for r, T in enumerate(Ts):
            sid, lid = group.tables[r]["slot_ids"][:T], ids[r]
            valid = (lid >= 0) & (lid < Ed)
            assert torch.equal(slot_of[sid[valid]], lid[valid]), f"phase {phase} rank {r}: slot of another expert"
            close(outs[r], reference_moe(xs[r], ws[r], ids[r], ref, full.activation, act_quant=act_quant), 3e-2)
        assert addresses() == before, f"phase {phase}: an address changed"
    assert group.errors() == [0] * W


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the symm kernels run on the CPU only under "
                    "TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_rebalance_between_replays_cpu(seed):
    """The capture -> rebalance -> replay sequence at tiny dims, eager (the GPU test below captures it)."""
    capture_rebalance_replay(torch.device("cpu"), (H, I, E, K, 6, 2, 10), "bf16", seed)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_rebalance_between_graph_replays_gpu(scheme, seed):
    """One GPU, 4 simulated symm ranks, 32 experts in 40 slots: every rank's forward in one CUDA graph,
    replayed before and after two rebalances (no recapture), correct each time."""
    capture_rebalance_replay(torch.device("cuda"), (2048, 1024, 32, 4, 64, 4, 40), scheme, seed)


# ---------------------------------------------------------------- the CLI
def test_place_subcommand(tmp_path, capsys, seed):
    gen = torch.Generator().manual_seed(seed)
    counts = zipf_counts(16, gen).tolist()
    src = tmp_path / "counts.json"
    src.write_text(json.dumps({"counts": counts}))
    out = tmp_path / "placement.json"
    assert main(["place", str(src), "--ep", "4", "--slots", "20", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "16 experts, 20 slots over EP 4 (5 per rank)" in text and "max / mean rank load: proposed" in text
    from atom_moe.tools.place import load_placement
    p = load_placement(str(out)).check(16, 4)
    assert p.slots() == balanced_placement(counts, 20, 4).slots()
    for argv, needle in (([str(src), "--ep", "4", "--slots", "18"], "a multiple of the EP size 4"),
                         ([str(tmp_path / "none.json"), "--ep", "2"], "is not readable JSON"),
                         ([str(src), "--ep", "4", "--slots", "8"], "must be >= the 16 experts")):
        assert main(["place", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("atom-moe place: error:") and needle in err[0], err
    src.write_text("[1, 2, \"x\"]")
    assert main(["place", str(src), "--ep", "1"]) == 2
    assert "non-empty list of numbers" in capsys.readouterr().err


def test_plan_counts_slots():
    layer = load_model("deepseek-v3", None)
    base = make_plan(layer, ep=8, tokens=256, gpu_bytes=140 * 2**30)
    more = make_plan(layer, ep=8, tokens=256, gpu_bytes=140 * 2**30, redundant_experts=32)
    assert more.spec.num_local_experts == 36 and base.spec.num_local_experts == 32
    assert more.weight_bytes * 32 == base.weight_bytes * 36
    owner = more.buffers.get("expert_owner") or 2 * more.buffers["owner"]  # int64 (torch) or int32 (symm) [P + 1]
    assert owner == 8 * (288 + 1)
    assert more.buffer_bytes > base.buffer_bytes
    with pytest.raises(PlanError, match="must divide over EP 8; allowed: R with"):
        make_plan(layer, ep=8, tokens=256, gpu_bytes=140 * 2**30, redundant_experts=3)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_buffer_plan_counts_slots(world):
    """docs/ep.md's redundant-expert rows, written out: owner tables over P slots plus the routing tables."""
    n = 8
    full = spec_of(experts=n)
    phys = tuple(range(n)) + (0, 0, 0, 1)  # P = 12, R = 5
    spec = full.for_rank(0, world, physical_experts=phys)
    plan = {n: (b.shape, b.dtype) for n, b in buffer_plan(spec, world, C, record_load=True).items()}
    plain = {n: (b.shape, b.dtype) for n, b in buffer_plan(full.for_rank(0, world), world, C).items()}
    i64 = torch.int64
    extra = {"slot_expert": ((12,), i64), "replica_slots": ((n + 1, 5), i64), "replica_count": ((n + 1,), i64),
             "pair_index": ((C, K), i64), "slot_ids": ((C, K), i64), "expert_load": ((n + 1,), i64),
             "load_ones": ((C * K,), i64)}
    want = plain | extra
    if world > 1:
        want["expert_owner"] = ((12 + 1,), i64)
    assert plan == want
