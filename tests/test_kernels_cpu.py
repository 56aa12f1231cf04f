"""Triton kernels vs the torch twin and the fp32 oracle (CPU, TRITON_INTERPRET=1, small shapes)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import make_layer, make_routing, poison, reference, rel_err  # noqa: E402

from atom_moe import formats  # noqa: E402
from atom_moe.experts import allocate_workspace, fused_experts  # noqa: E402
from atom_moe.experts_torch import experts_torch, local_ids  # noqa: E402
from atom_moe.kernels import routing  # noqa: E402
from atom_moe.kernels.tuning import TileConfig, heuristic  # noqa: E402
from atom_moe.layouts.gate_up import LayoutError, separate  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Triton 3.6's interpreter converts 1-element arrays to ints, which numpy 2.x deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


# ---------------------------------------------------------------- routing metadata
@pytest.mark.parametrize("mode", ["random", "sentinels", "one_expert"])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("scheme", ["fp8", "a8w4"])  # x per 128-group (2 column chunks), or per token (one chunk)
def test_routing_metadata_matches_twin(seed, mode, block_m, scheme):
    E, k, T = 8, 3, 23
    local = (1, 2, 4, 5, 7)  # experts 0, 3, 6 are not local: they contribute nothing
    spec, p = make_layer(1120, 96, E, k, scheme, local_experts=local, device=DEVICE)  # MXFP4: H % 32 == 0
    w, ids = make_routing(T, E, k, mode=mode, device=DEVICE)
    ids = ids.to(torch.int64) if seed % 2 else ids  # both id dtypes engines use
    ws = allocate_workspace(spec, T, DEVICE)
    poison(ws)
    # every row's groups get their own magnitude: a per-group scale cannot pass for the row's
    group_mags = torch.rand(T, 9, device=DEVICE).mul(8).repeat_interleave(128, dim=1)[:, :spec.hidden_size]
    x = (torch.randn(T, spec.hidden_size, device=DEVICE) * group_mags).to(torch.bfloat16)
    out = torch.full((T, spec.hidden_size), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    routing.routing_metadata(ids, p.expert_map, len(local), block_m, ws.sorted_ids, ws.block_expert, ws.cursor,
                             x, out, ws.counters, ws.n_counters, xq=ws.x_q, xs=ws.x_scale,
                             row_scale=spec.scheme.x_per_token)
    want_sorted, want_blocks = routing.routing_metadata_torch(ids.cpu(), p.expert_map.cpu(), len(local), block_m)
    n_blocks = want_blocks.numel()
    got_blocks = ws.block_expert[:n_blocks].cpu()
    assert torch.equal(got_blocks, want_blocks)
    got_sorted = ws.sorted_ids[:n_blocks * block_m].cpu().view(n_blocks, block_m)
    # inside one expert's rows the order is arrival order: compare each expert's set of pairs
    for e in range(len(local)):
        rows = got_blocks == e
        got = got_sorted[rows].flatten().sort().values
        want = want_sorted.view(n_blocks, block_m)[rows].flatten().sort().values
        assert torch.equal(got, want), f"expert {e}"
    # counters zeroed, empty tokens' rows zeroed, x quantized exactly like formats.quantize_fp8_per_group
    # (a8w4: quantize_fp8_per_token_grouped)
    assert (ws.counters[:T * ws.n_counters] == 0).all()
    empty = (local_ids(ids, p.expert_map) < 0).all(dim=1)
    assert (out[empty] == 0).all() and (mode != "sentinels" or empty[0])
    assert out[~empty].isnan().all()  # rows with work are left for GEMM2
    # tokens some local expert reads: quantized exactly like the formats function; the
    # others are never read by GEMM1, and are not touched (the poison stays)
    quant = formats.quantize_fp8_per_token_grouped if spec.scheme.x_per_token else formats.quantize_fp8_per_group
    q, s = quant(x)
    assert torch.equal(ws.x_q[:T][~empty].float(), q[~empty].float()) and torch.equal(ws.x_scale[:T][~empty], s[~empty])
    assert ws.x_scale[:T][empty].isnan().all()


def test_routing_block_bound():
    # the static block bound holds for the worst case: every expert gets count % BLOCK_M == 1
    E_l, block_m = 6, 16
    ids = torch.arange(E_l).repeat(17).view(-1, 1)  # 17 rows each -> 2 blocks each
    _, blocks = routing.routing_metadata_torch(ids, torch.arange(E_l, dtype=torch.int32), E_l, block_m)
    assert (blocks >= 0).sum() == 2 * E_l <= routing.max_blocks(ids.numel(), E_l, block_m)


# ---------------------------------------------------------------- split (two-launch) routing sort
def _split(monkeypatch, sort_chunk: int = 16, fill_blocks: int = 16) -> None:
    """Force the two-launch sort at any size, with small chunks so one call has many programs."""
    monkeypatch.setattr(routing, "SPLIT_PAIRS", 0)
    monkeypatch.setattr(routing, "SORT_CHUNK", sort_chunk)
    monkeypatch.setattr(routing, "FILL_BLOCKS", fill_blocks)


def _split_ids(mode: str, T: int, E: int, k: int) -> torch.Tensor:
    """Routing cases for the split sort; make_routing's modes plus two skews."""
    if mode == "every_pair":  # one local expert takes every pair (the routing does not need distinct ids)
        return torch.full((T, k), 2, dtype=torch.int32)
    if mode == "zero_experts":  # local experts 1, 4 and 7 get no pair
        pool = torch.tensor([0, 2, 3, 5, 6], dtype=torch.int32)
        return pool[torch.stack([torch.randperm(5)[:k] for _ in range(T)])]
    return make_routing(T, E, k, mode=mode)[1]


