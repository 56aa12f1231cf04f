"""Property-based fuzzing of every public entry point (issue 21): random valid and invalid specs,
weights and inputs give the correct result or a clear ValueError naming what is wrong, never
another exception, a crash or a silently wrong answer.

Entry points: MoESpec.create, prepare_stacked, experts_torch, reference_moe, fused_experts (the
Triton path: interpreter on the CPU, real kernels on a GPU) and MegaMoE (one rank). Correct
results are checked against the fp32 reference on the prepared weights' dequantized values
(activation quant included for the fp8-activation schemes): 1e-2 relative, as in the kernel tests.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atom_moe import MegaMoE, MoESpec, SpecError, prepare_stacked
from atom_moe.experts_torch import experts_torch
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import Activation, ActivationKind, Placement
from atom_moe.weights import WeightError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning",
                                        "ignore:.*x is float32:UserWarning")
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
BAD_CALLS = ["none", "ids_k", "weights_T", "ids_float", "x_int", "x_hidden", "x_3d", "map_permuted", "map_range"]
WHO = {"ids_k": "topk_ids|topk_weights", "weights_T": "topk_weights", "ids_float": "topk_ids", "x_int": "x dtype",
       "x_hidden": r"x must be", "x_3d": r"x must be", "map_permuted": "expert_map", "map_range": "expert_map"}


@st.composite
def layers(draw, schemes=("bf16", "fp8", "a16w4", "a8w4")):
    """(spec, prepared weights) of a small random layer, on DEVICE."""
    torch.manual_seed(draw(st.integers(0, 2**31 - 1)))
    scheme = draw(st.sampled_from(schemes))
    mx = scheme in ("a16w4", "a8w4")
    H = draw(st.sampled_from([64, 96, 160] if not mx else [64, 96]))
    I = draw(st.sampled_from([32, 64]))
    E = draw(st.integers(2, 8))
    k = draw(st.integers(1, min(E, 4)))
    local = tuple(sorted(draw(st.sets(st.integers(0, E - 1), min_size=1, max_size=E))))
    oai = draw(st.booleans())
    spec = MoESpec(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, scheme=scheme,
                   activation=Activation(ActivationKind.SWIGLU_OAI, limit=3.0) if oai else Activation(),
                   has_bias=oai, placement=Placement(0, 2, local))
    w13 = torch.randn(E, 2 * I, H) * (2.0 / H ** 0.5)
    w2 = torch.randn(E, H, I) / I ** 0.5
    bias = dict(w13_bias=torch.randn(E, 2 * I), w2_bias=torch.randn(E, H)) if oai else {}
    return spec, prepare_stacked(spec, w13, w2, layout=draw(st.sampled_from(["separated", "interleaved"])),
                                 device=DEVICE, **bias)


@st.composite
def calls(draw, spec):
    """(x, topk_weights, topk_ids, bad) for `spec`: ids include -1 and E sentinels; `bad` names the corruption."""
    T = draw(st.integers(0, 9))
    E, k = spec.num_experts, spec.top_k
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32) if T else \
        torch.empty(0, k, dtype=torch.int32)
    if T and draw(st.booleans()):  # sentinels: a padded row and a non-existent expert
        ids[0, 0] = -1
        ids[-1, -1] = E
    ids = ids.to(draw(st.sampled_from([torch.int32, torch.int64])))
    w = torch.rand(T, k).to(draw(st.sampled_from([torch.float32, torch.bfloat16])))
    x = torch.randn(T, spec.hidden_size).to(draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])))
    bad = draw(st.sampled_from(BAD_CALLS))
    if bad == "ids_k":
        ids = ids[:, :-1] if k > 1 else torch.cat((ids, ids), 1)
    elif bad == "weights_T":
        w = torch.rand(T + 1, k)
    elif bad == "ids_float":
        ids = ids.float()
    elif bad == "x_int":
        x = (x * 4).to(torch.int32)
    elif bad == "x_hidden":
        x = x[:, :-32]
    elif bad == "x_3d":
        x = x.unsqueeze(0)
    return x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), bad


def _corrupt(p, bad: str):
    """Weights whose expert_map is corrupted as `bad` says (a permutation needs two local experts)."""
    if bad not in ("map_permuted", "map_range"):
        return p, bad
    if bad == "map_permuted" and p.num_local_experts < 2:
        return p, "none"
    q = dataclasses.replace(p)  # the map is replaced after build: checked again at the next call
    m = p.expert_map.clone()
    a = p.local_experts[0]
    if bad == "map_permuted":
        b = p.local_experts[1]
        m[a], m[b] = p.expert_map[b], p.expert_map[a]
    else:
        m[a] = p.num_local_experts + 3
    q.expert_map = m
    return q, bad


def _expect(spec, p, run, x, w, ids, bad) -> None:
    """run(...) is right for a valid call, and raises a ValueError naming the culprit for a bad one."""
    if bad != "none":
        with pytest.raises(ValueError, match=WHO[bad]):
            run(x, w, ids, p, spec)
        return
    out = run(x, w, ids, p, spec)
    assert out.shape == x.shape and out.dtype == x.dtype
    fp8 = spec.scheme.fp8_activations
    ref = reference_moe(x, w, ids, ReferenceWeights.from_prepared(p), spec.activation, experts=spec.local_experts,
                        act_quant=spec.scheme if fp8 else None)
    err = (out.double() - ref.double()).norm()
    assert err <= 1e-2 * ref.double().norm() + 1e-6, (float(err), float(ref.norm()))


def _fused(x, w, ids, p, spec):
    from atom_moe.experts import fused_experts
    return fused_experts(x, w, ids, p, spec)


@settings(max_examples=40, **SETTINGS)
@given(st.data())
def test_fuzz_experts_torch(data):
    spec, p = data.draw(layers())
    x, w, ids, bad = data.draw(calls(spec))
    p, bad = _corrupt(p, bad)
    _expect(spec, p, experts_torch, x, w, ids, bad)


@settings(max_examples=25, **SETTINGS)
@given(st.data())
def test_fuzz_fused_experts(data):
    pytest.importorskip("triton")
    spec, p = data.draw(layers())
    x, w, ids, bad = data.draw(calls(spec))
    p, bad = _corrupt(p, bad)
    _expect(spec, p, _fused, x, w, ids, bad)


@settings(max_examples=20, **SETTINGS)
@given(st.data())
def test_fuzz_megamoe_one_rank(data):
    spec, p = data.draw(layers(schemes=("bf16", "fp8")))
    spec = dataclasses.replace(spec, placement=Placement())  # one rank owns every expert
    p = prepare_stacked(spec, *_dense(spec), layout="separated", device=DEVICE,
                        **({"w13_bias": torch.randn(spec.num_experts, 2 * spec.intermediate_size),
                            "w2_bias": torch.randn(spec.num_experts, spec.hidden_size)} if spec.has_bias else {}))
    x, w, ids, bad = data.draw(calls(spec))
    p, bad = _corrupt(p, bad)
    backend = "triton" if DEVICE == "cuda" else "torch"
    with MegaMoE(spec, experts_backend=backend, device=DEVICE, max_tokens_per_rank=16) as op:
        _expect(spec, p, lambda x_, w_, i_, p_, s_: op(x_, w_, i_, p_), x, w, ids, bad)


def _dense(spec):
    E, H, I = spec.num_experts, spec.hidden_size, spec.intermediate_size
    return torch.randn(E, 2 * I, H) * (2.0 / H ** 0.5), torch.randn(E, H, I) / I ** 0.5


@settings(max_examples=25, **SETTINGS)
@given(st.data())
def test_fuzz_reference_moe(data):
    spec, p = data.draw(layers(schemes=("bf16",)))
    x, w, ids, bad = data.draw(calls(spec))
    ref_w = ReferenceWeights.from_prepared(p)
    if bad in ("none", "map_permuted", "map_range"):  # the reference reads no map
        out = reference_moe(x, w, ids, ref_w, spec.activation)
        assert out.shape == x.shape and out.dtype == torch.float32 and torch.isfinite(out).all()
        return
    with pytest.raises(ValueError, match=WHO[bad]):
        reference_moe(x, w, ids, ref_w, spec.activation)


@settings(max_examples=60, **SETTINGS)
@given(H=st.integers(-2, 300), I=st.integers(-2, 300), E=st.integers(-1, 20), k=st.integers(-1, 22),
       scheme=st.sampled_from(["bf16", "fp8", "a16w4", "a8w4", "int4", "BF16"]),
       n_group=st.integers(0, 5), topk_group=st.integers(0, 5), world=st.integers(1, 4),
       shape_off=st.sampled_from([0, 0, 1, -1]))
def test_fuzz_spec_and_prepare_stacked(H, I, E, k, scheme, n_group, topk_group, world, shape_off):
    """Any spec either builds or raises SpecError; prepare_stacked on a valid one builds or raises WeightError."""
    try:
        spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, scheme=scheme,
                              routing={"n_group": n_group, "topk_group": topk_group},
                              placement={"rank": world - 1, "world_size": world})
    except SpecError as exc:
        assert str(exc)
        return
    if H * I * E > 200_000:
        return
    w13 = torch.randn(E, 2 * I + shape_off, H)
    w2 = torch.randn(E, H, I)
    try:
        p = prepare_stacked(spec, w13, w2, layout="separated")
    except WeightError as exc:
        assert shape_off != 0 and "w13 has shape" in str(exc)
        return
    assert shape_off == 0
    p.check(spec)
    assert p.num_local_experts == spec.num_local_experts
