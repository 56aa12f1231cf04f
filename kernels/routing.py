"""Routing metadata: sort (token, slot) pairs by local expert, padded per expert to BLOCK_M.

One launch does all the per-call preparation the GEMMs need, so a small call stays at three
launches (this, GEMM1, GEMM2); at T = 1 GEMM1 can do it instead (PairBlocks: two launches, three
where GEMM1 splits K):
  program 0      : counts pairs per local expert, writes the padded sorted pair list and
                   the per-block expert table (-1 = no work);
  programs 1..   : one per (token, 1024-column chunk): zero the token's GEMM2 combine
                   counters, zero its output columns when no slot is local (nobody else
                   would write them), and for fp8 quantize its input per group of 128
                   (so GEMM1 streams e4m3; a8w4: per token, one chunk holding the whole
                   row). Chunks keep this at one memory round trip.
Program 0 walks every pair twice on one SM, so its time grows with T*k: 5-8 us per 1024
pairs on an H200 (120 us at 16k pairs, 312-495 us at 64k, 3% of the layer). Above
SPLIT_PAIRS pairs (and when the caller passes a `chunk_counts` scratch) the sort is spread
over two launches, one program per SORT_CHUNK pairs:
  launch A, programs 0..n_pc-1 : chunk c's pairs per local expert -> chunk_counts[c, :]
                                 (plain stores: each program owns its row);
            programs n_pc..    : the token programs above;
  launch B, program i          : every expert's padded row start and the pairs of chunks
                                 before i, summed from chunk_counts; scatters chunk i's pairs
                                 (sorted in registers by (expert, pair), so the order is
                                 stable), then writes block_expert and the padding rows of
                                 blocks [i*FILL_BLOCKS, (i+1)*FILL_BLOCKS). Real rows and
                                 padding rows are disjoint, so no store races another.
Both launches are `_routing_kernel` (a constexpr STEP picks the part), so tools that name
launches by kernel see "routing". Neither uses atomics or a cursor set by the other launch:
replaying either alone (atom-moe breakdown does) rewrites the same values.
Sizes are static functions of (T, top_k, E_l, BLOCK_M), so both paths are graph-capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import FP8_MAX, cast, checked_ids, e4m3_scale, interpreting, pdl_release

# Pairs above which the sort runs as two launches. Program 0 costs 5-8 us per 1024 pairs; on
# an H200 the split took DeepSeek-V3's routing from 122 to 43 us at 16k pairs and from 406 to
# 94 us at 64k (docs/perf/kernels-breakdown-h200.md). At or below 4096 it was not measured
# against the split; the threshold keeps decode-size calls (T <= 512 at top-8) on the one-launch
# path (T = 1 may skip this launch: PairBlocks). Symm receive rows (SENT) are sized by
# capacity W*C*k, not by the tokens that arrived, so they split above it even when few rows
# came (chunks of unsent rows read no ids; program 0 would read only the sent rows).
# Read at call time: tests lower it.
SPLIT_PAIRS = 4096
SORT_CHUNK = 1024  # pairs per split-sort program (a power of 2: one tl.sort in registers)
FILL_BLOCKS = 64  # row blocks whose padding and block_expert one launch-B program writes (multiple of 16)


@dataclass(frozen=True)
class PairBlocks:
    """A call routed without the sort: row block b is (token, slot) pair b alone, and GEMM1 does the
    routing launch's per-token work (kernels/gemm1.py `token_duties`). Meant for where no expert takes
    two pairs, as at T = 1: the layer is then two launches, three where GEMM1 splits K or for a8w4 (atom_moe.experts:
    ATOM_MOE_PAIR_BLOCKS)."""

    topk_ids: torch.Tensor  # [T, k]
    expert_map: torch.Tensor  # int32 [E]: local expert or -1
    x: torch.Tensor  # [T, H] the layer input (GEMM1 quantizes it for e4m3 activations)
    out: torch.Tensor  # [T, H] the layer output (rows no local expert writes are zeroed)
    counters: torch.Tensor  # int32 [>= T * n_counters]: GEMM2's combine counters, zeroed
    n_counters: int


def max_blocks(num_pairs: int, num_local: int, block_m: int) -> int:
    """Upper bound on the padded block count: each non-empty expert wastes < 1 block."""
    return num_pairs // block_m + min(num_local, num_pairs)


def sort_chunks(num_pairs: int) -> int:
    """Programs of the split sort (SORT_CHUNK pairs each); chunk_counts holds this many rows of E_l."""
    return triton.cdiv(num_pairs, SORT_CHUNK)


@triton.jit
def _row_sent(info_ptr, row, mask, capacity):
    """Receive rows of the symm transport: row s*C + t holds data only while t < tokens sent by s."""
    src = row // capacity
    sent = tl.load(info_ptr + src * 2, mask=mask, other=0)
    return mask & (row - src * capacity < sent)


@triton.jit
def _local_expert(ids_ptr, emap_ptr, pair, mask, num_experts, info_ptr, capacity, TOPK, SENT: tl.constexpr):
    """Local expert of each pair, -1 for sentinels (outside [0, E)), non-local experts and unsent rows."""
    if SENT:
        mask = _row_sent(info_ptr, pair // TOPK, mask, capacity)
    ok, gid = checked_ids(tl.load(ids_ptr + pair, mask=mask, other=-1), num_experts)
    ok = mask & ok
    loc = tl.load(emap_ptr + gid, mask=ok, other=-1)
    return tl.where(ok, loc, -1)


@triton.jit
def _source_pairs(info_ptr, src, capacity, num_pairs, TOPK: tl.constexpr, SENT: tl.constexpr):
    """(first pair, pair count) of one source's rows: SENT reads the count it sent, else all pairs."""
    if SENT:
        return src * capacity * TOPK, tl.load(info_ptr + src * 2) * TOPK
    else:
        return src * 0, num_pairs


