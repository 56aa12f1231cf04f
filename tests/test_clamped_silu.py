"""Clamped SiLU (DeepSeek-V4's `swiglu_limit`): spec, reference, torch twin, Triton GEMM1, config reading.

The formula, read in vLLM 0.33 (SiluAndMulWithClamp, fused_moe/utils.py swiglu_limit_func) and
transformers 5 (DeepseekV4Experts._apply_gate): gate = min(gate, limit), up = clamp(up, -limit,
limit), out = silu(gate) * up, on GEMM1's output in fp32 (vLLM's kernels) before any quant.
Data are drawn so the clamp is live on both sides of up and above on gate (the tests check that
it is); every output element is compared.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from kernel_cases import make_layer, make_routing, reference, rel_err

from atom_moe.checkpoint.config import spec_from_config
from atom_moe.experts import allocate_workspace, fused_experts
from atom_moe.experts_torch import experts_torch
from atom_moe.reference import ReferenceWeights, apply_activation, reference_moe
from atom_moe.routing import route
from atom_moe.spec import Activation, ActivationKind, MoESpec, Routing, Scheme, Scoring, SpecError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CLAMP = ActivationKind.SWIGLU_CLAMP


def independent_clamped_silu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """The formula in float64 with torch.where (no clamp, no silu): what the reference must equal."""
    g, u = gate.double(), up.double()
    g = torch.where(g > limit, torch.full_like(g, limit), g)
    u = torch.where(u > limit, torch.full_like(u, limit), torch.where(u < -limit, torch.full_like(u, -limit), u))
    return g / (1 + torch.exp(-g)) * u


def assert_every_element(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    """Relative Frobenius error <= tol, and every element within 3 tol of the output's scale."""
    assert out.shape == ref.shape and torch.isfinite(out).all()
    assert rel_err(out, ref) <= tol, rel_err(out, ref)
    err = (out.double() - ref.double()).abs()
    bound = 3 * tol * ref.double().abs().max()
    assert (err <= bound).all(), f"{int((err > bound).sum())} of {err.numel()} elements off, max {err.max():.4g}"


# ---------------------------------------------------------------- spec
@pytest.mark.parametrize("limit, match", [
    (None, "swiglu_clamp needs its limit"),
    (0.0, "swiglu_clamp needs a finite limit > 0"),
    (-10.0, "swiglu_clamp needs a finite limit > 0"),
    (float("nan"), "swiglu_clamp needs a finite limit > 0"),
    (float("inf"), "swiglu_clamp needs a finite limit > 0"),
    ("10", "swiglu_clamp needs a finite limit > 0"),
    (True, "swiglu_clamp needs a finite limit > 0"),
])
def test_clamp_limit_is_validated(limit, match):
    with pytest.raises(SpecError, match=match):
        Activation(CLAMP, limit=limit)


def test_clamp_spec_and_defaults():
    act = Activation("swiglu_clamp", limit=10)
    assert act.kind is CLAMP and act.limit == 10.0 and isinstance(act.limit, float) and act.clamped
    spec = MoESpec.create(hidden_size=64, intermediate_size=64, num_experts=4, top_k=2,
                          activation={"kind": "swiglu_clamp", "limit": 7.5})
    assert spec.activation == Activation(CLAMP, limit=7.5)
    # the other kinds keep their meaning: gpt-oss's 7.0 by default, plain SiLU unclamped
    assert Activation(ActivationKind.SWIGLU_OAI).limit == 7.0 and Activation(ActivationKind.SWIGLU_OAI).clamped
    assert not Activation().clamped
    with pytest.raises(SpecError, match="allowed: swiglu, swiglu_oai, swiglu_clamp"):
        Activation("swiglu_clip", limit=1.0)


# ---------------------------------------------------------------- the formula
def test_reference_formula(seed):
    limit = 2.5
    g, u = torch.randn(64, 96) * 3 * limit, torch.randn(64, 96) * 3 * limit
    assert (g > limit).float().mean() > 0.2 and (u < -limit).float().mean() > 0.2 and (u > limit).float().mean() > 0.2
    got = apply_activation(g, u, Activation(CLAMP, limit=limit))
    assert got.dtype == torch.float32
    want = independent_clamped_silu(g, u, limit)
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
    # the clamp is live on these data: neither plain SiLU nor one-sided clamps give the same values
    assert not torch.allclose(apply_activation(g, u, Activation()).double(), want, rtol=1e-2, atol=1e-2)
    assert not torch.allclose((torch.nn.functional.silu(g.clamp(max=limit)) * u.clamp(max=limit)).double(), want,
                              rtol=1e-2, atol=1e-2)
    # bf16 inputs are computed in fp32; NaN survives the clamp (a silent clamp of NaN would hide bad data)
    assert apply_activation(g.bfloat16(), u.bfloat16(), Activation(CLAMP, limit=limit)).dtype == torch.float32
    nan = apply_activation(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, float("nan")]),
                           Activation(CLAMP, limit=limit))
    assert torch.isnan(nan).all()


