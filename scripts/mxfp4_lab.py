"""MXFP4 weight-streaming lab: which decode / layout streams e2m1 weights fastest (decode GEMM1 shape).

Problem: out[g, m, :] = x[g, m, :] @ dequant(w[g])^T for G experts, M rows per expert, fp32 out.
Weights start in the repo format (packed e2m1 uint8 [G, N, K/2], low nibble = even k; e8m0
uint8 [G, N, K/32]); each variant has a host-side repack (identity for most) and a kernel.
Activations: bf16 (a16w4) or e4m3 with one fp32 scale per row (a8w4; per row, not per
128-group as in the layer, so BLOCK_K can be swept freely).

Variants (weight tile orientation in brackets):
  base            repo decode kernels/mxfp4.py tile_bf16 / tile_e4m3, bytes [BK/2, BN], one dot
  kn_split        repack: bytes [K/2, N] (N contiguous); in each BK block the low nibbles hold
                  k in [0, BK/2) and the high nibbles k in [BK/2, BK): two dots on half-K, no join
  nk_split        same split-nibble packing, rows kept K-contiguous ([N, K/2]); two dots
  evenodd         no repack: low nibbles = even k, high = odd k; two dots with x[:, 0::2], x[:, 1::2]
  dot_scaled      tl.dot_scaled(x, None, bf16|e4m3, bytes [BK/2, BN], scales [BN, BK/32], e2m1)
  swap            out^T = W @ x^T: the decoded weight [BN, BK] is the dot's LHS (wgmma can take
                  it from registers, no shared-memory round trip); nibble join on the minor axis
  trans           weight decoded as [BN, BK] (minor-axis join) then tl.trans into the dot's RHS
  swap_g32        swap, per 32-K chunk: codes -> fp16 (a16w4, activations cast to fp16) or e4m3
                  (a8w4) by bit ops only (no cvt, no per-element scale multiply); the e8m0 scale
                  is applied to the fp32 chunk product (one FMA per acc element per 32 K)
  dot_scaled_swap tl.dot_scaled with the e2m1 weight as LHS and x^T as RHS
Any variant can take split_k > 1 (fp32 atomic_add into a zeroed output).

CLI:
  python scripts/mxfp4_lab.py --check            small shapes; CPU needs TRITON_INTERPRET=1 (set
                                                  automatically when there is no GPU) and numpy < 2.4
  python scripts/mxfp4_lab.py --bench --out DIR  GPU: CUDA graphs, L2 flushed, median of 20;
                                                  writes DIR/mxfp4_lab.csv and prints a table

Numerics notes: swap_g32 (a16w4) casts bf16 activations to fp16 (|x| > 65504 overflows,
|x| < 6e-5 loses bits); a8w4 variants that decode to e4m3 factor each K step's scales into a
per-column base and a residual (exact when a step's scales span <= 14 binades, as in the repo).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

if "--check" in sys.argv and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.common import cast  # noqa: E402
from kernels.mxfp4 import e2m1_value_2m14, e8m0_to_f32, tile_bf16, tile_e4m3  # noqa: E402

HBM_TBPS = 4.54  # measured H200 read ceiling (docs/perf/mxfp4-h200-first.md)
E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1."""
    return os.environ.get("TRITON_INTERPRET") == "1"