@triton.jit
def _sort_program(ids_ptr, emap_ptr, sorted_ptr, block_expert_ptr, cursor_ptr, info_ptr, capacity, n_src,
                  num_pairs, num_experts, num_local, n_rows, n_blocks,
                  BLOCK_M: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr, BB: tl.constexpr,
                  TOPK: tl.constexpr, SENT: tl.constexpr):
    # Pass 1: histogram of local experts; bin num_local collects every pair that does no work.
    # SENT: only the rows each source actually sent are read (cost follows the tokens, not the capacity)
    counts = tl.zeros([NB], dtype=tl.int32)
    for src in range(0, n_src):
        base, src_pairs = _source_pairs(info_ptr, src, capacity, num_pairs, TOPK, SENT)
        for start in range(0, src_pairs, CHUNK):
            off = start + tl.arange(0, CHUNK)
            loc = _local_expert(ids_ptr, emap_ptr, base + off, off < src_pairs, num_experts, info_ptr, capacity,
                                TOPK, SENT)
            counts += tl.histogram(tl.where(loc >= 0, loc, num_local), NB)
    # Pass 2: padded per-expert row ranges (exclusive prefix sum); cursors start at each range.
    e = tl.arange(0, NB)
    counts = tl.where(e < num_local, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    row_end = tl.cumsum(padded, 0)
    row_start = row_end - padded
    tl.store(cursor_ptr + e, row_start, mask=e < num_local)
    # Every row starts as padding (pair id num_pairs); pass 3 overwrites the real ones.
    for start in range(0, n_rows, CHUNK):
        r = start + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + r, tl.zeros([CHUNK], dtype=tl.int32) + num_pairs, mask=r < n_rows)
    # Block b belongs to the expert whose block range holds it: the count of experts ending
    # at or before b (empty experts end where the previous one did, so they count too).
    # Owners only for the blocks in use, whose count follows the pairs that came, not the capacity:
    # a decode op sized for 128 tokens per rank spent 9 us per call walking its ~256 mostly empty
    # blocks 16 at a time on this one program at T = 1 (docs/perf/ep-instances-h200.md); the rest
    # get -1 (no work) in wide stores.
    blk_end = row_end // BLOCK_M
    total_blocks = tl.sum(padded, 0) // BLOCK_M
    for start in range(0, total_blocks, BB):
        b = start + tl.arange(0, BB)
        ended = (blk_end[None, :] <= b[:, None]) & (e[None, :] < num_local)
        owner = tl.sum(ended.to(tl.int32), 1)
        tl.store(block_expert_ptr + b, owner, mask=b < total_blocks)
    for start in range(total_blocks, n_blocks, CHUNK):
        b = start + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + b, tl.full([CHUNK], -1, tl.int32), mask=b < n_blocks)
    tl.debug_barrier()  # cursor and padding stores before the scatter below
    # Pass 3: scatter. The order inside an expert's rows is arrival order; it does not
    # change any result bit (each GEMM row is computed on its own, the combine sums in
    # slot order).
    for src in range(0, n_src):
        base, src_pairs = _source_pairs(info_ptr, src, capacity, num_pairs, TOPK, SENT)
        for start in range(0, src_pairs, CHUNK):
            off = start + tl.arange(0, CHUNK)
            pair = base + off
            loc = _local_expert(ids_ptr, emap_ptr, pair, off < src_pairs, num_experts, info_ptr, capacity,
                                TOPK, SENT)
            work = loc >= 0
            pos = tl.atomic_add(cursor_ptr + loc, tl.full([CHUNK], 1, tl.int32), mask=work)
            tl.store(sorted_ptr + pos, pair.to(tl.int32), mask=work)


