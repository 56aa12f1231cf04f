"""Shared builders for the kernel tests: random layers, routings and error measures."""

from __future__ import annotations

import torch

from atom_moe.reference import ReferenceWeights, reference_moe, reference_moe_prepared
from atom_moe.spec import Activation, ActivationKind, MoESpec, Placement
from atom_moe.weights import PreparedWeights, prepare_stacked

OAI = Activation(ActivationKind.SWIGLU_OAI, alpha=1.702, limit=7.0)


def make_layer(H: int, I: int, E: int, k: int, scheme: str, *, oai: bool = False, bias: bool = False,
               local_experts: tuple[int, ...] | None = None, device: str = "cpu",
               gate_std: float | None = None, activation: Activation | None = None
               ) -> tuple[MoESpec, PreparedWeights]:
    """A random layer (spec + prepared weights); gate/up ~ N(0, gate_std^2) for x ~ N(0, 1).

    By default gate_std is 1, and 4 for gpt-oss's variant in bf16 so its clamp at limit=7
    is exercised. (fp8 defaults to 1: per-group e4m3 activations alone put the scheme ~4%
    from the unquantized oracle on SwiGLU data, close to the 5e-2 bound; see the tests.)
    `activation` overrides the one `oai` picks.
    """
    placement = Placement() if local_experts is None else Placement(0, 2, local_experts)
    act = activation if activation is not None else OAI if oai else Activation()
    spec = MoESpec(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, scheme=scheme,
                   activation=act, has_bias=bias, placement=placement)
    gate_std = (4.0 if oai and scheme == "bf16" else 1.0) if gate_std is None else gate_std
    w13 = torch.randn(E, 2 * I, H, device=device) * (gate_std / H ** 0.5)
    w2 = torch.randn(E, H, I, device=device) / I ** 0.5
    b13 = torch.randn(E, 2 * I, device=device) if bias else None
    b2 = torch.randn(E, H, device=device) * 0.5 if bias else None
    return spec, prepare_stacked(spec, w13, w2, layout="separated", w13_bias=b13, w2_bias=b2, device=device)


def make_routing(T: int, E: int, k: int, *, mode: str = "random", device: str = "cpu"):
    """(topk_weights fp32 [T, k], topk_ids int32 [T, k]) with distinct ids per token.

    mode: "random"; "sentinels" (some -1 and E ids); "one_expert" (every token's slot 0 is
    expert 0, so one expert takes every token).
    """
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]).to(torch.int32)
    if mode == "one_expert":
        ids = torch.stack([torch.cat((torch.zeros(1, dtype=torch.int64), torch.randperm(E - 1)[:k - 1] + 1))
                           for _ in range(T)]).to(torch.int32)
    elif mode == "sentinels":
        drop = torch.rand(T, k) < 0.3
        ids = torch.where(drop, torch.where(torch.rand(T, k) < 0.5, -1, E), ids).to(torch.int32)
        ids[0] = -1  # a token with no expert at all
    weights = torch.rand(T, k) + 0.1
    return weights.to(device), ids.to(device)


# T = 1 calls pooled for one error check: over a single row, a8w4's distance to the twin and to the fp32 layer
# spreads from seed to seed up to the bounds themselves (docs/perf/a8w4-error-probe-h100-2026-12-07.csv)
T1_DRAWS = 4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error ||a - b|| / ||b|| in fp64; NaN anywhere gives inf."""
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def twin_tol(spec: MoESpec, device: torch.device) -> float:
    """Largest rel_err allowed between the fused layer and experts_torch: 1e-2, or 2e-2 for a8w4 on a GPU.

    a8w4's GEMM1 keeps one fp8 accumulator over all of K (atom_moe.spec.Scheme.x_per_token). Hopper's fp8 MMAs
    accumulate with fewer bits than the twin's fp32, so some of GEMM2's e4m3 inputs round the other way, each
    moving by up to 1/16 of itself. On an H100 (2026-12-06, H = 5120-7168) the two then differed by 0.67-1.22e-2
    while both stayed as far from the fp32 layer (within 1.3e-4 of each other): `assert_near_twin` checks that
    too. The interpreter accumulates in plain fp32, so the CPU keeps 1e-2: there only the sum order differs from
    the twin's (2 of 15360 bf16 SwiGLU elements one step apart, none a row's largest; 10 seeds, 2026-12-06). A
    row whose largest value lands one step apart gets another e4m3 scale: its codes move as on the GPU (rare;
    it would show only where that row carries most of a test's error)."""
    return 2e-2 if spec.scheme.x_per_token and torch.device(device).type == "cuda" else 1e-2


def assert_near_twin(got: torch.Tensor, twin: torch.Tensor, x, w, ids, spec: MoESpec, p: PreparedWeights,
                     what: str = "") -> None:
    """got within twin_tol of the twin, and no further from the fp32 layer (no activation quant) than the twin is,
    give or take 1e-3 (an error of the kernel's own cannot hide in the wider twin bound)."""
    assert rel_err(got, twin) <= twin_tol(spec, got.device), what
    if spec.scheme.x_per_token and got.is_cuda:
        truth = reference_moe_prepared(x, w, ids, p, spec.activation)
        assert rel_err(got, truth) <= rel_err(twin, truth) + 1e-3, what


def reference(x, w, ids, spec: MoESpec, p: PreparedWeights, act_quant: bool) -> torch.Tensor:
    """fp32 oracle on the dequantized prepared weights, local experts only."""
    ref_w = ReferenceWeights.from_prepared(p)
    return reference_moe(x, w, ids, ref_w, spec.activation, experts=spec.local_experts,
                         act_quant=spec.scheme if act_quant else None)


def flushable_mxfp4(E: int, H: int, I: int, drop: float) -> list[tuple[torch.Tensor, ...]]:
    """Plain MXFP4 (w13, w13 scales, w2, w2 scales) of E experts: random e2m1 bytes and e8m0 scales,
    a `drop` fraction of the blocks 15-37 binades down, so a8w4 flushes some (atom_moe/layouts/mx_quads.py)."""
    def block(rows, cols):
        packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8)
        scales = torch.randint(119, 126, (rows, cols // 32), dtype=torch.uint8)
        low = torch.rand(scales.shape) < drop
        scales[low] = torch.randint(90, 108, (int(low.sum()),), dtype=torch.uint8)
        return packed, scales
    return [(*block(2 * I, H), *block(H, I)) for _ in range(E)]


def poison(ws) -> None:
    """Fill every workspace buffer with garbage (NaN for floats) so unwritten reads show."""
    for name in ("sorted_ids", "block_expert", "cursor", "chunk_counts", "counters"):
        getattr(ws, name).fill_(-7777)
    for name in ("partial", "inter", "inter_scale", "x_q", "x_scale", "inter_wide"):
        t = getattr(ws, name)
        if t is not None:
            t.untyped_storage().fill_(0xFF)  # NaN in fp32, bf16 and e4m3 (inter_scale is a transposed view)