# ================================================================ reference (torch, fp32)
def ref_dequant(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 [..., K] from packed e2m1 [..., K/2] (low nibble = even k) and e8m0 [..., K/32]."""
    table = torch.tensor(E2M1_TABLE, dtype=torch.float32, device=packed.device)
    p = packed.to(torch.int64)
    codes = torch.stack([p & 15, p >> 4], dim=-1).flatten(-2)
    mag = table[codes & 7]
    val = torch.where((codes & 8) != 0, -mag, mag)
    s = scales.to(torch.float64)
    sf = torch.where(s == 255, torch.full_like(s, float("nan")), torch.exp2(s - 127.0)).to(torch.float32)
    k = val.shape[-1]
    return (val.reshape(*val.shape[:-1], k // 32, 32) * sf.unsqueeze(-1)).flatten(-2)


def quant_rows_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization: (q [..., K], fp32 scale [...]) with x ~= q * scale."""
    amax = x.float().abs().amax(-1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (x.float() / scale.unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


# ================================================================ repacks (host side)
def repack_identity(packed: torch.Tensor, scales: torch.Tensor, block_k: int) -> dict:
    """Repo layout as is: bytes [G, N, K/2], scales [G, N, K/32] (strides for [k, n] indexing)."""
    g, n, kh = packed.shape
    w, s = packed.contiguous(), scales.contiguous()
    return dict(w=w, s=s, swg=n * kh, swk=1, swn=kh, ssg=n * (kh // 16), ssk=1, ssn=kh // 16)


def _split_codes(packed: torch.Tensor, block_k: int) -> torch.Tensor:
    """[G, N, K/2] bytes -> split-nibble bytes [G, N, Kp/2]: per BK block, lo = k < BK/2, hi = k >= BK/2."""
    g, n, kh = packed.shape
    k = 2 * kh
    kp = triton.cdiv(k, block_k) * block_k
    p = packed.to(torch.int16)
    codes = torch.stack([p & 15, p >> 4], dim=-1).reshape(g, n, k)
    codes = torch.nn.functional.pad(codes, (0, kp - k))  # zero codes in the padded tail
    blocks = codes.reshape(g, n, kp // block_k, 2, block_k // 2)
    return (blocks[:, :, :, 0, :] | (blocks[:, :, :, 1, :] << 4)).reshape(g, n, kp // 2).to(torch.uint8)


def _pad_scales(scales: torch.Tensor, block_k: int) -> torch.Tensor:
    """[G, N, K/32] -> [G, N, Kp/32] (pad with 127 = 1.0)."""
    kg = scales.shape[-1]
    kgp = triton.cdiv(kg * 32, block_k) * block_k // 32
    return torch.nn.functional.pad(scales, (0, kgp - kg), value=127)


def repack_nk_split(packed: torch.Tensor, scales: torch.Tensor, block_k: int) -> dict:
    """Split-nibble bytes [G, N, Kp/2] (K contiguous), scales [G, N, Kp/32]."""
    w = _split_codes(packed, block_k).contiguous()
    s = _pad_scales(scales, block_k).contiguous()
    g, n, kph = w.shape
    return dict(w=w, s=s, swg=n * kph, swk=1, swn=kph, ssg=n * s.shape[-1], ssk=1, ssn=s.shape[-1])


def repack_kn_split(packed: torch.Tensor, scales: torch.Tensor, block_k: int) -> dict:
    """Split-nibble bytes [G, Kp/2, N] (N contiguous), scales [G, Kp/32, N]."""
    w = _split_codes(packed, block_k).transpose(1, 2).contiguous()
    s = _pad_scales(scales, block_k).transpose(1, 2).contiguous()
    g, kph, n = w.shape
    return dict(w=w, s=s, swg=kph * n, swk=n, swn=1, ssg=s.shape[1] * n, ssk=n, ssn=1)


# ================================================================ decode helpers (Triton)
@triton.jit
def _codes_minor(packed, R: tl.constexpr, C: tl.constexpr):
    """bytes [R, C/2] -> codes [R, C]: column 2i = low nibble of byte column i (join on the minor axis)."""
    return tl.reshape(tl.join(packed & 0x0F, packed >> 4), (R, C))


@triton.jit
def _scale_rows(v, f, RG: tl.constexpr, KR: tl.constexpr, BN: tl.constexpr):
    """v [KR, BN] * f [KR/RG, BN] broadcast over groups of RG consecutive rows."""
    return tl.reshape(tl.reshape(v, (KR // RG, RG, BN)) * f[:, None, :], (KR, BN))


@triton.jit
def _scale_cols(v, f, BN: tl.constexpr, KC: tl.constexpr):
    """v [BN, KC] * f [BN, KC/32] broadcast over groups of 32 consecutive columns."""
    return tl.reshape(tl.reshape(v, (BN, KC // 32, 32)) * f[:, :, None], (BN, KC))


@triton.jit
def _factors(s, AXIS: tl.constexpr, A8: tl.constexpr):
    """e8m0 tile -> (per-element factor on value*2^-14, per-column base); AXIS = the K axis of s.

    bf16: factor 2^14 * 2^(s-127), base 1. e4m3: factor 2^(s - smax + 6 + 14) (residual, floor
    at fp32 exponent 1), base 2^(smax - 127 - 6) per column (NaN for a 0xFF scale).
    """
    if A8:
        si = s.to(tl.int32)
        smax = tl.max(si, AXIS)
        if AXIS == 0:
            fexp = tl.maximum(147 + si - smax[None, :], 1)
        else:
            fexp = tl.maximum(147 + si - smax[:, None], 1)
        return (fexp << 23).to(tl.float32, bitcast=True), e8m0_to_f32(smax) * 0.015625
    else:
        return e8m0_to_f32(s) * 16384.0, tl.zeros([1], dtype=tl.float32) + 1.0


@triton.jit
def _dot(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b; under the interpreter on fp32 upcasts (its bf16 / fp8 dots are not trusted)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


# ================================================================ kernel A: weight tile [K, N] (RHS)
@triton.jit(do_not_specialize=["M"])
def _rows_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K,
                 swg, swk, swn, ssg, ssk, ssn,
                 MODE: tl.constexpr, A8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, INTERP: tl.constexpr):
    m_blocks = tl.cdiv(M, BLOCK_M)
    g = tl.program_id(0) // m_blocks
    m = (tl.program_id(0) % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    g64 = g.to(tl.int64)
    x_row = x_ptr + (g64 * M + m.to(tl.int64)) * K
    w_g = w_ptr + g64 * swg + n.to(tl.int64)[None, :] * swn
    s_g = s_ptr + g64 * ssg + n.to(tl.int64)[None, :] * ssn
    HK: tl.constexpr = BLOCK_K // 2
    kh = tl.arange(0, HK)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = tl.program_id(2) * k_per
    k_end = tl.minimum(K, k_start + k_per)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if MODE == "split":
            b_ok = ((k0 + kh) < K)[:, None] & n_ok[None, :]  # byte i holds k0 + i and k0 + BK/2 + i
        else:
            b_ok = ((k0 // 2 + kh) < K // 2)[:, None] & n_ok[None, :]  # byte i holds k0 + 2i, k0 + 2i + 1
        wb = tl.load(w_g + (k0 // 2 + kh)[:, None] * swk, mask=b_ok, other=0)
        if MODE == "base":
            kk = k0 + tl.arange(0, BLOCK_K)
            kg = tl.arange(0, BLOCK_K // 32)
            sb = tl.load(s_g + (k0 // 32 + kg)[:, None] * ssk,
                         mask=((k0 + kg * 32) < K)[:, None] & n_ok[None, :], other=127)
            a = tl.load(x_row[:, None] + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            if A8:
                w, col = tile_e4m3(wb, sb, BLOCK_K, BLOCK_N, INTERP)
                acc += _dot(a, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERP) * col[None, :]
            else:
                w = tile_bf16(wb, sb, BLOCK_K, BLOCK_N, INTERP)
                acc = _dot(a, w, acc, INTERP)
        elif MODE == "dot_scaled":
            kk = k0 + tl.arange(0, BLOCK_K)
            kg = tl.arange(0, BLOCK_K // 32)
            # rhs_scale is [BN, BK/32] (not transposed)
            sb = tl.load(s_ptr + g64 * ssg + n.to(tl.int64)[:, None] * ssn + (k0 // 32 + kg)[None, :] * ssk,
                         mask=n_ok[:, None] & ((k0 + kg * 32) < K)[None, :], other=127)
            a = tl.load(x_row[:, None] + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            if A8:
                acc = tl.dot_scaled(a, None, "e4m3", wb, sb, "e2m1", acc)
            else:
                acc = tl.dot_scaled(a, None, "bf16", wb, sb, "e2m1", acc)
        else:
            lo = e2m1_value_2m14(wb & 0x0F)
            hi = e2m1_value_2m14(wb >> 4)
            if MODE == "evenodd":
                # half tiles: row i <-> k = k0 + 2i (lo) / k0 + 2i + 1 (hi); scale group = i // 16
                kg = tl.arange(0, BLOCK_K // 32)
                sb = tl.load(s_g + (k0 // 32 + kg)[:, None] * ssk,
                             mask=((k0 + kg * 32) < K)[:, None] & n_ok[None, :], other=127)
                f, col = _factors(sb, 0, A8)
                lo = _scale_rows(lo, f, 16, HK, BLOCK_N)
                hi = _scale_rows(hi, f, 16, HK, BLOCK_N)
                k_lo = k0 + 2 * kh
                k_hi = k_lo + 1
            else:  # "split": row i <-> k = k0 + i (lo) / k0 + BK/2 + i (hi); groups of 32 rows
                kq = tl.arange(0, BLOCK_K // 64)
                s_lo = tl.load(s_g + (k0 // 32 + kq)[:, None] * ssk,
                               mask=((k0 + kq * 32) < K)[:, None] & n_ok[None, :], other=127)
                s_hi = tl.load(s_g + (k0 // 32 + BLOCK_K // 64 + kq)[:, None] * ssk,
                               mask=((k0 + HK + kq * 32) < K)[:, None] & n_ok[None, :], other=127)
                if A8:
                    # one base per column for the whole BK step (both halves)
                    smax = tl.maximum(tl.max(s_lo.to(tl.int32), 0), tl.max(s_hi.to(tl.int32), 0))
                    f_lo = (tl.maximum(147 + s_lo.to(tl.int32) - smax[None, :], 1) << 23).to(tl.float32, bitcast=True)
                    f_hi = (tl.maximum(147 + s_hi.to(tl.int32) - smax[None, :], 1) << 23).to(tl.float32, bitcast=True)
                    col = e8m0_to_f32(smax) * 0.015625
                else:
                    f_lo = e8m0_to_f32(s_lo) * 16384.0
                    f_hi = e8m0_to_f32(s_hi) * 16384.0
                    col = tl.zeros([1], dtype=tl.float32) + 1.0
                lo = _scale_rows(lo, f_lo, 32, HK, BLOCK_N)
                hi = _scale_rows(hi, f_hi, 32, HK, BLOCK_N)
                k_lo = k0 + kh
                k_hi = k_lo + HK
            a_lo = tl.load(x_row[:, None] + k_lo[None, :], mask=m_ok[:, None] & (k_lo < K)[None, :], other=0.0)
            a_hi = tl.load(x_row[:, None] + k_hi[None, :], mask=m_ok[:, None] & (k_hi < K)[None, :], other=0.0)
            if A8:
                t = _dot(a_lo, cast(lo, tl.float8e4nv, INTERP), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), INTERP)
                t = _dot(a_hi, cast(hi, tl.float8e4nv, INTERP), t, INTERP)
                acc += t * col[None, :]
            else:
                acc = _dot(a_lo, cast(lo, tl.bfloat16, INTERP), acc, INTERP)
                acc = _dot(a_hi, cast(hi, tl.bfloat16, INTERP), acc, INTERP)
    if A8:
        acc = acc * tl.load(xs_ptr + g64 * M + m, mask=m_ok, other=0.0)[:, None]
    o_ptrs = out_ptr + (g64 * M + m.to(tl.int64))[:, None] * N + n[None, :]
    o_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(o_ptrs, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, acc, mask=o_mask)


# ================================================================ kernel B: weight tile [N, K]
@triton.jit(do_not_specialize=["M"])
def _cols_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, M, N, K,
                 swg, swk, swn, ssg, ssk, ssn,
                 MODE: tl.constexpr, A8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, INTERP: tl.constexpr):
    m_blocks = tl.cdiv(M, BLOCK_M)
    g = tl.program_id(0) // m_blocks
    m = (tl.program_id(0) % m_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    g64 = g.to(tl.int64)
    x_row = x_ptr + (g64 * M + m.to(tl.int64)) * K  # [BM]
    w_g = w_ptr + g64 * swg + n.to(tl.int64)[:, None] * swn
    s_g = s_ptr + g64 * ssg + n.to(tl.int64)[:, None] * ssn
    HK: tl.constexpr = BLOCK_K // 2
    kh = tl.arange(0, HK)
    kg = tl.arange(0, BLOCK_K // 32)
    k_per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_start = tl.program_id(2) * k_per
    k_end = tl.minimum(K, k_start + k_per)
    if MODE == "trans":
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # transposed accumulator (out^T)
    for k0 in range(k_start, k_end, BLOCK_K):
        if MODE == "swap_g32":
            for c in tl.static_range(BLOCK_K // 32):
                kb = k0 // 2 + c * 16 + tl.arange(0, 16)
                wb = tl.load(w_g + kb[None, :] * swk, mask=n_ok[:, None] & (kb < K // 2)[None, :], other=0)
                codes = _codes_minor(wb, BLOCK_N, 32)
                kc = k0 + c * 32 + tl.arange(0, 32)
                xt = tl.load(x_row[None, :] + kc[:, None], mask=(kc < K)[:, None] & m_ok[None, :], other=0.0)
                sc = tl.load(s_g + (k0 // 32 + c) * ssk, mask=n_ok[:, None] & (k0 + c * 32 < K), other=127)
                sf = e8m0_to_f32(sc)  # [BN, 1]
                if A8:
                    # e4m3 bits s|eeee|mmm of value * 2^-6 straight from the code bits
                    b8 = ((codes & 8) << 4) | ((codes & 7) << 2)
                    w = b8.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
                    t = _dot(w, xt, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERP)
                    acc += t * (sf * 64.0)
                else:
                    c16 = codes.to(tl.uint16)
                    w = (((c16 & 8) << 12) | ((c16 & 7) << 9)).to(tl.float16, bitcast=True)  # value * 2^-14
                    t = _dot(w, xt.to(tl.float16), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERP)
                    acc += t * (sf * 16384.0)
        else:
            wb = tl.load(w_g + (k0 // 2 + kh)[None, :] * swk,
                         mask=n_ok[:, None] & ((k0 // 2 + kh) < K // 2)[None, :], other=0)
            sb = tl.load(s_g + (k0 // 32 + kg)[None, :] * ssk,
                         mask=n_ok[:, None] & ((k0 + kg * 32) < K)[None, :], other=127)
            kk = k0 + tl.arange(0, BLOCK_K)
            if MODE == "trans":
                a = tl.load(x_row[:, None] + kk[None, :], mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            else:
                xt = tl.load(x_row[None, :] + kk[:, None], mask=(kk < K)[:, None] & m_ok[None, :], other=0.0)
            if MODE == "dot_scaled_swap":
                if A8:
                    acc = tl.dot_scaled(wb, sb, "e2m1", xt, None, "e4m3", acc)
                else:
                    acc = tl.dot_scaled(wb, sb, "e2m1", xt, None, "bf16", acc)
            else:
                v = e2m1_value_2m14(_codes_minor(wb, BLOCK_N, BLOCK_K))
                f, col = _factors(sb, 1, A8)
                v = _scale_cols(v, f, BLOCK_N, BLOCK_K)
                if A8:
                    w = cast(v, tl.float8e4nv, INTERP)
                else:
                    w = cast(v, tl.bfloat16, INTERP)
                if MODE == "trans":
                    if A8:
                        acc += _dot(a, tl.trans(w), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32),
                                    INTERP) * col[None, :]
                    else:
                        acc = _dot(a, tl.trans(w), acc, INTERP)
                else:  # "swap"
                    if A8:
                        acc += _dot(w, xt, tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), INTERP) * col[:, None]
                    else:
                        acc = _dot(w, xt, acc, INTERP)
    if MODE == "trans":
        if A8:
            acc = acc * tl.load(xs_ptr + g64 * M + m, mask=m_ok, other=0.0)[:, None]
        o_ptrs = out_ptr + (g64 * M + m.to(tl.int64))[:, None] * N + n[None, :]
        o_mask = m_ok[:, None] & n_ok[None, :]
    else:
        if A8:
            acc = acc * tl.load(xs_ptr + g64 * M + m, mask=m_ok, other=0.0)[None, :]
        o_ptrs = out_ptr + (g64 * M + m.to(tl.int64))[None, :] * N + n[:, None]
        o_mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(o_ptrs, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, acc, mask=o_mask)


# ================================================================ variants and launch
@dataclass(frozen=True)
class Variant:
    """One decode / layout strategy: its kernel, constexpr MODE and host repack."""

    name: str
    kernel: object
    mode: str
    repack: object
    min_block_k: int = 32
    uses_dot_scaled: bool = False


VARIANTS = [
    Variant("base", _rows_kernel, "base", repack_identity),
    Variant("swap", _cols_kernel, "swap", repack_identity),
    Variant("swap_g32", _cols_kernel, "swap_g32", repack_identity),
    Variant("trans", _cols_kernel, "trans", repack_identity),
    Variant("kn_split", _rows_kernel, "split", repack_kn_split, 64),
    Variant("nk_split", _rows_kernel, "split", repack_nk_split, 64),
    Variant("evenodd", _rows_kernel, "evenodd", repack_identity),
    Variant("dot_scaled", _rows_kernel, "dot_scaled", repack_identity, 64, True),
    Variant("dot_scaled_swap", _cols_kernel, "dot_scaled_swap", repack_identity, 64, True),
]
ACTS = ("a16w4", "a8w4")


@dataclass(frozen=True)
class Config:
    """Tile config of one launch."""

    block_m: int
    block_n: int
    block_k: int
    warps: int = 4
    stages: int = 3
    split_k: int = 1

    def tag(self) -> str:
        """Short printable form."""
        return (f"m{self.block_m} n{self.block_n} k{self.block_k} w{self.warps} s{self.stages}"
                + (f" sk{self.split_k}" if self.split_k > 1 else ""))


@dataclass
class Acts:
    """Activations of one act scheme: x [G, M, K] (bf16 or e4m3) and per-row fp32 scales [G, M]."""

    x: torch.Tensor
    xs: torch.Tensor

    def ref_input(self) -> torch.Tensor:
        """fp32 activations the reference multiplies."""
        return self.x.float() * self.xs.unsqueeze(-1)


def make_acts(x: torch.Tensor, act: str) -> Acts:
    """bf16 x [G, M, K] -> the kernels' activations for act ('a16w4' bf16, 'a8w4' per-row e4m3)."""
    if act == "a8w4":
        q, s = quant_rows_e4m3(x)
        return Acts(q.contiguous(), s.contiguous())
    return Acts(x.to(torch.bfloat16).contiguous(), torch.ones(x.shape[:-1], device=x.device))


def launch(v: Variant, acts: Acts, wp: dict, out: torch.Tensor, n: int, k: int, cfg: Config) -> object:
    """out [G, M, N] fp32 = acts @ dequant(w)^T with variant v (zeroes out first when split_k > 1).

    Returns what the Triton launch returns (the compiled kernel when compiled)."""
    g, m, _ = acts.x.shape
    if cfg.split_k > 1:
        out.zero_()
    grid = (g * triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    return v.kernel[grid](acts.x, acts.xs, wp["w"], wp["s"], out, m, n, k,
                   wp["swg"], wp["swk"], wp["swn"], wp["ssg"], wp["ssk"], wp["ssn"],
                   MODE=v.mode, A8=acts.x.dtype == torch.float8_e4m3fn, BLOCK_M=cfg.block_m,
                   BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, INTERP=interpreting(),
                   num_warps=cfg.warps, num_stages=cfg.stages)


def rel_errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(relative Frobenius error overall, worst per-(expert, row) relative error); inf if non-finite."""
    if not torch.isfinite(out).all():
        return math.inf, math.inf
    d = (out.double() - ref.double())
    overall = (d.norm() / ref.double().norm().clamp_min(1e-30)).item()
    rows = (d.norm(dim=-1) / ref.double().norm(dim=-1).clamp_min(1e-30)).max().item()
    return overall, rows


def random_weights(g: int, n: int, k: int, device: str, lo: int = 118, hi: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Random packed e2m1 bytes [G, N, K/2] (all 256 byte values) and e8m0 scales in [lo, hi]."""
    packed = torch.randint(0, 256, (g, n, k // 2), dtype=torch.uint8, device=device)
    scales = torch.randint(lo, hi + 1, (g, n, k // 32), dtype=torch.uint8, device=device)
    return packed, scales


# ================================================================ --check
def run_check(args: argparse.Namespace) -> int:
    """Small shapes: bit-exact dequant through identity activations, and random x vs fp32 reference."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not interpreting():
        print("no GPU and TRITON_INTERPRET!=1: cannot run kernels", flush=True)
        return 2
    torch.manual_seed(args.seed)
    g, n, k, m = 2, 96, 320, 3  # K = 2*128 + 64 and N = 64 + 32: tail tiles in both dims
    # scales span 14 binades: the a8w4 factorization is still exact
    packed, scales = random_weights(g, n, k, device, 120, 134)
    wdq = ref_dequant(packed, scales)  # [G, N, K]
    eye = torch.eye(k, device=device).expand(g, k, k).contiguous()
    x = torch.randn(g, m, k, device=device)
    cfgs = [Config(16, 64, 64), Config(16, 32, 128), Config(16, 64, 256), Config(16, 32, 128, split_k=2)]
    variants = [v for v in VARIANTS if not args.variants or v.name in args.variants]
    print(f"check on {device}{' (TRITON_INTERPRET=1)' if interpreting() else ''}: G={g} N={n} K={k} "
          f"M={m} (+ identity M=K)", flush=True)
    results: list[tuple[str, str, str, str]] = []
    bad = 0
    t0 = time.time()
    for v in variants:
        for act in ACTS:
            # identity rows (1.0, row scale 1): out^T is the kernel's dequantized weight, exactly
            a_id = Acts(eye.to(torch.float8_e4m3fn if act == "a8w4" else torch.bfloat16), torch.ones(g, k, device=device))
            a_x = make_acts(x, act)
            ref_x = torch.bmm(a_x.ref_input(), wdq.transpose(1, 2))
            for cfg in cfgs:
                if cfg.block_k < v.min_block_k:
                    continue
                wp = v.repack(packed, scales, cfg.block_k)
                try:
                    out_id = torch.full((g, k, n), float("nan"), device=device)
                    launch(v, a_id, wp, out_id, n, k, Config(64, cfg.block_n, cfg.block_k, cfg.warps, cfg.stages,
                                                              cfg.split_k))
                    out_x = torch.full((g, m, n), float("nan"), device=device)
                    launch(v, a_x, wp, out_x, n, k, cfg)
                    if device == "cuda":
                        torch.cuda.synchronize()
                except Exception as exc:  # noqa: BLE001 - report and go on
                    msg = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                    if v.uses_dot_scaled and interpreting():
                        results.append((v.name, act, cfg.tag(), f"UNSUPPORTED (interpreter) {msg}"))
                    else:
                        bad += 1
                        results.append((v.name, act, cfg.tag(), f"ERROR {msg}"))
                        if args.verbose:
                            traceback.print_exc()
                    print(f"  {v.name:16s} {act} {cfg.tag():28s} {results[-1][3]}", flush=True)
                    continue
                exact = bool((out_id.transpose(1, 2) == wdq).all().item())
                n_diff = int((out_id.transpose(1, 2) != wdq).sum().item())
                err, row_err = rel_errors(out_x, ref_x)
                ok = exact and err <= 1e-2 and row_err <= 1e-2
                bad += not ok
                status = (f"{'PASS' if ok else 'FAIL'} dequant {'bit-exact' if exact else f'{n_diff} mismatches'}"
                          f" rel_err {err:.2e} worst_row {row_err:.2e}")
                results.append((v.name, act, cfg.tag(), status))
                print(f"  {v.name:16s} {act} {cfg.tag():28s} {status}", flush=True)
    print(f"\nsummary ({time.time() - t0:.1f} s):", flush=True)
    for name in dict.fromkeys(r[0] for r in results):
        for act in ACTS:
            st = [r[3].split()[0] for r in results if r[0] == name and r[1] == act]
            verdict = "PASS" if st and all(s == "PASS" for s in st) else (
                "UNSUPPORTED" if st and all(s == "UNSUPPORTED" for s in st) else "FAIL")
            print(f"  {name:16s} {act}: {verdict} ({len(st)} configs)", flush=True)
    return 1 if bad else 0


# ================================================================ --bench
class GraphTimer:
    """Median us of CUDA-graph replays, a 512 MB buffer zeroed before each replay (L2 flush)."""

    def __init__(self, iters: int) -> None:
        self.iters = iters
        self.flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")

    def us(self, fn) -> float:
        """Capture fn() (already compiled) in a graph; median replay time in us."""
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm-up on a side stream before capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        times = []
        for _ in range(self.iters):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


class WallTimer:
    """Host-clock median (interpreter dry runs only)."""

    def __init__(self, iters: int) -> None:
        self.iters = iters

    def us(self, fn) -> float:
        """Median wall time of fn() in us."""
        times = []
        for _ in range(self.iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)


def sync(dev: str) -> None:
    """Wait for the device (no-op on the CPU)."""
    if dev == "cuda":
        torch.cuda.synchronize()


SHAPES = {"gpt-oss-120b": (2880, 5760), "deepseek-v3": (7168, 4096)}  # (K = H, N = 2I)
DEFAULT_CFG = {16: (128, 128, 4, 3, 1), 64: (128, 128, 8, 3, 1)}
SWEEP = {
    16: [(256, 128, 4, 3, 1), (64, 128, 4, 3, 1), (128, 256, 4, 3, 1), (128, 64, 4, 4, 1), (128, 128, 4, 3, 2),
         (256, 128, 8, 3, 1), (128, 128, 8, 4, 1), (64, 256, 4, 4, 1), (256, 256, 8, 3, 1), (128, 128, 4, 4, 4)],
    64: [(256, 128, 8, 3, 1), (128, 64, 4, 4, 1), (128, 256, 8, 3, 1)],
}
FIELDS = ["variant", "act", "shape", "K", "N", "G", "M", "block_m", "block_n", "block_k", "warps", "stages",
          "split_k", "us", "tbps", "frac", "rel_err", "ok", "note"]


def run_bench(args: argparse.Namespace) -> int:
    """Time every variant x act x shape x M over tile configs within the budget; CSV + table."""
    shapes = {name: SHAPES[name] for name in args.shapes}
    if torch.cuda.is_available():
        dev = "cuda"
        timer = GraphTimer(args.iters)
    elif interpreting():  # dry run of the harness on tiny shapes; timings are meaningless
        dev = "cpu"
        timer = WallTimer(2)
        shapes = {"tiny": (320, 96)}
    else:
        print("--bench needs a CUDA GPU (or TRITON_INTERPRET=1 for a dry run of the harness)", flush=True)
        return 2
    t0 = time.time()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(args.seed)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / "mxfp4_lab.csv"
    fh = open(csv_path, "w", newline="")
    writer = csv.DictWriter(fh, fieldnames=FIELDS)
    writer.writeheader()
    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else 'CPU interpreter dry run'} "
          f"torch {torch.__version__} triton {triton.__version__} "
          f"G={args.experts} budget {args.budget:.0f} s", flush=True)
    g = args.experts
    data = {}
    for name, (k, n) in shapes.items():
        packed, scales = random_weights(g, n, k, dev)
        wdq = ref_dequant(packed, scales)
        x64 = torch.randn(g, 64, k, device=dev)
        per_act = {}
        for act in ACTS:
            a64 = make_acts(x64, act)
            ref64 = torch.bmm(a64.ref_input(), wdq.transpose(1, 2))
            per_act[act] = {m: (Acts(a64.x[:, :m].contiguous(), a64.xs[:, :m].contiguous()), ref64[:, :m].contiguous())
                            for m in args.m}
        del wdq
        data[name] = (k, n, packed, scales, per_act)
    sync(dev)
    print(f"setup {time.time() - t0:.1f} s", flush=True)
    variants = [v for v in VARIANTS if not args.variants or v.name in args.variants]
    bms = sorted({16 if m <= 16 else 64 for m in args.m})
    work: list[tuple[Variant, str, Config]] = []
    for bm in bms:  # phase 1: default config of every variant
        for act in ACTS:
            for v in variants:
                work.append((v, act, Config(bm, *DEFAULT_CFG[bm])))
    for bm in bms:  # phase 2: sweep, config-major so a budget cut leaves balanced coverage
        for c in SWEEP[bm]:
            for act in ACTS:
                for v in variants:
                    work.append((v, act, Config(bm, *c)))
    rows: list[dict] = []
    broken: set[tuple[str, str]] = set()
    skipped = 0
    repacks: dict = {}
    for v, act, cfg in work:
        if cfg.block_k < v.min_block_k or (v.name, act) in broken:
            continue
        if time.time() - t0 > args.budget:
            skipped += 1
            continue
        is_default = cfg == Config(cfg.block_m, *DEFAULT_CFG[cfg.block_m])
        failed = False
        for name, (k, n, packed, scales, per_act) in data.items():
            key = (v.name, name, cfg.block_k if v.repack is not repack_identity else 0)
            if key not in repacks:
                repacks[key] = v.repack(packed, scales, cfg.block_k)
            wp = repacks[key]
            for m in args.m:
                if (16 if m <= 16 else 64) != cfg.block_m:
                    continue
                acts, ref = per_act[act][m]
                out = torch.empty(g, m, n, device=dev)
                row = dict(variant=v.name, act=act, shape=name, K=k, N=n, G=g, M=m, block_m=cfg.block_m,
                           block_n=cfg.block_n, block_k=cfg.block_k, warps=cfg.warps, stages=cfg.stages,
                           split_k=cfg.split_k, us="", tbps="", frac="", rel_err="", ok="", note="")
                try:
                    compiled = launch(v, acts, wp, out, n, k, cfg)
                    sync(dev)
                    row["note"] = kernel_stats(compiled)
                    err, row_err = rel_errors(out, ref)
                    row["rel_err"] = f"{max(err, row_err):.2e}"
                    row["ok"] = "PASS" if max(err, row_err) <= 1e-2 else "FAIL"
                    us = timer.us(lambda: launch(v, acts, wp, out, n, k, cfg))
                    nbytes = g * n * (k // 2 + k // 32)
                    tbps = nbytes / us / 1e6
                    row.update(us=f"{us:.2f}", tbps=f"{tbps:.3f}", frac=f"{tbps / HBM_TBPS:.3f}")
                except Exception as exc:  # noqa: BLE001 - one config's failure must not stop the run
                    row["ok"] = "ERROR"
                    row["note"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
                    if is_default:
                        broken.add((v.name, act))
                    try:
                        sync(dev)
                    except Exception:  # noqa: BLE001 - a sticky CUDA error: later rows will say so
                        pass
                writer.writerow(row)
                fh.flush()
                rows.append(row)
                print(f"[{time.time() - t0:6.1f}s] {v.name:16s} {act} {name:13s} M={m:<3d} {cfg.tag():28s} "
                      f"{row['us'] or '-':>9s} us {row['tbps'] or '-':>6s} TB/s frac {row['frac'] or '-':>6s} "
                      f"{row['ok']} {row['rel_err']} {row['note'][:120]}", flush=True)
                if row["ok"] == "ERROR":
                    failed = True
                    break
            if failed:
                break
    fh.close()
    print_table(rows)
    print(f"\n{len(rows)} rows -> {csv_path}; {skipped} work items skipped by the budget; "
          f"elapsed {time.time() - t0:.1f} s", flush=True)
    return 0


def kernel_stats(compiled: object) -> str:
    """'regs=R spills=S' of a compiled Triton kernel, '' when unavailable."""
    try:
        return f"regs={compiled.n_regs} spills={compiled.n_spills}"
    except Exception:  # noqa: BLE001 - informational only
        return ""


def print_table(rows: list[dict]) -> None:
    """Best config per (act, shape, M, variant), fastest first within each group."""
    best: dict = {}
    for r in rows:
        if r["ok"] != "PASS":
            continue
        key = (r["act"], r["shape"], r["M"], r["variant"])
        if key not in best or float(r["us"]) < float(best[key]["us"]):
            best[key] = r
    failed = sorted({(r["variant"], r["act"], r["ok"], r["note"][:100]) for r in rows if r["ok"] != "PASS"})
    print("\nbest config per variant (weight bytes 0.5 B + 1/32 B per weight; frac of 4.54 TB/s)")
    print(f"{'act':6s} {'shape':13s} {'M':>3s} {'variant':16s} {'us':>9s} {'TB/s':>6s} {'frac':>6s}  config")
    for group in sorted({k[:3] for k in best}):
        for key in sorted((k for k in best if k[:3] == group), key=lambda k: float(best[k]["us"])):
            r = best[key]
            cfg = Config(int(r["block_m"]), int(r["block_n"]), int(r["block_k"]), int(r["warps"]), int(r["stages"]),
                         int(r["split_k"]))
            print(f"{r['act']:6s} {r['shape']:13s} {r['M']:>3d} {r['variant']:16s} {r['us']:>9s} {r['tbps']:>6s} "
                  f"{r['frac']:>6s}  {cfg.tag():28s} {r['note']}")
        print()
    if failed:
        print("not passing (variant, act, status, note):")
        for f in failed:
            print(f"  {f}")


# ================================================================ main
def main() -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="correctness on small shapes (CPU: interpreter)")
    mode.add_argument("--bench", action="store_true", help="GPU timing sweep")
    p.add_argument("--out", default="out/mxfp4_lab", help="bench output directory")
    p.add_argument("--variants", nargs="*", default=None, help="subset of variant names")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--m", nargs="*", type=int, default=[1, 8, 64], help="rows per expert")
    p.add_argument("--experts", type=int, default=8, help="experts in the group (G)")
    p.add_argument("--iters", type=int, default=20, help="timed graph replays (median)")
    p.add_argument("--budget", type=float, default=130.0, help="bench: stop starting new configs after this (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args()
    if args.variants:
        unknown = set(args.variants) - {v.name for v in VARIANTS}
        if unknown:
            p.error(f"unknown variants {sorted(unknown)}; known: {[v.name for v in VARIANTS]}")
    if any(m > 64 for m in args.m):
        p.error("--m values must be <= 64")
    return run_check(args) if args.check else run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
