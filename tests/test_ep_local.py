"""The MegaMoE op at EP size 1 (local transport, no process group) on the CPU: results, warm-up, errors."""

from __future__ import annotations

import pytest
import torch

from atom_moe.ep import MegaMoE, MegaMoEError
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import MoESpec
from atom_moe.tools.synthetic import random_layer, random_tokens
from atom_moe.weights import WeightError, prepare_stacked

H, I, E, K, C = 160, 64, 8, 3, 12
TOL = 1e-2  # relative Frobenius vs the fp32 reference (bf16 rounding, fp8 activation quantization)


def layer(spec: MoESpec, seed: int):
    raw = random_layer(spec, generator=torch.Generator().manual_seed(seed))
    prepared = prepare_stacked(spec, raw.w13, raw.w2, layout="separated")
    return prepared, ReferenceWeights.from_prepared(prepared)


def check(out, x, w, ids, ref, spec):
    act_quant = spec.scheme if spec.scheme.fp8_activations else None
    expect = reference_moe(x, w, ids, ref, spec.activation, act_quant=act_quant)
    assert out.shape == expect.shape and out.dtype == x.dtype and torch.isfinite(out).all()
    scale = expect.norm()
    err = (out.float() - expect).norm()
    assert (err <= TOL * scale) if scale > 0 else err == 0, f"rel err {err / scale}"


def make_op(spec, **kw) -> MegaMoE:
    return MegaMoE(spec, None, **{"max_tokens_per_rank": C, "experts_backend": "torch", "device": "cpu", **kw})


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
def test_local_matches_reference(scheme, seed):
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme=scheme)
    layers = [layer(spec, seed + i) for i in range(2)]
    with make_op(spec) as op:
        assert op.transport_name == "local" and op.allocated_bytes() == 0  # no copies, no buffers
        g = torch.Generator().manual_seed(seed)
        for i, T in enumerate((C, 5, 1)):
            x, w, ids = random_tokens(spec, T, generator=g)
            ids[0, 0] = -1  # sentinels contribute nothing
            prepared, ref = layers[i % 2]
            check(op(x, w, ids, prepared), x, w, ids, ref, spec)
        empty = op.forward(x[:0], w[:0], ids[:0])
        assert empty.shape == (0, H) and empty.dtype == x.dtype
        for case in op.warmup(layers[0][0], seed=seed):
            check(case.out, case.x, case.topk_weights, case.topk_ids, layers[0][1], spec)
        sentinel = [c for c in op.warmup() if c.name == "sentinel"][0]
        assert torch.equal(sentinel.out, torch.zeros_like(sentinel.out))


def test_local_errors(seed):
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)
    prepared, _ = layer(spec, seed)
    g = torch.Generator().manual_seed(seed)
    x, w, ids = random_tokens(spec, C + 1, generator=g)
    op = make_op(spec)
    with pytest.raises(MegaMoEError, match="no weights bound"):
        op.forward(x[:2], w[:2], ids[:2])
    op.bind(prepared)
    with pytest.raises(MegaMoEError, match=f"{C + 1} tokens exceed max_tokens_per_rank={C}"):
        op.forward(x, w, ids)
    cases = [
        ((x[:2, :-1], w[:2], ids[:2]), "x must be a \\[T, H=160\\]"),
        ((x[:2].to(torch.int32), w[:2], ids[:2]), "x dtype torch.int32 not supported"),
        ((x[:2], w[:2], ids[:2, :2]), "topk_ids must be \\[T, top_k\\] = \\[2, 3\\]"),
        ((x[:2], w[:2], ids[:2].float()), "topk_ids dtype torch.float32 not supported"),
        ((x[:2], w[:2].to(torch.int64), ids[:2]), "topk_weights dtype torch.int64 not supported"),
        ((x[:4:2], w[:2], ids[:2]), "x must be contiguous"),
    ]
    for args, pattern in cases:
        with pytest.raises(MegaMoEError, match=pattern):
            op.forward(*args)
    other = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme="fp8")
    with pytest.raises(WeightError, match="do not match the spec"):
        op.bind(layer(other, seed)[0])
    op.close()
    op.close()  # idempotent
    with pytest.raises(MegaMoEError, match="closed"):
        op.forward(x[:2], w[:2], ids[:2])


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(wire="fp8"), "wire='fp8' needs a transport that moves tokens"),
    (dict(wire="fp4"), "unknown wire 'fp4'; allowed: bf16, fp8"),
    (dict(transport="nvshmem"), "unknown transport 'nvshmem'; allowed: auto, local, torch"),
    (dict(transport="torch"), "needs an initialized torch.distributed process group"),
    (dict(experts_backend="cutlass"), "unknown experts_backend 'cutlass'"),
])
def test_build_errors(kwargs, pattern):
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)
    with pytest.raises(MegaMoEError, match=pattern):
        make_op(spec, **kwargs)


def test_build_rejects_foreign_placement_and_bad_capacity():
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K).for_rank(1, 2)
    with pytest.raises(MegaMoEError, match="rank 1 of 2 but this process is rank 0 of 1"):
        make_op(spec)
    spec1 = spec.for_rank(0, 1)
    for bad in (0, -3, 2.5):
        with pytest.raises(MegaMoEError, match="max_tokens_per_rank must be a positive int"):
            MegaMoE(spec1, None, max_tokens_per_rank=bad, experts_backend="torch", device="cpu")


@pytest.mark.parametrize("transport", ["local", "torch"])
def test_outputs_are_not_overwritten_by_the_next_call(transport, seed):
    """One op serves every layer: a layer's output must survive the next layer's forward (fp32 x too)."""
    import torch.distributed as dist

    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)
    first, ref_first = layer(spec, seed)
    second, _ = layer(spec, seed + 1)
    gen = torch.Generator().manual_seed(seed)
    if transport == "torch":
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with make_op(spec, transport=transport) as op:
            x, w, ids = random_tokens(spec, C, generator=gen)
            x = x.float()
            out1 = op(x, w, ids, first)
            kept = out1.clone()
            op(random_tokens(spec, C, generator=gen)[0].float(), w, ids, second)
            assert torch.equal(out1, kept), "the previous layer's output was overwritten"
            check(out1, x, w, ids, ref_first, spec)
    finally:
        if transport == "torch":
            dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_forward_into_out(backend, seed):
    """forward(..., out=) writes the caller's tensor (the Triton path directly, no copy) and checks it."""
    import os
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton experts run on the CPU only under TRITON_INTERPRET=1 (scripts/test.sh sets it)")
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)
    prepared, ref = layer(spec, seed)
    x, w, ids = random_tokens(spec, 7, generator=torch.Generator().manual_seed(seed))
    with make_op(spec, experts_backend=backend).bind(prepared) as op:
        out = torch.full_like(x, float("nan"))
        got = op.forward(x, w, ids, out=out)
        assert got is out and torch.equal(out, op.forward(x, w, ids))
        check(out, x, w, ids, ref, spec)
        for bad, pattern in ((torch.empty(7, H, dtype=torch.float32), "out must be a contiguous \\[T, H\\]"),
                             (torch.empty(6, H, dtype=torch.bfloat16), "out must be a contiguous \\[T, H\\]"),
                             (torch.empty(H, 7, dtype=torch.bfloat16).t(), "out must be a contiguous")):
            with pytest.raises(MegaMoEError, match=pattern):
                op.forward(x, w, ids, out=bad)
