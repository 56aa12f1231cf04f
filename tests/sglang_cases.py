"""The SGLang plugin against the real SGLang package, on the CPU (run by tests/test_sglang_plugin.py).

Runs inside the SGLang env (scripts/sglang_env.sh) with ATOM_USE_FLYDSL=1: SGLang's own
`load_plugins()` finds and calls our entry point, FusedMoE layers are built under SGLang's
runtime context, SGLang's weight loaders fill them, and `FusedMoE.forward` runs them (eager
and through the piecewise-graph custom op). Outputs are compared with atom_moe.reference
on every element. Multi-rank cases run tests/sglang_worker.py processes (gloo).
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

assert os.environ.get("ATOM_USE_FLYDSL") == "1", "run through tests/test_sglang_plugin.py"

import sglang_common as c  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402
from sglang.srt.plugins.hook_registry import HookRegistry  # noqa: E402

from atom_moe.plugins import sglang as plugin  # noqa: E402
from atom_moe.plugins.sglang import hooks  # noqa: E402

HERE = Path(__file__).resolve().parent
SEED = int(os.environ.get("ATOM_MOE_SEED", "0")) or int(torch.seed() % 2**31)
print(f"seed={SEED}")


@pytest.fixture(scope="module")
def runtime():
    """SGLang's plugin loader (must find and call our entry point), then a 1-rank runtime context."""
    load_plugins()
    c.start_runtime(chunked=512)
    yield


def _gen(salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(SEED * 1000 + salt)


# ---------------------------------------------------------------- registration
def test_entry_point_discovered_and_applied_by_load_plugins(runtime):
    from importlib.metadata import entry_points

    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.value == "atom_moe.plugins.sglang:register"]
    assert len(eps) == 1, list(entry_points(group="sglang.srt.plugins"))
    # the hooks landed on the real classes, wrapping our functions
    assert FusedMoE.forward_impl.__wrapped__ is not None
    for cls in (FusedMoE, UnquantizedFusedMoEMethod, Fp8MoEMethod, Mxfp4MoEMethod):
        name = "forward_impl" if cls is FusedMoE else "process_weights_after_loading"
        assert hasattr(getattr(cls, name), "__wrapped__"), cls
    for target in (plugin.FORWARD, *plugin.PROCESS_WEIGHTS):
        assert target in HookRegistry._patched
        assert [h for _, h, _ in HookRegistry._hooks[target]] in ([hooks.forward_impl],
                                                                   [hooks.process_weights_after_loading])
    assert plugin.COMPLETE not in HookRegistry._hooks  # experts mode: SGLang's reductions stay as they are
    plugin.register()  # idempotent: no second hook
    assert len(HookRegistry._hooks[plugin.FORWARD]) == 1


def test_sglang_before_plugin_framework_changes_nothing(runtime, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="sglang.atom_moe")
    assert plugin.version_supported("0.5.14") and plugin.version_supported("0.5.23.post1")
    assert not plugin.version_supported("0.5.10") and not plugin.version_supported("dev")
    monkeypatch.setattr(plugin, "_registered", None)
    monkeypatch.setattr(plugin, "sglang_version", lambda: "0.5.10")
    before = {t: len(h) for t, h in HookRegistry._hooks.items()}
    plugin.register()
    assert {t: len(h) for t, h in HookRegistry._hooks.items()} == before
    assert any("found 0.5.10" in r.getMessage() for r in caplog.records)


def test_flag_off_changes_nothing():
    code = ("import sys; from sglang.srt.plugins import load_plugins; load_plugins();"
            "from sglang.srt.plugins.hook_registry import HookRegistry as R;"
            "from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE as F;"
            "from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod as M;"
            "assert not hasattr(F.forward_impl, '__wrapped__'); "
            "assert not hasattr(M.process_weights_after_loading, '__wrapped__');"
            "assert not [t for t in R._hooks if 'moe' in t or 'quantization' in t], dict(R._hooks); print('UNTOUCHED')")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATOM_USE_FLYDSL", "ATOM_FLYDSL"))}
    proc = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "UNTOUCHED" in proc.stdout, proc.stderr[-3000:]
    assert "active in SGLang" not in proc.stderr  # no start-up line without a flag


