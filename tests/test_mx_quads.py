"""MX quads (atom_moe.layouts.mx_quads, a8w4's MXFP4 layout): round trips, the documented word plan, row
exponents and flushing, the kernels' decoder (bit-exact), MX quads in PreparedWeights, GEMM guards."""

from __future__ import annotations

import dataclasses
import itertools
import warnings

import pytest
import torch

from atom_moe import experts_torch as et, formats as F
from atom_moe.layouts import mx_quads, mx_tiles
from atom_moe.layouts.gate_up import GateUpKind, GateUpLayout, GateUpTensor, LayoutError
from atom_moe.spec import MoESpec, Scheme
from atom_moe.weights import WeightError, plain_mxfp4, prepare_mxfp4_local, prepare_stacked

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INT, QUADS, TILES, ROWS = GateUpLayout.INTERLEAVED, GateUpKind.MX_QUADS, GateUpKind.MX_TILES, GateUpKind.ROWS
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
# Triton 3.6's interpreter converts 1-element arrays to ints, which numpy 2.x deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def rand_u8(*shape, lo=0, hi=256) -> torch.Tensor:
    return torch.randint(lo, hi, shape, dtype=torch.uint8)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(a, b)


def nonzero_bytes(*shape) -> torch.Tensor:
    """Random e2m1 byte pairs, at least one nonzero magnitude per byte (so every block holds one)."""
    p = rand_u8(*shape)
    return torch.where((p & 0x77) == 0, p | 0x01, p)


def zero_bytes(*shape) -> torch.Tensor:
    """Random +-0 code pairs (magnitudes 0, random signs)."""
    return rand_u8(*shape) & 0x88


def independent_rowexp(packed: torch.Tensor, scales: torch.Tensor) -> list[int]:
    """The docstring's row exponent of each row of a 2-D weight, one row at a time in Python."""
    codes = F.unpack_e2m1(packed).tolist()
    out = []
    for r, row in enumerate(scales.tolist()):
        nz = [s for b, s in enumerate(row) if any(c & 7 for c in codes[r][32 * b:32 * b + 32])]
        out.append(255 if 255 in row else max(nz) if nz else 127)
    return out