@triton.jit
def _chunk_bins(ids_ptr, emap_ptr, chunk, num_pairs, num_experts, num_local, info_ptr, capacity,
                CHUNK: tl.constexpr, TOPK: tl.constexpr, SENT: tl.constexpr):
    """Bin of each pair of one split-sort chunk: its local expert, num_local for pairs that do no work."""
    pair = chunk * CHUNK + tl.arange(0, CHUNK)
    # SENT: unsent rows are masked like sentinels (their ids are never read)
    loc = _local_expert(ids_ptr, emap_ptr, pair, pair < num_pairs, num_experts, info_ptr, capacity, TOPK, SENT)
    return tl.where(loc >= 0, loc, num_local)


@triton.jit
def _count_program(chunk, ids_ptr, emap_ptr, counts_ptr, info_ptr, capacity, num_pairs, num_experts, num_local,
                   NB: tl.constexpr, CHUNK: tl.constexpr, TOPK: tl.constexpr, SENT: tl.constexpr):
    # Split sort, launch A: this chunk's pairs per local expert (the no-work bin is dropped).
    bins = _chunk_bins(ids_ptr, emap_ptr, chunk, num_pairs, num_experts, num_local, info_ptr, capacity,
                       CHUNK, TOPK, SENT)
    e = tl.arange(0, NB)
    tl.store(counts_ptr + chunk * num_local + e, tl.histogram(bins, NB), mask=e < num_local)