@pytest.mark.parametrize("act, shown", [(None, "mxfp4 (gpt-oss style) as a16w4 (ATOM_MOE_MXFP4_ACT=bf16)"),
                                         ("fp8", "mxfp4 (gpt-oss style) as a8w4 (ATOM_MOE_MXFP4_ACT=fp8)")])
def test_startup_line_names_the_mode(act, shown):
    code = "from sglang.srt.plugins import load_plugins; load_plugins()"
    env = dict(os.environ, ATOM_USE_FLYDSL_FUSED="1")
    env.pop("ATOM_MOE_MXFP4_ACT", None)
    env.update({"ATOM_MOE_MXFP4_ACT": act} if act else {})
    proc = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "atom_moe 0" in ln and "active in SGLang" in ln]
    assert len(lines) == 1 and "ATOM_USE_FLYDSL_FUSED=1" in lines[0], proc.stderr[-3000:]
    assert shown in lines[0], lines[0]


def test_bad_mxfp4_act_stops_start_up():
    code = "from sglang.srt.plugins import load_plugins; load_plugins()"
    proc = subprocess.run([sys.executable, "-P", "-c", code], env=dict(os.environ, ATOM_MOE_MXFP4_ACT="int4"),
                          capture_output=True, text=True, timeout=600)
    assert "ATOM_MOE_MXFP4_ACT='int4'; allowed: bf16 (a16w4), fp8 (a8w4)" in proc.stderr, proc.stderr[-3000:]


# ---------------------------------------------------------------- layers, weights, forward
def _built(scheme: str, salt: int):
    layer = c.build(scheme)
    tensors, ref = c.checkpoint(scheme, _gen(salt))
    assert c.load(layer, scheme, tensors) > 0
    return layer, ref


@pytest.mark.parametrize("scheme", c.SCHEMES)
def test_weights_built_and_originals_released(runtime, scheme):
    layer, _ = _built(scheme, 1)
    originals = [weakref.ref(p) for n, p in layer.named_parameters() if n.startswith(("w13", "w2"))]
    assert len(originals) >= 2
    c.process(layer)
    state = layer.atom_moe
    assert state.weights.num_local_experts == c.E and state.plan.spec.local_experts == tuple(range(c.E))
    assert state.weights.w13.kind.value == ("mx_tiles" if scheme == "mxfp4" else "rows")  # no plain MXFP4 kept
    assert state.plan.tokens == 512  # --chunked-prefill-size (no graphs on the CPU)
    assert not [n for n, _ in layer.named_parameters() if n.startswith(("w13", "w2"))]
    gc.collect()
    assert all(r() is None for r in originals), "SGLang's expert parameters are still alive"


@pytest.mark.parametrize("scheme", c.SCHEMES)
def test_forward_matches_reference_with_padded_rows(runtime, scheme):
    layer, ref = _built(scheme, 2)
    c.process(layer)
    gen = _gen(3)
    T = 29
    x = torch.randn(T, c.H, generator=gen).bfloat16()
    logits = torch.randn(T, c.E, generator=gen)
    w, ids = c.route(logits)
    # decode-graph padding: SGLang's in-tree path sets padded rows' ids to num_experts; its mask kernel to -1
    ids[-4:-2] = c.E
    ids[-2:] = -1
    out = layer.forward(x, c.topk_output(w, ids, logits))
    c.assert_matches(out[:-4], c.expected(scheme, x, w, ids, ref)[:-4])
    assert torch.equal(out[-4:], torch.zeros_like(out[-4:]))


@pytest.mark.parametrize("scheme", c.SCHEMES)
def test_capture_style_degenerate_routing(runtime, scheme):
    """Graph capture runs all-zero input ids: every token picks the same experts."""
    layer, ref = _built(scheme, 4)
    c.process(layer)
    T = 64
    x = torch.randn(1, c.H, generator=_gen(5)).bfloat16().expand(T, c.H).contiguous()
    logits = torch.randn(1, c.E, generator=_gen(6)).expand(T, c.E).contiguous()
    w, ids = c.route(logits)
    assert (ids == ids[0]).all()
    out = layer.forward(x, c.topk_output(w, ids, logits))
    c.assert_matches(out, c.expected(scheme, x, w, ids, ref))


