"""What a MoE layer is: shapes, activation, routing, quant scheme, expert placement, limits.

Every invalid combination raises `SpecError` at construction, naming what is wrong and
what is allowed. Everything downstream (weights, kernels, buffers, plugins) reads the
spec instead of re-deriving facts from tensor shapes.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field, replace
from functools import cached_property

FP8_BLOCK = 128  # fp8 weights: 128x128 block scales; activations: per-token groups of 128
A8W4_INTER_GROUP = 64  # a8w4 quantizes GEMM2's input per token-group-64: GEMM1 tiles may then be 128 rows
A8W4_INTER_FLAG = "ATOM_MOE_A8W4_INTER"  # token (default) or group: a8w4's GEMM2 input scales, Scheme.inter_per_token
MX_BLOCK = 32  # MXFP4 / MXFP8: one e8m0 scale per 32 elements along the reduction dim


class SpecError(ValueError):
    """An invalid MoE layer description."""


class Scheme(str, enum.Enum):
    """Quantization scheme of the expert weights and activations."""

    BF16 = "bf16"  # bf16 weights and activations
    FP8 = "fp8"  # e4m3 weights with 128x128 block scales, activations per-token-group-128
    A16W4 = "a16w4"  # MXFP4 weights, bf16 activations
    A8W4 = "a8w4"  # MXFP4 weights, e4m3 activations (x per token, GEMM2's input per token-group-64)

    @classmethod
    def parse(cls, value: "str | Scheme") -> "Scheme":
        """Turn a string into a Scheme, with a clear error for unknown names."""
        if isinstance(value, Scheme):
            return value
        try:
            return cls(str(value).lower())
        except ValueError:
            allowed = ", ".join(s.value for s in cls)
            raise SpecError(f"unknown quant scheme {value!r}; allowed: {allowed}") from None

    @property
    def is_mxfp4(self) -> bool:
        return self in (Scheme.A16W4, Scheme.A8W4)

    @property
    def fp8_activations(self) -> bool:
        return self in (Scheme.FP8, Scheme.A8W4)

    @property
    def x_per_token(self) -> bool:
        """GEMM1's e4m3 input has one scale per token (a8w4), not one per 128-group (fp8).

        The scale is stored once per 128-group all the same, so x_scale keeps fp8's [T, ceil(H/128)] shape (the
        workspace, the EP wires): GEMM1 then keeps a single fp8 accumulator over K and applies the token's scale
        after the loop (kernels/mainloop.py `k_loop`, docs/perf/a8w4-one-accumulator-h100.md)."""
        return self is Scheme.A8W4

    @property
    def inter_per_token(self) -> bool:
        """a8w4 unless ATOM_MOE_A8W4_INTER=group: GEMM2's e4m3 input has one scale per token, from GEMM1's output
        rounded to bf16 (kernels/inter_quant.py), so GEMM2 keeps one accumulator as GEMM1 does. GEMM2 1.3-1.4x faster
        at T >= 2048 for +1.3-2.8e-3 of layer error on Gaussian data (docs/perf/a8w4-one-accumulator-h100.md, 4-5)."""
        return self is Scheme.A8W4 and a8w4_inter_per_token()

    @property
    def inter_group(self) -> int:
        """Quant group along I of GEMM2's e4m3 input (fp8 activations only): fp8 128, a8w4 64."""
        return A8W4_INTER_GROUP if self is Scheme.A8W4 else FP8_BLOCK


def a8w4_inter_per_token() -> bool:
    """ATOM_MOE_A8W4_INTER: `token` or unset gives a8w4's GEMM2 input one e4m3 scale per token; `group` keeps one
    per (token, 64-group). Read at every use: set it before building a layer and keep it (the workspace checks)."""
    flag = os.environ.get(A8W4_INTER_FLAG, "")
    if flag not in ("", "group", "token"):
        raise SpecError(f"{A8W4_INTER_FLAG}={flag!r}: allowed are token (default: one scale per token of GEMM2's "
                        "input) or group (a scale per token and 64-group)")
    return flag != "group"


