"""The fused experts step on one GPU: routing metadata, GEMM1 (+SwiGLU, +fp8 quant), GEMM2 (+combine).

Schemes: bf16, fp8 (e4m3 weights, 128x128 block scales), a16w4 (MXFP4 weights, bf16
activations) and a8w4 (MXFP4 weights as MX quads, e4m3 activations: one scale per token for the layer
input and, by default, for GEMM2's input (ATOM_MOE_A8W4_INTER); fp8 dots, see kernels/gemm1.py).

Three Triton launches per call at small T (two at T = 1: GEMM1 does the routing launch's work,
kernels/routing.py `PairBlocks`; ATOM_MOE_PAIR_BLOCKS=0 keeps the routing launch; a config that splits GEMM1's K
adds its second launch, as the heuristic does at T = 1 on shapes with few GEMM1 programs, kernels/tuning.py;
a8w4 adds its quant launch between the GEMMs, which also adds GEMM1's K slices where GEMM1 splits);
larger T adds a separate combine
(kernels/gemm2.py) and a second routing-sort launch (kernels/routing.py). No host sync,
every buffer in a `Workspace` that the caller may allocate once (`allocate_workspace`) and
pass in, so the forward is CUDA-graph capturable and the caller sees every allocation.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .formats import FP8_DTYPE
from .inputs import warn_fp32
from .spec import A8W4_INTER_FLAG, FP8_BLOCK, ActivationKind, MoESpec, Scheme
from .weights import PreparedWeights

if TYPE_CHECKING:
    from atom_moe.kernels.gemm2 import RemoteOutput
    from atom_moe.kernels.tuning import TileConfig

SUPPORTED = (Scheme.BF16, Scheme.FP8, Scheme.A16W4, Scheme.A8W4)


def choose_backend(scheme: Scheme, device: torch.device) -> str | None:
    """'triton' (graph-safe fused_experts) where it runs this scheme, 'torch' (experts_torch) on the CPU, else None."""
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "torch"
    if scheme in SUPPORTED:
        return "triton"
    return "torch" if device.type == "cpu" else None


PAIR_BLOCKS_FLAG = "ATOM_MOE_PAIR_BLOCKS"


def pair_blocks_flag() -> str:
    """ATOM_MOE_PAIR_BLOCKS: "" (unset) or "1" (the default: T = 1 calls skip the routing launch) or "0" (never).

    On since 2026-12-05: 1.02-1.18x faster than the routing launch at T = 1 in all 16 (shape, scheme) cells timed
    on an H100 (docs/perf/launch-h100.md); since a8w4's K loop rounds x itself (2026-12-07), 1.03-1.11x for a8w4
    on all nine served shapes on an H100 (docs/perf/mxfp4-h200.md)."""
    flag = os.environ.get(PAIR_BLOCKS_FLAG, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"{PAIR_BLOCKS_FLAG}={flag!r}: allowed are unset or 1 (the default: T = 1 in two launches) "
                         "or 0 (the routing launch at every T)")
    return flag


def launch_flags() -> str:
    """The launch flags this process sets away from their defaults ("ATOM_MOE_A8W4_INTER=group
    ATOM_MOE_PAIR_BLOCKS=0 ATOM_MOE_PDL=1 ATOM_MOE_TMA=1 ATOM_MOE_SWAP=1 (or 0)", or ""): benchmark rows carry
    them, so a time is never read as the default path's when it was not."""
    from atom_moe.kernels.common import PDL_FLAG, SWAP_FLAG, TMA_FLAG  # lazy: the package imports without Triton
    changed = [f"{A8W4_INTER_FLAG}=group"] if os.environ.get(A8W4_INTER_FLAG) == "group" else []
    changed += [f"{PAIR_BLOCKS_FLAG}=0"] if os.environ.get(PAIR_BLOCKS_FLAG) == "0" else []  # "1" is the default
    changed += [f"{flag}=1" for flag in (PDL_FLAG, TMA_FLAG) if os.environ.get(flag) == "1"]
    return " ".join(changed + [f"{SWAP_FLAG}={flag}" for flag in [os.environ.get(SWAP_FLAG)] if flag in ("0", "1")])


def _kernels():
    # Imported lazily: the package imports without Triton; only this path needs it.
    from atom_moe.kernels import common, gemm1, gemm2, inter_quant, routing, tuning
    return routing, gemm1, gemm2, tuning, common, inter_quant


@dataclass
class Workspace:
    """Every buffer the three kernels use, sized for up to `max_tokens` tokens."""

    max_tokens: int
    top_k: int
    num_local: int
    scheme: Scheme
    sorted_ids: torch.Tensor  # int32 [rows]: pair id per padded row, num_pairs = padding
    block_expert: torch.Tensor  # int32 [blocks]: local expert per row block, -1 = no work
    cursor: torch.Tensor  # int32 [E_l]: routing scatter cursors
    chunk_counts: torch.Tensor  # int32 [sort_chunks(max_tokens * top_k) * E_l]: split routing sort's histograms
    counters: torch.Tensor  # int32 [max_tokens * n_counters]: combine arrivals per (token, n-tile)
    n_counters: int
    partial: torch.Tensor  # fp32 [max_tokens * top_k, H]: weighted GEMM2 rows, combined in slot order
    inter: torch.Tensor  # bf16 or e4m3 [rows, I]: GEMM2's input
    # fp32 [rows, ceil(I/group)] (fp8: 128, a8w4: 64; Scheme.inter_group), stored group-major (stride (1, rows)):
    # a GEMM2 tile then reads each K step's scales of its consecutive rows as one run, not one load per row
    inter_scale: torch.Tensor | None
    x_q: torch.Tensor | None  # e4m3 [max_tokens, H] (fp8, a8w4)
    x_scale: torch.Tensor | None  # fp32 [max_tokens, ceil(H/128)] (fp8, a8w4)
    # bf16 [rows, I]: GEMM1's output before kernels/inter_quant.py puts it in `inter` (Scheme.inter_per_token)
    inter_wide: torch.Tensor | None = None

    def check(self, spec: MoESpec, num_tokens: int) -> None:
        """Raise ValueError unless this workspace fits `spec` and `num_tokens`."""
        mine = (self.top_k, self.num_local, self.scheme, self.partial.shape[1], self.inter.shape[1])
        theirs = (spec.top_k, spec.num_local_experts, spec.scheme, spec.hidden_size, spec.intermediate_size)
        if mine != theirs:
            raise ValueError(f"workspace (top_k, E_local, scheme, H, I) = {mine} does not match the spec {theirs}")
        if spec.scheme.inter_per_token != (self.inter_wide is not None):
            raise ValueError(f"the workspace was allocated with ATOM_MOE_A8W4_INTER="
                             f"{'group' if self.inter_wide is None else 'token'}, now it is "
                             f"{'token' if spec.scheme.inter_per_token else 'group'}: keep the flag, or allocate again")
        if num_tokens > self.max_tokens:
            raise ValueError(f"{num_tokens} tokens exceed the workspace's max_tokens={self.max_tokens}; "
                             f"allocate_workspace(spec, max_tokens>={num_tokens}, device)")


def allocate_workspace(spec: MoESpec, max_tokens: int, device: torch.device | str) -> Workspace:
    """Allocate (uninitialized) every buffer fused_experts needs for up to max_tokens tokens."""
    routing, _, _, tuning, _, _ = _kernels()
    if spec.scheme not in SUPPORTED:
        raise ValueError(f"fused_experts supports schemes {[s.value for s in SUPPORTED]}, got {spec.scheme.value}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    H, I, k, E_l = spec.hidden_size, spec.intermediate_size, spec.top_k, spec.num_local_experts
    pairs = max_tokens * k
    rows = routing.max_blocks(pairs, E_l, tuning.MAX_BLOCK_M) * tuning.MAX_BLOCK_M
    blocks = routing.max_blocks(pairs, E_l, tuning.MIN_BLOCK_M)
    n_counters = -(-H // tuning.MIN_BLOCK_N2)
    fp8 = spec.scheme.fp8_activations  # fp8 and a8w4: e4m3 activations per token group
    i32 = dict(dtype=torch.int32, device=device)
    return Workspace(
        max_tokens=max_tokens, top_k=k, num_local=E_l, scheme=spec.scheme,
        sorted_ids=torch.empty(rows, **i32), block_expert=torch.empty(blocks, **i32),
        cursor=torch.empty(E_l, **i32), chunk_counts=torch.empty(routing.sort_chunks(pairs) * E_l, **i32),
        counters=torch.empty(max_tokens * n_counters, **i32),
        n_counters=n_counters,
        # GEMM2's weighted rows; at decode sizes it holds MAX_SPLIT_K K slices of GEMM1's [pairs, 2I]
        # (borrowed while GEMM1 runs) or of GEMM2's [pairs, H] (kernels/gemm1.py, gemm2.py)
        partial=torch.empty(max(pairs, -(-tuning.MAX_SPLIT_K * min(pairs, tuning.SPLIT_MAX_PAIRS) * max(2 * I, H)
                                         // H)), H, dtype=torch.float32, device=device),
        inter=torch.empty(rows, I, dtype=FP8_DTYPE if fp8 else torch.bfloat16, device=device),
        inter_scale=torch.empty(-(-I // spec.scheme.inter_group), rows, dtype=torch.float32, device=device).t()
        if fp8 else None,
        x_q=torch.empty(max_tokens, H, dtype=FP8_DTYPE, device=device) if fp8 else None,
        x_scale=torch.empty(max_tokens, -(-H // FP8_BLOCK), dtype=torch.float32, device=device) if fp8 else None,
        inter_wide=torch.empty(rows, I, dtype=torch.bfloat16, device=device) if spec.scheme.inter_per_token else None,
    )


_device_names: dict[tuple[str, int | None], str] = {}


def device_name(device: torch.device) -> str:
    """The name tuned tables use for `device` (e.g. 'NVIDIA H200'); 'cpu' off CUDA."""
    key = (device.type, device.index)
    if key not in _device_names:
        _device_names[key] = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return _device_names[key]


def _check_inputs(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, spec: MoESpec,
                  allow_fp8: bool = False) -> None:
    if x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"fused_experts runs Triton kernels: x is on {x.device}; allowed: a CUDA device, "
                         f"or any device under TRITON_INTERPRET=1 (the CPU interpreter)")
    if x.dim() != 2 or x.shape[1] != spec.hidden_size:
        raise ValueError(f"x must be [T, H={spec.hidden_size}], got {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) + ((FP8_DTYPE,) if allow_fp8 else ()):
        raise ValueError(f"x dtype {x.dtype} not supported; allowed: bfloat16, float16, float32"
                         + (", float8_e4m3fn (with x_scale)" if allow_fp8 else ""))
    if x.stride(1) != 1:
        raise ValueError("x must have a contiguous last dim (stride(1) == 1)")
    expect = (x.shape[0], spec.top_k)
    if tuple(topk_ids.shape) != expect or tuple(topk_weights.shape) != expect:
        raise ValueError(f"topk_ids and topk_weights must be [T, top_k] = {list(expect)}, got "
                         f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids dtype {topk_ids.dtype} not supported; allowed: int32, int64")
    if topk_weights.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"topk_weights dtype {topk_weights.dtype} not supported; allowed: float32, bfloat16, float16")
    if not (topk_ids.is_contiguous() and topk_weights.is_contiguous()):
        raise ValueError("topk_ids and topk_weights must be contiguous")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device}, x on {x.device}; they must share a device")


def fused_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, weights: PreparedWeights,
                  spec: MoESpec, *, workspace: Workspace | None = None, config: TileConfig | None = None,
                  out: torch.Tensor | None = None, x_scale: torch.Tensor | None = None,
                  remote: RemoteOutput | None = None, combine: str | None = None,
                  pair_blocks: bool | None = None) -> torch.Tensor | None:
    """[T, H] in x.dtype: sum over top-k of weight * expert(x) for this rank's local experts.

    `config` (a kernels.tuning.TileConfig) overrides the table lookup; `out` (optional,
    [T, H] in x.dtype, last dim contiguous) receives the result. Used by the symm transport:
    `x_scale` marks x as already e4m3 per token-group-128 (fp8-activation schemes skip the
    quant; a8w4's is fp32 [T, 1], one scale per token: formats.quantize_fp8_per_token), and `remote`
    (kernels.gemm2.RemoteOutput) pushes the results to the source ranks instead; the call then returns None.
    `combine` forces GEMM2's top-k combine:
    "counter" (inside GEMM2) or "separate" (a fourth launch, local output only); default by
    pair count (kernels.gemm2.SEPARATE_MIN_PAIRS). `pair_blocks` skips the routing launch: each
    (token, slot) pair is its own row block and GEMM1 does the routing launch's per-token work
    (kernels/routing.py `PairBlocks`); by default on for T = 1 with a local output and unquantized x, where no
    expert can take two pairs of distinct ids, unless ATOM_MOE_PAIR_BLOCKS=0 (`pair_blocks_flag`): two launches
    (three where the config splits GEMM1's K; a8w4: three either way, its quant launch adding the K slices).
    """
    if spec.scheme not in SUPPORTED:
        raise ValueError(f"fused_experts supports schemes {[s.value for s in SUPPORTED]}, got {spec.scheme.value}")
    weights.check(spec)
    pre_quantized = x_scale is not None
    if pre_quantized:
        if not spec.scheme.fp8_activations or x.dtype != FP8_DTYPE:
            raise ValueError(f"x_scale means x is e4m3 for an fp8-activation scheme (fp8, a8w4); got x {x.dtype} "
                             f"for scheme {spec.scheme.value}")
        # a8w4's GEMM1 reads one scale per token: a per-group x_scale must not pass for it (it would run, wrong)
        groups, form = (1, "[T, 1] (a8w4: one scale per token)") if spec.scheme.x_per_token else \
            (-(-spec.hidden_size // FP8_BLOCK), "[T, ceil(H/128)]")
        if tuple(x_scale.shape) != (x.shape[0], groups) or x_scale.dtype != torch.float32:
            raise ValueError(f"x_scale must be fp32 {form} = [{x.shape[0]}, {groups}], got {x_scale.dtype} "
                             f"{tuple(x_scale.shape)}")
        _check_inputs(x, topk_weights, topk_ids, spec, allow_fp8=True)
    else:
        _check_inputs(x, topk_weights, topk_ids, spec)
        warn_fp32(x, "fused_experts")
    routing, gemm1, gemm2, tuning, common, inter_quant = _kernels()
    T, k, E_l = x.shape[0], spec.top_k, spec.num_local_experts
    if remote is not None:
        if out is not None:
            raise ValueError("fused_experts: pass either out or remote, not both")
    elif out is None:
        out = torch.empty(T, spec.hidden_size, dtype=torch.bfloat16 if pre_quantized else x.dtype, device=x.device)
    elif (out.shape != x.shape or out.dtype != (torch.bfloat16 if pre_quantized else x.dtype)
          or out.device != x.device or out.stride(1) != 1):
        raise ValueError(f"out must be [T, H] = {list(x.shape)} {torch.bfloat16 if pre_quantized else x.dtype} on "
                         f"{x.device} with a contiguous last dim, got {list(out.shape)} {out.dtype} on {out.device}")
    if combine not in (None, "counter", "separate"):
        raise ValueError(f"combine must be 'counter' or 'separate' (or None: by pair count), got {combine!r}")
    if combine == "separate" and remote is not None:
        raise ValueError("combine='separate' writes a local output; the symm transport's remote push needs 'counter'")
    if T == 0:
        return out
    if weights.w2.device != x.device:
        raise ValueError(f"weights are on {weights.w2.device}, x on {x.device}")
    cfg = config if config is not None else tuning.lookup(
        device_name(x.device), spec.scheme.value, spec.hidden_size, spec.intermediate_size, E_l, k, T)
    cfg.check(spec.scheme.value)
    common.check_ahead("GEMM2", cfg.ahead2, 1, x.device)  # before any launch: the device must have the prefetch
    ws = workspace if workspace is not None else allocate_workspace(spec, T, x.device)
    ws.check(spec, T)
    fp8 = spec.scheme.fp8_activations  # fp8 and a8w4
    quant = fp8 and not pre_quantized
    if pair_blocks is None:
        pair_blocks = T == 1 and remote is None and not pre_quantized and pair_blocks_flag() != "0"
    elif pair_blocks and (remote is not None or pre_quantized):
        raise ValueError("fused_experts: pair_blocks needs a local output and unquantized x (no remote, no x_scale)")
    pairs = routing.PairBlocks(topk_ids, weights.expert_map, x, out, ws.counters, ws.n_counters) if pair_blocks \
        else None
    # programmatic dependent launch (ATOM_MOE_PDL=1, NVIDIA sm_90+): GEMM1 and GEMM2 start while the launch before
    # them finishes; GEMM2 fetches its weights into L2 meanwhile. Local output only
    wide = spec.scheme.inter_per_token  # a8w4 unless ATOM_MOE_A8W4_INTER=group: GEMM1 bf16, a quant launch, GEMM2
    pdl = common.pdl(x.device) and remote is None and not wide  # PDL chains GEMM1 straight into GEMM2
    tma = common.tma(x.device)  # ATOM_MOE_TMA=1: bf16 / fp8 tiles through TMA descriptors
    if pairs is not None:
        n_blocks = T * k
    else:
        n_blocks = routing.max_blocks(T * k, E_l, cfg.block_m)
        routing.routing_metadata(topk_ids, weights.expert_map, E_l, cfg.block_m, ws.sorted_ids, ws.block_expert,
                                 ws.cursor, x, out, ws.counters, ws.n_counters,
                                 xq=ws.x_q if quant else None, xs=ws.x_scale if quant else None,
                                 sent=(remote.info, remote.capacity) if remote is not None else None,
                                 chunk_counts=ws.chunk_counts, pdl=pdl, row_scale=spec.scheme.x_per_token)
    act = spec.activation
    oai, clamp = act.kind is ActivationKind.SWIGLU_OAI, act.kind is ActivationKind.SWIGLU_CLAMP
    # the workspace holds max_tokens rows; GEMM1 takes its pair count from x's rows, so pass T of them
    x1, x1_scale = (x, x_scale) if pre_quantized else (ws.x_q[:T], ws.x_scale[:T]) if fp8 else (x, None)
    # split-K is a decode-size setting: a row picked for a nearby bucket may meet a larger call (T=16
    # from the T=8 row), which then runs the same tiles unsplit (kernels/gemm1.py check_split)
    decode = T * k <= tuning.SPLIT_MAX_PAIRS
    split_k = cfg.split_k1 if decode else 1
    finish = wide and split_k > 1  # one launch adds a8w4's K slices and quantizes (inter_quant.finish_rows)
    owners = (topk_ids, weights.expert_map) if pairs is not None else None  # whose rows GEMM1 wrote, for the quant
    gemm1.gemm1(x1, x1_scale, weights.w13, weights.w13_scale, weights.w13_bias,
                ws.sorted_ids, ws.block_expert, n_blocks, k, ws.inter_wide if wide else ws.inter,
                None if wide else ws.inter_scale,
                oai=oai, clamp=clamp, alpha=act.alpha, limit=act.limit,
                block_m=cfg.block_m, block_n=cfg.block_n1, block_k=cfg.block_k1,
                num_warps=cfg.warps1, num_stages=cfg.stages1, group_m=cfg.group_m, mx_big=weights.mx_scale_max > 128,
                w13_rowexp_t=weights.w13_rowexp, mx_flush=weights.mx_flush,
                split_k=split_k, partial=ws.partial, maxnreg=cfg.maxnreg1, pairs=pairs, pdl=pdl, tma=tma,
                slices_only=finish)
    if finish:
        inter_quant.finish_rows(ws.partial, split_k, weights.w13_rowexp, weights.w13_bias, ws.inter, ws.inter_scale,
                                ws.sorted_ids, ws.block_expert, n_blocks, cfg.block_m, T * k, oai=oai, clamp=clamp,
                                alpha=act.alpha, limit=act.limit, pairs=owners)
    elif wide:
        inter_quant.quantize_rows(ws.inter_wide, ws.inter, ws.inter_scale, ws.sorted_ids, ws.block_expert, n_blocks,
                                  cfg.block_m, T * k, owners)
    separate = remote is None and (combine == "separate" or (combine is None and T * k >= gemm2.SEPARATE_MIN_PAIRS))
    partial = gemm2.separate_partial(ws.partial, out) if separate else ws.partial
    split_k2 = cfg.split_k2 if decode and not separate and remote is None else 1
    gemm2.gemm2(ws.inter, ws.inter_scale, weights.w2, weights.w2_scale, weights.w2_bias,
                ws.sorted_ids, ws.block_expert, n_blocks, topk_ids, weights.expert_map, topk_weights,
                partial, ws.counters, ws.n_counters, out if out is not None else ws.partial,
                block_m=cfg.block_m, block_n=cfg.block_n2, block_k=cfg.block_k2,
                num_warps=cfg.warps2, num_stages=cfg.stages2, group_m=cfg.group_m, remote=remote,
                hidden=weights.hidden_size, mx_big=weights.mx_scale_max > 128,
                w2_rowexp=weights.w2_rowexp, mx_flush=weights.mx_flush, separate=separate, split_k=split_k2,
                maxnreg=cfg.maxnreg2, pairs=pairs is not None, pdl=pdl, tma=tma, row_scale=wide,
                ahead=cfg.ahead2)
    if separate:
        gemm2.combine(partial, topk_ids, weights.expert_map, out)
    return out