def test_piecewise_graph_op_path(runtime):
    """Inside a piecewise CUDA graph FusedMoE.forward goes through SGLang's custom op, then forward_impl."""
    from sglang.srt.layers.moe.fused_moe_triton import layer as layer_mod
    from sglang.srt.model_executor.runner_backend_utils.tc_piecewise_cuda_graph import context_manager as cm
    from sglang.srt.utils.common import sglang_lib

    # SGLang registers its op for the GPU key only; give the CPU key the same Python body
    op = torch.ops.sglang.moe_forward_piecewise_cuda_graph_impl
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op.default.name(), "CPU"):
        body = layer_mod.moe_forward_piecewise_cuda_graph_impl.__wrapped__
        sglang_lib.impl("moe_forward_piecewise_cuda_graph_impl", body, "CPU")

    layer, ref = _built("bf16", 7)
    c.process(layer)
    gen = _gen(8)
    x = torch.randn(11, c.H, generator=gen).bfloat16()
    logits = torch.randn(11, c.E, generator=gen)
    w, ids = c.route(logits)
    with cm.enable_tc_piecewise_cuda_graph(), cm.set_tc_piecewise_forward_context(
            None, [], None, {layer.layer_id: layer}, []):
        assert cm.is_in_tc_piecewise_cuda_graph()
        out = layer.forward(x, c.topk_output(w, ids, logits))
    c.assert_matches(out, c.expected("bf16", x, w, ids, ref))


def test_sglang_dispatcher_not_used_on_our_layers(runtime):
    layer, ref = _built("bf16", 9)
    c.process(layer)

    def boom(*a, **k):
        raise AssertionError("SGLang's dispatcher ran on a layer we own")

    layer.dispatcher.dispatch = layer.dispatcher.combine = boom
    gen = _gen(10)
    x = torch.randn(5, c.H, generator=gen).bfloat16()
    logits = torch.randn(5, c.E, generator=gen)
    w, ids = c.route(logits)
    c.assert_matches(layer.forward(x, c.topk_output(w, ids, logits)), c.expected("bf16", x, w, ids, ref))


def test_deepep_moe_falls_through_to_our_hook(runtime):
    """DeepEPMoE with deprecate_flag (e.g. under aiter) calls super().forward_impl: the hooked FusedMoE one."""
    from sglang.srt.layers.moe.ep_moe.layer import DeepEPMoE

    layer, ref = _built("fp8", 11)
    c.process(layer)
    layer.__class__ = DeepEPMoE  # its forward_impl; building one needs DeepEP, which the CPU lacks
    layer.deprecate_flag = True
    gen = _gen(12)
    x = torch.randn(9, c.H, generator=gen).bfloat16()
    logits = torch.randn(9, c.E, generator=gen)
    w, ids = c.route(logits)
    out = DeepEPMoE.forward_impl(layer, x, c.topk_output(w, ids, logits))
    c.assert_matches(out, c.expected("fp8", x, w, ids, ref))


# ---------------------------------------------------------------- MXFP4 as a8w4 (ATOM_MOE_MXFP4_ACT=fp8)
@pytest.fixture
def mxfp4_act(monkeypatch):
    """Set ATOM_MOE_MXFP4_ACT and hand the hooks the flags register() would read from it (it runs once)."""
    from atom_moe.plugins.common import parse_flags

    def use(value: str) -> None:
        monkeypatch.setenv("ATOM_MOE_MXFP4_ACT", value)
        monkeypatch.setattr(hooks, "_flags", parse_flags())

    return use


