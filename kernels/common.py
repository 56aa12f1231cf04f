"""Pieces shared by the kernels: constants, tile order, bf16 dot, rounding cast, interpreter switch,
the split-K bounds, programmatic dependent launch (PDL), an L2 prefetch and TMA tile descriptors."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
from triton.tools.tensor_descriptor import TensorDescriptor

# Kernel-visible constants must be tl.constexpr globals.
FP8_MAX = tl.constexpr(448.0)  # largest finite e4m3
QGROUP = tl.constexpr(128)  # activation quant group / weight block edge
MAX_SPLIT_K = 8  # K slices of a split-K GEMM
SPLIT_MAX_PAIRS = 128  # (token, slot) pairs up to which a GEMM may split K (T <= 16 at top-8)


def check_split(gemm: str, split_k: int, num_pairs: int, n_out: int, k: int, block_k: int,
                partial: torch.Tensor | None) -> int:
    """split_k if `gemm` can split its K that many ways here (a decode batch, room in `partial`), else a ValueError."""
    if not isinstance(split_k, int) or not 1 <= split_k <= MAX_SPLIT_K:
        raise ValueError(f"{gemm} split_k must be an int in [1, {MAX_SPLIT_K}], got {split_k!r}")
    if split_k == 1:
        return 1
    if num_pairs > SPLIT_MAX_PAIRS:
        raise ValueError(f"{gemm} split_k={split_k} is for decode batches of at most {SPLIT_MAX_PAIRS} (token, slot) "
                         f"pairs, got {num_pairs}")
    if triton.cdiv(k, block_k) < split_k:
        raise ValueError(f"{gemm} split_k={split_k} exceeds the {triton.cdiv(k, block_k)} K steps of {block_k}")
    need = split_k * num_pairs * n_out
    if partial is None or partial.dtype != torch.float32 or partial.numel() < need:
        have = "none" if partial is None else f"{partial.numel()} {partial.dtype}"
        raise ValueError(f"{gemm} split_k={split_k} needs an fp32 partial buffer of split_k * pairs * {n_out} = {need} "
                         f"elements, got {have} (atom_moe.experts.allocate_workspace sizes it)")
    return split_k


MAX_AHEAD = 4096  # GEMM2's lookahead prefetch, in programs: further ahead, their tiles would outgrow any L2


def check_ahead(gemm: str, ahead: int, split: int, device: torch.device) -> None:
    """Raise ValueError unless `gemm` can prefetch `ahead` programs ahead here: an int in [0, MAX_AHEAD], an unsplit
    launch, and an NVIDIA sm_90+ device (its bulk L2 prefetch) or the interpreter (which skips the prefetch)."""
    if not isinstance(ahead, int) or not 0 <= ahead <= MAX_AHEAD:
        raise ValueError(f"{gemm} ahead must be an int in [0, {MAX_AHEAD}] (programs), got {ahead!r}")
    if ahead == 0:
        return
    if split > 1:
        raise ValueError(f"{gemm} ahead={ahead} prefetches whole-K weight tiles: allowed with split_k=1 only, got "
                         f"split_k={split}")
    if interpreting():
        return
    if device.type != "cuda" or torch.version.hip is not None or \
            _capability(device.index if device.index is not None else torch.cuda.current_device()) < (9, 0):
        raise ValueError(f"{gemm} ahead={ahead}: the L2 bulk prefetch is NVIDIA sm_90+ PTX; {device} takes 0")


def register_cap(maxnreg: int) -> dict:
    """Launch options for a per-thread register cap (0: none): Triton's maxnreg, a ptxas option (NVIDIA only)."""
    if not maxnreg:
        return {}
    if torch.version.hip is not None:
        raise ValueError(f"maxnreg={maxnreg}: the register cap is a ptxas (NVIDIA) option; HIP builds take 0")
    return {"maxnreg": maxnreg}


PDL_FLAG = "ATOM_MOE_PDL"


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl(device: torch.device) -> bool:
    """Whether launches on `device` use programmatic dependent launch: ATOM_MOE_PDL=1 on an NVIDIA GPU of
    compute capability 9.0 or later (off under the interpreter, on HIP and by default: not yet timed)."""
    flag = os.environ.get(PDL_FLAG, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"{PDL_FLAG}={flag!r}: allowed are 1 (GEMM1 and GEMM2 start while the launch before them "
                         "finishes; NVIDIA sm_90+) or 0 / unset (plain stream order)")
    if flag != "1" or device.type != "cuda" or torch.version.hip is not None or interpreting():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


