"""TMA tile descriptors (ATOM_MOE_TMA, kernels/common.py `tma`): the switch, which tensors TMA can address,
and the same bits as per-thread loads.

With the flag on, bf16 and fp8 weight tiles, and every scheme's GEMM2 activation rows except for pair blocks,
come from TMA descriptors. A descriptor's tile is not masked: weight rows past an expert's last belong to the next
expert, and GEMM2's padding rows hold whatever the workspace held. Neither may reach a stored element, so
every case runs on a poisoned workspace (NaN floats) and must equal the per-thread path bit for bit. The
interpreter runs descriptor loads, so the CPU tests run the real kernel code; the GPU test runs TMA itself.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import assert_near_twin, make_layer, make_routing, poison  # noqa: E402

from atom_moe.experts import allocate_workspace, fused_experts  # noqa: E402
from atom_moe.experts_torch import experts_torch  # noqa: E402
from atom_moe.kernels import common, gemm1, gemm2  # noqa: E402
from atom_moe.kernels.tuning import TileConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def test_the_switch(monkeypatch):
    monkeypatch.delenv("ATOM_MOE_TMA", raising=False)
    assert not common.tma(torch.device("cpu"))
    monkeypatch.setenv("ATOM_MOE_TMA", "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert common.tma(torch.device("cpu"))  # the interpreter runs descriptor loads: the CPU tests use it
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not common.tma(torch.device("cpu"))  # a CUDA GPU of sm_90 or later only
    if torch.cuda.is_available():
        want = torch.version.hip is None and torch.cuda.get_device_capability() >= (9, 0)
        assert common.tma(torch.device("cuda")) == want
    monkeypatch.setattr(common.torch.version, "hip", "6.2", raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not common.tma(torch.device("cpu"))  # never on HIP
    monkeypatch.setenv("ATOM_MOE_TMA", "yes")
    with pytest.raises(ValueError, match="ATOM_MOE_TMA='yes': allowed are 1"):
        common.tma(torch.device("cpu"))


def test_what_tma_can_address():
    w = torch.zeros(3, 64, 256, dtype=torch.float8_e4m3fn)
    d = common.tile_desc(w, 3 * 64, (32, 128))
    assert d.shape == [192, 256] and d.strides == [256, 1] and d.block_shape == [32, 128]
    assert common.tile_desc(torch.zeros(3, 64, 200, dtype=torch.float8_e4m3fn), 192, (32, 128)) is None  # 200 B rows
    assert common.tile_desc(torch.zeros(3, 64, 200, dtype=torch.bfloat16), 192, (32, 64)) is not None  # 400 B rows
    assert common.tile_desc(w.transpose(1, 2), 3 * 256, (32, 64)) is None  # not contiguous
    assert common.tile_desc(torch.zeros(4097, dtype=torch.bfloat16)[1:].view(64, 64), 64, (16, 64)) is None  # base
    assert common.tile_desc(w, 3 * 64, (512, 64)) is None  # TMA boxes are at most 256 elements a side


def _spy(monkeypatch) -> list[tuple[str, bool]]:
    """Record (gemm, got a descriptor) for every tile_desc call of the launchers."""
    seen = []

    def wrap(name, fn):
        def spy(t, rows, block):
            d = fn(t, rows, block)
            seen.append((name, d is not None))
            return d
        return spy
    monkeypatch.setattr(gemm1, "tile_desc", wrap("gemm1", common.tile_desc))
    monkeypatch.setattr(gemm2, "tile_desc", wrap("gemm2", common.tile_desc))
    return seen


def _both(monkeypatch, spec, p, x, w, ids, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-thread loads, TMA) outputs of one call, each on a freshly poisoned workspace and NaN output."""
    outs = []
    for flag in ("0", "1"):
        monkeypatch.setenv("ATOM_MOE_TMA", flag)
        ws = allocate_workspace(spec, x.shape[0], DEVICE)
        poison(ws)
        out = torch.full((x.shape[0], spec.hidden_size), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        outs.append(fused_experts(x, w, ids, p, spec, workspace=ws, out=out, **kwargs))
    return outs[0], outs[1]


CASES = [
    # scheme, H, I, E, k, T, routing, local experts, tile config (None: heuristic), extra fused_experts arguments
    ("bf16", 256, 96, 6, 3, 29, "sentinels", None, None, {}),
    ("bf16", 200, 136, 5, 2, 21, "random", (0, 2, 3), TileConfig(32, 64, 64, 4, 2, 128, 32, 4, 2), {}),
    ("bf16", 160, 96, 4, 2, 37, "one_expert", None, TileConfig(64, 128, 64, 4, 2, 256, 64, 4, 2),
     {"combine": "separate"}),
    ("fp8", 256, 288, 6, 3, 29, "random", None, TileConfig(64, 256, 128, 4, 2, 256, 128, 4, 2), {}),
    ("fp8", 384, 160, 8, 2, 19, "sentinels", (1, 2, 7), TileConfig(16, 256, 128, 4, 2, 128, 128, 4, 2),
     {"combine": "separate"}),
    ("fp8", 256, 256, 4, 2, 5, "random", None, TileConfig(16, 256, 128, 4, 2, 64, 128, 4, 2, split_k1=2, split_k2=2),
     {}),
    ("bf16", 256, 96, 6, 3, 1, "random", None, None, {"pair_blocks": True}),
    ("fp8", 256, 288, 6, 3, 1, "random", None, None, {"pair_blocks": True}),
    # MXFP4: GEMM2's activation rows only (the weights are decoded from each thread's own words)
    ("a16w4", 256, 192, 6, 3, 29, "random", None, TileConfig(32, 128, 64, 4, 2, 128, 64, 4, 2), {}),
    ("a8w4", 256, 192, 6, 3, 29, "sentinels", (0, 2, 3, 5), None, {}),
    ("a8w4", 128, 256, 4, 2, 37, "one_expert", None, TileConfig(128, 128, 128, 8, 2, 128, 64, 4, 2), {}),
    ("a8w4", 256, 128, 4, 2, 5, "random", None, TileConfig(16, 128, 128, 4, 2, 64, 64, 4, 2, split_k1=2, split_k2=2),
     {}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c[:8]) + "-" + "-".join(c[9]))
def test_tma_gives_the_same_bits(seed, monkeypatch, case):
    scheme, H, I, E, k, T, mode, local, config, extra = case
    spec, p = make_layer(H, I, E, k, scheme, local_experts=local, device=DEVICE)
    w, ids = make_routing(T, E, k, mode=mode, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    seen = _spy(monkeypatch)
    plain, tma = _both(monkeypatch, spec, p, x, w, ids, config=config, **extra)
    assert torch.equal(tma, plain)
    assert_near_twin(tma, experts_torch(x, w, ids, p, spec), x, w, ids, spec, p)
    # every descriptor the flag asks for was made (none without it): w13 and w2 (not MXFP4) and, except with pair
    # blocks, GEMM2's rows
    want = ([] if scheme in ("a16w4", "a8w4") else [("gemm1", True), ("gemm2", True)]) \
        + ([] if extra.get("pair_blocks") else [("gemm2", True)])
    assert sorted(seen) == sorted(want), seen


@pytest.mark.parametrize("scheme,H,want", [
    # fp8 with H = I = 200: 200-byte rows, not a multiple of 16: per-thread loads for every tile
    ("fp8", 200, [("gemm1", False), ("gemm2", False), ("gemm2", False)]),
    # MXFP4 with pair blocks (T = 1): its weights never take a descriptor, and a pair block's row is no run of rows
    ("a16w4", 128, []),
    ("a8w4", 128, []),
])
def test_where_tma_is_not_used_nothing_changes(seed, monkeypatch, scheme, H, want):
    T = 1 if scheme in ("a16w4", "a8w4") else 13
    spec, p = make_layer(H, H, 4, 2, scheme, device=DEVICE)
    w, ids = make_routing(T, 4, 2, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    seen = _spy(monkeypatch)
    plain, tma = _both(monkeypatch, spec, p, x, w, ids, pair_blocks=T == 1)
    assert torch.equal(tma, plain) and torch.isfinite(tma).all()
    assert sorted(seen) == want, seen


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU ranks: needs TRITON_INTERPRET=1 "
                    "(scripts/test.sh sets it); the GPU runs the symm transport in tests/test_ep_symm.py")
@pytest.mark.parametrize("scheme,wire", [("bf16", "bf16"), ("fp8", "fp8")])
def test_tma_in_the_symm_transport(seed, monkeypatch, scheme, wire):
    # MegaMoE's symm transport (GEMM2 pushes each row to its source rank): the flag gives the same bits there too
    from ep_worker import C, E, H, I, K, make_case, placement
    from ep_worker import make_layer as rank_layer

    from atom_moe.ep.simulate import SimulatedSymmGroup
    from atom_moe.spec import MoESpec
    world = 2
    full = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme=scheme,
                          max_tokens_per_rank=C)
    owners = placement("uneven", world)
    specs = [full.for_rank(r, world, tuple(owners[r])) for r in range(world)]
    layers = [rank_layer(full, specs[r], seed)[0] for r in range(world)]
    ins = [make_case("random", full, r, world, owners, seed) for r in range(world)]
    seen = _spy(monkeypatch)
    results = []
    for flag in ("0", "1"):
        monkeypatch.setenv("ATOM_MOE_TMA", flag)
        group = SimulatedSymmGroup(specs, C, wire)
        outs = [torch.full_like(x, float("nan")) for x, _, _ in ins]
        group.forward(layers, *[[i[n] for i in ins] for n in range(3)], outs, [0, 1])  # SPLIT and FUSED modes
        assert group.errors() == [0] * world
        results.append(outs)
    for plain, tma in zip(*results):
        assert torch.equal(tma, plain) and torch.isfinite(tma).all()
    assert ("gemm2", True) in seen and ("gemm1", True) in seen, seen


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
@pytest.mark.parametrize("T", [8, 512, 2048])
def test_tma_on_the_gpu_at_deepseek_v3_dims(seed, monkeypatch, scheme, T):
    # DeepSeek-V3's H and I (32 of its experts, top-8), the shipped table's or heuristic's tiles: TMA loads give the
    # per-thread path's bits, also inside a CUDA graph replayed with new routing on the workspace it left behind
    if torch.version.hip is not None or torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs an NVIDIA GPU of sm_90 or later")
    spec, p = make_layer(7168, 2048, 32, 8, scheme, device="cuda")
    w, ids = make_routing(T, 32, 8, device="cuda")
    x = torch.randn(T, 7168, device="cuda").to(torch.bfloat16)
    plain, tma = _both(monkeypatch, spec, p, x, w, ids)
    assert torch.equal(tma, plain)
    monkeypatch.setenv("ATOM_MOE_TMA", "1")
    ws = allocate_workspace(spec, T, "cuda")
    out = torch.empty(T, 7168, device="cuda", dtype=torch.bfloat16)
    fused_experts(x, w, ids, p, spec, workspace=ws, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(x, w, ids, p, spec, workspace=ws, out=out)
    for _ in range(2):
        w2, ids2 = make_routing(T, 32, 8, device="cuda")
        w.copy_(w2), ids.copy_(ids2), x.copy_(torch.randn(T, 7168, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        monkeypatch.setenv("ATOM_MOE_TMA", "0")
        assert torch.equal(out, fused_experts(x, w, ids, p, spec))
        monkeypatch.setenv("ATOM_MOE_TMA", "1")
    assert_near_twin(out, experts_torch(x, w, ids, p, spec), x, w, ids, spec, p)