def _mxfp4_layer_run(salt: int):
    """A gpt-oss style FusedMoE through SGLang's loaders and forward: (state, out, x, w, ids, tensors, ref)."""
    layer = c.build("mxfp4")
    tensors, ref = c.checkpoint("mxfp4", _gen(salt))
    assert c.load(layer, "mxfp4", tensors) > 0
    originals = [weakref.ref(p) for n, p in layer.named_parameters() if n.startswith(("w13", "w2"))]
    assert len(originals) == 6  # blocks, scales, biases of w13 and w2
    c.process(layer)
    gc.collect()
    assert all(r() is None for r in originals), "SGLang's original MXFP4 parameters are still alive"
    assert not [n for n, _ in layer.named_parameters() if n.startswith(("w13", "w2"))]
    gen = _gen(salt + 1)
    x, logits = torch.randn(31, c.H, generator=gen).bfloat16(), torch.randn(31, c.E, generator=gen)
    w, ids = c.route(logits)
    out = layer.forward(x, c.topk_output(w, ids, logits))
    return layer.atom_moe, out, x, w, ids, tensors, ref


def test_mxfp4_fp8_flag_runs_our_a8w4(runtime, mxfp4_act):
    """ATOM_MOE_MXFP4_ACT=fp8: SGLang's Mxfp4MoEMethod layer is converted once to a8w4's MX quads (SGLang's
    parameters freed) and returns our a8w4 twin's output bit for bit, on weights we read ourselves."""
    from dataclasses import replace

    from atom_moe.layouts.gate_up import GateUpKind, GateUpLayout
    from atom_moe.spec import Scheme

    mxfp4_act("fp8")
    state, out, x, w, ids, tensors, ref = _mxfp4_layer_run(30)
    assert state.plan.spec.scheme is Scheme.A8W4  # the scheme that ran ...
    assert state.plan.layout is GateUpLayout.INTERLEAVED  # SGLang's gate_up_interleaved (gpt-oss rows)
    assert state.weights.scheme is Scheme.A8W4 and state.weights.w13.kind is GateUpKind.MX_QUADS  # ... its layout
    assert state.weights.w13_rowexp is not None and state.weights.w2_rowexp is not None
    spec = c.a8w4_spec(c.E, c.H, c.K)
    c.assert_bitwise(out, c.our_mxfp4_twin(tensors, spec, x, w, ids))
    c.assert_matches(out, c.expected("a8w4", x, w, ids, ref))  # the fp32 oracle with a8w4's activation quant
    a16 = c.our_mxfp4_twin(tensors, replace(spec, scheme=Scheme.A16W4), x, w, ids)
    with pytest.raises(AssertionError, match="elements differ"):  # the bitwise check tells the schemes apart
        c.assert_bitwise(out, a16)


@pytest.mark.parametrize("plant", ["a16w4_ran", "gate_up_swap"])
def test_planted_bug_fails_the_a8w4_check(runtime, mxfp4_act, monkeypatch, plant):
    """The check above must catch a16w4 running where fp8 was asked, and gate/up rows mispaired at load."""
    from engine_common import plant_a8w4_bug

    from atom_moe.spec import Scheme

    plant_a8w4_bug(plant, mxfp4_act, monkeypatch, hooks)
    state, out, x, w, ids, tensors, _ = _mxfp4_layer_run(32)
    assert state.plan.spec.scheme is (Scheme.A16W4 if plant == "a16w4_ran" else Scheme.A8W4)
    with pytest.raises(AssertionError, match="elements differ"):
        c.assert_bitwise(out, c.our_mxfp4_twin(tensors, c.a8w4_spec(c.E, c.H, c.K), x, w, ids))


# ---------------------------------------------------------------- fused shared experts
def _shared_layer(scheme: str, salt: int, rsf: float | None):
    """A DeepSeek-style layer with SGLang's shared-expert fusion: E + 1 experts (the shared one is expert E), top_k
    K + 1, loaded through SGLang's loaders from a checkpoint whose expert E is the shared expert."""
    layer = c.build(scheme, num_experts=c.E + 1, num_fused_shared_experts=1, top_k=c.K + 1,
                    routed_scaling_factor=rsf)
    tensors, ref = c.checkpoint(scheme, _gen(salt), num_experts=c.E + 1)
    assert c.load(layer, scheme, tensors, num_experts=c.E + 1) > 0
    c.process(layer)
    return layer, ref