class ActivationKind(str, enum.Enum):
    """The gated activation's formula."""

    SWIGLU = "swiglu"  # silu(gate) * up
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss: clamp, gate * sigmoid(alpha * gate) * (up + 1)
    SWIGLU_CLAMP = "swiglu_clamp"  # DeepSeek-V4: silu(min(gate, limit)) * clamp(up, -limit, limit)


@dataclass(frozen=True)
class Activation:
    """The gated activation between GEMM1 and GEMM2.

    The clamped kinds clamp the fp32 GEMM1 output before the activation: gate <= limit
    and -limit <= up <= limit (vLLM's and transformers' `swiglu_limit`).
    """

    kind: ActivationKind = ActivationKind.SWIGLU
    alpha: float = 1.702  # only for SWIGLU_OAI
    # SWIGLU_OAI and SWIGLU_CLAMP; None: gpt-oss's 7.0 for SWIGLU_OAI, required for SWIGLU_CLAMP (V4 uses 10.0,
    # and a silently defaulted clamp would be the wrong model)
    limit: float | None = None

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ActivationKind(self.kind))
        except ValueError:
            allowed = ", ".join(k.value for k in ActivationKind)
            raise SpecError(f"unknown activation {self.kind!r}; allowed: {allowed}") from None
        if self.limit is None:
            if self.kind is ActivationKind.SWIGLU_CLAMP:
                raise SpecError("swiglu_clamp needs its limit (the model's swiglu_limit, e.g. 10.0 for "
                                "DeepSeek-V4); allowed: a finite number > 0")
            object.__setattr__(self, "limit", 7.0)  # gpt-oss's; unused by plain swiglu
        if self.kind is ActivationKind.SWIGLU_OAI and not (self.alpha > 0 and self.limit > 0):
            raise SpecError(
                f"swiglu_oai needs alpha > 0 and limit > 0, got alpha={self.alpha}, limit={self.limit}"
            )
        if self.kind is ActivationKind.SWIGLU_CLAMP and not (
                isinstance(self.limit, (int, float)) and not isinstance(self.limit, bool)
                and math.isfinite(self.limit) and self.limit > 0):
            raise SpecError(f"swiglu_clamp needs a finite limit > 0 (the model's swiglu_limit), got "
                            f"limit={self.limit!r}; for no clamp use kind swiglu")
        object.__setattr__(self, "limit", float(self.limit))

    @property
    def clamped(self) -> bool:
        """Whether GEMM1's output is clamped at `limit` before the activation (swiglu_oai, swiglu_clamp)."""
        return self.kind is not ActivationKind.SWIGLU


class Scoring(str, enum.Enum):
    """How router logits become scores: softmax over experts, or a function of each logit."""

    SOFTMAX = "softmax"
    SIGMOID = "sigmoid"
    SQRTSOFTPLUS = "sqrtsoftplus"  # DeepSeek-V4: sqrt(softplus(logit))


@dataclass(frozen=True)
class Routing:
    """How router logits become (topk_weights, topk_ids).

    softmax: softmax over all experts, top-k.
    sigmoid (and sqrtsoftplus: sqrt(softplus(logit)), DeepSeek-V4): per-expert scores; with a
    correction bias the choice uses score + bias but the weights use the score (DeepSeek-V3);
    grouped top-k keeps the `topk_group` best of `n_group` groups, a group scored by the sum
    of its two best biased scores.
    """

    scoring: Scoring = Scoring.SOFTMAX
    renormalize: bool = True
    n_group: int = 1
    topk_group: int = 1
    correction_bias: bool = False
    routed_scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "scoring", Scoring(self.scoring))
        except ValueError:
            allowed = ", ".join(s.value for s in Scoring)
            raise SpecError(f"unknown routing scoring {self.scoring!r}; allowed: {allowed}") from None
        if self.n_group < 1 or not (1 <= self.topk_group <= self.n_group):
            raise SpecError(
                f"grouped top-k needs n_group >= 1 and 1 <= topk_group <= n_group, "
                f"got n_group={self.n_group}, topk_group={self.topk_group}"
            )
        if self.routed_scaling_factor <= 0:
            raise SpecError(f"routed_scaling_factor must be > 0, got {self.routed_scaling_factor}")


