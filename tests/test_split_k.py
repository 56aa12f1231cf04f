"""Split-K GEMM1 and GEMM2 (decode batches, every scheme) against the unsplit kernels, the torch twin
and the oracle.

CPU, TRITON_INTERPRET=1. H is chosen so the K slices are uneven and, at the largest split, the
last slice is empty (its programs store zeros): split 3 of 4 K steps gives slices of 2, 2, 0.
GEMM2's slices meet in its counter combine: a token completes at split x its local slots.
MXFP4 (a16w4, a8w4) splits in its swapped orientation: the slices travel transposed and each
slice's MX offsets start k_lo / BLOCK_K steps in.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import assert_near_twin, make_layer, make_routing, reference, rel_err  # noqa: E402

from atom_moe.experts import allocate_workspace, fused_experts  # noqa: E402
from atom_moe.experts_torch import experts_torch  # noqa: E402
from atom_moe.kernels import common, gemm2, routing  # noqa: E402
from atom_moe.kernels.tuning import ConfigError, TileConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

# (scheme, H, I, E, k, T, mode, oai); fp8 steps K by 128, the others by 64. H and I give 4-7 K steps,
# so split 3 leaves uneven slices or an empty last one; oai: gpt-oss's activation with biases (GEMM2's
# bias must be added once, by slice 0)
CASES = [
    ("bf16", 448, 96, 6, 3, 1, "random", False),
    ("bf16", 448, 160, 8, 4, 5, "sentinels", False),
    ("bf16", 200, 256, 6, 2, 16, "one_expert", True),
    ("fp8", 448, 256, 6, 3, 1, "random", False),
    ("fp8", 448, 192, 8, 4, 7, "sentinels", False),
    ("a16w4", 256, 192, 8, 4, 5, "sentinels", False),
    ("a8w4", 320, 256, 6, 3, 1, "random", True),
]


def config(scheme: str, split: int, split2: int = 1) -> TileConfig:
    if scheme == "fp8":
        return TileConfig(16, 256, 128, 4, 2, 64, 128, 4, 2, split_k1=split, split_k2=split2)
    if scheme == "a8w4":  # GEMM1 128 wide (one 64-group of its output per half), K step 64
        return TileConfig(16, 128, 64, 4, 2, 64, 64, 4, 2, split_k1=split, split_k2=split2)
    return TileConfig(16, 64, 64, 4, 2, 64, 64, 4, 2, split_k1=split, split_k2=split2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(v) for v in c))
def test_split_k_matches_unsplit_and_reference(seed, case):
    scheme, H, I, E, k, T, mode, oai = case
    spec, p = make_layer(H, I, E, k, scheme, oai=oai, bias=oai, device=DEVICE)
    w, ids = make_routing(T, E, k, mode=mode, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    twin = experts_torch(x, w, ids, p, spec)
    oracle = reference(x, w, ids, spec, p, act_quant=scheme in ("fp8", "a8w4"))
    whole = fused_experts(x, w, ids, p, spec, config=config(scheme, 1))
    steps1 = -(-H // config(scheme, 1).block_k1)
    steps2 = -(-I // config(scheme, 1).block_k2)
    # both GEMMs at 3 slices (uneven, or an empty last one), then GEMM1 at every K step with GEMM2 at 2
    for n, (split, split2) in enumerate([(3, min(3, steps2)), (steps1, 2)]):
        ws = allocate_workspace(spec, T, DEVICE)
        ws.partial.view(torch.uint8).fill_(0xFF)  # NaN: a slice the second launch reads unwritten shows
        got = fused_experts(x, w, ids, p, spec, config=config(scheme, split, split2), workspace=ws)
        what = f"split {split}, GEMM2 split {split2}"
        assert torch.isfinite(got).all(), f"{what}: unwritten or NaN output"
        # the slices are added in a fixed order: the same function as the unsplit kernel up to fp32
        # summation order (and, for fp8, a quant code at a rounding tie), every element
        scale = float(whole.float().abs().max())
        worst = float((got.float() - whole.float()).abs().max())
        assert worst <= 2e-2 * scale, f"{what}: an element {worst:.3g} off the unsplit kernel ({scale:.3g})"
        assert rel_err(got, twin) <= 1e-2 and rel_err(got, oracle) <= 1e-2, what
        if n == 0:
            again = fused_experts(x, w, ids, p, spec, config=config(scheme, split, split2), workspace=ws)
            assert torch.equal(again, got), f"{what}: not deterministic"


def test_split_rows_run_unsplit_above_the_decode_bound(seed):
    # a row tuned with split 2 at T = 8 is the nearest bucket for T = 16 too; there (and above) the
    # call runs the row's tiles unsplit: the same kernel launch as split 1, bit for bit
    spec, p = make_layer(448, 96, 6, 3, "bf16", device=DEVICE)
    w, ids = make_routing(64, 6, 3, device=DEVICE)  # 192 pairs: above the decode bound
    x = torch.randn(64, 448, device=DEVICE).to(torch.bfloat16)
    got = fused_experts(x, w, ids, p, spec, config=config("bf16", 2))
    assert torch.equal(got, fused_experts(x, w, ids, p, spec, config=config("bf16", 1)))
    assert rel_err(got, reference(x, w, ids, spec, p, act_quant=False)) <= 1e-2
    with pytest.raises(ValueError, match="decode batches of at most 128"):
        common.check_split("GEMM1", 2, 192, 192, 448, 64, torch.empty(10**6))


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_split_k_in_a_workspace_sized_for_more_tokens(seed, scheme):
    # engines size one workspace for their largest batch and run decode steps in it; fp8's
    # quantized activations live there, so GEMM1 must see T rows of them, not max_tokens
    spec, p = make_layer(448, 256, 6, 3, scheme, device=DEVICE)
    ws = allocate_workspace(spec, 512, DEVICE)
    for T in (1, 5):
        w, ids = make_routing(T, 6, 3, device=DEVICE)
        x = torch.randn(T, 448, device=DEVICE).to(torch.bfloat16)
        whole = fused_experts(x, w, ids, p, spec, config=config(scheme, 1))
        got = fused_experts(x, w, ids, p, spec, config=config(scheme, 2), workspace=ws)
        scale = float(whole.float().abs().max())
        assert float((got.float() - whole.float()).abs().max()) <= 2e-2 * scale, f"T={T}"
        assert rel_err(got, reference(x, w, ids, spec, p, act_quant=scheme == "fp8")) <= 1e-2, f"T={T}"


def test_split_k_is_refused_where_it_does_not_run(seed):
    spec, p = make_layer(448, 96, 6, 3, "bf16", device=DEVICE)
    x = torch.randn(64, 448, device=DEVICE).to(torch.bfloat16)
    w, ids = make_routing(64, 6, 3, device=DEVICE)
    with pytest.raises(ValueError, match="exceeds the 7 K steps"):
        fused_experts(x[:2], w[:2], ids[:2], p, spec, config=TileConfig(16, 64, 64, 4, 2, 64, 64, 4, 2, split_k1=8))
    with pytest.raises(ConfigError, match="split_k1=9"):
        TileConfig(16, 64, 64, 4, 2, 64, 64, 4, 2, split_k1=9).check("bf16")
    with pytest.raises(ValueError, match="needs an fp32 partial buffer"):
        common.check_split("GEMM1", 2, 8, 192, 448, 64, torch.empty(10))


def test_gemm2_split_runs_only_with_the_local_counter_combine(seed):
    # the separate combine (and the symm transport) sum slot rows that a split GEMM2 would leave in
    # slices: the launcher refuses the pair, and fused_experts runs such calls unsplit
    spec, p = make_layer(448, 256, 6, 3, "bf16", device=DEVICE)
    w, ids = make_routing(2, 6, 3, device=DEVICE)
    x = torch.randn(2, 448, device=DEVICE).to(torch.bfloat16)
    ws = allocate_workspace(spec, 2, DEVICE)
    out = fused_experts(x, w, ids, p, spec, workspace=ws, combine="separate", config=config("bf16", 1))
    split = fused_experts(x, w, ids, p, spec, workspace=ws, combine="separate", config=config("bf16", 1, 2))
    assert torch.equal(split, out)
    with pytest.raises(ValueError, match="GEMM2 split_k=2: split-K runs with the local counter combine only"):
        gemm2.gemm2(ws.inter, None, p.w2, None, None, ws.sorted_ids, ws.block_expert, routing.max_blocks(6, 6, 16),
                    ids, p.expert_map, w, gemm2.separate_partial(ws.partial, out), ws.counters, ws.n_counters, out,
                    block_m=16, block_n=64, block_k=64, num_warps=4, num_stages=2, separate=True, split_k=2)


def test_workspace_has_room_for_every_split_at_decode_sizes():
    # a workspace sized exactly for one token still takes the largest split
    spec, _ = make_layer(200, 160, 6, 3, "bf16", device=DEVICE)
    ws = allocate_workspace(spec, 1, DEVICE)
    assert ws.partial.numel() >= common.MAX_SPLIT_K * 1 * 3 * 2 * 160
    common.check_split("GEMM1", common.MAX_SPLIT_K, 3, 2 * 160, 200 * 8, 64, ws.partial)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
def test_split_k_on_the_gpu_at_deepseek_v3_dims(seed, scheme):
    # DeepSeek-V3's H and I (16 of its experts, top-8), T = 1 and 8, every split of GEMM1 alone, then of
    # both GEMMs, then a graph replay of new routing: the same checks as on the CPU, at the shape
    # split-K is for
    spec, p = make_layer(7168, 2048, 16, 8, scheme, device="cuda")
    for T in (1, 8):
        w, ids = make_routing(T, 16, 8, device="cuda")
        x = torch.randn(T, 7168, device="cuda").to(torch.bfloat16)
        twin = experts_torch(x, w, ids, p, spec)
        whole = fused_experts(x, w, ids, p, spec, config=config(scheme, 1))
        ws = allocate_workspace(spec, T, "cuda")
        for split, split2 in [(s, 1) for s in (2, 4, 8)] + [(s, s) for s in (2, 4, 8)]:
            got = fused_experts(x, w, ids, p, spec, config=config(scheme, split, split2), workspace=ws)
            scale = float(whole.float().abs().max())
            what = f"T={T} split {split}, GEMM2 split {split2}"
            assert float((got.float() - whole.float()).abs().max()) <= 2e-2 * scale, what
            assert_near_twin(got, twin, x, w, ids, spec, p, what)  # a8w4: the fp8 accumulator's bound
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused_experts(x, w, ids, p, spec, config=config(scheme, 4, 4), workspace=ws)
        w2, ids2 = make_routing(T, 16, 8, device="cuda")
        w.copy_(w2), ids.copy_(ids2)
        graph.replay()
        assert torch.equal(out, fused_experts(x, w, ids, p, spec, config=config(scheme, 4, 4), workspace=ws))
