"""Raw checkpoint / engine tensors -> prepared per-layer expert weights (built once).

Prepared weight formats by scheme (E_l = local experts, tags from atom_moe.layouts.gate_up):

| scheme      | w13 (INTERLEAVED rows)      | w13_scale                           | w2                 | w2_scale               |
|-------------|-----------------------------|-------------------------------------|--------------------|------------------------|
| bf16        | bf16 [E_l, 2I, H]           | None                                | bf16 [E_l, H, I]   | None                   |
| fp8         | e4m3 [E_l, 2I, H]           | fp32 [E_l, ceil(I/128), 2, ceil(H/128)] (BLOCK_SCALE) | e4m3 [E_l, H, I] | fp32 [E_l, ceil(H/128), ceil(I/128)] |
| a16w4       | uint8 MX tiles [E_l, ceil(2I/16), ceil(H/64), 512] (MX_TILES) | uint8 [E_l, ceil(2I/16), ceil(H/64), 32] (MX_TILES) | uint8 [E_l, ceil(H/16), ceil(I/64), 512] | uint8 [E_l, ceil(H/16), ceil(I/64), 32] |
| a8w4        | MX quads, same shapes (MX_QUADS) | paired residual bytes (MX_QUADS, below) | MX quads | residual bytes |

a16w4 weights are stored only as MX tiles (atom_moe.layouts.mx_tiles: e2m1 codes and e8m0 scales
repacked for the kernels' mma fragments, N padded to 16 and K to 64 with zero codes and
scale byte 0). w13's rows are tiled in INTERLEAVED order [g0, u0, g1, u1, ...].
`plain_mxfp4` untiles them back to checkpoint MXFP4 (uint8 e2m1x2 [E_l, 2I, H/2] INTERLEAVED,
e8m0 [E_l, 2I, H/32], [E_l, H, I/2], [E_l, H, I/32]) for oracles and baselines; the plain
copy is never kept. `mx_scale_max` records the largest e8m0 byte of both (0 for bf16/fp8).
a8w4 stores MX quads instead (atom_moe.layouts.mx_quads: e4m3 mma word order, scales as residuals of a
per-row exponent), with w13_rowexp uint8 [E_l, 2I] INTERLEAVED and w2_rowexp uint8 [E_l, H]. w13's residuals
are paired per 128 k for GEMM1's 128-k step, uint8 [E_l, ceil(2I/16), ceil(H/128), 64]; w2's keep the plain
order, a16w4's scale shape [E_l, ceil(H/16), ceil(I/64), 32].
`mx_flush` says whether some block is flushed (more than 2^11 below its row's largest scale);
preparation warns with the count when it is.

Biases (optional): w13_bias fp32 [E_l, 2I] INTERLEAVED, w2_bias fp32 [E_l, H].

The local expert count is recorded here, from the spec's placement, and never inferred
from a tensor shape later. Inputs given as a mutable mapping are consumed: their entries
are popped, so the originals can be freed once the caller drops them.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import torch

from . import formats
from .layouts import mx_quads, mx_tiles
from .layouts.gate_up import GateUpKind, GateUpLayout, GateUpTensor, interleave, require
from .spec import FP8_BLOCK, MX_BLOCK, MoESpec, Scheme


class WeightError(ValueError):
    """Expert weights that do not match the spec or the expected checkpoint format."""


# PreparedWeights' fields with one entry per local expert along dim 0
PER_EXPERT = ("w13", "w13_scale", "w2", "w2_scale", "w13_bias", "w2_bias", "w13_rowexp", "w2_rowexp")


@dataclass
class PreparedWeights:
    """One MoE layer's local expert weights in the kernels' format (see module docstring)."""

    scheme: Scheme
    hidden_size: int
    intermediate_size: int
    num_experts: int  # global routed experts
    local_experts: tuple[int, ...]  # global id of each local expert, in local order
    num_local_experts: int  # recorded at build time, never inferred from shapes
    expert_map: torch.Tensor  # int32 [num_experts]: global id -> local index, -1 if not local
    w13: GateUpTensor
    w13_scale: GateUpTensor | None
    w2: torch.Tensor
    w2_scale: torch.Tensor | None
    w13_bias: GateUpTensor | None = None
    w2_bias: torch.Tensor | None = None
    # MXFP4: the largest e8m0 byte over w13_scale and w2_scale (the kernels pick their scale
    # decode by it: bytes > 128 need the general path). 0 for bf16/fp8.
    mx_scale_max: int = 0
    # a8w4 (MX quads): per-row exponents, and whether some block is flushed (atom_moe.layouts.mx_quads)
    w13_rowexp: GateUpTensor | None = None
    w2_rowexp: torch.Tensor | None = None
    mx_flush: bool | None = None  # None: measured at construction (below)

    def __post_init__(self) -> None:
        # A separated w13 must never reach a kernel: refuse it at construction already.
        for name in ("w13", "w13_scale", "w13_bias", "w13_rowexp"):
            t = getattr(self, name)
            if t is not None or name == "w13":
                require(t, GateUpLayout.INTERLEAVED, name)
        self.mx_scale_max = int(self.mx_scale_max)
        # MXFP4 weights built without it (by hand): measured here, once (one host sync), so a
        # scale byte > 128 can never meet a kernel told the maximum is 0
        if (Scheme(self.scheme).is_mxfp4 and self.mx_scale_max == 0 and self.w13_scale is not None
                and self.w13_scale.kind is GateUpKind.MX_TILES and self.w2_scale is not None):
            self.mx_scale_max = _scale_max(self.w13_scale.data, self.w2_scale)
        # MX quads built by hand: the flush path goes on wherever a residual byte is outside
        # [1, 12] (conservative: zero and padding blocks count too; one host sync)
        if self.mx_flush is None:
            quads = self.w13_scale is not None and self.w13_scale.kind is GateUpKind.MX_QUADS
            self.mx_flush = quads and any(bool(((t.data if isinstance(t, GateUpTensor) else t) - 1 > 11).any())
                                          for t in (self.w13_scale, self.w2_scale))
        self.mx_flush = bool(self.mx_flush)
        self.validate_expert_map()

    def restricted(self, local: Sequence[int]) -> PreparedWeights:
        """The same layer holding only the local experts `local` (in that order), e.g. those a batch hits: what
        a reference needs when dequantizing the whole layer would not fit."""
        local = [int(j) for j in local]
        bad = [j for j in local if not 0 <= j < self.num_local_experts]
        if bad or len(set(local)) != len(local):
            what = f"indices {bad} out of range" if bad else "repeated indices"
            raise WeightError(f"restricted({local}): {what}; allowed: distinct local expert indices in "
                              f"[0, {self.num_local_experts})")

        def take(t):
            if isinstance(t, GateUpTensor):
                return GateUpTensor(t.data[local], t.layout, t.kind)
            return None if t is None else t[local]

        glob = [self.local_experts[j] for j in local]
        emap = torch.full((self.num_experts,), -1, dtype=torch.int32)
        emap[glob] = torch.arange(len(glob), dtype=torch.int32)
        return replace(
            self, local_experts=tuple(glob), num_local_experts=len(glob), expert_map=emap.to(self.w2.device),
            **{name: take(getattr(self, name)) for name in PER_EXPERT})

    def validate_expert_map(self) -> None:
        """Raise WeightError unless expert_map maps exactly local_experts[j] -> j (one host sync, at build)."""
        em, E, El = self.expert_map, self.num_experts, self.num_local_experts
        if El != len(self.local_experts):
            raise WeightError(f"num_local_experts={El} but local_experts lists {len(self.local_experts)} experts; "
                              f"they must agree")
        if not isinstance(em, torch.Tensor) or em.dtype != torch.int32 or tuple(em.shape) != (E,):
            got = _fmt(tuple(em.shape), em.dtype) if isinstance(em, torch.Tensor) else type(em).__name__
            raise WeightError(f"expert_map is {got}; allowed: int32 [{E}] (global id -> local index, -1 elsewhere)")
        if em.device != self.w2.device:
            raise WeightError(f"expert_map is on {em.device}, w2 on {self.w2.device}; they must share a device")
        want = torch.full((E,), -1, dtype=torch.int32)
        want[list(self.local_experts)] = torch.arange(El, dtype=torch.int32)
        have = em.detach().cpu()
        if not torch.equal(have, want):
            bad = (have != want).nonzero().flatten()[:4].tolist()
            raise WeightError(
                f"expert_map disagrees with local_experts at global ids {bad} (got {have[bad].tolist()}, expected "
                f"{want[bad].tolist()}); allowed: entries in [-1, num_local_experts={El}), each local index "
                f"exactly once, expert_map[local_experts[j]] == j")
        self._map_seen = (em, _tensor_version(em))

    def check(self, spec: MoESpec) -> None:
        """Raise WeightError/LayoutError unless these weights are what `spec` needs."""
        spec = spec.kernel_spec  # redundant experts: weights are stored per physical slot
        # expert_map was validated at build; a replaced or in-place edited map is validated again,
        # but never inside a CUDA graph capture (the check reads the map on the host)
        seen = getattr(self, "_map_seen", (None, None))
        if seen[0] is not self.expert_map or seen[1] != _tensor_version(self.expert_map):
            if _capturing():
                raise WeightError("expert_map changed since it was validated; call weights.validate_expert_map() "
                                  "before capturing a CUDA graph")
            self.validate_expert_map()
        require(self.w13, GateUpLayout.INTERLEAVED, "w13")
        if self.w13_bias is not None:
            require(self.w13_bias, GateUpLayout.INTERLEAVED, "w13_bias")
        if self.w13_scale is not None:
            require(self.w13_scale, GateUpLayout.INTERLEAVED, "w13_scale")
        mine = (self.scheme, self.hidden_size, self.intermediate_size, self.num_experts, self.local_experts)
        theirs = (spec.scheme, spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.local_experts)
        if mine != theirs:
            raise WeightError(
                f"prepared weights (scheme, H, I, E, local experts) = {mine[:4]}, {len(self.local_experts)} local "
                f"do not match the spec {theirs[:4]}, {len(spec.local_experts)} local"
            )
        if spec.has_bias != (self.w2_bias is not None):
            raise WeightError(f"spec.has_bias={spec.has_bias} but the prepared weights "
                              f"{'have' if self.w2_bias is not None else 'lack'} biases")
        self._check_tensors(spec)

    def _check_tensors(self, spec: MoESpec) -> None:
        """Every tensor's kind, dtype and shape as the module docstring's table gives them."""
        want_kind = {Scheme.BF16: (GateUpKind.ROWS, None), Scheme.FP8: (GateUpKind.ROWS, GateUpKind.BLOCK_SCALE)}
        mx = GateUpKind.MX_QUADS if spec.scheme is Scheme.A8W4 else GateUpKind.MX_TILES
        kind13, kind13_scale = want_kind.get(spec.scheme, (mx, mx))
        for name, t, kind in (("w13", self.w13, kind13), ("w13_scale", self.w13_scale, kind13_scale),
                              ("w13_rowexp", self.w13_rowexp, GateUpKind.ROWS)):
            if t is not None and kind is not None and t.kind is not kind:
                hint = (" (plain MXFP4 is not a kernel format: build with atom_moe.weights.prepare_* or "
                        "prepare_mxfp4_local, which tile it for the scheme)" if kind.tiled else "")
                raise WeightError(f"{name} is kind {t.kind.value}, {spec.scheme.value} weights need "
                                  f"{kind.value}{hint}")
        have = {"expert_map": self.expert_map, "w13": self.w13.data, "w2": self.w2,
                "w13_scale": None if self.w13_scale is None else self.w13_scale.data, "w2_scale": self.w2_scale,
                "w13_bias": None if self.w13_bias is None else self.w13_bias.data, "w2_bias": self.w2_bias,
                "w13_rowexp": None if self.w13_rowexp is None else self.w13_rowexp.data, "w2_rowexp": self.w2_rowexp}
        want = prepared_shapes(spec)
        for name, t in have.items():
            if name not in want:
                if t is not None:
                    raise WeightError(f"{name} is set, but {spec.scheme.value} weights take none")
                continue
            shape, dtype = want[name]
            if t is None:
                raise WeightError(f"{name} is missing: {spec.scheme.value} weights need {_fmt(shape, dtype)}")
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise WeightError(f"{name} is {_fmt(tuple(t.shape), t.dtype)}, {spec.scheme.value} weights need "
                                  f"{_fmt(shape, dtype)} for H={spec.hidden_size}, I={spec.intermediate_size}, "
                                  f"{spec.num_local_experts} local experts (module docstring of atom_moe.weights)")

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor these weights hold (for memory accounting)."""
        out = [self.expert_map, self.w13.data, self.w2]
        for t in (self.w13_scale, self.w13_bias, self.w13_rowexp):
            if t is not None:
                out.append(t.data)
        out += [t for t in (self.w2_scale, self.w2_bias, self.w2_rowexp) if t is not None]
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _tensor_version(t) -> int | None:
    """A tensor's in-place version counter; None for inference tensors, which keep none."""
    try:
        return t._version
    except (AttributeError, RuntimeError):
        return None


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _fmt(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')} [{', '.join(map(str, shape))}]"


def _scale_max(*scales: torch.Tensor) -> int:
    """Largest e8m0 byte over the given uint8 scale tensors (one host sync); 0 when all are empty."""
    maxima = [s.max() for s in scales if s.numel()]
    return int(torch.stack(maxima).max()) if maxima else 0


def prepared_shapes(spec: MoESpec) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each tensor of one layer's PreparedWeights on this rank (the table above).

    Keys: expert_map, w13, w2, and where the scheme has them w13_scale, w2_scale, w13_bias, w2_bias,
    w13_rowexp, w2_rowexp. With redundant experts E is P and E_l the rank's P/W slots.
    """
    spec = spec.kernel_spec
    H, I, E, El = spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.num_local_experts
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {"expert_map": ((E,), torch.int32)}
    if spec.scheme is Scheme.BF16:
        out |= {"w13": ((El, 2 * I, H), torch.bfloat16), "w2": ((El, H, I), torch.bfloat16)}
    elif spec.scheme is Scheme.FP8:
        nb_i, nb_h = -(-I // FP8_BLOCK), -(-H // FP8_BLOCK)
        out |= {"w13": ((El, 2 * I, H), formats.FP8_DTYPE), "w13_scale": ((El, nb_i, 2, nb_h), torch.float32),
                "w2": ((El, H, I), formats.FP8_DTYPE), "w2_scale": ((El, nb_h, nb_i), torch.float32)}
    else:  # MXFP4 as MX tiles (a16w4) or quads (a8w4), padded to 16 rows x 64 k
        if spec.scheme is Scheme.A8W4:  # w13's residuals paired (atom_moe/layouts/mx_quads.py)
            (v13, s13), (v2, s2) = mx_quads.tiled_shapes(2 * I, H, paired=True), mx_quads.tiled_shapes(H, I)
        else:
            (v13, s13), (v2, s2) = mx_tiles.tiled_shapes(2 * I, H), mx_tiles.tiled_shapes(H, I)
        out |= {"w13": ((El, *v13), torch.uint8), "w13_scale": ((El, *s13), torch.uint8),
                "w2": ((El, *v2), torch.uint8), "w2_scale": ((El, *s2), torch.uint8)}
        if spec.scheme is Scheme.A8W4:
            out |= {"w13_rowexp": ((El, 2 * I), torch.uint8), "w2_rowexp": ((El, H), torch.uint8)}
    if spec.has_bias:
        out |= {"w13_bias": ((El, 2 * I), torch.float32), "w2_bias": ((El, H), torch.float32)}
    return out


def prepared_nbytes(spec: MoESpec) -> int:
    """Bytes of one layer's PreparedWeights on this rank, from the spec alone (the table above).

    MXFP4 counts the stored MX tiles, padding included (N to 16, K to 64).
    """
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in prepared_shapes(spec).values())


def plain_mxfp4(p: PreparedWeights, experts: slice | Sequence[int] | torch.Tensor | None = None
                ) -> tuple[GateUpTensor, GateUpTensor, torch.Tensor, torch.Tensor]:
    """MX tiles or quads -> plain MXFP4 (w13, w13_scale, w2, w2_scale), rebuilt on each call (never cached).

    w13 uint8 e2m1x2 [E', 2I, H/2] and w13_scale e8m0 [E', 2I, H/32], both INTERLEAVED ROWS;
    w2 [E', H, I/2], w2_scale [E', H, I/32]. E' = all local experts, or those `experts`
    selects along dim 0 (a slice or index list, e.g. slice(j, j + 1) for local expert j alone).
    """
    if not Scheme(p.scheme).is_mxfp4:
        raise WeightError(f"plain_mxfp4 needs MXFP4 (a16w4/a8w4) weights, these are {Scheme(p.scheme).value}")
    kind = GateUpKind.MX_QUADS if Scheme(p.scheme) is Scheme.A8W4 else GateUpKind.MX_TILES
    for name, t in (("w13", p.w13), ("w13_scale", p.w13_scale)):
        if not isinstance(t, GateUpTensor) or t.kind is not kind:
            got = t.kind.value if isinstance(t, GateUpTensor) else type(t).__name__
            raise WeightError(f"plain_mxfp4: {name} must be {kind.value} for {Scheme(p.scheme).value}, got {got}")
    if isinstance(experts, int):
        raise TypeError("plain_mxfp4: select experts with a slice or index list (dim 0 is kept), not an int")
    pick = (lambda t: t) if experts is None else (lambda t: t[experts])  # noqa: E731
    H, I = p.hidden_size, p.intermediate_size
    v13 = pick(require(p.w13, GateUpLayout.INTERLEAVED, "w13"))
    s13 = pick(require(p.w13_scale, GateUpLayout.INTERLEAVED, "w13_scale"))
    if kind is GateUpKind.MX_QUADS:
        if p.w13_rowexp is None or p.w2_rowexp is None:
            raise WeightError("plain_mxfp4: a8w4 MX quads need w13_rowexp and w2_rowexp")
        r13 = pick(require(p.w13_rowexp, GateUpLayout.INTERLEAVED, "w13_rowexp"))
        q13, sc13 = _untile_experts(v13, s13, 2 * I, H, r13, paired=True)
        q2, sc2 = _untile_experts(pick(p.w2), pick(p.w2_scale), H, I, pick(p.w2_rowexp))
    else:
        q13, sc13 = _untile_experts(v13, s13, 2 * I, H)
        q2, sc2 = _untile_experts(pick(p.w2), pick(p.w2_scale), H, I)
    return (GateUpTensor(q13, GateUpLayout.INTERLEAVED), GateUpTensor(sc13, GateUpLayout.INTERLEAVED, GateUpKind.ROWS),
            q2, sc2)


def _untile_experts(values: torch.Tensor, scales: torch.Tensor, n: int, k: int, rowexp: torch.Tensor | None = None,
                    paired: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Untile one expert (dim 0) at a time (MX tiles, or MX quads when rowexp is given, their residuals
    paired or not): the int64 working set is ~16 bytes per code, too much for a whole layer at once."""
    if values.dim() != 4 or scales.dim() != 4 or values.shape[0] != scales.shape[0]:
        raise WeightError(f"MX tiles must be [E, N/16, K/64, bytes] with one scale tile per value tile, got "
                          f"{tuple(values.shape)} / {tuple(scales.shape)}")
    packed = torch.empty(values.shape[0], n, k // 2, dtype=torch.uint8, device=values.device)
    plain = torch.empty(values.shape[0], n, k // MX_BLOCK, dtype=torch.uint8, device=values.device)
    for e in range(values.shape[0]):
        if rowexp is None:
            packed[e], plain[e] = mx_tiles.untile(values[e], scales[e], n, k)
        else:
            packed[e], plain[e] = mx_quads.untile(values[e], scales[e], rowexp[e], n, k, paired)
    return packed, plain


def _expert_map(spec: MoESpec, device: torch.device) -> torch.Tensor:
    expert_map = torch.full((spec.num_experts,), -1, dtype=torch.int32)
    expert_map[list(spec.local_experts)] = torch.arange(spec.num_local_experts, dtype=torch.int32)
    return expert_map.to(device)


class _MxStack:
    """Per-expert plain MXFP4 [n, k/2] + [n, k/32] tiled into preallocated [E_l, ...] MX tiles, or MX
    quads with their row exponents (quads, for a8w4; paired: residuals paired, for w13)."""

    def __init__(self, name: str, count: int, n: int, k: int, device: torch.device, quads: bool = False,
                 paired: bool = False) -> None:
        (vs, ss) = mx_quads.tiled_shapes(n, k, paired) if quads else mx_tiles.tiled_shapes(n, k)
        self.name, self.n, self.k, self.quads, self.paired = name, n, k, quads, paired
        self.values = torch.empty(count, *vs, dtype=torch.uint8, device=device)
        self.scales = torch.empty(count, *ss, dtype=torch.uint8, device=device)
        self.rowexp = torch.empty(count, n, dtype=torch.uint8, device=device) if quads else None
        self.scale_max = torch.zeros((), dtype=torch.uint8, device=device)  # of the e8m0 bytes given
        self.flushed = 0

    def put(self, j: int, packed: torch.Tensor, scales: torch.Tensor) -> None:
        want = ((self.n, self.k // 2), (self.n, self.k // MX_BLOCK))
        for what, t, shape in (("", packed, want[0]), ("_scale", scales, want[1])):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or tuple(t.shape) != shape:
                got = _fmt(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                raise WeightError(f"{self.name}{what} of local expert {j} is {got}, expected "
                                  f"{_fmt(shape, torch.uint8)} (plain MXFP4)")
        dev = self.values.device
        packed, scales = packed.to(dev), scales.to(dev)
        if scales.numel():
            self.scale_max = torch.maximum(self.scale_max, scales.max())
        if self.quads:
            self.values[j], self.scales[j], self.rowexp[j], flushed = mx_quads.tile(packed, scales, self.paired)
            self.flushed += flushed
        else:
            self.values[j], self.scales[j] = mx_tiles.tile(packed, scales)


def prepare_mxfp4_local(spec: MoESpec, experts: Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
                        *, device: torch.device | str | None = None, w13_bias: GateUpTensor | None = None,
                        w2_bias: torch.Tensor | None = None) -> PreparedWeights:
    """Plain MXFP4 of each local expert -> PreparedWeights holding MX tiles (a16w4) or MX quads (a8w4).

    `experts` yields, in local order, spec.num_local_experts tuples (w13 uint8 [2I, H/2] with
    INTERLEAVED rows, w13_scale uint8 [2I, H/32] INTERLEAVED, w2 uint8 [H, I/2], w2_scale uint8
    [H, I/32]). Each is tiled onto `device` (default: that of the first w13) into the stacked
    result and dropped before the next is drawn, so a generator never has more than one
    expert's plain copy alive. Biases, if any, are already prepared: w13_bias INTERLEAVED fp32
    [E_l, 2I], w2_bias fp32 [E_l, H].
    """
    if not spec.scheme.is_mxfp4:
        raise WeightError(f"prepare_mxfp4_local builds MXFP4 (a16w4/a8w4) weights, the spec's scheme is "
                          f"{spec.scheme.value}")
    spec = spec.kernel_spec  # redundant experts: `experts` yields one tuple per local slot
    H, I, El = spec.hidden_size, spec.intermediate_size, spec.num_local_experts
    dev = None if device is None else torch.device(device)
    quads = spec.scheme is Scheme.A8W4
    st13 = st2 = None
    count = 0
    for item in experts:
        if count >= El:
            raise WeightError(f"prepare_mxfp4_local: more than {El} experts given (the spec has {El} local)")
        if len(item) != 4:
            raise WeightError("prepare_mxfp4_local: each expert is (w13, w13_scale, w2, w2_scale)")
        if st13 is None:
            dev = dev or item[0].device
            st13, st2 = _MxStack("w13", El, 2 * I, H, dev, quads, quads), _MxStack("w2", El, H, I, dev, quads)
        st13.put(count, item[0], item[1])
        st2.put(count, item[2], item[3])
        del item  # the plain copy goes before the next expert's is drawn
        count += 1
    if count != El:
        raise WeightError(f"prepare_mxfp4_local: {count} experts given, the spec has {El} local")
    if st13 is None:  # no local experts
        dev = dev or torch.device("cpu")
        st13, st2 = _MxStack("w13", 0, 2 * I, H, dev, quads, quads), _MxStack("w2", 0, H, I, dev, quads)
    kind = GateUpKind.MX_QUADS if quads else GateUpKind.MX_TILES
    flushed = st13.flushed + st2.flushed
    if flushed:
        warnings.warn(f"a8w4: {flushed} MXFP4 blocks of this layer have a scale more than 2^11 below their row's "
                      f"largest and are flushed to zero (atom_moe/layouts/mx_quads.py); a16w4 keeps them", stacklevel=2)
    return PreparedWeights(
        scheme=spec.scheme, hidden_size=H, intermediate_size=I, num_experts=spec.num_experts,
        local_experts=spec.local_experts, num_local_experts=El, expert_map=_expert_map(spec, dev),
        w13=GateUpTensor(st13.values, GateUpLayout.INTERLEAVED, kind),
        w13_scale=GateUpTensor(st13.scales, GateUpLayout.INTERLEAVED, kind),
        w2=st2.values, w2_scale=st2.scales, w13_bias=w13_bias, w2_bias=w2_bias,
        mx_scale_max=int(torch.maximum(st13.scale_max, st2.scale_max)),
        w13_rowexp=GateUpTensor(st13.rowexp, GateUpLayout.INTERLEAVED) if quads else None,
        w2_rowexp=st2.rowexp, mx_flush=flushed > 0,
    )


# ---------------------------------------------------------------- one matrix
# A "matrix" is (data, scale, fmt) for one [N, K] weight of one expert, fmt in
# {"float", "fp8", "mxfp4"}: float has no scale, fp8 has 128x128 block scales, mxfp4 is
# packed e2m1 [N, K/2] with e8m0 [N, K/32].
def _source_format(data: torch.Tensor, scale: torch.Tensor | None, what: str) -> str:
    if data.dtype in (torch.bfloat16, torch.float16, torch.float32):
        if scale is not None:
            raise WeightError(f"{what}: a {data.dtype} weight takes no scale")
        return "float"
    if data.dtype == formats.FP8_DTYPE:
        if scale is None:
            raise WeightError(f"{what}: an fp8 weight needs its 128x128 block scales (weight_scale_inv)")
        return "fp8"
    if data.dtype == torch.uint8:
        if scale is None or scale.dtype != torch.uint8:
            raise WeightError(f"{what}: an MXFP4 (uint8) weight needs uint8 e8m0 scales")
        return "mxfp4"
    raise WeightError(f"{what}: unsupported weight dtype {data.dtype}; allowed: bf16/fp16/fp32, "
                      f"float8_e4m3fn with block scales, uint8 MXFP4 with e8m0 scales")


def _dequantize(data: torch.Tensor, scale: torch.Tensor | None, fmt: str) -> torch.Tensor:
    if fmt == "float":
        return data.float()
    if fmt == "fp8":
        return formats.dequantize_fp8_block(data, scale, FP8_BLOCK)
    return formats.dequantize_mxfp4(data, scale)


def _target_format(scheme: Scheme) -> str:
    return {Scheme.BF16: "float", Scheme.FP8: "fp8"}.get(scheme, "mxfp4")


def _convert(data: torch.Tensor, scale: torch.Tensor | None, src: str, dst: str):
    """One [N, K] matrix from format src to dst; same format passes through untouched."""
    if src == dst:
        return (data.to(torch.bfloat16) if dst == "float" else data), scale
    full = _dequantize(data, scale, src)
    if dst == "float":
        return full.to(torch.bfloat16), None
    if dst == "fp8":
        return formats.quantize_fp8_block(full, FP8_BLOCK)
    return formats.quantize_mxfp4(full)


def _expected_k(fmt: str, k: int) -> int:
    return k // 2 if fmt == "mxfp4" else k


# ---------------------------------------------------------------- builders
def _check_count(name: str, tensor: torch.Tensor, spec: MoESpec, expert_ids: Sequence[int]) -> None:
    if tensor.shape[0] != len(expert_ids):
        raise WeightError(f"{name} holds {tensor.shape[0]} experts, expected {len(expert_ids)} "
                          f"(expert_ids given: {len(expert_ids)})")


def prepare_stacked(spec: MoESpec, w13: torch.Tensor, w2: torch.Tensor, *, layout: GateUpLayout | str,
                    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                    w13_bias: torch.Tensor | None = None, w2_bias: torch.Tensor | None = None,
                    expert_ids: Sequence[int] | None = None, device: torch.device | str | None = None
                    ) -> PreparedWeights:
    """Engine-stacked w13 [E', 2I, K'] / w2 [E', H, I'] (+scales, biases) -> PreparedWeights.

    `layout` names the gate/up layout of w13 (and its scales and bias): it is required,
    never guessed. `expert_ids` names the global expert of each stacked row; by default
    all `spec.num_experts` experts. Only the spec's local experts are kept.
    fp8 w13 scales are [E', 2*ceil(I/128), ceil(H/128)] when SEPARATED (each of gate and
    up blocked on its own) or [E', ceil(I/128), 2, ceil(H/128)] when INTERLEAVED.
    MXFP4 schemes (a16w4, a8w4) come out as MX tiles (prepare_mxfp4_local), built one
    expert at a time; `plain_mxfp4` gives the plain form back.
    Redundant experts (spec.redundant): the rows stay logical experts, and each of the
    rank's physical slots gets a copy of the expert it holds (weights per slot, numbered
    by slot id: spec.kernel_spec).
    """
    layout = GateUpLayout(layout)
    ids = list(range(spec.num_experts)) if expert_ids is None else [int(e) for e in expert_ids]
    if spec.redundant:
        return _prepare_slots(spec, ids, layout, device, w13=w13, w2=w2, w13_scale=w13_scale, w2_scale=w2_scale,
                              w13_bias=w13_bias, w2_bias=w2_bias)
    for name, t in (("w13", w13), ("w2", w2), ("w13_scale", w13_scale), ("w2_scale", w2_scale),
                    ("w13_bias", w13_bias), ("w2_bias", w2_bias)):
        if t is not None:
            _check_count(name, t, spec, ids)
    if spec.has_bias != (w13_bias is not None and w2_bias is not None):
        raise WeightError(f"spec.has_bias={spec.has_bias} needs both w13_bias and w2_bias "
                          f"{'given' if spec.has_bias else 'absent'}")
    row_of = {e: i for i, e in enumerate(ids)}
    missing = [e for e in spec.local_experts if e not in row_of]
    if missing:
        raise WeightError(f"local experts {missing} are not among the given expert_ids")

    H, I = spec.hidden_size, spec.intermediate_size
    src13 = _source_format(w13, w13_scale, "w13")
    src2 = _source_format(w2, w2_scale, "w2")
    for name, t, fmt, n, k in (("w13", w13, src13, 2 * I, H), ("w2", w2, src2, H, I)):
        if tuple(t.shape[1:]) != (n, _expected_k(fmt, k)):
            raise WeightError(f"{name} has shape {tuple(t.shape)}, expected [E, {n}, {_expected_k(fmt, k)}] "
                              f"for H={H}, I={I} in {fmt} format")
    for name, t, fmt, n, k in (("w13_scale", w13_scale, src13, 2 * I, H), ("w2_scale", w2_scale, src2, H, I)):
        if fmt == "mxfp4":
            want = (n, k // 32)
        elif fmt == "fp8" and name == "w2_scale":
            want = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
        elif fmt == "fp8":  # w13 block rows depend on the layout: checked in _gate_up_selectors
            want = (*t.shape[1:-1], -(-k // FP8_BLOCK))
        else:
            continue
        if tuple(t.shape[1:]) != want:
            raise WeightError(f"{name} has shape {tuple(t.shape)}, expected [E, {', '.join(map(str, want))}] "
                              f"for H={H}, I={I} in {fmt} format")
    dst = _target_format(spec.scheme)
    dev = torch.device(device) if device is not None else w13.device

    gate_rows, up_rows, g13, u13 = _gate_up_selectors(layout, w13_scale, src13, I)
    bias13 = bias2 = None
    if spec.has_bias:
        local_rows = torch.tensor([row_of[e] for e in spec.local_experts], device=w13_bias.device)
        b13 = w13_bias.index_select(0, local_rows).float().to(dev)
        bias13 = interleave(GateUpTensor(b13, layout)) if layout is GateUpLayout.SEPARATED \
            else GateUpTensor(b13.contiguous(), GateUpLayout.INTERLEAVED)
        bias2 = w2_bias.index_select(0, local_rows.to(w2_bias.device)).float().to(dev).contiguous()

    def local_expert(e: int):
        """(gate data, gate scale, up data, up scale, w2, w2 scale) of global expert e in format dst."""
        r = row_of[e]
        gd, gs = _convert(w13[r, gate_rows], None if w13_scale is None else w13_scale[r][g13], src13, dst)
        ud, us = _convert(w13[r, up_rows], None if w13_scale is None else w13_scale[r][u13], src13, dst)
        d2, s2 = _convert(w2[r], None if w2_scale is None else w2_scale[r], src2, dst)
        return gd, gs, ud, us, d2, s2

    if dst == "mxfp4":  # one expert at a time: interleave its rows, tile it; no stacked plain copy
        def plain():
            for e in spec.local_experts:
                gd, gs, ud, us, d2, s2 = local_expert(e)
                yield _interleave_rows(gd, ud), _interleave_rows(gs, us), d2, s2
        return prepare_mxfp4_local(spec, plain(), device=dev, w13_bias=bias13, w2_bias=bias2)

    w13_parts, s13_parts, w2_parts, s2_parts = [], [], [], []
    for e in spec.local_experts:
        gd, gs, ud, us, d2, s2 = local_expert(e)
        w13_parts.append(torch.cat((gd, ud)).to(dev))
        if gs is not None:
            s13_parts.append(torch.cat((gs, us)).to(dev))
        w2_parts.append(d2.to(dev))
        if s2 is not None:
            s2_parts.append(s2.to(dev))

    scale_kind = GateUpKind.BLOCK_SCALE if dst == "fp8" else GateUpKind.ROWS
    prepared13 = interleave(GateUpTensor(torch.stack(w13_parts), GateUpLayout.SEPARATED))
    prepared13_scale = (interleave(GateUpTensor(torch.stack(s13_parts), GateUpLayout.SEPARATED, scale_kind))
                        if s13_parts else None)
    return PreparedWeights(
        scheme=spec.scheme, hidden_size=H, intermediate_size=I, num_experts=spec.num_experts,
        local_experts=spec.local_experts, num_local_experts=spec.num_local_experts,
        expert_map=_expert_map(spec, dev), w13=prepared13, w13_scale=prepared13_scale,
        w2=torch.stack(w2_parts), w2_scale=torch.stack(s2_parts) if s2_parts else None,
        w13_bias=bias13, w2_bias=bias2,
    )


def _prepare_slots(spec: MoESpec, ids: list[int], layout: GateUpLayout, device, **tensors) -> PreparedWeights:
    """prepare_stacked for a redundant spec: pick each local slot's logical row, then prepare the slots."""
    row_of = {e: i for i, e in enumerate(ids)}
    for name, t in tensors.items():
        if t is not None:
            _check_count(name, t, spec, ids)
    missing = sorted({e for e in spec.local_experts if e not in row_of})
    if missing:
        raise WeightError(f"local experts {missing} (held by this rank's slots) are not among the given expert_ids")
    kspec = spec.kernel_spec
    rows = [row_of[e] for e in spec.local_experts]  # one row per slot: a replicated expert is copied
    picked = {n: None if t is None else t[torch.tensor(rows, device=t.device)] for n, t in tensors.items()}
    return prepare_stacked(kspec, layout=layout, expert_ids=kspec.local_experts, device=device, **picked)


def _interleave_rows(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[n, ...] gate rows and [n, ...] up rows -> [2n, ...] rows g0, u0, g1, u1, ..."""
    return torch.stack((gate, up), dim=1).flatten(0, 1)


def _gate_up_selectors(layout: GateUpLayout, w13_scale, src: str, I: int):
    """Index objects selecting gate and up rows (and their scale rows) of one expert."""
    if layout is GateUpLayout.SEPARATED:
        gate_rows, up_rows = slice(0, I), slice(I, 2 * I)
    else:
        gate_rows, up_rows = slice(0, 2 * I, 2), slice(1, 2 * I, 2)
    if src != "fp8":
        return gate_rows, up_rows, gate_rows, up_rows  # MX scales are row tensors
    nb = -(-I // FP8_BLOCK)
    if layout is GateUpLayout.SEPARATED:
        if w13_scale.shape[1] != 2 * nb:
            raise WeightError(f"separated fp8 w13 scales need {2 * nb} block rows (gate and up blocked "
                              f"separately, ceil(I/128) each), got shape {tuple(w13_scale.shape)}")
        return gate_rows, up_rows, slice(0, nb), slice(nb, 2 * nb)
    if w13_scale.dim() != 4 or w13_scale.shape[1:3] != (nb, 2):
        raise WeightError(f"interleaved fp8 w13 scales must be [E, {nb}, 2, kb], got {tuple(w13_scale.shape)}")
    return gate_rows, up_rows, (slice(None), 0), (slice(None), 1)
