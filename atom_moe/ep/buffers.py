"""Sizing of every persistent buffer the expert-parallel op allocates (one source of truth).

`buffer_plan` lists each buffer's name, shape and dtype; the op allocates exactly these,
so a test can assert that allocated bytes equal planned bytes and a planning tool can
print them without a GPU. With W = EP world size, C = max_tokens_per_rank (the capacity
per destination rank: the worst case, every local token sent to one rank), N = W * C,
H = hidden, k = top_k, G = ceil(H / 128):

torch transport (static-capacity all-to-all; row N of the send buffers is a dummy row
that absorbs the writes of (token, rank) pairs that are not sent):
    expert_owner   int64 [E + 1]        owning rank of each global expert, W for the sentinel slot
    rank_offsets   int64 [W]            r * C: first row of rank r's block
    send_x         wire  [N + 1, H]     tokens out (bf16, or e4m3 for the fp8 wire)
    send_meta      int32 [N + 1, 2k+G'] per row: k global ids, k fp32 weights (bit-cast), G' fp32 scales
    recv_x         wire  [N, H]         tokens in
    recv_meta      int32 [N, 2k+G']
    expert_ids     int32 [N, k]         contiguous ids for the experts step
    expert_w       fp32  [N, k]         contiguous weights for the experts step
    expert_x       bf16  [N, H]         fp8 wire only: dequantized tokens for the experts step
    combine_recv   bf16  [N + 1, H]     expert outputs back (row N stays zero: the dummy row)
    dest_index     int64 [C, W]         per token and rank: row in send/combine buffers, or N
    combine_acc    fp32  [C, H]         per-token sum over ranks
    combine_tmp    bf16  [C, H]         one rank's gathered rows
  G' = G for the fp8 wire, 0 for bf16.
symm transport (one-sided pushes; "symm." buffers live in the peer-mapped heap, each
starting SYMM_ALIGN-aligned, the rest are ordinary device memory):
    symm.recv_x      wire  [N, H]   tokens in, row s*C + t from source rank s
    symm.recv_scale  fp32  [N, G]   fp8 wire only
    symm.recv_ids    int32 [N, k]   global ids this rank owns, -1 for the other slots
    symm.recv_w      fp32  [N, k]   routing weights
    symm.recv_info   int32 [W, 2]   tokens sent and combine mode, per source rank
    symm.slots       bf16  [C*k, H] fused combine: one weighted row per (token, slot)
    symm.returned    bf16  [N, H]   split combine: one row per (rank, token)
    symm.flags       int64 [W]      barrier epochs signalled by each peer
    owner            int32 [E + 1]  owning rank of each expert, -1 for the sentinel slot
    peer_delta       int64 [W]      byte distance to each peer's heap mapping
    epoch            int64 [1]      barriers passed
    error            int32 [1]      barrier waits that gave up on a peer
local transport (EP = 1): no transport buffers.
With redundant experts (spec.redundant: P physical slots, R = P - N + 1) every table above
counts slots: E is P (expert_owner / owner [P + 1]); the workspace is sized for the P/W
local slots. Plus, on every transport, the routing tables (updated in place by a rebalance):
    slot_expert    int64 [P]            logical expert of each slot
    replica_slots  int64 [N + 1, R]     slots of each expert (-1 padded); row N: the sentinel slot P
    replica_count  int64 [N + 1]        replicas of each expert; 1 for the sentinel row
    pair_index     int64 [C, k]         (rank * C + t) * k + j: which replica a pair takes
    slot_ids       int64 [C, k]         the pairs' physical slot ids, written per forward
With the load statistic on (record_load=True):
    expert_load    int64 [N + 1]        (token, slot) pairs per logical expert since the last reset; N: sentinels
    load_ones      int64 [C * k]        the ones index_add_ adds
triton experts backend: plus, for the torch transport, expert_out bf16 [N, H] (the fused
experts' output, read by the combine all-to-all), and the experts workspace for N rows (C for local), named
"workspace.<field>", sized by atom_moe.experts.allocate_workspace on the meta device.

Every buffer must be addressable with int32 byte offsets (a Triton kernel that forgets an
int64 cast wraps silently past 2**31 - 1); `check_limits` enforces that and names the
largest max_tokens_per_rank that fits. The exceptions are the buffers in INT64_INDEXED,
whose every access computes offsets in int64 and has a GPU test past 2**31 bytes.
"""

from __future__ import annotations

from collections.abc import Callable

from dataclasses import dataclass

import torch

from ..formats import FP8_DTYPE
from ..spec import FP8_BLOCK, MoESpec

