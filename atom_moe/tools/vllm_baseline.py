"""vLLM 0.33's Triton fused_moe as a baseline beside ours in `atom-moe bench` (impl vllm, vllm-tuned).

The GPU machine has no vLLM and no network, so the bench loads vLLM's sources from a folder that
scripts/vllm_baseline_src.py unzips from the vllm wheel (never committed). From
fused_moe/fused_moe.py it takes, by name and unchanged, `fused_moe_kernel` (the @triton.jit
GEMM) with `write_zeros_to_output`, its launcher `invoke_fused_moe_triton_kernel` (grid, SWAP_AB,
BLOCK_SIZE_K clamp), `get_default_config` and `_prepare_expert_assignment` (the decode path that
skips the align step); from fused_moe/utils.py `enable_swap_ab` and `resolve_moe_use_td`. Each
function's own source (its AST node, compiled under the file's real name so Triton reads the
source from there) runs in a namespace holding what those functions name from the rest of vLLM:
small stand-ins for `current_platform`, `envs`, the logger, and our equivalents of vLLM's
compiled CUDA helpers, each with vLLM's contract:

  moe_align_block_size        one Triton program: counts, padded offsets, block experts, scatter
  silu_and_mul                Triton: silu(x[:, :d]) * x[:, d:], fp32 math, one rounding
  moe_sum                     torch.sum over top-k (vLLM's own op for top_k > 4)
  per_token_group_quant_fp8   Triton: scale = max(amax, 1e-10) / 448 per 128-group (no UE8M0)

`VllmMoE.forward` is the sequence of vLLM's fused_experts_impl (per-call buffers, quant, expert
assignment, GEMM1, activation, quant, GEMM2, moe_sum) with those pieces. Configs: `vllm` is
get_default_config; `vllm-tuned` is the table vLLM ships for this (E, N = I, device, dtype) or,
failing that, the nearest shipped table of the same device and dtype (see `tuned_table`; the fetched
sources hold vLLM's H100 and H200 tables), indexed by the
batch size nearest T, as vLLM does.
"""

from __future__ import annotations

import ast
import functools
import json
import math
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import triton
import triton.language as tl

from ..kernels.common import cast, interpreting

FUSED_MOE = Path("vllm/model_executor/layers/fused_moe")
TAKEN = {  # file -> the functions taken from it, unchanged
    "fused_moe.py": ("write_zeros_to_output", "fused_moe_kernel", "invoke_fused_moe_triton_kernel",
                     "get_default_config", "_prepare_expert_assignment"),
    "utils.py": ("enable_swap_ab", "resolve_moe_use_td"),
}
FP8_GROUP = 128  # vLLM's block-quant DeepSeek scheme: [128, 128] weight blocks, 128-groups of activations
MAX_REL_ERR = 1e-2  # the check before timing, against reference_rows: a few 1e-3 expected, a wrong baseline near 1
OURS_REL_ERR = 5e-2  # against atom_moe's output: fp8 quantizes GEMM2's input from bf16 (vLLM) or fp32 (ours), ~2% apart


class VllmSourceError(RuntimeError):
    """The vLLM source folder is missing or not the layout this baseline reads."""


