"""MoESpec validation, presets, placement."""

from __future__ import annotations

import dataclasses

import pytest

from atom_moe import PRESETS, preset
from atom_moe.presets import scaled_down
from atom_moe.spec import (Activation, ActivationKind, MoESpec, Placement, Routing, Scheme, Scoring, SpecError)


def make(**kw):
    base = dict(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2)
    base.update(kw)
    return MoESpec.create(**base)


# ---------------------------------------------------------------- shapes / schemes
@pytest.mark.parametrize("scheme", ["a16w4", "a8w4"])
@pytest.mark.parametrize("field, value", [("hidden_size", 2880 + 16), ("intermediate_size", 100),
                                          ("hidden_size", 33), ("intermediate_size", 31)])
def test_mxfp4_needs_multiples_of_32(scheme, field, value):
    with pytest.raises(SpecError, match=rf"(?s)MXFP4.*multiples of 32.*{field}={value} is not.*% 32 == 0"):
        make(scheme=scheme, **{field: value})


@pytest.mark.parametrize("scheme", ["a16w4", "a8w4"])
def test_mxfp4_accepts_multiples_of_32(scheme):
    s = make(scheme=scheme, hidden_size=2880, intermediate_size=2880)
    assert s.scheme is Scheme(scheme) and s.scheme.is_mxfp4


@pytest.mark.parametrize("h, i", [(2880, 2880), (200, 100), (7168, 2048), (129, 1)])
def test_fp8_accepts_non_multiples_of_128(h, i):
    s = make(scheme="fp8", hidden_size=h, intermediate_size=i)
    assert s.scheme is Scheme.FP8 and (s.hidden_size, s.intermediate_size) == (h, i)
    assert s.scheme.fp8_activations and not s.scheme.is_mxfp4


def test_scheme_properties_and_parse():
    assert Scheme.parse("FP8") is Scheme.FP8 and Scheme.parse(Scheme.A8W4) is Scheme.A8W4
    assert [s.fp8_activations for s in Scheme] == [False, True, False, True]
    assert [s.is_mxfp4 for s in Scheme] == [False, False, True, True]


@pytest.mark.parametrize("bad", ["int4", "mxfp4", "", "fp16"])
def test_unknown_scheme(bad):
    with pytest.raises(SpecError, match=r"unknown quant scheme.*allowed: bf16, fp8, a16w4, a8w4"):
        make(scheme=bad)
    with pytest.raises(SpecError, match="unknown quant scheme"):
        Scheme.parse(bad)


@pytest.mark.parametrize("field", ["hidden_size", "intermediate_size", "num_experts", "top_k", "max_tokens_per_rank"])
@pytest.mark.parametrize("value", [0, -4, 2.0, True, "8"])
def test_positive_ints(field, value):
    with pytest.raises(SpecError, match=f"{field} must be a positive int"):
        make(**{field: value})


def test_top_k_exceeds_num_experts():
    with pytest.raises(SpecError, match=r"top_k=9 exceeds num_experts=8"):
        make(top_k=9)
    assert make(top_k=8).top_k == 8


# ---------------------------------------------------------------- activation / routing
@pytest.mark.parametrize("bad", ["gelu", "silu", "SwiGLU"])
def test_bad_activation(bad):
    with pytest.raises(SpecError, match=r"unknown activation.*allowed: swiglu, swiglu_oai"):
        make(activation={"kind": bad})


@pytest.mark.parametrize("alpha, limit", [(0.0, 7.0), (-1.0, 7.0), (1.702, 0.0), (1.702, -7.0)])
def test_swiglu_oai_parameters(alpha, limit):
    with pytest.raises(SpecError, match="swiglu_oai needs alpha > 0 and limit > 0"):
        Activation(ActivationKind.SWIGLU_OAI, alpha=alpha, limit=limit)
    Activation(ActivationKind.SWIGLU, alpha=alpha, limit=limit)  # ignored for plain swiglu


def test_activation_from_string():
    s = make(activation={"kind": "swiglu_oai", "alpha": 1.5, "limit": 5.0})
    assert s.activation == Activation(ActivationKind.SWIGLU_OAI, 1.5, 5.0)


def test_bad_scoring():
    with pytest.raises(SpecError, match=r"unknown routing scoring.*allowed: softmax, sigmoid"):
        make(routing={"scoring": "relu"})


