"""Number formats: e2m1 (FP4), e8m0 scales, MXFP4, fp8 e4m3 (tensor/token/group/block), MXFP8.

Conventions (docs/formats.md has the tables):
- e2m1 codes are 4 bits, sign in bit 3; two codes per byte, LOW nibble first (element 2i
  in bits 0-3, element 2i+1 in bits 4-7): the OCP / gpt-oss convention.
- e8m0 byte e means 2**(e - 127); 0xFF is NaN.
- MX scale rule (pinned): the scale of a 32-block is the smallest power of two X with
  amax <= max_elem * X (max_elem 6 for e2m1, 448 for e4m3), clamped to [2^-127, 2^127].
  This never clips a finite block (the OCP example rule floor(log2 amax) - emax can clip
  values up to 25%). Elements are x / X rounded to nearest, ties to even, saturated.
- fp8 scales are fp32 "dequant multipliers": x ~= q * scale, scale = amax / 448.
- All-zero groups get scale 1.0 (fp8) or 2^0 (MX).
- Non-finite input: a group holding NaN or +-Inf gets a NaN scale (fp32 NaN, or e8m0
  0xFF), so the whole group dequantizes to NaN. Finite groups are unaffected.
"""

from __future__ import annotations

import torch

E2M1_MAX = 6.0
E4M3_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn
E8M0_BIAS = 127
E8M0_NAN = 0xFF

# e2m1 code -> value, codes 0..15 (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Rounding thresholds on |x| for codes 1..7, round-to-nearest-even: a tie goes to the
# code whose mantissa bit is 0 (0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0,
# 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0). (threshold, inclusive)
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


class FormatError(ValueError):
    """A tensor that does not fit the requested number format."""


def _check_last_dim(x: torch.Tensor, multiple: int, what: str) -> None:
    if x.shape[-1] % multiple:
        raise FormatError(f"{what}: last dim {x.shape[-1]} must be a multiple of {multiple}")


# ---------------------------------------------------------------- e2m1 / e8m0
def e2m1_encode(y: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to e2m1 codes (uint8 0..15), RNE, saturating at +-6."""
    a = y.float().abs()
    code = torch.zeros(y.shape, dtype=torch.uint8, device=y.device)
    for threshold, inclusive in _E2M1_STEPS:
        code += (a >= threshold if inclusive else a > threshold).to(torch.uint8)
    return code | (torch.signbit(y.float()).to(torch.uint8) << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8 0..15) -> fp32 values."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, low nibble first."""
    _check_last_dim(codes, 2, "pack_e2m1")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes, low nibble first."""
    if packed.dtype != torch.uint8:
        raise FormatError(f"packed e2m1 must be uint8, got {packed.dtype}")
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack((lo, hi), dim=-1).flatten(-2)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes -> fp32 2**(e-127); 0xFF -> NaN."""
    if scales.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        raise FormatError(f"e8m0 scales must be uint8, got {scales.dtype}")
    e = scales.view(torch.uint8).to(torch.int32)
    value = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - E8M0_BIAS)
    return torch.where(e == E8M0_NAN, torch.full_like(value, float("nan")), value)


def _mx_scale_exponent(amax: torch.Tensor, max_elem: float) -> torch.Tensor:
    """Smallest e with amax <= max_elem * 2**e, exactly (no log/division rounding)."""
    m_max, p_max = torch.frexp(torch.tensor(max_elem, dtype=torch.float32))
    m, p = torch.frexp(amax)
    e = p - p_max.to(p.dtype) + (m > m_max).to(p.dtype)
    return torch.where(amax == 0, torch.zeros_like(e), e).clamp(-E8M0_BIAS, E8M0_BIAS)