@dataclass(frozen=True)
class Placement:
    """Which experts this expert-parallel rank owns (global expert ids, in local order).

    Redundant experts: `physical_experts` lists, for every one of the P physical slots of
    the whole EP group, the logical expert it holds (P >= num_experts, P divisible by the
    world size, slot s on rank s // (P / world_size), every expert in at least one slot).
    `local_experts` is then the logical expert of each of this rank's P / world_size slots
    (filled by MoESpec; an expert may appear more than once).
    """

    rank: int = 0
    world_size: int = 1
    local_experts: tuple[int, ...] | None = None  # None: linear placement, filled by MoESpec
    physical_experts: tuple[int, ...] | None = None  # None: one slot per expert (P == num_experts)

    @staticmethod
    def linear(rank: int, world_size: int, num_experts: int) -> "Placement":
        """Contiguous placement: rank r owns experts [r*E/W, (r+1)*E/W); E must divide by W."""
        if world_size < 1 or not (0 <= rank < world_size):
            raise SpecError(f"EP rank must be in [0, world_size), got rank={rank}, world_size={world_size}")
        if num_experts % world_size:
            raise SpecError(
                f"linear placement needs num_experts divisible by the EP world size: "
                f"{num_experts} experts over {world_size} ranks; pass an explicit local_experts list "
                f"for uneven placement, or use a world size dividing {num_experts}"
            )
        per = num_experts // world_size
        return Placement(rank, world_size, tuple(range(rank * per, (rank + 1) * per)))