def test_reference_matches_transformers_deepseek_v4(seed):
    """transformers' own DeepSeek-V4 expert activation (its gate_up chunked into gate, up) is ours."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts

    limit = 10.0  # DeepSeek-V4's
    gate_up = torch.randn(40, 2 * 72) * 25
    hf = DeepseekV4Experts._apply_gate(SimpleNamespace(limit=limit, act_fn=torch.nn.functional.silu), gate_up)
    ours = apply_activation(gate_up[:, :72], gate_up[:, 72:], Activation(CLAMP, limit=limit))
    assert torch.allclose(ours, hf, rtol=1e-6, atol=1e-6)
    assert (gate_up.abs() > limit).float().mean() > 0.5


def test_reference_moe_with_clamp_vs_token_loop(seed):
    H, I, E, T, limit = 96, 64, 4, 12, 1.5
    w13, w2 = torch.randn(E, 2 * I, H) * (4 / H ** 0.5), torch.randn(E, H, I) / I ** 0.5
    x = torch.randn(T, H)
    w, ids = torch.rand(T, 2) + 0.1, torch.stack([torch.randperm(E)[:2] for _ in range(T)])
    act = Activation(CLAMP, limit=limit)
    got = reference_moe(x, w, ids, ReferenceWeights.from_separated(w13, w2), act)
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(2):
            h = w13[ids[t, k]].double() @ x[t].double()
            want[t] += float(w[t, k]) * (w2[ids[t, k]].double() @ independent_clamped_silu(h[:I], h[I:], limit))
    assert_every_element(got, want, 1e-5)


# ---------------------------------------------------------------- torch twin and Triton kernels
# scheme, H, I, E, k, T, bias, routing mode, local experts, limit
CASES = [
    ("bf16", 160, 96, 4, 2, 11, False, "random", None, 2.0),
    ("bf16", 128, 64, 6, 3, 9, True, "sentinels", (0, 2, 5), 10.0),  # DeepSeek-V4's limit
    ("fp8", 200, 136, 6, 3, 13, False, "sentinels", None, 2.0),
    ("a16w4", 160, 96, 4, 2, 11, True, "random", (1, 3), 1.5),
    ("a8w4", 160, 96, 4, 2, 11, False, "one_expert", None, 2.0),
]


def _clamp_case(case):
    scheme, H, I, E, k, T, bias, mode, local, limit = case
    # gate/up ~ N(0, (3 limit)^2): most values beyond the limit, on both sides
    spec, p = make_layer(H, I, E, k, scheme, bias=bias, local_experts=local, device=DEVICE, gate_std=3 * limit,
                         activation=Activation(CLAMP, limit=limit))
    w, ids = make_routing(T, E, k, mode=mode, device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    return spec, p, x, w, ids


def _unclamped(spec):
    from dataclasses import replace

    return replace(spec, activation=Activation())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-H{c[1]}-I{c[2]}-{c[7]}-L{c[9]}")
def test_twin_matches_reference(seed, case):
    spec, p, x, w, ids = _clamp_case(case)
    act_quant = spec.scheme.fp8_activations
    ref = reference(x, w, ids, spec, p, act_quant=act_quant)
    twin = experts_torch(x, w, ids, p, spec)
    assert_every_element(twin, ref, 1e-2)
    # the clamp decides the result here: the unclamped layer is far from it
    assert rel_err(reference(x, w, ids, _unclamped(spec), p, act_quant=act_quant), ref) > 0.2


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-H{c[1]}-I{c[2]}-{c[7]}-L{c[9]}")
def test_triton_matches_reference(seed, case):
    """Our Triton experts (the interpreter on the CPU) with the clamp in GEMM1's epilogue."""
    spec, p, x, w, ids = _clamp_case(case)
    T, H = x.shape
    ws = allocate_workspace(spec, T, DEVICE)
    out = torch.full((T, H), float("nan"), device=DEVICE, dtype=torch.bfloat16)
    got = fused_experts(x, w, ids, p, spec, workspace=ws, out=out)
    act_quant = spec.scheme.fp8_activations
    ref = reference(x, w, ids, spec, p, act_quant=act_quant)
    assert_every_element(got, ref, 1e-2)
    assert_every_element(got, experts_torch(x, w, ids, p, spec), 1e-2)
    assert rel_err(reference(x, w, ids, _unclamped(spec), p, act_quant=act_quant), ref) > 0.2


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
def test_v4_flash_dims_on_gpu(seed, scheme):
    """DeepSeek-V4-Flash's expert dims (H 4096, I 2048; 8 local experts, top-6) with its limit 10 live,
    compiled kernels on the GPU, in and out of a CUDA graph, every element against the reference."""
    H, I, E, k, limit = 4096, 2048, 8, 6, 10.0
    spec, p = make_layer(H, I, E, k, scheme, device="cuda", gate_std=3 * limit,
                         activation=Activation(CLAMP, limit=limit))
    ws = allocate_workspace(spec, 256, "cuda")
    act_quant = spec.scheme.fp8_activations
    for T, mode in ((1, "random"), (37, "sentinels"), (256, "random")):
        w, ids = make_routing(T, E, k, mode=mode, device="cuda")
        x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
        got = fused_experts(x, w, ids, p, spec, workspace=ws)
        ref = reference(x, w, ids, spec, p, act_quant=act_quant)
        assert_every_element(got, ref, 1e-2)
        assert rel_err(reference(x, w, ids, _unclamped(spec), p, act_quant=act_quant), ref) > 0.2
    out = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    fused_experts(x, w, ids, p, spec, workspace=ws, out=out)  # compiled before the capture
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fused_experts(x, w, ids, p, spec, workspace=ws, out=out)
    w2, ids2 = make_routing(T, E, k, device="cuda")
    w.copy_(w2), ids.copy_(ids2), x.copy_(torch.randn(T, H, device="cuda").to(torch.bfloat16))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert_every_element(out, reference(x, w, ids, spec, p, act_quant=act_quant), 1e-2)


