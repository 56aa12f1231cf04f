"""Gate/up layouts: interleave/separate, tags, and the gate/up mispairing seed bug."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from atom_moe import formats as F
from atom_moe.experts_torch import experts_torch
from atom_moe.layouts.gate_up import (GateUpKind, GateUpLayout, GateUpTensor, LayoutError, interleave, require, separate,
                             split_gate_up)
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import MoESpec
from atom_moe.weights import plain_mxfp4, prepare_stacked

SEP, INT = GateUpLayout.SEPARATED, GateUpLayout.INTERLEAVED


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def manual_interleave(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    """Independent interleave: rows g0, u0, g1, u1, ... along `dim`."""
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype in (F.FP8_DTYPE, torch.uint8):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.contiguous().view(torch.int16 if a.element_size() == 2 else torch.int32),
                       b.contiguous().view(torch.int16 if b.element_size() == 2 else torch.int32))


# ---------------------------------------------------------------- interleave / separate
@pytest.mark.parametrize("shape, dtype", [((3, 10, 7), torch.float32), ((2, 384, 64), torch.bfloat16),
                                          ((4, 6), torch.float32), ((3, 64, 8), torch.uint8),
                                          ((1, 2, 5), torch.float32)])
def test_rows_interleave_separate_inverse(seed, shape, dtype):
    if dtype == torch.uint8:
        data = torch.randint(0, 256, shape, dtype=torch.uint8)
    else:
        data = torch.randn(shape).to(dtype)
    dim = 1
    half = shape[dim] // 2
    t = GateUpTensor(data, SEP)
    il = interleave(t)
    assert il.layout is INT and il.kind is GateUpKind.ROWS and il.data.shape == data.shape
    assert il.data.is_contiguous()
    gate, up = data.narrow(dim, 0, half), data.narrow(dim, half, half)
    assert torch.equal(il.data, manual_interleave(gate, up, dim))
    for j in range(half):
        assert torch.equal(il.data.select(dim, 2 * j), gate.select(dim, j))
        assert torch.equal(il.data.select(dim, 2 * j + 1), up.select(dim, j))
    back = separate(il)
    assert back.layout is SEP and torch.equal(back.data, data)
    # split_gate_up agrees in both layouts
    for x in (t, il):
        g, u = split_gate_up(x)
        assert torch.equal(g, gate) and torch.equal(u, up)
    # already in the target layout: unchanged
    assert interleave(il) is il and separate(t) is t
    # and the other direction from random interleaved data
    il2 = GateUpTensor(data, INT)
    sep2 = separate(il2)
    assert torch.equal(sep2.data, torch.cat((data.narrow(dim, 0, shape[dim]).index_select(
        dim, torch.arange(0, shape[dim], 2)), data.index_select(dim, torch.arange(1, shape[dim], 2))), dim))
    assert torch.equal(interleave(sep2).data, data)


@pytest.mark.parametrize("e, nb, kb", [(3, 4, 5), (2, 1, 3), (1, 2, 1)])
def test_block_scale_interleave_separate_inverse(seed, e, nb, kb):
    data = torch.rand(e, 2 * nb, kb) + 0.1
    t = GateUpTensor(data, SEP, GateUpKind.BLOCK_SCALE)
    il = interleave(t)
    assert il.layout is INT and il.kind is GateUpKind.BLOCK_SCALE and il.data.shape == (e, nb, 2, kb)
    for j in range(nb):
        assert torch.equal(il.data[:, j, 0], data[:, j])  # gate block j
        assert torch.equal(il.data[:, j, 1], data[:, nb + j])  # up block j
    back = separate(il)
    assert back.layout is SEP and back.data.shape == data.shape and torch.equal(back.data, data)
    il_data = torch.rand(e, nb, 2, kb)
    assert torch.equal(interleave(separate(GateUpTensor(il_data, INT, "block_scale"))).data, il_data)
    with pytest.raises(LayoutError, match="row tensors"):
        split_gate_up(il)


def test_gate_up_tensor_validation():
    with pytest.raises(LayoutError, match="even row count"):
        GateUpTensor(torch.zeros(2, 5, 4), SEP)
    with pytest.raises(LayoutError, match="even row count"):
        GateUpTensor(torch.zeros(2, 7), INT)
    with pytest.raises(LayoutError, match="even row count"):
        GateUpTensor(torch.zeros(2, 3, 4), SEP, GateUpKind.BLOCK_SCALE)
    with pytest.raises(LayoutError, match=r"\[E, nb, 2, kb\]"):
        GateUpTensor(torch.zeros(2, 3, 3, 4), INT, GateUpKind.BLOCK_SCALE)
    with pytest.raises(LayoutError, match="must be a torch.Tensor"):
        GateUpTensor([[1.0, 2.0]], SEP)  # type: ignore[arg-type]
    assert GateUpTensor(torch.zeros(2, 4, 3), "interleaved").layout is INT


def test_require():
    data = torch.randn(2, 6, 4)
    t = GateUpTensor(data, INT)
    assert require(t, INT) is data
    with pytest.raises(LayoutError, match=r"untagged torch.Tensor.*expected interleaved"):
        require(data, INT)
    msg = r"w13_scale: tagged separated, but this kernel needs interleaved.*interleave"
    with pytest.raises(LayoutError, match=msg):
        require(GateUpTensor(data, SEP), INT, "w13_scale")
    with pytest.raises(LayoutError, match=r"tagged interleaved, but this kernel needs separated.*separate\(\)"):
        require(t, SEP)
    with pytest.raises(LayoutError, match="expected a GateUpTensor"):
        require(data.numpy(), INT)


# ---------------------------------------------------------------- the seed bug
H, I, E, T, K = 256, 192, 4, 48, 2  # I % 128 != 0: a partial fp8 block row


def make_routing(t=T, e=E, k=K):
    ids = torch.rand(t, e).argsort(dim=1)[:, :k]
    w = torch.rand(t, k).softmax(-1)
    return w, ids


def raw_separated(e=E, h=H, i=I, dtype=torch.bfloat16):
    w13 = (torch.randn(e, 2 * i, h) * h ** -0.5).to(dtype)
    w2 = (torch.randn(e, h, i) * i ** -0.5).to(dtype)
    return w13, w2


def test_interleaved_prepared_matches_separated_reference(seed):
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)
    w13, w2 = raw_separated()
    p = prepare_stacked(spec, w13, w2, layout="separated")
    assert p.w13.layout is INT
    x = torch.randn(T, H, dtype=torch.bfloat16)
    tw, ti = make_routing()
    ref = reference_moe(x, tw, ti, ReferenceWeights.from_separated(w13, w2), spec.activation)
    out = experts_torch(x, tw, ti, p, spec)
    assert out.dtype == torch.bfloat16 and out.shape == (T, H)
    assert rel_err(out, ref) <= 1e-2


def test_separated_tag_is_rejected(seed):
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme="fp8")
    w13, w2 = raw_separated()
    p = prepare_stacked(spec, w13, w2, layout="separated")
    x = torch.randn(T, H, dtype=torch.bfloat16)
    tw, ti = make_routing()
    experts_torch(x, tw, ti, p, spec)  # the prepared weights themselves are fine
    for field, value in (("w13", separate(p.w13)), ("w13_scale", separate(p.w13_scale)),
                         ("w13", p.w13.data)):
        with pytest.raises(LayoutError, match=field):  # refused at construction
            dataclasses.replace(p, **{field: value})
        bad = copy.copy(p)
        setattr(bad, field, value)  # or swapped in afterwards: still refused before any compute
        with pytest.raises(LayoutError, match=field):
            bad.check(spec)
        with pytest.raises(LayoutError, match=field):
            experts_torch(x, tw, ti, bad, spec)


def test_separated_bias_tag_is_rejected(seed):
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, has_bias=True)
    w13, w2 = raw_separated()
    p = prepare_stacked(spec, w13, w2, layout="separated", w13_bias=torch.randn(E, 2 * I), w2_bias=torch.randn(E, H))
    with pytest.raises(LayoutError, match="w13_bias"):
        dataclasses.replace(p, w13_bias=separate(p.w13_bias))
    bad = copy.copy(p)
    bad.w13_bias = separate(p.w13_bias)
    x = torch.randn(T, H)
    tw, ti = make_routing()
    with pytest.raises(LayoutError, match="w13_bias"):
        experts_torch(x, tw, ti, bad, spec)


def test_mislabelled_tensor_is_caught_by_the_reference(seed):
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)
    w13, w2 = raw_separated()
    p = prepare_stacked(spec, w13, w2, layout="separated")
    x = torch.randn(T, H, dtype=torch.bfloat16)
    tw, ti = make_routing()
    ref = reference_moe(x, tw, ti, ReferenceWeights.from_separated(w13, w2), spec.activation)
    lie = dataclasses.replace(p, w13=GateUpTensor(separate(p.w13).data, INT))  # separated data, wrong tag
    assert rel_err(experts_torch(x, tw, ti, lie, spec), ref) > 0.3
    # ... and telling prepare_stacked the wrong source layout is just as visible
    wrong = prepare_stacked(spec, w13, w2, layout="interleaved")
    assert rel_err(experts_torch(x, tw, ti, wrong, spec), ref) > 0.3


def _source(fmt: str, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
    """(gate data, gate scale, up data, up scale, w2, w2 scale) in a checkpoint format."""
    if fmt == "bf16":
        return gate.bfloat16(), None, up.bfloat16(), None, down.bfloat16(), None
    if fmt == "fp8":
        return (*F.quantize_fp8_block(gate), *F.quantize_fp8_block(up), *F.quantize_fp8_block(down))
    return (*F.quantize_mxfp4(gate), *F.quantize_mxfp4(up), *F.quantize_mxfp4(down))


@pytest.mark.parametrize("src, scheme", [("bf16", "bf16"), ("fp8", "fp8"), ("mxfp4", "a16w4"), ("mxfp4", "a8w4"),
                                         ("bf16", "fp8"), ("bf16", "a16w4"), ("fp8", "bf16"), ("mxfp4", "bf16")])
@pytest.mark.parametrize("bias", [False, True])
def test_interleaved_source_equals_separated_source(seed, src, scheme, bias):
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme=scheme, has_bias=bias)
    gate, up, down = torch.randn(E, I, H) * 0.1, torch.randn(E, I, H) * 0.1, torch.randn(E, H, I) * 0.1
    gd, gs, ud, us, w2, s2 = _source(src, gate, up, down)
    sep13 = torch.cat((gd, ud), 1)
    int13 = manual_interleave(gd, ud, 1)
    sep_s = int_s = None
    if src == "fp8":
        sep_s, int_s = torch.cat((gs, us), 1), torch.stack((gs, us), 2)  # [E, 2nb, kb] / [E, nb, 2, kb]
    elif src == "mxfp4":
        sep_s, int_s = torch.cat((gs, us), 1), manual_interleave(gs, us, 1)
    b13s = b13i = b2 = None
    if bias:
        gb, ub, b2 = torch.randn(E, I), torch.randn(E, I), torch.randn(E, H)
        b13s, b13i = torch.cat((gb, ub), 1), manual_interleave(gb, ub, 1)
    a = prepare_stacked(spec, sep13, w2, layout="separated", w13_scale=sep_s, w2_scale=s2, w13_bias=b13s,
                        w2_bias=b2)
    b = prepare_stacked(spec, int13, w2, layout=INT, w13_scale=int_s, w2_scale=s2, w13_bias=b13i, w2_bias=b2)
    for x, y in ((a.w13, b.w13), (a.w13_scale, b.w13_scale), (a.w13_bias, b.w13_bias), (a.w13_rowexp, b.w13_rowexp)):
        assert (x is None) == (y is None)
        if x is not None:
            assert x.layout is INT and y.layout is INT and x.kind is y.kind
            assert same_bits(x.data, y.data)
    for x, y in ((a.w2, b.w2), (a.w2_scale, b.w2_scale), (a.w2_bias, b.w2_bias), (a.w2_rowexp, b.w2_rowexp)):
        assert (x is None) == (y is None)
        if x is not None:
            assert same_bits(x, y)
    # and both are the interleaved form of the source: gate row j at 2j, up row j at 2j+1
    if src == {"bf16": "bf16", "fp8": "fp8", "a16w4": "mxfp4", "a8w4": "mxfp4"}[scheme]:
        w13, w13_scale = a.w13, a.w13_scale
        if spec.scheme.is_mxfp4:  # stored as MX tiles (a16w4) or quads (a8w4): their plain form
            assert a.w13.kind is (GateUpKind.MX_QUADS if scheme == "a8w4" else GateUpKind.MX_TILES)
            w13, w13_scale, _, _ = plain_mxfp4(a)
        assert same_bits(w13.data, int13.to(w13.data.dtype))
        if int_s is not None:
            assert same_bits(w13_scale.data, int_s)
    if bias:
        assert torch.equal(a.w13_bias.data, b13i)