@pytest.mark.parametrize("scheme, kind, rsf", [("bf16", "biased", None), ("bf16", "biased", c.RSF),
                                               ("fp8", "biased", c.RSF), ("fp8", "grouped", c.RSF),
                                               ("mxfp4", "biased", c.RSF)])
def test_fused_shared_expert_runs_as_a_routed_one(runtime, scheme, kind, rsf):
    """SGLang's own grouped top-k appends the shared id E (weight exactly 1 or 1/rsf; or SGLang's renormalized
    1/rsf, per token); every element of 200 tokens against the routed experts plus the shared expert on its own."""
    layer, ref = _shared_layer(scheme, 20, rsf)
    spec = layer.atom_moe.plan.spec
    assert (spec.num_experts, spec.top_k, spec.shared_experts) == (c.E + 1, c.K + 1, 1)
    assert spec.local_experts == tuple(range(c.E + 1)) and layer.atom_moe.weights.num_local_experts == c.E + 1
    gen = _gen(21)
    T = 200
    x = torch.randn(T, c.H, generator=gen).bfloat16()
    logits = torch.randn(T, c.E, generator=gen)
    w, ids = c.shared_topk(kind, x, logits, rsf)
    assert (ids[:, -1] == c.E).all()
    shared_w = torch.full((T,), 1.0 if rsf is None else 1 / rsf)
    if kind == "biased":  # exactly SGLang's fused_shared_expert_weight
        assert torch.equal(w[:, -1], shared_w), "SGLang's shared weight changed: update the case"
    else:
        torch.testing.assert_close(w[:, -1], shared_w, rtol=1e-4, atol=0)
    out = layer.forward(x, c.topk_output(w, ids, logits))
    c.assert_matches(out, c.expected_shared(scheme, x, w, ids, ref, rsf))


def test_planted_shared_underweight_fails(runtime, monkeypatch):
    """The shared slot at 0.4x its weight (a planted bug in our routing hand-off) must fail the same check."""
    layer, ref = _shared_layer("fp8", 22, c.RSF)
    gen = _gen(23)
    x = torch.randn(200, c.H, generator=gen).bfloat16()
    logits = torch.randn(200, c.E, generator=gen)
    w, ids = c.shared_topk("biased", x, logits, c.RSF)
    real = hooks._routing

    def planted(topk_output):
        weights, topk_ids = real(topk_output)
        return torch.cat([weights[:, :-1], 0.4 * weights[:, -1:]], dim=1).contiguous(), topk_ids

    monkeypatch.setattr(hooks, "_routing", planted)
    with pytest.raises(AssertionError, match="elements off"):
        c.assert_matches(layer.forward(x, c.topk_output(w, ids, logits)), c.expected_shared("fp8", x, w, ids, ref,
                                                                                              c.RSF))


@pytest.mark.parametrize("mode, world", [("tp_ep_shared", 2), ("tp_ep_shared", 4), ("dp_ep_shared", 2),
                                         ("dp_ep_shared", 4)])
def test_fused_shared_expert_ranks(mode, world):
    """TP + EP (the shared expert on every rank, weight 1/(rsf x EP), SGLang all-reduces) and DP + EP with
    megamoe (SGLang's per-rank shared slots, MegaMoE): every rank's output element by element."""
    _run_ranks(mode, "fp8" if world == 2 else "bf16", world=world)


# ---------------------------------------------------------------- fallback and limits
def test_unsupported_layer_falls_back_with_one_warning(runtime, caplog):
    caplog.set_level(logging.WARNING, logger="sglang.atom_moe")
    layers = [c.build("bf16", params_dtype=torch.float16) for _ in range(2)]
    for layer in layers:
        names = [n for n, _ in layer.named_parameters()]
        c.process(layer)  # SGLang's own post-processing ran instead
        assert getattr(layer, "atom_moe", None) is None
        assert [n for n, _ in layer.named_parameters()] == names  # SGLang's weights kept
    msgs = [r.getMessage() for r in caplog.records if "keep SGLang's own path" in r.getMessage()]
    assert len(msgs) == 1 and "float16" in msgs[0], msgs