def test_gemm1_rejects_oai_with_clamp(seed):
    from atom_moe.kernels import gemm1

    spec, p, x, w, ids = _clamp_case(CASES[0])
    ws = allocate_workspace(spec, x.shape[0], DEVICE)
    with pytest.raises(ValueError, match="oai already clamps"):
        gemm1.gemm1(x, None, p.w13, None, None, ws.sorted_ids, ws.block_expert, 1, 2, ws.inter, None, oai=True,
                    clamp=True, alpha=1.702, limit=2.0, block_m=16, block_n=64, block_k=64, num_warps=4,
                    num_stages=2)


# ---------------------------------------------------------------- config.json -> spec, routing
V4 = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 4096,
      "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 6, "num_hidden_layers": 43,
      "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
      "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "hidden_act": "silu",
      "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                              "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}, "expert_dtype": "fp4"}


def test_v4_config_gives_clamped_silu_and_its_routing():
    layer = spec_from_config(V4)
    spec = layer.spec
    assert spec.activation == Activation(CLAMP, limit=10.0)
    assert spec.scheme is Scheme.A16W4  # expert_dtype fp4: MXFP4 experts (quant_method fp8 is attention's)
    assert (spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k) == (4096, 2048, 256, 6)
    assert spec.routing == Routing(Scoring.SQRTSOFTPLUS, renormalize=True, correction_bias=True,
                                   routed_scaling_factor=1.5)
    assert layer.moe_layers == 43
    # V4.1 nests the text model's fields under text_config; expert_dtype may sit in quantization_config
    text = {k: v for k, v in V4.items() if k not in ("model_type", "architectures", "quantization_config",
                                                     "expert_dtype")}
    v41 = {"model_type": "deepseek_v41", "text_config": dict(text, swiglu_limit=7.25),
           "quantization_config": dict(V4["quantization_config"], expert_dtype="fp8")}
    s41 = spec_from_config(v41).spec
    assert s41.activation == Activation(CLAMP, limit=7.25) and s41.scheme is Scheme.FP8
    assert spec_from_config(dict(V4, swiglu_limit=0)).spec.activation == Activation()  # vLLM: 0 means no clamp
    assert spec_from_config({k: v for k, v in V4.items() if k != "swiglu_limit"}).spec.activation.limit == 10.0
    with pytest.raises(SpecError, match="swiglu_limit 'ten' is not a number"):
        spec_from_config(dict(V4, swiglu_limit="ten"))
    with pytest.raises(SpecError, match="expert_dtype 'int4' not supported; allowed: fp4, fp8"):
        spec_from_config(dict(V4, expert_dtype="int4"))
    with pytest.raises(SpecError, match="NVFP4 routed experts"):
        spec_from_config(dict(V4, quantization_config=dict(V4["quantization_config"], moe_quant_algo="nvfp4")))


def test_route_sqrtsoftplus(seed):
    """DeepSeek-V4's scores sqrt(softplus(logit)): biased choice, unbiased renormalized weights, scaled."""
    logits, bias = torch.randn(16, 32) * 3, torch.randn(32) * 0.5
    routing = Routing(Scoring.SQRTSOFTPLUS, renormalize=True, correction_bias=True, routed_scaling_factor=1.5)
    w, ids = route(logits, routing, 6, bias)
    for t in range(16):
        scores = [math.sqrt(math.log1p(math.exp(float(v)))) for v in logits[t]]
        pick = sorted(range(32), key=lambda i: -(scores[i] + float(bias[i])))[:6]
        assert sorted(ids[t].tolist()) == sorted(pick)
        chosen = {i: scores[i] for i in pick}
        for slot in range(6):
            want = chosen[int(ids[t, slot])] / sum(chosen.values()) * 1.5
            assert abs(float(w[t, slot]) - want) <= 1e-5 * want
