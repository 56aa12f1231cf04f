"""The fused experts path on a GPU: real shapes, int64 offsets, CUDA graphs, no syncs, 3 launches."""

from __future__ import annotations

import pytest
import torch

from kernel_cases import (T1_DRAWS, assert_near_twin, flushable_mxfp4, make_layer, make_routing, reference, rel_err,
                          twin_tol)

pytestmark = pytest.mark.gpu

SHAPES = [  # (name, H, I, local experts E, top_k, activation, bias)
    ("deepseek-v3-dims", 7168, 2048, 8, 4, "swiglu", False),
    ("gpt-oss-dims", 2880, 2880, 6, 4, "oai", True),
]


def _fused():
    from atom_moe.experts import allocate_workspace, fused_experts
    return allocate_workspace, fused_experts


ALL = ["bf16", "fp8", "a16w4", "a8w4"]


@pytest.mark.parametrize("scheme", ALL)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_real_shapes(seed, scheme, shape):
    allocate_workspace, fused_experts = _fused()
    _, H, I, E, k, act, bias = shape
    spec, p = make_layer(H, I, E, k, scheme, oai=act == "oai", bias=bias, device="cuda")
    ws = allocate_workspace(spec, 300, "cuda")
    fp8_act = scheme in ("fp8", "a8w4")
    for T, mode in ((1, "random"), (7, "sentinels"), (300, "one_expert"), (300, "random")):
        # T = 1's bounds are taken over T1_DRAWS calls: one row's error spreads too widely from draw to draw
        parts = []
        for _ in range(T1_DRAWS if T == 1 else 1):
            w, ids = make_routing(T, E, k, mode=mode, device="cuda")
            x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
            out = torch.full((T, H), float("nan"), device="cuda", dtype=torch.bfloat16)
            got = fused_experts(x, w, ids, p, spec, workspace=ws, out=out)
            # the fp32 reference with the same activation quant differs from the kernels as the twin does
            parts.append((got, reference(x, w, ids, spec, p, act_quant=fp8_act),
                          reference(x, w, ids, spec, p, act_quant=False) if fp8_act else None))
        got, ref_q = torch.cat([g for g, _, _ in parts]), torch.cat([r for _, r, _ in parts])
        err_q = rel_err(got, ref_q)
        assert err_q <= twin_tol(spec, got.device), (T, mode, err_q)
        if fp8_act:
            assert rel_err(got, torch.cat([r for _, _, r in parts])) <= 5e-2


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_a8w4_inter_per_group(seed, monkeypatch, shape):
    # ATOM_MOE_A8W4_INTER=group (not the default) at real dims: GEMM1 quantizes per 64-group, GEMM2 with two
    # accumulators; against the twin (which follows the flag) at T = 1 (pair blocks), 8 and 300, then in a CUDA
    # graph replayed with new routing, without a host sync
    from atom_moe.experts_torch import experts_torch
    monkeypatch.setenv("ATOM_MOE_A8W4_INTER", "group")
    allocate_workspace, fused_experts = _fused()
    _, H, I, E, k, act, bias = shape
    spec, p = make_layer(H, I, E, k, "a8w4", oai=act == "oai", bias=bias, device="cuda")
    ws = allocate_workspace(spec, 300, "cuda")
    for T, mode in ((1, "random"), (8, "sentinels"), (300, "random")):
        w, ids = make_routing(T, E, k, mode=mode, device="cuda")
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        got = fused_experts(x, w, ids, p, spec, workspace=ws)
        assert torch.isfinite(got).all(), (T, mode)
        assert_near_twin(got, experts_torch(x, w, ids, p, spec), x, w, ids, spec, p, what=f"T={T} {mode}")
    out = torch.empty(300, H, device="cuda", dtype=torch.bfloat16)
    fused_experts(x, w, ids, p, spec, workspace=ws, out=out)  # compile outside the capture
    graph = _sync_free_graph(lambda: fused_experts(x, w, ids, p, spec, workspace=ws, out=out))
    for mode in ("one_expert", "random"):
        _new_inputs(x, w, ids, out, E, mode)
        graph.replay()
        assert_near_twin(out, experts_torch(x, w, ids, p, spec), x, w, ids, spec, p, what=f"replay {mode}")