def _mx_blocks(x: torch.Tensor, max_elem: float, what: str):
    """Split [..., K] into 32-blocks; return (blocks fp32, exponent int32, bad-mask)."""
    _check_last_dim(x, 32, what)
    xb = x.float().reshape(*x.shape[:-1], x.shape[-1] // 32, 32)
    bad = ~torch.isfinite(xb).all(dim=-1)
    amax = torch.where(bad, torch.zeros(1, device=x.device), xb.abs().amax(dim=-1))
    return xb, _mx_scale_exponent(amax, max_elem), bad


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (packed e2m1 uint8 [..., K/2], e8m0 scales uint8 [..., K/32])."""
    xb, e, bad = _mx_blocks(x, E2M1_MAX, "quantize_mxfp4")
    y = torch.ldexp(xb, -e.unsqueeze(-1))
    codes = e2m1_encode(torch.where(bad.unsqueeze(-1), torch.zeros_like(y), y))
    scales = torch.where(bad, torch.full_like(e, E8M0_NAN), e + E8M0_BIAS).to(torch.uint8)
    return pack_e2m1(codes.flatten(-2)), scales


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed [..., K/2], scales [..., K/32]) -> [..., K] in dtype."""
    values = e2m1_decode(unpack_e2m1(packed))
    k = values.shape[-1]
    if scales.shape[-1] * 32 != k or scales.shape[:-1] != packed.shape[:-1]:
        raise FormatError(f"mxfp4 scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)} (one per 32)")
    blocks = values.reshape(*values.shape[:-1], k // 32, 32) * e8m0_to_float(scales).unsqueeze(-1)
    return blocks.flatten(-2).to(dtype)


def quantize_mxfp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] float -> (e4m3 [..., K], e8m0 scales uint8 [..., K/32]): MXFP8 activations."""
    xb, e, bad = _mx_blocks(x, E4M3_MAX, "quantize_mxfp8")
    y = torch.ldexp(xb, -e.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX)
    y = torch.where(bad.unsqueeze(-1), torch.full_like(y, float("nan")), y)
    scales = torch.where(bad, torch.full_like(e, E8M0_NAN), e + E8M0_BIAS).to(torch.uint8)
    return y.to(FP8_DTYPE).flatten(-2), scales


def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(e4m3 [..., K], e8m0 [..., K/32]) -> [..., K]."""
    qb = q.float().reshape(*q.shape[:-1], q.shape[-1] // 32, 32)
    return (qb * e8m0_to_float(scales).unsqueeze(-1)).flatten(-2).to(dtype)


# ---------------------------------------------------------------- fp8 e4m3
def _fp8_from_groups(xg: torch.Tensor, reduce_dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize groups along reduce_dims; return (e4m3, fp32 scale with reduce_dims kept)."""
    xg = xg.float()
    bad = ~torch.isfinite(xg).all(dim=reduce_dims, keepdim=True) if reduce_dims else ~torch.isfinite(xg)
    amax = xg.abs().amax(dim=reduce_dims, keepdim=True) if reduce_dims else xg.abs()
    # clamp_min: amax / 448 of a tiny finite group must not underflow to 0 (-> NaN) or a subnormal
    scale = torch.where(amax > 0, (amax / E4M3_MAX).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    q = (xg / scale).clamp(-E4M3_MAX, E4M3_MAX)
    q = torch.where(bad, torch.full_like(q, float("nan")), q)
    return q.to(FP8_DTYPE), scale


def quantize_fp8_per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (e4m3 like x, fp32 scalar scale)."""
    q, s = _fp8_from_groups(x.reshape(1, -1), (1,))
    return q.reshape(x.shape), s.reshape(())


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (e4m3 [..., K], fp32 scales [..., 1]): one scale per row."""
    return _fp8_from_groups(x, (-1,))


def quantize_fp8_per_token_grouped(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (e4m3 [..., K], fp32 scales [..., ceil(K/group)]): one scale per row, stored once per group, so
    the result reads like quantize_fp8_per_group's (a8w4's GEMM1 input, Scheme.x_per_token)."""
    q, s = quantize_fp8_per_token(x)
    return q, s.expand(*s.shape[:-1], -(-x.shape[-1] // group)).contiguous()


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def quantize_fp8_per_group(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] -> (e4m3 [..., K], fp32 scales [..., ceil(K/group)]); a partial last group is fine."""
    k = x.shape[-1]
    xp = _pad_last(x.float(), group)
    q, s = _fp8_from_groups(xp.reshape(*x.shape[:-1], xp.shape[-1] // group, group), (-1,))
    return q.flatten(-2)[..., :k], s.squeeze(-1)


def dequantize_fp8_per_group(q: torch.Tensor, scales: torch.Tensor, group: int = 128,
                             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_fp8_per_group."""
    k = q.shape[-1]
    expanded = scales.float().repeat_interleave(group, dim=-1)[..., :k]
    return (q.float() * expanded).to(dtype)


def quantize_fp8_block(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (e4m3 [..., N, K], fp32 [..., ceil(N/b), ceil(K/b)]); partial blocks are fine."""
    n, k = w.shape[-2:]
    wp = _pad_last(_pad_last(w.float(), block).transpose(-1, -2), block).transpose(-1, -2)
    nb, kb = wp.shape[-2] // block, wp.shape[-1] // block
    blocks = wp.reshape(*w.shape[:-2], nb, block, kb, block)
    q, s = _fp8_from_groups(blocks, (-3, -1))
    q = q.reshape(*w.shape[:-2], nb * block, kb * block)[..., :n, :k]
    return q, s.squeeze(-1).squeeze(-2)


def dequantize_fp8_block(q: torch.Tensor, scales: torch.Tensor, block: int = 128,
                         dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of quantize_fp8_block."""
    n, k = q.shape[-2:]
    expected = (-(-n // block), -(-k // block))
    if tuple(scales.shape[-2:]) != expected:
        raise FormatError(f"fp8 block scales {tuple(scales.shape)} do not match weight {tuple(q.shape)}: "
                          f"expected [..., {expected[0]}, {expected[1]}] for {block}x{block} blocks")
    s = scales.float().repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]
    return (q.float() * s).to(dtype)
