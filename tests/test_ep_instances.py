"""Decode and prefill MegaMoE instances (atom_moe.ep.MegaMoEInstances): the pick, the outputs, the errors.

2 gloo ranks (tests/ep_instances_worker.py): steps on both sides of the decode capacity, with the
count gathered by the pair and given by the "engine"; every output element vs the single-rank fp32
reference; ranks that pick different ops and an agreed count below a rank's real one raise on every
rank. EP 1 in process: the pick by the batch's own size, the custom op with an agreed-count callable.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from atom_moe import ops
from atom_moe.ep import MegaMoEError, MegaMoEInstances, buffer_sizes
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import MoESpec
from atom_moe.tools.synthetic import random_layer, random_tokens
from atom_moe.weights import prepare_stacked
from engine_common import record_instance_calls
from test_ep_multiproc import assert_all_passed, run_ranks as run_multiproc_ranks

WORKER = Path(__file__).with_name("ep_instances_worker.py")

STEPS, WARMUPS = 8, 8  # ep_instances_worker.STEPS; 4 warm-up batches per op
# bytes x 2 ops; per step and mode: pick, output, every element, shared weights; warm-ups x 2; 3 errors;
# the step after them x 2; the bad decode capacity
CHECKS = 2 + STEPS * 2 * 4 + WARMUPS * 2 + 3 + 2 + 1


@pytest.mark.parametrize("scheme", ["bf16", "a8w4"])
def test_two_ranks_pick_alike_and_match_reference(scheme, seed):
    res = assert_all_passed(run_ranks(f"{scheme}/torch", 2, seed, timeout=300),
                            CHECKS)
    names = {r["check"] for r in res}
    assert {f"{scheme}/torch step 0 gathered picks decode", f"{scheme}/torch step 3 engine picks prefill",
            f"{scheme}/torch ranks pick different ops", f"{scheme}/torch decode op above its capacity"} <= names


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the symm transport's kernels run on the CPU "
                    "only under TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_two_ranks_symm_transport(seed):
    """The same steps over the symm transport (shared-file heaps, Triton experts under the interpreter)."""
    assert_all_passed(run_ranks("bf16/symm", 2, seed, timeout=600), CHECKS)


def run_ranks(scenario: str, world: int, seed: int, timeout: float):
    """Launch `world` instance workers; return [(rc, stdout, stderr)] by rank."""
    return run_multiproc_ranks(scenario, world, seed, timeout, worker=WORKER)


def _layer(seed: int, scheme: str = "bf16"):
    spec = MoESpec.create(hidden_size=96, intermediate_size=64, num_experts=6, top_k=2, scheme=scheme,
                          max_tokens_per_rank=16)
    raw = random_layer(spec, generator=torch.Generator().manual_seed(seed))
    weights = prepare_stacked(spec, raw.w13, raw.w2, layout="separated")
    return spec, weights, ReferenceWeights.from_prepared(weights)


def test_one_rank_picks_by_batch_size(seed):
    spec, weights, ref = _layer(seed)
    pair = MegaMoEInstances(spec, None, max_tokens_per_rank=16, decode_tokens=5, experts_backend="torch",
                            device="cpu")
    assert pair.decode.transport_name == pair.prefill.transport_name == "local"
    for name, op, cap in (("decode", pair.decode, 5), ("prefill", pair.prefill, 16)):
        assert op.max_tokens_per_rank == cap, name
        assert op.allocated_bytes() == sum(buffer_sizes(spec, 1, cap, "bf16", transport="local",
                                                        experts_backend="torch").values())
    g = torch.Generator().manual_seed(seed)
    for T in (0, 1, 5, 6, 16):
        x, w, ids = random_tokens(spec, T, generator=g)
        assert pair.pick(T) is (pair.decode if T <= 5 else pair.prefill)
        out = pair(x, w.contiguous(), ids.contiguous(), weights)
        assert out.shape == (T, 96) and torch.isfinite(out).all()
        if T:
            want = reference_moe(x, w, ids, ref, spec.activation)
            err = ((out.float() - want).norm() / want.norm()).item()
            assert err <= 1e-2, (T, err)  # bf16 rounding of x and the intermediate
            assert (out.float() - want).abs().max() <= 3e-2 * want.abs().max()
    assert pair.decode._weights is weights and pair.prefill._weights is weights  # shared, not copied
    # an agreed count below the batch: the decode op would run above its capacity, and refuses
    x, w, ids = random_tokens(spec, 7, generator=g)
    with pytest.raises(MegaMoEError, match="7 tokens exceed max_tokens_per_rank=5"):
        pair(x, w.contiguous(), ids.contiguous(), weights, agreed_tokens=3)
    with pytest.raises(MegaMoEError, match=r"decode_tokens=16 must be an int in \[1, max_tokens_per_rank=16\)"):
        MegaMoEInstances(spec, None, max_tokens_per_rank=16, decode_tokens=16, experts_backend="torch", device="cpu")
    with pytest.raises(MegaMoEError, match="needs check_tokens=True"):
        MegaMoEInstances(spec, None, max_tokens_per_rank=16, decode_tokens=4, check_tokens=False,
                         experts_backend="torch", device="cpu")
    pair.close()


def test_small_decode_op_below_the_decode_capacity(seed):
    """small_tokens < decode_tokens: three ops, the smallest that holds the batch runs; outputs vs the reference."""
    spec, weights, ref = _layer(seed)
    small = int(torch.randint(1, 5, (), generator=torch.Generator().manual_seed(seed)))
    pair = MegaMoEInstances(spec, None, max_tokens_per_rank=16, decode_tokens=6, small_tokens=small,
                            experts_backend="torch", device="cpu")
    assert [op.max_tokens_per_rank for op in pair.ops] == [small, 6, 16] and pair.decode_ops[-1] is pair.decode
    assert pair.allocated_bytes() == sum(sum(buffer_sizes(spec, 1, cap, "bf16", transport="local",
                                                          experts_backend="torch").values()) for cap in (small, 6, 16))
    ran = []
    for op in pair.ops:
        op.forward = lambda *a, _f=op.forward, _c=op.max_tokens_per_rank, **k: (ran.append(_c), _f(*a, **k))[1]
    g = torch.Generator().manual_seed(seed)
    for T in sorted({1, small, small + 1, 6, 7, 16}):
        x, w, ids = random_tokens(spec, T, generator=g)
        out = pair(x, w.contiguous(), ids.contiguous(), weights)
        assert ran[-1] == (small if T <= small else 6 if T <= 6 else 16), (T, ran)
        want = reference_moe(x, w, ids, ref, spec.activation)
        assert (out.float() - want).abs().max() <= 3e-2 * want.abs().max(), T
    assert all(op._weights is weights for op in pair.ops)  # one copy of the weights
    for bad in (-1, 2.0):
        with pytest.raises(MegaMoEError, match="small_tokens=.* must be an int >= 0"):
            MegaMoEInstances(spec, None, max_tokens_per_rank=16, decode_tokens=6, small_tokens=bad,
                             experts_backend="torch", device="cpu")
    one = MegaMoEInstances(spec, None, max_tokens_per_rank=16, decode_tokens=6, small_tokens=6,
                           experts_backend="torch", device="cpu")
    assert [op.max_tokens_per_rank for op in one.ops] == [6, 16]  # no small op at or above decode_tokens
    one.close()
    pair.close()


def test_custom_op_takes_the_engines_agreed_count(seed):
    """torch.ops.atom_moe.mega_moe over a pair: the callable's count picks the op, per call."""
    spec, weights, ref = _layer(seed)
    pair = MegaMoEInstances(spec, None, max_tokens_per_rank=16, decode_tokens=4, experts_backend="torch",
                            device="cpu")
    agreed = [0]
    handle = ops.bind_mega_moe(pair, weights, agreed_tokens=lambda: agreed[0])
    ran = record_instance_calls(pair, 4, 16)
    g = torch.Generator().manual_seed(seed)
    for T, engine_max in ((3, 3), (3, 9), (4, 4), (8, 8)):  # (3, 9): a peer DP rank brought 9 tokens
        agreed[0] = engine_max
        x, w, ids = random_tokens(spec, T, generator=g)
        out = torch.ops.atom_moe.mega_moe(x, w.contiguous(), ids.contiguous(), handle)
        assert ran[-1] == ("decode" if engine_max <= 4 else "prefill"), (T, engine_max, ran)
        want = reference_moe(x, w, ids, ref, spec.activation)
        assert ((out.float() - want).norm() / want.norm()).item() <= 1e-2
    ops.unbind(handle)
    pair.close()