def _sync_free_graph(call) -> torch.cuda.CUDAGraph:
    """Run `call` with host syncs turned into errors, then capture it in a CUDA graph."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def _new_inputs(x, w, ids, out, num_experts: int, mode: str) -> None:
    """New tokens and routing (`mode`, make_routing's) into a captured call's inputs, NaN into its output."""
    nw, nids = make_routing(x.shape[0], num_experts, ids.shape[1], mode=mode, device="cuda")
    w.copy_(nw)
    ids.copy_(nids)
    x.copy_(torch.randn(x.shape, device="cuda"))
    out.fill_(float("nan"))


@pytest.mark.parametrize("combine", ["counter", "separate"])
def test_deterministic_combine(seed, combine):
    allocate_workspace, fused_experts = _fused()
    spec, p = make_layer(2048, 512, 16, 8, "bf16", device="cuda")
    w, ids = make_routing(200, 16, 8, device="cuda")
    x = torch.randn(200, 2048, device="cuda").to(torch.bfloat16)
    first = fused_experts(x, w, ids, p, spec, combine=combine)
    for _ in range(20):
        assert torch.equal(fused_experts(x, w, ids, p, spec, combine=combine), first)


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_int64_offsets(seed, scheme):
    # w13 holds > 2**31 elements: expert e's rows start past 2**31 for the high experts
    from atom_moe.experts_torch import experts_torch
    from atom_moe.spec import MoESpec
    from atom_moe.weights import prepare_stacked
    _, fused_experts = _fused()
    H, I, E, k = 4096, 2048, 140, 2
    assert E * 2 * I * H > 2**31
    spec = MoESpec(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, scheme=scheme)
    w13 = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * (2.0 / H ** 0.5)
    w2 = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) / I ** 0.5
    p = prepare_stacked(spec, w13, w2, layout="separated", device="cuda")
    del w13, w2
    T = 33
    ids = torch.stack([torch.randperm(8)[:k] + E - 8 for _ in range(T)]).to(torch.int32).cuda()
    ids[:, 0] = torch.randint(0, E, (T,), dtype=torch.int32).cuda()
    w = torch.rand(T, k, device="cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    got = fused_experts(x, w, ids, p, spec)
    assert rel_err(got, experts_torch(x, w, ids, p, spec)) <= 1e-2


@pytest.mark.parametrize("scheme", ALL)
def test_cuda_graph_replay_with_new_routing(seed, scheme):
    allocate_workspace, fused_experts = _fused()
    from atom_moe.experts_torch import experts_torch
    spec, p = make_layer(1024, 384, 8, 4, scheme, device="cuda")
    T = 40
    ws = allocate_workspace(spec, T, "cuda")
    w, ids = make_routing(T, 8, 4, device="cuda")
    x = torch.randn(T, 1024, device="cuda").to(torch.bfloat16)
    out = torch.empty(T, 1024, device="cuda", dtype=torch.bfloat16)
    fused_experts(x, w, ids, p, spec, workspace=ws, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(x, w, ids, p, spec, workspace=ws, out=out)
    for mode in ("random", "sentinels", "one_expert", "random"):
        nw, nids = make_routing(T, 8, 4, mode=mode, device="cuda")
        w.copy_(nw)
        ids.copy_(nids)
        x.copy_(torch.randn(T, 1024, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        assert rel_err(out, experts_torch(x, w, ids, p, spec)) <= 1e-2, mode


@pytest.mark.parametrize("scheme", ALL)
def test_no_host_sync_and_three_launches(seed, scheme):
    allocate_workspace, fused_experts = _fused()
    spec, p = make_layer(1024, 384, 8, 4, scheme, device="cuda")
    ws = allocate_workspace(spec, 1, "cuda")
    w, ids = make_routing(1, 8, 4, device="cuda")
    x = torch.randn(1, 1024, device="cuda").to(torch.bfloat16)
    fused_experts(x, w, ids, p, spec, workspace=ws)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fused_experts(x, w, ids, p, spec, workspace=ws)
        fused_experts(x, w, ids, p, spec)  # allocating its own workspace is sync-free too
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fused_experts(x, w, ids, p, spec, workspace=ws)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    # a8w4 adds the quant of GEMM1's output (one scale per token on GEMM2's input, kernels/inter_quant.py; where
    # GEMM1 splits K, `_finish_kernel` adds its slices and quantizes in place of GEMM1's second launch)
    quant = [name for name in kernels if "inter_quant" in name or "finish" in name]
    assert len(quant) == (scheme == "a8w4"), kernels
    assert 1 <= len(kernels) - len(quant) <= 3, kernels


@pytest.mark.parametrize("scheme", ["a16w4", "a8w4"])
def test_int64_offsets_mxfp4(seed, scheme):
    # the w13 MX tiles hold > 2**31 bytes: the high experts' blocks start past 2**31. Random tile
    # bytes are built directly (quantizing 9 GB of bf16 would dominate the test); with H and I
    # multiples of 64 there is no padding, so every byte is a real code or scale.
    from atom_moe.experts_torch import experts_torch
    from atom_moe.layouts.gate_up import GateUpKind, GateUpLayout, GateUpTensor
    from atom_moe.spec import MoESpec
    from atom_moe.weights import PreparedWeights
    _, fused_experts = _fused()
    H, I, E, k = 4096, 2048, 264, 2
    assert E * 2 * I * H // 2 > 2**31
    spec = MoESpec(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, scheme=scheme)
    u8 = dict(dtype=torch.uint8, device="cuda")
    w13 = torch.randint(0, 256, (E, 2 * I // 16, H // 64, 512), **u8)
    w2 = torch.randint(0, 256, (E, H // 16, I // 64, 512), **u8)
    quads = scheme == "a8w4"  # MX quads: residual bytes in [1, 12] (none flushed), exponents per row
    kind = GateUpKind.MX_QUADS if quads else GateUpKind.MX_TILES
    lo, hi = (6, 13) if quads else (116, 122)  # ~2^-8: unit-ish rows
    # a8w4's w13 residuals are paired per 128 k (atom_moe/layouts/mx_quads.py)
    s13 = torch.randint(lo, hi, (E, 2 * I // 16, H // 128, 64) if quads else (E, 2 * I // 16, H // 64, 32), **u8)
    s2 = torch.randint(lo, hi, (E, H // 16, I // 64, 32), **u8)
    rowexp = dict(w13_rowexp=GateUpTensor(torch.randint(119, 122, (E, 2 * I), **u8), GateUpLayout.INTERLEAVED),
                  w2_rowexp=torch.randint(119, 122, (E, H), **u8)) if quads else {}
    p = PreparedWeights(spec.scheme, H, I, E, tuple(range(E)), E, torch.arange(E, dtype=torch.int32, device="cuda"),
                        GateUpTensor(w13, GateUpLayout.INTERLEAVED, kind),
                        GateUpTensor(s13, GateUpLayout.INTERLEAVED, kind), w2, s2, **rowexp)
    T = 33
    ids = torch.stack([torch.randperm(8)[:k] + E - 8 for _ in range(T)]).to(torch.int32).cuda()
    ids[:, 0] = torch.randint(0, E, (T,), dtype=torch.int32).cuda()
    w = torch.rand(T, k, device="cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    got = fused_experts(x, w, ids, p, spec)
    assert_near_twin(got, experts_torch(x, w, ids, p, spec), x, w, ids, spec, p)


@pytest.mark.parametrize("combine", ["counter", "separate"])
def test_int64_partial_rows(seed, combine):
    # GEMM2's fp32 partial buffer [T*k, H] holds > 2**31 bytes: the last tokens' rows start past
    # 2**31 bytes (ep/buffers.py lets it pass the int32 check on the strength of this test)
    from atom_moe.experts_torch import experts_torch
    allocate_workspace, fused_experts = _fused()
    H, I, E, k, T = 7168, 256, 8, 8, 9400
    spec, p = make_layer(H, I, E, k, "bf16", device="cuda")
    ws = allocate_workspace(spec, T, "cuda")
    assert ws.partial.numel() * ws.partial.element_size() > 2**31
    w, ids = make_routing(T, E, k, device="cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    got = fused_experts(x, w, ids, p, spec, workspace=ws, combine=combine)
    tail = slice(T - 300, T)  # the rows past 2**31 bytes, checked element by element like the rest
    want = experts_torch(x, w, ids, p, spec)
    assert rel_err(got, want) <= 1e-2
    assert rel_err(got[tail], want[tail]) <= 1e-2


@pytest.mark.parametrize("scheme", ALL)
def test_large_t_launches_graph_replay_and_no_sync(seed, scheme):
    # T*k above both thresholds: the split routing sort (2 launches) and the separate combine,
    # captured once and replayed with new routing (incl. every token on one expert), no host sync
    from atom_moe.tools.breakdown import record_launches
    from atom_moe.experts_torch import experts_torch
    from atom_moe.kernels import gemm2, routing
    allocate_workspace, fused_experts = _fused()
    H, I, E, k, T = 1024, 384, 16, 8, 1100
    assert T * k > max(routing.SPLIT_PAIRS, gemm2.SEPARATE_MIN_PAIRS)
    spec, p = make_layer(H, I, E, k, scheme, device="cuda")
    ws = allocate_workspace(spec, T, "cuda")
    w, ids = make_routing(T, E, k, device="cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
    launches = record_launches(lambda: fused_experts(x, w, ids, p, spec, workspace=ws, out=out))
    quant = ["_inter_quant_kernel"] if scheme == "a8w4" else []  # GEMM2's input per token
    assert [launch.name for launch in launches] == ["_routing_kernel", "_routing_kernel", "_gemm1_kernel", *quant,
                                                    "_gemm2_kernel", "_combine_kernel"]
    graph = _sync_free_graph(lambda: fused_experts(x, w, ids, p, spec, workspace=ws, out=out))
    for mode in ("random", "one_expert", "sentinels"):
        _new_inputs(x, w, ids, out, E, mode)
        graph.replay()
        assert_near_twin(out, experts_torch(x, w, ids, p, spec), x, w, ids, spec, p, what=mode)
        counter = fused_experts(x, w, ids, p, spec, combine="counter")
        assert rel_err(out, counter) <= 4e-3, mode


@pytest.mark.parametrize("block_n1", [128, 256])
def test_a8w4_flushed_blocks(seed, block_n1):
    # a8w4 with flushed blocks (mx_flush, atom_moe/layouts/mx_quads.py) at gpt-oss dims through both GEMM1
    # widths: the compiled decode's flush select zeroes exactly what the twin zeroes, and the same
    # weights with the switch off miss the twin.
    import dataclasses
    import warnings
    from atom_moe.layouts import mx_quads
    from atom_moe.experts_torch import experts_torch
    from atom_moe.kernels.tuning import TileConfig
    from atom_moe.spec import MoESpec
    from atom_moe.weights import prepare_mxfp4_local
    _, fused_experts = _fused()
    H, I, E, k, T = 2880, 2880, 4, 4, 200
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, scheme="a8w4")

    experts = flushable_mxfp4(E, H, I, 0.15)
    flushed = sum(int(mx_quads.flushed_blocks(p, s).sum()) for ex in experts for p, s in (ex[:2], ex[2:]))
    assert flushed > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the flush warning (tested on the CPU)
        p = prepare_mxfp4_local(spec, [tuple(t.cuda() for t in ex) for ex in experts])
    assert p.mx_flush is True
    w, ids = make_routing(T, E, k, mode="random", device="cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    cfg = TileConfig(32, block_n1, 64, 4, 3, 64, 64, 4, 3)
    twin = experts_torch(x, w, ids, p, spec)
    got = fused_experts(x, w, ids, p, spec, config=cfg)
    assert torch.isfinite(got).all()
    assert_near_twin(got, twin, x, w, ids, spec, p)
    assert rel_err(fused_experts(x, w, ids, dataclasses.replace(p, mx_flush=False), spec, config=cfg), twin) > 0.1


def test_register_cap_reaches_the_compiled_gemms(seed):
    # a tile config's maxnreg1/2 caps the registers of the kernels that run: an a16w4 16 x 128 x 128 tile
    # (122 registers uncapped) at 96, same answer as uncapped within rounding, against the reference
    from atom_moe.kernels import gemm1, gemm2
    from atom_moe.kernels.tuning import TileConfig
    _, fused_experts = _fused()
    H, I, E, k, T = 2048, 1024, 8, 4, 16
    spec, p = make_layer(H, I, E, k, "a16w4", device="cuda")
    w, ids = make_routing(T, E, k, mode="random", device="cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    free = TileConfig(16, 128, 128, 4, 3, 128, 128, 4, 3)
    capped = TileConfig(16, 128, 128, 4, 3, 128, 128, 4, 3, maxnreg1=96, maxnreg2=96)
    for kernel in (gemm1._gemm1_kernel, gemm2._gemm2_kernel):
        kernel.device_caches.clear()
    got = fused_experts(x, w, ids, p, spec, config=capped)
    regs = [c.n_regs for kernel in (gemm1._gemm1_kernel, gemm2._gemm2_kernel)
            for cache in kernel.device_caches.values() for c in cache[0].values()]
    assert regs and max(regs) <= 96, regs
    assert rel_err(got, reference(x, w, ids, spec, p, act_quant=False)) <= 1e-2
    assert rel_err(got, fused_experts(x, w, ids, p, spec, config=free)) <= 1e-3


@pytest.mark.parametrize("block_k1", [64, 128])
def test_a8w4_through_dot_scaled(seed, monkeypatch, block_k1):
    # ATOM_MOE_SCALED_DOT=1: a8w4 through the real tl.dot_scaled (gfx950's path; Triton decomposes it on
    # Hopper), at gpt-oss dims, against the twin and the e4m3 decode (the CPU runs an fp32 emulation)
    from atom_moe.experts_torch import experts_torch
    from atom_moe.kernels import mxfp4
    from atom_moe.kernels.tuning import TileConfig
    _, fused_experts = _fused()
    H, I, E, k, T = 2880, 2880, 6, 4, 300
    spec, p = make_layer(H, I, E, k, "a8w4", oai=True, bias=True, device="cuda")
    w, ids = make_routing(T, E, k, mode="random", device="cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    cfg = TileConfig(32, 128, block_k1, 4, 3, 64, 64, 4, 3)
    monkeypatch.setenv(mxfp4.SCALED_DOT_FLAG, "1")
    got = fused_experts(x, w, ids, p, spec, config=cfg)
    assert torch.isfinite(got).all() and rel_err(got, experts_torch(x, w, ids, p, spec)) <= 1e-2
    monkeypatch.setenv(mxfp4.SCALED_DOT_FLAG, "0")
    assert rel_err(got, fused_experts(x, w, ids, p, spec, config=cfg)) <= 1e-2


@pytest.mark.parametrize("act", ["fp8", "bf16"])
def test_plugin_mxfp4_path_equals_fused_experts_bit_for_bit(seed, act):
    """ATOM_MOE_MXFP4_ACT on the GPU: the vLLM plugin's path for a gpt-oss layer equals fused_experts, bit for bit.

    vLLM cannot be installed on the GPU machine, so this runs the plugin's own pieces without it: the
    flag parsed by plugins.common, vLLM's parameter layout (w13_weight [E, 2I, H/2] uint8 rows
    interleaved, w13_weight_scale, biases) through prepare_stacked as
    AtomMoEMethod.process_weights_after_loading calls it, then the custom op its apply calls, with a
    Triton workspace. The other side reads the same checkpoint with atom_moe.checkpoint (not the
    plugin's code) and calls fused_experts. The engine suites check the method inside vLLM on the CPU.
    """
    from dataclasses import replace

    from engine_common import a8w4_spec, assert_bitwise, hf_checkpoint

    from atom_moe import ops
    from atom_moe.checkpoint.gpt_oss import prepare_gpt_oss
    from atom_moe.experts import allocate_workspace, fused_experts
    from atom_moe.layouts.gate_up import GateUpLayout
    from atom_moe.plugins.common import parse_flags
    from atom_moe.spec import Scheme
    from atom_moe.weights import prepare_stacked

    E, H, k, T = 8, 512, 4, 96
    gen = torch.Generator().manual_seed(seed)
    tensors, _ = hf_checkpoint("mxfp4", gen, E, H)
    scheme = parse_flags({"ATOM_USE_FLYDSL": "1", "ATOM_MOE_MXFP4_ACT": act}).mxfp4_scheme
    assert scheme is (Scheme.A8W4 if act == "fp8" else Scheme.A16W4)
    spec = replace(a8w4_spec(E, H, k), scheme=scheme)
    two_i = tensors["gate_up_proj_blocks"].shape[1]
    vllm_params = dict(w13=tensors["gate_up_proj_blocks"].reshape(E, two_i, H // 2),
                       w2=tensors["down_proj_blocks"].reshape(E, H, -1),
                       w13_scale=tensors["gate_up_proj_scales"], w2_scale=tensors["down_proj_scales"],
                       w13_bias=tensors["gate_up_proj_bias"], w2_bias=tensors["down_proj_bias"])
    cuda = {n: t.cuda() for n, t in vllm_params.items()}
    plugin_weights = prepare_stacked(spec, cuda.pop("w13"), cuda.pop("w2"), layout=GateUpLayout.INTERLEAVED,
                                     expert_ids=tuple(range(E)), device=torch.device("cuda"), **cuda)
    handle = ops.bind_experts(plugin_weights, spec, backend="triton",
                              workspace=allocate_workspace(spec, T, "cuda"))
    ours = prepare_gpt_oss(spec, {f"experts.{n}": t for n, t in tensors.items()}, "experts", device="cuda")
    x = (torch.randn(T, H, generator=gen) * 2).bfloat16().cuda()
    logits = torch.randn(T, E, generator=gen).cuda()
    w, ids = torch.topk(logits.softmax(-1), k)
    try:
        got = torch.ops.atom_moe.experts(x, w, ids, handle)
        want = fused_experts(x, w, ids, ours, spec, workspace=allocate_workspace(spec, T, "cuda"))
        torch.cuda.synchronize()
        assert torch.isfinite(want).all() and want.abs().max() > 0
        assert_bitwise(got.cpu(), want.cpu())
    finally:
        ops.unbind(handle)
