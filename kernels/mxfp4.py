"""MXFP4 weight tiles decoded in registers, from the MX tile layout (atom_moe/mx_tiles.py).

The GEMMs read MX tiles as int32 words: a [BLOCK_N, BLOCK_K] weight tile is NB x KB blocks of
16 rows x 64 k (NB = BLOCK_N / 16, KB = BLOCK_K / 64), 128 words each, plus one scale word per
row pair (g, g + 8) of a block. Every thread loads its 16 contiguous bytes per block, already
in the order a Hopper mma A fragment wants, so the load needs no shared-memory shuffle.

Decode (`tile_bf16`): each word gives 4 bf16x2 registers with shifts and masks only (value *
2^-126, code 1 = 0.5 on a bf16 subnormal), then one bf16x2 multiply by 2^(s-1) applies the
e8m0 scale, exactly: e2m1 has 2 significant bits. Scales above 128 (2^(s-1) would overflow
bf16) take a second multiply; `BIG` (set from the weights' largest scale at preparation)
switches that in, so real checkpoints pay one multiply. An e8m0 0xFF gives NaN, as in the
reference. Against the plain-row layout (`scripts/kernel_sass.py`, sm_90a): 4.3-4.9 SASS
instructions per weight in the GEMMs' K loop instead of 12.6; on an H200 the gpt-oss layer
got 1.9-3.1x faster at T <= 512 (docs/perf/mxfp4-h200.md).

a8w4 uses the same bf16 tiles (bf16 dots, kernels/gemm1.py says why): Hopper's fp8 mma wants
each thread's A fragment as k-quads, the bf16 one as k-pairs, so fp8 dots from this layout
would need a shared-memory restage per tile; measured at 0.07-0.08 of the fp8 floor before
this layout, against 0.13-0.16 for bf16 dots after it (docs/perf/mxfp4-h200.md).

Under TRITON_INTERPRET=1 the decode works in fp32 holding the same bf16 bit patterns (the
interpreter flushes bf16 subnormals) and rounds with `cast`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from atom_moe import mx_tiles

from .common import cast, dot, interpreting

MASK = tl.constexpr(mx_tiles.MASK)
OUT3_R8 = tl.constexpr(mx_tiles.OUT3_MASKS[-8])
OUT3_R3 = tl.constexpr(mx_tiles.OUT3_MASKS[-3])
OUT3_L2 = tl.constexpr(mx_tiles.OUT3_MASKS[2])


@triton.jit
def tile_offsets(expert64, pid_n, row_blocks, k_blocks, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(word offsets [NB, KB, 32, 4], scale-word offsets [NB, KB, 8], row-block ok [NB], kb [KB]) of
    the tile at column tile pid_n, K step 0; advance by KB * 128 and KB * 8 words per K step."""
    NB: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // 64
    nb = pid_n * NB + tl.arange(0, NB)
    kb = tl.arange(0, KB)
    blk = (expert64 * row_blocks + nb)[:, None] * k_blocks + kb[None, :]
    lane_j = tl.arange(0, 32)[:, None] * 4 + tl.arange(0, 4)[None, :]
    w_off = blk[:, :, None, None] * 128 + lane_j[None, None, :, :]
    s_off = blk[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    return w_off, s_off, nb < row_blocks, kb


@triton.jit
def load_tile(w_ptr, s_ptr, w_off, s_off, nb_ok, kb, k0, k_blocks):
    """The int32 value words and scale words of one K step (zeros past N or K)."""
    kb_ok = (k0 // 64 + kb) < k_blocks
    ok = nb_ok[:, None] & kb_ok[None, :]
    words = tl.load(w_ptr + w_off, mask=ok[:, :, None, None], other=0)
    swords = tl.load(s_ptr + s_off, mask=ok[:, :, None], other=0)
    return words, swords


@triton.jit
def _halves(o, INTERP: tl.constexpr):
    """uint32 bf16x2 -> [..., 2] (low, high) as bf16, or as fp32 with the same bits when interpreting."""
    if INTERP:
        pair = tl.join((o << 16).to(tl.float32, bitcast=True), (o & 0xFFFF0000).to(tl.float32, bitcast=True))
    else:
        pair = tl.join((o & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True),
                       (o >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))
    return pair


@triton.jit
def tile_scales(swords, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Scale words [NB, KB, 8] -> e8m0 as int32 [BLOCK_N, BLOCK_K / 32]."""
    NB: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // 64
    s = swords.to(tl.uint32, bitcast=True)
    # bytes (h, jg) = 2h + jg, little-endian -> [NB, KB, g, h, jg]
    sb = tl.join(tl.join(s & 255, (s >> 16) & 255), tl.join((s >> 8) & 255, s >> 24))
    return tl.reshape(tl.permute(sb, (0, 3, 2, 1, 4)), (BLOCK_N, BLOCK_K // 32)).to(tl.int32)


@triton.jit
def tile_bf16(words, swords, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BIG: tl.constexpr, INTERP: tl.constexpr):
    """Dequantized bf16 tile [BLOCK_N, BLOCK_K] (rows n, columns k), bit-exact."""
    NB: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // 64
    w = words.to(tl.uint32, bitcast=True)
    o0 = w & MASK
    o1 = (w << 3) & MASK
    o2 = (w << 6) & MASK
    o3 = ((w >> 8) & OUT3_R8) | ((w >> 3) & OUT3_R3) | ((w << 2) & OUT3_L2)
    v = _halves(tl.join(tl.join(o0, o2), tl.join(o1, o3)), INTERP)  # [NB, KB, lane, j, c, h, e]
    v = tl.reshape(v, (NB, KB, 8, 4, 4, 2, 2, 2))  # nb kb g q j c h e
    v = tl.reshape(tl.permute(v, (0, 6, 2, 1, 4, 5, 3, 7)), (BLOCK_N, BLOCK_K // 32, 32))  # nb h g | kb j c q e
    s = tile_scales(swords, BLOCK_N, BLOCK_K)
    if BIG:  # 2^(s-1) overflows bf16 above 128: 2^(s-128) * 2^127 there
        e = tl.where(s > 128, s - 1, s + 126)
    else:
        e = s + 126
    if INTERP:
        f = tl.where(s == 255, float("nan"), ((e.to(tl.uint32) << 23).to(tl.float32, bitcast=True)))
    else:
        f = tl.where(s == 255, 0x7FC0, e << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    out = v * f[:, :, None]
    if BIG:
        out = out * tl.where(s > 128, 1.7014118346046923e38, 1.0)[:, :, None]  # 2^127 where s > 128
    out = tl.reshape(out, (BLOCK_N, BLOCK_K))
    if INTERP:
        out = cast(out, tl.bfloat16, INTERP)
    else:
        out = out.to(tl.bfloat16)
    return out


@triton.jit
def swap_step(acc, a, a_s, w_ptr, s_ptr, w_off, s_off, nb_ok, kb, k0, k_blocks, BLOCK_N: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, BIG: tl.constexpr,
              INTERP: tl.constexpr):
    """acc^T [BLOCK_N, BLOCK_M] plus one K step of W @ a^T: a is [BLOCK_K, BLOCK_M] bf16, or (FP8)
    e4m3 with per-token scales a_s, exact in bf16, the scale applied to the step's product."""
    words, swords = load_tile(w_ptr, s_ptr, w_off, s_off, nb_ok, kb, k0, k_blocks)
    w = tile_bf16(words, swords, BLOCK_N, BLOCK_K, BIG, INTERP)
    if FP8:
        step = dot(w, a.to(tl.bfloat16), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERP)
        acc = acc + step * a_s[None, :]
    else:
        acc = dot(w, a, acc, INTERP)
    return acc


@triton.jit
def _dequant_kernel(w_ptr, s_ptr, out_ptr, n_rows, k, row_blocks, k_blocks, BIG: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr):
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    w_off, s_off, nb_ok, kb = tile_offsets(tl.program_id(2).to(tl.int64), pid_n, row_blocks, k_blocks, BLOCK_N, BLOCK_K)
    words, swords = load_tile(w_ptr, s_ptr, w_off + (k0 // 64) * 128, s_off + (k0 // 64) * 8, nb_ok, kb, k0, k_blocks)
    w = tile_bf16(words, swords, BLOCK_N, BLOCK_K, BIG, INTERP)
    if INTERP:  # bf16 -> fp32 by bits: the interpreter's conversion flushes subnormals
        full = (w.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        full = w.to(tl.float32)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = k0 + tl.arange(0, BLOCK_K)
    base = out_ptr + tl.program_id(2).to(tl.int64) * n_rows * k
    tl.store(base + n.to(tl.int64)[:, None] * k + kk[None, :], full, mask=(n < n_rows)[:, None] & (kk < k)[None, :])


def words(t: torch.Tensor) -> torch.Tensor:
    """An MX tile tensor (uint8, last dim a multiple of 4) as the int32 words the kernels read."""
    return t.view(torch.int32)


def launch_args(gemm: str, name: str, values: torch.Tensor, scales: torch.Tensor, n: int, k: int, block_n: int,
                block_k: int) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Check [E, ...] MX tiles of an [n, k] weight and the tile; (value words, scale words, row blocks, k blocks)."""
    if values.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{gemm}: MX tiles {name} and their scales must be uint8, got {values.dtype}, {scales.dtype}")
    want_v, want_s = mx_tiles.tiled_shapes(n, k)
    if tuple(values.shape[1:]) != want_v or tuple(scales.shape[1:]) != want_s:
        raise ValueError(f"{gemm}: MX tiles {name} {tuple(values.shape)} / scales {tuple(scales.shape)} do not fit "
                         f"an [{n}, {k}] weight: expected [E, {', '.join(map(str, want_v))}] / "
                         f"[E, {', '.join(map(str, want_s))}]")
    if block_n % mx_tiles.ROWS or block_k % mx_tiles.KS:
        raise ValueError(f"MXFP4 {gemm} needs block_n % 16 == 0 and block_k % 64 == 0 (whole MX tile blocks), "
                         f"got block_n={block_n}, block_k={block_k}")
    return words(values), words(scales), want_v[0], want_v[1]


def dequantize(values: torch.Tensor, scales: torch.Tensor, n: int, k: int, *, big: bool | None = None,
               block_n: int = 32, block_k: int = 128) -> torch.Tensor:
    """fp32 [..., n, k] from MX tiles through the kernels' decoder (tests: bit-exact vs the reference).

    big: the scales-above-128 path (default: on iff any scale byte is above 128).
    """
    want_v, want_s = mx_tiles.tiled_shapes(n, k)
    if tuple(values.shape[-3:]) != want_v or tuple(scales.shape[-3:]) != want_s:
        raise ValueError(f"MX tiles {tuple(values.shape)} / {tuple(scales.shape)} do not fit [{n}, {k}]")
    lead = values.shape[:-3]
    experts = int(torch.tensor(lead).prod()) if lead else 1
    if big is None:
        big = bool((scales > 128).any())
    out = torch.empty(*lead, n, k, dtype=torch.float32, device=values.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k), experts)
    _dequant_kernel[grid](words(values.contiguous()), words(scales.contiguous()), out, n, k, want_v[0], want_v[1],
                          BIG=big, BLOCK_N=block_n, BLOCK_K=block_k, INTERP=interpreting())
    return out
