"""Weight preparation: HF per-expert dicts, gpt-oss MXFP4 tensors, scheme conversion, EP, errors."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from atom_moe import formats as F
from atom_moe.layouts.gate_up import GateUpKind, GateUpLayout, LayoutError
from atom_moe.presets import preset, scaled_down
from atom_moe.reference import ReferenceWeights
from atom_moe.spec import MoESpec, Scheme
from atom_moe.checkpoint import prepare_gpt_oss, prepare_hf_experts
from atom_moe.weights import PreparedWeights, WeightError, plain_mxfp4, prepare_stacked

INT = GateUpLayout.INTERLEAVED
PREFIX = "model.layers.3.mlp.experts"
H, I, E = 256, 192, 8
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def inter(gate: torch.Tensor, up: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.stack((gate, up), dim=dim + 1).flatten(dim, dim + 1)


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    if t.dtype in (F.FP8_DTYPE, torch.uint8):
        return t.view(torch.uint8)
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def spec_for(scheme="bf16", **kw) -> MoESpec:
    return MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, scheme=scheme, **kw)


def hf_checkpoint(fp8: bool, extra: bool = True):
    """(dict, expected per-expert source tensors, weakrefs) without any other strong reference."""
    tensors, src, refs = {}, {}, {}
    for e in range(E):
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            w = torch.randn(shape) * 0.1
            key = f"{PREFIX}.{e}.{name}.weight"
            if fp8:
                q, s = F.quantize_fp8_block(w)
                tensors[key], tensors[f"{PREFIX}.{e}.{name}.weight_scale_inv"] = q, s
                src[(e, name)] = (q.clone(), s.clone())
                refs[key] = weakref.ref(q)
                refs[f"{PREFIX}.{e}.{name}.weight_scale_inv"] = weakref.ref(s)
            else:
                w = w.bfloat16()
                tensors[key] = w
                src[(e, name)] = (w.clone(), None)
                refs[key] = weakref.ref(w)
    if extra:
        tensors["model.layers.3.mlp.gate.weight"] = torch.randn(E, H)
    return tensors, src, refs


# ---------------------------------------------------------------- prepare_hf_experts
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rank, world, local", [(0, 1, None), (1, 4, None), (1, 3, (5, 0, 7))])
def test_prepare_hf_experts(seed, fp8, rank, world, local):
    spec = spec_for("fp8" if fp8 else "bf16").for_rank(rank, world, local)
    tensors, src, refs = hf_checkpoint(fp8)
    keys_before = set(tensors)
    p = prepare_hf_experts(spec, tensors, PREFIX)
    p.check(spec)
    mine = spec.local_experts
    assert p.local_experts == mine and p.num_local_experts == len(mine) == len(spec.local_experts)
    assert p.num_experts == E and p.scheme is spec.scheme and (p.hidden_size, p.intermediate_size) == (H, I)
    want_map = [-1] * E
    for j, e in enumerate(mine):
        want_map[e] = j
    assert p.expert_map.dtype == torch.int32 and p.expert_map.tolist() == want_map
    # consumed entries popped, everything else left
    consumed = {k for k in keys_before if any(k.startswith(f"{PREFIX}.{e}.") for e in mine)}
    assert set(tensors) == keys_before - consumed
    assert "model.layers.3.mlp.gate.weight" in tensors
    # originals of consumed entries are freed once the caller drops the dict entries; others are alive
    gc.collect()
    for k, r in refs.items():
        assert (r() is None) == (k in consumed), k
        if k not in consumed:
            assert r() is tensors[k]
    # contents: interleaved gate/up, bit-exact
    assert p.w13.layout is INT and p.w13.data.shape == (len(mine), 2 * I, H)
    for j, e in enumerate(mine):
        (g, gs), (u, us), (d, ds) = (src[(e, n)] for n in ("gate_proj", "up_proj", "down_proj"))
        assert same(p.w13.data[j], inter(g, u, 0))
        assert same(p.w2[j], d)
        if fp8:
            assert p.w13_scale.kind is GateUpKind.BLOCK_SCALE and p.w13_scale.layout is INT
            assert same(p.w13_scale.data[j], torch.stack((gs, us), 1))  # [nb, 2, kb]
            assert same(p.w2_scale[j], ds)
        else:
            assert p.w13_scale is None and p.w2_scale is None
    assert p.w13_bias is None and p.w2_bias is None
    assert p.nbytes() == sum(t.numel() * t.element_size() for t in p.tensors())


def test_prepare_hf_fp8_checkpoint_to_bf16(seed):
    spec = spec_for("bf16")
    tensors, src, _ = hf_checkpoint(True, extra=False)
    p = prepare_hf_experts(spec, tensors, PREFIX)
    assert tensors == {}
    for e in range(E):
        deq = {n: F.dequantize_fp8_block(*src[(e, n)]).bfloat16() for n in ("gate_proj", "up_proj", "down_proj")}
        assert same(p.w13.data[e], inter(deq["gate_proj"], deq["up_proj"], 0))
        assert same(p.w2[e], deq["down_proj"])


def test_prepare_hf_errors(seed):
    spec = spec_for("fp8")
    tensors, _, _ = hf_checkpoint(True)
    del tensors[f"{PREFIX}.2.up_proj.weight_scale_inv"]
    with pytest.raises(WeightError, match=rf"missing checkpoint tensor '{PREFIX}.2.up_proj.weight_scale_inv'"):
        prepare_hf_experts(spec, tensors, PREFIX)
    tensors, _, _ = hf_checkpoint(False)
    del tensors[f"{PREFIX}.5.down_proj.weight"]
    with pytest.raises(WeightError, match=rf"missing checkpoint tensor '{PREFIX}.5.down_proj.weight'"):
        prepare_hf_experts(spec_for(), tensors, PREFIX)
    with pytest.raises(WeightError, match="missing checkpoint tensor 'wrong.0.gate_proj.weight'"):
        prepare_hf_experts(spec_for(), hf_checkpoint(False)[0], "wrong")
    tensors, _, _ = hf_checkpoint(False)
    tensors[f"{PREFIX}.0.gate_proj.weight"] = torch.randn(I, H + 1).bfloat16()
    tensors[f"{PREFIX}.0.up_proj.weight"] = torch.randn(I, H + 1).bfloat16()
    msg = rf"{PREFIX}.0.gate_proj.weight has shape \(192, 257\), expected \[192, 256\]"
    with pytest.raises(WeightError, match=msg):
        prepare_hf_experts(spec_for(), tensors, PREFIX)
    tensors, _, _ = hf_checkpoint(False)
    tensors[f"{PREFIX}.4.down_proj.weight"] = torch.randn(I, H).bfloat16()
    with pytest.raises(WeightError, match=rf"{PREFIX}.4.down_proj.weight has shape \(192, 256\)"):
        prepare_hf_experts(spec_for(), tensors, PREFIX)
    # every expert misshapen alike: caught on the stacked tensors too
    big = MoESpec.create(hidden_size=H * 2, intermediate_size=I, num_experts=E, top_k=2)
    with pytest.raises(WeightError, match=r"gate_proj.weight has shape \(192, 256\), expected \[192, 512\]"):
        prepare_hf_experts(big, hf_checkpoint(False)[0], PREFIX)
    with pytest.raises(WeightError, match="has_bias=True"):
        prepare_hf_experts(spec_for(has_bias=True), hf_checkpoint(False)[0], PREFIX)


# ---------------------------------------------------------------- gpt-oss
def my_dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Independent MXFP4 decode: [..., N, K/32, 16] bytes + [..., N, K/32] e8m0 -> fp32 [..., N, K]."""
    table = torch.tensor(E2M1, dtype=torch.float32)
    lo, hi = (blocks & 0x0F).long(), (blocks >> 4).long()
    vals = torch.empty(*blocks.shape[:-1], 32)
    vals[..., 0::2], vals[..., 1::2] = table[lo], table[hi]
    scale = torch.tensor([2.0 ** (int(b) - 127) for b in scales.flatten().tolist()]).reshape(scales.shape)
    return (vals * scale.unsqueeze(-1)).flatten(-2)