def want_residuals(packed: torch.Tensor, scales: torch.Tensor, paired: bool = False) -> torch.Tensor:
    """Residual bytes placed by the docstring, (s - base + 12) mod 256, 0 in padding. Plain [..., N/16, K/64, 32]:
    byte g * 4 + j (j = 2s + h) of block (nb, kb) is row nb * 16 + g + 8h, k32 slab 2kb + s. Paired [..., N/16,
    ceil(K/128), 64]: byte g * 8 + t * 4 + j of pair (nb, p) is that byte of block kb = 2p + t."""
    *lead, n, kh = packed.shape
    k = 2 * kh
    n_pad, k_pad = mx_tiles.padded(n, k)
    groups, per = (-(-k_pad // 128), 2) if paired else (k_pad // 64, 1)
    p2, s2 = packed.reshape(-1, n, kh), scales.reshape(-1, n, k // 32)
    out = torch.zeros(p2.shape[0], n_pad // 16, groups, 32 * per, dtype=torch.uint8)
    for e in range(p2.shape[0]):
        base = independent_rowexp(p2[e], s2[e])
        sc = s2[e].tolist()
        for nb, p, g, t, j in itertools.product(range(n_pad // 16), range(groups), range(8), range(per), range(4)):
            s, h = divmod(j, 2)
            row, slab = nb * 16 + g + 8 * h, 2 * (per * p + t) + s
            if row < n and slab < k // 32:
                out[e, nb, p, g * 4 * per + t * 4 + j] = (sc[row][slab] - base[row] + 12) % 256
    return out.reshape(*lead, n_pad // 16, groups, 32 * per)


# ---------------------------------------------------------------- tile / untile
# N not a multiple of 16 (40, 17, 1, 37), K a multiple of 32 but not of 64 (96, 160, 32, 288), leading dims
SHAPES = [((), 40, 96), ((3,), 40, 96), ((2, 3), 80, 160), ((2,), 16, 64), ((1,), 17, 32), ((2,), 8, 2880),
          ((2,), 48, 448), ((), 1, 32), ((2,), 37, 288)]


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("lead, n, k", SHAPES)
def test_round_trip_bit_exact(seed, lead, n, k, paired):
    packed, scales = rand_u8(*lead, n, k // 2), rand_u8(*lead, n, k // 32)
    values, residuals, rowexp, flushed = mx_quads.tile(packed, scales, paired)
    want_v, want_s = mx_quads.tiled_shapes(n, k, paired)
    assert values.dtype == residuals.dtype == rowexp.dtype == torch.uint8
    assert values.shape == (*lead, *want_v) and residuals.shape == (*lead, *want_s) and rowexp.shape == (*lead, n)
    assert values.is_contiguous() and residuals.is_contiguous()
    assert isinstance(flushed, int) and flushed == int(mx_quads.flushed_blocks(packed, scales).sum())
    back_p, back_s = mx_quads.untile(values, residuals, rowexp, n, k, paired)
    assert same(back_p, packed) and same(back_s, scales)  # lossless, flushed blocks and NaN scales included
    again = mx_quads.tile(back_p, back_s, paired)
    assert same(again[0], values) and same(again[1], residuals) and same(again[2], rowexp) and again[3] == flushed


@pytest.mark.parametrize("lead, n, k", [((), 40, 96), ((2,), 17, 160), ((3,), 1, 32), ((2, 2), 37, 288),
                                         ((2,), 32, 128), ((2,), 16, 320)])
@pytest.mark.parametrize("paired", [False, True])
def test_residuals_and_padding(seed, lead, n, k, paired):
    """Residual bytes at the documented places, (s - base + 12) mod 256, padding bytes 0; padding codes 0."""
    packed = nonzero_bytes(*lead, n, k // 2)
    scales = rand_u8(*lead, n, k // 32, lo=1, hi=255)  # no NaN byte
    values, residuals, rowexp, _ = mx_quads.tile(packed, scales, paired)
    assert same(residuals, want_residuals(packed, scales, paired))
    # the padded [n_pad, k_pad] weight gives the same quads: untile it whole to see the padding codes
    n_pad, k_pad = mx_tiles.padded(n, k)
    rowexp_pad = torch.full((*lead, n_pad), 127, dtype=torch.uint8)
    rowexp_pad[..., :n] = rowexp
    full_p, _ = mx_quads.untile(values, residuals, rowexp_pad, n_pad, k_pad, paired)
    assert same(full_p[..., :n, : k // 2], packed)
    pad = torch.ones_like(full_p, dtype=torch.bool)
    pad[..., :n, : k // 2] = False
    assert (full_p[pad] == 0).all()
    # each value byte carries two codes of one packed byte (and sign bits): none is 0 without padding
    if n % 16 == 0 and k % 64 == 0:
        assert (values != 0).all()


def test_tile_errors():
    p, s = rand_u8(4, 40, 48), rand_u8(4, 40, 3)
    with pytest.raises(ValueError, match="MX quads take uint8 e2m1 bytes and uint8 e8m0 scales"):
        mx_quads.tile(p.to(torch.int32), s)
    with pytest.raises(ValueError, match=r"scales \(4, 40, 2\) do not match packed \(4, 40, 48\)"):
        mx_quads.tile(p, s[..., :2])
    with pytest.raises(ValueError, match="K a multiple of 32"):
        mx_quads.tile(rand_u8(40, 8), rand_u8(40, 0))  # K = 16
    v, r, e, _ = mx_quads.tile(p, s)
    with pytest.raises(ValueError, match=r"do not fit an \[40, 160\] weight"):
        mx_quads.untile(v, r, e, 40, 160)
    with pytest.raises(ValueError, match=r"rowexp \(4, 39\) do not fit"):
        mx_quads.untile(v, r, e[..., :39], 40, 96)
    with pytest.raises(ValueError, match="MX quads rowexp must be uint8, got torch.int32"):
        mx_quads.untile(v, r, e.to(torch.int32), 40, 96)
    with pytest.raises(ValueError, match=r"paired residuals \(4, 3, 2, 32\) .* / \[\.\.\., 3, 1, 64\] /"):
        mx_quads.untile(v, r, e, 40, 96, paired=True)  # plain residuals read as paired


# ---------------------------------------------------------------- the documented word plan
@pytest.mark.parametrize("n, k", [(16, 64), (40, 96), (37, 288)])
def test_documented_word_plan(seed, n, k):
    """Decode each word the way the docstring says, independently of tile()'s own permutation."""
    packed, scales = rand_u8(n, k // 2), rand_u8(n, k // 32)
    values, _, _, _ = mx_quads.tile(packed, scales)
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)  # LOW nibble = even k
    assert torch.equal(codes, F.unpack_e2m1(packed))
    n_pad, k_pad = mx_tiles.padded(n, k)
    want = torch.zeros(n_pad, k_pad, dtype=torch.int64)
    want[:n, :k] = codes
    want = want.tolist()
    v = values.to(torch.int64)
    checked = 0
    for nb in range(n_pad // 16):
        for kb in range(k_pad // 64):
            b = v[nb, kb].reshape(128, 4)
            words = (b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24).tolist()  # little-endian
            for lane in range(32):
                g, q = divmod(lane, 4)
                for j in range(4):
                    s, h = divmod(j, 2)
                    w = words[lane * 4 + j]
                    row = nb * 16 + g + 8 * h
                    for t in range(2):
                        for i in range(4):
                            c = want[row][kb * 64 + 32 * s + 16 * t + 4 * q + i]
                            mag_at, sign_at = (4 * i, 8 * i + 7) if t == 0 else (16 + 4 * i, 8 * i + 3)
                            assert (w >> mag_at) & 7 == c & 7, (nb, kb, lane, j, t, i)
                            assert (w >> sign_at) & 1 == c >> 3, (nb, kb, lane, j, t, i)
                            checked += 1
                    # the kernels' register expressions: byte i of (w & 0x7777) | (w & 0x80808080) is code
                    # (0, i)'s magnitude | sign << 7; the same for (w >> 16) & 0x7777 | (w << 4) & 0x80808080, t = 1
                    for t, (sel, sign) in enumerate(((w & 0x7777, w & 0x80808080),
                                                     ((w >> 16) & 0x7777, (w << 4) & 0x80808080))):
                        for i in range(4):
                            c = want[row][kb * 64 + 32 * s + 16 * t + 4 * q + i]
                            assert (sel >> 4 * i) & 15 == c & 7 and (sign >> 8 * i + 7) & 1 == c >> 3
    assert checked == n_pad * k_pad  # every code, once (the 32 bits of a word hold 8 codes: a bijection)


def test_table_values_are_exact_e4m3():
    """The docstring's table: value(c) * 2^(d - 6) is exact in e4m3 for d in [1, 12] (and overflows at 13)."""
    mags = torch.tensor(E2M1[:8])
    for d in range(1, 13):
        x = mags * 2.0 ** (d - 6)
        assert torch.equal(x.to(torch.float8_e4m3fn).float(), x)
    assert (mags * 2.0 ** 7).max() > torch.finfo(torch.float8_e4m3fn).max


# ---------------------------------------------------------------- row exponents
def test_row_exponents(seed):
    lead, n, k = (2, 3), 24, 256
    nblk = k // 32
    packed = nonzero_bytes(*lead, n, k // 2)
    scales = rand_u8(*lead, n, nblk, lo=0, hi=255)
    # some blocks hold only +-0 codes, with large scales that must be ignored
    zero = torch.rand(*lead, n, nblk) < 0.35
    packed = torch.where(zero.repeat_interleave(16, -1), zero_bytes(*lead, n, k // 2), packed)
    scales = torch.where(zero, rand_u8(*lead, n, nblk, lo=200, hi=255), scales)
    packed[0, 0, 0] = zero_bytes(k // 2)  # a row of zeros: 127
    packed[1, 2, 5] = zero_bytes(k // 2)
    scales[1, 2, 5] = rand_u8(nblk, lo=0, hi=255)
    scales[0, 1, 3, int(torch.randint(nblk, ()))] = 255  # NaN byte in a nonzero block
    packed[1, 0, 7, :16] = zero_bytes(16)
    scales[1, 0, 7, 0] = 255  # NaN byte in a block of +-0 codes: still 255
    got = mx_quads.row_exponents(packed, scales)
    assert got.dtype == torch.uint8 and got.shape == (*lead, n)
    p2, s2, g2 = packed.reshape(-1, n, k // 2), scales.reshape(-1, n, nblk), got.reshape(-1, n)
    for e in range(p2.shape[0]):
        assert g2[e].tolist() == independent_rowexp(p2[e], s2[e]), e
    assert int(got[0, 0, 0]) == int(got[1, 2, 5]) == 127
    assert int(got[0, 1, 3]) == int(got[1, 0, 7]) == 255
    # base = max over blocks with a nonzero code: the +-0 blocks' (larger) scales do not count
    nonzero = (F.unpack_e2m1(packed).reshape(*lead, n, nblk, 32) & 7).amax(-1) > 0
    nz_max = torch.where(nonzero, scales.to(torch.int32), -1).amax(-1)
    ordinary = (nz_max >= 0) & ~(scales == 255).any(-1)
    assert torch.equal(got.to(torch.int32)[ordinary], nz_max[ordinary])
    assert int(ordinary.sum()) > n  # most rows are ordinary ones, and many have a +-0 block above their base
    above = (~nonzero & (scales.to(torch.int32) > got.to(torch.int32).unsqueeze(-1))).any(-1)
    assert int((above & ordinary).sum()) > n // 2


# ---------------------------------------------------------------- flushing
def test_flushed_blocks_and_flush(seed):
    n, nblk = 21, 6
    k = 32 * nblk
    packed = nonzero_bytes(n, k // 2)
    scales = torch.zeros(n, nblk, dtype=torch.uint8)
    want_flushed = torch.zeros(n, nblk, dtype=torch.bool)
    for r in range(n):
        base = int(torch.randint(30, 243, ()))
        # row max, exactly 11 below (kept), exactly 12 below (flushed), 13+ below (flushed),
        # 30 below with +-0 codes (not flushed), above the max with +-0 codes (ignored)
        blocks = [base, base - 11, base - 12, int(torch.randint(0, base - 12, ())), base - 30, base + 5]
        kinds = ["max", "kept", "flush", "flush", "zero", "zero"]
        order = torch.randperm(nblk).tolist()
        for b, src in enumerate(order):
            scales[r, b] = blocks[src]
            want_flushed[r, b] = kinds[src] == "flush"
            if kinds[src] == "zero":
                packed[r, 16 * b:16 * b + 16] = zero_bytes(16)
    nan_row = 3  # a row with an e8m0 NaN byte flushes nothing (it decodes to NaN anyway)
    scales[nan_row, int(torch.randint(nblk, ()))] = 255
    want_flushed[nan_row] = False
    got = mx_quads.flushed_blocks(packed, scales)
    assert got.dtype == torch.bool and got.shape == (n, nblk)
    assert torch.equal(got, want_flushed) and int(got.sum()) == 2 * (n - 1)
    # tile counts them; the residual bytes wrap mod 256 below the row's range
    values, residuals, rowexp, count = mx_quads.tile(packed, scales)
    assert count == int(got.sum()) == int(want_flushed.sum())
    assert same(residuals, want_residuals(packed, scales))
    base = rowexp.to(torch.int32)
    assert base.tolist() == independent_rowexp(packed, scales)
    d = (scales.to(torch.int32) - base[:, None] + 12) % 256
    ok = torch.ones(n, dtype=torch.bool)
    ok[nan_row] = False
    kept = ~want_flushed & ok[:, None] & (F.unpack_e2m1(packed).reshape(n, nblk, 32) & 7).amax(-1).bool()
    assert ((d[kept] >= 1) & (d[kept] <= 12)).all()  # the decodable range
    assert ((d[want_flushed] == 0) | (d[want_flushed] > 12)).all()  # 12 below -> 0, further -> wraps past 243
    assert bool((d[want_flushed] > 200).any())
    # flush: the flushed blocks' codes become +-0 with their signs; everything else untouched
    flat = mx_quads.flush(packed, scales)
    byte_flushed = want_flushed.repeat_interleave(16, -1)
    assert flat.dtype == torch.uint8 and flat.shape == packed.shape
    assert torch.equal(flat[byte_flushed], packed[byte_flushed] & 0x88)
    assert torch.equal(flat[~byte_flushed], packed[~byte_flushed])
    assert bool((packed[byte_flushed] & 0x88).any())  # some signs to keep
    # the layout itself stays lossless
    assert all(map(same, mx_quads.untile(values, residuals, rowexp, n, k), (packed, scales)))
    # nothing to flush: flush gives the same bytes
    s_ok = rand_u8(n, nblk, lo=116, hi=128)
    assert not mx_quads.flushed_blocks(packed, s_ok).any() and torch.equal(mx_quads.flush(packed, s_ok), packed)
    assert mx_quads.tile(packed, s_ok)[3] == 0


def test_flushed_blocks_random(seed):
    """Wide random scales with leading dims: flushed_blocks against the docstring's rule, row by row."""
    lead, n, k = (3,), 19, 320
    packed = rand_u8(*lead, n, k // 2)
    packed[..., :40] &= 0x88  # the first 2.5 blocks of each row: +-0 codes
    scales = rand_u8(*lead, n, k // 32, lo=90, hi=150)
    scales[1, 4, 6] = 255
    got = mx_quads.flushed_blocks(packed, scales)
    for e in range(lead[0]):
        base = independent_rowexp(packed[e], scales[e])
        codes = F.unpack_e2m1(packed[e]).tolist()
        for r in range(n):
            for b in range(k // 32):
                nz = any(c & 7 for c in codes[r][32 * b:32 * b + 32])
                want = nz and base[r] != 255 and int(scales[e, r, b]) < base[r] - 11
                assert bool(got[e, r, b]) == want, (e, r, b)
    assert got.any() and not got[1, 4].any() and not got[..., :2].any()
    assert mx_quads.tile(packed, scales)[3] == int(got.sum())


# ---------------------------------------------------------------- the kernels' decoder
def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def _decode_and_compare(packed, scales, *, flush, block_n, block_k, paired=False):
    """dequantize_quads on DEVICE vs the twin's weights on the host: bit-exact on rows without an e8m0 NaN
    byte; those rows are NaN throughout. (a8w4 NaN-poisons the whole row through its row factor; the
    reference NaNs only the block, but the GEMM output of that row is NaN either way.)"""
    from atom_moe.kernels import mxfp4
    *_, n, kh = packed.shape
    k = 2 * kh
    values, residuals, rowexp, _ = mx_quads.tile(packed, scales, paired)
    got = mxfp4.dequantize_quads(values.to(DEVICE), residuals.to(DEVICE), rowexp.to(DEVICE), n, k, flush=flush,
                                 paired=paired, block_n=block_n, block_k=block_k).cpu()
    assert got.dtype == torch.float32 and got.shape == (*packed.shape[:-1], k)
    want = F.dequantize_mxfp4(mx_quads.flush(packed, scales), scales)
    nan_rows = (scales == 255).any(-1)
    assert got[nan_rows].isnan().all()
    assert not want[~nan_rows].isnan().any()
    assert _bits_equal(got[~nan_rows], want[~nan_rows])
    return want


def _all_bytes(E, N, K):
    packed = rand_u8(E, N, K // 2)
    packed[0, 0, :] = torch.arange(K // 2, dtype=torch.uint8)
    packed[1, 1, :] = torch.arange(256 - K // 2, 256, dtype=torch.uint8)
    assert len(torch.unique(packed)) == 256  # every byte value: all 16 x 16 code pairs
    return packed


@pytest.mark.parametrize("paired", [False, True])  # paired: one 8-byte load at 128 k, two halves at 64, pairs at 256
@pytest.mark.parametrize("block_n, block_k", [(32, 128), (16, 64), (64, 256)])
def test_decoder_bit_exact_no_flush(seed, block_n, block_k, paired):
    pytest.importorskip("triton")
    E, N, K = 2, 37, 288  # N, K not multiples of the tile block (padding, partial tiles)
    packed = _all_bytes(E, N, K)
    packed[0, 9, :32] &= 0x88  # two +-0 blocks with residuals far outside [1, 12]: not flushed, still +-0
    nan = torch.zeros(E, N, dtype=torch.bool)
    nan[0, 5] = nan[1, 36] = True
    # around 127, and at the top of the finite range (up to 6 * 2^125), at most 11 apart: nothing flushed
    for lo in (122, 241):
        scales = rand_u8(E, N, K // 32, lo=lo, hi=lo + 12)
        scales[0, 9, :2] = torch.tensor([lo - 40, 254], dtype=torch.uint8)
        scales[0, 5, 2] = scales[1, 36, 8] = 255
        assert not mx_quads.flushed_blocks(packed, scales).any()
        for flush in (True, False):  # no flushed block: both paths decode the same
            want = _decode_and_compare(packed, scales, flush=flush, block_n=block_n, block_k=block_k,
                                       paired=paired)
        assert (want[~nan] != 0).sum() > want[~nan].numel() // 2 and want[~nan].isfinite().all()
        assert (want[0, 9, :64] == 0).all()


@pytest.mark.parametrize("paired", [False, True])
@pytest.mark.parametrize("block_n, block_k", [(32, 128), (64, 128)])
def test_decoder_bit_exact_with_flush(seed, block_n, block_k, paired):
    pytest.importorskip("triton")
    E, N, K = 2, 37, 288
    packed = _all_bytes(E, N, K)
    packed[1, 3, :48] &= 0x88  # +-0 blocks, one with a scale far above the row's base
    scales = rand_u8(E, N, K // 32, lo=100, hi=151)
    scales[1, 3, 0] = 254
    scales[0, 7, 4] = 255
    dropped = mx_quads.flushed_blocks(packed, scales)
    assert int(dropped.sum()) > 50
    want = _decode_and_compare(packed, scales, flush=True, block_n=block_n, block_k=block_k, paired=paired)
    # the flushed blocks are +-0 (signs kept), as mx_quads.flush gives them
    assert (want.reshape(E, N, K // 32, 32)[dropped] == 0).all()


def test_decoder_bit_exact_small_scales(seed):
    """e8m0 bytes 0..20: fp32 subnormal values and subnormal row factors 2^(base - 133) (base < 7)."""
    pytest.importorskip("triton")
    E, N, K = 2, 37, 288
    packed = _all_bytes(E, N, K)
    scales = rand_u8(E, N, K // 32, lo=0, hi=21)
    scales[:, 10:20] = rand_u8(E, 10, K // 32, lo=0, hi=7)  # rows with base < 7
    scales[0, 12] = 0  # base 0: the factor 2^-133
    scales[1, 13] = 0
    scales[1, 25, 3] = 255
    base = mx_quads.row_exponents(packed, scales)
    assert (base[:, 10:20] < 7).all() and int(base[0, 12]) == 0
    assert mx_quads.flushed_blocks(packed, scales).any()
    want = _decode_and_compare(packed, scales, flush=True, block_n=32, block_k=128)
    fin = want[want.isfinite() & (want != 0)]
    assert (fin.abs() < torch.finfo(torch.float32).tiny).any()  # subnormal results are compared too


# ---------------------------------------------------------------- PreparedWeights
def _spec(scheme, H, I, E, **kw):
    return MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=2, scheme=scheme, **kw)


def _experts(E, H, I, lo=118, hi=128):
    """Plain MXFP4 per expert (w13 INTERLEAVED rows), scales within 11 of each other: nothing flushed."""
    return [(nonzero_bytes(2 * I, H // 2), rand_u8(2 * I, H // 32, lo=lo, hi=hi), nonzero_bytes(H, I // 2),
             rand_u8(H, I // 32, lo=lo, hi=hi)) for _ in range(E)]


@pytest.mark.parametrize("H, I, rank, world", [(96, 160, 0, 1), (160, 96, 1, 2)])
def test_prepare_mxfp4_local_builds_mx_quads(seed, H, I, rank, world):
    E = 4
    spec = _spec("a8w4", H, I, E).for_rank(rank, world)
    El = spec.num_local_experts
    ex = _experts(El, H, I)
    ex[-1][3][H // 2] = rand_u8(I // 32, lo=190, hi=201)  # one whole w2 row far above: no flush, scale max
    ex[-1][3][H // 2, 0] = 201
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no flush warning on normal data
        p = prepare_mxfp4_local(spec, ex)
    p.check(spec)
    assert p.mx_flush is False
    assert p.mx_scale_max == 201 == max(max(int(e[1].max()), int(e[3].max())) for e in ex)
    (v13, s13), (v2, s2) = mx_quads.tiled_shapes(2 * I, H, paired=True), mx_quads.tiled_shapes(H, I)
    assert p.w13.kind is QUADS and p.w13.layout is INT and p.w13.data.shape == (El, *v13)
    assert p.w13_scale.kind is QUADS and p.w13_scale.layout is INT and p.w13_scale.data.shape == (El, *s13)
    assert p.w2.shape == (El, *v2) and p.w2_scale.shape == (El, *s2)
    assert isinstance(p.w13_rowexp, GateUpTensor) and p.w13_rowexp.layout is INT and p.w13_rowexp.kind is ROWS
    assert p.w13_rowexp.data.shape == (El, 2 * I) and p.w2_rowexp.shape == (El, H)
    assert all(t.dtype == torch.uint8 for t in (p.w13.data, p.w13_scale.data, p.w2, p.w2_scale, p.w13_rowexp.data,
                                                p.w2_rowexp))
    for j, (q13, sc13, q2, sc2) in enumerate(ex):  # exactly mx_quads.tile of each expert
        t13, t2 = mx_quads.tile(q13, sc13, paired=True), mx_quads.tile(q2, sc2)
        assert same(p.w13.data[j], t13[0]) and same(p.w13_scale.data[j], t13[1]) and same(p.w13_rowexp.data[j], t13[2])
        assert same(p.w2[j], t2[0]) and same(p.w2_scale[j], t2[1]) and same(p.w2_rowexp[j], t2[2])
    # plain_mxfp4 gives the checkpoint bytes back exactly, also for a selection of experts
    q13, s13_, q2, s2_ = plain_mxfp4(p)
    assert q13.layout is INT and s13_.kind is ROWS
    for j, e in enumerate(ex):
        assert same(q13.data[j], e[0]) and same(s13_.data[j], e[1]) and same(q2[j], e[2]) and same(s2_[j], e[3])
    for sel, idx in ((slice(El - 1, El), [El - 1]), ([El - 1, 0], [El - 1, 0])):
        one = plain_mxfp4(p, sel)
        for pos, j in enumerate(idx):
            assert same(one[0].data[pos], ex[j][0]) and same(one[1].data[pos], ex[j][1])
            assert same(one[2][pos], ex[j][2]) and same(one[3][pos], ex[j][3])
    # a16w4 and a8w4 no longer share a weight format: each scheme's check refuses the other's weights
    with pytest.raises(WeightError, match="prepared weights"):
        p.check(dataclasses.replace(spec, scheme=Scheme.A16W4))
    p16 = prepare_mxfp4_local(dataclasses.replace(spec, scheme=Scheme.A16W4), ex)
    assert p16.w13.kind is TILES and p16.w13_rowexp is None and p16.w2_rowexp is None
    with pytest.raises(WeightError, match="prepared weights"):
        p16.check(spec)
    swapped = dataclasses.replace(p, w13=GateUpTensor(p16.w13.data, INT, TILES))
    with pytest.raises(WeightError, match="w13 is kind mx_tiles, a8w4 weights need mx_quads"):
        swapped.check(spec)
    with pytest.raises(WeightError, match="plain_mxfp4: w13 must be mx_quads for a8w4"):
        plain_mxfp4(swapped)
    with pytest.raises(WeightError, match="need w13_rowexp and w2_rowexp"):
        plain_mxfp4(dataclasses.replace(p, w2_rowexp=None))
    # check() covers the row exponents too
    with pytest.raises(WeightError, match=r"w2_rowexp is missing: a8w4 weights need uint8 \["):
        dataclasses.replace(p, w2_rowexp=None).check(spec)
    with pytest.raises(WeightError, match="w13_rowexp is int32"):
        dataclasses.replace(p, w13_rowexp=GateUpTensor(p.w13_rowexp.data.to(torch.int32), INT)).check(spec)
    with pytest.raises(WeightError, match="w2_rowexp is set, but a16w4 weights take none"):
        dataclasses.replace(p16, w2_rowexp=p.w2_rowexp).check(dataclasses.replace(spec, scheme=Scheme.A16W4))


def test_prepare_mxfp4_local_warns_on_flushed_blocks(seed):
    H, I, E = 64, 96, 3
    spec = _spec("a8w4", H, I, E)
    ex = _experts(E, H, I, lo=120, hi=128)
    r = int(torch.randint(2 * I, ()))
    ex[1][1][r] = torch.tensor([127, 115], dtype=torch.uint8)  # block 1: 12 below its row's max
    ex[2][3][5, 1] = 127 - 11  # exactly 11 below: kept
    ex[2][3][5, 0] = 127
    with pytest.warns(UserWarning, match=r"^a8w4: 1 MXFP4 blocks"):
        p = prepare_mxfp4_local(spec, ex)
    assert p.mx_flush is True
    p.check(spec)
    q13, s13, q2, s2 = plain_mxfp4(p)  # the layout keeps the flushed block's bytes
    assert same(q13.data[1], ex[1][0]) and same(s13.data[1], ex[1][1]) and same(s2[2], ex[2][3])
    # a16w4 keeps it and does not warn
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prepare_mxfp4_local(dataclasses.replace(spec, scheme=Scheme.A16W4), ex).mx_flush is False


@pytest.mark.parametrize("src", ["bf16", "mxfp4"])
def test_prepare_stacked_a8w4_gives_mx_quads(seed, src):
    H, I, E = 96, 64, 4
    spec = _spec("a8w4", H, I, E).for_rank(1, 2)
    gate, up, down = torch.randn(E, I, H), torch.randn(E, I, H) * 4, torch.randn(E, H, I) * 1e-3
    (qg, sg), (qu, su), (qd, sd) = F.quantize_mxfp4(gate), F.quantize_mxfp4(up), F.quantize_mxfp4(down)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # gaussian weights: no block 2^11 below its row's largest
        if src == "bf16":
            p = prepare_stacked(spec, torch.cat((gate, up), 1), down, layout="separated")
        else:
            p = prepare_stacked(spec, torch.cat((qg, qu), 1), qd, layout="separated", w13_scale=torch.cat((sg, su), 1),
                                w2_scale=sd)
    p.check(spec)
    assert p.w13.kind is QUADS and p.w13_scale.kind is QUADS and p.mx_flush is False
    loc = list(spec.local_experts)
    inter = lambda a, b: torch.stack((a, b), dim=-2).flatten(-3, -2)  # noqa: E731  rows g0, u0, g1, u1, ...
    want = (inter(qg[loc], qu[loc]), inter(sg[loc], su[loc]), qd[loc], sd[loc])
    got = plain_mxfp4(p)
    for g, w in zip((got[0].data, got[1].data, got[2], got[3]), want):
        assert same(g, w)
    assert same(p.w13_rowexp.data, mx_quads.row_exponents(want[0], want[1]))
    assert same(p.w2_rowexp, mx_quads.row_exponents(want[2], want[3]))
    assert p.mx_scale_max == max(int(want[1].max()), int(want[3].max()))
    # the torch twin's weights are exactly the kernels' decode (no NaN here)
    pytest.importorskip("triton")
    from atom_moe.kernels import mxfp4
    dq13 = mxfp4.dequantize_quads(p.w13.data.to(DEVICE), p.w13_scale.data.to(DEVICE),
                                  p.w13_rowexp.data.to(DEVICE), 2 * I, H, paired=True).cpu()
    dq2 = mxfp4.dequantize_quads(p.w2.to(DEVICE), p.w2_scale.to(DEVICE), p.w2_rowexp.to(DEVICE), H, I).cpu()
    for j in range(spec.num_local_experts):
        assert _bits_equal(et.dequantize_w13(p, j), dq13[j]) and _bits_equal(et.dequantize_w2(p, j), dq2[j])


# ---------------------------------------------------------------- GEMM launch guards
def test_gemm_launch_guards(seed):
    pytest.importorskip("triton")
    from atom_moe.kernels import gemm1, gemm2
    H, I, E, T, k = 64, 64, 2, 3, 2
    spec = _spec("a8w4", H, I, E)
    ex = _experts(E, H, I)
    p8 = prepare_mxfp4_local(spec, ex)
    p16 = prepare_mxfp4_local(dataclasses.replace(spec, scheme=Scheme.A16W4), ex)
    x = torch.zeros(T, H).to(F.FP8_DTYPE)
    x_scale = torch.ones(T, 1)
    out = torch.zeros(T * k, I).to(F.FP8_DTYPE)
    out_scale = torch.ones(T * k, 1)
    ids = torch.zeros(16, dtype=torch.int32)
    blocks = torch.zeros(1, dtype=torch.int32)
    kw = dict(oai=False, alpha=1.702, limit=7.0, block_m=16, block_n=256, block_k=128, num_warps=4, num_stages=2)
    with pytest.raises(LayoutError, match="must be mx_quads for a8w4"):
        gemm1.gemm1(x, x_scale, p16.w13, p16.w13_scale, None, ids, blocks, 1, k, out, out_scale, **kw,
                    w13_rowexp_t=p8.w13_rowexp)
    with pytest.raises(ValueError, match="GEMM1: a8w4 \\(MX quads\\) needs w13_rowexp"):
        gemm1.gemm1(x, x_scale, p8.w13, p8.w13_scale, None, ids, blocks, 1, k, out, out_scale, **kw)
    with pytest.raises(ValueError, match="GEMM1: w13_rowexp must be contiguous uint8"):
        gemm1.gemm1(x, x_scale, p8.w13, p8.w13_scale, None, ids, blocks, 1, k, out, out_scale, **kw,
                    w13_rowexp_t=GateUpTensor(p8.w13_rowexp.data.to(torch.int32), INT))
    # and a16w4 (bf16 activations) refuses MX quads
    with pytest.raises(LayoutError, match="must be mx_tiles for a16w4"):
        gemm1.gemm1(x.bfloat16(), None, p8.w13, p8.w13_scale, None, ids, blocks, 1, k, out.bfloat16(), None,
                    **{**kw, "block_n": 64, "block_k": 64})
    # GEMM1's tile holds whole 64-groups of its output, with one scale per (row, group)
    quads = dict(w13_rowexp_t=p8.w13_rowexp)
    with pytest.raises(ValueError, match="a8w4 GEMM1 needs block_n=128 or 256 and block_k=64 or 128"):
        gemm1.gemm1(x, x_scale, p8.w13, p8.w13_scale, None, ids, blocks, 1, k, out, out_scale,
                    **{**kw, "block_n": 64}, **quads)
    with pytest.raises(ValueError, match=r"GEMM1: out_scale must be \[6, ceil\(I/64\)\] for a8w4, got \(6, 2\)"):
        gemm1.gemm1(x, x_scale, p8.w13, p8.w13_scale, None, ids, blocks, 1, k, out, torch.ones(T * k, 2), **kw,
                    **quads)
    a = torch.zeros(T * k, I).to(F.FP8_DTYPE)

    def call_gemm2(a_scale, block_k, **extra):
        gemm2.gemm2(a, a_scale, p8.w2, p8.w2_scale, None, ids, blocks, 1, torch.zeros(T, k),
                    p8.expert_map, torch.ones(T, k), torch.zeros(T * k, H), torch.zeros(T, 1, dtype=torch.int32), 1,
                    torch.zeros(T, H, dtype=torch.bfloat16), block_m=16, block_n=64, block_k=block_k, num_warps=4,
                    num_stages=2, hidden=H, **extra)

    with pytest.raises(ValueError, match="GEMM2: a8w4 \\(MX quads\\) needs w2_rowexp"):
        call_gemm2(torch.ones(T * k, 1), 64)
    with pytest.raises(ValueError, match="a8w4 GEMM2 needs block_k=64 \\(its activation's quant group\\), got 128"):
        call_gemm2(torch.ones(T * k, 1), 128, w2_rowexp=p8.w2_rowexp)
    with pytest.raises(ValueError, match=r"GEMM2: a_scale must be \[6, ceil\(I/64\)\] for a8w4, got \(6, 2\)"):
        call_gemm2(torch.ones(T * k, 2), 64, w2_rowexp=p8.w2_rowexp)
    # scales are read and written through their strides: overlapping elements (expand) are refused
    with pytest.raises(ValueError, match=r"GEMM2: a_scale \(6, 1\) has strides \(0, 1\): allowed are row-major"):
        call_gemm2(torch.ones(1, 1).expand(T * k, 1), 64, w2_rowexp=p8.w2_rowexp)
    with pytest.raises(ValueError, match=r"GEMM1: out_scale \(6, 1\) has strides \(0, 1\): allowed are row-major"):
        gemm1.gemm1(x, x_scale, p8.w13, p8.w13_scale, None, ids, blocks, 1, k, out, torch.ones(1, 1).expand(T * k, 1),
                    **kw, **quads)


def test_fused_a8w4_flushes_the_blocks_the_twin_flushes(seed):
    # a layer with flushed blocks through the whole Triton path (interpreter): the kernels' flush
    # select zeroes exactly what the torch twin zeroes. Without it those blocks' residual bytes
    # (far outside 1..12) build garbage tables: the same weights with mx_flush off must miss.
    pytest.importorskip("triton")
    from kernel_cases import make_routing, rel_err
    from atom_moe.experts import fused_experts
    H, I, E, T = 128, 64, 3, 7
    spec = _spec("a8w4", H, I, E)
    ex = _experts(E, H, I, lo=122, hi=128)
    for e in range(E):
        for s in (1, 3):  # w13 and w2 scales: ~15% of the blocks 15-37 binades below their row's max
            drop = torch.rand(ex[e][s].shape) < 0.15
            ex[e][s][drop] = rand_u8(int(drop.sum()), lo=90, hi=108)
    flushed = sum(int(mx_quads.flushed_blocks(ex[e][w], ex[e][s]).sum()) for e in range(E) for w, s in ((0, 1), (2, 3)))
    assert flushed > 0
    with pytest.warns(UserWarning, match=f"^a8w4: {flushed} MXFP4 blocks"):
        p = prepare_mxfp4_local(spec, ex)
    assert p.mx_flush is True
    w, ids = make_routing(T, E, 2)
    x = torch.randn(T, H).to(torch.bfloat16)
    twin = et.experts_torch(x, w, ids, p, spec)
    got = fused_experts(x, w, ids, p, spec)
    assert torch.isfinite(got).all() and rel_err(got, twin) <= 1e-2
    unflushed = fused_experts(x, w, ids, dataclasses.replace(p, mx_flush=False), spec)
    assert rel_err(unflushed, twin) > 0.1  # ten times the tolerance above


@pytest.mark.parametrize("block_n1", [128, 256])
def test_a8w4_gemm1_quantizes_its_output_per_64_group(seed, block_n1, monkeypatch):
    # a8w4 with ATOM_MOE_A8W4_INTER=group quantizes GEMM2's input per token-group-64 (Scheme.inter_group) in
    # GEMM1's epilogue, so GEMM1's tile may be 128 rows (one group) or 256 (two). Every row's scale of every group
    # (I = 160: two whole groups and a half one) is that group's amax / 448, and the e4m3 values are the twin's.
    pytest.importorskip("triton")
    monkeypatch.setenv("ATOM_MOE_A8W4_INTER", "group")
    from kernel_cases import make_routing, rel_err
    from atom_moe.experts import allocate_workspace, fused_experts
    from atom_moe.kernels.tuning import TileConfig
    from atom_moe.reference import apply_activation, quant_dequant_activations
    H, I, E, T, bm = 128, 160, 3, 6, 16
    spec = _spec("a8w4", H, I, E)
    p = prepare_mxfp4_local(spec, _experts(E, H, I))
    w, ids = make_routing(T, E, 2)
    x = torch.randn(T, H).to(torch.bfloat16)
    ws = allocate_workspace(spec, T, "cpu")
    assert tuple(ws.inter_scale.shape[1:]) == (3,)
    fused_experts(x, w, ids, p, spec, workspace=ws, config=TileConfig(bm, block_n1, 64, 4, 2, 64, 64, 4, 2))
    xin = quant_dequant_activations(x, spec.scheme)
    rows = 0
    for r, pair in enumerate(ws.sorted_ids[:ws.block_expert.numel() * bm].tolist()):
        local = int(ws.block_expert[r // bm])
        if local < 0 or pair >= T * 2:  # unused block, padding row
            continue
        h = xin[pair // 2] @ et.dequantize_w13(p, local).T
        act = apply_activation(h[0::2], h[1::2], spec.activation)
        amax = torch.nn.functional.pad(act, (0, 32)).view(3, 64).abs().amax(1)
        torch.testing.assert_close(ws.inter_scale[r], amax / 448, rtol=1e-4, atol=0)
        deq = ws.inter[r].float() * ws.inter_scale[r].repeat_interleave(64)[:I]
        assert rel_err(deq, quant_dequant_activations(act[None], spec.scheme, inter=True)[0]) <= 1e-3
        rows += 1
    assert rows == T * 2


def test_dequantize_helpers_refuse_bad_input(seed):
    # the decoders' test entry points: wrong dtypes, shapes and block sizes are clear errors, never a
    # reinterpretation of the bytes or a crash inside the kernel
    from atom_moe.kernels import mxfp4
    n, k = 40, 96
    v, d, b, _ = mx_quads.tile(nonzero_bytes(n, k // 2), rand_u8(n, k // 32, lo=120, hi=128))
    tv, ts = mx_tiles.tile(nonzero_bytes(n, k // 2), rand_u8(n, k // 32, lo=120, hi=128))
    with pytest.raises(ValueError, match="MX quads and their scales must be uint8, got torch.uint8, torch.float32"):
        mxfp4.dequantize_quads(v, d.float(), b, n, k)
    with pytest.raises(ValueError, match="MX tiles and their scales must be uint8, got torch.int32"):
        mxfp4.dequantize(tv.to(torch.int32), ts, n, k)
    with pytest.raises(ValueError, match=r"do not fit \[40, 160\]: expected \[\.\.\., 3, 3, 512\]"):
        mxfp4.dequantize_quads(v, d, b, n, 160)
    with pytest.raises(ValueError, match=r"scales \(2, 3, 2, 32\) do not fit"):
        mxfp4.dequantize(tv, ts.expand(2, *ts.shape), n, k)
    with pytest.raises(ValueError, match="rowexp must be uint8 .* got torch.int32"):
        mxfp4.dequantize_quads(v, d, b.to(torch.int32), n, k)
    with pytest.raises(ValueError, match="powers of two, multiples of 16 and 64, got 48, 128"):
        mxfp4.dequantize_quads(v, d, b, n, k, block_n=48)
    with pytest.raises(ValueError, match="got 32, 96"):
        mxfp4.dequantize(tv, ts, n, k, block_k=96)
