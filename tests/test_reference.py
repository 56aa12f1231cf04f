"""route(), the fp32 reference and the torch twin (experts_torch) against each other."""

from __future__ import annotations

import math

import pytest
import torch

from atom_moe import formats as F
from atom_moe.experts_torch import experts_torch, local_ids
from atom_moe.reference import (ReferenceWeights, apply_activation, quant_dequant_activations, reference_moe,
                                reference_moe_prepared)
from atom_moe.routing import route
from atom_moe.spec import Activation, ActivationKind, MoESpec, Routing, Scheme, Scoring
from atom_moe.weights import prepare_stacked

SWIGLU = Activation()
OAI = Activation(ActivationKind.SWIGLU_OAI, alpha=1.702, limit=7.0)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def close(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Frobenius relative error <= tol and no single element off by more than 3 tol of the scale."""
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) <= tol, rel_err(out, ref)
    assert ((out.float() - ref.float()).abs() <= 3 * tol * ref.float().abs().max()).all()


# ---------------------------------------------------------------- route()
def hand_route(logits, routing: Routing, top_k, bias=None):
    t, e = logits.shape
    ws, ids = [], []
    for row in range(t):
        lg = [float(v) for v in logits[row]]
        if routing.scoring is Scoring.SOFTMAX:
            m = max(lg)
            ex = [math.exp(v - m) for v in lg]
            scores = [v / sum(ex) for v in ex]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in lg]
        choice = [s + (float(bias[i]) if bias is not None else 0.0) for i, s in enumerate(scores)]
        allowed = set(range(e))
        if routing.n_group > 1:
            size = e // routing.n_group
            gscore = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(routing.n_group)]
            kept = sorted(range(routing.n_group), key=lambda g: -gscore[g])[:routing.topk_group]
            allowed = {i for g in kept for i in range(g * size, (g + 1) * size)}
        pick = sorted(allowed, key=lambda i: -choice[i])[:top_k]
        w = [scores[i] for i in pick]
        if routing.renormalize:
            w = [v / sum(w) for v in w]
        ws.append([v * routing.routed_scaling_factor for v in w])
        ids.append(pick)
    return torch.tensor(ws), torch.tensor(ids)


@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("e, k", [(8, 2), (32, 4), (128, 8)])
def test_route_softmax(seed, renorm, e, k):
    logits = torch.randn(20, e) * 2
    routing = Routing(Scoring.SOFTMAX, renormalize=renorm)
    w, ids = route(logits, routing, k)
    hw, hids = hand_route(logits, routing, k)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64 and w.shape == ids.shape == (20, k)
    assert torch.equal(ids, hids)
    assert torch.allclose(w, hw.float(), rtol=1e-5, atol=1e-7)
    wb, idb = route(logits.bfloat16(), routing, k)  # bf16 logits are accepted, computed in fp32
    assert wb.dtype == torch.float32
    hwb = hand_route(logits.bfloat16().float(), routing, k)[0].float()
    assert torch.allclose(wb.sort(-1).values, hwb.sort(-1).values, rtol=1e-5, atol=1e-7)
    if renorm:
        assert torch.allclose(w.sum(-1), torch.ones(20))
    else:
        assert (w.sum(-1) < 1).all()


@pytest.mark.parametrize("n_group, topk_group, k, scale, renorm",
                         [(8, 4, 8, 2.5, True), (4, 2, 3, 1.0, True), (1, 1, 8, 2.827, True), (8, 4, 6, 1.5, False)])
def test_route_sigmoid_bias_grouped(seed, n_group, topk_group, k, scale, renorm):
    e = 64
    logits = torch.randn(24, e)
    bias = torch.randn(e) * 0.5  # big enough to change choices
    routing = Routing(Scoring.SIGMOID, renormalize=renorm, n_group=n_group, topk_group=topk_group,
                      correction_bias=True, routed_scaling_factor=scale)
    w, ids = route(logits, routing, k, bias)
    hw, hids = hand_route(logits, routing, k, bias)
    assert torch.equal(ids, hids)
    assert torch.allclose(w, hw.float(), rtol=1e-5, atol=1e-7)
    scores = logits.sigmoid()
    # weights come from the unbiased scores (renormalized), then scaled
    raw = scores.gather(1, ids)
    want = (raw / raw.sum(-1, keepdim=True) if renorm else raw) * scale
    assert torch.allclose(w, want, rtol=1e-6)
    if renorm:
        assert torch.allclose(w.sum(-1), torch.full((24,), scale))
    # chosen experts lie in the topk_group best groups (by the sum of the two best biased scores)
    size = e // n_group
    gscore = (scores + bias).view(24, n_group, size).topk(2, -1).values.sum(-1)
    kept = gscore.topk(topk_group, -1).indices
    for t in range(24):
        assert set((ids[t] // size).tolist()) <= set(kept[t].tolist())
    # and the bias mattered for some token (the choice is not the unbiased top-k)
    assert any(set(ids[t].tolist()) != set(scores[t].topk(k).indices.tolist()) for t in range(24))


def test_route_errors():
    routing = Routing(Scoring.SIGMOID, correction_bias=True)
    with pytest.raises(ValueError, match="correction bias"):
        route(torch.randn(4, 8), routing, 2)
    with pytest.raises(ValueError, match=r"must be \[T, E\]"):
        route(torch.randn(8), Routing(), 2)


# ---------------------------------------------------------------- activations
def test_apply_activation(seed):
    g, u = torch.randn(30, 40) * 6, torch.randn(30, 40) * 6
    assert torch.allclose(apply_activation(g, u, SWIGLU), g * torch.sigmoid(g) * u, rtol=1e-6, atol=1e-6)
    gc, uc = torch.minimum(g, torch.tensor(7.0)), u.clamp(-7, 7)
    want = gc * torch.sigmoid(1.702 * gc) * (uc + 1)
    got = apply_activation(g.bfloat16(), u.bfloat16(), OAI)
    assert got.dtype == torch.float32
    assert torch.allclose(apply_activation(g, u, OAI), want, rtol=1e-6, atol=1e-6)
    big = apply_activation(torch.tensor([100.0, -100.0]), torch.tensor([100.0, -100.0]), OAI)
    assert torch.allclose(big, torch.tensor([7 * torch.sigmoid(torch.tensor(1.702 * 7)).item() * 8, 0.0]))


def test_quant_dequant_activations(seed, monkeypatch):
    monkeypatch.delenv("ATOM_MOE_A8W4_INTER", raising=False)
    a = torch.randn(5, 200)
    for s in (Scheme.BF16, Scheme.A16W4):
        assert torch.equal(quant_dequant_activations(a, s), a)
    for s in (Scheme.FP8, Scheme.A8W4):
        d = quant_dequant_activations(a, s)
        assert not torch.equal(d, a) and rel_err(d, a) < 4e-2
    # GEMM1's input: fp8 per 128-group, a8w4 per token; GEMM2's: fp8 per 128-group, a8w4 per token of the bf16
    # row (by default) or per 64-group (ATOM_MOE_A8W4_INTER=group)
    cases = [(Scheme.FP8, False, F.quantize_fp8_per_group(a, 128), 128),
             (Scheme.A8W4, False, F.quantize_fp8_per_token_grouped(a, 128), 128),
             (Scheme.FP8, True, F.quantize_fp8_per_group(a, 128), 128)]
    for s, inter, (q, sc), group in cases:
        assert torch.equal(quant_dequant_activations(a, s, inter=inter), F.dequantize_fp8_per_group(q, sc, group))
    q, sc = F.quantize_fp8_per_token(a.bfloat16())
    assert torch.equal(quant_dequant_activations(a, Scheme.A8W4, inter=True), q.float() * sc)
    monkeypatch.setenv("ATOM_MOE_A8W4_INTER", "group")
    q, sc = F.quantize_fp8_per_group(a, 64)
    assert torch.equal(quant_dequant_activations(a, Scheme.A8W4, inter=True), F.dequantize_fp8_per_group(q, sc, 64))


# ---------------------------------------------------------------- reference_moe
H, I, E, T = 256, 192, 8, 64


def raw_weights(e=E, bias=False):
    w13 = torch.randn(e, 2 * I, H) * H ** -0.5
    w2 = torch.randn(e, H, I) * I ** -0.5
    b13 = torch.randn(e, 2 * I) * 0.5 if bias else None
    b2 = torch.randn(e, H) * 0.5 if bias else None
    return w13, w2, b13, b2


def routing_for(t=T, e=E, k=2):
    ids = torch.rand(t, e).argsort(1)[:, :k]
    return torch.rand(t, k) + 0.1, ids


def loop_reference(x, tw, ti, w13, w2, b13, b2, act):
    """Token-by-token float64 oracle for reference_moe itself."""
    x, w13, w2 = x.double(), w13.double(), w2.double()
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ti.shape[1]):
            e = int(ti[t, k])
            if not 0 <= e < w13.shape[0]:
                continue
            h = w13[e] @ x[t]
            if b13 is not None:
                h = h + b13[e].double()
            y = w2[e] @ apply_activation(h[:I], h[I:], act).double()
            if b2 is not None:
                y = y + b2[e].double()
            out[t] += float(tw[t, k]) * y
    return out


@pytest.mark.parametrize("act, bias", [(SWIGLU, False), (OAI, True)])
def test_reference_moe_vs_loop(seed, act, bias):
    w13, w2, b13, b2 = raw_weights(bias=bias)
    x = torch.randn(16, H)
    tw, ti = routing_for(16, k=3)
    ti[0, 1], ti[3, 0], ti[5, 2] = -1, E, -1  # sentinels
    ti[:, 2] = torch.where(ti[:, 2] >= 0, torch.full_like(ti[:, 2], 4), ti[:, 2])  # expert 4 in most tokens
    ref = reference_moe(x, tw, ti, ReferenceWeights.from_separated(w13, w2, b13, b2), act)
    assert ref.dtype == torch.float32 and ref.shape == (16, H)
    assert torch.allclose(ref.double(), loop_reference(x, tw, ti, w13, w2, b13, b2, act), rtol=1e-4, atol=1e-5)


def test_reference_moe_ep_shares_sum_to_full(seed):
    w13, w2, b13, b2 = raw_weights(bias=True)
    rw = ReferenceWeights.from_separated(w13, w2, b13, b2)
    x = torch.randn(T, H)
    tw, ti = routing_for(k=3)
    full = reference_moe(x, tw, ti, rw, OAI)
    perm = torch.randperm(E).tolist()
    for parts in ([range(0, 4), range(4, 8)], [range(r * 2, r * 2 + 2) for r in range(4)],
                  [perm[:1], perm[1:4], perm[4:]]):
        shares = [reference_moe(x, tw, ti, rw, OAI, experts=p) for p in parts]
        assert torch.allclose(sum(shares), full, rtol=1e-5, atol=1e-5)
        for p, s in zip(parts, shares):
            untouched = ~torch.isin(ti, torch.tensor(list(p))).any(1)
            assert (s[untouched] == 0).all() and (s[~untouched] != 0).any()
    # a reference built from a subset of experts (rows = global ids) is that share
    sub = [1, 6, 3]
    rws = ReferenceWeights.from_separated(w13[sub], w2[sub], b13[sub], b2[sub], experts=sub)
    assert torch.allclose(reference_moe(x, tw, ti, rws, OAI), reference_moe(x, tw, ti, rw, OAI, experts=sub),
                          rtol=1e-6, atol=1e-6)


def test_reference_moe_sentinels_and_hot_expert(seed):
    w13, w2, _, _ = raw_weights()
    rw = ReferenceWeights.from_separated(w13, w2)
    x = torch.randn(T, H)
    tw, ti = routing_for(k=3)
    base = reference_moe(x, tw, ti, rw, SWIGLU)
    dropped = ti.clone()
    dropped[::3, 0], dropped[1::3, 2] = -1, E  # sentinel slots contribute nothing
    tw0 = tw.clone()
    tw0[::3, 0], tw0[1::3, 2] = 0, 0
    assert torch.allclose(reference_moe(x, tw, dropped, rw, SWIGLU), reference_moe(x, tw0, ti, rw, SWIGLU),
                          rtol=1e-5, atol=1e-6)
    all_bad = torch.full_like(ti, -1)
    all_bad[:, 1] = E
    assert (reference_moe(x, tw, all_bad, rw, SWIGLU) == 0).all()
    # one expert takes every token
    hot = ti.clone()
    hot[:, 0] = 5
    hot[:, 1:] = torch.where(hot[:, 1:] == 5, torch.full_like(hot[:, 1:], 2), hot[:, 1:])
    hot[:, 2] = torch.where(hot[:, 2] == 2, torch.full_like(hot[:, 2], 7), hot[:, 2])
    hot[:, 1] = torch.where(hot[:, 1] == 7, torch.full_like(hot[:, 1], 0), hot[:, 1])
    out = reference_moe(x, tw, hot, rw, SWIGLU)
    assert torch.allclose(out.double(), loop_reference(x, tw, hot, w13, w2, None, None, SWIGLU), rtol=1e-4, atol=1e-5)
    only = reference_moe(x, tw, hot, rw, SWIGLU, experts=[5])
    y5 = (torch.nn.functional.silu(x @ w13[5, :I].T) * (x @ w13[5, I:].T)) @ w2[5].T
    assert torch.allclose(only, y5 * tw[:, :1], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(base, out)


# ---------------------------------------------------------------- experts_torch vs reference
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
@pytest.mark.parametrize("act, bias", [(SWIGLU, False), (OAI, True)])
def test_experts_torch_vs_reference(seed, scheme, act, bias):
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, scheme=scheme,
                          activation=act, has_bias=bias)
    w13, w2, b13, b2 = raw_weights(bias=bias)
    p = prepare_stacked(spec, w13, w2, layout="separated", w13_bias=b13, w2_bias=b2)
    x = torch.randn(T, H, dtype=torch.bfloat16)
    tw, ti = routing_for()
    out = experts_torch(x, tw, ti, p, spec)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    if scheme == "bf16":
        ref = reference_moe(x, tw, ti, ReferenceWeights.from_separated(w13, w2, b13, b2), act)
    else:
        act_quant = spec.scheme if spec.scheme.fp8_activations else None
        ref = reference_moe(x, tw, ti, ReferenceWeights.from_prepared(p), act, act_quant=act_quant)
    close(out, ref, 1e-2)
    # the quantized schemes are still the same layer as the fp32 weights, only coarser
    full = reference_moe(x, tw, ti, ReferenceWeights.from_separated(w13, w2, b13, b2), act)
    assert rel_err(out, full) < {"bf16": 0.02, "fp8": 0.08}.get(scheme, 0.35)


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
def test_reference_moe_prepared_chunks_add_up(seed, scheme):
    """Chunked dequantization (what the tuner uses on layers too large for fp32) gives the whole layer's reference,
    on a rank holding a subset of the experts, with -1 / E sentinels in the ids."""
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=3, scheme=scheme,
                          activation=OAI, has_bias=True)
    w13, w2, b13, b2 = raw_weights(bias=True)
    local = tuple(torch.randperm(E)[:E - 1].tolist())  # one expert lives elsewhere
    rs = spec.for_rank(0, 2, local)
    p = prepare_stacked(rs, w13, w2, layout="separated", w13_bias=b13, w2_bias=b2)
    x = torch.randn(T, H)
    tw, ti = routing_for(k=3)
    ti[0, 0], ti[1, 2] = -1, E
    act_quant = spec.scheme if spec.scheme.fp8_activations else None
    want = reference_moe(x, tw, ti, ReferenceWeights.from_prepared(p), OAI, act_quant=act_quant)
    assert want.abs().max() > 0
    for chunk in (1, 2, E):
        got = reference_moe_prepared(x, tw, ti, p, OAI, act_quant=act_quant, chunk=chunk)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max())), chunk
    with pytest.raises(ValueError, match="chunk=0"):
        reference_moe_prepared(x, tw, ti, p, OAI, chunk=0)


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a8w4"])
def test_experts_torch_ep_ranks(seed, scheme):
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=3, scheme=scheme,
                          activation=OAI, has_bias=True)
    w13, w2, b13, b2 = raw_weights(bias=True)
    full_p = prepare_stacked(spec, w13, w2, layout="separated", w13_bias=b13, w2_bias=b2)
    rw = ReferenceWeights.from_prepared(full_p)
    act_quant = spec.scheme if spec.scheme.fp8_activations else None
    x = torch.randn(T, H)
    tw, ti = routing_for(k=3)
    ti[0, 0], ti[1, 2] = -1, E
    full = experts_torch(x, tw, ti, full_p, spec)
    perm = torch.randperm(E).tolist()
    for layout in ([None, None], [None] * 4, [tuple(perm[:2]), tuple(perm[2:3]), tuple(perm[3:])]):
        world = len(layout)
        total = torch.zeros_like(full)
        for r, local in enumerate(layout):
            rs = spec.for_rank(r, world, local)
            p = prepare_stacked(rs, w13, w2, layout="separated", w13_bias=b13, w2_bias=b2)
            assert p.num_local_experts == len(rs.local_experts) and p.w13.data.shape[0] == len(rs.local_experts)
            out = experts_torch(x, tw, ti, p, rs)
            ref = reference_moe(x, tw, ti, rw, OAI, experts=rs.local_experts, act_quant=act_quant)
            close(out, ref, 1e-2)
            mine = torch.isin(ti, torch.tensor(rs.local_experts)).any(1)
            assert (out[~mine] == 0).all()
            lids = local_ids(ti, p.expert_map)
            for t in range(T):
                for k in range(3):
                    e = int(ti[t, k])
                    want = rs.local_experts.index(e) if e in rs.local_experts else -1
                    assert int(lids[t, k]) == want
            total += out
        assert torch.allclose(total, full, rtol=1e-4, atol=1e-5)
