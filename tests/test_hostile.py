"""Hostile input (issue 21): corrupt expert maps, non-finite x and routing weights, wrong shapes and
dtypes, odd checkpoint tensors, fp32 x, transformers-5 configs. Each is a clear error naming the
tensor and what is allowed, or the documented semantics (docs/formats.md), on every path.

Only APIs that predate the issue are used, so each test can be run against the old code too.
The Triton paths run under the interpreter on the CPU and natively on a GPU (DEVICE).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from kernel_cases import make_layer, make_routing

from atom_moe import MegaMoE
from atom_moe.checkpoint import prepare_hf_experts
from atom_moe.checkpoint.config import spec_from_config
from atom_moe.experts_torch import experts_torch
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import MoESpec
from atom_moe.weights import WeightError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BACKEND = "triton" if DEVICE == "cuda" else "torch"  # MegaMoE's experts step (the interpreter is covered above)
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")
H, I, E, K, T = 128, 64, 8, 3, 12
SCHEMES = ["bf16", "fp8", "a16w4", "a8w4"]


def _fused(*args, **kwargs):
    pytest.importorskip("triton")
    from atom_moe.experts import fused_experts
    return fused_experts(*args, **kwargs)


PATHS = {"torch": experts_torch, "triton": _fused}


# ---------------------------------------------------------------- expert map
def _bad_maps(p):
    """(what, corrupt expert_map) pairs: out of range, permuted, a duplicate, a local expert unmapped."""
    m = p.expert_map
    over = m.clone()
    over[p.local_experts[0]] = p.num_local_experts  # one past the local experts
    perm = m.clone()
    a, b = p.local_experts[0], p.local_experts[1]
    perm[a], perm[b] = m[b], m[a]
    dup = m.clone()
    dup[a] = m[b]
    missing = m.clone()
    missing[a] = -1
    return [("out of range", over), ("permuted", perm), ("duplicate", dup), ("unmapped", missing)]


@pytest.mark.parametrize("local", [None, (1, 3, 4, 6)])
def test_corrupt_expert_map_is_refused_at_build(seed, local):
    spec, p = make_layer(H, I, E, K, "bf16", local_experts=local)
    for what, bad in _bad_maps(p):
        with pytest.raises(WeightError, match="expert_map disagrees with local_experts"):
            dataclasses.replace(p, expert_map=bad)
    with pytest.raises(WeightError, match="num_local_experts=3 but local_experts lists 4"):
        dataclasses.replace(p, local_experts=p.local_experts[:4], num_local_experts=3)
    with pytest.raises(WeightError, match=r"expert_map is int64 \[8\]; allowed: int32 \[8\]"):
        dataclasses.replace(p, expert_map=p.expert_map.long())


@pytest.mark.parametrize("path", ["torch", "triton"])
def test_expert_map_edited_after_build_is_refused(seed, path):
    """An in-place edit or a replaced map is validated again before use (not inside a graph capture)."""
    spec, p = make_layer(H, I, E, K, "bf16", local_experts=(0, 2, 5, 7), device=DEVICE)
    w, ids = make_routing(T, E, K, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).bfloat16()
    ok = PATHS[path](x, w, ids, p, spec)  # valid map: runs
    assert torch.isfinite(ok).all()
    for what, bad in _bad_maps(p):
        q = dataclasses.replace(p)
        q.expert_map = bad.to(DEVICE)  # replaced
        with pytest.raises(WeightError, match="expert_map"):
            PATHS[path](x, w, ids, q, spec)
        r = dataclasses.replace(p, expert_map=p.expert_map.clone())
        r.expert_map.copy_(bad)  # edited in place
        with pytest.raises(WeightError, match="expert_map"):
            PATHS[path](x, w, ids, r, spec)


def test_megamoe_refuses_corrupt_expert_map(seed):
    spec, p = make_layer(H, I, E, K, "bf16", device=DEVICE)
    w, ids = make_routing(T, E, K, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).bfloat16()
    with MegaMoE(spec, experts_backend=BACKEND, device=DEVICE) as op:
        for what, bad in _bad_maps(p):
            with pytest.raises(WeightError, match="expert_map"):
                op.bind(dataclasses.replace(p, expert_map=bad.to(DEVICE)))
            q = dataclasses.replace(p)
            q.expert_map = bad.to(DEVICE)
            with pytest.raises(WeightError, match="expert_map"):
                op(x, w, ids, q)


# ---------------------------------------------------------------- wide int64 ids
@pytest.mark.parametrize("call", ["torch", "triton", "separate", "pair_blocks"])
def test_wide_int64_ids_are_sentinels(seed, call, monkeypatch):
    # an int64 id outside [0, E) whose low 32 bits name an expert (2^32 + e, 2^31) contributes nothing, as
    # -1 does, on every path: the kernels used to narrow the ids to int32 before the range check
    spec, p = make_layer(H, I, E, K, "fp8", local_experts=(1, 2, 5, 6), device=DEVICE)
    T1 = 1 if call == "pair_blocks" else T
    w, ids = make_routing(T1, E, K, device=DEVICE)
    ids = ids.long()
    wide = ids.clone()
    wide[0, 0] = 2**32 + 1
    wide[:, -1] = torch.where(torch.arange(T1, device=DEVICE) % 2 == 0, 2**32 + 5, 2**31)
    dead = torch.where(wide == ids, ids, torch.full_like(ids, -1))
    x = torch.randn(T1, H, device=DEVICE).bfloat16()
    kwargs = {"combine": "separate"} if call == "separate" else {"pair_blocks": True} if call == "pair_blocks" else {}
    run = PATHS["torch" if call == "torch" else "triton"]
    got, want = run(x, w, wide, p, spec, **kwargs), run(x, w, dead, p, spec, **kwargs)
    assert torch.equal(got, want)


# ---------------------------------------------------------------- non-finite input
def _nan_case(scheme: str, oai: bool = False):
    spec, p = make_layer(H, I, E, K, scheme, oai=oai, bias=oai, device=DEVICE)
    w, ids = make_routing(T, E, K, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).bfloat16()
    return spec, p, w, ids, x


def _check_rows(out: torch.Tensor, clean: torch.Tensor, bad_rows: list[int]) -> None:
    """The bad rows are all NaN; every other row is exactly the clean run's."""
    for r in bad_rows:
        assert torch.isnan(out[r]).all(), f"row {r} should be NaN: {out[r, :8].tolist()}"
    good = [r for r in range(out.shape[0]) if r not in bad_rows]
    assert torch.isfinite(out[good]).all()
    assert torch.equal(out[good], clean[good]), "a non-finite row leaked into other rows"


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_non_finite_x_rows_stay_non_finite(seed, path, scheme):
    spec, p, w, ids, x = _nan_case(scheme)
    run = PATHS[path]
    clean = run(x, w, ids, p, spec)
    bad = x.clone()
    bad[2, 5] = float("nan")
    bad[7, 100] = float("inf")
    bad[9, 0] = float("-inf")
    _check_rows(run(bad, w, ids, p, spec), clean, [2, 7, 9])


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("scheme", ["fp8", "a8w4"])
def test_nan_in_last_partial_group_of_x(seed, path, scheme):
    """H = 160: the NaN sits in the partial last 128-group (32 wide) of the per-group quant."""
    spec, p = make_layer(160, I, E, K, scheme, device=DEVICE)
    w, ids = make_routing(T, E, K, device=DEVICE)
    x = torch.randn(T, 160, device=DEVICE).bfloat16()
    clean = PATHS[path](x, w, ids, p, spec)
    x[4, 150] = float("nan")
    _check_rows(PATHS[path](x, w, ids, p, spec), clean, [4])


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("scheme", ["bf16", "a16w4"])
def test_nan_survives_gpt_oss_clamp(seed, path, scheme):
    """swiglu_oai clamps gate and up: a clamp must not turn NaN into the limit."""
    spec, p, w, ids, x = _nan_case(scheme, oai=True)
    clean = PATHS[path](x, w, ids, p, spec)
    x[3, 17] = float("nan")
    _check_rows(PATHS[path](x, w, ids, p, spec), clean, [3])