@pytest.mark.parametrize("n_group, topk_group", [(0, 1), (4, 0), (4, 5), (-1, -1)])
def test_bad_group_numbers(n_group, topk_group):
    with pytest.raises(SpecError, match=r"n_group >= 1 and 1 <= topk_group <= n_group"):
        Routing(n_group=n_group, topk_group=topk_group)


def test_groups_must_divide_experts():
    with pytest.raises(SpecError, match=r"num_experts % n_group == 0, got 10 % 4"):
        make(num_experts=10, routing={"n_group": 4, "topk_group": 2})


def test_top_k_exceeds_kept_groups():
    # 16 experts in 8 groups of 2, keep 2 groups -> at most 4 candidates
    with pytest.raises(SpecError, match=r"top_k=5 exceeds the experts in the 2 kept groups"):
        make(num_experts=16, top_k=5, routing={"n_group": 8, "topk_group": 2})
    assert make(num_experts=16, top_k=4, routing={"n_group": 8, "topk_group": 2}).top_k == 4


def test_groups_need_two_experts_each():
    with pytest.raises(SpecError, match=r"two best experts.*>= 2 experts per group"):
        make(num_experts=8, top_k=1, routing={"n_group": 8, "topk_group": 2})


@pytest.mark.parametrize("f", [0.0, -2.5])
def test_routed_scaling_factor_positive(f):
    with pytest.raises(SpecError, match="routed_scaling_factor must be > 0"):
        Routing(routed_scaling_factor=f)


