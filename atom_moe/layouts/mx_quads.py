"""The a8w4 kernels' MXFP4 weight layout ("MX quads"): codes that become e4m3 mma fragments in registers.

Hopper's fp8 mma takes each thread's A fragment as k-quads (4 consecutive k per 32-bit
register), where the bf16 one takes k-pairs; so a8w4 has its own word order, next to
a16w4's MX tiles (atom_moe/layouts/mx_tiles.py). Built once at weight preparation, from plain
MXFP4 (e2m1 uint8 [..., N, K/2], LOW nibble = even k; e8m0 [..., N, K/32]):

- N is padded to 16 and K to 64, as in MX tiles; values: uint8 [..., N/16, K/64, 512], one
  16-row x 64-k block = 128 little-endian words, word (lane, j) at index lane * 4 + j,
  lane = g * 4 + q, j = 2s + h. Word (lane, j) holds row g + 8h, k32 slab s: the 4 codes at
  k = 32s + 4q + i (t = 0) and the 4 at k = 32s + 16 + 4q + i (t = 1), i < 4, exactly the two
  fp8 A-fragment registers of thread `lane` for that row and slab.
- Inside a word: code (t = 0, i) has its magnitude (e1 e0 m) at bits 4i..4i+2 and its sign
  at bit 8i+7; code (t = 1, i) its magnitude at bits 16+4i.. and its sign at bit 8i+3. So
  the kernel gets register t = 0 as `lookup(w & 0x7777) | (w & 0x80808080)` and t = 1 as
  `lookup((w >> 16) & 0x7777) | ((w << 4) & 0x80808080)`: one byte permute (PRMT) per 4 codes.
- The lookup table is the block's scale folded into e4m3: code magnitude c -> e4m3 bits of
  value(c) * 2^(s - base + 6), where base is the row's exponent (`rowexp`, below). With the
  residual byte d = s - base + 12 in [1, 12] the 8 table bytes are two integer multiply-adds
  of d, and every value is exact in e4m3. residuals: uint8 [..., N/16, K/64, 32], byte
  g * 4 + j = (s - base[row] + 12) mod 256 for lane word (g, j) (0 in padding).
- Paired residuals (`paired`, w13 only: GEMM1 steps K by 128): uint8 [..., N/16, ceil(K/128), 64],
  the bytes of two consecutive 16 x 64 blocks (t = 0, 1) side by side per lane, byte g * 8 + t * 4 + j
  for lane word (g, j) of block 2p + t (0 in padding, and in the missing second block where K/64 is
  odd). A 128-k step then loads a lane's 8 bytes with one 8-byte cp.async instead of two 4-byte ones:
  GEMM1 at 128-k steps 1.10-1.19x faster at T = 8-128 on an H200, while 64-k launches lost up to
  0.83x (docs/perf/a8w4-resid-pairs-h200.md), so w2 (GEMM2 steps by 64) keeps the plain order.
- rowexp: uint8 [..., N]: per row, the largest e8m0 byte over its blocks that hold a nonzero
  code (255 if any block's scale is the e8m0 NaN byte; 127 for a row of zeros). The kernels
  multiply each output row by 2^(base - 133) after the K loop.

A block with a nonzero code and s < base - 11 (its scale more than 2^11 below its row's
largest) does not fit the e4m3 range: a8w4 flushes it to zero, and the torch twin does the
same (`flush`). `tile` counts those blocks; weight preparation warns when any exist and
switches the kernels' flush path on. The layout itself is lossless: `untile` gives back the
original bytes, flushed blocks included.
"""

from __future__ import annotations

import torch

from . import mx_tiles
from .mx_tiles import BLOCK_BYTES, SCALE_BYTES, _codes, bytes_word, packed_bytes, padded, padded_codes, word_bytes

RESIDUAL_BIAS = 12  # d = s - base + 12; d in [1, 12] decodes exactly
E8M0_NAN = 255
PAIR_BYTES = 2 * SCALE_BYTES  # paired residuals: one byte per (lane word, block) of two blocks


