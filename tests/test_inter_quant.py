"""a8w4 with one scale per token on GEMM2's input (ATOM_MOE_A8W4_INTER=token): the flag, the quant launch
(kernels/inter_quant.py) bit for bit against atom_moe.formats, and the layer against its twin and the reference
(CPU, TRITON_INTERPRET=1, small shapes)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import make_layer, make_routing, poison, reference, rel_err  # noqa: E402

from atom_moe import formats  # noqa: E402
from atom_moe.experts import allocate_workspace, fused_experts  # noqa: E402
from atom_moe.experts_torch import experts_torch  # noqa: E402
from atom_moe.kernels import gemm1, inter_quant, routing  # noqa: E402
from atom_moe.layouts.gate_up import GateUpLayout, GateUpTensor, LayoutError  # noqa: E402
from atom_moe.kernels.tuning import TileConfig  # noqa: E402
from atom_moe.reference import quant_dequant_activations  # noqa: E402
from atom_moe.spec import A8W4_INTER_FLAG, Activation, ActivationKind, Scheme, SpecError  # noqa: E402
from atom_moe.tools.common import record_launches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
F8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == F8 else t.view(torch.int32)


@pytest.mark.parametrize("value, per_token", [(None, True), ("group", False), ("token", True)])
def test_flag(monkeypatch, value, per_token):
    if value is None:
        monkeypatch.delenv(A8W4_INTER_FLAG, raising=False)
    else:
        monkeypatch.setenv(A8W4_INTER_FLAG, value)
    assert Scheme.A8W4.inter_per_token is per_token
    assert not any(s.inter_per_token for s in Scheme if s is not Scheme.A8W4)  # a8w4's switch only


def test_bad_flag_names_the_allowed_values(monkeypatch):
    monkeypatch.setenv(A8W4_INTER_FLAG, "row")
    with pytest.raises(SpecError, match=r"ATOM_MOE_A8W4_INTER='row': allowed are token .* or group"):
        Scheme.A8W4.inter_per_token


def test_reference_quantizes_the_bf16_row(monkeypatch, seed):
    a = torch.randn(7, 200) * torch.rand(7, 1) * 30
    monkeypatch.setenv(A8W4_INTER_FLAG, "token")
    q, s = formats.quantize_fp8_per_token(a.bfloat16())
    assert torch.equal(quant_dequant_activations(a, Scheme.A8W4, inter=True), q.float() * s)
    assert torch.equal(quant_dequant_activations(a, Scheme.FP8, inter=True),  # fp8 keeps its 128-groups
                       formats.dequantize_fp8_per_group(*formats.quantize_fp8_per_group(a, 128), 128))
    monkeypatch.setenv(A8W4_INTER_FLAG, "group")
    assert not torch.equal(quant_dequant_activations(a, Scheme.A8W4, inter=True), q.float() * s)


@pytest.mark.parametrize("inter", [96, 200])  # a power of two's worth of columns, and a masked tail
def test_quantize_rows_matches_formats(seed, inter):
    block_m, n_blocks, num_pairs = 4, 5, 11
    rows = n_blocks * block_m
    src = (torch.randn(rows, inter) * torch.rand(rows, 1).mul(50)).bfloat16()
    src[3] = 0.0  # a zero row: scale 1
    src[6, 17] = float("nan")  # a NaN row: NaN scale and codes, as formats gives
    # blocks 0, 1, 3 hold pairs (padding rows hold num_pairs), block 2 no expert, block 4 one pair
    sorted_ids = torch.full((rows,), num_pairs, dtype=torch.int32)
    sorted_ids[[0, 1, 2, 3, 4, 5, 6, 12, 13, 14, 16]] = torch.arange(num_pairs, dtype=torch.int32)
    block_expert = torch.tensor([0, 1, -1, 2, 3], dtype=torch.int32)
    dst = torch.full((rows, inter), 0x7F, dtype=torch.uint8).view(F8)  # NaN: untouched rows stay NaN
    scales = torch.full((-(-inter // 64), rows), -1.0).t()  # group-major, as the workspace keeps it
    inter_quant.quantize_rows(src.to(DEVICE), dst.to(DEVICE), scales.to(DEVICE), sorted_ids.to(DEVICE),
                              block_expert.to(DEVICE), n_blocks, block_m, num_pairs)
    dst, scales = dst.cpu(), scales.cpu()
    done = [0, 1, 2, 3, 4, 5, 6, 12, 13, 14, 16]
    q, s = formats.quantize_fp8_per_token(src[done])
    finite = [i for i, r in enumerate(done) if r != 6]
    assert torch.equal(_bits(dst[done][finite]), _bits(q[finite]))
    assert torch.equal(scales[done, 0][finite], s[finite, 0]) and scales[3, 0] == 1.0
    # a row holding NaN: its scale is NaN, so is every value GEMM2 makes of it (codes unspecified, docs/formats.md)
    assert scales[6, 0].isnan() and s[done.index(6), 0].isnan()
    skipped = [r for r in range(rows) if r not in done]  # padding and the block of no expert
    assert (dst[skipped].view(torch.uint8) == 0x7F).all() and (scales[skipped, 0] == -1.0).all()
    assert (scales[:, 1:] == -1.0).all()  # only column 0 is GEMM2's


def test_quantize_rows_pair_blocks_skip_other_ranks_pairs(seed):
    T, k, inter = 3, 2, 64
    src = torch.randn(T * k, inter).bfloat16()
    ids = torch.tensor([[0, 5], [-1, 2], [3, 1]], dtype=torch.int32)
    expert_map = torch.tensor([0, -1, 1, 2, -1, 3], dtype=torch.int32)  # experts 1 and 4 on another rank
    dst = torch.full((T * k, inter), 0x7F, dtype=torch.uint8).view(F8)
    scales = torch.full((1, T * k), -1.0).t()
    unused = torch.zeros(1, dtype=torch.int32)
    inter_quant.quantize_rows(src, dst, scales, unused, unused, T * k, 1, T * k, (ids, expert_map))
    local = [0, 1, 3, 4]  # pairs (0,0), (0,1) expert 5, (1,1) expert 2, (2,0) expert 3
    q, s = formats.quantize_fp8_per_token(src[local])
    assert torch.equal(_bits(dst[local]), _bits(q)) and torch.equal(scales[local, 0], s[:, 0])
    assert (dst[[2, 5]].view(torch.uint8) == 0x7F).all() and (scales[[2, 5], 0] == -1.0).all()


def test_quantize_rows_refuses_bad_buffers():
    src, dst = torch.zeros(8, 64, dtype=torch.bfloat16), torch.zeros(8, 64, dtype=F8)
    ids = torch.zeros(8, dtype=torch.int32)
    with pytest.raises(ValueError, match="dst_scale must be fp32 and group-major"):
        inter_quant.quantize_rows(src, dst, torch.zeros(8, 2), ids, ids, 2, 4, 8)  # row-major
    with pytest.raises(ValueError, match="src must be bf16 with contiguous rows"):
        inter_quant.quantize_rows(src.float(), dst, torch.zeros(1, 8).t(), ids, ids, 2, 4, 8)
    with pytest.raises(ValueError, match=r"dst must be e4m3 \[rows, 64\]"):
        inter_quant.quantize_rows(src, dst.float(), torch.zeros(1, 8).t(), ids, ids, 2, 4, 8)
    with pytest.raises(ValueError, match="12 rows to quantize, the buffers hold 8"):
        inter_quant.quantize_rows(src, dst, torch.zeros(1, 8).t(), ids, ids, 3, 4, 8)


CASES = [  # H, I, E, k, T, oai, bias, mode, local, config (None: the heuristic's)
    (160, 96, 4, 2, 5, True, True, "random", None, None),
    (224, 160, 6, 3, 21, False, False, "sentinels", (1, 2, 4, 5), TileConfig(32, 256, 64, 4, 2, 64, 64, 4, 2)),
    (256, 288, 8, 4, 19, True, True, "one_expert", None, TileConfig(16, 128, 128, 4, 2, 64, 64, 4, 2,
                                                                      split_k1=2, split_k2=3)),
    (96, 224, 5, 3, 70, False, True, "random", None, TileConfig(64, 128, 64, 4, 2, 128, 64, 4, 2)),
    (160, 96, 4, 2, 1, True, True, "random", None, None),  # T = 1: pair blocks
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c[:9]))
def test_fused_a8w4_per_token_inter_matches_twin(monkeypatch, seed, case):
    H, I, E, k, T, oai, bias, mode, local, cfg = case
    monkeypatch.setenv(A8W4_INTER_FLAG, "token")
    spec, p = make_layer(H, I, E, k, "a8w4", oai=oai, bias=bias, local_experts=local, device=DEVICE)
    w, ids = make_routing(T, E, k, mode=mode, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    ws = allocate_workspace(spec, T, DEVICE)
    assert ws.inter_wide is not None and ws.inter_wide.dtype == torch.bfloat16
    poison(ws)  # NaN everywhere: a scale column GEMM2 should not read, or a row nobody wrote, shows
    out = torch.full((T, H), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    got = fused_experts(x, w, ids, p, spec, workspace=ws, out=out, config=cfg)
    assert torch.isfinite(got).all(), "unwritten or NaN output elements"
    twin = experts_torch(x, w, ids, p, spec)
    assert rel_err(got, twin) <= 1e-2
    assert rel_err(got, reference(x, w, ids, spec, p, act_quant=True)) <= 1e-2
    # the numerics are the flag's: the per-group twin is another function of the same inputs
    monkeypatch.setenv(A8W4_INTER_FLAG, "group")
    assert rel_err(experts_torch(x, w, ids, p, spec), twin) > 1e-4


def test_workspace_remembers_the_flag(monkeypatch, seed):
    spec, p = make_layer(160, 96, 4, 2, "a8w4", device=DEVICE)
    w, ids = make_routing(3, 4, 2, device=DEVICE)
    x = torch.randn(3, 160, device=DEVICE).to(torch.bfloat16)
    monkeypatch.setenv(A8W4_INTER_FLAG, "group")
    ws = allocate_workspace(spec, 3, DEVICE)
    assert ws.inter_wide is None
    monkeypatch.setenv(A8W4_INTER_FLAG, "token")
    with pytest.raises(ValueError, match="allocated with ATOM_MOE_A8W4_INTER=group, now it is token"):
        fused_experts(x, w, ids, p, spec, workspace=ws)


# ---------------------------------------------------------------- finish_rows: GEMM1's slice sum and the quant in one
FINISH_CASES = [  # H, I, E, k, T, activation, bias, split, pair blocks; K steps of 64: H 320 is 5, H 256 is 4
    (320, 96, 6, 3, 1, "oai", True, 3, True),  # slices of 2, 2, 1 steps; gpt-oss's activation with biases
    (256, 224, 5, 2, 1, "clamp", False, 2, True),  # I = 224: the row's masked tail; V4's clamped SiLU
    (320, 160, 6, 3, 6, "silu", True, 4, False),  # the routing launch's sorted rows, with padding rows
    (256, 64, 4, 2, 3, "silu", False, 4, False),  # a slice per K step
]
ACTIVATIONS = {"silu": Activation(), "oai": Activation(ActivationKind.SWIGLU_OAI, alpha=1.702, limit=7.0),
               "clamp": Activation(ActivationKind.SWIGLU_CLAMP, limit=10.0)}


@pytest.mark.parametrize("case", FINISH_CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_finish_rows_writes_what_gemm1s_second_launch_and_quantize_rows_write(monkeypatch, seed, case):
    """The layer at a split GEMM1 runs GEMM1's first launch and finish_rows; the two launches finish_rows replaces
    (GEMM1's second, then quantize_rows), run here on the same routing, must give the same bytes, every row."""
    H, I, E, k, T, kind, bias, split, pairs = case
    monkeypatch.setenv(A8W4_INTER_FLAG, "token")
    spec, p = make_layer(H, I, E, k, "a8w4", bias=bias, activation=ACTIVATIONS[kind], gate_std=3.0, device=DEVICE)
    w, ids = make_routing(T, E, k, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    cfg = TileConfig(16, 128, 64, 4, 2, 64, 64, 4, 2, split_k1=split)
    ws = allocate_workspace(spec, T, DEVICE)
    poison(ws)
    out = fused_experts(x, w, ids, p, spec, workspace=ws, config=cfg, pair_blocks=pairs)
    launches = record_launches(lambda: fused_experts(x, w, ids, p, spec, workspace=ws, config=cfg, pair_blocks=pairs))
    assert [launch.name for launch in launches if launch.stage != "routing"] == [
        "_gemm1_kernel", "_finish_kernel", "_gemm2_kernel"]
    n_blocks = T * k if pairs else routing.max_blocks(T * k, E, 16)
    written = ws.inter.clone(), ws.inter_scale.clone()
    # the two launches finish_rows replaces, on the routing the layer call left in the workspace
    act = spec.activation
    dst = torch.empty_like(ws.inter).view(torch.uint8).fill_(0xFF).view(F8)
    dst_scale = torch.empty_like(ws.inter_scale.t()).t()  # group-major, as the workspace's
    dst_scale.untyped_storage().fill_(0xFF)  # poison's bytes: rows neither path writes compare equal too
    block_pairs = routing.PairBlocks(ids, p.expert_map, x, torch.empty_like(out), torch.empty_like(ws.counters),
                                     ws.n_counters) if pairs else None
    gemm1.gemm1(ws.x_q[:T], ws.x_scale[:T], p.w13, p.w13_scale, p.w13_bias, ws.sorted_ids,  # as the layer calls it
                ws.block_expert, n_blocks, k, ws.inter_wide, None, oai=act.kind is ActivationKind.SWIGLU_OAI,
                clamp=act.kind is ActivationKind.SWIGLU_CLAMP, alpha=act.alpha, limit=act.limit, block_m=16,
                block_n=128, block_k=64, num_warps=4, num_stages=2, w13_rowexp_t=p.w13_rowexp,
                mx_flush=p.mx_flush, split_k=split, partial=ws.partial, pairs=block_pairs)
    inter_quant.quantize_rows(ws.inter_wide, dst, dst_scale, ws.sorted_ids, ws.block_expert, n_blocks, 16, T * k,
                              (ids, p.expert_map) if pairs else None)
    assert torch.equal(written[0].view(torch.uint8), dst.view(torch.uint8)), "e4m3 rows differ"
    assert torch.equal(_bits(written[1][:, :1]), _bits(dst_scale[:, :1])), "row scales differ"
    assert rel_err(out, experts_torch(x, w, ids, p, spec)) <= 1e-2


def test_finish_rows_refuses_what_it_cannot_finish(monkeypatch, seed):
    monkeypatch.setenv(A8W4_INTER_FLAG, "token")
    spec, p = make_layer(256, 64, 4, 2, "a8w4", device=DEVICE)
    ws = allocate_workspace(spec, 2, DEVICE)
    args = (p.w13_rowexp, None, ws.inter, ws.inter_scale, ws.sorted_ids, ws.block_expert, 4, 16, 4)
    kw = dict(oai=False, clamp=False, alpha=1.0, limit=7.0)
    with pytest.raises(ValueError, match="split must be an int >= 2"):
        inter_quant.finish_rows(ws.partial, 1, *args, **kw)
    with pytest.raises(ValueError, match=r"part must be fp32 with split \* pairs \* 2I = 4096 elements"):
        inter_quant.finish_rows(ws.partial[:1, :8], 8, *args, **kw)
    with pytest.raises(ValueError, match="oai already clamps"):
        inter_quant.finish_rows(ws.partial, 2, *args, oai=True, clamp=True, alpha=1.0, limit=7.0)
    separated = GateUpTensor(p.w13_rowexp.data, GateUpLayout.SEPARATED, p.w13_rowexp.kind)
    with pytest.raises(LayoutError, match="w13_rowexp"):  # gate and up rows must pair as GEMM1 reads them
        inter_quant.finish_rows(ws.partial, 2, separated, *args[1:], **kw)
    x = torch.randn(2, 256, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="slices_only .* needs split_k > 1"):
        gemm1.gemm1(x, torch.ones(2, 2, device=DEVICE), p.w13, p.w13_scale, None, ws.sorted_ids, ws.block_expert, 4, 2,
                    ws.inter_wide, None, oai=False, clamp=False, alpha=1.0, limit=7.0, block_m=16, block_n=128,
                    block_k=64, num_warps=4, num_stages=2, w13_rowexp_t=p.w13_rowexp, split_k=1, partial=ws.partial,
                    slices_only=True)
