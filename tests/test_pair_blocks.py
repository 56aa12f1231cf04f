"""Pair blocks: the layer without its routing launch (kernels/routing.py `PairBlocks`), every scheme
(ATOM_MOE_PAIR_BLOCKS=1 makes them T = 1's default; every test here sets it).

CPU, TRITON_INTERPRET=1. Each (token, slot) pair is its own row block and GEMM1 does the routing
launch's per-token work: it zeroes the combine counters and the output rows no local expert writes,
and for e4m3 activations quantizes x itself. Every case runs on a poisoned workspace (NaN floats,
garbage counters) into a NaN output, so a duty left undone shows; each must equal the sorted path
bit for bit (a row's result does not depend on which block computes it).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import assert_near_twin, make_layer, make_routing, poison  # noqa: E402

from atom_moe import formats  # noqa: E402
from atom_moe.experts import allocate_workspace, fused_experts  # noqa: E402
from atom_moe.experts_torch import experts_torch  # noqa: E402
from atom_moe.kernels import tuning  # noqa: E402
from atom_moe.kernels.tuning import TileConfig  # noqa: E402
from atom_moe.tools.breakdown import record_launches  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
SCHEMES = ["bf16", "fp8", "a16w4", "a8w4"]
H, I, E, K = 224, 160, 6, 3
LOCAL = (1, 2, 4, 5)  # this rank's experts in the "mixed" and "nothing_local" cases


@pytest.fixture(autouse=True)
def _pair_blocks_on(monkeypatch):
    monkeypatch.setenv("ATOM_MOE_PAIR_BLOCKS", "1")  # T = 1 takes pair blocks by default


def _poisoned(spec, T: int):
    ws = allocate_workspace(spec, T, DEVICE)
    poison(ws)
    return ws


def _case(scheme: str, mode: str, T: int):
    """(spec, weights, topk_weights, topk_ids, x) for one routing mode."""
    local = None if mode in ("random", "same_expert") else LOCAL
    spec, p = make_layer(H, I, E, K, scheme, local_experts=local, device=DEVICE)
    w, ids = make_routing(T, E, K, device=DEVICE)
    if mode == "mixed":  # local, non-local and sentinel slots in every token
        ids[:, 0] = torch.tensor(LOCAL)[torch.randint(0, len(LOCAL), (T,))].to(ids)
        ids[:, 1] = torch.where(torch.rand(T) < 0.5, 0, 3).to(ids)  # experts of another rank
        ids[:, 2] = torch.where(torch.rand(T) < 0.5, -1, E).to(ids)
    elif mode == "same_expert":  # a warm-up batch: every slot on one expert
        ids[:] = int(torch.randint(0, E, ()))
    elif mode == "nothing_local":
        ids[:] = torch.tensor([0, 3, -1]).to(ids)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    return spec, p, w, ids, x


@pytest.mark.parametrize("mode", ["random", "mixed", "same_expert", "nothing_local"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_one_token_is_two_launches_and_equals_the_sorted_path(seed, scheme, mode):
    spec, p, w, ids, x = _case(scheme, mode, 1)
    sorted_path = fused_experts(x, w, ids, p, spec, pair_blocks=False)
    # no routing launch; GEMM1 is a second launch only where the config splits its K (the heuristic at T = 1 on
    # shapes with few GEMM1 programs, as here for bf16, fp8 and a8w4: kernels/tuning.py `_fill`)
    gemm1 = ["gemm1"] * (2 if tuning.heuristic(scheme, H, I, E, K, 1).split_k1 > 1 else 1)
    assert len(gemm1) == (1 if scheme == "a16w4" else 2)
    if scheme == "a8w4":  # GEMM2's input per token: a launch quantizes GEMM1's rows, adding its K slices first
        gemm1 = ["gemm1", "inter_quant"]
    for _ in range(2):  # the second call finds the first call's counters: GEMM1 must zero them again
        ws = _poisoned(spec, 1)
        out = torch.full((1, H), float("nan"), device=DEVICE, dtype=torch.bfloat16)
        launches = record_launches(lambda: fused_experts(x, w, ids, p, spec, workspace=ws, out=out))
        assert [launch.stage for launch in launches] == gemm1 + ["gemm2"]
        assert torch.equal(out, sorted_path), "pair blocks differ from the sorted path"
    if mode == "nothing_local":
        assert (out == 0).all()
    else:
        assert_near_twin(out, experts_torch(x, w, ids, p, spec), x, w, ids, spec, p)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_pair_blocks_at_more_tokens(seed, scheme):
    # forced on where experts repeat across tokens: correct, only slower (an expert read per pair)
    spec, p, w, ids, x = _case(scheme, "mixed", 5)
    ws = _poisoned(spec, 5)
    out = torch.full((5, H), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    fused_experts(x, w, ids, p, spec, workspace=ws, out=out, pair_blocks=True)
    assert torch.equal(out, fused_experts(x, w, ids, p, spec))


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a8w4"])
def test_pair_blocks_with_split_k(seed, scheme):
    # GEMM1's duties run in the first launch only (slice 0 zeroes, every slice quantizes)
    n1, k1, k2 = {"bf16": (64, 64, 64), "fp8": (256, 128, 128), "a8w4": (128, 64, 64)}[scheme]
    cfg = TileConfig(16, n1, k1, 4, 2, 64, k2, 4, 2, split_k1=2, split_k2=2)
    spec, p, w, ids, x = _case(scheme, "mixed", 1)
    ws = _poisoned(spec, 1)
    out = torch.full((1, H), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    launches = record_launches(lambda: fused_experts(x, w, ids, p, spec, workspace=ws, out=out, config=cfg))
    # a8w4: the quant launch adds the K slices itself (kernels/inter_quant.py finish_rows), GEMM1 is one launch
    want = ["gemm1", "inter_quant"] if scheme == "a8w4" else ["gemm1", "gemm1"]
    assert [launch.stage for launch in launches] == [*want, "gemm2"]
    assert [launch.name for launch in launches][1] == ("_finish_kernel" if scheme == "a8w4" else "_gemm1_kernel")
    assert torch.equal(out, fused_experts(x, w, ids, p, spec, config=cfg, pair_blocks=False))


def test_the_flag_decides_the_default(seed, monkeypatch):
    spec, p, w, ids, x = _case("bf16", "random", 1)
    gemm1 = ["gemm1", "gemm1"]  # the heuristic splits GEMM1's K at this shape (9 programs): two launches
    assert tuning.heuristic("bf16", H, I, E, K, 1).split_k1 == 2
    for flag, want in (("1", [*gemm1, "gemm2"]), ("0", ["routing", *gemm1, "gemm2"]),
                       (None, [*gemm1, "gemm2"])):
        if flag is None:
            monkeypatch.delenv("ATOM_MOE_PAIR_BLOCKS")
        else:
            monkeypatch.setenv("ATOM_MOE_PAIR_BLOCKS", flag)
        assert [launch.stage for launch in record_launches(lambda: fused_experts(x, w, ids, p, spec))] == want, flag
    monkeypatch.setenv("ATOM_MOE_PAIR_BLOCKS", "yes")
    with pytest.raises(ValueError, match="ATOM_MOE_PAIR_BLOCKS='yes': allowed are unset or 1 .* or 0"):
        fused_experts(x, w, ids, p, spec)


@pytest.mark.parametrize("scheme", ["fp8", "a8w4"])
def test_pre_quantized_x_scale_shape(seed, scheme):
    # fp8 takes one scale per 128-group; a8w4 one per token, [T, 1]: a per-group x_scale would run and be wrong,
    # so it is refused by shape. The accepted form gives the same bits as the layer's own quant of x.
    spec, p, w, ids, x = _case(scheme, "random", 3)
    ws = allocate_workspace(spec, 3, DEVICE)
    q, s = formats.quantize_fp8_per_token(x) if spec.scheme.x_per_token else formats.quantize_fp8_per_group(x)
    got = fused_experts(q, w, ids, p, spec, x_scale=s, workspace=ws, pair_blocks=False).clone()
    assert torch.equal(got, fused_experts(x, w, ids, p, spec, workspace=ws, pair_blocks=False))
    wrong = formats.quantize_fp8_per_group(x)[1] if spec.scheme.x_per_token else s[:, :1]
    want = r"\[T, 1\] \(a8w4: one scale per token\)" if spec.scheme.x_per_token else r"\[T, ceil\(H/128\)\]"
    with pytest.raises(ValueError, match=want):
        fused_experts(q, w, ids, p, spec, x_scale=wrong, workspace=ws, pair_blocks=False)


def test_pair_blocks_need_a_local_unquantized_call(seed):
    spec, p, w, ids, x = _case("fp8", "random", 1)
    xq = x.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="pair_blocks needs a local output and unquantized x"):
        fused_experts(xq, w, ids, p, spec, x_scale=torch.ones(1, 2, device=DEVICE), pair_blocks=True)


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", SCHEMES)
def test_pair_blocks_on_the_gpu_at_deepseek_v3_dims(seed, scheme):
    # DeepSeek-V3's H and I (16 of its experts, top-8) at T = 1: the two-launch layer equals the sorted path
    # bit for bit (GEMM1's own quant of x included), in a CUDA graph replayed with new routing and input,
    # on a workspace the previous replay left behind
    spec, p = make_layer(7168, 2048, 16, 8, scheme, device="cuda")
    w, ids = make_routing(1, 16, 8, device="cuda")
    x = torch.randn(1, 7168, device="cuda").to(torch.bfloat16)
    ws = _poisoned(spec, 1)
    out = torch.full((1, 7168), float("nan"), device="cuda", dtype=torch.bfloat16)
    fused_experts(x, w, ids, p, spec, workspace=ws, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(x, w, ids, p, spec, workspace=ws, out=out)
    for _ in range(3):
        w2, ids2 = make_routing(1, 16, 8, device="cuda")
        w.copy_(w2), ids.copy_(ids2), x.copy_(torch.randn(1, 7168, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, fused_experts(x, w, ids, p, spec, pair_blocks=False))
        assert_near_twin(out, experts_torch(x, w, ids, p, spec), x, w, ids, spec, p)