@dataclass(frozen=True)
class MoESpec:
    """One validated MoE layer description. Use `MoESpec.create(...)` or a preset."""

    hidden_size: int
    intermediate_size: int  # per expert, per TP shard
    num_experts: int  # global routed experts
    top_k: int
    scheme: Scheme = Scheme.BF16
    activation: Activation = field(default_factory=Activation)
    routing: Routing = field(default_factory=Routing)
    placement: Placement = field(default_factory=Placement)
    max_tokens_per_rank: int = 8192
    has_bias: bool = False
    # fused shared experts: the last `shared_experts` of num_experts are shared experts, and every token's
    # last `shared_experts` top-k slots name them (the engines append them so, with their own weights)
    shared_experts: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheme", Scheme.parse(self.scheme))
        for name in ("hidden_size", "intermediate_size", "num_experts", "top_k", "max_tokens_per_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise SpecError(f"{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise SpecError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}; top_k must be <= num_experts")
        S = self.shared_experts
        if not isinstance(S, int) or isinstance(S, bool) or not 0 <= S < min(self.num_experts, self.top_k):
            raise SpecError(f"shared_experts must be an int in [0, min(num_experts, top_k)) = [0, "
                            f"{min(self.num_experts, self.top_k)}) (top_k counts the shared slots), got {S!r}")
        if self.scheme.is_mxfp4:
            for name in ("hidden_size", "intermediate_size"):
                value = getattr(self, name)
                if value % MX_BLOCK:
                    raise SpecError(
                        f"scheme {self.scheme.value} (MXFP4) needs the reduction dims to be multiples of "
                        f"{MX_BLOCK}: {name}={value} is not; allowed: {name} % {MX_BLOCK} == 0"
                    )
        # fp8 128-blocks deliberately accept any size: partial blocks are handled.
        r = self.routing
        routed, routed_k = self.num_experts - S, self.top_k - S  # grouped top-k picks among routed experts only
        if r.n_group > 1 and routed % r.n_group:
            raise SpecError(f"grouped top-k needs num_experts % n_group == 0, got {routed} % {r.n_group}"
                            + (f" (the routed experts; {S} shared excluded)" if S else ""))
        if r.n_group > 1 and routed_k > (routed // r.n_group) * r.topk_group:
            raise SpecError(
                f"top_k={routed_k}{' (routed)' if S else ''} exceeds the experts in the {r.topk_group} kept groups "
                f"({routed // r.n_group} each)"
            )
        if r.n_group > 1 and routed // r.n_group < 2:
            raise SpecError("grouped top-k scores a group by its two best experts: need >= 2 experts per group")
        p = self.placement
        if S and p.world_size > 1 and p.physical_experts is None and p.local_experts is None:
            # the shared experts on every rank: a replica in each rank's last slots (docs/ep.md)
            p = replace(p, physical_experts=shared_physical_map(self.num_experts, S, p.world_size))
        if p.physical_experts is not None:
            self._check_physical_placement(p)
        elif p.local_experts is None:
            object.__setattr__(self, "placement", Placement.linear(p.rank, p.world_size, self.num_experts))
        else:
            self._check_explicit_placement(p)

    def _check_physical_placement(self, p: Placement) -> None:
        if p.world_size < 1 or not (0 <= p.rank < p.world_size):
            raise SpecError(f"EP rank must be in [0, world_size), got rank={p.rank}, world_size={p.world_size}")
        phys = tuple(int(e) for e in p.physical_experts)
        problem = physical_map_problem(phys, self.num_experts, p.world_size) or shared_map_problem(
            phys, self.num_experts, self.shared_experts, p.world_size)
        if problem:
            raise SpecError(problem)
        per = len(phys) // p.world_size
        mine = phys[p.rank * per:(p.rank + 1) * per]
        if p.local_experts is not None and tuple(int(e) for e in p.local_experts) != mine:
            raise SpecError(f"local_experts {tuple(p.local_experts)} disagree with physical_experts, whose slots on "
                            f"rank {p.rank} hold {mine}; pass physical_experts alone")
        object.__setattr__(self, "placement", replace(p, local_experts=mine, physical_experts=phys))

    def _check_explicit_placement(self, p: Placement) -> None:
        if p.world_size < 1 or not (0 <= p.rank < p.world_size):
            raise SpecError(f"EP rank must be in [0, world_size), got rank={p.rank}, world_size={p.world_size}")
        ids = tuple(int(e) for e in p.local_experts)
        if not ids:
            raise SpecError("local_experts is empty; every EP rank must own at least one expert")
        if len(set(ids)) != len(ids):
            raise SpecError(f"local_experts has duplicates: {ids}")
        bad = [e for e in ids if not 0 <= e < self.num_experts]
        if bad:
            raise SpecError(f"local_experts {bad} outside [0, num_experts={self.num_experts})")
        object.__setattr__(self, "placement", replace(p, local_experts=ids))

    @classmethod
    def create(cls, *, scheme: "str | Scheme" = "bf16", **kwargs) -> "MoESpec":
        """Build a spec from plain values (strings for enums, dicts for sub-configs)."""
        for key, typ in (("activation", Activation), ("routing", Routing), ("placement", Placement)):
            if isinstance(kwargs.get(key), dict):
                kwargs[key] = typ(**kwargs[key])
        return cls(scheme=Scheme.parse(scheme), **kwargs)

    @property
    def local_experts(self) -> tuple[int, ...]:
        return self.placement.local_experts  # type: ignore[return-value]

    @property
    def num_local_experts(self) -> int:
        """Local experts, or local physical slots with redundant experts."""
        return len(self.local_experts)

    @property
    def shared_ids(self) -> tuple[int, ...]:
        """Global ids of the fused shared experts: the last `shared_experts` of num_experts."""
        return tuple(range(self.num_experts - self.shared_experts, self.num_experts))

    @property
    def redundant(self) -> bool:
        """Whether the spec places physical slots (redundant experts) instead of one slot per expert."""
        return self.placement.physical_experts is not None

    @property
    def num_physical_experts(self) -> int:
        """P: physical expert slots over the whole EP group (num_experts without redundant experts)."""
        phys = self.placement.physical_experts
        return self.num_experts if phys is None else len(phys)

    @cached_property
    def kernel_spec(self) -> "MoESpec":
        """The layer as the kernels, transports and prepared weights see it: the P physical slots are the
        experts, linearly placed (this spec itself when it has no redundant experts)."""
        if not self.redundant:
            return self
        p, P = self.placement, self.num_physical_experts
        per = P // p.world_size
        # routing is the engine's business (ids arrive already chosen): the slots keep only the shapes
        return replace(self, num_experts=P, routing=Routing(), shared_experts=0,
                       placement=Placement(p.rank, p.world_size, tuple(range(p.rank * per, (p.rank + 1) * per))))

    def for_rank(self, rank: int, world_size: int, local_experts: tuple[int, ...] | None = None,
                 physical_experts: tuple[int, ...] | None = None) -> "MoESpec":
        """The same layer as seen by one EP rank (a redundant spec keeps its physical map unless given one)."""
        if physical_experts is None and local_experts is None:
            physical_experts = self.placement.physical_experts
        return replace(self, placement=Placement(rank, world_size, local_experts, physical_experts))


def shared_physical_map(num_experts: int, shared: int, world_size: int) -> tuple[int, ...]:
    """Slot -> expert map with the routed experts placed linearly and every shared expert on every rank.

    Rank r's slots: routed experts [r*R/W, (r+1)*R/W) (R = num_experts - shared), then the
    shared ids; the rank-major layout SGLang's per-rank shared slots use too.
    """
    routed = num_experts - shared
    if routed % world_size:
        raise SpecError(f"shared experts on every rank need the {routed} routed experts divisible by the EP world "
                        f"size {world_size}; pass physical_experts for an uneven placement")
    per = routed // world_size
    shared_ids = tuple(range(routed, num_experts))
    return tuple(e for r in range(world_size) for e in tuple(range(r * per, (r + 1) * per)) + shared_ids)


def shared_map_problem(physical_experts: tuple[int, ...], num_experts: int, shared: int,
                       world_size: int) -> str | None:
    """What keeps a slot map from holding every shared expert on every rank, or None."""
    if not shared:
        return None
    per = len(physical_experts) // world_size
    for r in range(world_size):
        missing = sorted(set(range(num_experts - shared, num_experts)) - set(physical_experts[r * per:(r + 1) * per]))
        if missing:
            return (f"shared experts {missing} have no slot on rank {r}; every rank needs a replica of every shared "
                    f"expert (its tokens' shared slots are served at home; see shared_physical_map)")
    return None


def physical_map_problem(physical_experts: tuple[int, ...], num_experts: int, world_size: int) -> str | None:
    """What is wrong with a slot -> logical expert map, or None (see Placement)."""
    P = len(physical_experts)
    if P < num_experts:
        return (f"physical_experts has {P} slots, fewer than the {num_experts} logical experts; allowed: "
                f"P >= num_experts")
    if P % world_size:
        return (f"physical_experts has {P} slots, not divisible by the EP world size {world_size}; allowed: "
                f"P a multiple of {world_size} (each rank holds P / world_size slots)")
    bad = [(s, e) for s, e in enumerate(physical_experts) if not 0 <= e < num_experts]
    if bad:
        return f"physical_experts slots {bad[:8]} (slot, expert) hold ids outside [0, num_experts={num_experts})"
    missing = sorted(set(range(num_experts)) - set(physical_experts))
    if missing:
        return f"logical experts {missing[:16]} have no physical slot; every expert needs at least one replica"
    return None
