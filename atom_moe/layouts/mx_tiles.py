"""The kernels' MXFP4 weight layout ("MX tiles"): rows packed so each thread loads its mma operand in one go.

Plain MXFP4 ([N, K/2] e2m1 bytes, LOW nibble = even k, plus e8m0 [N, K/32]) is what
checkpoints and engines hand us. The kernels stream a repacked copy, built once at weight
preparation (atom_moe.weights) and never converted back in the forward:

- N is padded to a multiple of 16 and K to a multiple of 64 (zero codes, scale byte 0).
- values: uint8 [..., N/16, K/64, 512]. Each 16-row x 64-k block is 128 little-endian 32-bit
  words, word (lane, j) at index lane * 4 + j, lane = g * 4 + q (g < 8, q < 4), j < 4. A word
  holds the 8 codes a Hopper mma A-fragment gives thread `lane` for the k16 slab j:
  row g + 8h and k = 16j + 8c + 2q + e for h, c, e in {0, 1}. One 16-byte load per thread
  per block, no shuffles.
- Inside a word the 8 code bits are placed so that 4 bf16x2 registers come out with shifts,
  one rotate and masks only (9 integer ops per 8 codes): output o = 2c + h holds (e = 0, e = 1)
  in its (low, high) half, each as bf16 bits `sign << 15 | em << 6`, i.e. e2m1 value * 2^-126
  (code 1 = 0.5 lands on a bf16 subnormal). PIECES lists, per output, (left rotation, target
  mask) pairs: output o is the OR of `rotl(w, r) & mask` over its pieces. Outputs 0-2 take one
  piece each (w, w << 6, rotl(w, 12)); output 3 two (w << 2 and w >> 6). No choice of plain
  shifts covers the fourth output with fewer than three pieces (11 ops); a rotation lets two do.
- scales: uint8 [..., N/16, K/64, 32], byte index g * 4 + 2h + jg (jg = k32 group in the block),
  read as one 32-bit word per row pair (g, g + 8).

`tile` and `untile` are exact inverses on the unpadded part; tests check every bit.
"""

from __future__ import annotations

import torch

ROWS = 16  # rows per tile block
KS = 64  # k per tile block
BLOCK_BYTES = ROWS * KS // 2
SCALE_BYTES = ROWS * KS // 32

MASK = 0x81C081C0  # bf16x2: sign bits 15/31, e1 e0 m at bits 8..6 and 24..22
OUT3_SHL = 0x80C080C0  # output 3's bits taken from w << 2: sign and e0 m of both halves
OUT3_SHR = MASK & ~OUT3_SHL  # and from w >> 6 (left rotation 26): e1 of both halves
# per output o: ((left rotation, target mask), ...); the kernel (kernels/mxfp4.py tile_bf16) does these
PIECES = (((0, MASK),), ((6, MASK),), ((12, MASK),), ((2, OUT3_SHL), (26, OUT3_SHR)))
# target bit -> (half e, code bit): em at 8..6 = code bits 2..0, sign 15 = code bit 3
_TARGET = {6: (0, 0), 7: (0, 1), 8: (0, 2), 15: (0, 3), 22: (1, 0), 23: (1, 1), 24: (1, 2), 31: (1, 3)}


def _word_plan() -> list[tuple[int, int, int, int]]:
    """(output o, half e, code bit, word bit) for all 32 bits of a word."""
    plan = []
    for o, pieces in enumerate(PIECES):
        for rot, mask in pieces:
            for target, (e, bit) in _TARGET.items():
                if mask >> target & 1:
                    plan.append((o, e, bit, (target - rot) % 32))
    assert sorted(p for *_, p in plan) == list(range(32))
    return plan


_PLAN = _word_plan()


