"""Number formats: bit-exact OCP MX v1.0 tables, rounding, packing, pinned scale rules, properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from atom_moe import formats as F

SETTINGS = settings(max_examples=25, deadline=None)

# OCP MX v1.0, table "FP4 (E2M1)": code -> value, bit 3 is the sign.
E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-level equality of float tensors (NaN == NaN, -0 != +0)."""
    a, b = a.float(), b.float()
    return a.shape == b.shape and bool(
        (torch.isnan(a) == torch.isnan(b)).all()
        and ((a == b) | torch.isnan(a)).all()
        and (torch.signbit(a) == torch.signbit(b)).all()
    )


# ---------------------------------------------------------------- e2m1 / e8m0 / e4m3 tables
def test_e2m1_table_all_16_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    values = F.e2m1_decode(codes)
    assert values.dtype == torch.float32
    assert _same(values, torch.tensor(E2M1_TABLE))
    assert torch.signbit(values[8]) and values[8] == 0  # code 8 is -0
    # and back: every table value encodes to its own code (including -0 -> 8)
    assert torch.equal(F.e2m1_encode(torch.tensor(E2M1_TABLE)), codes)


def test_e8m0_table():
    b = torch.tensor([0, 1, 100, 126, 127, 128, 200, 253, 254, 0xFF], dtype=torch.uint8)
    got = F.e8m0_to_float(b)
    want = torch.tensor([math.ldexp(1.0, -127), math.ldexp(1.0, -126), math.ldexp(1.0, -27), 0.5, 1.0, 2.0,
                         math.ldexp(1.0, 73), math.ldexp(1.0, 126), math.ldexp(1.0, 127), float("nan")])
    assert _same(got, want)
    assert got[0].item() == 2.0 ** -127 and got[8].item() == 2.0 ** 127
    with pytest.raises(F.FormatError):
        F.e8m0_to_float(torch.zeros(3, dtype=torch.int32))


def test_e4m3_table_via_fp8_quantizers():
    # amax 448 -> scale exactly 1, so the codes are the plain e4m3 encodings.
    vals = [448.0, -448.0, 2.0 ** -6, 2.0 ** -9, -(2.0 ** -9), 2.0 ** -7, 0.0, 1.0, 1.125, 240.0, 256.0, 288.0]
    # OCP MX v1.0 / OFP8 E4M3: S.EEEE.MMM, bias 7, no inf, NaN = S.1111.111
    bits = [0x7E, 0xFE, 0x08, 0x01, 0x81, 0x04, 0x00, 0x38, 0x39, 0x77, 0x78, 0x79]
    q, s = F.quantize_fp8_per_tensor(torch.tensor(vals))
    assert s.shape == () and s.item() == 1.0
    assert q.dtype == F.FP8_DTYPE
    assert q.view(torch.uint8).tolist() == bits
    assert _same(q.float(), torch.tensor(vals))
    # rounding at the subnormal edge and above the max normal
    x = torch.tensor([448.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -9 * 1.4999, 1.0625, 1.1875, 3 * 2.0 ** -11])
    q, s = F.quantize_fp8_per_tensor(x)
    assert s.item() == 1.0
    # 2^-10 is the midpoint of 0 and 2^-9: ties to even -> 0; 3*2^-10 (between 2^-9 and 2^-8) -> 2^-8
    # 1.0625 = midpoint of 1.0 and 1.125 -> 1.0 (even), 1.1875 = midpoint 1.125 / 1.25 -> 1.25 (even)
    assert q.float().tolist() == [448.0, 0.0, 2.0 ** -8, 2.0 ** -9, 1.0, 1.25, 2.0 ** -9]
    # max normal, min normal, min subnormal
    assert torch.finfo(F.FP8_DTYPE).max == 448.0
    q, _ = F.quantize_fp8_per_group(torch.tensor([[448.0, 2.0 ** -6, 2.0 ** -9, 0.0]]), 4)
    assert q.view(torch.uint8).tolist() == [[0x7E, 0x08, 0x01, 0x00]]