@pytest.mark.parametrize("path", ["torch", "triton"])
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_nan_routing_weight_stays_in_its_row(seed, path, scheme):
    spec, p, w, ids, x = _nan_case(scheme)
    clean = PATHS[path](x, w, ids, p, spec)
    w = w.clone()
    w[5, 1] = float("nan")
    _check_rows(PATHS[path](x, w, ids, p, spec), clean, [5])


def test_non_finite_x_reference_and_megamoe(seed):
    spec, p, w, ids, x = _nan_case("bf16")
    ref_w = ReferenceWeights.from_prepared(p)
    bad = x.clone()
    bad[1, 3] = float("nan")
    _check_rows(reference_moe(bad.float(), w, ids, ref_w, spec.activation),
                reference_moe(x.float(), w, ids, ref_w, spec.activation), [1])
    with MegaMoE(spec, experts_backend=BACKEND, device=DEVICE) as op:
        _check_rows(op(bad, w, ids, p), op(x, w, ids, p), [1])


# ---------------------------------------------------------------- call validation
@pytest.mark.parametrize("entry", ["experts_torch", "reference_moe"])
def test_bad_calls_name_the_tensor(seed, entry):
    spec, p = make_layer(H, I, E, K, "bf16")
    w, ids = make_routing(T, E, K)
    x = torch.randn(T, H).bfloat16()
    if entry == "experts_torch":
        call = lambda x_, w_, i_: experts_torch(x_, w_, i_, p, spec)  # noqa: E731
    else:
        ref_w = ReferenceWeights.from_prepared(p)
        call = lambda x_, w_, i_: reference_moe(x_, w_, i_, ref_w, spec.activation)  # noqa: E731
    cases = [
        ((x, w, ids[:, :2]), "topk_weights must be|topk_ids must be"),
        ((x, w[:-1], ids), "topk_weights must be"),
        ((x, w, ids[:-1]), "topk_ids must be"),
        ((x, w, ids.float()), "topk_ids dtype torch.float32 not supported; allowed: int32, int64"),
        ((x, w.to(torch.int32), ids), "topk_weights dtype torch.int32 not supported; allowed: float32"),
        ((x.to(torch.int32), w, ids), "x dtype torch.int32 not supported; allowed: bfloat16, float16, float32"),
        ((x[:, :100], w, ids), r"x must be \[T, H=128\], got \(12, 100\)"),
        ((x[0], w, ids), r"x must be \[T, H=128\]"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            call(*args)


def test_fp32_x_is_announced(seed):
    """fp32 x runs with bf16 activations: every path that does so says it, once per call site."""
    spec, p = make_layer(H, I, E, K, "bf16", device=DEVICE)
    w, ids = make_routing(T, E, K, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE)
    paths = [lambda: experts_torch(x, w, ids, p, spec)]
    if DEVICE == "cuda" or __import__("os").environ.get("TRITON_INTERPRET") == "1":
        paths.append(lambda: _fused(x, w, ids, p, spec))
    for run in paths:
        with pytest.warns(UserWarning, match="x is float32, but atom_moe computes with bf16 activations"):
            out = run()
        assert out.dtype == torch.float32
    with warnings.catch_warnings():  # bf16 x: silent
        warnings.simplefilter("error")
        experts_torch(x.bfloat16(), w, ids, p, spec)


# ---------------------------------------------------------------- checkpoints and configs
def _hf_tensors(spec: MoESpec, dtype=torch.bfloat16) -> dict:
    out = {}
    for e in range(spec.num_experts):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            out[f"m.experts.{e}.{proj}.weight"] = torch.randn(shape).to(dtype)
    return out


def test_hf_checkpoint_odd_dtypes_name_the_tensor(seed):
    spec = MoESpec(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K)
    t = _hf_tensors(spec)
    t["m.experts.3.up_proj.weight"] = t["m.experts.3.up_proj.weight"].to(torch.int32)
    with pytest.raises(WeightError, match=r"m.experts.3.up_proj.weight has dtype int32; allowed: bfloat16"):
        prepare_hf_experts(spec, t, "m.experts")
    t = _hf_tensors(spec)
    t["m.experts.5.down_proj.weight"] = t["m.experts.5.down_proj.weight"].to(torch.float8_e4m3fn)
    with pytest.raises(WeightError, match=r"m.experts.5.down_proj.weight is float8_e4m3fn but "
                                          r"m.experts.5.gate_proj.weight is bfloat16"):
        prepare_hf_experts(spec, t, "m.experts")
    t = _hf_tensors(spec)
    for p in ("gate_proj", "up_proj", "down_proj"):  # a whole fp8 expert among bf16 ones
        key = f"m.experts.2.{p}.weight"
        t[key] = t[key].to(torch.float8_e4m3fn)
        t[key + "_scale_inv"] = torch.ones(1, 1)
    with pytest.raises(WeightError, match="m.experts.2.gate_proj.weight is float8_e4m3fn but expert 0 is bfloat16"):
        prepare_hf_experts(spec, t, "m.experts")


QWEN3_T5 = dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048,
                intermediate_size=6144, moe_intermediate_size=768, num_local_experts=128, num_experts_per_tok=8,
                norm_topk_prob=True, num_hidden_layers=48, decoder_sparse_step=1, mlp_only_layers=[])


def test_transformers5_qwen3_config_reads_as_qwen3():
    """transformers 5 writes num_local_experts (not num_experts) into Qwen3-MoE configs."""
    layer = spec_from_config(QWEN3_T5)
    s = layer.spec
    assert (s.num_experts, s.intermediate_size, s.top_k, s.has_bias) == (128, 768, 8, False)
    assert s.activation.kind.value == "swiglu" and s.routing.renormalize
    for key in ("model_type",):  # without model_type, the architecture decides
        layer2 = spec_from_config({k: v for k, v in QWEN3_T5.items() if k != key})
        assert layer2.spec == s
    released = dict(QWEN3_T5)
    released["num_experts"] = released.pop("num_local_experts")
    assert spec_from_config(released).spec == s
    gpt_oss = dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_experts=32,
                   num_experts_per_tok=4, num_hidden_layers=24)
    g = spec_from_config(gpt_oss).spec  # gpt-oss with the other expert-count key
    assert g.num_experts == 32 and g.has_bias and g.activation.kind.value == "swiglu_oai"
    with pytest.raises(Exception, match="model_type 'mixtral'"):
        spec_from_config(dict(model_type="mixtral", hidden_size=64, intermediate_size=64, num_local_experts=8,
                              num_experts_per_tok=2, num_hidden_layers=1))