SWAP_FLAG = "ATOM_MOE_SWAP"
SWAP_BELOW_ROWS = 64  # Hopper's wgmma is 64 rows tall: narrower bf16 / fp8 tiles compile to mma.sync


def swapped(block_m: int, fp8: bool) -> bool:
    """Whether bf16 / fp8 tiles of block_m rows run swapped (kernels/mainloop.py k_loop SWAP: out^T = w @ x^T, the
    weight tile as the MMA's tall operand), below SWAP_BELOW_ROWS rows: ATOM_MOE_SWAP unset swaps bf16's (the
    default since 2026-12-07: 0.997-1.044x the plain tiles' speed over nine shapes at T = 1-512 on an H100,
    docs/perf/swap-h100.md), 1 fp8's too (mixed there), 0 neither."""
    flag = os.environ.get(SWAP_FLAG, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"{SWAP_FLAG}={flag!r}: allowed are unset (bf16 tiles under {SWAP_BELOW_ROWS} rows compute "
                         "out^T = w @ x^T), 1 (fp8's too) or 0 (out = x @ w^T for both)")
    return block_m < SWAP_BELOW_ROWS and (flag == "1" or (flag == "" and not fp8))


TMA_FLAG = "ATOM_MOE_TMA"


def tma(device: torch.device) -> bool:
    """Whether the bf16 and fp8 GEMMs load their weight tiles, and GEMM2 of every scheme its activation rows, through
    TMA tensor descriptors: ATOM_MOE_TMA=1 on an NVIDIA GPU of compute capability 9.0 or later, or under the
    interpreter (which runs descriptor loads, for the tests); off on HIP and by default."""
    flag = os.environ.get(TMA_FLAG, "")
    if flag not in ("", "0", "1"):
        raise ValueError(f"{TMA_FLAG}={flag!r}: allowed are 1 (GEMM tiles through TMA descriptors where TMA can "
                         "address them; NVIDIA sm_90+) or 0 / unset (per-thread loads)")
    if flag != "1" or torch.version.hip is not None:
        return False
    if interpreting():
        return True
    return device.type == "cuda" and _capability(device.index if device.index is not None
                                                 else torch.cuda.current_device()) >= (9, 0)


def scale_strides(gemm: str, name: str, scale: torch.Tensor | None) -> tuple[int, int]:
    """(row stride, group stride) of an activation-scale tensor [rows, groups]; (0, 0) for none.

    The kernels read and write scales through these strides, so row-major and group-major layouts both work
    (the workspace keeps GEMM2's input group-major, atom_moe/experts.py `Workspace`), row slices of either
    too. Elements that overlap (a stride of 0, e.g. from expand) or neither dimension at unit stride are
    refused: GEMM1's stores through them would collide, and such a tensor is never what a caller meant."""
    if scale is None:
        return 0, 0
    (rows, groups), (s_row, s_group) = scale.shape, scale.stride()
    row_major = (s_group == 1 or groups == 1) and (s_row >= groups or rows == 1)
    group_major = (s_row == 1 or rows == 1) and (s_group >= rows or groups == 1)
    if not (row_major or group_major):
        raise ValueError(f"{gemm}: {name} {tuple(scale.shape)} has strides {(s_row, s_group)}: allowed are "
                         f"row-major (strides (>= {groups}, 1)) or group-major (strides (1, >= {rows})) layouts")
    return s_row, s_group


def tile_desc(t: torch.Tensor, rows: int, block: tuple[int, int]) -> TensorDescriptor | None:
    """A TMA descriptor over contiguous `t` seen as [rows, t.shape[-1]] that loads `block` tiles (zeros past its
    edges), or None where TMA cannot address it: base or row not a multiple of 16 bytes, or a tile edge above
    256 elements (TMA's largest box)."""
    cols = t.shape[-1]
    if not t.is_contiguous() or t.data_ptr() % 16 or cols * t.element_size() % 16 or t.numel() != rows * cols \
            or max(block) > 256:
        return None
    return TensorDescriptor(t, [rows, cols], [cols, 1], list(block))