# ---------------------------------------------------------------- our equivalents of vLLM's CUDA helpers
@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, total_ptr, cursor_ptr, numel, num_experts, max_padded,
                  max_blocks, BLOCK_SIZE: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr,
                  BCHUNK: tl.constexpr):
    # one program: its phases meet at barriers (global atomics and stores are visible within a CTA)
    offs_e = tl.arange(0, E_PAD)
    emask = offs_e < num_experts
    tl.store(cursor_ptr + offs_e, tl.zeros([E_PAD], tl.int32), mask=emask)
    tl.debug_barrier()
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
        ok = (offs < numel) & (e >= 0) & (e < num_experts)
        tl.atomic_add(cursor_ptr + e, tl.full([CHUNK], 1, tl.int32), mask=ok)
    tl.debug_barrier()
    counts = tl.load(cursor_ptr + offs_e, mask=emask, other=0, volatile=True)  # the atomics' results, not L1's
    padded = (counts + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    ends = tl.cumsum(padded, 0)
    tl.store(total_ptr, tl.sum(padded, 0))
    tl.debug_barrier()
    tl.store(cursor_ptr + offs_e, ends - padded, mask=emask)  # next free row of each expert
    for b0 in range(0, max_blocks, BCHUNK):
        blk = b0 + tl.arange(0, BCHUNK)
        row = blk * BLOCK_SIZE
        # a block's expert: how many experts' padded rows end at or before its first row
        e = tl.sum(((ends[None, :] <= row[:, None]) & emask[None, :]).to(tl.int32), 1)
        tl.store(expert_ids_ptr + blk, tl.where(e < num_experts, e, -1), mask=blk < max_blocks)
    for s0 in range(0, max_padded, CHUNK):
        offs = s0 + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.full([CHUNK], 0, tl.int32) + numel, mask=offs < max_padded)
    tl.debug_barrier()
    for start in range(0, numel, CHUNK):
        offs = start + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < numel, other=-1)
        ok = (offs < numel) & (e >= 0) & (e < num_experts)
        pos = tl.atomic_add(cursor_ptr + e, tl.full([CHUNK], 1, tl.int32), mask=ok)
        tl.store(sorted_ptr + pos, offs, mask=ok)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int,
                         expert_map: torch.Tensor | None = None, pad_sorted_ids: bool = False,
                         ignore_invalid_experts: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vLLM's moe_align_block_size contract: (sorted_ids, expert_ids, num_tokens_post_pad), int32.

    Each expert's slots (flat index into topk_ids) fill a run of rows padded to a multiple of
    block_size, experts in ascending order; padding rows hold topk_ids.numel(); expert_ids[b] is
    block b's expert (-1 past the last block); ids outside [0, num_experts) are dropped. The order
    of slots inside an expert's run is unspecified (atomics), as in vLLM's kernel.
    """
    if expert_map is not None or pad_sorted_ids:
        raise ValueError("moe_align_block_size: this stand-in supports expert_map=None and pad_sorted_ids=False "
                         "only (the single-GPU fused_experts path)")
    numel = topk_ids.numel()
    # vLLM's buffer sizes (its Python wrapper): worst case of padding every expert
    max_padded = numel + num_experts * (block_size - 1)
    if numel < num_experts:
        max_padded = min(numel * block_size, max_padded)
    max_blocks = triton.cdiv(max_padded, block_size)
    dev = topk_ids.device
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](topk_ids.reshape(-1), sorted_ids, expert_ids, total, cursor, numel, num_experts, max_padded,
                        max_blocks, BLOCK_SIZE=block_size, E_PAD=triton.next_power_of_2(num_experts), CHUNK=1024,
                        BCHUNK=16, num_warps=8)
    return sorted_ids, expert_ids, total


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < d
    g = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + d + cols, mask=m, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_o + cols, cast(y, out_ptr.dtype.element_ty, EMULATE), mask=m)


def silu_and_mul(out: torch.Tensor, x: torch.Tensor) -> None:
    """vLLM's silu_and_mul contract: out [M, d] = silu(x[:, :d]) * x[:, d:] for x [M, 2d]."""
    M, d = out.shape
    if x.shape != (M, 2 * d) or x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError(f"silu_and_mul: x {tuple(x.shape)} and out {tuple(out.shape)}; allowed: x [M, 2d], out [M, d], "
                         f"unit stride along the last dim")
    BLOCK = 1024
    _silu_mul_kernel[(M, triton.cdiv(d, BLOCK))](x, out, d, x.stride(0), out.stride(0), BLOCK=BLOCK,
                                                 EMULATE=interpreting())


def moe_sum(x: torch.Tensor, out: torch.Tensor) -> None:
    """vLLM's moe_sum contract: out [M, H] = x [M, top_k, H] summed over top_k (fp32 accumulation)."""
    torch.sum(x, dim=1, out=out)


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, cols, stride_x, eps, GROUP: tl.constexpr, EMULATE: tl.constexpr):
    g = tl.program_id(0)
    groups = cols // GROUP
    row = (g // groups).to(tl.int64)
    offs = tl.arange(0, GROUP)
    y = tl.load(x_ptr + row * stride_x + (g % groups) * GROUP + offs).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(y)), eps) * (1.0 / 448.0)
    q = tl.clamp(y / scale, -448.0, 448.0)
    tl.store(q_ptr + g.to(tl.int64) * GROUP + offs, cast(q, q_ptr.dtype.element_ty, EMULATE))
    tl.store(s_ptr + g, scale)