def tiled_shapes(n: int, k: int, paired: bool = False) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Per-expert shapes of (values, residuals) for an [n, k] weight, residuals paired or not."""
    want_v, want_s = mx_tiles.tiled_shapes(n, k)
    return want_v, ((want_v[0], -(-want_v[1] // 2), PAIR_BYTES) if paired else want_s)


def _nonzero_blocks(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bool [..., N, K/32]: blocks holding a code of nonzero magnitude."""
    return (_codes(packed) & 7).reshape(*scales.shape, 32).amax(-1) > 0


def _row_exponents(scales: torch.Tensor, nonzero: torch.Tensor) -> torch.Tensor:
    s = scales.to(torch.int32)
    base = torch.where(nonzero, s, -1).amax(-1)
    base = torch.where(base < 0, 127, base)
    return torch.where((s == E8M0_NAN).any(-1), E8M0_NAN, base)


def _flushed(scales: torch.Tensor, nonzero: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    low = scales.to(torch.int32) < (base - (RESIDUAL_BIAS - 1)).unsqueeze(-1)
    return nonzero & low & (base != E8M0_NAN).unsqueeze(-1)


def row_exponents(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N]: each row's base exponent (module docstring)."""
    return _row_exponents(scales, _nonzero_blocks(packed, scales)).to(torch.uint8)


def flushed_blocks(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """bool [..., N, K/32]: the blocks a8w4 flushes to zero (a nonzero code, s < base - 11)."""
    nonzero = _nonzero_blocks(packed, scales)
    return _flushed(scales, nonzero, _row_exponents(scales, nonzero))


def flush(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed with the codes of the blocks a8w4 flushes set to +-0 (the twin's weights; signs kept, as
    the kernels' decode keeps them)."""
    drop = flushed_blocks(packed, scales)
    if not bool(drop.any()):
        return packed
    keep = torch.where(drop, 0x88, 0xFF).to(torch.uint8).repeat_interleave(16, dim=-1)
    return packed & keep


def tile(packed: torch.Tensor, scales: torch.Tensor, paired: bool = False
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Plain MXFP4 -> MX quads (values, residuals, paired or not, rowexp, number of flushed blocks)."""
    codes, n, k = padded_codes(packed, scales, "MX quads")
    lead = codes.shape[:-2]
    n_pad, k_pad = codes.shape[-2:]
    nd = len(lead)
    # [.., nb, h, g, kb, s, t, q, i] -> [.., nb, kb, g, q, s, h, t, i]
    c = codes.reshape(*lead, n_pad // 16, 2, 8, k_pad // 64, 2, 2, 4, 4)
    c = c.permute(*range(nd), nd, nd + 3, nd + 2, nd + 6, nd + 4, nd + 1, nd + 5, nd + 7)
    c = c.reshape(*lead, n_pad // 16, k_pad // 64, 128, 2, 4)  # word (lane, j), then t, i
    shift = 4 * torch.arange(4, device=packed.device)
    mag, sign = c & 7, c >> 3
    word = ((mag[..., 0, :] << shift) | (sign[..., 0, :] << (2 * shift + 7))
            | (mag[..., 1, :] << (shift + 16)) | (sign[..., 1, :] << (2 * shift + 3))).sum(-1)
    values = word_bytes(word).reshape(*lead, n_pad // 16, k_pad // 64, BLOCK_BYTES)

    nonzero = _nonzero_blocks(packed, scales)
    base = _row_exponents(scales, nonzero)
    rshape = tiled_shapes(n, k, paired)[1]
    d = torch.zeros(*lead, n_pad, rshape[1] * rshape[2] // 16, dtype=torch.int32, device=packed.device)
    d[..., :n, : k // 32] = (scales.to(torch.int32) - base.unsqueeze(-1) + RESIDUAL_BIAS) % 256
    if paired:
        d = d.reshape(*lead, n_pad // 16, 2, 8, rshape[1], 2, 2)  # nb h g p t s
        d = d.permute(*range(nd), nd, nd + 3, nd + 2, nd + 4, nd + 5, nd + 1)  # nb p g t s h: byte g*8 + t*4 + 2s + h
    else:
        d = d.reshape(*lead, n_pad // 16, 2, 8, k_pad // 64, 2)  # nb h g kb s
        d = d.permute(*range(nd), nd, nd + 3, nd + 2, nd + 4, nd + 1)  # nb kb g s h: byte g*4 + 2s + h
    residuals = d.reshape(*lead, *rshape).to(torch.uint8)
    flushed = int(_flushed(scales, nonzero, base).sum())
    return values.contiguous(), residuals.contiguous(), base.to(torch.uint8), flushed


def untile(values: torch.Tensor, residuals: torch.Tensor, rowexp: torch.Tensor, n: int, k: int, paired: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """MX quads -> plain (e2m1 uint8 [..., n, k/2], e8m0 uint8 [..., n, k/32]); the inverse of `tile`."""
    for name, t in (("values", values), ("residuals", residuals), ("rowexp", rowexp)):
        if t.dtype != torch.uint8:
            raise ValueError(f"MX quads {name} must be uint8, got {t.dtype}")
    want_v, want_s = tiled_shapes(n, k, paired)
    lead = values.shape[:-3]
    if (tuple(values.shape[-3:]) != want_v or tuple(residuals.shape) != (*lead, *want_s)
            or tuple(rowexp.shape) != (*lead, n)):
        raise ValueError(f"MX quads {tuple(values.shape)} / {'paired ' if paired else ''}residuals "
                         f"{tuple(residuals.shape)} / rowexp {tuple(rowexp.shape)} do not fit an [{n}, {k}] weight: "
                         f"expected [..., "
                         f"{', '.join(map(str, want_v))}] / [..., {', '.join(map(str, want_s))}] / [..., {n}]")
    nd = len(lead)
    n_pad, k_pad = padded(n, k)
    word = bytes_word(values.reshape(*lead, n_pad // 16, k_pad // 64, 128, 4)).unsqueeze(-1)
    shift = 4 * torch.arange(4, device=values.device)
    c0 = ((word >> shift) & 7) | (((word >> (2 * shift + 7)) & 1) << 3)
    c1 = ((word >> (shift + 16)) & 7) | (((word >> (2 * shift + 3)) & 1) << 3)
    c = torch.stack((c0, c1), dim=-2)  # lane j | t i
    c = c.reshape(*lead, n_pad // 16, k_pad // 64, 8, 4, 2, 2, 2, 4)  # nb kb g q s h t i
    c = c.permute(*range(nd), nd, nd + 5, nd + 2, nd + 1, nd + 4, nd + 6, nd + 3, nd + 7)  # nb h g kb s t q i
    packed = packed_bytes(c.reshape(*lead, n_pad, k_pad), n, k)
    if paired:
        d = residuals.reshape(*lead, n_pad // 16, want_s[1], 8, 2, 2, 2)  # nb p g t s h
        d = d.permute(*range(nd), nd, nd + 5, nd + 2, nd + 1, nd + 3, nd + 4).reshape(*lead, n_pad, want_s[1] * 4)
    else:
        d = residuals.reshape(*lead, n_pad // 16, k_pad // 64, 8, 2, 2)  # nb kb g s h
        d = d.permute(*range(nd), nd, nd + 4, nd + 2, nd + 1, nd + 3).reshape(*lead, n_pad, k_pad // 32)
    d = d[..., :n, : k // 32].to(torch.int32)
    scales = (d + rowexp.to(torch.int32).unsqueeze(-1) - RESIDUAL_BIAS) % 256
    return packed, scales.to(torch.uint8).contiguous()