INT32_MAX = 2**31 - 1
WIRES = ("bf16", "fp8")
TRANSPORTS = ("local", "torch", "symm")
SYMM_ALIGN = 256  # bytes: every heap buffer starts at a multiple (vector loads, int64 flags)
BACKENDS = ("triton", "torch")
COMBINE_DTYPE = torch.bfloat16  # expert outputs travel back in bf16 on every wire


# name -> the GPU test that reaches past 2**31 bytes in it
INT64_INDEXED = {
    # GEMM2 writes and reads pair64 * H; the largest buffer by far (fp32, k rows per token)
    "workspace.partial": "tests/test_kernels_gpu.py::test_int64_partial_rows",
}


class BufferLimitError(ValueError):
    """A buffer plan that exceeds an int32 byte or index range."""


@dataclass(frozen=True)
class BufferSpec:
    """One persistent buffer: shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def wire_dtype(wire: str) -> torch.dtype:
    """The dtype of token rows on the wire."""
    return FP8_DTYPE if wire == "fp8" else torch.bfloat16


def scale_groups(spec: MoESpec, wire: str) -> int:
    """fp32 scales per token row on the wire: ceil(H/128) for fp8, 0 for bf16."""
    return -(-spec.hidden_size // FP8_BLOCK) if wire == "fp8" else 0


def _check_args(ep_size: int, max_tokens_per_rank: int, wire: str, transport: str, experts_backend: str) -> None:
    for name, value in (("ep_size", ep_size), ("max_tokens_per_rank", max_tokens_per_rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    for name, value, allowed in (("wire", wire, WIRES), ("transport", transport, TRANSPORTS),
                                 ("experts_backend", experts_backend, BACKENDS)):
        if value not in allowed:
            raise ValueError(f"unknown {name} {value!r}; allowed: {', '.join(allowed)}")
    if transport == "local" and ep_size != 1:
        raise ValueError(f"the local transport serves EP size 1 only, got ep_size={ep_size}; use transport='torch'")
    if transport == "symm" and experts_backend != "triton":
        raise ValueError("the symm transport's results are pushed by the Triton GEMM2: it needs "
                         "experts_backend='triton'")


def buffer_plan(spec: MoESpec, ep_size: int, max_tokens_per_rank: int, wire: str = "bf16", *,
                transport: str | None = None, experts_backend: str = "torch",
                record_load: bool = False) -> dict[str, BufferSpec]:
    """Every persistent buffer (name -> shape, dtype) of a MegaMoE op; see the module docstring."""
    transport = transport or ("local" if ep_size == 1 else "torch")
    _check_args(ep_size, max_tokens_per_rank, wire, transport, experts_backend)
    logical_experts, redundant = spec.num_experts, spec.redundant
    spec = spec.kernel_spec  # buffers count physical slots, not logical experts
    W, C, H, k, E = ep_size, max_tokens_per_rank, spec.hidden_size, spec.top_k, spec.num_experts
    N, G = W * C, scale_groups(spec, wire)
    plan: dict[str, BufferSpec] = {}
    if redundant:
        plan.update(
            slot_expert=BufferSpec((E,), torch.int64),
            replica_slots=BufferSpec((logical_experts + 1, E - logical_experts + 1), torch.int64),
            replica_count=BufferSpec((logical_experts + 1,), torch.int64),
            pair_index=BufferSpec((C, k), torch.int64),
            slot_ids=BufferSpec((C, k), torch.int64),
        )
    if record_load:
        plan.update(expert_load=BufferSpec((logical_experts + 1,), torch.int64),
                    load_ones=BufferSpec((C * k,), torch.int64))
    if transport == "torch":
        wd = wire_dtype(wire)
        plan.update(
            expert_owner=BufferSpec((E + 1,), torch.int64),
            rank_offsets=BufferSpec((W,), torch.int64),
            send_x=BufferSpec((N + 1, H), wd),
            send_meta=BufferSpec((N + 1, 2 * k + G), torch.int32),
            recv_x=BufferSpec((N, H), wd),
            recv_meta=BufferSpec((N, 2 * k + G), torch.int32),
            expert_ids=BufferSpec((N, k), torch.int32),
            expert_w=BufferSpec((N, k), torch.float32),
        )
        if wire == "fp8":
            plan["expert_x"] = BufferSpec((N, H), torch.bfloat16)
        plan.update(
            combine_recv=BufferSpec((N + 1, H), COMBINE_DTYPE),
            dest_index=BufferSpec((C, W), torch.int64),
            combine_acc=BufferSpec((C, H), torch.float32),
            combine_tmp=BufferSpec((C, H), COMBINE_DTYPE),
        )
    if transport == "symm":
        plan.update({
            "symm.recv_x": BufferSpec((N, H), wire_dtype(wire)),
            **({"symm.recv_scale": BufferSpec((N, G), torch.float32)} if wire == "fp8" else {}),
            "symm.recv_ids": BufferSpec((N, k), torch.int32),
            "symm.recv_w": BufferSpec((N, k), torch.float32),
            "symm.recv_info": BufferSpec((W, 2), torch.int32),
            "symm.slots": BufferSpec((C * k, H), COMBINE_DTYPE),
            "symm.returned": BufferSpec((N, H), COMBINE_DTYPE),
            "symm.flags": BufferSpec((W,), torch.int64),
            "owner": BufferSpec((E + 1,), torch.int32),
            "peer_delta": BufferSpec((W,), torch.int64),
            "epoch": BufferSpec((1,), torch.int64),
            "error": BufferSpec((1,), torch.int32),
        })
    if experts_backend == "triton":
        rows = C if transport == "local" else N
        if transport == "torch":  # the fused experts write here; the combine all-to-all reads it
            plan["expert_out"] = BufferSpec((N, H), COMBINE_DTYPE)
        plan.update({f"workspace.{name}": spec_ for name, spec_ in workspace_plan(spec, rows).items()})
    return plan


def workspace_plan(spec: MoESpec, rows: int) -> dict[str, BufferSpec]:
    """The fused experts' workspace for `rows` tokens, read off a meta-device allocation."""
    from ..experts import allocate_workspace  # lazy: needs Triton

    ws = allocate_workspace(spec, rows, "meta")
    return {name: BufferSpec(tuple(t.shape), t.dtype) for name, t in workspace_tensors(ws).items()}