def per_token_group_quant_fp8(x: torch.Tensor, group_size: int, eps: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per_token_group_quant_fp8 contract (row-major scales, no UE8M0): (e4m3 [M, K], fp32 [M, K / group])."""
    M, K = x.shape
    if K % group_size or x.stride(1) != 1 or group_size != triton.next_power_of_2(group_size):
        raise ValueError(f"per_token_group_quant_fp8: x {tuple(x.shape)}, group {group_size}; allowed: K a multiple "
                         f"of a power-of-two group, unit stride along K")
    q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(M, K // group_size, dtype=torch.float32, device=x.device)
    if M:
        _group_quant_kernel[(M * (K // group_size),)](x, q, s, K, x.stride(0), eps, GROUP=group_size,
                                                      EMULATE=interpreting())
    return q, s


# ---------------------------------------------------------------- loading vLLM's functions
class _Platform:
    """The few `current_platform` questions the taken functions ask (a CUDA device of `capability`)."""

    def __init__(self, capability: tuple[int, int] | None) -> None:
        self.capability = capability

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_device_capability(self, cap: int | tuple[int, int]) -> bool:
        """vLLM compares major * 10 + minor with an int, or the pair with a tuple."""
        if self.capability is None:
            return False
        return (self.capability == tuple(cap)) if isinstance(cap, tuple) else (
            self.capability[0] * 10 + self.capability[1] == cap)


class _Logger:
    """vLLM's logger calls, silenced."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: None


def _unsupported(what: str):
    def fail(*args, **kwargs):
        raise NotImplementedError(f"vllm baseline: {what} is outside this baseline (bf16 and block fp8 only)")
    return fail


def load(src: Path, capability: tuple[int, int] | None = None) -> SimpleNamespace:
    """vLLM's functions (TAKEN) from the folder scripts/vllm_baseline_src.py made, in a namespace.

    capability: the device's (major, minor) as vLLM's platform reports it (None: the current CUDA
    device's, or no device under the interpreter); it decides SWAP_AB (sm_90 only).
    """
    src = Path(src)
    if capability is None and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
    ns: dict[str, Any] = dict(
        __name__="atom_moe_vllm_fused_moe", Any=Any, functools=functools, json=json, os=os, torch=torch,
        triton=triton, tl=tl, logger=_Logger(), current_platform=_Platform(capability),
        envs=SimpleNamespace(VLLM_BATCH_INVARIANT=False, VLLM_TRITON_USE_TD=None, VLLM_TUNED_CONFIG_FOLDER=None),
        next_power_of_2=triton.next_power_of_2, moe_align_block_size=moe_align_block_size,
        warn_if_moe_use_td_ineffective=lambda *args, **kwargs: None,
        set_triton_allocator=_unsupported("the tensor-descriptor path (VLLM_TRITON_USE_TD)"),
        should_moe_wna16_use_cuda=_unsupported("int4/int8 weight-only"))
    for fname, names in TAKEN.items():
        path = src / FUSED_MOE / fname
        if not path.is_file():
            raise VllmSourceError(f"--vllm-src {src}: no {FUSED_MOE / fname}; make the folder with "
                                  f"`python3 scripts/vllm_baseline_src.py` (vllm 0.33.0 wheel)")
        tree = ast.parse(path.read_text(), str(path))
        nodes = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names]
        missing = sorted(set(names) - {n.name for n in nodes})
        if missing:
            raise VllmSourceError(f"{path} lacks {missing}: not the vLLM 0.33 layout this baseline reads")
        # the real file name: Triton's jit reads each kernel's source back from it
        exec(compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec"), ns)
    ns["configs_dir"] = src / FUSED_MOE / "configs"
    return SimpleNamespace(**{k: v for k, v in ns.items() if not k.startswith("__")})


# ---------------------------------------------------------------- configs
TABLE_NAME = re.compile(r"E=(\d+),N=(\d+),device_name=([^,]+?)(?:,dtype=([^,]+?))?(?:,block_shape=\[(\d+),(\d+)\])?\.json")


def tuned_table(configs_dir: Path, E: int, N: int, dtype: str | None, block: list[int] | None,
                device: str) -> tuple[dict[int, dict], str] | None:
    """(batch size -> config, file name + how it was chosen), or None when vLLM ships no table of this kind.

    vLLM reads E=<E>,N=<N>,device_name=<device>[,dtype=..][,block_shape=..].json (device: the CUDA
    name with '_' for ' ', H200-family -> NVIDIA_H200). Without that file this takes the same device,
    dtype and block shape at the nearest (E, N): least |log2(E'/E)| + |log2(N'/N)|, then same E,
    then larger N.
    """
    device = device.replace(" ", "_")
    if "H200" in device.split("_"):
        device = "NVIDIA_H200"
    cands = []
    for path in sorted(Path(configs_dir).glob("*.json")):
        m = TABLE_NAME.fullmatch(path.name)
        if not m or m[3] != device or m[4] != dtype:
            continue
        if (None if m[5] is None else [int(m[5]), int(m[6])]) != block:
            continue
        e, n = int(m[1]), int(m[2])
        cands.append((abs(math.log2(e / E)) + abs(math.log2(n / N)), e != E, -n, path))
    if not cands:
        return None
    dist, _, _, path = min(cands)
    table = json.loads(path.read_text())
    table.pop("triton_version", None)
    how = "exact key" if dist == 0 else f"nearest shipped key to E={E},N={N}"
    return {int(k): v for k, v in table.items()}, f"{path.name} ({how})"


# ---------------------------------------------------------------- the layer
@dataclass
class VllmMoE:
    """One layer in vLLM's format, run with vLLM's fused_experts sequence; `config_name` says which config."""

    vllm: SimpleNamespace
    w1: torch.Tensor  # [E, 2I, H], gate rows then up rows (vLLM's w13)
    w2: torch.Tensor  # [E, H, I]
    w1_scale: torch.Tensor | None  # fp8: [E, 2I/128, H/128]
    w2_scale: torch.Tensor | None  # fp8: [E, H/128, I/128]
    top_k: int
    table: dict[int, dict] | None = None
    config_name: str = "get_default_config"

    @property
    def fp8(self) -> bool:
        """Block-fp8 weights (w8a8), else bf16."""
        return self.w1_scale is not None

    def with_tuned(self, device: str) -> "VllmMoE | None":
        """The same layer with vLLM's shipped tuned table (None when none fits: see tuned_table)."""
        E, N = self.w2.shape[0], self.w2.shape[2]
        found = tuned_table(self.vllm.configs_dir, E, N, "fp8_w8a8" if self.fp8 else None,
                            [FP8_GROUP, FP8_GROUP] if self.fp8 else None, device)
        return None if found is None else replace(self, table=found[0], config_name=found[1])

    def config(self, M: int) -> dict:
        """The kernel config for M tokens: the table's nearest batch size, or vLLM's default."""
        if self.table is not None:
            return dict(self.table[min(self.table, key=lambda b: abs(b - M))])
        E, H, N = self.w2.shape
        block = [FP8_GROUP, FP8_GROUP] if self.fp8 else None
        return self.vllm.get_default_config(M, E, N, H, self.top_k, "fp8_w8a8" if self.fp8 else None, block)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                stages: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        """[T, H] bf16: vLLM's fused_experts_impl (silu, no bias, no expert map) with our CUDA-helper stand-ins.

        stages: when given, receives copies of what the path stores between its GEMMs, "gate_up" [T, k, 2I] and
        "swiglu" [T, k, I] (bf16), for a check stage by stage (check)."""
        v, M, k = self.vllm, x.shape[0], self.top_k
        E, N, H = self.w1.shape
        block = [FP8_GROUP, FP8_GROUP] if self.fp8 else None
        cfg = self.config(M)
        # per-call buffers, as vLLM allocates them (cache1 and cache3 share memory)
        cache13 = torch.empty(M * k * max(N, H), device=x.device, dtype=x.dtype)
        cache1, cache3 = cache13[:M * k * N].view(M, k, N), cache13[:M * k * H].view(M, k, H)
        cache2 = torch.empty(M * k, N // 2, device=x.device, dtype=x.dtype)
        out = torch.empty_like(x)
        qx, xs = per_token_group_quant_fp8(x, FP8_GROUP) if self.fp8 else (x, None)
        sorted_ids, expert_ids, post_pad = v._prepare_expert_assignment(
            topk_ids, cfg, M, k, E, None, block_shape=block, ignore_invalid_experts=True,
            weights_host_resident=False)
        kw = dict(compute_type=tl.bfloat16, use_fp8_w8a8=self.fp8, use_int8_w8a8=False, use_int8_w8a16=False,
                  use_int4_w4a16=False, per_channel_quant=False, block_shape=block)
        v.invoke_fused_moe_triton_kernel(qx, self.w1, cache1, xs, self.w1_scale, topk_weights, sorted_ids, expert_ids,
                                         post_pad, False, k, cfg, **kw)
        silu_and_mul(cache2, cache1.view(-1, N))
        if stages is not None:  # cache1 is about to be overwritten: it shares memory with cache3
            stages.update(gate_up=cache1.clone(), swiglu=cache2.view(M, k, N // 2).clone())
        q2, s2 = per_token_group_quant_fp8(cache2, FP8_GROUP) if self.fp8 else (cache2, None)
        v.invoke_fused_moe_triton_kernel(q2, self.w2, cache3, s2, self.w2_scale, topk_weights, sorted_ids, expert_ids,
                                         post_pad, True, 1, cfg, **kw)
        moe_sum(cache3, out)
        return out


def from_prepared(vllm: SimpleNamespace, weights, spec) -> VllmMoE:
    """Our prepared bf16 / fp8 weights in vLLM's layout (gate rows before up rows); a copy of w13."""
    from ..layouts.gate_up import separate
    from ..spec import ActivationKind, Scheme
    scheme = Scheme(spec.scheme)
    if scheme not in (Scheme.BF16, Scheme.FP8):
        raise ValueError(f"vllm baseline: scheme {scheme.value}; allowed: bf16, fp8 (block 128x128 w8a8)")
    if spec.activation.kind is not ActivationKind.SWIGLU or spec.has_bias:
        raise ValueError("vllm baseline: only SwiGLU without biases (vLLM's silu fused_experts path)")
    if weights.num_local_experts != spec.num_experts:
        raise ValueError(f"vllm baseline: {weights.num_local_experts} of {spec.num_experts} experts are local; "
                         f"allowed: all (EP = 1)")
    H, I = spec.hidden_size, spec.intermediate_size
    if scheme is Scheme.FP8 and (H % FP8_GROUP or I % FP8_GROUP):
        raise ValueError(f"vllm baseline: fp8 with H={H}, I={I}; vLLM's block fp8 needs both multiples of "
                         f"{FP8_GROUP} (activation groups and whole scale blocks)")
    fp8 = scheme is Scheme.FP8
    return VllmMoE(vllm, separate(weights.w13).data, weights.w2,
                   separate(weights.w13_scale).data if fp8 else None, weights.w2_scale if fp8 else None, spec.top_k)


# ---------------------------------------------------------------- the check before timing
def _experts_hit(weights, topk_ids: torch.Tensor):
    """Per local expert these rows hit: its fp32 gate, up and down, and the (token, slot) pairs routed to it.
    Only the experts hit are dequantized: all of a large layer would not fit."""
    from ..reference import ReferenceWeights, local_experts_hit
    ref = ReferenceWeights.from_prepared(weights.restricted(local_experts_hit(weights, topk_ids)))
    for row, e in enumerate(ref.experts):
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        yield ref.gate[row], ref.up[row], ref.down[row], tokens, slots


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def _gate_up(spec, x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 of these rows as vLLM stores it: bf16 gate and up of the (fp8: per-128-group quantized) x."""
    xf = group_quant_dequant(x) if spec.scheme.fp8_activations else x.float()
    return _bf16(xf @ gate.T), _bf16(xf @ up.T)


def reference_stages(weights, spec, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     swiglu: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(GEMM1 [T, k, 2I], output [T, H]): fp32 references of these rows with vLLM's roundings, in one pass over
    the experts they hit; GEMM1 gate then up, zeros where no local expert is hit.

    atom_moe.reference's math on the dequantized weights, rounded where vLLM's path stores bf16:
    GEMM1's output, the SwiGLU output (which fp8 then quantizes per 128-group: from bf16, unlike
    our fused epilogue, which costs vLLM's fp8 ~2% against a reference quantizing from fp32) and
    GEMM2's weighted output; fp8 activations quantized by vLLM's rule (group_quant_dequant).

    swiglu: [T, k, I], the SwiGLU output a vLLM run stored; given, the output continues from it instead of the
    reference's own. fp8 needs it for a comparison that is not a lottery: a group's e4m3 scale follows its
    largest value, and when GEMM1's sum order moves that value across a bf16 rounding tie, all 128 codes of the
    group change (1.5e-2 of the row, seed 658876577 of test_vllm_layer_matches_reference). GEMM1 is then checked
    on its own against the first result.
    """
    T, k = topk_ids.shape
    gate_up = torch.zeros(T, k, 2 * spec.intermediate_size, dtype=torch.float32, device=x.device)
    out = torch.zeros(T, spec.hidden_size, dtype=torch.float32, device=x.device)
    for gate, up, down, tokens, slots in _experts_hit(weights, topk_ids):
        g, u = _gate_up(spec, x[tokens], gate, up)
        gate_up[tokens, slots] = torch.cat((g, u), dim=-1)
        a = _bf16(torch.nn.functional.silu(g) * u) if swiglu is None else swiglu[tokens, slots].float()
        if spec.scheme.fp8_activations:
            a = group_quant_dequant(a)
        out.index_add_(0, tokens, _bf16((a @ down.T) * topk_weights[tokens, slots].float().unsqueeze(1)))
    return gate_up, out


def reference_rows(weights, spec, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """[T, H] fp32: the output reference of these rows with vLLM's roundings (reference_stages)."""
    return reference_stages(weights, spec, x, topk_weights, topk_ids)[1]


def group_quant_dequant(a: torch.Tensor) -> torch.Tensor:
    """fp32 values of vLLM's per-128-group e4m3 activations: scale = max(amax, 1e-10) * (1 / 448) (vLLM's Triton
    quant multiplies by the reciprocal; atom_moe.formats divides, which moves ties: 0.2% of the values)."""
    g = a.float().reshape(*a.shape[:-1], -1, FP8_GROUP)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-10) * (1.0 / 448.0)
    return ((g / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).reshape(a.shape)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32; inf when a has a NaN or Inf."""
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def check(layer: VllmMoE, weights, spec, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
          ours: torch.Tensor | None, rows: int) -> str:
    """Run the layer on these inputs; compare its first `rows` rows with the fp32 reference and all rows with
    ours (when given). Returns the errors as text; raises RuntimeError above MAX_REL_ERR.

    Against the reference stage by stage: GEMM1's output on its own, then the output continued from vLLM's own
    SwiGLU output (reference_stages' `swiglu`: a bf16 tie in GEMM1 would otherwise rescale a whole fp8 group)."""
    stages: dict[str, torch.Tensor] = {}
    y = layer.forward(x, topk_weights, topk_ids, stages)
    n = min(rows, x.shape[0])
    ref_gate_up, ref = reference_stages(weights, spec, x[:n], topk_weights[:n], topk_ids[:n], stages["swiglu"][:n])
    err_gemm1 = rel(stages["gate_up"][:n], ref_gate_up)
    err = rel(y[:n], ref)
    text = f"vs reference ({n} rows) {err:.2e}, GEMM1 {err_gemm1:.2e}"
    ok = max(err, err_gemm1) <= MAX_REL_ERR  # also NaN
    if ours is not None:
        err_ours = rel(y, ours)
        text += f", vs atom_moe (all rows) {err_ours:.2e}"
        ok = ok and err_ours <= OURS_REL_ERR
    if not ok:
        raise RuntimeError(f"vllm baseline ({layer.config_name}) is wrong here: {text}; limits {MAX_REL_ERR} "
                           f"(reference), {OURS_REL_ERR} (atom_moe)")
    return text
