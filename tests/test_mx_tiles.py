"""MX tiles (atom_moe.layouts.mx_tiles): round trips, padding, the documented bit layout, and MX tiles in PreparedWeights."""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch

from atom_moe.tools import common
from atom_moe import experts_torch as et, formats as F
from atom_moe.layouts import mx_tiles
from atom_moe.layouts.gate_up import GateUpKind, GateUpLayout, GateUpTensor, LayoutError, interleave, require, separate, \
    split_gate_up
from atom_moe.reference import ReferenceWeights
from atom_moe.spec import MoESpec, Scheme
from atom_moe.weights import (PreparedWeights, WeightError, plain_mxfp4, prepare_mxfp4_local, prepare_stacked,
                              prepared_nbytes, prepared_shapes)

INT, SEP, TILES = GateUpLayout.INTERLEAVED, GateUpLayout.SEPARATED, GateUpKind.MX_TILES
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def rand_u8(*shape, lo=0, hi=256) -> torch.Tensor:
    return torch.randint(lo, hi, shape, dtype=torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(a, b)


def inter(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Rows g0, u0, g1, u1, ... along dim -2 (independent of atom_moe.layouts.gate_up)."""
    return torch.stack((gate, up), dim=-2).flatten(-3, -2)


# ---------------------------------------------------------------- tile / untile
SHAPES = [((), 40, 96), ((3,), 40, 96), ((2, 3), 80, 160), ((2,), 16, 64), ((1,), 17, 32), ((2,), 8, 2880),
          ((2,), 48, 448), ((), 1, 32)]


@pytest.mark.parametrize("lead, n, k", SHAPES)
def test_round_trip_bit_exact(seed, lead, n, k):
    packed, scales = rand_u8(*lead, n, k // 2), rand_u8(*lead, n, k // 32)
    values, tscales = mx_tiles.tile(packed, scales)
    want_v, want_s = mx_tiles.tiled_shapes(n, k)
    assert values.dtype == tscales.dtype == torch.uint8
    assert values.shape == (*lead, *want_v) and tscales.shape == (*lead, *want_s)
    assert values.is_contiguous() and tscales.is_contiguous()
    back_p, back_s = mx_tiles.untile(values, tscales, n, k)
    assert same(back_p, packed) and same(back_s, scales)
    # and tiling the untiled form again gives the same tiles (nothing outside the weight is stored)
    again_v, again_s = mx_tiles.tile(back_p, back_s)
    assert same(again_v, values) and same(again_s, tscales)


def test_padded_and_shapes():
    assert mx_tiles.padded(40, 96) == (48, 128)
    assert mx_tiles.padded(2880, 2880) == (2880, 2880)
    assert mx_tiles.padded(1, 32) == (16, 64)
    assert mx_tiles.tiled_shapes(40, 96) == ((3, 2, 512), (3, 2, 32))
    assert mx_tiles.tiled_shapes(5760, 2880) == ((360, 45, 512), (360, 45, 32))


@pytest.mark.parametrize("lead, n, k", [((), 40, 96), ((2,), 17, 160), ((3,), 1, 32)])
def test_padding_is_zero_codes_and_zero_scales(seed, lead, n, k):
    packed, scales = rand_u8(*lead, n, k // 2), rand_u8(*lead, n, k // 32, lo=1)  # no 0 byte in the real ones
    values, tscales = mx_tiles.tile(packed, scales)
    n_pad, k_pad = mx_tiles.padded(n, k)
    # the padded [n_pad, k_pad] weight has the same tiles: untile it whole to see the padding
    full_p, full_s = mx_tiles.untile(values, tscales, n_pad, k_pad)
    assert same(full_p[..., :n, : k // 2], packed) and same(full_s[..., :n, : k // 32], scales)
    pad_p = torch.ones_like(full_p, dtype=torch.bool)
    pad_p[..., :n, : k // 2] = False
    pad_s = torch.ones_like(full_s, dtype=torch.bool)
    pad_s[..., :n, : k // 32] = False
    assert (full_p[pad_p] == 0).all() and (full_s[pad_s] == 0).all()
    assert int(pad_p.sum()) == (n_pad * k_pad // 2 - n * k // 2) * math.prod(lead)
    # zero bytes in the tiles are exactly the padding's (the real scales have no 0 byte)
    assert int((tscales == 0).sum()) == int(pad_s.sum())


def _decode_word(w: int, o: int) -> tuple[int, int]:
    """Output register o of a tile word as the docstring's shifts and masks give it: (low, high) bf16 bits."""
    rotl = lambda r: ((w << r) | (w >> (32 - r))) & 0xFFFFFFFF  # noqa: E731
    x = 0
    for rot, mask in mx_tiles.PIECES[o]:
        x |= rotl(rot) & mask
    return x & 0xFFFF, x >> 16


def _bf16(bits16: int) -> float:
    return torch.tensor([bits16 - (1 << 16) if bits16 >= 1 << 15 else bits16], dtype=torch.int16).view(
        torch.bfloat16).float().item()


@pytest.mark.parametrize("n, k", [(16, 64), (40, 96)])
def test_documented_fragment_layout(seed, n, k):
    """Decode the tiles the way the docstring says a thread does, independently of tile()'s own plan."""
    packed, scales = rand_u8(n, k // 2), rand_u8(n, k // 32)
    values, tscales = mx_tiles.tile(packed, scales)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)  # LOW nibble = even k
    n_pad, k_pad = mx_tiles.padded(n, k)
    want = torch.zeros(n_pad, k_pad, dtype=torch.uint8)
    want[:n, :k] = codes
    want_s = torch.zeros(n_pad, k_pad // 32, dtype=torch.uint8)
    want_s[:n, : k // 32] = scales
    v = values.to(torch.int64)
    for nb in range(n_pad // 16):
        for kb in range(k_pad // 64):
            words = v[nb, kb].reshape(128, 4)
            words = (words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24).tolist()
            for lane in range(32):
                g, q = divmod(lane, 4)
                for j in range(4):
                    w = words[lane * 4 + j]
                    for c in range(2):
                        for h in range(2):
                            halves = _decode_word(w, 2 * c + h)
                            for e in range(2):
                                row, col = nb * 16 + g + 8 * h, kb * 64 + 16 * j + 8 * c + 2 * q + e
                                bits16 = halves[e]
                                code = (bits16 >> 15) << 3 | (bits16 >> 6) & 7
                                assert bits16 & ~0x81C0 == 0
                                assert code == int(want[row, col]), (nb, kb, lane, j, c, h, e)
                                # the bf16 is the e2m1 value * 2^-126 (code 1 = 0.5 on a bf16 subnormal)
                                assert _bf16(bits16) * 2.0 ** 126 == E2M1[code] or E2M1[code] == 0
            s = tscales[nb, kb].tolist()
            for g in range(8):
                for h in range(2):
                    for jg in range(2):
                        assert s[g * 4 + 2 * h + jg] == int(want_s[nb * 16 + g + 8 * h, kb * 2 + jg])


def test_tile_errors():
    p, s = rand_u8(4, 40, 48), rand_u8(4, 40, 3)
    with pytest.raises(ValueError, match="MX tiles take uint8 e2m1 bytes and uint8 e8m0 scales"):
        mx_tiles.tile(p.to(torch.int32), s)
    with pytest.raises(ValueError, match="MX tiles take uint8"):
        mx_tiles.tile(p, s.float())
    with pytest.raises(ValueError, match=r"scales \(4, 40, 2\) do not match packed \(4, 40, 48\)"):
        mx_tiles.tile(p, s[..., :2])
    with pytest.raises(ValueError, match="K a multiple of 32"):
        mx_tiles.tile(rand_u8(40, 8), rand_u8(40, 0))  # K = 16
    v, ts = mx_tiles.tile(p, s)
    with pytest.raises(ValueError, match=r"do not fit an \[40, 160\] weight: expected \[\.\.\., 3, 3, 512\]"):
        mx_tiles.untile(v, ts, 40, 160)
    with pytest.raises(ValueError, match=r"do not fit an \[80, 96\] weight"):
        mx_tiles.untile(v, ts, 80, 96)
    with pytest.raises(ValueError, match="do not fit"):
        mx_tiles.untile(v, ts[..., :16], 40, 96)
    with pytest.raises(ValueError, match="MX tiles are uint8 values and uint8 scales, got torch.int32"):
        mx_tiles.untile(v.to(torch.int32), ts, 40, 96)


def test_gemm_launch_checks_name_the_problem():
    from atom_moe.kernels import mxfp4
    v, ts = mx_tiles.tile(rand_u8(2, 40, 48), rand_u8(2, 40, 3))
    words, swords, row_blocks, k_blocks = mxfp4.launch_args("GEMM1", "w13", v, ts, 40, 96, 64, 128)
    assert words.dtype == swords.dtype == torch.int32 and (row_blocks, k_blocks) == (3, 2)
    assert torch.equal(words.view(torch.uint8), v)
    with pytest.raises(ValueError, match="GEMM1: MX tiles w13 and their scales must be uint8, got torch.uint8, "
                                         "torch.float32"):
        mxfp4.launch_args("GEMM1", "w13", v, ts.float(), 40, 96, 64, 128)
    with pytest.raises(ValueError, match=r"GEMM2: MX tiles w2 .* do not fit an \[80, 96\] weight"):
        mxfp4.launch_args("GEMM2", "w2", v, ts, 80, 96, 64, 128)
    with pytest.raises(ValueError, match=r"block_n % 16 == 0 and block_k % 64 == 0 \(whole MX tile blocks\), "
                                         r"got block_n=64, block_k=32"):
        mxfp4.launch_args("GEMM1", "w13", v, ts, 40, 96, 64, 32)


# ---------------------------------------------------------------- layout guards
def test_layout_refuses_to_reorder_mx_tiles(seed):
    v, s = mx_tiles.tile(rand_u8(2, 48, 48), rand_u8(2, 48, 3))  # 3 row blocks: an odd dim -3 is fine
    t = GateUpTensor(v, INT, TILES)
    ts = GateUpTensor(s, INT, "mx_tiles")
    assert t.kind is TILES and ts.kind is TILES and GateUpKind("mx_tiles") is TILES
    assert require(t, INT) is v and require(ts, INT, "w13_scale") is s
    with pytest.raises(LayoutError, match="w13: tagged interleaved, but this kernel needs separated"):
        require(t, SEP, "w13")
    for fn in (interleave, separate, split_gate_up):
        for x in (t, ts, GateUpTensor(v, SEP, TILES)):
            with pytest.raises(LayoutError, match=f"{fn.__name__}.*untile first with atom_moe.weights.plain_mxfp4"):
                fn(x)
    with pytest.raises(LayoutError, match=r"mx_tiles are \[\.\.\., N/16, K/64, bytes\]"):
        GateUpTensor(v[0, 0], INT, TILES)


# ---------------------------------------------------------------- PreparedWeights
def old_plain(spec: MoESpec, gate, up, down):
    """What prepare_stacked stored before MX tiles: per local expert quantize, rows interleaved."""
    q13, s13, q2, s2 = [], [], [], []
    for e in spec.local_experts:
        (qg, sg), (qu, su), (qd, sd) = F.quantize_mxfp4(gate[e]), F.quantize_mxfp4(up[e]), F.quantize_mxfp4(down[e])
        q13.append(inter(qg, qu))
        s13.append(inter(sg, su))
        q2.append(qd)
        s2.append(sd)
    return torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)


@pytest.mark.parametrize("scheme", ["a16w4"])  # a8w4's MX quads: tests/test_mx_quads.py
@pytest.mark.parametrize("H, I, rank, world", [(96, 160, 0, 1), (160, 96, 1, 2), (128, 64, 2, 3)])
@pytest.mark.parametrize("src", ["bf16", "mxfp4"])
def test_prepare_stacked_gives_mx_tiles_of_the_plain_result(seed, scheme, H, I, rank, world, src):
    E = 6
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, scheme=scheme).for_rank(
        rank, world)
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H) * 4, torch.randn(E, H, I) * 1e-3
    if src == "bf16":
        gate, up, down = gate.bfloat16(), up.bfloat16(), down.bfloat16()
        p = prepare_stacked(spec, torch.cat((gate, up), 1), down, layout="separated")
    else:  # MXFP4 checkpoint bytes, SEPARATED: passed through, only reordered and tiled
        (qg, sg), (qu, su), (qd, sd) = F.quantize_mxfp4(gate), F.quantize_mxfp4(up), F.quantize_mxfp4(down)
        p = prepare_stacked(spec, torch.cat((qg, qu), 1), qd, layout="separated", w13_scale=torch.cat((sg, su), 1),
                            w2_scale=sd)
    p.check(spec)
    El = spec.num_local_experts
    (v13, sc13), (v2, sc2) = mx_tiles.tiled_shapes(2 * I, H), mx_tiles.tiled_shapes(H, I)
    assert p.w13.kind is TILES and p.w13.layout is INT and p.w13.data.shape == (El, *v13)
    assert p.w13_scale.kind is TILES and p.w13_scale.layout is INT and p.w13_scale.data.shape == (El, *sc13)
    assert isinstance(p.w2, torch.Tensor) and p.w2.shape == (El, *v2) and p.w2_scale.shape == (El, *sc2)
    assert all(t.dtype == torch.uint8 for t in (p.w13.data, p.w13_scale.data, p.w2, p.w2_scale))
    want = old_plain(spec, gate, up, down)
    q13, s13, q2, s2 = plain_mxfp4(p)
    assert q13.layout is INT and q13.kind is GateUpKind.ROWS and s13.layout is INT and s13.kind is GateUpKind.ROWS
    for got, exp in zip((q13.data, s13.data, q2, s2), want):
        assert same(got, exp)
    # the tiles are exactly tile() of that plain result
    assert same(p.w13.data, mx_tiles.tile(want[0], want[1])[0]) and same(p.w2_scale, mx_tiles.tile(want[2], want[3])[1])
    assert p.mx_scale_max == max(int(want[1].max()), int(want[3].max()))
    assert p.nbytes() == prepared_nbytes(spec)
    # one expert alone, as experts_torch untiles it
    j = El - 1
    one = plain_mxfp4(p, slice(j, j + 1))
    assert same(one[0].data, want[0][j:j + 1]) and same(one[3], want[3][j:j + 1])


def test_mx_scale_max(seed):
    H, I, E = 64, 96, 4
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, scheme="a16w4")
    q13, q2 = rand_u8(E, 2 * I, H // 2), rand_u8(E, H, I // 2)
    s13, s2 = rand_u8(E, 2 * I, H // 32, lo=100, hi=128), rand_u8(E, H, I // 32, lo=100, hi=128)
    big = int(torch.randint(129, 255, ()))
    where = tuple(int(torch.randint(0, d, ())) for d in s2.shape)
    s2[where] = big  # one byte > 128, in w2
    p = prepare_stacked(spec, q13, q2, layout="interleaved", w13_scale=s13, w2_scale=s2)
    assert p.mx_scale_max == big
    s2[where] = 100
    assert prepare_stacked(spec, q13, q2, layout="interleaved", w13_scale=s13, w2_scale=s2).mx_scale_max == \
        max(int(s13.max()), int(s2.max())) < 128
    for scheme in ("bf16", "fp8"):
        other = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, scheme=scheme)
        assert prepare_stacked(other, torch.randn(E, 2 * I, H), torch.randn(E, H, I), layout="separated"
                               ).mx_scale_max == 0
    # MXFP4 weights built by hand without it: measured at construction
    hand = dataclasses.replace(p, mx_scale_max=0)
    assert hand.mx_scale_max == big


def test_plain_mxfp4_and_check_errors(seed):
    H, I, E = 64, 64, 3
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, scheme="a16w4")
    p = prepare_stacked(spec, torch.randn(E, 2 * I, H), torch.randn(E, H, I), layout="separated")
    bf = prepare_stacked(dataclasses.replace(spec, scheme=Scheme.BF16), torch.randn(E, 2 * I, H), torch.randn(E, H, I),
                         layout="separated")
    with pytest.raises(WeightError, match="plain_mxfp4 needs MXFP4 .* these are bf16"):
        plain_mxfp4(bf)
    q13, s13, q2, s2 = plain_mxfp4(p)
    # plain MXFP4 in PreparedWeights is not a kernel format: check() says so, plain_mxfp4 refuses it
    plain = dataclasses.replace(p, w13=q13, w13_scale=s13, w2=q2, w2_scale=s2)
    with pytest.raises(WeightError, match="w13 is kind rows, a16w4 weights need mx_tiles.*plain MXFP4 is not"):
        plain.check(spec)
    # a16w4 and a8w4 no longer share a format: MX tiles do not pass as a8w4 weights
    with pytest.raises(WeightError, match=r"\(scheme, H, I, E, local experts\) = \(<Scheme.A16W4"):
        p.check(dataclasses.replace(spec, scheme=Scheme.A8W4))
    with pytest.raises(WeightError, match="plain_mxfp4: w13 must be mx_tiles for a16w4"):
        plain_mxfp4(plain)
    with pytest.raises(TypeError, match="slice or index list"):
        plain_mxfp4(p, 0)
    # every tensor's shape and dtype is checked against the tiled shapes
    bad = copy.copy(p)
    bad.w2 = p.w2[:, :-1]
    with pytest.raises(WeightError, match=r"w2 is uint8 \[3, 3, 1, 512\], a16w4 weights need uint8 \[3, 4, 1, 512\]"):
        bad.check(spec)
    bad = copy.copy(p)
    bad.w2_scale = None
    with pytest.raises(WeightError, match="w2_scale is missing"):
        bad.check(spec)
    bad = copy.copy(p)
    bad.w13_scale = GateUpTensor(p.w13_scale.data.float(), INT, TILES)
    with pytest.raises(WeightError, match="w13_scale is float32"):
        bad.check(spec)
    bad = copy.copy(bf)
    bad.w2_scale = torch.ones(E, 1, 1)
    with pytest.raises(WeightError, match="w2_scale is set, but bf16 weights take none"):
        bad.check(dataclasses.replace(spec, scheme=Scheme.BF16))


def test_prepared_shapes_and_nbytes():
    spec = MoESpec.create(hidden_size=2880, intermediate_size=2880, num_experts=128, top_k=4, scheme="a16w4",
                          has_bias=True).for_rank(0, 8)
    shapes = prepared_shapes(spec)
    assert shapes["w13"] == ((16, 360, 45, 512), torch.uint8) and shapes["w13_scale"] == ((16, 360, 45, 32),
                                                                                          torch.uint8)
    assert shapes["w2"] == ((16, 180, 45, 512), torch.uint8) and shapes["w2_scale"] == ((16, 180, 45, 32), torch.uint8)
    # no padding at 2880: the plain MXFP4 bytes, 0.5 + 1/32 per weight
    assert prepared_nbytes(spec) == 4 * 128 + 16 * 3 * 2880 * 2880 * (0.5 + 1 / 32) + 4 * 16 * (2 * 2880 + 2880)
    # padding counted where K is not a multiple of 64 (H = 96 -> 128)
    small = MoESpec.create(hidden_size=96, intermediate_size=64, num_experts=2, top_k=1, scheme="a16w4")
    tiles = 2 * (128 * 128 // 2 + 128 * 128 // 32 + 96 * 64 // 2 + 96 * 64 // 32)
    assert prepared_nbytes(small) == 4 * 2 + tiles
    # a8w4's MX quads: the same bytes plus one exponent byte per row (2I + H per expert)
    small = dataclasses.replace(small, scheme=Scheme.A8W4)
    assert prepared_nbytes(small) == 4 * 2 + tiles + 2 * (128 + 96)


def test_prepare_mxfp4_local_errors(seed):
    H, I, E = 64, 64, 2
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=1, scheme="a16w4")
    one = (rand_u8(2 * I, H // 2), rand_u8(2 * I, H // 32), rand_u8(H, I // 2), rand_u8(H, I // 32))
    with pytest.raises(WeightError, match="1 experts given, the spec has 2 local"):
        prepare_mxfp4_local(spec, [one])
    with pytest.raises(WeightError, match="more than 2 experts given"):
        prepare_mxfp4_local(spec, [one] * 3)
    with pytest.raises(WeightError, match=r"w2_scale of local expert 1 is uint8 \[64, 1\], expected uint8 \[64, 2\]"):
        prepare_mxfp4_local(spec, [one, (*one[:3], one[3][:, :1])])
    with pytest.raises(WeightError, match="builds MXFP4"):
        prepare_mxfp4_local(dataclasses.replace(spec, scheme=Scheme.FP8), [one] * 2)
    p = prepare_mxfp4_local(spec, iter([one, one]))
    q13, s13, q2, s2 = plain_mxfp4(p)
    assert same(q13.data[1], one[0]) and same(s13.data[0], one[1]) and same(q2[1], one[2]) and same(s2[0], one[3])


def test_experts_torch_untiles_one_expert_at_a_time(seed, monkeypatch):
    H, I, E = 64, 96, 4
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, scheme="a16w4")
    p = prepare_stacked(spec, torch.randn(E, 2 * I, H), torch.randn(E, H, I), layout="separated")
    ref = ReferenceWeights.from_prepared(p)
    seen = []
    real = mx_tiles.untile

    def spy(values, scales, n, k):
        seen.append(tuple(values.shape))
        return real(values, scales, n, k)
    monkeypatch.setattr(mx_tiles, "untile", spy)
    for j in range(E):
        w13 = et.dequantize_w13(p, j)
        assert torch.equal(w13[0::2], ref.gate[j]) and torch.equal(w13[1::2], ref.up[j])
        assert torch.equal(et.dequantize_w2(p, j), ref.down[j])
    assert seen and all(len(s) == 3 for s in seen)  # [N/16, K/64, bytes]: one expert, never the stack


def test_bench_random_weights_are_mx_tiles(seed):
    spec = MoESpec.create(hidden_size=96, intermediate_size=64, num_experts=5, top_k=2, scheme="a16w4")
    p = common.random_weights(spec, device="cpu")
    assert isinstance(p, PreparedWeights)
    p.check(spec)
    assert p.w13.kind is TILES and p.w13_scale.kind is TILES
    q13, s13, q2, s2 = plain_mxfp4(p)
    for s in (s13.data, s2):  # the bench's scale distribution: e8m0 bytes 116..121
        assert int(s.min()) >= 116 and int(s.max()) <= 121
    assert p.mx_scale_max == max(int(s13.data.max()), int(s2.max()))
    assert q13.data.shape == (5, 128, 48) and q2.shape == (5, 96, 32)