# ---------------------------------------------------------------- e2m1 rounding
def test_e2m1_round_to_nearest_even_at_midpoints():
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    want = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0])
    assert _same(F.e2m1_decode(F.e2m1_encode(mids)), want)
    assert _same(F.e2m1_decode(F.e2m1_encode(-mids)), -want)
    # one ulp either side of each midpoint goes to the nearer neighbour
    lower = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0])
    upper = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    below = torch.nextafter(mids, torch.zeros_like(mids))
    above = torch.nextafter(mids, torch.full_like(mids, 100.0))
    assert _same(F.e2m1_decode(F.e2m1_encode(below)), lower)
    assert _same(F.e2m1_decode(F.e2m1_encode(above)), upper)
    assert _same(F.e2m1_decode(F.e2m1_encode(-above)), -upper)


def test_e2m1_saturation_and_signs():
    x = torch.tensor([6.0, 7.0, 1e9, float("inf"), -7.0, -1e9, 5.0001, -0.0, 0.0, -0.1, 0.1])
    want = torch.tensor([6.0, 6.0, 6.0, 6.0, -6.0, -6.0, 6.0, -0.0, 0.0, -0.0, 0.0])
    assert _same(F.e2m1_decode(F.e2m1_encode(x)), want)
    assert F.e2m1_encode(x).tolist() == [7, 7, 7, 7, 15, 15, 7, 8, 0, 8, 0]


@SETTINGS
@given(st.floats(-20.0, 20.0, allow_nan=False, width=32))
def test_e2m1_nearest_property(v):
    """The encoded value is a nearest table value; on a tie, the one with an even code."""
    got = F.e2m1_decode(F.e2m1_encode(torch.tensor([v]))).item()
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    a = min(abs(v), 6.0)
    dists = [abs(a - g) for g in grid]
    best = min(dists)
    cands = [i for i, d in enumerate(dists) if d == best]
    idx = cands[0] if len(cands) == 1 else [i for i in cands if i % 2 == 0][0]
    assert abs(got) == grid[idx]
    if got != 0:
        assert math.copysign(1, got) == math.copysign(1, v)


# ---------------------------------------------------------------- packing
def test_pack_e2m1_low_nibble_first():
    codes = torch.tensor([[1, 2, 3, 4, 15, 0, 8, 7], [0, 15, 15, 0, 9, 10, 6, 5]], dtype=torch.uint8)
    packed = F.pack_e2m1(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 4)
    assert packed.tolist() == [[0x21, 0x43, 0x0F, 0x78], [0xF0, 0x0F, 0xA9, 0x56]]
    assert torch.equal(F.unpack_e2m1(packed), codes)
    assert F.unpack_e2m1(torch.tensor([0x21, 0x8F], dtype=torch.uint8)).tolist() == [1, 2, 15, 8]
    with pytest.raises(F.FormatError):
        F.pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(F.FormatError):
        F.unpack_e2m1(torch.zeros(3, dtype=torch.int32))


def test_pack_unpack_round_trip(seed):
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8)
    packed = F.pack_e2m1(codes)
    assert packed.shape == (3, 5, 32)
    assert torch.equal(packed, codes[..., 0::2] | (codes[..., 1::2] << 4))
    assert torch.equal(F.unpack_e2m1(packed), codes)
    b = torch.randint(0, 256, (7, 16), dtype=torch.uint8)
    assert torch.equal(F.pack_e2m1(F.unpack_e2m1(b)), b)


def test_quantize_mxfp4_packs_hand_block():
    # scale 1 (amax 6): element 2i in the low nibble
    x = torch.tensor([[0.5, 1.0, -6.0, 3.0] + [0.0] * 28])
    packed, scales = F.quantize_mxfp4(x)
    assert scales.tolist() == [[127]]
    assert packed[0, :2].tolist() == [0x21, 0x5F]
    assert packed[0, 2:].tolist() == [0] * 14


# ---------------------------------------------------------------- MX scale rule (pinned)
def _mx_exponent_exact(amax: float, max_elem: float) -> int:
    """Smallest e with amax <= max_elem * 2**e, clamped to [-127, 127] (exact in Python floats)."""
    if amax == 0:
        return 0
    e = -200
    while amax > max_elem * 2.0 ** e:
        e += 1
    return max(-127, min(127, e))


