"""MXFP4 weight tiles decoded in registers: e2m1 codes x e8m0 scales (one per 32 along K).

Layout: the kernels stream PreparedWeights' tensors as they are (no repack yet):
packed e2m1 uint8 [E, N, K/2] (two codes per byte, LOW nibble = even k) and e8m0 uint8
[E, N, K/32]. A weight tile is loaded as bytes [BLOCK_K/2, BLOCK_N] plus scales
[BLOCK_K/32, BLOCK_N] and decoded here:

- `tile_bf16` (a16w4): value * 2^(s-127), exact in bf16 (e2m1 has 2 significant bits).
- `tile_e4m3` (a8w4): e2m1 converts exactly to e4m3. The per-32 scales of one 128-K step
  are factored into a per-column base 2^(max_s - 127 - 6) (applied once per K step to the
  fp32 dot result, exactly like the fp8 scheme's block scale) and a residual exponent
  r = s - max_s + 6 in [.., 6] folded into the e4m3 values at decode time. 6 * 2^6 = 384
  <= 448, and e2m1 values stay exact in e4m3 down to r = -8, so the factorization is
  lossless whenever the four scales of a 128-K step span <= 14 binades (real checkpoints:
  always; beyond that the smallest blocks are rounded to the e4m3 grid, not dropped).

`tile_bf16_nk` / `tile_e4m3_nk` decode the same bytes loaded the other way round, [BLOCK_N,
BLOCK_K/2] + scales [BLOCK_N, BLOCK_K/32], into [BLOCK_N, BLOCK_K] tiles (nibbles joined along
K, no permute) with identical values: the "swap" GEMMs use them as the dot's LEFT operand
(out^T = W @ x^T), which an H200 runs up to 1.8x faster at <= 16 rows per expert
(docs/perf/mxfp4-lab-h200.md).

The e2m1 decode is a bit trick: code bits s|e1 e0|m placed as fp16 bits (s << 15 | em << 9)
give exactly value * 2^-14 (code 1 = 0.5 lands on an fp16 subnormal, which the fp16 ->
fp32 conversion handles exactly), so no table and no branches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast, interpreting

SCALE_BLOCK = 32  # elements per e8m0 scale along K


@triton.jit
def e8m0_to_f32(s):
    """e8m0 bytes -> fp32 2^(s-127); 0 -> 2^-127 (fp32 subnormal), 0xFF -> NaN."""
    si = s.to(tl.int32)
    bits = tl.where(si == 0, 0x00400000, si << 23)
    bits = tl.where(si == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_codes(packed, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """bytes [BLOCK_K/2, BLOCK_N] -> codes [BLOCK_K, BLOCK_N]: row 2i = low nibble of byte row i."""
    lo = packed & 0x0F
    hi = packed >> 4
    return tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), (BLOCK_K, BLOCK_N))


@triton.jit
def e2m1_value_2m14(codes):
    """e2m1 codes -> fp32 value * 2^-14 (exact; via fp16 bits, code 1 is an fp16 subnormal)."""
    c = codes.to(tl.uint16)
    h = ((c & 8) << 12) | ((c & 7) << 9)
    return h.to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def tile_bf16(packed, scales, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    """Dequantized bf16 tile [BLOCK_K, BLOCK_N] (bit-exact: e2m1 * 2^k is representable)."""
    v = e2m1_value_2m14(e2m1_codes(packed, BLOCK_K, BLOCK_N)) * 16384.0
    sf = e8m0_to_f32(scales)
    w = tl.reshape(tl.reshape(v, (BLOCK_K // 32, 32, BLOCK_N)) * sf[:, None, :], (BLOCK_K, BLOCK_N))
    return cast(w, tl.bfloat16, EMULATE)


@triton.jit
def tile_e4m3(packed, scales, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    """(e4m3 tile [BLOCK_K, BLOCK_N], fp32 column scale [BLOCK_N]) with tile * col == dequantized weight.

    col = 2^(max_s - 127 - 6) per column (NaN if any scale is 0xFF); the tile holds
    e2m1 * 2^(s - max_s + 6), exact for s >= max_s - 14.
    """
    si = scales.to(tl.int32)
    smax = tl.max(si, 0)
    # value * 2^-14 * 2^(20 + s - smax) = value * 2^(s - smax + 6); fp32 exponent field >= 1
    fexp = tl.maximum(127 + 20 + si - smax[None, :], 1)
    f = (fexp << 23).to(tl.float32, bitcast=True)
    v = e2m1_value_2m14(e2m1_codes(packed, BLOCK_K, BLOCK_N))
    w = tl.reshape(tl.reshape(v, (BLOCK_K // 32, 32, BLOCK_N)) * f[:, None, :], (BLOCK_K, BLOCK_N))
    col = e8m0_to_f32(smax) * 0.015625
    return cast(w, tl.float8e4nv, EMULATE), col


@triton.jit
def e2m1_codes_nk(packed, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """bytes [BLOCK_N, BLOCK_K/2] -> codes [BLOCK_N, BLOCK_K]: column 2i = low nibble of byte column i."""
    return tl.reshape(tl.join(packed & 0x0F, packed >> 4), (BLOCK_N, BLOCK_K))


@triton.jit
def tile_bf16_nk(packed, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    """`tile_bf16` for bytes [BLOCK_N, BLOCK_K/2] and scales [BLOCK_N, BLOCK_K/32]: tile [BLOCK_N, BLOCK_K]."""
    v = e2m1_value_2m14(e2m1_codes_nk(packed, BLOCK_N, BLOCK_K)) * 16384.0
    sf = e8m0_to_f32(scales)
    w = tl.reshape(tl.reshape(v, (BLOCK_N, BLOCK_K // 32, 32)) * sf[:, :, None], (BLOCK_N, BLOCK_K))
    return cast(w, tl.bfloat16, EMULATE)


@triton.jit
def tile_e4m3_nk(packed, scales, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EMULATE: tl.constexpr):
    """`tile_e4m3` for bytes [BLOCK_N, BLOCK_K/2] and scales [BLOCK_N, BLOCK_K/32]:
    (e4m3 tile [BLOCK_N, BLOCK_K], fp32 row scale [BLOCK_N]), same base x residual split."""
    si = scales.to(tl.int32)
    smax = tl.max(si, 1)
    fexp = tl.maximum(127 + 20 + si - smax[:, None], 1)
    f = (fexp << 23).to(tl.float32, bitcast=True)
    v = e2m1_value_2m14(e2m1_codes_nk(packed, BLOCK_N, BLOCK_K))
    w = tl.reshape(tl.reshape(v, (BLOCK_N, BLOCK_K // 32, 32)) * f[:, :, None], (BLOCK_N, BLOCK_K))
    col = e8m0_to_f32(smax) * 0.015625
    return cast(w, tl.float8e4nv, EMULATE), col


@triton.jit
def _bf16_bits_to_f32(w):
    """bf16 -> fp32 by bits: the interpreter's bf16 -> fp32 conversion flushes subnormals."""
    return (w.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, n_rows, k, E4M3: tl.constexpr, NK: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, EMULATE: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    kh = tl.arange(0, BLOCK_K // 2)
    kg = tl.arange(0, BLOCK_K // 32)
    kk = k0 + tl.arange(0, BLOCK_K)
    n64 = n.to(tl.int64)
    n_ok = n < n_rows
    if NK:  # the swap GEMMs' tiles [BLOCK_N, BLOCK_K]
        wb = tl.load(w_ptr + n64[:, None] * (k // 2) + k0 // 2 + kh[None, :],
                     mask=n_ok[:, None] & ((k0 // 2 + kh) < k // 2)[None, :], other=0)
        sb = tl.load(s_ptr + n64[:, None] * (k // 32) + k0 // 32 + kg[None, :],
                     mask=n_ok[:, None] & ((k0 // 32 + kg) < k // 32)[None, :], other=0)
        if E4M3:
            q, col = tile_e4m3_nk(wb, sb, BLOCK_N, BLOCK_K, EMULATE)
            w = q.to(tl.float32) * col[:, None]
        else:
            w = _bf16_bits_to_f32(tile_bf16_nk(wb, sb, BLOCK_N, BLOCK_K, EMULATE))
        tl.store(out_ptr + n64[:, None] * k + kk[None, :], w, mask=n_ok[:, None] & (kk < k)[None, :])
    else:
        wb = tl.load(w_ptr + n64[None, :] * (k // 2) + k0 // 2 + kh[:, None],
                     mask=n_ok[None, :] & ((k0 // 2 + kh) < k // 2)[:, None], other=0)
        sb = tl.load(s_ptr + n64[None, :] * (k // 32) + k0 // 32 + kg[:, None],
                     mask=n_ok[None, :] & ((k0 // 32 + kg) < k // 32)[:, None], other=0)
        if E4M3:
            q, col = tile_e4m3(wb, sb, BLOCK_K, BLOCK_N, EMULATE)
            w = q.to(tl.float32) * col[None, :]
        else:
            w = _bf16_bits_to_f32(tile_bf16(wb, sb, BLOCK_K, BLOCK_N, EMULATE))
        tl.store(out_ptr + n64[None, :] * k + kk[:, None], w, mask=n_ok[None, :] & (kk < k)[:, None])


def dequantize(packed: torch.Tensor, scales: torch.Tensor, *, e4m3: bool, nk: bool = False, block_k: int = 128,
               block_n: int = 32) -> torch.Tensor:
    """fp32 [N, K] from packed [N, K/2] and e8m0 [N, K/32] through the kernels' tile decoders.

    e4m3=False: the a16w4 bf16 tile; e4m3=True: the a8w4 (e4m3 tile) * column scale. nk: the
    swap GEMMs' [BLOCK_N, BLOCK_K] decoders (`*_nk`) instead of the [BLOCK_K, BLOCK_N] ones.
    Tests compare it bit for bit with formats.dequantize_mxfp4.
    """
    n_rows, k = packed.shape[0], packed.shape[1] * 2
    if scales.shape != (n_rows, k // SCALE_BLOCK):
        raise ValueError(f"scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)}")
    out = torch.empty(n_rows, k, dtype=torch.float32, device=packed.device)
    grid = (triton.cdiv(n_rows, block_n), triton.cdiv(k, block_k))
    _dequant_kernel[grid](packed.contiguous(), scales.contiguous(), out, n_rows, k, E4M3=e4m3, NK=nk,
                          BLOCK_K=block_k, BLOCK_N=block_n, EMULATE=interpreting())
    return out