# ---------------------------------------------------------------- placement
def test_linear_placement_ranges():
    assert Placement.linear(0, 1, 8).local_experts == tuple(range(8))
    for w in (1, 2, 4, 8):
        got = [Placement.linear(r, w, 256).local_experts for r in range(w)]
        assert got == [tuple(range(r * 256 // w, (r + 1) * 256 // w)) for r in range(w)]
        assert sorted(e for g in got for e in g) == list(range(256))
    p = Placement.linear(2, 4, 8)
    assert (p.rank, p.world_size, p.local_experts) == (2, 4, (4, 5))


@pytest.mark.parametrize("rank, world", [(2, 2), (-1, 2), (0, 0)])
def test_bad_rank(rank, world):
    with pytest.raises(SpecError, match=r"EP rank must be in \[0, world_size\)"):
        Placement.linear(rank, world, 8)
    with pytest.raises(SpecError, match=r"EP rank must be in \[0, world_size\)"):
        make(placement={"rank": rank, "world_size": world})
    with pytest.raises(SpecError, match=r"EP rank must be in \[0, world_size\)"):
        make(placement={"rank": rank, "world_size": world, "local_experts": (0,)})


def test_linear_needs_divisible_experts():
    with pytest.raises(SpecError, match=r"num_experts divisible by the EP world size: 10 experts over 4 ranks"):
        make(num_experts=10, placement={"rank": 0, "world_size": 4})
    with pytest.raises(SpecError, match="explicit local_experts"):
        Placement.linear(1, 3, 8)


def test_explicit_uneven_placement_accepted():
    ranks = [(0, 1, 2), (3, 4, 5), (6, 7, 8, 9)]
    for r, ids in enumerate(ranks):
        s = make(num_experts=10, placement={"rank": r, "world_size": 3, "local_experts": list(ids)})
        assert s.local_experts == ids and s.num_local_experts == len(ids)
        assert isinstance(s.local_experts, tuple)
    # any order, not necessarily contiguous
    s = make(placement={"rank": 1, "world_size": 2, "local_experts": [7, 0, 3]})
    assert s.local_experts == (7, 0, 3)


@pytest.mark.parametrize("ids, words", [
    ((1, 2, 1), "duplicates"), ((0, 8), r"\[8\] outside \[0, num_experts=8\)"),
    ((-1, 3), r"\[-1\] outside"), ((), "empty"),
])
def test_bad_explicit_placement(ids, words):
    with pytest.raises(SpecError, match=words):
        make(placement={"rank": 0, "world_size": 2, "local_experts": ids})


def test_for_rank():
    base = make(num_experts=8)
    assert base.local_experts == tuple(range(8)) and base.num_local_experts == 8
    r1 = base.for_rank(1, 4)
    assert r1.local_experts == (2, 3) and r1.placement.rank == 1 and r1.placement.world_size == 4
    assert (r1.hidden_size, r1.intermediate_size, r1.num_experts, r1.top_k) == (256, 128, 8, 2)
    assert base.for_rank(0, 2, (5, 1, 6)).local_experts == (5, 1, 6)
    with pytest.raises(SpecError, match="divisible"):
        base.for_rank(0, 3)
    with pytest.raises(SpecError, match="duplicates"):
        base.for_rank(0, 3, (1, 1))
    with pytest.raises(SpecError, match="top_k"):
        dataclasses.replace(base, top_k=9)  # every copy is re-validated


def test_spec_is_frozen():
    s = make()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.top_k = 3  # type: ignore[misc]


# ---------------------------------------------------------------- presets
def test_presets_match_public_configs():
    from atom_moe.presets import SERVED  # the served TP shards: tests/test_served_shapes.py
    assert set(PRESETS) == {"deepseek-v3", "kimi-k2", "gpt-oss-120b", "qwen3-235b-a22b", "glm-4.5", *SERVED}
    ds = preset("deepseek-v3")
    assert (ds.hidden_size, ds.intermediate_size, ds.num_experts, ds.top_k) == (7168, 2048, 256, 8)
    assert ds.scheme is Scheme.FP8
    assert ds.routing == Routing(Scoring.SIGMOID, True, n_group=8, topk_group=4, correction_bias=True,
                                 routed_scaling_factor=2.5)
    kimi = preset("kimi-k2")
    assert (kimi.hidden_size, kimi.intermediate_size, kimi.num_experts, kimi.top_k) == (7168, 2048, 384, 8)
    assert kimi.scheme is Scheme.FP8 and kimi.routing.scoring is Scoring.SIGMOID
    assert kimi.routing.correction_bias and kimi.routing.routed_scaling_factor == 2.827
    assert kimi.routing.n_group == 1 and kimi.routing.renormalize
    oss = preset("gpt-oss-120b")
    assert (oss.hidden_size, oss.intermediate_size, oss.num_experts, oss.top_k) == (2880, 2880, 128, 4)
    assert oss.scheme is Scheme.A16W4 and oss.has_bias
    assert oss.activation == Activation(ActivationKind.SWIGLU_OAI, alpha=1.702, limit=7.0)
    assert oss.routing.scoring is Scoring.SOFTMAX and oss.routing.renormalize
    qw = preset("qwen3-235b-a22b")
    assert (qw.hidden_size, qw.intermediate_size, qw.num_experts, qw.top_k) == (4096, 1536, 128, 8)
    assert qw.routing.scoring is Scoring.SOFTMAX and qw.routing.renormalize and not qw.has_bias
    glm = preset("glm-4.5")
    assert (glm.hidden_size, glm.intermediate_size, glm.num_experts, glm.top_k) == (5120, 1536, 160, 8)
    assert glm.routing.scoring is Scoring.SIGMOID and glm.routing.correction_bias
    assert glm.routing.routed_scaling_factor == 2.5
    for name in PRESETS:
        s = preset(name)
        assert s.local_experts == tuple(range(s.num_experts))
        assert s.activation.kind is (ActivationKind.SWIGLU_OAI if name == "gpt-oss-120b" else ActivationKind.SWIGLU)
        assert s.has_bias == (name == "gpt-oss-120b")
        assert MoESpec(**{f.name: getattr(s, f.name) for f in dataclasses.fields(s)}) == s  # re-validates


def test_preset_overrides():
    assert preset("DeepSeek-V3", scheme="bf16").scheme is Scheme.BF16
    assert preset("gpt-oss-120b", scheme="a8w4").scheme is Scheme.A8W4
    with pytest.raises(SpecError, match=r"(?s)MXFP4.*hidden_size=7170 is not"):
        preset("deepseek-v3", scheme="a16w4", hidden_size=7170)
    with pytest.raises(SpecError, match=r"unknown preset 'llama'; allowed: deepseek-v3"):
        preset("llama")
    s = preset("qwen3-235b-a22b", num_experts=64)
    assert s.num_experts == 64 and s.local_experts == tuple(range(64))
    r = preset("deepseek-v3").for_rank(3, 8)
    assert r.local_experts == tuple(range(96, 128))
    with pytest.raises(SpecError, match="divisible"):
        preset("glm-4.5").for_rank(0, 3)


def test_scaled_down():
    s = scaled_down(preset("deepseek-v3"), hidden_size=256, intermediate_size=64, num_experts=16)
    assert (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k) == (256, 64, 16, 8)
    assert s.routing.n_group == 8 and s.routing.topk_group == 4 and s.scheme is Scheme.FP8
    s = scaled_down(preset("deepseek-v3"), hidden_size=256, intermediate_size=64, num_experts=4)
    assert s.routing.n_group == 1 and s.top_k == 4 and s.local_experts == (0, 1, 2, 3)