@pytest.mark.parametrize("amax, byte", [
    (6.0, 127), (float(torch.nextafter(torch.tensor(6.0), torch.tensor(7.0))), 128), (3.0, 126),
    (float(torch.nextafter(torch.tensor(3.0), torch.tensor(4.0))), 127), (4.0, 127), (1.0, 125),
    (12.0, 128), (0.75, 124), (1e-3, 127 - 12), (5.9, 127), (6.5, 128),
])
def test_mxfp4_scale_rule_hand_cases(amax, byte):
    x = torch.zeros(1, 64)
    x[0, 3] = -amax  # sign must not matter
    x[0, 40] = 0.1 * amax
    x[0, 32] = amax
    _, scales = F.quantize_mxfp4(x)
    assert scales.tolist() == [[byte, byte]]


@pytest.mark.parametrize("k", [-120, -30, -3, 0, 1, 2, 7, 50, 120])
def test_mx_scale_at_power_of_two_boundaries(k):
    # amax = 0.75 * 2^k = 6 * 2^(k-3) exactly -> X = 2^(k-3); one ulp more -> 2^(k-2)
    amax = torch.tensor(math.ldexp(0.75, k))
    up = torch.nextafter(amax, torch.tensor(float("inf")))
    x = torch.stack([torch.full((32,), float(amax)), torch.full((32,), float(up))]).reshape(1, 64)
    _, s = F.quantize_mxfp4(x)
    assert s.tolist() == [[127 + k - 3, 127 + k - 2]]
    # MXFP8: 448 = 0.875 * 2^9
    amax8 = torch.tensor(math.ldexp(0.875, k))
    up8 = torch.nextafter(amax8, torch.tensor(float("inf")))
    x8 = torch.stack([torch.full((32,), float(amax8)), torch.full((32,), float(up8))]).reshape(1, 64)
    _, s8 = F.quantize_mxfp8(x8)
    assert s8.tolist() == [[max(0, 127 + k - 9), max(0, 127 + k - 8)]]  # clamped at 2^-127


def test_mxfp8_scale_hand_cases():
    x = torch.zeros(4, 32)
    x[0, 0], x[1, 5], x[2, 7], x[3, 9] = 448.0, -449.0, 224.0, 1.0
    q, s = F.quantize_mxfp8(x)
    # 1.0 <= 448 * 2^-8 = 1.75 but > 448 * 2^-9 = 0.875
    assert s.flatten().tolist() == [127, 128, 126, 127 - 8]
    d = F.dequantize_mxfp8(q, s)
    assert d[0, 0] == 448.0 and d[2, 7] == 224.0 and d[3, 9] == 1.0
    assert d[1, 5] == -448.0  # -449 / 2 = -224.5 -> -224 (e4m3 step 16 in [128, 256))


def _e2m1_half_step(y: torch.Tensor) -> torch.Tensor:
    a = y.abs()
    return torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0))


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(-100, 100), st.integers(1, 4))
def test_mxfp4_scale_rule_and_no_clipping(s, log_mag, nblocks):
    g = torch.Generator().manual_seed(s)
    x = torch.randn(3, 32 * nblocks, generator=g) * torch.rand(3, 32 * nblocks, generator=g) * 2.0 ** log_mag
    packed, scales = F.quantize_mxfp4(x)
    assert packed.shape == (3, 16 * nblocks) and scales.shape == (3, nblocks)
    xb = x.reshape(3, nblocks, 32)
    for r in range(3):
        for b in range(nblocks):
            amax = xb[r, b].abs().max().item()
            assert scales[r, b].item() == 127 + _mx_exponent_exact(amax, 6.0)
    d = F.dequantize_mxfp4(packed, scales).reshape(3, nblocks, 32)
    X = F.e8m0_to_float(scales).unsqueeze(-1)
    assert ((d - xb).abs() <= X * _e2m1_half_step(xb / X)).all()
    assert (d.abs() <= 6 * X).all()


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(-100, 100))
def test_mxfp8_scale_rule_and_no_clipping(s, log_mag):
    g = torch.Generator().manual_seed(s)
    x = torch.randn(4, 96, generator=g) * 2.0 ** log_mag
    q, scales = F.quantize_mxfp8(x)
    assert q.dtype == F.FP8_DTYPE and q.shape == x.shape and scales.shape == (4, 3)
    xb = x.reshape(4, 3, 32)
    for r in range(4):
        for b in range(3):
            assert scales[r, b].item() == 127 + _mx_exponent_exact(xb[r, b].abs().max().item(), 448.0)
    X = F.e8m0_to_float(scales).unsqueeze(-1)
    d = F.dequantize_mxfp8(q, scales).reshape(4, 3, 32)
    y = (xb / X).abs()
    assert ((d - xb).abs() <= X * torch.clamp(y * 2.0 ** -4, min=2.0 ** -10)).all()