@triton.jit
def _scatter_program(pid, ids_ptr, emap_ptr, sorted_ptr, block_expert_ptr, counts_ptr, info_ptr, capacity,
                     num_pairs, num_experts, num_local, n_sort, n_blocks,
                     BLOCK_M: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr, FILL: tl.constexpr,
                     BB: tl.constexpr, CB: tl.constexpr, TOPK: tl.constexpr, SENT: tl.constexpr):
    # Split sort, launch B. Every program needs the global row ranges, so each sums the
    # n_sort x E_l counts itself (64 x 256 ints at T = 8192, top-8, 256 local experts:
    # L2-resident) rather than waiting on another program; the total grows as n_sort^2.
    e = tl.arange(0, NB)
    total = tl.zeros([NB], dtype=tl.int32)
    before = tl.zeros([NB], dtype=tl.int32)  # pairs of each expert in chunks < pid
    for c0 in range(0, n_sort, CB):
        c = c0 + tl.arange(0, CB)
        tile = tl.load(counts_ptr + c[:, None] * num_local + e[None, :],
                       mask=(c[:, None] < n_sort) & (e[None, :] < num_local), other=0)
        total += tl.sum(tile, 0)
        before += tl.sum(tl.where(c[:, None] < pid, tile, 0), 0)
    padded = (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    row_end = tl.cumsum(padded, 0)
    row_start = row_end - padded
    if pid < n_sort:
        # Scatter chunk pid: sort its (bin, position) keys (unique, so the sort is stable);
        # after sorting, position p of expert b goes to row_start[b] + before[b] + (p - first[b]).
        bins = _chunk_bins(ids_ptr, emap_ptr, pid, num_pairs, num_experts, num_local, info_ptr, capacity,
                           CHUNK, TOPK, SENT)
        hist = tl.histogram(bins, NB)
        first = tl.cumsum(hist, 0) - hist  # sorted position of each bin's first pair
        p = tl.arange(0, CHUNK)
        key = tl.sort(bins * CHUNK + p)
        sbin = key // CHUNK
        row = tl.gather(row_start + before - first, sbin, 0) + p
        tl.store(sorted_ptr + row, pid * CHUNK + key % CHUNK, mask=sbin < num_local)
    # Blocks [pid*FILL, (pid+1)*FILL): block_expert, and padding (num_pairs) in every row that
    # holds no pair: past its expert's count, or in a block past the last used one. The owner
    # of block b is the count of experts ending at or before b (as in _sort_program); the
    # experts before it are exactly those, so their padded sizes sum to its first row.
    blk_end = row_end // BLOCK_M
    total_blocks = tl.sum(padded, 0) // BLOCK_M
    for i in tl.static_range(FILL // BB):
        b = pid * FILL + i * BB + tl.arange(0, BB)
        ended = (blk_end[None, :] <= b[:, None]) & (e[None, :] < num_local)
        owner = tl.sum(ended.to(tl.int32), 1)
        used = b < total_blocks
        tl.store(block_expert_ptr + b, tl.where(used, owner, -1), mask=b < n_blocks)
        owner_start = tl.sum(tl.where(ended, padded[None, :], 0), 1)
        owner_count = tl.sum(tl.where(e[None, :] == owner[:, None], total[None, :], 0), 1)
        r = b[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        pad = (r - owner_start[:, None] >= owner_count[:, None]) | (b[:, None] >= total_blocks)
        tl.store(sorted_ptr + r, tl.zeros([BB, BLOCK_M], dtype=tl.int32) + num_pairs,
                 mask=pad & (b[:, None] < n_blocks))


@triton.jit
def _token_program(t, chunk, ids_ptr, emap_ptr, x_ptr, stride_x, xq_ptr, xs_ptr, out_ptr, stride_out,
                   counters_ptr, n_counters, num_experts, hidden, info_ptr, capacity,
                   TOPK: tl.constexpr, KP2: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                   GPC: tl.constexpr, CCHUNK: tl.constexpr, EMULATE: tl.constexpr, SENT: tl.constexpr):
    # One [GPC, GROUP] column chunk of one token: a single round trip, no serial loop over H.
    # SENT (symm receive rows): unsent rows do no work, and GEMM2 pushes its results to the
    # source ranks, so there is no local output row to zero.
    t64 = t.to(tl.int64)
    live = t >= 0
    if SENT:
        src = t // capacity
        live = (t - src * capacity) < tl.load(info_ptr + src * 2)
    if live:
        _token_work(t64, chunk, ids_ptr, emap_ptr, x_ptr, stride_x, xq_ptr, xs_ptr, out_ptr, stride_out,
                    counters_ptr, n_counters, num_experts, hidden, info_ptr, capacity,
                    TOPK, KP2, QUANT, GROUP, GPC, CCHUNK, EMULATE, SENT)


@triton.jit
def _token_work(t64, chunk, ids_ptr, emap_ptr, x_ptr, stride_x, xq_ptr, xs_ptr, out_ptr, stride_out,
                counters_ptr, n_counters, num_experts, hidden, info_ptr, capacity,
                TOPK: tl.constexpr, KP2: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                GPC: tl.constexpr, CCHUNK: tl.constexpr, EMULATE: tl.constexpr, SENT: tl.constexpr):
    if chunk == 0:
        zero_counters(t64, counters_ptr, n_counters, CCHUNK)
    n_local = local_slots(t64, ids_ptr, emap_ptr, num_experts, info_ptr, capacity, TOPK, KP2, SENT)
    if not SENT:
        if n_local == 0:
            zero_row(t64, chunk, out_ptr, stride_out, hidden, GROUP, GPC)
    if QUANT:
        if n_local > 0:  # a token no local expert reads needs no quantized copy
            quant_row(t64, chunk, x_ptr, stride_x, xq_ptr, xs_ptr, hidden, GROUP, GPC, EMULATE, QUANT == 2)


@triton.jit
def zero_counters(t64, counters_ptr, n_counters, CCHUNK: tl.constexpr):
    """Zero token t64's GEMM2 combine counters."""
    for start in range(0, n_counters, CCHUNK):
        c = start + tl.arange(0, CCHUNK)
        tl.store(counters_ptr + t64 * n_counters + c, tl.zeros([CCHUNK], dtype=tl.int32), mask=c < n_counters)


@triton.jit
def local_slots(t64, ids_ptr, emap_ptr, num_experts, info_ptr, capacity, TOPK, KP2: tl.constexpr, SENT: tl.constexpr):
    """How many of token t64's TOPK slots (TOPK <= KP2; a runtime value in GEMM1) go to a local expert."""
    j = tl.arange(0, KP2)
    loc = _local_expert(ids_ptr, emap_ptr, t64 * TOPK + j, j < TOPK, num_experts, info_ptr, capacity, TOPK, SENT)
    return tl.sum((loc >= 0).to(tl.int32), 0)


@triton.jit
def zero_row(t64, chunk, out_ptr, stride_out, hidden, GROUP: tl.constexpr, GPC: tl.constexpr):
    """Zero columns [chunk * GPC * GROUP, +GPC * GROUP) of output row t64 (a token no local expert writes)."""
    k = (chunk * GPC + tl.arange(0, GPC))[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    tl.store(out_ptr + t64 * stride_out + k, tl.zeros([GPC, GROUP], dtype=out_ptr.dtype.element_ty), mask=k < hidden)


@triton.jit
def _row_scale_of(v):
    """The one e4m3 scale of the values v (fp32, any shape): amax / 448, NaN where one is NaN or Inf."""
    return e4m3_scale(tl.max(tl.max(tl.abs(v), 1), 0), tl.sum(tl.sum(tl.abs(v) * 0.0, 1), 0))


@triton.jit
def row_scale(t64, x_ptr, stride_x, hidden, GROUP: tl.constexpr, GPC: tl.constexpr):
    """The one e4m3 scale of x row t64 (its first GPC * GROUP >= hidden columns): what quant_row stores with
    ROW_SCALE, for a K loop that quantizes the row itself (kernels/gemm1.py, a8w4's pair blocks)."""
    k = tl.arange(0, GPC)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    return _row_scale_of(tl.load(x_ptr + t64 * stride_x + k, mask=k < hidden, other=0.0).to(tl.float32))


@triton.jit
def quant_row(t64, chunk, x_ptr, stride_x, xq_ptr, xs_ptr, hidden, GROUP: tl.constexpr, GPC: tl.constexpr,
              EMULATE: tl.constexpr, ROW_SCALE: tl.constexpr = False):
    """e4m3 copy of columns [chunk * GPC * GROUP, +GPC * GROUP) of x row t64, one fp32 scale per GROUP (ROW_SCALE:
    the chunk is the whole row, and each group stores the row's one scale)."""
    g = chunk * GPC + tl.arange(0, GPC)
    k = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    km = k < hidden
    v = tl.load(x_ptr + t64 * stride_x + k, mask=km, other=0.0).to(tl.float32)
    if ROW_SCALE:
        scale = tl.zeros([GPC], tl.float32) + _row_scale_of(v)  # the row's, in every group
    else:
        scale = e4m3_scale(tl.max(tl.abs(v), 1), tl.sum(tl.abs(v) * 0.0, 1))
    q = tl.clamp(v / scale[:, None], -FP8_MAX, FP8_MAX)
    tl.store(xq_ptr + t64 * hidden + k, cast(q, xq_ptr.dtype.element_ty, EMULATE), mask=km)
    n_groups = tl.cdiv(hidden, GROUP)
    tl.store(xs_ptr + t64 * n_groups + g, scale, mask=g < n_groups)


@triton.jit
def _routing_kernel(ids_ptr, emap_ptr, sorted_ptr, block_expert_ptr, cursor_ptr, counts_ptr,
                    x_ptr, stride_x, xq_ptr, xs_ptr, out_ptr, stride_out, counters_ptr, n_counters,
                    info_ptr, capacity, n_src,
                    num_pairs, num_experts, num_local, n_rows, n_blocks, hidden, n_chunks, n_sort,
                    BLOCK_M: tl.constexpr, NB: tl.constexpr, CHUNK: tl.constexpr, BB: tl.constexpr,
                    TOPK: tl.constexpr, KP2: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                    GPC: tl.constexpr, EMULATE: tl.constexpr, SENT: tl.constexpr, STEP: tl.constexpr,
                    SCHUNK: tl.constexpr, FILL: tl.constexpr, CB: tl.constexpr, PDL_RELEASE: tl.constexpr):
    # QUANT: 0 none, 1 per 128-group, 2 per row (a8w4: the chunk is the whole row).
    # STEP 0: one launch (program 0 sorts); 1: split launch A (n_sort histogram programs);
    # 2: split launch B (scatter + padding). Programs past n_sort of steps 0 and 1 are token programs.
    pdl_release(PDL_RELEASE)  # GEMM1 may start: it waits for this launch before reading anything
    pid = tl.program_id(0)
    if STEP == 2:
        _scatter_program(pid, ids_ptr, emap_ptr, sorted_ptr, block_expert_ptr, counts_ptr, info_ptr, capacity,
                         num_pairs, num_experts, num_local, n_sort, n_blocks,
                         BLOCK_M, NB, SCHUNK, FILL, BB, CB, TOPK, SENT)
    elif pid < n_sort:
        if STEP == 0:
            _sort_program(ids_ptr, emap_ptr, sorted_ptr, block_expert_ptr, cursor_ptr, info_ptr, capacity,
                          n_src, num_pairs, num_experts, num_local, n_rows, n_blocks, BLOCK_M, NB, CHUNK, BB,
                          TOPK, SENT)
        else:
            _count_program(pid, ids_ptr, emap_ptr, counts_ptr, info_ptr, capacity, num_pairs, num_experts,
                           num_local, NB, SCHUNK, TOPK, SENT)
    else:
        _token_program((pid - n_sort) // n_chunks, (pid - n_sort) % n_chunks, ids_ptr, emap_ptr, x_ptr, stride_x,
                       xq_ptr, xs_ptr, out_ptr, stride_out, counters_ptr, n_counters, num_experts, hidden,
                       info_ptr, capacity, TOPK, KP2, QUANT, GROUP, GPC, 256, EMULATE, SENT)


def routing_metadata(topk_ids: torch.Tensor, expert_map: torch.Tensor, num_local: int, block_m: int,
                     sorted_ids: torch.Tensor, block_expert: torch.Tensor, cursor: torch.Tensor,
                     x: torch.Tensor, out: torch.Tensor | None, counters: torch.Tensor, n_counters: int,
                     xq: torch.Tensor | None = None, xs: torch.Tensor | None = None,
                     sent: tuple[torch.Tensor, int] | None = None,
                     chunk_counts: torch.Tensor | None = None, pdl: bool = False, row_scale: bool = False) -> None:
    """Fill sorted_ids / block_expert, zero counters and empty output rows, quantize x if xq given (one scale
    per 128-group, or with row_scale one per token stored once per group: atom_moe.spec.Scheme.x_per_token).

    sent = (recv_info, C): topk_ids are symm receive rows; row s*C + t counts only while
    t < recv_info[s, 0], and there is no output to zero (out may be None).
    chunk_counts (int32, >= sort_chunks(T*k) * num_local elements) enables the two-launch
    sort above SPLIT_PAIRS pairs; without it the sort is always the one-launch program 0. pdl: the last
    launch lets the next (GEMM1, launched with programmatic dependent launch) start early.
    """
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    n_blocks = max_blocks(num_pairs, num_local, block_m)
    quant = xq is not None
    # groups of 128 per token program: 1024 columns, or the whole row for one scale per row
    gpc = triton.next_power_of_2(triton.cdiv(x.shape[1], 128)) if quant and row_scale else 8
    n_chunks = triton.cdiv(x.shape[1], gpc * 128)
    split = chunk_counts is not None and num_pairs > SPLIT_PAIRS
    n_sort = sort_chunks(num_pairs) if split else 1
    if split and chunk_counts.numel() < n_sort * num_local:
        raise ValueError(f"chunk_counts holds {chunk_counts.numel()} ints, the split sort needs "
                         f"sort_chunks({num_pairs}) * {num_local} = {n_sort * num_local}")
    args = (topk_ids, expert_map, sorted_ids, block_expert, cursor, chunk_counts if split else cursor,
            x, x.stride(0), xq if quant else x, xs if quant else x, x if out is None else out,
            x.stride(0) if out is None else out.stride(0), counters, n_counters,
            sent[0] if sent else counters, sent[1] if sent else 1, sent[0].shape[0] if sent else 1,
            num_pairs, expert_map.shape[0], num_local, n_blocks * block_m, n_blocks, x.shape[1], n_chunks, n_sort)
    meta = dict(BLOCK_M=block_m, NB=triton.next_power_of_2(num_local + 1), CHUNK=1024, BB=16,
                TOPK=top_k, KP2=triton.next_power_of_2(top_k), QUANT=(2 if row_scale else 1) if quant else 0,
                GROUP=128, GPC=gpc,
                EMULATE=interpreting(), SENT=sent is not None, SCHUNK=SORT_CHUNK, FILL=FILL_BLOCKS, CB=8,
                num_warps=8)
    _routing_kernel[(n_sort + num_tokens * n_chunks,)](*args, STEP=1 if split else 0, PDL_RELEASE=pdl and not split,
                                                       **meta)
    if split:  # launch B: scatter programs and padding programs share the grid
        n_fill = triton.cdiv(n_blocks, FILL_BLOCKS)
        _routing_kernel[(max(n_sort, n_fill),)](*args, STEP=2, PDL_RELEASE=pdl, **meta)


def routing_metadata_torch(topk_ids: torch.Tensor, expert_map: torch.Tensor, num_local: int,
                           block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch twin: (sorted pair ids with padding = num_pairs, block expert ids with -1), stable order."""
    num_pairs = topk_ids.numel()
    flat = topk_ids.reshape(-1).long()
    valid = (flat >= 0) & (flat < expert_map.shape[0])
    loc = torch.where(valid, expert_map[flat.clamp(0, expert_map.shape[0] - 1)].long(), -1)
    n_blocks = max_blocks(num_pairs, num_local, block_m)
    sorted_ids = torch.full((n_blocks * block_m,), num_pairs, dtype=torch.int32)
    block_expert = torch.full((n_blocks,), -1, dtype=torch.int32)
    row, blk = 0, 0
    for e in range(num_local):
        pairs = (loc == e).nonzero().flatten()
        if pairs.numel() == 0:
            continue
        sorted_ids[row:row + pairs.numel()] = pairs.to(torch.int32)
        nb = -(-pairs.numel() // block_m)
        block_expert[blk:blk + nb] = e
        row, blk = row + nb * block_m, blk + nb
    return sorted_ids, block_expert
