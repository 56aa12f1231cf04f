"""The K loop GEMM1 and GEMM2 share: one tile of a grouped GEMM over an expert's weight rows.

Both GEMMs read activation rows through the sorted pair list and stream one expert's
weights; they differ only in which rows they read and in their epilogues (SwiGLU + quant, or
routing weight + combine). The shared prologue is `tile_expert`, `tile_rows` and `tile_start`,
both epilogues start from `tile_finish`; the loop itself, for every scheme:

- bf16: acc[M, N] += a @ w (a upcast to bf16 when it arrives wider);
- fp8: the same in e4m3 with per-(token, 128-group) and per-128x128-block scales folded into
  each step's product;
- MXFP4 (a16w4, a8w4) "swapped": acc^T[N, M] += W @ a^T with W decoded in registers from MX
  tiles / MX quads (kernels/mxfp4.py). a8w4's GEMM1 (ROW_SCALE: one activation scale per token)
  keeps one fp8 accumulator over all of K and applies the scale after the loop; its GEMM2 (a scale
  per token-group-64) applies each step's scales to that step's product, loaded one K step ahead,
  since a plain load would stall every step.

A @triton.jit helper is inlined into its caller, so each GEMM compiles to the code it had
with the loop and prologue written out (docs/perf/kloop-shared-sass.md: the SASS was compared).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .common import FP8_MAX, QGROUP, cast, checked_ids, dot, tile_ids
from .mxfp4 import row_factor, scale_step, swap_step, tile_offsets


@triton.jit
def tile_expert(block_expert_ptr, n_blocks, n_col_tiles, GROUP_M: tl.constexpr, ids_ptr, emap_ptr, num_experts,
                PAIRS: tl.constexpr, L2_ONLY: tl.constexpr = False, AHEAD: tl.constexpr = 0):
    """(pid_m, pid_n, expert) of this program: its row block, column tile and the block's expert (-1: idle).

    PAIRS: no routing sort ran; row block b is (token, slot) pair b alone, its expert read from
    topk_ids through expert_map (-1 for sentinels and experts of other ranks). L2_ONLY: read past
    L1 (GEMM2 under PDL reads the expert before its wait: kernels/gemm2.py). AHEAD > 0: those of the program
    AHEAD places later in the launch (it must exist; GEMM2's lookahead prefetch)."""
    pid_m, pid_n = tile_ids(n_blocks, n_col_tiles, GROUP_M, AHEAD)
    cache: tl.constexpr = ".cg" if L2_ONLY else ""
    if PAIRS:
        ok, gid = checked_ids(tl.load(ids_ptr + pid_m, cache_modifier=cache), num_experts)
        expert = tl.where(ok, tl.load(emap_ptr + gid, mask=ok, other=-1, cache_modifier=cache), -1)
    else:
        expert = tl.load(block_expert_ptr + pid_m, cache_modifier=cache)
    return pid_m, pid_n, expert


@triton.jit
def tile_rows(sorted_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr):
    """(rows, pair, row_ok) of row block pid_m: its rows of the sorted pair list (PAIRS: the pair's own
    row first, the rest padding), their (token, slot) pairs and which rows hold one (padding rows hold
    num_pairs)."""
    i = tl.arange(0, BLOCK_M)
    if PAIRS:  # GEMM1's output row is the pair's index: GEMM2 reads it back the same way
        rows = tl.where(i == 0, pid_m, 0)
        pair = tl.where(i == 0, pid_m, num_pairs)
    else:
        rows = pid_m * BLOCK_M + i
        pair = tl.load(sorted_ptr + rows)
    return rows, pair, pair < num_pairs


@triton.jit
def tile_start(a_ptr, a_rows, stride_a, as_ptr, stride_as, w_ptr, e64, pid_n, n, n_total, K, row_blocks, k_blocks,
               AGROUP: tl.constexpr, FP8: tl.constexpr, W4: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, SCALED: tl.constexpr = False, PAIRED: tl.constexpr = False,
               SWAP: tl.constexpr = False):
    """(a_ptrs, as_ptrs, w_ptrs, w_off, s_off, nb_ok, kb): where `k_loop` starts for this tile.

    a_rows: each tile row's activation row (int64), stride_a apart; as_ptrs: each row's first
    activation scale (FP8, AGROUP columns per scale), stride_as apart. bf16/fp8 weights: w_ptrs at rows n of
    expert e64's [n_total, K] matrix. MXFP4: the MX tile offsets (mxfp4.tile_offsets; PAIRED: MX quads with
    paired residuals). SWAP (bf16 / fp8; MXFP4 always): the tiles of k_loop's swapped product, activation^T
    [BLOCK_K, BLOCK_M] and weights [BLOCK_N, BLOCK_K]. What a scheme does not use is returned unread (the bare
    pointers, zeros).
    """
    kk = tl.arange(0, BLOCK_K)
    if W4 or SWAP:  # activation^T tiles [BLOCK_K, BLOCK_M]
        a_ptrs = a_ptr + a_rows[None, :] * stride_a + kk[:, None]
    else:
        a_ptrs = a_ptr + a_rows[:, None] * stride_a + kk[None, :]
    as_ptrs, w_ptrs, w_off, s_off, nb_ok, kb = as_ptr, w_ptr, 0, 0, False, 0
    if W4:  # MX tiles, or MX quads for a8w4 (kernels/mxfp4.py), advanced per K step
        w_off, s_off, nb_ok, kb = tile_offsets(e64, pid_n, row_blocks, k_blocks, BLOCK_N, BLOCK_K, FP8, SCALED, PAIRED)
    elif SWAP:
        w_ptrs = w_ptr + e64 * n_total * K + n.to(tl.int64)[:, None] * K + kk[None, :]
    else:
        w_ptrs = w_ptr + e64 * n_total * K + n.to(tl.int64)[None, :] * K + kk[:, None]
    if FP8:
        as_ptrs = as_ptr + a_rows * stride_as
    return a_ptrs, as_ptrs, w_ptrs, w_off, s_off, nb_ok, kb


@triton.jit
def k_loop(a_ptrs, as_ptrs, stride_as_k, row_ok, w_ptr, ws_ptr, w_ptrs, ws_lo, ws_hi, ws_sel, n_ok, w_off, s_off, nb_ok,
           kb, k_blocks, K, k_lo, k_hi, a_desc, a_row, w_desc, w_row, AGROUP: tl.constexpr, FP8: tl.constexpr,
           W4: tl.constexpr, BIG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           INTERP: tl.constexpr, SCALED: tl.constexpr = False, TMA_A: tl.constexpr = False,
           TMA_W: tl.constexpr = False, PAIRED: tl.constexpr = False, ROW_SCALE: tl.constexpr = False,
           a_scale=1.0, QUANT_A: tl.constexpr = False, SWAP: tl.constexpr = False):
    """The fp32 accumulator of one tile over k in [k_lo, k_hi): [BLOCK_M, BLOCK_N], or [BLOCK_N, BLOCK_M] swapped
    (W4 always; SWAP for bf16 / fp8: acc^T += w @ a^T, so the weight tile is the MMA's wide left operand and
    Hopper's wgmma takes a few-row tile; unswapped, fewer than 64 rows compile to mma.sync, fp8 upcast to fp16).

    a_ptrs: activation tile pointers ([BLOCK_M, BLOCK_K], or [BLOCK_K, BLOCK_M] swapped) at k = 0;
    as_ptrs: each row's first activation scale (FP8), AGROUP columns per scale, the next K group's stride_as_k
    further (1 for row-major scales; GEMM2's are group-major, atom_moe/experts.py `Workspace`); w_ptrs: the bf16/fp8
    weight tile; ws_lo / ws_hi: the first K group's block scales of the tile's two kinds of columns (fp8:
    a tile spans at most two 128-blocks of weight rows), ws_sel [BLOCK_N]: the columns of the ws_hi kind,
    a function of tl.arange alone so that the compiler sees each register's kind; w_off, s_off, nb_ok, kb:
    the MX tile offsets (W4, from mxfp4.tile_offsets). Pointers of the unused kind are never read. k_lo > 0 (split-K)
    must be a multiple of BLOCK_K; K bounds the masks. SCALED: a8w4 through tl.dot_scaled
    (kernels/mxfp4.py); PAIRED: a8w4's residuals paired (w13, atom_moe/layouts/mx_quads.py); ROW_SCALE (a8w4's
    GEMM1): each row's activation scales are all one (atom_moe.spec.Scheme.x_per_token), so the K loop keeps one
    accumulator and the first is applied after it, the only one read (docs/perf/a8w4-one-accumulator-h100.md).
    QUANT_A (a8w4's pair blocks, with ROW_SCALE): a_ptrs are the bf16 rows and a_scale their one scale
    (routing.row_scale); each step rounds its tile to e4m3 as routing.quant_row would have, so no quantized copy
    is stored and read back.
    TMA_A (any scheme) / TMA_W
    (bf16, fp8): the activation tile comes from a_desc at rows
    [a_row, a_row + BLOCK_M) (they must be consecutive; rows that hold no pair load what is there, and
    their results are never stored), the weight tile from w_desc at rows [w_row, w_row + BLOCK_N) of
    [E * n_total, K] (rows past the expert's last belong to the next expert or are zeros: their
    columns are never stored), both through TMA (common.tile_desc).
    """
    kk = tl.arange(0, BLOCK_K)
    a_ptrs += k_lo
    if W4:  # the MX offsets start at k = 0: skip k_lo / BLOCK_K steps
        w_off += (k_lo // BLOCK_K) * ((BLOCK_K // 64) * 128)
        s_off += (k_lo // BLOCK_K) * scale_step(BLOCK_K, FP8, PAIRED)
    else:
        w_ptrs += k_lo
    SWAPPED: tl.constexpr = W4 or SWAP
    if SWAPPED:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # out^T
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if W4 and FP8:  # activation scales one K step ahead at up to 64 rows: a plain load would stall every step.
        # From 128 rows on, each thread holds 32+ token columns: the step's own scales are loaded at its top,
        # which spills less (a8w4 GEMM1 128 x 128 x 128: 132 B instead of 268 B) and shortens GEMM2 128 x 128's
        # loop from 342 to 282 instructions (sm_90a, scripts/kernel_sass.py)
        # an empty last split-K slice starts past K: its first scale is not read
        first = (tl.zeros([BLOCK_M], tl.int32) + k_lo) < K
        k_col = (k_lo // AGROUP) * stride_as_k
        if ROW_SCALE:  # the row's one scale: its first column (x_scale may be [T, 1])
            k_col = 0
        if QUANT_A:
            a_s_next = tl.zeros([BLOCK_M], tl.float32) + a_scale
        else:
            a_s_next = tl.load(as_ptrs + k_col, mask=row_ok & first, other=0.0)
        a_s_row = a_s_next  # ROW_SCALE: the row's one scale
    k_end = k_hi
    if W4:  # at least one step (an empty split-K slice loads only masked zeros): with a path that skips the
        # loop, its zeroed accumulator sat inside the wgmma pipeline and ptxas serialized every wgmma at the
        # 128 x 128 tiles (C7515, scripts/kernel_sass.py). bf16 and fp8 never were (200 tiles compiled), and
        # fp8 reads its scales unmasked along K: they keep the plain bound
        k_end = tl.maximum(k_hi, k_lo + BLOCK_K)
    for k0 in range(k_lo, k_end, BLOCK_K):
        k_ok = (k0 + kk) < K
        if SWAPPED and TMA_A:  # GEMM2's rows through TMA: off the LSU pipe, the fullest unit of a8w4's GEMMs
            a = tl.trans(a_desc.load([a_row, k0]))
        elif SWAPPED:
            a = tl.load(a_ptrs, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
            if QUANT_A:
                a = cast(tl.clamp(a.to(tl.float32) / a_scale, -FP8_MAX, FP8_MAX), tl.float8e4nv, INTERP)
        elif TMA_A:
            a = a_desc.load([a_row, k0])
        else:
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if W4:
            if FP8:
                if ROW_SCALE:
                    a_s = a_s_row  # unread: the step's product goes straight into the accumulator
                elif BLOCK_M >= 128:
                    a_s = tl.load(as_ptrs + (k0 // AGROUP) * stride_as_k, mask=row_ok, other=0.0)
                else:
                    a_s = a_s_next
                    # the scalar bound broadcast to [BLOCK_M] first: triton 3.9's interpreter rejects a mask
                    # that mixes a vector with a 0-d comparison ('mask has unsupported dtype')
                    more = (tl.zeros([BLOCK_M], tl.int32) + (k0 + BLOCK_K)) < K
                    a_s_next = tl.load(as_ptrs + ((k0 + BLOCK_K) // AGROUP) * stride_as_k, mask=row_ok & more,
                                       other=0.0)
                acc = swap_step(acc, a, a_s, w_ptr, ws_ptr, w_off, s_off, nb_ok, kb, k0, k_blocks,
                                BLOCK_N, BLOCK_M, BLOCK_K, FP8, BIG, INTERP, SCALED, PAIRED, ROW_SCALE)
            else:
                if a_ptrs.dtype.element_ty != tl.bfloat16:  # a16w4 dots in bf16
                    a = cast(a.to(tl.float32), tl.bfloat16, INTERP)
                acc = swap_step(acc, a, 0.0, w_ptr, ws_ptr, w_off, s_off, nb_ok, kb, k0, k_blocks,
                                BLOCK_N, BLOCK_M, BLOCK_K, FP8, BIG, INTERP)
            w_off += (BLOCK_K // 64) * 128
            s_off += scale_step(BLOCK_K, FP8, PAIRED)
        else:
            if TMA_W and SWAP:
                w = w_desc.load([w_row, k0])
            elif TMA_W:
                w = tl.trans(w_desc.load([w_row, k0]))
            elif SWAP:
                w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            else:
                w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if FP8:
                kb8 = k0 // QGROUP
                a_s = tl.load(as_ptrs + kb8 * stride_as_k, mask=row_ok, other=0.0)
                # two scalar loads and a select on a known column kind, not a load per column: ptxas then
                # folds the factors into one FFMA per accumulator element (the per-column load took a
                # shared-memory broadcast and an extra FMUL each: 35-70 % more K-loop instructions at 64- and
                # 128-row tiles on sm_90a, docs/perf/prefill-kloop-sass.md)
                w_s = tl.where(ws_sel, tl.load(ws_hi + kb8), tl.load(ws_lo + kb8))
                if SWAP:
                    acc += tl.dot(w, a) * (w_s[:, None] * a_s[None, :])
                else:
                    acc += tl.dot(a, w) * (a_s[:, None] * w_s[None, :])
            else:
                if a_ptrs.dtype.element_ty != tl.bfloat16:  # the bf16 scheme computes in bf16
                    a = cast(a.to(tl.float32), tl.bfloat16, INTERP)
                if SWAP:
                    acc = dot(w, a, acc, INTERP)
                else:
                    acc = dot(a, w, acc, INTERP)
            w_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
    if W4 and FP8 and ROW_SCALE:
        acc = acc * a_s_row[None, :]
    return acc


@triton.jit
def tile_finish(acc, rowexp_ptr, bias_ptr, e64, n, n_ok, n_total, FP8: tl.constexpr, W4: tl.constexpr,
                HAS_BIAS: tl.constexpr, SWAP: tl.constexpr = False):
    """k_loop's accumulator as [BLOCK_M, BLOCK_N] fp32 with the weights' row factors (MX quads) and
    bias (rows n of expert e64's n_total) applied: what both epilogues start from."""
    if W4 and FP8:  # MX quads: each row's 2^(base - 133)
        acc = acc * row_factor(rowexp_ptr, e64, n, n_ok, n_total)[:, None]
    if W4 or SWAP:
        acc = tl.trans(acc)  # the epilogue works on [BLOCK_M, BLOCK_N]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e64 * n_total + n, mask=n_ok, other=0.0)[None, :]
    return acc


@triton.jit
def gated_act(acc, alpha, limit, j_ok, OAI: tl.constexpr, CLAMP: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """GEMM1's activation on tile_finish's [BLOCK_M, BLOCK_N] (gate and up interleaved): [BLOCK_M, BLOCK_N // 2],
    zero in the columns j_ok leaves out. The clamped kinds clamp gate <= limit and |up| <= limit first; oai is
    gpt-oss's gate * sigmoid(alpha * gate) * (up + 1), else silu(gate) * up."""
    gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
    if OAI or CLAMP:
        # NaN must survive the clamp: min/clamp default to dropping it on GPUs (PTX min.f32)
        gate = tl.minimum(gate, limit, propagate_nan=tl.PropagateNan.ALL)
        up = tl.clamp(up, -limit, limit, propagate_nan=tl.PropagateNan.ALL)
    if OAI:
        act = gate * tl.sigmoid(alpha * gate) * (up + 1.0)
    else:
        act = gate * tl.sigmoid(gate) * up
    return tl.where(j_ok[None, :], act, 0.0)