def gpt_oss_tensors(e=4, h=H, i=I):
    gate, up = torch.randn(e, i, h), torch.randn(e, i, h) * 0.5
    down = torch.randn(e, h, i) * 2
    gate[0, 0, :32] = 0  # an all-zero block
    p13, s13 = F.quantize_mxfp4(inter(gate, up, 1))  # rows interleaved: gate even, up odd
    p2, s2 = F.quantize_mxfp4(down)
    t = {
        f"{PREFIX}.gate_up_proj_blocks": p13.reshape(e, 2 * i, h // 32, 16),
        f"{PREFIX}.gate_up_proj_scales": s13,
        f"{PREFIX}.gate_up_proj_bias": torch.randn(e, 2 * i).bfloat16(),
        f"{PREFIX}.down_proj_blocks": p2.reshape(e, h, i // 32, 16),
        f"{PREFIX}.down_proj_scales": s2,
        f"{PREFIX}.down_proj_bias": torch.randn(e, h).bfloat16(),
        "model.layers.0.mlp.router.weight": torch.randn(e, h),
    }
    return t


@pytest.mark.parametrize("scheme", ["a16w4", "a8w4"])
@pytest.mark.parametrize("rank, world", [(0, 1), (1, 2)])
def test_prepare_gpt_oss_bit_exact(seed, scheme, rank, world):
    spec = scaled_down(preset("gpt-oss-120b", scheme=scheme), hidden_size=H, intermediate_size=I,
                       num_experts=4, top_k=2).for_rank(rank, world)
    tensors = gpt_oss_tensors()
    src = {k: v.clone() for k, v in tensors.items()}
    refs = {k: weakref.ref(v) for k, v in tensors.items()}
    p = prepare_gpt_oss(spec, tensors, PREFIX)
    p.check(spec)
    assert list(tensors) == ["model.layers.0.mlp.router.weight"]
    gc.collect()
    assert all(r() is None for k, r in refs.items() if k.startswith(PREFIX))
    local = list(spec.local_experts)
    assert p.local_experts == tuple(local) and p.num_local_experts == len(local)
    assert p.expert_map.tolist() == [local.index(e) if e in local else -1 for e in range(4)]
    # stored as MX tiles of the checkpoint bytes (already interleaved, already MXFP4): untiled, the same bits
    blocks13, scales13 = src[f"{PREFIX}.gate_up_proj_blocks"][local], src[f"{PREFIX}.gate_up_proj_scales"][local]
    blocks2, scales2 = src[f"{PREFIX}.down_proj_blocks"][local], src[f"{PREFIX}.down_proj_scales"][local]
    kind = GateUpKind.MX_QUADS if p.scheme is Scheme.A8W4 else GateUpKind.MX_TILES
    assert p.w13.layout is INT and p.w13.kind is kind and p.w13_scale.kind is kind
    q13, s13, q2, s2 = plain_mxfp4(p)
    assert same(q13.data, blocks13.flatten(-2)) and q13.layout is INT
    assert same(s13.data, scales13) and s13.kind is GateUpKind.ROWS and s13.layout is INT
    assert same(q2, blocks2.flatten(-2)) and same(s2, scales2)
    assert p.mx_scale_max == max(int(scales13.max()), int(scales2.max()))
    # dequantized: bit-exact with an independent decode + de-interleave
    ref = ReferenceWeights.from_prepared(p)
    full13 = my_dequant_mxfp4(blocks13, scales13)
    assert ref.experts == tuple(local)
    assert same(ref.gate, full13[:, 0::2]) and same(ref.up, full13[:, 1::2])
    assert same(ref.down, my_dequant_mxfp4(blocks2, scales2))
    b13 = src[f"{PREFIX}.gate_up_proj_bias"][local].float()
    assert same(ref.gate_bias, b13[:, 0::2]) and same(ref.up_bias, b13[:, 1::2])
    assert same(ref.down_bias, src[f"{PREFIX}.down_proj_bias"][local].float())
    assert same(F.dequantize_mxfp4(q13.data, s13.data), full13)


def test_prepare_gpt_oss_errors(seed):
    spec = scaled_down(preset("gpt-oss-120b"), hidden_size=H, intermediate_size=I, num_experts=4, top_k=2)
    t = gpt_oss_tensors()
    t[f"{PREFIX}.gate_up_proj_blocks"] = t[f"{PREFIX}.gate_up_proj_blocks"].flatten(-2)
    with pytest.raises(WeightError, match=r"gate_up_proj_blocks has shape \(4, 384, 128\), expected \[4, 384, 8, 16\]"):
        prepare_gpt_oss(spec, t, PREFIX)
    t = gpt_oss_tensors()
    del t[f"{PREFIX}.down_proj_scales"]
    with pytest.raises(WeightError, match=r"missing checkpoint tensor .*down_proj_scales"):
        prepare_gpt_oss(spec, t, PREFIX)
    with pytest.raises(WeightError, match="has_bias=True"):
        prepare_gpt_oss(dataclasses.replace(spec, has_bias=False), gpt_oss_tensors(), PREFIX)
    t = gpt_oss_tensors(h=H + 32)
    with pytest.raises(WeightError, match=r"blocks has shape \(4, 384, 9, 16\), expected \[4, 384, 8, 16\]"):
        prepare_gpt_oss(spec, t, PREFIX)


# ---------------------------------------------------------------- scheme conversion
@pytest.mark.parametrize("scheme", ["fp8", "a16w4", "a8w4"])
def test_bf16_source_converted_with_pinned_rules(seed, scheme):
    spec = spec_for(scheme).for_rank(1, 2)
    gate, up = torch.randn(E, I, H).bfloat16(), (torch.randn(E, I, H) * 3).bfloat16()
    down = (torch.randn(E, H, I) * 0.01).bfloat16()
    p = prepare_stacked(spec, torch.cat((gate, up), 1), down, layout="separated")
    p.check(spec)
    if scheme == "fp8":
        w13, s13, w2, s2 = p.w13.data, p.w13_scale.data, p.w2, p.w2_scale
    else:  # MX tiles: compare their plain form
        t13, ts13, w2, s2 = plain_mxfp4(p)
        w13, s13 = t13.data, ts13.data
    for j, e in enumerate(spec.local_experts):
        if scheme == "fp8":
            (qg, sg), (qu, su) = F.quantize_fp8_block(gate[e]), F.quantize_fp8_block(up[e])
            q2, qs2 = F.quantize_fp8_block(down[e])
            assert same(s13[j], torch.stack((sg, su), 1))
        else:
            (qg, sg), (qu, su) = F.quantize_mxfp4(gate[e]), F.quantize_mxfp4(up[e])
            q2, qs2 = F.quantize_mxfp4(down[e])
            assert same(s13[j], inter(sg, su, 0))
        assert same(w13[j], inter(qg, qu, 0))
        assert same(w2[j], q2) and same(s2[j], qs2)

def test_fp8_scales_when_i_is_not_a_multiple_of_128(seed):
    # gate and up are blocked separately: ceil(I/128) block rows each, not ceil(2I/128)
    spec = spec_for("fp8")
    p = prepare_stacked(spec, torch.randn(E, 2 * I, H), torch.randn(E, H, I), layout="separated")
    assert p.w13_scale.data.shape == (E, 2, 2, 2)  # [E, ceil(192/128), 2, ceil(256/128)]
    assert p.w2_scale.shape == (E, 2, 2)


# ---------------------------------------------------------------- errors
def _fp8_stacked():
    w13, s13 = F.quantize_fp8_block(torch.randn(E, 2, I, H))
    w2, s2 = F.quantize_fp8_block(torch.randn(E, H, I))
    return w13.flatten(1, 2), s13.flatten(1, 2), w2, s2


def test_prepare_stacked_errors(seed):
    spec = spec_for()
    w13, w2 = torch.randn(E, 2 * I, H), torch.randn(E, H, I)
    with pytest.raises(WeightError, match="w13 holds 7 experts, expected 8"):
        prepare_stacked(spec, w13[:7], w2, layout="separated")
    with pytest.raises(WeightError, match=r"w2 has shape \(8, 256, 191\)"):
        prepare_stacked(spec, w13, w2[..., :-1], layout="separated")
    with pytest.raises(WeightError, match="takes no scale"):
        prepare_stacked(spec, w13, w2, layout="separated", w2_scale=torch.ones(E, 2, 2))
    with pytest.raises(WeightError, match="unsupported weight dtype torch.int8"):
        prepare_stacked(spec, w13.to(torch.int8), w2, layout="separated")
    with pytest.raises(ValueError):
        prepare_stacked(spec, w13, w2, layout="diagonal")
    with pytest.raises(WeightError, match=r"local experts \[6, 7\] are not among the given expert_ids"):
        prepare_stacked(spec.for_rank(3, 4), w13[:6], w2[:6], layout="separated", expert_ids=range(6))
    p = prepare_stacked(spec.for_rank(3, 4), w13[5:], w2[5:], layout="separated", expert_ids=[5, 6, 7])
    assert torch.equal(p.w13.data[1].float(), inter(w13[7, :I], w13[7, I:], 0).bfloat16().float())
    # biases
    with pytest.raises(WeightError, match="has_bias=False"):
        prepare_stacked(spec, w13, w2, layout="separated", w13_bias=torch.randn(E, 2 * I), w2_bias=torch.randn(E, H))
    with pytest.raises(WeightError, match="has_bias=True needs both w13_bias and w2_bias"):
        prepare_stacked(spec_for(has_bias=True), w13, w2, layout="separated", w13_bias=torch.randn(E, 2 * I))
    # fp8: missing / misshapen scales
    q13, s13, q2, s2 = _fp8_stacked()
    fp8 = spec_for("fp8")
    with pytest.raises(WeightError, match=r"w13: an fp8 weight needs its 128x128 block scales"):
        prepare_stacked(fp8, q13, q2, layout="separated", w2_scale=s2)
    with pytest.raises(WeightError, match=r"w2: an fp8 weight needs"):
        prepare_stacked(fp8, q13, q2, layout="separated", w13_scale=s13)
    with pytest.raises(WeightError, match=r"separated fp8 w13 scales need 4 block rows"):
        prepare_stacked(fp8, q13, q2, layout="separated", w13_scale=s13[:, :3], w2_scale=s2)
    with pytest.raises(WeightError, match=r"interleaved fp8 w13 scales must be \[E, 2, 2, kb\]"):
        prepare_stacked(fp8, q13, q2, layout="interleaved", w13_scale=s13, w2_scale=s2)
    # MXFP4: scales must be uint8
    p13, ps13 = F.quantize_mxfp4(torch.randn(E, 2 * I, H))
    p2, ps2 = F.quantize_mxfp4(torch.randn(E, H, I))
    with pytest.raises(WeightError, match="needs uint8 e8m0 scales"):
        prepare_stacked(spec_for("a16w4"), p13, p2, layout="separated", w13_scale=ps13.float(), w2_scale=ps2)
    with pytest.raises(WeightError, match="needs uint8 e8m0 scales"):
        prepare_stacked(spec_for("a16w4"), p13, p2, layout="separated", w13_scale=ps13)


@pytest.mark.parametrize("scheme", ["fp8", "a16w4", "bf16"])
def test_prepare_stacked_rejects_misshapen_scales(seed, scheme):
    """Wrong scale shapes must be a WeightError even when no conversion reads them (pass-through)."""
    if scheme in ("fp8", "bf16"):  # bf16: an fp8 source converted to bf16
        q13, s13, q2, s2 = _fp8_stacked()
        bad13, bad2 = s13[..., :1], s2[:, :1]
    else:
        q13, s13 = F.quantize_mxfp4(torch.randn(E, 2 * I, H))
        q2, s2 = F.quantize_mxfp4(torch.randn(E, H, I))
        bad13, bad2 = s13[..., :-1], s2[..., :-1]
    spec = spec_for(scheme)
    with pytest.raises(WeightError, match="w2_scale"):
        prepare_stacked(spec, q13, q2, layout="separated", w13_scale=s13, w2_scale=bad2)
    with pytest.raises(WeightError, match="w13_scale"):
        prepare_stacked(spec, q13, q2, layout="separated", w13_scale=bad13, w2_scale=s2)


def test_check_against_spec(seed):
    spec = spec_for("a16w4")
    p = prepare_stacked(spec, torch.randn(E, 2 * I, H), torch.randn(E, H, I), layout="separated")
    p.check(spec)
    with pytest.raises(WeightError, match="do not match the spec"):  # a8w4 stores MX quads, not MX tiles
        p.check(spec_for("a8w4"))
    with pytest.raises(WeightError, match="do not match the spec"):
        p.check(spec_for("fp8"))
    with pytest.raises(WeightError, match="do not match the spec"):
        p.check(spec.for_rank(0, 2))
    with pytest.raises(WeightError, match="do not match the spec"):
        p.check(MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=16, top_k=2, scheme="a16w4",
                               placement={"local_experts": tuple(range(8)), "world_size": 2}))
    with pytest.raises(WeightError, match="has_bias=True"):
        p.check(spec_for("a16w4", has_bias=True))
    mislabelled = dataclasses.replace(p.w13_scale, layout=GateUpLayout.SEPARATED)
    with pytest.raises(LayoutError, match="w13_scale"):  # refused at construction
        dataclasses.replace(p, w13_scale=mislabelled)
    p.w13_scale = mislabelled  # and when swapped in afterwards
    with pytest.raises(LayoutError, match="w13_scale"):
        p.check(spec)
    assert isinstance(p, PreparedWeights) and p.scheme is Scheme.A16W4


# ---------------------------------------------------------------- restricted
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
def test_restricted_keeps_exactly_the_chosen_experts(seed, scheme):
    from atom_moe.tools.common import random_weights
    from atom_moe.spec import Placement
    spec = MoESpec.create(hidden_size=128, intermediate_size=64, num_experts=8, top_k=2, scheme=scheme,
                          placement=Placement.linear(1, 2, 8))
    weights = random_weights(spec, device="cpu")
    full = ReferenceWeights.from_prepared(weights)
    pick = torch.randperm(weights.num_local_experts)[:3].tolist()
    sub = weights.restricted(pick)
    assert sub.num_local_experts == 3 and sub.local_experts == tuple(weights.local_experts[j] for j in pick)
    assert sub.expert_map[list(sub.local_experts)].tolist() == [0, 1, 2]
    assert int((sub.expert_map >= 0).sum()) == 3
    ref = ReferenceWeights.from_prepared(sub)
    assert ref.experts == sub.local_experts
    for name in ("gate", "up", "down"):
        assert torch.equal(getattr(ref, name), getattr(full, name)[pick]), name
    # an id the map marks as not local (-1) must not wrap around to the last expert
    for bad, why in (([0, -1], "out of range"), ([weights.num_local_experts], "out of range"), ([1, 1], "repeated")):
        with pytest.raises(WeightError, match=why):
            weights.restricted(bad)