def pdl_options(dependent: bool) -> dict:
    """Launch options of a kernel that waits on the launch before it through PDL (`dependent`), else none."""
    return {"launch_pdl": True} if dependent else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: block until the launch before this one has finished and its writes are visible."""
    if PDL:
        gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """With PDL: let the next launch's programs start (they wait for this launch to finish before reading
    what it writes)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptr, nbytes, NT: tl.constexpr):
    """Ask L2 for bytes [ptr, ptr + nbytes) (ptr 16-byte aligned) in NT bulk prefetches of whole 16-byte
    units, one per element (a hint: no data comes back, nothing waits; NVIDIA sm_90+ only)."""
    chunk = tl.cdiv(nbytes, NT * 16) * 16
    off = tl.arange(0, NT).to(tl.int64) * chunk
    size = (tl.minimum(chunk, nbytes - off) // 16 * 16).to(tl.int32)
    tl.inline_asm_elementwise("{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; "
                              "mov.u32 $0, 0; }", "=r,l,r", [ptr.to(tl.int64, bitcast=True) + off, size],
                              dtype=tl.int32, is_pure=False, pack=1)


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1: kernels then switch in workarounds for the interpreter's
    wrong bf16 dot and bf16/e4m3 rounding (see `dot` and `cast`)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def checked_ids(raw, num_experts):
    """(ok, ids as int32) of expert ids as loaded (int32 or int64): ok where in [0, num_experts), checked before
    the ids are narrowed (an int64 id 2^32 + e is a sentinel, not expert e); -1 where not ok."""
    ok = (raw >= 0) & (raw < num_experts)
    return ok, tl.where(ok, raw, -1).to(tl.int32)


@triton.jit
def tile_ids(n_blocks, n_tiles_n, GROUP_M: tl.constexpr, AHEAD: tl.constexpr = 0):
    """Grouped tile order: GROUP_M row blocks sweep all column tiles together, for L2 reuse. (pid_m, pid_n) of
    this program, or with AHEAD > 0 of the program AHEAD places after it (which must exist)."""
    pid = tl.program_id(0) + AHEAD
    per_group = GROUP_M * n_tiles_n
    first_m = (pid // per_group) * GROUP_M
    size = tl.minimum(n_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size
    pid_n = (pid % per_group) // size
    return pid_m, pid_n


@triton.jit
def dot(a, b, acc, INTERP: tl.constexpr):
    """acc + a @ b; INTERP (interpreter only) computes bf16 operands in fp32 (its bf16 dot is wrong)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def e4m3_scale(amax, nan):
    """The fp32 scale of an e4m3 group: amax / 448, 1 for an all-zero group. nan = sum(|v| * 0) over the group:
    NaN where it holds NaN or Inf, so the scale (and every value) goes NaN instead of turning into numbers
    (docs/formats.md), else 0."""
    return tl.where(amax > 0, amax / FP8_MAX, 1.0) + nan


@triton.jit
def cast(v, dtype: tl.constexpr, EMULATE: tl.constexpr):
    """fp32 -> dtype, round to nearest even (e4m3 inputs must already be within +-448).

    EMULATE (interpreter only): the interpreter's own casts truncate to bf16 (and flush bf16
    subnormals) and mis-round e4m3 ties and binade carries, so round in fp32 first; the bf16
    result is then a bitcast of the high half, the e4m3 cast is exact.
    """
    if EMULATE:
        if dtype == tl.bfloat16:
            bits = v.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            # bitcast, not .to(): the interpreter's own conversion also flushes bf16 subnormals
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        elif dtype == tl.float8e4nv:
            bits = v.to(tl.int32, bitcast=True)
            exp = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3 subnormals share exponent -6
            step = ((exp - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
            magic = step * 12582912.0  # 1.5 * 2**23 * step: adding it rounds to a multiple of step
            r = (tl.abs(v) + magic) - magic
            v = tl.where(bits < 0, r * -1.0, r)  # sign after rounding |v| (-r would be 0 - r: loses -0)
    return v.to(dtype)