@pytest.mark.parametrize("mode", ["random", "sentinels", "one_expert", "every_pair", "zero_experts"])
@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("sort_chunk", [16, 256])  # 16: many scatter programs; 256: padding-only programs too
def test_split_routing_matches_twin(seed, monkeypatch, mode, block_m, sort_chunk):
    _split(monkeypatch, sort_chunk)
    E, k = 8, 3
    T = int(torch.randint(59, 90, ()))  # 177-267 pairs: 17-22 blocks of 16, two padding ranges of 16
    local = (0, 1, 2, 4, 5, 7)  # 3 and 6 are not local
    spec, p = make_layer(1100, 96, E, k, "fp8", local_experts=local, device=DEVICE)  # 2 column chunks
    ids = _split_ids(mode, T, E, k).to(DEVICE)
    ids = ids.to(torch.int64) if seed % 2 else ids
    ws = allocate_workspace(spec, T, DEVICE)
    poison(ws)
    x = torch.randn(T, spec.hidden_size, device=DEVICE, dtype=torch.bfloat16)
    out = torch.full((T, spec.hidden_size), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    routing.routing_metadata(ids, p.expert_map, len(local), block_m, ws.sorted_ids, ws.block_expert, ws.cursor,
                             x, out, ws.counters, ws.n_counters, xq=ws.x_q, xs=ws.x_scale,
                             chunk_counts=ws.chunk_counts)
    want_sorted, want_blocks = routing.routing_metadata_torch(ids.cpu(), p.expert_map.cpu(), len(local), block_m)
    n_blocks = want_blocks.numel()
    assert torch.equal(ws.block_expert[:n_blocks].cpu(), want_blocks)
    # the split sort is stable (pair order inside each expert), so even the order matches the twin
    assert torch.equal(ws.sorted_ids[:n_blocks * block_m].cpu(), want_sorted)
    # the token programs (after the chunk programs in launch A) did their work too
    assert (ws.counters[:T * ws.n_counters] == 0).all()
    empty = (local_ids(ids, p.expert_map) < 0).all(dim=1)
    assert (out[empty] == 0).all() and out[~empty].isnan().all()
    q, s = formats.quantize_fp8_per_group(x)
    assert torch.equal(ws.x_q[:T][~empty].float(), q[~empty].float()) and torch.equal(ws.x_scale[:T][~empty], s[~empty])


@pytest.mark.parametrize("split", [False, True])
def test_routing_sent_rows(seed, monkeypatch, split):
    # symm receive rows: only rows t < info[s, 0] of each source s count, the rest act as sentinels
    if split:
        _split(monkeypatch)
    E, k, W, C, block_m = 8, 3, 3, 13, 16
    local = (1, 2, 4, 5, 7)
    spec, p = make_layer(160, 96, E, k, "bf16", local_experts=local, device=DEVICE)
    ids = make_routing(W * C, E, k, mode="sentinels", device=DEVICE)[1]
    info = torch.zeros(W, 2, dtype=torch.int32)
    info[:, 0] = torch.tensor([C, 0, int(torch.randint(1, C, ()))])  # full, none, some
    ws = allocate_workspace(spec, W * C, DEVICE)
    poison(ws)
    x = torch.randn(W * C, 160, device=DEVICE, dtype=torch.bfloat16)
    routing.routing_metadata(ids, p.expert_map, len(local), block_m, ws.sorted_ids, ws.block_expert, ws.cursor,
                             x, None, ws.counters, ws.n_counters, sent=(info.to(DEVICE), C),
                             chunk_counts=ws.chunk_counts)
    sent_ids = ids.cpu().clone().view(W, C, k)
    for src in range(W):
        sent_ids[src, int(info[src, 0]):] = -1
    want_sorted, want_blocks = routing.routing_metadata_torch(sent_ids.view(W * C, k), p.expert_map.cpu(),
                                                              len(local), block_m)
    n_blocks = want_blocks.numel()
    got_blocks = ws.block_expert[:n_blocks].cpu()
    assert torch.equal(got_blocks, want_blocks)
    got_sorted = ws.sorted_ids[:n_blocks * block_m].cpu()
    if split:
        assert torch.equal(got_sorted, want_sorted)
    else:  # one program: arrival order inside each expert
        for e in range(len(local)):
            rows = (got_blocks == e).repeat_interleave(block_m)
            assert torch.equal(got_sorted[rows].sort().values, want_sorted[rows].sort().values), f"expert {e}"
        assert (got_sorted[~(got_blocks >= 0).repeat_interleave(block_m)] == W * C * k).all()


@pytest.mark.parametrize("scheme,mode,local", [("bf16", "sentinels", (0, 2, 3, 5, 6)), ("fp8", "one_expert", None),
                                               ("a8w4", "random", (1, 2, 4, 5))])
def test_fused_experts_split_routing(seed, monkeypatch, scheme, mode, local):
    # the whole layer through the two-launch sort: same bits as the one-launch sort (row order
    # inside an expert changes no result bit), and vs the torch twin / fp32 oracle
    from atom_moe.tools.breakdown import record_launches
    H, I, E, k, T = 160, 96, 8, 3, 41
    spec, p = make_layer(H, I, E, k, scheme, local_experts=local, device=DEVICE)
    w, ids = make_routing(T, E, k, mode=mode, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    one = fused_experts(x, w, ids, p, spec)
    _split(monkeypatch)
    ws = allocate_workspace(spec, T, DEVICE)
    poison(ws)
    out = torch.full((T, H), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    launches = record_launches(lambda: fused_experts(x, w, ids, p, spec, workspace=ws, out=out))
    stages = [launch.stage for launch in launches]
    assert stages[:3] == ["routing", "routing", "gemm1"] and "routing" not in stages[3:], stages
    assert torch.equal(out, one)
    assert rel_err(out, experts_torch(x, w, ids, p, spec)) <= 1e-2
    assert rel_err(out, reference(x, w, ids, spec, p, act_quant=scheme in ("fp8", "a8w4"))) <= 1e-2


def _launches(spec, p, T: int, **kwargs) -> list:
    """The kernel launches of one layer call on T random tokens (uniform routing over 4 experts, top-2)."""
    from atom_moe.tools.breakdown import record_launches
    w, ids = make_routing(T, 4, 2, device=DEVICE)
    x = torch.randn(T, spec.hidden_size, device=DEVICE).to(torch.bfloat16)
    return record_launches(lambda: fused_experts(x, w, ids, p, spec, **kwargs))


def test_small_calls_stay_one_routing_launch(seed, monkeypatch):
    # at the default threshold any T*k <= SPLIT_PAIRS is three launches in all, T = 1 two by default (pair
    # blocks, tests/test_pair_blocks.py) and three without them; 16 pairs covers T = 1 up to top-16
    spec, p = make_layer(160, 96, 4, 2, "bf16", device=DEVICE)
    ws = allocate_workspace(spec, 8, DEVICE)
    monkeypatch.delenv("ATOM_MOE_PAIR_BLOCKS", raising=False)
    one = ["gemm1", "gemm1"]  # T = 1's heuristic splits GEMM1's K here (4 programs, kernels/tuning.py `_fill`)
    assert heuristic("bf16", 160, 96, 4, 2, 1).split_k1 == 2 and heuristic("bf16", 160, 96, 4, 2, 8).split_k1 == 1
    assert [launch.stage for launch in _launches(spec, p, 1, workspace=ws)] == [*one, "gemm2"]
    assert [launch.stage for launch in _launches(spec, p, 8, workspace=ws)] == ["routing", "gemm1", "gemm2"]
    monkeypatch.setenv("ATOM_MOE_PAIR_BLOCKS", "0")
    assert [launch.stage for launch in _launches(spec, p, 1, workspace=ws)] == ["routing", *one, "gemm2"]


def test_split_routing_needs_room(monkeypatch):
    # a chunk_counts too small for the split sort is an error, not an out-of-bounds write
    _split(monkeypatch)
    spec, p = make_layer(160, 96, 4, 2, "bf16", device=DEVICE)
    w, ids = make_routing(40, 4, 2, device=DEVICE)
    ws = allocate_workspace(spec, 40, DEVICE)
    x = torch.randn(40, 160, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match="chunk_counts holds"):
        routing.routing_metadata(ids, p.expert_map, 4, 16, ws.sorted_ids, ws.block_expert, ws.cursor, x, None,
                                 ws.counters, ws.n_counters, chunk_counts=ws.chunk_counts[:3])


# ---------------------------------------------------------------- the whole layer
CASES = [
    # scheme, H, I, E, k, T, activation, bias, routing mode, local experts, gate std (None: default)
    ("bf16", 160, 96, 4, 2, 5, "swiglu", False, "random", None, None),
    ("bf16", 200, 136, 6, 3, 37, "swiglu", False, "sentinels", None, None),
    ("bf16", 256, 144, 8, 4, 19, "oai", True, "one_expert", None, None),
    ("bf16", 320, 288, 8, 2, 9, "swiglu", True, "random", (0, 3, 5, 6), None),
    ("bf16", 136, 200, 5, 3, 70, "oai", False, "random", None, None),
    ("fp8", 160, 96, 4, 2, 5, "swiglu", False, "random", None, None),
    ("fp8", 200, 136, 6, 3, 37, "oai", True, "sentinels", None, None),
    ("fp8", 256, 288, 8, 4, 19, "swiglu", True, "one_expert", None, None),
    ("fp8", 320, 160, 8, 2, 9, "oai", False, "random", (1, 2, 7), 4.0),  # gpt-oss clamp active
    ("fp8", 136, 200, 5, 3, 70, "swiglu", False, "sentinels", None, None),
    # MXFP4 weights; H and I multiples of 32, several not of 128 (and not of 64)
    ("a16w4", 160, 96, 4, 2, 5, "swiglu", False, "random", None, None),
    ("a16w4", 224, 160, 6, 3, 21, "oai", True, "sentinels", None, 4.0),  # gpt-oss clamp active
    ("a16w4", 256, 288, 8, 4, 19, "swiglu", True, "one_expert", (0, 2, 3, 6), None),
    ("a16w4", 96, 224, 5, 3, 30, "oai", False, "random", None, None),
    ("a8w4", 160, 96, 4, 2, 5, "oai", True, "random", None, None),
    ("a8w4", 224, 160, 6, 3, 21, "swiglu", False, "sentinels", (1, 2, 4, 5), None),
    ("a8w4", 256, 288, 8, 4, 19, "oai", True, "one_expert", None, 4.0),  # gpt-oss clamp active
    ("a8w4", 96, 224, 5, 3, 70, "swiglu", True, "random", None, None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c[:9]))
def test_fused_experts_matches_reference(seed, case):
    scheme, H, I, E, k, T, act, bias, mode, local, gate_std = case
    spec, p = make_layer(H, I, E, k, scheme, oai=act == "oai", bias=bias, local_experts=local, device=DEVICE,
                         gate_std=gate_std)
    w, ids = make_routing(T, E, k, mode=mode, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    ws = allocate_workspace(spec, T, DEVICE)
    poison(ws)
    out = torch.full((T, H), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    got = fused_experts(x, w, ids, p, spec, workspace=ws, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == torch.bfloat16
    assert torch.isfinite(got).all(), "unwritten or NaN output elements"
    twin = experts_torch(x, w, ids, p, spec)
    assert rel_err(got, twin) <= 1e-2
    if scheme in ("bf16", "a16w4"):
        assert rel_err(got, reference(x, w, ids, spec, p, act_quant=False)) <= 1e-2
    else:
        assert rel_err(got, reference(x, w, ids, spec, p, act_quant=True)) <= 1e-2
        # vs the unquantized oracle the scheme itself (the torch twin) sits at ~4% on these
        # data, so the 5e-2 bound is only a stable check with enough rows (>= 50 pairs that a local expert
        # computes: sentinel and other ranks' slots add none; at 34 such pairs a8w4's twin was 5.1e-2 from the
        # oracle at seed 2025637753) and unit-scale gates; the 1e-2 checks above hold everywhere.
        valid = (ids >= 0) & (ids < E)
        computed = int((valid & (p.expert_map[ids.clamp(0, E - 1).long()] >= 0)).sum())
        if computed >= 50 and gate_std is None:
            assert rel_err(got, reference(x, w, ids, spec, p, act_quant=False)) <= 5e-2


def test_swap_flag(monkeypatch):
    from atom_moe.kernels.common import swapped
    monkeypatch.delenv("ATOM_MOE_SWAP", raising=False)  # the default: bf16 swapped, fp8 not
    assert swapped(16, fp8=False) and swapped(32, fp8=False) and not swapped(16, fp8=True)
    assert not swapped(64, fp8=False)  # wgmma's own 64 rows need no swap
    monkeypatch.setenv("ATOM_MOE_SWAP", "1")
    assert swapped(16, fp8=True) and swapped(16, fp8=False) and not swapped(64, fp8=True)
    monkeypatch.setenv("ATOM_MOE_SWAP", "0")
    assert not swapped(16, fp8=True) and not swapped(16, fp8=False)
    monkeypatch.setenv("ATOM_MOE_SWAP", "yes")
    with pytest.raises(ValueError, match=r"ATOM_MOE_SWAP='yes': allowed are unset .* 1 .* or 0"):
        swapped(16, fp8=False)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("case", [c for c in CASES if c[0] in ("bf16", "fp8")],
                         ids=lambda c: "-".join(str(v) for v in c[:9]))
def test_swapped_tiles_compute_the_same_layer(seed, monkeypatch, case, split_k):
    # ATOM_MOE_SWAP=1 (kernels/common.py `swapped`): bf16 / fp8 tiles under 64 rows compute out^T = w @ x^T;
    # 16 and 32 rows, split K or not, must give the plain orientation's layer (the sums differ only in order)
    scheme, H, I, E, k, T, act, bias, mode, local, gate_std = case
    spec, p = make_layer(H, I, E, k, scheme, oai=act == "oai", bias=bias, local_experts=local, device=DEVICE,
                         gate_std=gate_std)
    w, ids = make_routing(T, E, k, mode=mode, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    twin = experts_torch(x, w, ids, p, spec)
    for bm in (16, 32):
        n1, k1 = (256, 128) if scheme == "fp8" else (64, 64)
        cfg = TileConfig(bm, n1, k1, 4, 2, 128, k1, 4, 2, split_k1=split_k,
                         split_k2=split_k if I >= split_k * k1 else 1)  # GEMM2 needs a K step per slice
        monkeypatch.setenv("ATOM_MOE_SWAP", "0")
        plain = fused_experts(x, w, ids, p, spec, config=cfg)
        monkeypatch.setenv("ATOM_MOE_SWAP", "1")
        ws = allocate_workspace(spec, T, DEVICE)
        poison(ws)
        got = fused_experts(x, w, ids, p, spec, config=cfg, workspace=ws)
        assert torch.isfinite(got).all(), cfg
        assert rel_err(got, plain) <= 1e-3 and rel_err(got, twin) <= 1e-2, cfg


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
def test_tile_configs_agree(seed, scheme):
    # every BLOCK_M / tile shape computes the same function (padding, partial tiles, K tails)
    # MXFP4: smaller (the interpreter's decode is slow)
    H, I, T = (160, 96, 13) if scheme in ("a16w4", "a8w4") else (200, 136, 29)
    spec, p = make_layer(H, I, 6, 3, scheme, device=DEVICE)
    w, ids = make_routing(T, 6, 3, mode="sentinels", device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    twin = experts_torch(x, w, ids, p, spec)
    base = heuristic(scheme, H, I, 6, 3, T)
    mx = scheme in ("a16w4", "a8w4")  # MX tiles: whole 16 x 64 blocks
    # fp8 n2 256: two w2 blocks; 128 rows: a8w4 loads each step's activation scales at its top; 128 rows with
    # n2 256 and a 128-k GEMM1: a8w4's large-T heuristic tile (kernels/tuning.py A8W4_ROWS_128)
    for bm, n2, k in ((16, 32, 32), (32, 64, 64), (64, 128, 128), (64, 256, 128), (128, 64, 64), (128, 256, 128)):
        if mx:
            k = max(k, 64)
        # a8w4: GEMM1 128 or 256 rows wide (one or two 64-groups of GEMM2's input), GEMM2 steps K by 64
        n1, k1, k2 = (256, 128, 128) if scheme == "fp8" else (128 if bm != 32 else 256, k, 64) \
            if scheme == "a8w4" else (32, k, k)
        cfg = TileConfig(bm, n1, k1, base.warps1, 2, n2, k2, base.warps2, 2, group_m=2)
        got = fused_experts(x, w, ids, p, spec, config=cfg)
        assert rel_err(got, twin) <= 1e-2, cfg
    # a register cap reaches each GEMM's launch options (the interpreter ignores it; tests/test_kernels_gpu.py
    # checks that ptxas applies it)
    from atom_moe.kernels import common, gemm1, gemm2
    seen = []

    def record(maxnreg):
        seen.append(maxnreg)
        return common.register_cap(maxnreg)
    capped = dataclasses.replace(cfg, maxnreg1=96, maxnreg2=128)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemm1, "register_cap", record)
        mp.setattr(gemm2, "register_cap", record)
        assert rel_err(fused_experts(x, w, ids, p, spec, config=capped), twin) <= 1e-2
    assert seen == [96, 128], seen


@pytest.mark.parametrize("scheme,x_dtype", [("bf16", torch.float16), ("bf16", torch.float32),
                                            ("fp8", torch.float16), ("fp8", torch.float32),
                                            ("a16w4", torch.float16), ("a8w4", torch.float32)])
def test_input_dtypes(seed, scheme, x_dtype):
    # fp16 / fp32 activations and bf16 routing weights: output in x.dtype, same math as the twin
    H, I, T = (160, 96, 9) if scheme in ("a16w4", "a8w4") else (200, 136, 21)
    spec, p = make_layer(H, I, 6, 3, scheme, device=DEVICE)
    w, ids = make_routing(T, 6, 3, mode="sentinels", device=DEVICE)
    x = torch.randn(T, H, device=DEVICE, dtype=x_dtype)
    got = fused_experts(x, w.to(torch.bfloat16), ids, p, spec)
    assert got.dtype == x_dtype and torch.isfinite(got).all()
    assert rel_err(got, experts_torch(x, w.to(torch.bfloat16), ids, p, spec)) <= 1e-2


def test_combine_is_a_fixed_order_sum(seed):
    # the deterministic combine: out[t] == bf16(sum over slots in order 0..k-1 of the partials)
    spec, p = make_layer(160, 96, 4, 3, "bf16", device=DEVICE)
    T = 13
    w, ids = make_routing(T, 4, 3, mode="sentinels", device=DEVICE)
    x = torch.randn(T, 160, device=DEVICE).to(torch.bfloat16)
    ws = allocate_workspace(spec, T, DEVICE)
    poison(ws)
    got = fused_experts(x, w, ids, p, spec, workspace=ws)
    valid = local_ids(ids, p.expert_map) >= 0
    partial = ws.partial[:T * 3].view(T, 3, 160)
    want = torch.zeros(T, 160, device=DEVICE)
    for j in range(3):
        want = want + torch.where(valid[:, j, None], partial[:, j], torch.zeros_like(want))
    assert torch.equal(got, want.to(torch.bfloat16))
    again = fused_experts(x, w, ids, p, spec, workspace=ws)
    assert torch.equal(got, again)


@pytest.mark.parametrize("scheme,x_dtype,local", [("bf16", torch.bfloat16, (0, 2, 3)),
                                                  ("fp8", torch.float16, None),
                                                  ("a16w4", torch.float32, (1, 3)),
                                                  ("a8w4", torch.bfloat16, None)])
def test_separate_combine_is_a_fixed_order_sum(seed, scheme, x_dtype, local):
    # combine="separate": GEMM2 writes weighted rows in out's dtype, a fourth launch sums the
    # local slots in order 0..k-1; tokens with no local slot (sentinels, non-local experts) get 0
    from atom_moe.tools.breakdown import record_launches
    from atom_moe.kernels.gemm2 import separate_partial
    H, I, E, k, T = 160, 96, 5, 3, 17
    spec, p = make_layer(H, I, E, k, scheme, local_experts=local, device=DEVICE)
    w, ids = make_routing(T, E, k, mode="sentinels", device=DEVICE)
    x = torch.randn(T, H, device=DEVICE, dtype=x_dtype)
    ws = allocate_workspace(spec, T, DEVICE)
    poison(ws)
    out = torch.full((T, H), float("nan"), device=DEVICE, dtype=x_dtype)
    launches = record_launches(lambda: fused_experts(x, w, ids, p, spec, workspace=ws, out=out, combine="separate"))
    assert [launch.name for launch in launches][-2:] == ["_gemm2_kernel", "_combine_kernel"]
    valid = local_ids(ids, p.expert_map) >= 0
    rows = separate_partial(ws.partial, out)[:T * k].view(T, k, H).float()
    want = torch.zeros(T, H, device=DEVICE)
    for j in range(k):
        want = want + torch.where(valid[:, j, None], rows[:, j], torch.zeros_like(want))
    assert torch.equal(out, want.to(x_dtype))
    assert (out[~valid.any(1)] == 0).all() and torch.isfinite(out).all()
    counter = fused_experts(x, w, ids, p, spec, combine="counter")
    assert rel_err(out, counter) <= 4e-3  # the same sum, less the rounding of each slot to out's dtype
    assert rel_err(out, experts_torch(x, w, ids, p, spec)) <= 1e-2
    assert rel_err(out, reference(x, w, ids, spec, p, act_quant=scheme in ("fp8", "a8w4"))) <= 1e-2


def test_combine_mode_by_pair_count(seed, monkeypatch):
    # the default picks the separate combine from SEPARATE_MIN_PAIRS pairs up; the symm push never
    from atom_moe.kernels import gemm2
    spec, p = make_layer(160, 96, 4, 2, "bf16", device=DEVICE)
    monkeypatch.setattr(gemm2, "SEPARATE_MIN_PAIRS", 16)
    for T, last in ((7, "_gemm2_kernel"), (8, "_combine_kernel")):
        assert _launches(spec, p, T)[-1].name == last
    w, ids = make_routing(3, 4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="combine must be"):
        fused_experts(torch.randn(3, 160, device=DEVICE).to(torch.bfloat16), w, ids, p, spec, combine="atomic")


def test_workspace_reuse_and_limits(seed):
    spec, p = make_layer(160, 96, 4, 2, "fp8", device=DEVICE)
    ws = allocate_workspace(spec, 12, DEVICE)
    for T in (12, 3):
        w, ids = make_routing(T, 4, 2, device=DEVICE)
        x = torch.randn(T, 160, device=DEVICE).to(torch.bfloat16)
        assert rel_err(fused_experts(x, w, ids, p, spec, workspace=ws), experts_torch(x, w, ids, p, spec)) <= 1e-2
    w, ids = make_routing(13, 4, 2, device=DEVICE)
    with pytest.raises(ValueError, match="max_tokens"):
        fused_experts(torch.randn(13, 160, device=DEVICE), w, ids, p, spec, workspace=ws)
    assert fused_experts(torch.randn(0, 160, device=DEVICE), w[:0], ids[:0], p, spec).shape == (0, 160)


def test_bad_inputs_name_the_problem(seed, monkeypatch):
    spec, p = make_layer(160, 96, 4, 2, "bf16", device=DEVICE)
    w, ids = make_routing(3, 4, 2, device=DEVICE)
    x = torch.randn(3, 160, device=DEVICE).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"x must be \[T, H=160\]"):
        fused_experts(x[:, :100], w, ids, p, spec)
    with pytest.raises(ValueError, match="topk_ids dtype"):
        fused_experts(x, w, ids.float(), p, spec)
    with pytest.raises(ValueError, match=r"\[T, top_k\]"):
        fused_experts(x, w[:, :1], ids[:, :1], p, spec)
    with monkeypatch.context() as m:
        m.delenv("TRITON_INTERPRET", raising=False)
        if DEVICE == "cpu":
            with pytest.raises(ValueError, match="CUDA device"):
                fused_experts(x, w, ids, p, spec)
    fp4 = dataclasses.replace(spec, scheme="a16w4")
    with pytest.raises(ValueError, match="do not match the spec"):  # bf16 weights, MXFP4 spec
        fused_experts(x, w, ids, p, fp4)
    p.w13 = separate(p.w13)
    with pytest.raises(LayoutError, match="interleaved"):
        fused_experts(x, w, ids, p, spec)
    with pytest.raises(ValueError, match="fp8 needs block_n1=256, block_k1=128, block_k2=128"):
        TileConfig(16, 128, 128, 4, 2, 128, 128, 4, 2).check("fp8")
    for bad in ((64, 64, 64), (512, 64, 64), (128, 32, 64), (128, 64, 128)):  # (n1, k1, k2)
        with pytest.raises(ValueError, match=r"a8w4 needs block_n1 in \(128, 256\), block_k1 in \(64, 128\) and "
                                             r"block_k2=64"):
            TileConfig(16, bad[0], bad[1], 4, 2, 128, bad[2], 4, 2).check("a8w4")
    TileConfig(16, 128, 128, 4, 2, 256, 64, 4, 2).check("a8w4")
    with pytest.raises(ValueError, match="a16w4 needs block_n1, block_n2 multiples of 16 and block_k1"):
        TileConfig(16, 128, 32, 4, 2, 128, 64, 4, 2).check("a16w4")


# ---------------------------------------------------------------- MXFP4 tile decoders
def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, equal zero signs, NaN where the other is NaN."""
    return bool(((a == b) & (torch.signbit(a) == torch.signbit(b)) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("block_n", [16, 64])
def test_mxfp4_decoders_bit_exact(seed, block_n):
    # The kernels' in-register dequant of MX tiles equals formats.dequantize_mxfp4 bit for bit:
    # every byte value (all 16 x 16 code pairs), every e8m0 byte (0 = 2^-127 subnormal ... 254,
    # and 0xFF = NaN, both scale paths), N and K not multiples of the tile block (padding), and
    # partial tiles.
    from atom_moe.layouts import mx_tiles
    from atom_moe.kernels import mxfp4
    E, N, K = 2, 37, 288
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8)
    packed[0, 0, :] = torch.arange(144, dtype=torch.uint8)
    packed[1, 1, :] = torch.arange(112, 256, dtype=torch.uint8)
    scales = torch.randint(0, 256, (E, N, K // 32), dtype=torch.uint8)
    scales[:, :, :2] = torch.tensor([0, 255], dtype=torch.uint8)

    def run(sc, big=None):  # the kernels' decoder on DEVICE, compared on the host
        values, tiles = mx_tiles.tile(packed, sc)
        return mxfp4.dequantize(values.to(DEVICE), tiles.to(DEVICE), N, K, big=big, block_n=block_n).cpu()

    assert _same_bits(run(scales), formats.dequantize_mxfp4(packed, scales))  # scales above 128 too
    small = scales % 129  # the one-multiply path covers every byte up to 128 ...
    assert _same_bits(run(small, big=False), formats.dequantize_mxfp4(packed, small))
    assert _same_bits(run(small, big=True), formats.dequantize_mxfp4(packed, small))  # ... as does BIG's



def test_bench_floor_counts_mxfp4_bytes():
    # atom-moe bench's floor: 0.5 byte per weight + 1/32 byte of e8m0 scale (vs 2 for bf16)
    import argparse

    from atom_moe.tools import bench, common
    from atom_moe.spec import MoESpec
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert parser.parse_args(["--schemes", "a16w4", "a8w4"]).schemes == ["a16w4", "a8w4"]
    ids = torch.tensor([[0, 1], [1, 2], [2, 0]])
    H, I = 2880, 2880
    got = {}
    for scheme in ("bf16", "a16w4", "a8w4"):
        spec = MoESpec(hidden_size=H, intermediate_size=I, num_experts=4, top_k=2, scheme=scheme)
        got[scheme] = common.floor_terms(spec, ids, 2)
    act = 3 * H * (2 + 2)
    assert got["bf16"] == (3 * 3 * H * I * 2 + act, 2.0 * 6 * 3 * H * I)
    assert got["a16w4"] == got["a8w4"] == (3 * 3 * H * I * 17 // 32 + act, got["bf16"][1])