def workspace_tensors(ws) -> dict[str, torch.Tensor]:
    """The tensors of an experts Workspace, by field name."""
    return {name: value for name, value in vars(ws).items() if isinstance(value, torch.Tensor)}


def buffer_sizes(spec: MoESpec, ep_size: int, max_tokens_per_rank: int, wire: str = "bf16", *,
                 transport: str | None = None, experts_backend: str = "torch",
                 record_load: bool = False) -> dict[str, int]:
    """Bytes of every persistent buffer of a MegaMoE op (name -> bytes); sum them for the total."""
    plan = buffer_plan(spec, ep_size, max_tokens_per_rank, wire, transport=transport,
                       experts_backend=experts_backend, record_load=record_load)
    return {name: b.nbytes for name, b in plan.items()}


def _violations(spec: MoESpec, ep_size: int, mtpr: int, wire: str, transport: str | None,
                experts_backend: str) -> list[str]:
    plan = buffer_plan(spec, ep_size, mtpr, wire, transport=transport, experts_backend=experts_backend)
    bad = [f"{name} {list(b.shape)} {str(b.dtype).removeprefix('torch.')} = {b.nbytes} bytes"
           for name, b in plan.items() if b.nbytes > INT32_MAX and name not in INT64_INDEXED]
    pairs = ep_size * mtpr * spec.top_k  # (token, expert) pairs one rank's experts step may receive
    if pairs > INT32_MAX:
        bad.append(f"{pairs} (token, expert) pairs")
    return bad


def largest_true(fits: Callable[[int], bool], upper: int) -> int:
    """The largest t in [0, upper] with fits(t), for a predicate true up to some point (0 if none)."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_limits(spec: MoESpec, ep_size: int, max_tokens_per_rank: int, wire: str = "bf16", *,
                 transport: str | None = None, experts_backend: str = "torch") -> None:
    """Raise BufferLimitError, naming the largest safe max_tokens_per_rank, if any buffer passes int32."""
    bad = _violations(spec, ep_size, max_tokens_per_rank, wire, transport, experts_backend)
    if not bad:
        return
    # plan sizes grow with max_tokens_per_rank: bisect the largest safe value
    lo = largest_true(lambda t: not _violations(spec, ep_size, t, wire, transport, experts_backend),
                      max_tokens_per_rank)
    raise BufferLimitError(
        f"max_tokens_per_rank={max_tokens_per_rank} with EP size {ep_size} (H={spec.hidden_size}, "
        f"I={spec.intermediate_size}, top_k={spec.top_k}, wire={wire}, experts={experts_backend}) needs buffers "
        f"past the int32 range (2**31 - 1 bytes or indices): {'; '.join(bad)}. "
        + (f"The largest safe max_tokens_per_rank is {lo}." if lo else
           "No max_tokens_per_rank fits: reduce the EP size or the layer.")
    )