@pytest.mark.gpu
def test_graphs_captured_for_decode_sizes_replay_the_decode_op(seed):
    """CUDA, Triton experts, EP 1: the graph's size picks the op at capture (decode at T <= D, prefill above);
    replays with new routing equal the reference, with no host sync; both ops bind one copy of the weights."""
    spec = MoESpec.create(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2, scheme="bf16")
    raw = random_layer(spec, generator=torch.Generator().manual_seed(seed))
    weights = prepare_stacked(spec, raw.w13, raw.w2, layout="separated", device="cuda")
    ref = ReferenceWeights.from_prepared(weights)
    pair = MegaMoEInstances(spec, None, max_tokens_per_rank=64, decode_tokens=8, experts_backend="triton",
                            device="cuda")
    pair.warmup(weights, seed=seed)
    pair.bind(weights)
    ran = record_instance_calls(pair, 8, 64)
    g = torch.Generator().manual_seed(seed)
    for T, want in ((1, "decode"), (8, "decode"), (9, "prefill"), (64, "prefill")):
        x, w, ids = random_tokens(spec, T, generator=g, device="cuda")
        x_s, w_s, ids_s = x.clone(), w.contiguous().clone(), ids.contiguous().clone()
        pair.forward(x_s, w_s, ids_s)  # eager first: compiles this size's kernels outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_s = pair.forward(x_s, w_s, ids_s)
        assert ran[-1] == want, (T, ran)
        steps = [random_tokens(spec, T, generator=g, device="cuda") for _ in range(3)]  # drawn before: it syncs
        torch.cuda.set_sync_debug_mode("error")
        try:
            for x, w, ids in steps:
                x_s.copy_(x), w_s.copy_(w), ids_s.copy_(ids)
                graph.replay()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        want_out = reference_moe(x, w, ids, ref, spec.activation)
        err = ((out_s.float() - want_out).norm() / want_out.norm()).item()
        assert torch.isfinite(out_s).all() and err <= 1e-2, (T, err)
    assert pair.decode._weights is weights and pair.prefill._weights is weights
    pair.close()
