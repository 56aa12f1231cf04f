"""MegaMoE: the expert-parallel MoE op (dispatch -> local experts -> combine) with persistent buffers.

Lifecycle (docs/ep.md): build once per (spec, EP group, max_tokens_per_rank) -> warmup ->
[capture] -> per layer `bind(weights)` + `forward(x, topk_weights, topk_ids)` -> close().
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..inputs import warn_fp32
from ..placement import ExpertPlacement, home_tables, physical_ids, slot_moves
from ..spec import MoESpec, shared_map_problem
from ..weights import PreparedWeights
from .buffers import BACKENDS, TRANSPORTS, WIRES, buffer_plan, check_limits, workspace_tensors
from .paths import combine_mode
from .rebalance import move_slots, refresh_kernel_flags
from .symm import SymmTransport, cuda_heap, heap_nbytes, shm_heap
from .transports import LocalTransport, TorchTransport, Transport, allocate

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class MegaMoEError(ValueError):
    """Invalid use of the expert-parallel op; raised on every rank when any rank is at fault."""


@dataclass
class WarmupCase:
    """One warm-up batch and the op's output for it (tests compare it with the reference)."""

    name: str
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor
    out: torch.Tensor


def _backend_names(group: dist.ProcessGroup) -> str:
    return str(dist.get_backend(group)).lower()


