"""MXFP4 weight tiles decoded in registers: MX tiles (atom_moe/layouts/mx_tiles.py) and, for a8w4, MX quads.

The GEMMs read MX tiles as int32 words: a [BLOCK_N, BLOCK_K] weight tile is NB x KB blocks of
16 rows x 64 k (NB = BLOCK_N / 16, KB = BLOCK_K / 64), 128 words each, plus one scale word per
row pair (g, g + 8) of a block. Every thread loads its 16 contiguous bytes per block, already
in the order a Hopper mma A fragment wants, so the load needs no shared-memory shuffle.

Decode (`tile_bf16`): each word gives 4 bf16x2 registers with shifts, one rotate and masks only,
9 integer ops (mx_tiles.PIECES; value * 2^-126, code 1 = 0.5 on a bf16 subnormal), then one bf16x2 multiply by 2^(s-1) applies the
e8m0 scale, exactly: e2m1 has 2 significant bits. Scales above 128 (2^(s-1) would overflow
bf16) take a second multiply; `BIG` (set from the weights' largest scale at preparation)
switches that in, so real checkpoints pay one multiply. An e8m0 0xFF (above 128, so BIG) gives
NaN, as in the reference. Without BIG the scale bytes become bf16 factors two at a time (a PRMT
and a multiply-add per pair; `tile_scale_factors`): 6-11 % fewer K-loop instructions than a
per-byte extract and NaN select (sm_90a, `scripts/kernel_sass.py`, 2026-12-03). Against the
plain-row layout (`scripts/kernel_sass.py`, sm_90a): 4.3-4.9 SASS instructions per weight in the
GEMMs' K loop instead of 12.6; on an H200 the gpt-oss layer got 1.9-3.1x faster at T <= 512
(docs/perf/mxfp4-h200.md). On NVIDIA the bf16 halves of a word are split by one opaque PTX move
(`_halves`), which keeps LLVM from swapping halves around the scale multiply: 3.2-4.0 per weight
then, 5-9 % faster layers (docs/perf/a16w4-halves-h200.md). The rotate layout took the fourth output from
three shifted pieces to two: 3.3-3.4 per weight at the 64-k tiles, 3-7 % faster layers there
(docs/perf/a16w4-rotation-h200.md).

a8w4 streams its own layout, MX quads (atom_moe/layouts/mx_quads.py): each word holds one row's
codes for two e4m3 mma A-fragment registers (k-quads), and `tile_e4m3` turns it into them
with one byte permute (PRMT) per 4 codes, through an 8-byte table that folds the block's
scale into the e4m3 exponent (value * 2^(s - base + 6), exact). The dots are fp8; each K
step's product is scaled by the activation scale (per token group: 128 for GEMM1's input, 64
for GEMM2's, `Scheme.inter_group`) into the fp32
accumulator, and `row_factor` applies 2^(base - 133) per output row after the loop.
FLUSH (set at preparation when some block sits more than 2^11 below its row's largest
scale) zeroes those blocks' tables, as the torch twin does. Off NVIDIA GPUs and under the
interpreter the table lookup is shifts and masks instead of PRMT.

SCALED (`scaled_dot`: on by default on gfx950 from a 128-k step on, whose scaled MFMA multiplies
e2m1 by e4m3 with e8m0 block scales in hardware) swaps that decode for `tl.dot_scaled`: each MX quad word is
unpacked into the plain e2m1 bytes the op takes (`tile_e2m1`) and each residual byte becomes
the e8m0 scale 2^(d - 6) (`quad_scales`), the same value * 2^(s - base + 6) as the e4m3
table, so `row_factor` still finishes the row. Under the interpreter, which has no
`dot_scaled`, `dot_scaled_emulated` computes the same product in fp32.

Under TRITON_INTERPRET=1 the decode works in fp32 holding the same bf16 bit patterns (the
interpreter flushes bf16 subnormals) and rounds with `cast`.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from atom_moe.layouts import mx_quads, mx_tiles

from .common import cast, dot, interpreting

NVIDIA = torch.version.hip is None  # PRMT is PTX: NVIDIA only
MASK = tl.constexpr(mx_tiles.MASK)
PRMT_OK = tl.constexpr(NVIDIA)
OUT3_SHL = tl.constexpr(mx_tiles.OUT3_SHL)
OUT3_SHR = tl.constexpr(mx_tiles.OUT3_SHR)
# tile_bf16 writes out mx_tiles.PIECES: w, w << 6, rotl(w, 12), (w << 2 | w >> 6) under masks
assert mx_tiles.PIECES == (((0, mx_tiles.MASK),), ((6, mx_tiles.MASK),), ((12, mx_tiles.MASK),),
                           ((2, mx_tiles.OUT3_SHL), (26, mx_tiles.OUT3_SHR))), "kernels/mxfp4.py: MX tiles changed"


@triton.jit
def tile_offsets(expert64, pid_n, row_blocks, k_blocks, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 QUADS: tl.constexpr = False, SCALED: tl.constexpr = False, PAIRED: tl.constexpr = False):
    """(word offsets [NB, KB, 128], scale offsets, row-block ok [NB], kb [KB]) of the tile at column tile pid_n,
    K step 0; advance the words by KB * 128 and the scales by `scale_step(BLOCK_K, QUADS, PAIRED)` per K step.

    The words of one MX block (a row block's 64 k) are 128 consecutive int32s, so their offsets run along that
    block's last axis: the loads then coalesce with consecutive lanes on consecutive bytes, and `load_tile`
    reshapes them to [NB, KB, 32, 4]. Shaped [NB, KB, 32, 4], the offsets made Triton put consecutive lanes on
    different row blocks, 512 bytes apart: their cp.async writes to shared memory hit the same banks (Nsight
    Compute source counters, DeepSeek-V3, H100, 2026-12-07: a8w4 4-8 shared wavefronts per ideal one on the
    words, 15-16 on the residuals; a16w4 4 by the TTGIR's layouts). Reshaped, a8w4 ran 1.04-1.25x and a16w4
    1.02-1.14x faster (docs/perf/mxfp4-h200.md). a16w4's fully flat form took 2-9 % more K-loop instructions and
    up to 17 more registers (sm_90a, scripts/kernel_sass.py).
    MX quads' words ran flat [NB, KB * 128] at first, the shape of their residual offsets. Triton gives
    same-shaped loads that meet in the decode the widest vector any of them takes: beside the paired residuals'
    8 bytes a lane, the words went 32 bytes a lane in two 16-byte cp.async, each touching twice its ideal L2
    sectors and shared-memory wavefronts (Nsight Compute, a8w4 GEMM1, DeepSeek-V3, T = 1 and 128, H100,
    2026-12-07). In their own shape they take 16 bytes a lane, 512 contiguous bytes a warp. sm_90a K loops of
    the tables' a8w4 GEMM1 tiles: -11 to +4 instructions, -2 to +6 registers (not timed yet).

    Scale offsets: MX tiles, int32 words [NB, KB, 8] (one per row pair); MX quads (QUADS), the
    residual bytes each lane needs for its 4 words, flat [NB, KB * 128] (a per-lane load keeps the table math in
    the words' own layout, so the decoded tile needs no shared-memory restage);
    with SCALED, the residual bytes in plain order [BLOCK_N, BLOCK_K / 32] (row, 32-k block).
    PAIRED (MX quads with paired residuals, atom_moe/layouts/mx_quads.py): at k = 0, `load_tile`
    adds `pair_offset`; a 128-k step's are 8 bytes per lane, flat [NB, 256], a 64-k step's [NB, KB, 32, 4]."""
    NB: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // 64
    nb = pid_n * NB + tl.arange(0, NB)
    kb = tl.arange(0, KB)
    blk = (expert64 * row_blocks + nb)[:, None] * k_blocks + kb[None, :]
    lane_j = tl.arange(0, 32)[:, None] * 4 + tl.arange(0, 4)[None, :]
    w_off = blk[:, :, None] * 128 + tl.arange(0, 128)[None, None, :]
    if PAIRED:  # 64 bytes per row block and pair of K blocks: byte g * 8 + t * 4 + j
        first = (expert64 * row_blocks + nb) * ((k_blocks + 1) // 2) * 64  # [NB] each row block's first pair
    if QUADS and SCALED and PAIRED:  # row 16 nb + 8 h + g, block c = 2 kb + s: byte g*8 + t*4 + 2s + h of pair kb//2
        r = tl.arange(0, BLOCK_N)[:, None]
        c = tl.arange(0, BLOCK_K // 32)[None, :]
        s_off = ((expert64 * row_blocks + pid_n * NB + r // 16) * ((k_blocks + 1) // 2) + c // 4) * 64 \
            + (r % 8) * 8 + (c // 2 % 2) * 4 + (c % 2) * 2 + (r // 8) % 2
    elif QUADS and SCALED:  # byte g * 4 + 2 s + h of block (nb, kb)
        r = tl.arange(0, BLOCK_N)[:, None]
        c = tl.arange(0, BLOCK_K // 32)[None, :]
        s_off = ((expert64 * row_blocks + pid_n * NB + r // 16) * k_blocks + c // 2) * 32 \
            + (r % 8) * 4 + (c % 2) * 2 + (r // 8) % 2
    elif QUADS and PAIRED and KB == 2:  # lane l's 8 bytes 8 (l // 4) .. + 7 of the pair, flat ([NB, 256])
        f = tl.arange(0, 256)
        s_off = first[:, None] + (f // 32 * 8 + f % 8)[None, :]
    elif QUADS and PAIRED:
        s_off = first[:, None, None, None] + (kb // 2 * 64 + kb % 2 * 4)[None, :, None, None] \
            + (lane_j // 16 * 8 + lane_j % 4)[None, None, :, :]
    elif QUADS:  # lane l's 4 bytes 4 (l // 4) .. + 3 of each block, flat ([NB, KB * 128])
        f = tl.arange(0, KB * 128)
        s_off = ((expert64 * row_blocks + nb) * k_blocks * 32)[:, None] \
            + (f // 128 * 32 + f % 128 // 16 * 4 + f % 4)[None, :]
    else:
        s_off = blk[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
    return w_off, s_off, nb < row_blocks, kb


@triton.jit
def scale_step(BLOCK_K: tl.constexpr, QUADS: tl.constexpr, PAIRED: tl.constexpr = False):
    """How far the scale offsets advance per K step (int32 words, or residual bytes for QUADS); 0 for
    PAIRED, whose offsets `load_tile` moves from k0 (recomputed per step: a loop-carried increment lost the
    8-byte alignment the compiler must see, docs/perf/a8w4-resid-pairs-h200.md)."""
    if PAIRED:
        return 0
    elif QUADS:
        return (BLOCK_K // 64) * 32
    else:
        return (BLOCK_K // 64) * 8


@triton.jit
def pair_offset(k0, BLOCK_K: tl.constexpr):
    """Paired residual bytes of the K step at k0 past those of k = 0: 64 bytes per pair of K blocks, and a
    64-k step may start a pair's second half (4 bytes further)."""
    if BLOCK_K % 128 == 0:
        return (k0 // 128) * 64
    else:
        return (k0 // 128) * 64 + ((k0 >> 6) & 1) * 4


@triton.jit
def load_tile(w_ptr, s_ptr, w_off, s_off, nb_ok, kb, k0, k_blocks, PAIRED: tl.constexpr = False,
              QUADS: tl.constexpr = False, SCALED: tl.constexpr = False):
    """One K step's int32 value words [NB, KB, 32, 4] and its scale words [NB, KB, 8] (MX tiles) or residual bytes
    (MX quads: per lane [NB, KB, 32, 4], or in plain order for SCALED); zeros past N or K.

    The words come through offsets along each block's run (`tile_offsets`) and are reshaped here. MX quads'
    residual bytes are loaded per lane (four lanes read each): handed over by a broadcast from one load instead,
    they took a shared-memory restage (32 byte stores and loads per K step, sm_90a)."""
    if PAIRED:
        s_off += pair_offset(k0, 64 * kb.shape[0])
    kb_ok = (k0 // 64 + kb) < k_blocks
    ok = nb_ok[:, None] & kb_ok[None, :]
    NB: tl.constexpr = ok.shape[0]
    KB: tl.constexpr = ok.shape[1]
    words = tl.reshape(tl.load(w_ptr + w_off, mask=ok[:, :, None], other=0), (NB, KB, 32, 4))
    if QUADS:
        s_ok = nb_ok[:, None] & ((k0 // 64 + tl.arange(0, KB * 128) // 128) < k_blocks)[None, :]
    if QUADS and SCALED:  # [BLOCK_N, BLOCK_K / 32] in plain order
        ok = tl.reshape(tl.broadcast_to(ok[:, None, :, None], (NB, 16, KB, 2)), (NB * 16, KB * 2))
        swords = tl.load(s_ptr + s_off, mask=ok, other=0)
    elif QUADS and PAIRED and KB == 2:  # one 8-byte load per lane and row block, masked by row block and step
        # only (a mask that varies along the 8 bytes would split the load): a pair's missing second block is
        # zeros in memory, and its value words are masked
        step_ok = (tl.zeros([NB], tl.int32) + k0 // 64) < k_blocks
        sw = tl.reshape(tl.load(s_ptr + s_off, mask=(nb_ok & step_ok)[:, None], other=0), (NB, 32, 8))
        swords = tl.permute(tl.reshape(sw, (NB, 32, 2, 4)), (0, 2, 1, 3))
    elif QUADS and PAIRED:  # a 64-k step's half of a pair: per lane, [NB, KB, 32, 4]
        swords = tl.load(s_ptr + s_off, mask=ok[:, :, None, None], other=0)
    elif QUADS:  # [NB, KB * 128]: 4 bytes per lane and block
        swords = tl.reshape(tl.load(s_ptr + s_off, mask=s_ok, other=0), (NB, KB, 32, 4))
    else:  # MX tiles: [NB, KB, 8] scale words
        swords = tl.load(s_ptr + s_off, mask=ok[:, :, None], other=0)
    return words, swords


@triton.jit
def _halves(o, INTERP: tl.constexpr):
    """uint32 bf16x2 -> [..., 2] (low, high) as bf16, or as fp32 with the same bits when interpreting."""
    if INTERP:
        pair = tl.join((o << 16).to(tl.float32, bitcast=True), (o & 0xFFFF0000).to(tl.float32, bitcast=True))
    elif PRMT_OK:  # PTX: an opaque split. From a mask and a shift LLVM re-derives each half through the
        # decode's shifts (for the three-part fourth output too) and then repacks the bf16 pairs for the
        # scale multiply and the mma with a half-swap PRMT before and after: 10-12 % of the K loop on sm_90a
        lo, hi = tl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [o], dtype=(tl.uint16, tl.uint16),
                                           is_pure=True, pack=1)
        pair = tl.join(lo.to(tl.bfloat16, bitcast=True), hi.to(tl.bfloat16, bitcast=True))
    else:
        pair = tl.join((o & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True),
                       (o >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True))
    return pair


@triton.jit
def _rotl12(w, INTERP: tl.constexpr):
    """uint32 w rotated left by 12 bits."""
    if PRMT_OK and not INTERP:  # one funnel shift; spelled as two shifts and an OR, LLVM may split it around the mask
        r = tl.inline_asm_elementwise("shf.l.wrap.b32 $0, $1, $1, 12;", "=r,r", [w], dtype=tl.uint32, is_pure=True,
                                      pack=1)
    else:
        r = (w << 12) | (w >> 20)
    return r


@triton.jit
def tile_scales(swords, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Scale words [NB, KB, 8] -> e8m0 as int32 [BLOCK_N, BLOCK_K / 32]."""
    s = swords.to(tl.uint32, bitcast=True)
    # bytes (h, jg) = 2h + jg, little-endian -> [NB, KB, g, h, jg]
    sb = tl.join(tl.join(s & 255, (s >> 16) & 255), tl.join((s >> 8) & 255, s >> 24))
    return tl.reshape(tl.permute(sb, (0, 3, 2, 1, 4)), (BLOCK_N, BLOCK_K // 32)).to(tl.int32)


@triton.jit
def tile_scale_factors(swords, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERP: tl.constexpr):
    """Scale words [NB, KB, 8], every byte <= 128 -> 2^(s-1) as bf16 [BLOCK_N, BLOCK_K / 32] (fp32 holding the
    bf16 bits when interpreting): one byte permute puts two scale bytes in a register's halves, one
    multiply-add makes them bf16 exponents (s + 126) << 7."""
    w = swords.to(tl.uint32, bitcast=True)
    if PRMT_OK and not INTERP:  # selector 4: a byte of the zero operand
        lo = tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x4140;", "=r,r", [w], dtype=tl.uint32, is_pure=True,
                                       pack=1)
        hi = tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0x4342;", "=r,r", [w], dtype=tl.uint32, is_pure=True,
                                       pack=1)
    else:
        lo = (w & 0xFF) | ((w << 8) & 0xFF0000)
        hi = ((w >> 16) & 0xFF) | ((w >> 8) & 0xFF0000)
    # bytes 2h + jg: lo holds h = 0 (jg = 0 in its low half, 1 in its high half), hi holds h = 1
    f = _halves(tl.join(lo * 128 + 0x3F003F00, hi * 128 + 0x3F003F00), INTERP)  # [NB, KB, g, h, jg]
    return tl.reshape(tl.permute(f, (0, 3, 2, 1, 4)), (BLOCK_N, BLOCK_K // 32))


@triton.jit
def tile_bf16(words, swords, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BIG: tl.constexpr, INTERP: tl.constexpr):
    """Dequantized bf16 tile [BLOCK_N, BLOCK_K] (rows n, columns k), bit-exact."""
    NB: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // 64
    w = words.to(tl.uint32, bitcast=True)
    o0 = w & MASK
    o1 = (w << 6) & MASK
    o2 = _rotl12(w, INTERP) & MASK
    o3 = ((w << 2) & OUT3_SHL) | ((w >> 6) & OUT3_SHR)
    v = _halves(tl.join(tl.join(o0, o2), tl.join(o1, o3)), INTERP)  # [NB, KB, lane, j, c, h, e]
    v = tl.reshape(v, (NB, KB, 8, 4, 4, 2, 2, 2))  # nb kb g q j c h e
    v = tl.reshape(tl.permute(v, (0, 6, 2, 1, 4, 5, 3, 7)), (BLOCK_N, BLOCK_K // 32, 32))  # nb h g | kb j c q e
    if BIG:  # 2^(s-1) overflows bf16 above 128: 2^(s-128) * 2^127 there; an e8m0 0xFF is NaN
        s = tile_scales(swords, BLOCK_N, BLOCK_K)
        e = tl.where(s > 128, s - 1, s + 126)
        if INTERP:
            f = tl.where(s == 255, float("nan"), ((e.to(tl.uint32) << 23).to(tl.float32, bitcast=True)))
        else:
            f = tl.where(s == 255, 0x7FC0, e << 7).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:  # every scale <= 128, so none is 0xFF
        f = tile_scale_factors(swords, BLOCK_N, BLOCK_K, INTERP)
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
def _lookup(t_lo, t_hi, sel, PRMT: tl.constexpr):
    """Byte i = byte (sel >> 4i) & 7 of the 8-byte table (t_lo, t_hi), for the 4 selector nibbles of
    sel (bit 3 of each clear): one PRMT on NVIDIA GPUs, shifts and masks elsewhere."""
    if PRMT:
        out = tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [t_lo, t_hi, sel],
                                        dtype=tl.uint32, is_pure=True, pack=1)
    else:
        out = tl.zeros_like(sel)
        for i in tl.static_range(4):
            c = (sel >> (4 * i)) & 7
            t = tl.where(c < 4, t_lo, t_hi)
            out = out | (((t >> (8 * (c & 3))) & 0xFF) << (8 * i))
    return out


@triton.jit
def tile_e4m3(words, resid, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLUSH: tl.constexpr,
              PRMT: tl.constexpr):
    """MX quad words [NB, KB, 32, 4] + residual bytes [NB, KB, 32, 4] -> e4m3 tile [BLOCK_N, BLOCK_K]
    holding value * 2^(s - base + 6), exact (atom_moe/layouts/mx_quads.py)."""
    NB: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // 64
    w = words.to(tl.uint32, bitcast=True)
    d = resid.to(tl.uint32)
    # table bytes for magnitudes 0..7 = {0, 0.5, 1, 1.5, 2, 3, 4, 6} * 2^(d - 6) in e4m3
    t_lo = d * 0x08080800 + 0x0C080000
    t_hi = d * 0x08080808 + 0x1C181410
    if FLUSH:  # d outside [1, 12]: the block is flushed to zero
        keep = (d - 1) < 12
        t_lo = tl.where(keep, t_lo, 0)
        t_hi = tl.where(keep, t_hi, 0)
    reg0 = _lookup(t_lo, t_hi, w & 0x7777, PRMT) | (w & 0x80808080)
    reg1 = _lookup(t_lo, t_hi, (w >> 16) & 0x7777, PRMT) | ((w << 4) & 0x80808080)
    r = tl.join(reg0, reg1)  # nb kb lane j t
    b = tl.join(tl.join(r & 0xFF, (r >> 16) & 0xFF), tl.join((r >> 8) & 0xFF, r >> 24)).to(tl.uint8)
    b = tl.reshape(b, (NB, KB, 8, 4, 2, 2, 2, 4))  # nb kb g q s h t i
    b = tl.reshape(tl.permute(b, (0, 5, 2, 1, 4, 6, 3, 7)), (BLOCK_N, BLOCK_K))  # nb h g | kb s t q i
    return b.to(tl.float8e4nv, bitcast=True)


@triton.jit
def tile_e2m1(words, resid, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FLUSH: tl.constexpr):
    """MX quad words [NB, KB, 32, 4] -> the plain e2m1 codes tl.dot_scaled takes, uint8 [BLOCK_N, BLOCK_K / 2]
    (low nibble: even k); FLUSH zeroes (keeping signs) the blocks whose residual bytes resid
    [BLOCK_N, BLOCK_K / 32] lie outside [1, 12], as `tile_e4m3` does."""
    NB: tl.constexpr = BLOCK_N // 16
    KB: tl.constexpr = BLOCK_K // 64
    w = words.to(tl.uint32, bitcast=True)[:, :, :, :, None, None]
    t = tl.arange(0, 2)[:, None]
    i = tl.arange(0, 4)[None, :]
    # code (t, i) of a word: magnitude at bits 16t + 4i, sign at bit 8i + 7 - 4t (atom_moe/layouts/mx_quads.py)
    c = ((w >> (16 * t + 4 * i)) & 7) | (((w >> (8 * i + 7 - 4 * t)) & 1) << 3)  # nb kb lane j t i
    c = tl.reshape(c, (NB, KB, 8, 4, 2, 2, 2, 4))  # nb kb g q s h t i
    c = tl.reshape(tl.permute(c, (0, 5, 2, 1, 4, 6, 3, 7)), (BLOCK_N, BLOCK_K // 32, 32))  # nb h g | kb s | t q i
    if FLUSH:
        c = c & tl.where(((resid.to(tl.int32) - 1) & 0xFF) < 12, 15, 8)[:, :, None]
    lo, hi = tl.split(tl.reshape(c, (BLOCK_N, BLOCK_K // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def quad_scales(resid):
    """MX quads' residual bytes d -> the e8m0 scales 2^(d - 6) (uint8, same shape) that give tl.dot_scaled the
    e4m3 table's value * 2^(s - base + 6); 2^0 outside [1, 12] (padding, flushed or all-zero blocks), never the
    NaN byte."""
    d = resid.to(tl.int32)
    return tl.where(((d - 1) & 0xFF) < 12, d + 121, 127).to(tl.uint8)


@triton.jit
def dot_scaled_emulated(codes, scales, a, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """tl.dot_scaled(codes, scales, "e2m1", a, None, "e4m3") in fp32, for the interpreter (which has no
    dot_scaled): codes uint8 [BLOCK_N, BLOCK_K / 2], scales e8m0 [BLOCK_N, BLOCK_K / 32], a [BLOCK_K, M]."""
    c = tl.reshape(tl.join(codes & 15, codes >> 4), (BLOCK_N, BLOCK_K // 32, 32)).to(tl.int32)
    e, m = (c >> 1) & 3, (c & 1).to(tl.float32)
    mag = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    scale = (scales.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(x - 127); the scales are >= 1
    w = tl.reshape(tl.where(c >= 8, -mag, mag) * scale[:, :, None], (BLOCK_N, BLOCK_K))
    return tl.dot(w, a.to(tl.float32))


@triton.jit
def row_factor(rowexp_ptr, e64, n, n_ok, n_rows):
    """fp32 2^(base - 133) for rows n of expert e64 (NaN where base is the e8m0 NaN byte)."""
    base = tl.load(rowexp_ptr + e64 * n_rows + n, mask=n_ok, other=127).to(tl.int32)
    bits = tl.where(base >= 7, (base - 6) << 23, 1 << (base + 16))  # 2^(base-133): subnormal below 7
    f = bits.to(tl.float32, bitcast=True)
    return tl.where(base == 255, float("nan"), f)


@triton.jit
def swap_step(acc, a, a_s, w_ptr, s_ptr, w_off, s_off, nb_ok, kb, k0, k_blocks, BLOCK_N: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, BIG: tl.constexpr,
              INTERP: tl.constexpr, SCALED: tl.constexpr = False, PAIRED: tl.constexpr = False,
              ROW_SCALE: tl.constexpr = False):
    """acc^T [BLOCK_N, BLOCK_M] plus one K step of W @ a^T. a is [BLOCK_K, BLOCK_M]: bf16 against
    MX tiles, or (FP8) e4m3 against MX quads, with per-token scales a_s applied to the step's fp8
    product (ROW_SCALE: not applied, the caller scales the sum; a_s is unread) (BIG: MX tiles' scales above 128;
    for MX quads it is FLUSH); SCALED: MX quads through tl.dot_scaled; PAIRED: their residuals paired
    (tile_offsets)."""
    words, swords = load_tile(w_ptr, s_ptr, w_off, s_off, nb_ok, kb, k0, k_blocks, PAIRED, FP8, SCALED)
    if FP8 and SCALED:
        codes = tile_e2m1(words, swords, BLOCK_N, BLOCK_K, BIG)
        if INTERP:
            step = dot_scaled_emulated(codes, quad_scales(swords), a, BLOCK_N, BLOCK_K)
        else:
            step = tl.dot_scaled(codes, quad_scales(swords), "e2m1", a, None, "e4m3")
        if ROW_SCALE:
            acc = acc + step
        else:
            acc = acc + step * a_s[None, :]
    elif FP8:
        w = tile_e4m3(words, swords, BLOCK_N, BLOCK_K, BIG, not INTERP and PRMT_OK)
        if ROW_SCALE:  # one accumulator: no second register tile, no per-step scale multiply
            acc = tl.dot(w, a, acc)
        else:
            acc = acc + tl.dot(w, a) * a_s[None, :]
    else:
        w = tile_bf16(words, swords, BLOCK_N, BLOCK_K, BIG, INTERP)
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
                block_k: int, quads: bool = False, paired: bool = False) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Check [E, ...] MX tiles (or quads, their residuals paired or not) of an [n, k] weight and the tile;
    (value words, scale words or residual bytes, row blocks, k blocks)."""
    layout = ("MX quads with paired residuals" if paired else "MX quads") if quads else "MX tiles"
    if values.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{gemm}: {layout} {name} and their scales must be uint8, got {values.dtype}, "
                         f"{scales.dtype}")
    want_v, want_s = mx_quads.tiled_shapes(n, k, paired) if quads else mx_tiles.tiled_shapes(n, k)
    if tuple(values.shape[1:]) != want_v or tuple(scales.shape[1:]) != want_s:
        raise ValueError(f"{gemm}: {layout} {name} {tuple(values.shape)} / scales {tuple(scales.shape)} do not "
                         f"fit an [{n}, {k}] weight: expected [E, {', '.join(map(str, want_v))}] / "
                         f"[E, {', '.join(map(str, want_s))}]")
    if block_n % mx_tiles.ROWS or block_k % mx_tiles.KS:
        raise ValueError(f"MXFP4 {gemm} needs block_n % 16 == 0 and block_k % 64 == 0 (whole MX tile blocks), "
                         f"got block_n={block_n}, block_k={block_k}")
    return words(values), scales if quads else words(scales), want_v[0], want_v[1]


def rowexp_arg(gemm: str, name: str, rowexp: torch.Tensor | None, experts: int, n: int) -> torch.Tensor:
    """Check MX quads' row exponents: uint8 [experts, n]."""
    if rowexp is None:
        raise ValueError(f"{gemm}: a8w4 (MX quads) needs {name}, uint8 [E, {n}] (atom_moe/layouts/mx_quads.py)")
    if rowexp.dtype != torch.uint8 or tuple(rowexp.shape) != (experts, n) or not rowexp.is_contiguous():
        raise ValueError(f"{gemm}: {name} must be contiguous uint8 [{experts}, {n}], got {rowexp.dtype} "
                         f"{tuple(rowexp.shape)}")
    return rowexp


def _dequant_args(layout: str, values: torch.Tensor, scales: torch.Tensor, n: int, k: int, block_n: int,
                  block_k: int, want: tuple[tuple[int, int, int], tuple[int, int, int]]
                  ) -> tuple[tuple[int, ...], int]:
    """Check a dequantize call's inputs against the layout's per-expert shapes `want`; (leading dims, their
    product)."""
    if values.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{layout} and their scales must be uint8, got {values.dtype}, {scales.dtype}")
    want_v, want_s = want
    lead = tuple(values.shape[:-3])
    if tuple(values.shape[-3:]) != want_v or tuple(scales.shape) != (*lead, *want_s):
        raise ValueError(f"{layout} {tuple(values.shape)} / scales {tuple(scales.shape)} do not fit [{n}, {k}]: "
                         f"expected [..., {', '.join(map(str, want_v))}] / [..., {', '.join(map(str, want_s))}]")
    if block_n % mx_tiles.ROWS or block_k % mx_tiles.KS or block_n & (block_n - 1) or block_k & (block_k - 1):
        raise ValueError(f"dequantize needs block_n, block_k powers of two, multiples of 16 and 64, got "
                         f"{block_n}, {block_k}")
    return lead, math.prod(lead)


def dequantize(values: torch.Tensor, scales: torch.Tensor, n: int, k: int, *, big: bool | None = None,
               block_n: int = 32, block_k: int = 128) -> torch.Tensor:
    """fp32 [..., n, k] from MX tiles through the kernels' decoder (tests: bit-exact vs the reference).

    big: the scales-above-128 path (default: on iff any scale byte is above 128).
    """
    want_v = mx_tiles.tiled_shapes(n, k)[0]
    lead, experts = _dequant_args("MX tiles", values, scales, n, k, block_n, block_k, mx_tiles.tiled_shapes(n, k))
    if big is None:
        big = bool((scales > 128).any())
    out = torch.empty(*lead, n, k, dtype=torch.float32, device=values.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k), experts)
    _dequant_kernel[grid](words(values.contiguous()), words(scales.contiguous()), out, n, k, want_v[0], want_v[1],
                          BIG=big, BLOCK_N=block_n, BLOCK_K=block_k, INTERP=interpreting())
    return out


@triton.jit
def _dequant_quads_kernel(w_ptr, r_ptr, rowexp_ptr, out_ptr, n_rows, k, row_blocks, k_blocks, FLUSH: tl.constexpr,
                          PRMT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PAIRED: tl.constexpr):
    pid_n = tl.program_id(0)
    k0 = tl.program_id(1) * BLOCK_K
    e64 = tl.program_id(2).to(tl.int64)
    w_off, r_off, nb_ok, kb = tile_offsets(e64, pid_n, row_blocks, k_blocks, BLOCK_N, BLOCK_K, True, PAIRED=PAIRED)
    r_off += (k0 // BLOCK_K) * scale_step(BLOCK_K, True, PAIRED)
    words, resid = load_tile(w_ptr, r_ptr, w_off + (k0 // 64) * 128, r_off, nb_ok, kb, k0, k_blocks, PAIRED, True)
    w = tile_e4m3(words, resid, BLOCK_N, BLOCK_K, FLUSH, PRMT).to(tl.float32)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = k0 + tl.arange(0, BLOCK_K)
    full = w * row_factor(rowexp_ptr, e64, n, n < n_rows, n_rows)[:, None]
    base = out_ptr + e64 * n_rows * k
    tl.store(base + n.to(tl.int64)[:, None] * k + kk[None, :], full, mask=(n < n_rows)[:, None] & (kk < k)[None, :])


def dequantize_quads(values: torch.Tensor, residuals: torch.Tensor, rowexp: torch.Tensor, n: int, k: int, *,
                     flush: bool = True, paired: bool = False, block_n: int = 32, block_k: int = 128
                     ) -> torch.Tensor:
    """fp32 [..., n, k] from MX quads (residuals paired or not) through the a8w4 decoder (tests: equal to the
    twin's weights)."""
    want_v = mx_tiles.tiled_shapes(n, k)[0]
    lead, experts = _dequant_args("MX quads", values, residuals, n, k, block_n, block_k,
                                  mx_quads.tiled_shapes(n, k, paired))
    if rowexp.dtype != torch.uint8 or tuple(rowexp.shape) != (*lead, n):
        raise ValueError(f"MX quads' rowexp must be uint8 [..., {n}] matching the values' leading dims {lead}, "
                         f"got {rowexp.dtype} {tuple(rowexp.shape)}")
    out = torch.empty(*lead, n, k, dtype=torch.float32, device=values.device)
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k), experts)
    _dequant_quads_kernel[grid](words(values.contiguous()), residuals.contiguous(), rowexp.contiguous(), out, n, k,
                                want_v[0], want_v[1], FLUSH=flush, PRMT=use_prmt(), BLOCK_N=block_n,
                                BLOCK_K=block_k, PAIRED=paired)
    return out


SCALED_DOT_FLAG = "ATOM_MOE_SCALED_DOT"
# Triton's gfx950 build maps tl.dot_scaled onto the scaled MFMA (v_mfma_scale_f32_16x16x128_f8f6f4)
# from a 128-k step on; at 64 it upcasts both operands to bf16 MFMAs, slower than the e4m3 decode's
# fp8 MFMAs (amdgcn of hip_compile's builds, 2026-12-03)
SCALED_MIN_BLOCK_K = 128


def scaled_by_default(arch: str, block_k: int) -> bool:
    """scaled_dot's default for a GPU architecture ("gfx950", "gfx942", "sm_90a", ...) and a K step."""
    return arch.split(":")[0] == "gfx950" and block_k >= SCALED_MIN_BLOCK_K


@functools.cache
def _arch(index: int) -> str:
    return torch.cuda.get_device_properties(index).gcnArchName


def scaled_dot(device: torch.device, block_k: int) -> bool:
    """Whether an a8w4 launch with this K step dots through tl.dot_scaled on `device`:
    ATOM_MOE_SCALED_DOT=1 / 0 forces it, else `scaled_by_default` (gfx950, block_k >= 128)."""
    flag = os.environ.get(SCALED_DOT_FLAG, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"{SCALED_DOT_FLAG}={flag!r}: allowed are 1 (a8w4 through tl.dot_scaled), 0 (the e4m3 "
                         "decode), or unset (tl.dot_scaled on gfx950 GPUs from a 128-k step on)")
    if flag:
        return flag == "1"
    if device.type != "cuda" or torch.version.hip is None:
        return False
    return scaled_by_default(_arch(device.index if device.index is not None else torch.cuda.current_device()), block_k)


def use_prmt() -> bool:
    """Whether the a8w4 decode may use PTX's PRMT (NVIDIA GPUs, not the interpreter): as swap_step decides."""
    return NVIDIA and not interpreting()