# ---------------------------------------------------------------- properties
_block_values = st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=32, max_size=32)


@SETTINGS
@given(st.lists(_block_values, min_size=1, max_size=3))
def test_mxfp4_requantize_is_exact(blocks):
    x = torch.tensor(blocks).reshape(1, -1)
    d = F.dequantize_mxfp4(*F.quantize_mxfp4(x))
    p2, s2 = F.quantize_mxfp4(d)
    d2 = F.dequantize_mxfp4(p2, s2)
    assert _same(d2, d)
    assert torch.equal(F.quantize_mxfp4(d2)[0], p2) and torch.equal(F.quantize_mxfp4(d2)[1], s2)


@SETTINGS
@given(st.lists(_block_values, min_size=1, max_size=3))
def test_mxfp8_requantize_is_exact(blocks):
    x = torch.tensor(blocks).reshape(1, -1)
    d = F.dequantize_mxfp8(*F.quantize_mxfp8(x))
    d2 = F.dequantize_mxfp8(*F.quantize_mxfp8(d))
    assert _same(d2, d)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(-60, 60), st.sampled_from([128, 200, 2880]))
def test_fp8_group_requantize_is_exact(s, log_mag, k):
    g = torch.Generator().manual_seed(s)
    x = torch.randn(3, k, generator=g) * 2.0 ** log_mag
    d = F.dequantize_fp8_per_group(*F.quantize_fp8_per_group(x))
    q2, s2 = F.quantize_fp8_per_group(d)
    assert _same(F.dequantize_fp8_per_group(q2, s2), d)
    w = torch.randn(130, 140, generator=g) * 2.0 ** log_mag
    dw = F.dequantize_fp8_block(*F.quantize_fp8_block(w))
    assert _same(F.dequantize_fp8_block(*F.quantize_fp8_block(dw)), dw)