class MegaMoE:
    """One expert-parallel MoE op serving every layer of one shape on one EP group.

    group: the EP process group (None: the default group if initialized, else EP size 1).
    cpu_group: a gloo group over the same ranks for host-side agreement (None: the EP
    group itself when it is gloo, else one is created here, collectively over the
    default group, and destroyed by close()).
    check_tokens: agree on every rank's token count before any device work (one tiny
    gloo all_gather per forward) so an overflow or invalid input on one rank raises on
    every rank. With False each rank checks only itself, and a peer's failure surfaces
    as a process-group timeout instead.
    placement: redundant experts only (spec.redundant): the replica tables routing uses;
    their physical_to_logical must be the spec's physical_experts. None: derived from the
    spec, each expert's replicas in slot order.
    record_load: keep the per-expert load statistic (`expert_load()`); off by default.
    """

    def __init__(self, spec: MoESpec, group: dist.ProcessGroup | None = None, *,
                 max_tokens_per_rank: int | None = None, transport: str = "auto", wire: str = "bf16",
                 experts_backend: str = "auto", device: torch.device | str | None = None,
                 cpu_group: dist.ProcessGroup | None = None, check_tokens: bool = True,
                 timeout: timedelta = timedelta(minutes=5), placement: ExpertPlacement | None = None,
                 record_load: bool = False) -> None:
        self.spec = spec
        self.kspec = spec.kernel_spec  # what transports, kernels and weights see: physical slots
        self.record_load = bool(record_load)
        self.placement = placement
        self.max_tokens_per_rank = spec.max_tokens_per_rank if max_tokens_per_rank is None else max_tokens_per_rank
        self.check_tokens = check_tokens
        self.device = _normalize_device(device)
        self._closed = False
        self._weights: PreparedWeights | None = None
        # A TileConfig that replaces the tuned-table lookup (atom-moe tune times candidates this way);
        # None: the kernels look their config up as usual.
        self.tile_config = None
        # FUSED or SPLIT (atom_moe.ep.symm) to force the symm transport's combine mode (benchmarks,
        # tests); None: the measured thresholds of atom_moe.ep.paths decide per call.
        self.combine_override: int | None = None
        self._owned_cpu_group = False
        self.group, self.rank, self.world = self._resolve_group(group)
        self.cpu_group = self._resolve_cpu_group(cpu_group, timeout) if self.world > 1 else None
        try:
            self._build(transport, wire, experts_backend)
        except BaseException:
            if self._owned_cpu_group:  # a failed build leaves no group behind
                dist.destroy_process_group(self.cpu_group)
            raise

    def _build(self, transport: str, wire: str, experts_backend: str) -> None:
        spec = self.spec
        problem = self._local_build_problem(transport, wire, experts_backend) or self._placement_problem()
        owners = self._agree_at_build(problem)  # raises on every rank if any rank is at fault
        self.wire = wire
        self.experts_backend = self._resolve_backend(experts_backend)
        self.transport_name = self._resolve_transport(transport)
        check_limits(spec, self.world, self.max_tokens_per_rank, wire, transport=self.transport_name,
                     experts_backend=self.experts_backend)  # same inputs on every rank: all raise alike

        plan = buffer_plan(spec, self.world, self.max_tokens_per_rank, wire, transport=self.transport_name,
                           experts_backend=self.experts_backend, record_load=self.record_load)
        self.buffers = allocate({n: b for n, b in plan.items() if not n.startswith(("workspace.", "symm."))},
                                self.device)
        self._init_routing_tables()
        self.transport: Transport | SymmTransport
        if self.transport_name == "local":
            self.transport = LocalTransport(self.max_tokens_per_rank)
        elif self.transport_name == "symm":
            layout = {n: b for n, b in plan.items() if n.startswith("symm.")}
            heap = (cuda_heap(heap_nbytes(layout), self.group, self.device) if self.device.type == "cuda"
                    else shm_heap(heap_nbytes(layout), self.cpu_group))
            self.buffers.update(heap.views(layout))
            self.transport = SymmTransport(self.kspec, self.rank, self.world, self.max_tokens_per_rank, wire, owners,
                                           self.buffers, heap)
            # every peer zeroed its heap before anyone may push into it
            dist.barrier(group=self.cpu_group)
        else:
            self.transport = TorchTransport(self.kspec, self.group, self.rank, self.world, self.max_tokens_per_rank,
                                            wire, owners, self.buffers)
        self._workspace = None
        if self.experts_backend == "triton":
            from ..experts import allocate_workspace
            with torch.inference_mode(False), torch.no_grad():
                self._workspace = allocate_workspace(self.kspec, self.transport.rows, self.device)
            self.buffers.update({f"workspace.{n}": t for n, t in workspace_tensors(self._workspace).items()})
        # host-side agreement buffers: [num_tokens, error flag, capacity] per rank, reused every call; the
        # capacity tells apart ops of one shape and group (MegaMoEInstances) that ranks must pick alike
        self._mine = torch.zeros(3, dtype=torch.int64)
        self._all = [torch.zeros(3, dtype=torch.int64) for _ in range(self.world)]

    # ------------------------------------------------------------------ build helpers
    def _placement_problem(self) -> str | None:
        """What is wrong with the replica tables (redundant experts), or None; also fills self.placement."""
        s = self.spec
        if not s.redundant:
            return None if self.placement is None else (
                "placement= (replica tables) needs a spec with redundant experts: build it with "
                "spec.for_rank(rank, world, physical_experts=placement.slots())")
        if self.placement is None:
            self.placement = ExpertPlacement.from_map(s.placement.physical_experts, s.num_experts)
        if not isinstance(self.placement, ExpertPlacement):
            return f"placement must be an ExpertPlacement, got {type(self.placement).__name__}"
        problem = self.placement.problem(s.num_experts, self.world)
        if problem is None and self.placement.slots() != s.placement.physical_experts:
            problem = ("placement.physical_to_logical differs from the spec's physical_experts (the weights are "
                       "prepared for the spec's map): pass the same map to both")
        return None if problem is None else f"replica tables: {problem}"

    def _init_routing_tables(self) -> None:
        """Fill the redundant-expert routing tables and the load statistic's buffers (once, at build)."""
        b, s = self.buffers, self.spec
        with torch.inference_mode(False), torch.no_grad():
            if self.record_load:
                b["expert_load"].zero_()
                b["load_ones"].fill_(1)
            if not s.redundant:
                return
            C, k = self.max_tokens_per_rank, s.top_k
            pairs = torch.arange(C * k, dtype=torch.int64).view(C, k) + self.rank * C * k
            b["pair_index"].copy_(pairs)
            b["slot_ids"].fill_(s.num_physical_experts)
            self._write_tables(self.placement)

    def _write_tables(self, placement: ExpertPlacement) -> None:
        """Copy a placement into the persistent routing tables in place (addresses unchanged)."""
        b, N, P = self.buffers, self.spec.num_experts, self.spec.num_physical_experts
        # shared experts: every rank holds one, so a token's shared slots are served at home
        table, count = home_tables(placement, self.rank, self.world, self.spec.shared_ids)
        with torch.inference_mode(False), torch.no_grad():
            b["slot_expert"].copy_(placement.physical_to_logical)
            b["replica_slots"][:N].copy_(table)
            b["replica_slots"][N].fill_(-1)
            b["replica_slots"][N, 0] = P  # sentinel ids go to slot P, which no rank owns
            b["replica_count"][:N].copy_(count)
            b["replica_count"][N] = 1

    def _resolve_group(self, group):
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        if group is None:
            world, rank = 1, 0
        else:
            world, rank = dist.get_world_size(group), dist.get_rank(group)
        return group, rank, world

    def _resolve_cpu_group(self, cpu_group, timeout):
        if cpu_group is not None:
            return cpu_group
        if "gloo" in _backend_names(self.group) and "nccl" not in _backend_names(self.group):
            return self.group
        ranks = dist.get_process_group_ranks(self.group)
        self._owned_cpu_group = True
        # collective over the default group: every process must build its op at the same point
        return dist.new_group(ranks, backend="gloo", timeout=timeout)

    def _local_build_problem(self, transport: str, wire: str, experts_backend: str) -> str | None:
        mtpr, p = self.max_tokens_per_rank, self.spec.placement
        if (p.rank, p.world_size) != (self.rank, self.world):
            return (f"the spec's placement is rank {p.rank} of {p.world_size} but this process is rank {self.rank} "
                    f"of {self.world} in the EP group; build the spec with spec.for_rank({self.rank}, {self.world})")
        if not isinstance(mtpr, int) or isinstance(mtpr, bool) or mtpr < 1:
            return f"max_tokens_per_rank must be a positive int, got {mtpr!r}"
        for name, value, allowed in (("transport", transport, ("auto",) + TRANSPORTS), ("wire", wire, WIRES),
                                     ("experts_backend", experts_backend, ("auto",) + BACKENDS)):
            if value not in allowed:
                return f"unknown {name} {value!r}; allowed: {', '.join(allowed)}"
        if transport == "local" and self.world != 1:
            return (f"transport='local' serves EP size 1 only; this EP group has {self.world} ranks: "
                    f"use 'torch' or 'auto'")
        if wire == "fp8" and (transport == "local" or (transport == "auto" and self.world == 1)):
            return ("wire='fp8' needs a transport that moves tokens; EP size 1 uses the local transport, which has "
                    "no wire: pass wire='bf16' (or transport='torch' to quantize on a 1-rank all-to-all)")
        if transport == "symm":
            if self.group is None:
                return "transport='symm' needs an initialized torch.distributed process group"
            if experts_backend == "torch":
                return "transport='symm' pushes results from the Triton GEMM2: use experts_backend='triton' or 'auto'"
            if self.device.type == "cuda" and not _symm_memory_available():
                return "transport='symm' needs torch.distributed._symmetric_memory, which this torch lacks"
            if self.device.type == "cpu" and not _triton_interpreter():
                return ("transport='symm' on the CPU runs its Triton kernels under TRITON_INTERPRET=1 only "
                        "(tests); use 'torch'")
            if wire == "fp8" and not self.spec.scheme.fp8_activations:
                return (f"transport='symm' with wire='fp8' feeds fp8-activation schemes (fp8, a8w4) only; scheme "
                        f"{self.spec.scheme.value} computes on bf16 activations: use wire='bf16'")
        if transport == "torch" or (transport == "auto" and self.world > 1):
            if self.group is None:
                return "transport='torch' needs an initialized torch.distributed process group"
            names = _backend_names(self.group)
            if self.device.type == "cuda" and "nccl" not in names:
                return f"CUDA buffers need an NCCL EP group for the torch transport, got backend {names!r}"
            if self.device.type == "cpu" and "gloo" not in names:
                return f"CPU buffers need a gloo EP group for the torch transport, got backend {names!r}"
        if experts_backend == "triton" and self.device.type != "cuda" and not _triton_interpreter():
            return "experts_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1); use 'torch' on the CPU"
        return None

    def _agree_at_build(self, problem: str | None) -> list[int]:
        """Exchange each rank's view; raise the same error everywhere on any mismatch; return expert owners."""
        s, ks = self.spec, self.kspec
        tables = None if problem or self.placement is None else [t.tolist() for t in (
            self.placement.physical_to_logical, self.placement.logical_to_physical, self.placement.replica_count)]
        mine = dict(problem=problem, mtpr=self.max_tokens_per_rank, local=list(ks.local_experts), tables=tables,
                    layer=(s.hidden_size, s.intermediate_size, s.num_experts, s.num_physical_experts, s.top_k,
                           s.scheme.value, s.activation, s.has_bias))
        views = [mine]
        if self.world > 1:
            views = [None] * self.world
            dist.all_gather_object(views, mine, group=self.cpu_group)
        problems = [f"rank {r}: {v['problem']}" for r, v in enumerate(views) if v["problem"]]
        if problems:
            raise MegaMoEError("MegaMoE build failed: " + "; ".join(problems))
        mtprs = [v["mtpr"] for v in views]
        if len(set(mtprs)) > 1:
            raise MegaMoEError("max_tokens_per_rank must be identical on every EP rank, got "
                               + ", ".join(f"rank {r}: {m}" for r, m in enumerate(mtprs)))
        layers = [v["layer"] for v in views]
        if any(layer != layers[0] for layer in layers):
            per_rank = "; ".join(f"rank {r}: {x}" for r, x in enumerate(layers))
            raise MegaMoEError("every EP rank must build the op for the same layer shape; (H, I, E, P, top_k, "
                               f"scheme, activation, has_bias) per rank: {per_rank}")
        if any(v["tables"] != views[0]["tables"] for v in views):
            raise MegaMoEError("every EP rank must build the op with the same physical map and replica tables; "
                               "they differ between ranks " + str([r for r, v in enumerate(views)
                                                                  if v["tables"] != views[0]["tables"]]))
        s = ks  # the placements partition the physical slots (the experts themselves without redundancy)
        owner_of: dict[int, list[int]] = {}
        for r, v in enumerate(views):
            for e in v["local"]:
                owner_of.setdefault(e, []).append(r)
        missing = [e for e in range(s.num_experts) if e not in owner_of]
        shared = {e: rs for e, rs in owner_of.items() if len(rs) > 1}
        if missing or shared:
            hint = (" (fused shared experts: build the spec without local_experts, or with physical_experts, so "
                    "that every rank holds a replica)" if self.spec.shared_experts else "")
            raise MegaMoEError(
                f"the EP ranks' placements must partition the {s.num_experts} experts (each expert on exactly one "
                f"rank): unowned experts {missing[:16]}, experts on several ranks {dict(list(shared.items())[:16])}"
                + hint)
        return [owner_of[e][0] for e in range(s.num_experts)]

    def _resolve_transport(self, requested: str) -> str:
        if requested != "auto":
            return requested
        return auto_transport(self.world, self.device, self.experts_backend, self.wire, self.spec)

    def _resolve_backend(self, requested: str) -> str:
        if requested != "auto":
            return requested
        if self.device.type != "cuda":
            return "torch"
        try:
            from ..experts import SUPPORTED
        except ImportError as exc:  # the Triton path is optional; say why it is not used
            warnings.warn(f"atom_moe.experts unavailable ({exc}); using the torch experts (not CUDA-graph safe)")
            return "torch"
        if self.spec.scheme not in SUPPORTED:
            warnings.warn(f"fused experts do not support scheme {self.spec.scheme.value} yet; using the torch "
                          f"experts (not CUDA-graph safe)")
            return "torch"
        return "triton"

    # ------------------------------------------------------------------ per layer
    def bind(self, weights: PreparedWeights) -> "MegaMoE":
        """Point the op at one layer's prepared local weights (a reference swap, no copy)."""
        self._check_open()
        weights.check(self.kspec)
        if weights.w2.device != self.device:
            raise MegaMoEError(f"weights are on {weights.w2.device}, the op's buffers on {self.device}")
        self._weights = weights
        return self

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 weights: PreparedWeights) -> torch.Tensor:
        """bind(weights) then forward."""
        return self.bind(weights).forward(x, topk_weights, topk_ids)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                out: torch.Tensor | None = None, agreed_max: int | None = None) -> torch.Tensor:
        """[T, H] in x.dtype: the bound layer's MoE output for this rank's tokens (global expert ids).

        out: an optional [T, H] tensor in x.dtype to write into (no allocation in the forward).
        agreed_max: what `agree()` returned for this very call on every rank (MegaMoEInstances checks
        once for both of its ops); None: the op agrees here.
        """
        self._check_open()
        if agreed_max is None:
            num_tokens = self._agree_on_call(x, self._call_problem(x, topk_weights, topk_ids, out))[0]
        else:  # every rank checked this call in agree() and holds the same agreed_max: all raise alike
            if agreed_max > self.max_tokens_per_rank:
                raise MegaMoEError(f"rank {self.rank}: the agreed {agreed_max} tokens per rank exceed this op's "
                                   f"max_tokens_per_rank={self.max_tokens_per_rank}; nothing was sent")
            num_tokens = x.shape[0]
        warn_fp32(x, "MegaMoE.forward")
        if self.record_load:
            self._count_load(topk_ids)
        if self.spec.redundant:  # logical ids -> one replica's slot per (token, slot); all downstream sees slots
            b = self.buffers
            topk_ids = physical_ids(topk_ids, b["replica_slots"], b["replica_count"], b["pair_index"], b["slot_ids"])
        if self.transport_name == "symm":
            return self._forward_symm(x, topk_weights, topk_ids, out)
        if num_tokens == 0 and self.transport_name == "local":  # nothing to compute, nobody to serve
            return x.new_empty(0, self.spec.hidden_size) if out is None else out
        self._tokens = num_tokens
        xin, w, ids = self.transport.dispatch(x, topk_weights, topk_ids)
        y = self._experts(xin, w, ids, out if self.transport_name == "local" else None)
        combined = self.transport.combine(y, num_tokens)
        if out is not None:
            return combined if combined is out else out.copy_(combined)
        if self.transport_name == "local":  # the experts step's own fresh output
            return combined if combined.dtype == x.dtype else combined.to(x.dtype)
        # the torch transport combines into a persistent buffer that the next layer's call reuses:
        # the caller gets its own tensor (for bf16 x this is the fp32 -> bf16 copy anyway)
        return combined.to(x.dtype, copy=True)

    def _forward_symm(self, x, topk_weights, topk_ids, out):
        tr = self.transport
        mode = self.combine_override
        if mode is None:
            mode = combine_mode(self.spec, self.world, self.wire, x.shape[0], self.device)
        if out is None:
            out = torch.empty_like(x)
        cfg = self._config(x.shape[0])

        def experts(xin, x_scale, w, ids, remote):
            from ..experts import fused_experts
            fused_experts(xin, w, ids, self._weights, self.kspec, workspace=self._workspace, config=cfg,
                          x_scale=x_scale, remote=remote)

        for _, step in tr.steps(x, topk_weights, topk_ids, out, mode, experts):
            step()
        return out

    def _config(self, tokens: int):
        """The tile config for a call with `tokens` tokens on this rank (override, table or heuristic)."""
        if self.tile_config is not None:
            return self.tile_config
        from ..experts import device_name
        from ..kernels import tuning
        s = self.spec
        return tuning.lookup(device_name(self.device), s.scheme.value, s.hidden_size, s.intermediate_size,
                             s.num_local_experts, s.top_k, max(tokens, 1))

    def _experts(self, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        if self.experts_backend == "triton":
            from ..experts import fused_experts
            if out is None:  # torch transport: persistent; local: the caller's out, else a fresh [T, H]
                out = self.buffers.get("expert_out")
            return fused_experts(x, w, ids, self._weights, self.kspec, workspace=self._workspace, out=out,
                                 config=self._config(self._tokens))
        from ..experts_torch import experts_torch
        return experts_torch(x, w, ids, self._weights, self.kspec)

    def agree(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
              out: torch.Tensor | None = None, capacity: int | None = None) -> int:
        """Check this call on every rank (collective) and return the most tokens any rank brings.

        capacity: the per-rank token limit to enforce (default: max_tokens_per_rank). While a CUDA
        graph is captured, with check_tokens=False or at EP 1 no rank is asked: x's own rows are returned.
        """
        self._check_open()
        return self._agree_on_call(x, self._call_problem(x, topk_weights, topk_ids, out), capacity)[1]

    def _call_problem(self, x, topk_weights, topk_ids, out) -> str | None:
        problem = self._input_problem(x, topk_weights, topk_ids)
        if problem is None and out is not None and (out.shape != x.shape or out.dtype != x.dtype
                                                    or out.device != x.device or not out.is_contiguous()):
            problem = (f"out must be a contiguous [T, H] = {list(x.shape)} {x.dtype} tensor on {x.device}, got "
                       f"{list(out.shape)} {out.dtype} on {out.device}")
        return problem

    def _input_problem(self, x, topk_weights, topk_ids) -> str | None:
        """What is wrong with this rank's call, or None (checked before any collective)."""
        if self._weights is None:
            return "no weights bound: call bind(weights) (or op(x, w, ids, weights)) first"
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.spec.hidden_size:
            return f"x must be a [T, H={self.spec.hidden_size}] tensor, got {tuple(getattr(x, 'shape', ()))}"
        if x.dtype not in X_DTYPES:
            return f"x dtype {x.dtype} not supported; allowed: bfloat16, float16, float32"
        k = self.spec.top_k
        for name, t, dtypes in (("topk_ids", topk_ids, (torch.int32, torch.int64)),
                                ("topk_weights", topk_weights, (torch.float32, torch.bfloat16, torch.float16))):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != (x.shape[0], k):
                return f"{name} must be [T, top_k] = [{x.shape[0]}, {k}], got {tuple(getattr(t, 'shape', ()))}"
            if t.dtype not in dtypes:
                return f"{name} dtype {t.dtype} not supported; allowed: {', '.join(map(str, dtypes))}"
        for name, t in (("x", x), ("topk_weights", topk_weights), ("topk_ids", topk_ids)):
            if t.device != self.device:
                return f"{name} is on {t.device}; the op's buffers are on {self.device}"
            if not t.is_contiguous():
                return f"{name} must be contiguous"
        if self.experts_backend == "torch" and _capturing(self.device):
            return "experts_backend='torch' is not CUDA-graph safe (it syncs with the host); build with 'triton'"
        return None

    def _agree_on_call(self, x, problem: str | None, capacity: int | None = None) -> tuple[int, int]:
        """Raise on every rank if any rank's call is invalid or has too many tokens; return (T, max T of all ranks)."""
        T = x.shape[0] if problem is None else -1
        mtpr = self.max_tokens_per_rank if capacity is None else capacity
        if self.world == 1 or not self.check_tokens or _capturing(self.device):
            # shapes are static during capture and were validated on every rank at warm-up/first call
            if problem:
                raise MegaMoEError(f"rank {self.rank}: {problem}")
            if T > mtpr:
                raise MegaMoEError(f"rank {self.rank}: {T} tokens exceed max_tokens_per_rank={mtpr}")
            return T, T
        self._mine[0], self._mine[1], self._mine[2] = T, int(problem is not None), mtpr
        try:
            dist.all_gather(self._all, self._mine, group=self.cpu_group)
        except RuntimeError as exc:
            raise MegaMoEError(f"rank {self.rank}: the EP peers did not all reach forward within the process-group "
                               f"timeout (a peer failed or skipped this call): {exc}") from exc
        counts, flags, caps = ([int(t[i]) for t in self._all] for i in range(3))
        if any(flags):
            # a second collective, only on this error path, that every rank enters (all saw the flag)
            msgs = [None] * self.world
            dist.all_gather_object(msgs, problem, group=self.cpu_group)
            raise MegaMoEError("invalid MegaMoE call: " + "; ".join(f"rank {r}: {m}" for r, m in enumerate(msgs) if m))
        if len(set(caps)) > 1:
            raise MegaMoEError("the EP ranks ran MegaMoE ops of different max_tokens_per_rank in one step ("
                               + ", ".join(f"rank {r}: {c}" for r, c in enumerate(caps)) + "); the choice between "
                               "a decode and a prefill op must come from a count every rank agrees on")
        over = [(r, c) for r, c in enumerate(counts) if c > mtpr]
        if over:
            raise MegaMoEError("tokens exceed max_tokens_per_rank=" + str(mtpr) + " on "
                               + ", ".join(f"rank {r} ({c} tokens)" for r, c in over)
                               + "; nothing was sent. Rebuild the op with a larger max_tokens_per_rank "
                               "or split the batch")
        return T, max(counts)

    # ------------------------------------------------------------------ load statistic, rebalancing
    def _count_load(self, topk_ids: torch.Tensor) -> None:
        b, N = self.buffers, self.spec.num_experts
        valid = (topk_ids >= 0) & (topk_ids < N)
        e = torch.where(valid, topk_ids, N).long().view(-1)  # sentinels land in the extra entry N
        b["expert_load"].index_add_(0, e, b["load_ones"][:e.numel()])

    def expert_load(self) -> torch.Tensor:
        """int64 [N]: (token, slot) pairs routed to each logical expert on this rank since the last reset.

        The op's persistent buffer itself (clone it to keep a snapshot); needs record_load=True.
        """
        self._check_open()
        if not self.record_load:
            raise MegaMoEError("the load statistic is off: build the op with record_load=True")
        return self.buffers["expert_load"][:self.spec.num_experts]

    def reset_load(self) -> None:
        """Zero the load statistic in place (no reallocation)."""
        self.expert_load()
        self.buffers["expert_load"].zero_()

    def rebalance(self, placement: ExpertPlacement, layers: Sequence[PreparedWeights]) -> list[int]:
        """Apply a new placement in place (collective: every rank, same placement, its own layers in the same order).

        Copies expert weights between slots over the EP group, then rewrites the routing
        tables; no buffer or weight tensor is reallocated, so captured CUDA graphs stay valid.
        Returns the indices of MXFP4 layers whose kernel flags rose (recapture their graphs).
        """
        self._check_open()
        problem = self._rebalance_problem(placement, layers)
        tables = None if problem else [t.tolist() for t in (
            placement.physical_to_logical, placement.logical_to_physical, placement.replica_count)]
        mine = (problem, tables, len(layers))
        views = [mine]
        if self.world > 1:
            views = [None] * self.world
            dist.all_gather_object(views, mine, group=self.cpu_group)
        problems = [f"rank {r}: {v[0]}" for r, v in enumerate(views) if v[0]]
        if problems:
            raise MegaMoEError("MegaMoE rebalance refused, nothing moved: " + "; ".join(problems))
        if any(v[1:] != views[0][1:] for v in views):
            raise MegaMoEError("MegaMoE rebalance refused, nothing moved: every rank must pass the same placement "
                               "(map and replica tables) and the same number of layers; differing ranks "
                               + str([r for r, v in enumerate(views) if v[1:] != views[0][1:]]) + ", layers per rank: "
                               + ", ".join(f"rank {r}: {v[2]}" for r, v in enumerate(views)))
        moves = slot_moves(self.placement.slots(), placement.slots(), self.world)
        slots = self.spec.num_physical_experts // self.world
        if moves:
            move_slots(layers, moves, self.rank, self.world, slots, self.group)
        self._write_tables(placement)
        self.placement = placement
        return [i for i, w in enumerate(layers) if refresh_kernel_flags(w)]

    def _rebalance_problem(self, placement, layers) -> str | None:
        s = self.spec
        if not s.redundant:
            return ("rebalance needs redundant experts: build the spec with physical_experts "
                    "(spec.for_rank(rank, world, physical_experts=...))")
        if _capturing(self.device):
            return "rebalance cannot run inside a CUDA graph capture; call it between steps"
        if not isinstance(placement, ExpertPlacement):
            return f"placement must be an ExpertPlacement, got {type(placement).__name__}"
        problem = placement.problem(s.num_experts, self.world) or shared_map_problem(
            placement.slots(), s.num_experts, s.shared_experts, self.world)
        if problem:
            return f"replica tables: {problem}"
        if placement.num_slots != s.num_physical_experts:
            return (f"the new placement has {placement.num_slots} slots, the op {s.num_physical_experts}; the slot "
                    f"count is fixed at build")
        for i, w in enumerate(layers):
            try:
                w.check(self.kspec)
            except ValueError as exc:
                return f"layer {i}: {exc}"
            if w.w2.device != self.device:
                return f"layer {i}: weights are on {w.w2.device}, the op's buffers on {self.device}"
        return None

    # ------------------------------------------------------------------ warm-up, accounting, teardown
    def warmup(self, weights: PreparedWeights | None = None, *, seed: int = 0) -> list[WarmupCase]:
        """Run, before any capture, the engines' dummy batches at T = max_tokens_per_rank (collective).

        balanced (ids t*k+j mod E), same_experts (every token to experts 0..k-1), one_expert
        (every slot to expert 0), sentinel (ids E and -1 only). Returns each case and its output.
        """
        if weights is not None:
            self.bind(weights)
        s, T = self.spec, self.max_tokens_per_rank
        E, k = s.num_experts, s.top_k
        gen = torch.Generator().manual_seed(seed * 1000003 + self.rank)
        x = torch.randn(T, s.hidden_size, generator=gen).to(self.device, torch.bfloat16)
        w = torch.rand(T, k, generator=gen).add_(0.1).to(self.device)
        t = torch.arange(T).unsqueeze(1)
        j = torch.arange(k).unsqueeze(0)
        ids = {
            "balanced": (t * k + j) % E,
            "same_experts": j.expand(T, k) % E,
            "one_expert": torch.zeros(T, k, dtype=torch.int64),
            "sentinel": torch.where((t + j) % 2 == 0, E, -1).expand(T, k),
        }
        cases = []
        for name, i in ids.items():
            i = i.contiguous().to(self.device)
            cases.append(WarmupCase(name, x, w, i, self.forward(x, w, i)))
        if self.transport_name == "symm":  # a host sync and one gloo gather: warm-up only
            counts = [None] * self.world
            dist.all_gather_object(counts, self.transport.errors(), group=self.cpu_group)
            if any(counts):
                raise MegaMoEError("symm barrier waits gave up on a peer (a peer stalled or died; outputs since are "
                                   "not valid): " + ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts) if c))
        return cases

    def allocated_bytes(self) -> int:
        """Bytes of every persistent buffer this op allocated (equals sum(buffer_sizes(...)))."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def close(self) -> None:
        """Release the buffers and destroy what the op created (its gloo side group); idempotent."""
        if self._closed:
            return
        self._closed = True
        self.transport.close()
        self.buffers, self._workspace, self._weights = {}, None, None
        if self._owned_cpu_group and dist.is_initialized():
            dist.destroy_process_group(self.cpu_group)
        self.cpu_group = None

    def __enter__(self) -> "MegaMoE":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise MegaMoEError("this MegaMoE op was closed; build a new one")


def _normalize_device(device: torch.device | str | None) -> torch.device:
    """'cuda' -> 'cuda:<current>' so device comparisons with tensors' devices are exact."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def auto_transport(world: int, device: torch.device | str, experts_backend: str, wire: str, spec: MoESpec) -> str:
    """What transport='auto' picks: local for one rank; symm on CUDA with the Triton experts (bf16 wire, or the
    fp8 wire with an fp8-activation scheme) where torch has symmetric memory; else torch."""
    if world == 1:
        return "local"
    symm_ok = (torch.device(device).type == "cuda" and experts_backend == "triton" and _symm_memory_available()
               and (wire == "bf16" or spec.scheme.fp8_activations))
    return "symm" if symm_ok else "torch"


def _symm_memory_available() -> bool:
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_interpreter() -> bool:
    import os
    return os.environ.get("TRITON_INTERPRET") == "1"
