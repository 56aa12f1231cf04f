"""Gate/up row layouts of the fused w13 tensor, typed and tagged.

SEPARATED   (checkpoints, vLLM, SGLang):   rows [g0, g1, ..., g(I-1), u0, u1, ..., u(I-1)]
INTERLEAVED (atom_moe kernels, gpt-oss):   rows [g0, u0, g1, u1, ..., g(I-1), u(I-1)]

Row-shaped tensors (weights [E, 2I, K], MXFP4 scales [E, 2I, K/32], biases [E, 2I]) are
interleaved row by row. fp8 128x128 block scales have one row per 128 output rows:
SEPARATED [E, 2*nb, kb] (all gate blocks, then all up blocks, nb = ceil(I/128)) becomes
INTERLEAVED [E, nb, 2, kb] (gate block j, up block j, ...), so output pair j of the
interleaved weight reads scale [e, j // 128, 0 or 1, kb] even when I % 128 != 0.

MX_TILES (atom_moe.layouts.mx_tiles) holds MXFP4 values or scales repacked into the kernels' tiles
[E, N/16, K/64, 512 or 32]; the rows of w13 are tiled in INTERLEAVED order, so the tag is
INTERLEAVED. Rows are no longer a dimension there: interleave, separate and split_gate_up
refuse it (untile first with atom_moe.weights.plain_mxfp4). MX_QUADS (atom_moe.layouts.mx_quads) is
a8w4's variant, same shapes, another word order and per-row residual scales; the same rules hold.

A kernel never accepts a raw tensor: it accepts a GateUpTensor and calls
`require(t, INTERLEAVED)`. Mispairing gate and up rows does not crash, it silently
collapses accuracy (gsm8k 0.95 -> 0.017), so the tag is checked, never assumed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch


class LayoutError(TypeError):
    """A tensor with the wrong (or no) gate/up layout tag was handed to a kernel."""


class GateUpLayout(str, enum.Enum):
    """Row order of a w13 tensor: all gate rows then all up rows, or gate/up pairs interleaved."""

    SEPARATED = "separated"
    INTERLEAVED = "interleaved"


class GateUpKind(str, enum.Enum):
    ROWS = "rows"  # one row per output feature: weights, MXFP4 scales, biases
    BLOCK_SCALE = "block_scale"  # fp8 128x128 block scales
    MX_TILES = "mx_tiles"  # MXFP4 values / e8m0 scales in atom_moe.layouts.mx_tiles' layout [E, N/16, K/64, bytes]
    MX_QUADS = "mx_quads"  # a8w4: MXFP4 values / residual scales in atom_moe.layouts.mx_quads' layout, same shapes

    @property
    def tiled(self) -> bool:
        """MX tiles or quads: rows packed inside 16-row blocks, not a dimension."""
        return self in (GateUpKind.MX_TILES, GateUpKind.MX_QUADS)


@dataclass(frozen=True)
class GateUpTensor:
    """A w13-shaped tensor that knows its gate/up layout."""

    data: torch.Tensor
    layout: GateUpLayout
    kind: GateUpKind = GateUpKind.ROWS

    def __post_init__(self) -> None:
        if not isinstance(self.data, torch.Tensor):
            raise LayoutError(f"GateUpTensor.data must be a torch.Tensor, got {type(self.data).__name__}")
        object.__setattr__(self, "layout", GateUpLayout(self.layout))
        object.__setattr__(self, "kind", GateUpKind(self.kind))
        if self.kind.tiled:  # dim -3 counts 16-row blocks: no row-pair check possible
            if self.data.dim() < 3:
                raise LayoutError(f"{self.kind.value} are [..., N/16, K/64, bytes], got shape {tuple(self.data.shape)}")
            return
        rows_dim = _rows_dim(self)
        if self.layout is GateUpLayout.SEPARATED or self.kind is GateUpKind.ROWS:
            if self.data.shape[rows_dim] % 2:
                raise LayoutError(f"gate/up tensor needs an even row count, got shape {tuple(self.data.shape)}")
        elif self.data.shape[-2] != 2:
            raise LayoutError(f"interleaved block scales must be [E, nb, 2, kb], got {tuple(self.data.shape)}")


def _refuse_tiles(t: GateUpTensor, op: str) -> None:
    if t.kind.tiled:
        raise LayoutError(f"{op} cannot reorder rows of {t.kind.value} (gate/up rows are packed inside 16-row "
                          f"blocks); untile first with atom_moe.weights.plain_mxfp4")


def _rows_dim(t: GateUpTensor) -> int:
    # Weights [E, 2I, K] and scales: rows are dim 1 (dim -2 of a 3D tensor); biases [E, 2I]: dim -1.
    if t.kind is GateUpKind.BLOCK_SCALE:
        return -3 if t.layout is GateUpLayout.INTERLEAVED else -2
    return -1 if t.data.dim() == 2 else -2


def interleave(t: GateUpTensor) -> GateUpTensor:
    """SEPARATED -> INTERLEAVED (returns a new contiguous tensor)."""
    _refuse_tiles(t, "interleave")
    if t.layout is GateUpLayout.INTERLEAVED:
        return t
    if t.kind is GateUpKind.BLOCK_SCALE:  # [E, 2nb, kb] -> [E, nb, 2, kb]
        d = t.data
        nb2 = d.shape[-2]
        out = d.reshape(*d.shape[:-2], 2, nb2 // 2, d.shape[-1]).transpose(-3, -2).contiguous()
        return GateUpTensor(out, GateUpLayout.INTERLEAVED, t.kind)
    dim = _rows_dim(t) % t.data.dim()
    d = t.data
    half = d.shape[dim] // 2
    split = d.reshape(*d.shape[:dim], 2, half, *d.shape[dim + 1:])
    out = split.transpose(dim, dim + 1).reshape(d.shape).contiguous()
    return GateUpTensor(out, GateUpLayout.INTERLEAVED, t.kind)


def separate(t: GateUpTensor) -> GateUpTensor:
    """INTERLEAVED -> SEPARATED (the inverse of interleave)."""
    _refuse_tiles(t, "separate")
    if t.layout is GateUpLayout.SEPARATED:
        return t
    d = t.data
    if t.kind is GateUpKind.BLOCK_SCALE:  # [E, nb, 2, kb] -> [E, 2nb, kb]
        out = d.transpose(-3, -2).reshape(*d.shape[:-3], 2 * d.shape[-3], d.shape[-1]).contiguous()
        return GateUpTensor(out, GateUpLayout.SEPARATED, t.kind)
    dim = _rows_dim(t) % d.dim()
    half = d.shape[dim] // 2
    pairs = d.reshape(*d.shape[:dim], half, 2, *d.shape[dim + 1:])
    out = pairs.transpose(dim, dim + 1).reshape(d.shape).contiguous()
    return GateUpTensor(out, GateUpLayout.SEPARATED, t.kind)


def require(t: object, layout: GateUpLayout, what: str = "w13") -> torch.Tensor:
    """Return t.data if t is a GateUpTensor tagged `layout`; raise LayoutError otherwise."""
    if isinstance(t, torch.Tensor):
        raise LayoutError(
            f"{what}: got an untagged torch.Tensor; gate/up tensors must be prepared "
            f"(atom_moe.weights.prepare_*) so their layout is known, expected {layout.value}"
        )
    if not isinstance(t, GateUpTensor):
        raise LayoutError(f"{what}: expected a GateUpTensor tagged {layout.value}, got {type(t).__name__}")
    if t.layout is not layout:
        raise LayoutError(
            f"{what}: tagged {t.layout.value}, but this kernel needs {layout.value}; "
            f"convert with atom_moe.layouts.gate_up.{'interleave' if layout is GateUpLayout.INTERLEAVED else 'separate'}()"
        )
    return t.data


def split_gate_up(t: GateUpTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate rows, up rows) views of a row-kind tensor in either layout."""
    _refuse_tiles(t, "split_gate_up")
    if t.kind is not GateUpKind.ROWS:
        raise LayoutError("split_gate_up works on row tensors (weights, MX scales, biases)")
    d = t.data
    dim = _rows_dim(t) % d.dim()
    if t.layout is GateUpLayout.SEPARATED:
        return d.chunk(2, dim=dim)
    idx = torch.arange(d.shape[dim], device=d.device)
    return d.index_select(dim, idx[0::2]), d.index_select(dim, idx[1::2])