@SETTINGS
@given(_block_values, st.floats(1e-3, 1e3))
def test_monotonic_within_a_block(vals, mult):
    x = torch.tensor(sorted(vals)).reshape(1, 32) * mult
    d4 = F.dequantize_mxfp4(*F.quantize_mxfp4(x))
    d8 = F.dequantize_mxfp8(*F.quantize_mxfp8(x))
    dg = F.dequantize_fp8_per_group(*F.quantize_fp8_per_group(x, 32), 32)
    for d in (d4, d8, dg):
        assert (d[0, 1:] >= d[0, :-1]).all()


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(-100, 100), st.sampled_from([64, 128, 200, 333]))
def test_fp8_per_group_error_bound(s, log_mag, k):
    """|x - q*s| <= s * half-ulp(q): 2^-4 |q| for normals (3 mantissa bits), 2^-10 for subnormals."""
    g = torch.Generator().manual_seed(s)
    x = torch.randn(5, k, generator=g) * torch.rand(5, 1, generator=g) * 2.0 ** log_mag
    q, sc = F.quantize_fp8_per_group(x, 128)
    ng = -(-k // 128)
    assert sc.shape == (5, ng)
    for r in range(5):
        for j in range(ng):
            assert sc[r, j].item() == (x[r, j * 128:(j + 1) * 128].abs().max() / 448.0).item()
    d = F.dequantize_fp8_per_group(q, sc)
    se = sc.repeat_interleave(128, dim=-1)[:, :k]
    bound = se * torch.clamp(q.float().abs() * 2.0 ** -4, min=2.0 ** -10) * (1 + 2.0 ** -18)
    assert ((d - x).abs() <= bound).all()


# ---------------------------------------------------------------- NaN / Inf / zeros
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_mx_nonfinite_block_is_all_nan_others_exact(seed, bad):
    x = torch.randn(3, 96) * 4
    clean = x.clone()
    x[0, 5] = bad  # block (0, 0)
    x[2, 95] = bad  # block (2, 2)
    nan_blocks = {(0, 0), (2, 2)}
    for quant, dequant in ((F.quantize_mxfp4, F.dequantize_mxfp4), (F.quantize_mxfp8, F.dequantize_mxfp8)):
        q, s = quant(x)
        qc, sc = quant(clean)
        d, dc = dequant(q, s).reshape(3, 3, 32), dequant(qc, sc).reshape(3, 3, 32)
        for r in range(3):
            for b in range(3):
                if (r, b) in nan_blocks:
                    assert s[r, b].item() == 0xFF
                    assert torch.isnan(d[r, b]).all()
                else:
                    assert s[r, b] == sc[r, b]
                    assert _same(d[r, b], dc[r, b])
                    assert torch.isfinite(d[r, b]).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_fp8_nonfinite_group_is_all_nan_others_exact(seed, bad):
    x = torch.randn(4, 300)
    clean = x.clone()
    x[1, 130] = bad  # group (1, 1)
    q, s = F.quantize_fp8_per_group(x)
    qc, sc = F.quantize_fp8_per_group(clean)
    d, dc = F.dequantize_fp8_per_group(q, s), F.dequantize_fp8_per_group(qc, sc)
    assert torch.isnan(s[1, 1]) and torch.isnan(d[1, 128:256]).all()
    mask = torch.ones_like(d, dtype=torch.bool)
    mask[1, 128:256] = False
    assert _same(d[mask], dc[mask]) and torch.isfinite(d[mask]).all()
    smask = torch.ones_like(s, dtype=torch.bool)
    smask[1, 1] = False
    assert torch.equal(s[smask], sc[smask])
    # per token: only row 1 is NaN
    qt, st_ = F.quantize_fp8_per_token(x)
    dt = qt.float() * st_
    assert torch.isnan(dt[1]).all() and torch.isfinite(dt[[0, 2, 3]]).all()
    qtc, stc = F.quantize_fp8_per_token(clean)
    assert _same(dt[[0, 2, 3]], (qtc.float() * stc)[[0, 2, 3]])
    # per tensor: everything NaN
    qa, sa = F.quantize_fp8_per_tensor(x)
    assert torch.isnan(sa) and torch.isnan(qa.float() * sa).all()
    # 128x128 blocks on [300, 200]: block (1, 1) only
    w = torch.randn(300, 200)
    wc = w.clone()
    w[200, 150] = bad
    qb, sb = F.quantize_fp8_block(w)
    qbc, sbc = F.quantize_fp8_block(wc)
    db, dbc = F.dequantize_fp8_block(qb, sb), F.dequantize_fp8_block(qbc, sbc)
    assert torch.isnan(sb[1, 1]) and torch.isnan(db[128:256, 128:200]).all()
    bm = torch.ones_like(db, dtype=torch.bool)
    bm[128:256, 128:200] = False
    assert _same(db[bm], dbc[bm]) and torch.isfinite(db[bm]).all()


def test_zero_blocks(seed):
    x = torch.randn(2, 96)
    x[0, 32:64] = 0
    x[1, :] = 0
    for quant, dequant in ((F.quantize_mxfp4, F.dequantize_mxfp4), (F.quantize_mxfp8, F.dequantize_mxfp8)):
        q, s = quant(x)
        assert s[0, 1].item() == 127 and (s[1] == 127).all()
        d = dequant(q, s)
        assert (d[0, 32:64] == 0).all() and (d[1] == 0).all()
    q, s = F.quantize_fp8_per_group(x, 32)
    assert s[0, 1].item() == 1.0 and (s[1] == 1.0).all()
    assert (F.dequantize_fp8_per_group(q, s, 32)[1] == 0).all()
    qt, st_ = F.quantize_fp8_per_token(x)
    assert st_[1, 0].item() == 1.0 and (qt[1].float() == 0).all()
    qa, sa = F.quantize_fp8_per_tensor(torch.zeros(5, 7))
    assert sa.item() == 1.0 and (qa.float() == 0).all()
    w = torch.randn(300, 200)
    w[:128, 128:] = 0
    qb, sb = F.quantize_fp8_block(w)
    assert sb[0, 1].item() == 1.0 and (F.dequantize_fp8_block(qb, sb)[:128, 128:] == 0).all()


def test_tiny_finite_groups_do_not_become_nan():
    """A finite group whose amax / 448 underflows must still dequantize finite and close."""
    x = torch.zeros(3, 128)
    x[0, :4] = torch.tensor([1e-44, -5e-44, 3e-44, 0.0])
    x[1, :2] = torch.tensor([1e-38, -2e-37])
    x[2, :2] = torch.tensor([float(torch.finfo(torch.float32).tiny), 1e-36])
    q, s = F.quantize_fp8_per_group(x)
    d = F.dequantize_fp8_per_group(q, s)
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(d).all()
    # scale floored at the smallest normal fp32: error <= max(amax * 2^-4, tiny * 2^-10)
    tiny = torch.finfo(torch.float32).tiny
    assert ((d - x).abs() <= torch.clamp(x.abs().amax(-1, keepdim=True) * 2.0 ** -4, min=tiny * 2.0 ** -10)).all()
    qb, sb = F.quantize_fp8_block(x)
    assert torch.isfinite(F.dequantize_fp8_block(qb, sb)).all()
    for quant, dequant in ((F.quantize_mxfp4, F.dequantize_mxfp4), (F.quantize_mxfp8, F.dequantize_mxfp8)):
        dm = dequant(*quant(x))
        assert torch.isfinite(dm).all()


# ---------------------------------------------------------------- fp8 granularities
def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fp8_per_tensor(seed):
    x = torch.randn(37, 300) * 3
    q, s = F.quantize_fp8_per_tensor(x)
    assert q.shape == x.shape and q.dtype == F.FP8_DTYPE and s.shape == () and s.dtype == torch.float32
    assert s.item() == (x.abs().max() / 448).item()
    assert _rel(q.float() * s, x) < 4e-2


def test_fp8_per_token(seed):
    x = torch.randn(2, 37, 300) * torch.rand(2, 37, 1) * 10
    q, s = F.quantize_fp8_per_token(x)
    assert q.shape == x.shape and s.shape == (2, 37, 1)
    assert torch.equal(s, x.abs().amax(-1, keepdim=True) / 448)
    assert _rel(q.float() * s, x) < 4e-2


@pytest.mark.parametrize("shape", [(5, 2880), (3, 200), (2, 4, 256), (1, 100)])
def test_fp8_per_token_grouped(seed, shape):
    # a8w4's GEMM1 input: the per-token quant, its scale written once per 128-group (a partial last one too)
    x = torch.randn(*shape) * torch.rand(*shape[:-1], 1) * 5
    x[..., :64] *= 30  # one group far larger than the rest: a per-group scale would differ
    q, s = F.quantize_fp8_per_token_grouped(x, 128)
    qt, st_ = F.quantize_fp8_per_token(x)
    assert s.shape == (*shape[:-1], -(-shape[-1] // 128)) and s.is_contiguous()
    assert torch.equal(q.float(), qt.float()) and torch.equal(s, st_.expand_as(s))
    assert torch.equal(F.dequantize_fp8_per_group(q, s, 128), qt.float() * st_)
    x[(0,) * (len(shape) - 1) + (shape[-1] - 1,)] = float("nan")  # NaN spreads to its row's scales only
    _, s = F.quantize_fp8_per_token_grouped(x, 128)
    assert s[(0,) * (len(shape) - 1)].isnan().all() and s.isnan().sum() == s.shape[-1]


@pytest.mark.parametrize("shape", [(5, 2880), (3, 200), (2, 4, 256), (1, 100)])
def test_fp8_per_group_shapes_and_dequant(seed, shape):
    x = torch.randn(*shape) * torch.rand(*shape[:-1], 1) * 5
    k = shape[-1]
    q, s = F.quantize_fp8_per_group(x, 128)
    ng = -(-k // 128)
    assert q.shape == x.shape and q.dtype == F.FP8_DTYPE and s.shape == (*shape[:-1], ng)
    assert s.dtype == torch.float32
    for j in range(ng):
        assert torch.equal(s[..., j], x[..., j * 128:(j + 1) * 128].abs().amax(-1) / 448)
    d = F.dequantize_fp8_per_group(q, s)
    # q * scale, expanded by hand, reproduces dequant exactly
    manual = torch.empty_like(x)
    for j in range(ng):
        manual[..., j * 128:(j + 1) * 128] = q[..., j * 128:(j + 1) * 128].float() * s[..., j:j + 1]
    assert _same(d, manual)
    assert _rel(d, x) < 4e-2
    assert F.dequantize_fp8_per_group(q, s, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(300, 200), (256, 128), (2, 130, 260), (100, 2880)])
def test_fp8_block_shapes_and_dequant(seed, shape):
    w = torch.randn(*shape) * 0.05
    w[..., :7, :9] *= 40  # uneven blocks
    q, s = F.quantize_fp8_block(w)
    n, k = shape[-2:]
    nb, kb = -(-n // 128), -(-k // 128)
    assert q.shape == w.shape and q.dtype == F.FP8_DTYPE and s.shape == (*shape[:-2], nb, kb)
    manual = torch.empty_like(w)
    for i in range(nb):
        for j in range(kb):
            blk = w[..., i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            sij = blk.abs().amax(dim=(-1, -2)) / 448
            assert torch.equal(s[..., i, j], sij)
            manual[..., i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (
                q[..., i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].float() * s[..., i, j, None, None])
    d = F.dequantize_fp8_block(q, s)
    assert _same(d, manual)
    assert _rel(d, w) < 4e-2
    with pytest.raises(F.FormatError, match="block scales"):
        F.dequantize_fp8_block(q, s[..., :-1])


def test_mxfp4_dequant_shape_checks(seed):
    x = torch.randn(4, 64)
    p, s = F.quantize_mxfp4(x)
    with pytest.raises(F.FormatError):
        F.dequantize_mxfp4(p, s[:, :1])
    with pytest.raises(F.FormatError):
        F.quantize_mxfp4(torch.randn(4, 48))
    d = F.dequantize_mxfp4(p, s, torch.bfloat16)
    assert d.dtype == torch.bfloat16 and d.shape == x.shape
    assert _rel(d, x) < 0.2


def test_e4m3_single_rounding_near_ties():
    """x just past an e4m3 midpoint must round away from the tie (no double rounding via bf16/fp16)."""
    eps = 2.0 ** -12
    vals = [448.0, 1.0625 + eps, 1.1875 - eps, -(1.0625 + eps), 2.0 ** -10 + 2.0 ** -20, 200.0 + 2.0 ** -10]
    want = [448.0, 1.125, 1.125, -1.125, 2.0 ** -9, 208.0]
    x = torch.zeros(1, 32)
    x[0, :len(vals)] = torch.tensor(vals)
    q, s = F.quantize_mxfp8(x)
    assert s.tolist() == [[127]]
    assert F.dequantize_mxfp8(q, s)[0, :len(vals)].tolist() == want
    q, s = F.quantize_fp8_per_group(x, 32)
    assert s.tolist() == [[1.0]]
    assert q.float()[0, :len(vals)].tolist() == want


def test_zero_rows_quantize_to_empty_tensors():
    # An EP rank can receive no tokens: every activation quantizer must accept [0, K].
    q, s = F.quantize_fp8_per_group(torch.randn(0, 300))
    assert q.shape == (0, 300) and s.shape == (0, 3)
    assert F.dequantize_fp8_per_group(q, s).shape == (0, 300)
    q, s = F.quantize_fp8_per_token(torch.randn(0, 64))
    assert q.shape == (0, 64) and s.shape == (0, 1)
    q, s = F.quantize_mxfp8(torch.randn(0, 64))
    assert q.shape == (0, 64) and s.shape == (0, 2)
    p, s = F.quantize_mxfp4(torch.randn(0, 64))
    assert p.shape == (0, 32) and F.dequantize_mxfp4(p, s).shape == (0, 64)