# ---------------------------------------------------------------- on the GPU, at model dims
@pytest.mark.gpu
@pytest.mark.parametrize("scheme,hidden,inter,oai", [("fp8", 7168, 2048, False), ("a8w4", 2880, 2880, True),
                                                     ("a16w4", 2880, 2880, True), ("bf16", 2880, 2880, True)])
def test_gpu_non_finite_rows_at_model_dims(seed, scheme, hidden, inter, oai):
    """DeepSeek-V3 (fp8) and gpt-oss (MXFP4, bf16; clamped SwiGLU) dims: NaN/Inf rows stay NaN, others exact."""
    spec, p = make_layer(hidden, inter, 8, 4, scheme, oai=oai, bias=oai, device="cuda")
    w, ids = make_routing(64, 8, 4, device="cuda")
    x = torch.randn(64, hidden, device="cuda").bfloat16()
    clean = _fused(x, w, ids, p, spec)
    x[3, 11] = float("nan")
    x[40, hidden - 1] = float("inf")  # in gpt-oss's partial last 128-group
    w = w.clone()
    w[50, 2] = float("nan")
    _check_rows(_fused(x, w, ids, p, spec), clean, [3, 40, 50])


@pytest.mark.gpu
def test_gpu_expert_map_check_is_graph_safe(seed):
    """The per-call check never syncs; a map edited after build is refused before use, and inside a capture
    with a clear error instead of a sync."""
    from atom_moe.experts import allocate_workspace
    spec, p = make_layer(1024, 384, 8, 4, "bf16", local_experts=(0, 2, 5, 7), device="cuda")
    w, ids = make_routing(16, 8, 4, device="cuda")
    x = torch.randn(16, 1024, device="cuda").bfloat16()
    ws = allocate_workspace(spec, 16, "cuda")
    out = torch.empty_like(x)
    _fused(x, w, ids, p, spec, workspace=ws, out=out)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _fused(x, w, ids, p, spec, workspace=ws, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _fused(x, w, ids, p, spec, workspace=ws, out=out)
    graph.replay()
    torch.cuda.synchronize()
    p.expert_map[[0, 2]] = p.expert_map[[2, 0]].clone()  # permuted in place
    with pytest.raises(WeightError, match="expert_map"):
        _fused(x, w, ids, p, spec, workspace=ws, out=out)
    graph2 = torch.cuda.CUDAGraph()
    with pytest.raises(WeightError, match="before capturing a CUDA graph"):
        with torch.cuda.graph(graph2):
            _fused(x, w, ids, p, spec, workspace=ws, out=out)