def test_chunked_prefill_too_large_names_largest_safe_value():
    """A fresh process whose --chunked-prefill-size passes int32 in the experts' workspace (H=7168)."""
    _run_ranks("limit", "bf16", world=1)


# ---------------------------------------------------------------- two ranks
@pytest.mark.parametrize("mode,scheme", [("tp_ep", "bf16"), ("tp_ep", "mxfp4"), ("dp_ep", "bf16"),
                                         ("dp_ep", "fp8"), ("dp_ep", "a8w4")])
def test_two_ranks(mode, scheme):
    _run_ranks(mode, scheme, world=2)


@pytest.mark.parametrize("mode", ["eplb", "eplb_dp"])
def test_eplb_two_ranks(mode):
    """SGLang's EPLB on (redundant experts, random placement): our path runs on the physical slots SGLang's
    top-k maps to, matches the reference, and stays correct after SGLang rearranges the experts mid-run."""
    _run_ranks(mode, "bf16", world=2)


def test_eplb_planted_bug_fails():
    """Our tensors hidden from SGLang's rearrangement (the planted bug): the forward after it must fail."""
    with pytest.raises(AssertionError, match="elements off"):
        _run_ranks("eplb_plant", "bf16", world=2)


@pytest.mark.parametrize("scheme", ["bf16", "a8w4"])
def test_dp_ep_decode_prefill_switch(scheme):
    """ATOM_MOE_DECODE_TOKENS=8: a decode and a prefill MegaMoE, the same weights; SGLang's DP-wide count
    picks the op on both ranks; outputs = the reference on both sides; differing views raise on both."""
    _run_ranks("dp_ep_switch", scheme, world=2)


def _run_ranks(mode: str, scheme: str, world: int) -> None:
    port = c.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATOM_USE_FLYDSL", "ATOM_FLYDSL"))}
    c.run_ranks(lambda r: [sys.executable, "-P", str(HERE / "sglang_worker.py"), mode, scheme, str(r), str(world),
                           str(port), str(SEED)], world, env=env)


# ---------------------------------------------------------------- SGLang's torch.compile paths
class _Block(torch.nn.Module):
    """A model-like module around one FusedMoE layer: router logits in, the layer's output out."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, logits):
        w, ids = c.route(logits)
        return self.layer.forward(x, c.topk_output(w, ids, logits))


@pytest.mark.parametrize("runner", ["cuda_graph_runner", "cpu_graph_runner"])
def test_sglang_torch_compile_runs_our_custom_op(runtime, runner, monkeypatch):
    """--enable-torch-compile: SGLang's own patch_model (decode graphs) compiles the model with our layer.

    cuda_graph_runner: sglang.srt.compilation.torch_compile_decoration (the GPU runners' helper; its
    default mode wants GPU autotuning, so SGLANG_TORCH_COMPILE_MODE=default here). cpu_graph_runner:
    SGLang's CPU backend (freezing on). The op must run (not be traced into) with no graph break.
    """
    from sglang.srt.distributed import get_tp_group

    from atom_moe import ops

    if runner == "cuda_graph_runner":
        from sglang.srt.compilation import torch_compile_decoration as helper
        monkeypatch.setenv("SGLANG_TORCH_COMPILE_MODE", "default")
    else:
        from sglang.srt.model_executor import cpu_graph_runner as helper
    layer, ref = _built("bf16", 20)
    c.process(layer)
    handle = layer.atom_moe.handle
    calls = []
    run = ops._bound[handle]
    monkeypatch.setitem(ops._bound, handle, lambda *a: calls.append(1) or run(*a))
    helper.set_torch_compile_config()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    gen = _gen(21)
    block = _Block(layer)
    T = 16
    with helper.patch_model(block, True, T, get_tp_group()) as forward:
        for _ in range(2):
            x = torch.randn(T, c.H, generator=gen).bfloat16()
            logits = torch.randn(T, c.E, generator=gen)
            out = forward(x, logits)
            w, ids = c.route(logits)
            c.assert_matches(out, c.expected("bf16", x, w, ids, ref))
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert not breaks, f"graph breaks: {breaks}"
    assert len(calls) == 2  # our op's body ran once per call: Dynamo did not trace into it