def padded(n: int, k: int) -> tuple[int, int]:
    """(N, K) rounded up to the tile block (16, 64)."""
    return -(-n // ROWS) * ROWS, -(-k // KS) * KS


def tiled_shapes(n: int, k: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """Per-expert shapes of (values, scales) for an [n, k] weight."""
    n_pad, k_pad = padded(n, k)
    return (n_pad // ROWS, k_pad // KS, BLOCK_BYTES), (n_pad // ROWS, k_pad // KS, SCALE_BYTES)


def _codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def padded_codes(packed: torch.Tensor, scales: torch.Tensor, layout: str) -> tuple[torch.Tensor, int, int]:
    """Check plain MXFP4 and return (codes int64 [..., N padded, K padded], n, k)."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{layout} take uint8 e2m1 bytes and uint8 e8m0 scales, got {packed.dtype}, {scales.dtype}")
    *lead, n, kh = packed.shape
    k = 2 * kh
    if k % 32 or tuple(scales.shape) != (*lead, n, k // 32):
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not match packed {tuple(packed.shape)} "
                         f"(one e8m0 per 32 codes along K, K a multiple of 32)")
    n_pad, k_pad = padded(n, k)
    codes = torch.zeros(*lead, n_pad, k_pad, dtype=torch.int64, device=packed.device)
    codes[..., :n, :k] = _codes(packed).to(torch.int64)
    return codes, n, k


def packed_bytes(codes: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Padded codes [..., N padded, K padded] -> plain e2m1 bytes uint8 [..., n, k/2] (the inverse of padded_codes)."""
    c = codes[..., :n, :k].to(torch.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).contiguous()


def word_bytes(word: torch.Tensor) -> torch.Tensor:
    """int64 32-bit words [...] -> uint8 [..., 4], little-endian."""
    return torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], dim=-1).to(torch.uint8)


def bytes_word(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4] little-endian -> int64 32-bit words [...]."""
    b = b.to(torch.int64)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def tile(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain (e2m1 uint8 [..., N, K/2], e8m0 uint8 [..., N, K/32]) -> MX tiles (values, scales)."""
    codes, n, k = padded_codes(packed, scales, "MX tiles")
    lead = codes.shape[:-2]
    n_pad, k_pad = codes.shape[-2:]
    # [.., nb, h, g, kb, j, c, q, e] -> [.., nb, kb, g, q, j, c, h, e]
    c = codes.reshape(*lead, n_pad // 16, 2, 8, k_pad // 64, 4, 2, 4, 2)
    nd = len(lead)
    c = c.permute(*range(nd), nd, nd + 3, nd + 2, nd + 6, nd + 4, nd + 5, nd + 1, nd + 7)
    c = c.reshape(*lead, n_pad // 16, k_pad // 64, 128, 4, 2)  # o = 2c + h
    word = torch.zeros(c.shape[:-2], dtype=torch.int64, device=packed.device)
    for o, e, bit, pos in _PLAN:
        word |= ((c[..., o, e] >> bit) & 1).to(torch.int64) << pos
    values = word_bytes(word).reshape(*lead, n_pad // 16, k_pad // 64, BLOCK_BYTES)

    s = torch.zeros(*lead, n_pad, k_pad // 32, dtype=torch.uint8, device=packed.device)
    s[..., :n, : k // 32] = scales
    s = s.reshape(*lead, n_pad // 16, 2, 8, k_pad // 64, 2)  # nb h g kb jg
    s = s.permute(*range(nd), nd, nd + 3, nd + 2, nd + 1, nd + 4)  # nb kb g h jg
    return values.contiguous(), s.reshape(*lead, n_pad // 16, k_pad // 64, SCALE_BYTES).contiguous()


def untile(values: torch.Tensor, scales: torch.Tensor, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """MX tiles -> plain (e2m1 uint8 [..., n, k/2], e8m0 uint8 [..., n, k/32]); the inverse of `tile`."""
    if values.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MX tiles are uint8 values and uint8 scales, got {values.dtype}, {scales.dtype}")
    want_v, want_s = tiled_shapes(n, k)
    if tuple(values.shape[-3:]) != want_v or tuple(scales.shape[-3:]) != want_s:
        raise ValueError(f"MX tiles {tuple(values.shape)} / {tuple(scales.shape)} do not fit an [{n}, {k}] "
                         f"weight: expected [..., {', '.join(map(str, want_v))}] / [..., {', '.join(map(str, want_s))}]")
    lead = values.shape[:-3]
    nd = len(lead)
    n_pad, k_pad = padded(n, k)
    word = bytes_word(values.reshape(*lead, n_pad // 16, k_pad // 64, 128, 4))
    c = torch.zeros(*word.shape, 4, 2, dtype=torch.int64, device=values.device)
    for o, e, bit, pos in _PLAN:
        c[..., o, e] |= ((word >> pos) & 1) << bit
    c = c.reshape(*lead, n_pad // 16, k_pad // 64, 8, 4, 4, 2, 2, 2)  # nb kb g q j c h e
    c = c.permute(*range(nd), nd, nd + 6, nd + 2, nd + 1, nd + 4, nd + 5, nd + 3, nd + 7)  # nb h g kb j c q e
    packed = packed_bytes(c.reshape(*lead, n_pad, k_pad), n, k)
    s = scales.reshape(*lead, n_pad // 16, k_pad // 64, 8, 2, 2)  # nb kb g h jg
    s = s.permute(*range(nd), nd, nd + 3, nd + 2, nd + 1, nd + 4).reshape(*lead, n_pad, k_pad // 32)
    return packed, s[..., :n, : k // 32].contiguous()
