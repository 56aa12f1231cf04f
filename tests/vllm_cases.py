"""The vLLM plugin against a real vLLM package, on the CPU (run by tests/test_vllm_plugin.py).

Runs inside an engine environment (scripts/engine_env.sh vllm VERSION) with
ATOM_USE_FLYDSL=1 and VLLM_TARGET_DEVICE=cpu: vLLM's own `load_general_plugins()` finds
and calls our entry point, `FusedMoEFactory` builds the layers, vLLM's weight loader
fills them from HF-style tensors, and vLLM's `MoERunner.forward` runs them. Outputs are
compared with atom_moe.reference on every element. Multi-rank cases run in
tests/vllm_worker.py processes brought up through vLLM's distributed init.
"""

from __future__ import annotations

import gc
import inspect
import itertools
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

assert os.environ.get("VLLM_TARGET_DEVICE") == "cpu", "run through tests/test_vllm_plugin.py"

import vllm  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.custom_op import op_registry_oot  # noqa: E402
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory  # noqa: E402
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts  # noqa: E402
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod  # noqa: E402
from vllm.model_executor.layers.quantization.fp8 import Fp8Config, Fp8MoEMethod  # noqa: E402
from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

from engine_common import (INTER, SCHEMES, a8w4_spec, activation_of, assert_bitwise, assert_matches,  # noqa: E402
                           free_port, hf_checkpoint, our_mxfp4_twin, run_ranks)
from atom_moe.layouts.gate_up import GateUpKind, GateUpLayout  # noqa: E402
from atom_moe.reference import ReferenceWeights, reference_moe  # noqa: E402
from atom_moe.spec import Activation, ActivationKind, MoESpec, Scheme  # noqa: E402

HERE = Path(__file__).resolve().parent
E, K, H = 8, 2, 256
# intermediate size per scheme (engine_common.INTER): vLLM refines fp8 block scales when I is
# not a multiple of 128 (a fallback case below); MXFP4 needs multiples of 32
_names = itertools.count()


# ---------------------------------------------------------------- process set-up
# Small checkpoint configs (config.json only): vLLM's ModelConfig reads them offline and
# builds the quant config (Fp8Config, GptOssMxfp4Config) itself, as for a real checkpoint.
_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": H,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": E,
            "num_experts_per_tok": K, "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "torch_dtype": "bfloat16"}
CHECKPOINTS = {
    "bf16": dict(_MIXTRAL, intermediate_size=INTER["bf16"]),
    "fp8": dict(_MIXTRAL, intermediate_size=INTER["fp8"], quantization_config={
        "quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}),
    "mxfp4": {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": H,
              "intermediate_size": INTER["mxfp4"], "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "num_local_experts": E, "num_experts_per_tok": K,
              "vocab_size": 512, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "sliding_window": 128,
              "layer_types": ["full_attention"], "rope_theta": 150000, "torch_dtype": "bfloat16",
              "rope_scaling": {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "rope_type": "yarn",
                               "original_max_position_embeddings": 4096},
              "quantization_config": {"quant_method": "mxfp4"}},
    # DeepSeek-V4 with fp4 experts: vLLM's DeepseekV4FP8Config builds the generic Mxfp4MoEMethod for them
    "dsv4": {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": H,
             "moe_intermediate_size": INTER["mxfp4"], "n_routed_experts": E, "num_experts_per_tok": K,
             "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 512, "swiglu_limit": 10.0,
             "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "topk_method": "noaux_tc",
             "torch_dtype": "bfloat16", "expert_dtype": "fp4",
             "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                     "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}},
}
V4_LIMIT = 10.0  # DeepSeek-V4's swiglu_limit (its config above)


def vllm_config(scheme: str, tmp: Path, **kwargs) -> VllmConfig:
    """A VllmConfig for a small checkpoint of this scheme (config.json written under tmp)."""
    import json

    from vllm.config import ModelConfig

    folder = tmp / f"ckpt-{scheme}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(CHECKPOINTS[scheme]))
    model = ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16")
    return VllmConfig(model_config=model, **kwargs)


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    """One vLLM config per scheme, and a 1-rank gloo world (vLLM's own init) for the module."""
    load_general_plugins()  # vLLM's plugin loader: must find and call our entry point
    tmp = tmp_path_factory.mktemp("ckpt")
    out = {s: vllm_config(s, tmp) for s in (*SCHEMES, "dsv4")}
    with set_current_vllm_config(out["bf16"]):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{free_port()}", 0, backend="gloo")
        initialize_model_parallel(1, 1)
    return out


# ---------------------------------------------------------------- checkpoint-form layers
def hf_tensors(scheme: str, gen: torch.Generator, num_experts: int = E) -> tuple[dict, ReferenceWeights]:
    """Random checkpoint tensors in the HF naming of the scheme (keys as RoutedExperts loads them)."""
    return hf_checkpoint(scheme, gen, num_experts, H)


def build(scheme: str, cfg: VllmConfig, **overrides):
    """FusedMoEFactory(...) as the model would call it for this checkpoint (gpt-oss style for MXFP4)."""
    mx = scheme == "mxfp4"
    kwargs = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER.get(scheme, INTER["mxfp4"]),
                  params_dtype=torch.bfloat16, quant_config=cfg.quant_config,
                  prefix=f"model.layers.{next(_names)}.mlp.experts", has_bias=mx,
                  activation="swigluoai" if mx else "silu", renormalize=True)
    kwargs.update(overrides)
    with set_current_vllm_config(cfg):
        return FusedMoEFactory(**kwargs)


def load(runner, scheme: str, tensors: dict, ep_range: tuple[int, int] | None = None) -> None:
    """Feed the tensors through vLLM's own weight loader, as the model's load_weights does."""
    experts = runner.routed_experts
    if scheme != "mxfp4":
        names = list(runner.load_weights(iter(tensors.items())))  # RoutedExperts.load_weights: the expert mapping
        assert names, "vLLM's loader took none of the tensors"
        return
    # gpt-oss (GptOssModel._load_weights_mxfp4): flatten blocks, slice this EP rank's experts, load whole
    lo, hi = ep_range or (0, E)
    for param_name, key in (("w13_weight", "gate_up_proj_blocks"), ("w2_weight", "down_proj_blocks"),
                            ("w13_weight_scale", "gate_up_proj_scales"), ("w2_weight_scale", "down_proj_scales"),
                            ("w13_bias", "gate_up_proj_bias"), ("w2_bias", "down_proj_bias")):
        t = tensors[key]
        if t.dim() == 4:
            t = t.flatten(-2)
        param = getattr(experts, param_name)
        param.weight_loader(param, t[lo:hi], weight_name=f"{experts.layer_name}.{param_name}", shard_id=None,
                            expert_id=None)


def process(runner) -> None:
    """What vLLM's model loader does after loading: the quant method's post-processing."""
    runner.routed_experts.quant_method.process_weights_after_loading(runner.routed_experts)


def process_and_check_freed(runner, experts, count: int) -> None:
    """Process the loaded weights and check vLLM's `count` original expert tensors are freed and unregistered."""
    originals = [weakref.ref(p) for n, p in experts.named_parameters() if n.startswith(("w13", "w2"))]
    assert len(originals) == count, f"{len(originals)} original expert tensors, expected {count}"
    process(runner)
    gc.collect()
    assert all(r() is None for r in originals), "vLLM's original expert weights are still alive"
    assert not [n for n, _ in experts.named_parameters() if n.startswith(("w13", "w2"))]


def spy_apply(monkeypatch) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Record (x, topk_weights, topk_ids) of every AtomMoEMethod.apply call (vLLM passes them by name or position)."""
    from atom_moe.plugins.vllm import method as m
    given = []
    real = m.AtomMoEMethod.apply

    def spy(self, *args, **kwargs):
        bound = inspect.signature(real).bind(self, *args, **kwargs).arguments
        given.append((bound["x"], bound["topk_weights"], bound["topk_ids"]))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(m.AtomMoEMethod, "apply", spy)
    return given


def route(logits: torch.Tensor, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k with renormalization (vLLM's default router), computed independently."""
    w, ids = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids


def expected(scheme: str, x, logits, ref: ReferenceWeights, experts=None) -> torch.Tensor:
    """The fp32 reference, with the scheme's activation quant (fp8; "a8w4": the MXFP4 layer on fp8 activations)."""
    w, ids = route(logits)
    return reference_moe(x, w, ids, ref, activation_of(scheme), experts=experts,
                         act_quant={"fp8": Scheme.FP8, "a8w4": Scheme.A8W4}.get(scheme))


def forward(cfg, runner, x, logits):
    with set_forward_context(None, cfg):
        return runner.forward(x, logits)


# ---------------------------------------------------------------- registration
def test_entry_point_discovered_and_called_by_vllm(configs):
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "atom_moe"]
    assert [ep.value for ep in eps] == ["atom_moe.plugins.vllm:register"]
    from atom_moe.plugins.vllm.method import AtomRoutedExperts

    assert op_registry_oot.get("RoutedExperts") is AtomRoutedExperts  # put there by load_general_plugins()


def test_register_is_idempotent(configs, caplog):
    import atom_moe.plugins.vllm as plugin
    from atom_moe.plugins.vllm.method import AtomRoutedExperts

    with caplog.at_level(logging.INFO, logger="vllm.atom_moe"):
        plugin.register()
        plugin.register()
    assert op_registry_oot.get("RoutedExperts") is AtomRoutedExperts
    assert not [r for r in caplog.records if "active in vLLM" in r.getMessage()], "start-up line logged twice"


def _run_snippet(code: str, env_update: dict) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ATOM_")}
    env.update(env_update)
    proc = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


SNIPPET = r"""
import torch, socket
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.layers.fused_moe.layer import FusedMoEFactory
from vllm.plugins import load_general_plugins
load_general_plugins()
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
with set_current_vllm_config(VllmConfig()):
    init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
    initialize_model_parallel(1, 1)
    r = FusedMoEFactory(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128,
                        params_dtype=torch.bfloat16, prefix="m.experts")
    print("TYPES", type(r.routed_experts).__module__, type(r.routed_experts).__name__,
          type(r.routed_experts.quant_method).__name__)
"""


def test_flag_off_gives_vllms_own_classes():
    out = _run_snippet(SNIPPET, {})
    assert "TYPES vllm.model_executor.layers.fused_moe.routed_experts RoutedExperts UnquantizedFusedMoEMethod" in out
    assert "atom_moe" not in out  # no start-up line, no warning: nothing changed


_MX = "mxfp4 (gpt-oss; DeepSeek-V4 and other Mxfp4MoEMethod layers)"


@pytest.mark.parametrize("act, shown", [(None, f"{_MX} as a16w4 (ATOM_MOE_MXFP4_ACT=bf16)"),
                                         ("fp8", f"{_MX} as a8w4 (ATOM_MOE_MXFP4_ACT=fp8)")])
def test_flag_on_logs_one_startup_line_per_process(act, shown):
    out = _run_snippet(SNIPPET, {"ATOM_USE_FLYDSL": "1"} | ({"ATOM_MOE_MXFP4_ACT": act} if act else {}))
    assert "TYPES atom_moe.plugins.vllm.method AtomRoutedExperts AtomMoEMethod" in out
    lines = [line for line in out.splitlines() if "active in vLLM" in line]
    assert len(lines) == 1, out
    assert f"vLLM {vllm.__version__}" in lines[0] and "ATOM_USE_FLYDSL=1" in lines[0] and "torch" in lines[0]
    assert shown in lines[0], lines[0]


def test_bad_flag_value_is_a_clear_error():
    proc = subprocess.run([sys.executable, "-P", "-c", "from vllm.plugins import load_general_plugins; load_general_plugins()"],
                          env={**os.environ, "ATOM_USE_FLYDSL": "maybe"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "ATOM_USE_FLYDSL='maybe' is not a boolean" in proc.stderr
    code = "from vllm.plugins import load_general_plugins; load_general_plugins()"
    proc = subprocess.run([sys.executable, "-P", "-c", code], env={**os.environ, "ATOM_MOE_MXFP4_ACT": "int4"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert "ATOM_MOE_MXFP4_ACT='int4'; allowed: bf16 (a16w4), fp8 (a8w4)" in proc.stderr


# ---------------------------------------------------------------- construction, loading, forward
@pytest.mark.parametrize("scheme", SCHEMES)
def test_factory_builds_our_method(configs, scheme):
    from atom_moe.plugins.vllm.method import AtomMoEMethod, AtomRoutedExperts

    runner = build(scheme, configs[scheme])
    method = runner.routed_experts.quant_method
    assert isinstance(runner.routed_experts, AtomRoutedExperts)
    assert isinstance(method, AtomMoEMethod)
    assert method.plan.spec.scheme is {"bf16": Scheme.BF16, "fp8": Scheme.FP8, "mxfp4": Scheme.A16W4}[scheme]
    assert method.plan.layout is (GateUpLayout.INTERLEAVED if scheme == "mxfp4" else GateUpLayout.SEPARATED)
    assert method.plan.spec.local_experts == tuple(range(E))
    assert not method.is_monolithic and not method.plan.fused
    # vLLM's own parameters exist for its loader (unpadded: our method does not round MXFP4 sizes up)
    w13 = runner.routed_experts.w13_weight
    I = INTER[scheme]
    assert tuple(w13.shape) == ((E, 2 * I, H // 2) if scheme == "mxfp4" else (E, 2 * I, H))


@pytest.mark.parametrize("scheme", SCHEMES)
def test_weights_load_release_and_forward(configs, scheme, seed):
    cfg = configs[scheme]
    gen = torch.Generator().manual_seed(seed)
    runner = build(scheme, cfg)
    tensors, ref = hf_tensors(scheme, gen)
    load(runner, scheme, tensors)
    experts = runner.routed_experts
    process_and_check_freed(runner, experts, 6 if scheme == "mxfp4" else 4 if scheme == "fp8" else 2)
    prepared = experts.atom_moe_weights
    assert prepared is experts.quant_method.weights
    assert prepared.w13.layout is GateUpLayout.INTERLEAVED and prepared.num_local_experts == E
    assert prepared.w13.kind is (GateUpKind.MX_TILES if scheme == "mxfp4" else GateUpKind.ROWS)  # no plain MXFP4 kept
    x = torch.randn(37, H, generator=gen).bfloat16()
    logits = torch.randn(37, E, generator=gen)
    out = forward(cfg, runner, x, logits)
    assert out.dtype == torch.bfloat16
    assert_matches(out, expected(scheme, x, logits, ref))


# ---------------------------------------------------------------- MXFP4 as a8w4 (ATOM_MOE_MXFP4_ACT=fp8)
@pytest.fixture
def mxfp4_act():
    """Set ATOM_MOE_MXFP4_ACT and let the entry point read the flags again; bf16 (unset) again afterwards."""
    import atom_moe.plugins.vllm as plugin

    def use(value: str) -> None:
        os.environ["ATOM_MOE_MXFP4_ACT"] = value
        plugin.register()  # install() takes the new flags; the layers built next see them

    yield use
    os.environ.pop("ATOM_MOE_MXFP4_ACT", None)
    plugin.register()


def _mxfp4_layer_run(cfg, seed: int, monkeypatch):
    """A gpt-oss style layer through vLLM's factory, loader and runner: (method, out, what it was given, tensors, ref).

    What it was given is the (x, topk_weights, topk_ids) vLLM's router handed our apply, so our own
    a8w4 twin can be run on exactly the same routing.
    """
    gen = torch.Generator().manual_seed(seed)
    runner = build("mxfp4", cfg)
    tensors, ref = hf_tensors("mxfp4", gen)
    load(runner, "mxfp4", tensors)
    experts = runner.routed_experts
    process_and_check_freed(runner, experts, 6)  # blocks, scales, biases of w13 and w2
    given = spy_apply(monkeypatch)
    x, logits = torch.randn(37, H, generator=gen).bfloat16(), torch.randn(37, E, generator=gen)
    out = forward(cfg, runner, x, logits)
    assert len(given) == 1
    w, ids = route(logits)  # vLLM's router picked what an independent softmax top-k picks
    assert torch.equal(given[0][2].long(), ids) and torch.allclose(given[0][1].float(), w)
    return experts.quant_method, out, given[0], tensors, ref, (x, logits)


def test_mxfp4_fp8_flag_runs_our_a8w4(configs, seed, mxfp4_act, monkeypatch):
    """ATOM_MOE_MXFP4_ACT=fp8: the gpt-oss layer is converted once to a8w4's MX quads (vLLM's originals
    freed) and its output is our a8w4 twin's, bit for bit, on weights we read from the checkpoint ourselves."""
    from dataclasses import replace

    mxfp4_act("fp8")
    method, out, (x, w, ids), tensors, ref, (x0, logits) = _mxfp4_layer_run(configs["mxfp4"], seed, monkeypatch)
    assert method.plan.spec.scheme is Scheme.A8W4  # the scheme that ran ...
    assert method.plan.layout is GateUpLayout.INTERLEAVED  # vLLM's swigluoai rows: gpt-oss pairs
    prepared = method.weights
    assert prepared.scheme is Scheme.A8W4 and prepared.w13.kind is GateUpKind.MX_QUADS  # ... in its layout
    assert prepared.w13_rowexp is not None and prepared.w2_rowexp is not None
    spec = a8w4_spec(E, H, K)
    assert_bitwise(out, our_mxfp4_twin(tensors, spec, x, w, ids))
    # the fp32 oracle on the checkpoint's separated weights, with a8w4's activation quant
    assert_matches(out, reference_moe(x0, *route(logits), ref, activation_of("mxfp4"), act_quant=Scheme.A8W4))
    # and a16w4 on the same weights is another result: the bitwise check tells the schemes apart
    a16 = our_mxfp4_twin(tensors, replace(spec, scheme=Scheme.A16W4), x, w, ids)
    with pytest.raises(AssertionError, match="elements differ"):
        assert_bitwise(out, a16)


@pytest.mark.parametrize("plant", ["a16w4_ran", "gate_up_swap"])
def test_planted_bug_fails_the_a8w4_check(configs, seed, mxfp4_act, monkeypatch, plant):
    """The check above must catch a16w4 running where fp8 was asked, and gate/up rows mispaired at load."""
    from engine_common import plant_a8w4_bug

    from atom_moe.plugins.vllm import method as m

    plant_a8w4_bug(plant, mxfp4_act, monkeypatch, m)
    method, out, (x, w, ids), tensors, _, _ = _mxfp4_layer_run(configs["mxfp4"], seed, monkeypatch)
    assert method.plan.spec.scheme is (Scheme.A16W4 if plant == "a16w4_ran" else Scheme.A8W4)
    with pytest.raises(AssertionError, match="elements differ"):
        assert_bitwise(out, our_mxfp4_twin(tensors, a8w4_spec(E, H, K), x, w, ids))


# ---------------------------------------------------------------- DeepSeek-V4: Mxfp4MoEMethod, clamped SiLU
def v4_checkpoint(gen: torch.Generator, std: float) -> tuple[dict, ReferenceWeights]:
    """DeepSeek-V4 style per-expert MXFP4 tensors (`{e}.w1/w2/w3.weight` packed e2m1, `.weight_scale` e8m0)
    and their fp32 reference, dequantized here from the same bytes (no code of the plugin's).

    gate and up ~ N(0, std^2) per unit input, so most of them pass swiglu_limit on either side.
    """
    from atom_moe import formats

    I = INTER["mxfp4"]
    gate, up = (torch.randn(E, I, H, generator=gen) * (std / H ** 0.5) for _ in range(2))
    down = torch.randn(E, H, I, generator=gen) / I ** 0.5
    tensors, full = {}, {}
    for name, w in (("w1", gate), ("w3", up), ("w2", down)):
        q, s = formats.quantize_mxfp4(w)
        full[name] = formats.dequantize_mxfp4(q, s)
        for e in range(E):  # e8m0 as the checkpoint stores it: vLLM's scale loader turns it into bytes
            tensors[f"{e}.{name}.weight"] = q[e]
            tensors[f"{e}.{name}.weight_scale"] = s[e].view(torch.float8_e8m0fnu)
    return tensors, ReferenceWeights(full["w1"], full["w3"], full["w2"], tuple(range(E)))


def build_v4(cfg: VllmConfig, **overrides):
    """FusedMoEFactory as DeepseekV4MoE._init_fused_moe_experts calls it (w1/w2/w3 names, the limit)."""
    kwargs = dict(ckpt_names=("w1", "w2", "w3"), swiglu_limit=V4_LIMIT, intermediate_size=INTER["mxfp4"])
    return build("dsv4", cfg, **(kwargs | overrides))


def _v4_layer_run(cfg, seed: int, monkeypatch, std: float = 30.0):
    """A DeepSeek-V4 layer through vLLM's factory, loader and runner: (method, out, (x, w, ids) given to apply, ref)."""
    gen = torch.Generator().manual_seed(seed)
    runner = build_v4(cfg)
    tensors, ref = v4_checkpoint(gen, std)
    names = list(runner.load_weights(iter(tensors.items())))
    assert len(names) == len(tensors), f"vLLM's loader took {len(names)} of {len(tensors)} tensors"
    experts = runner.routed_experts
    process_and_check_freed(runner, experts, 4)  # weights and scales of w13 and w2
    given = spy_apply(monkeypatch)
    x, logits = torch.randn(64, H, generator=gen).bfloat16(), torch.randn(64, E, generator=gen)
    out = forward(cfg, runner, x, logits)
    assert len(given) == 1
    return experts.quant_method, out, given[0], ref


def v4_expected(x, w, ids, ref, scheme: Scheme, activation=None) -> torch.Tensor:
    """The fp32 reference of the V4 layer (clamped SiLU unless `activation`), with a8w4's activation quant."""
    act = activation or Activation(ActivationKind.SWIGLU_CLAMP, limit=V4_LIMIT)
    return reference_moe(x, w, ids, ref, act, act_quant=Scheme.A8W4 if scheme is Scheme.A8W4 else None)


@pytest.mark.parametrize("act", ["bf16", "fp8"])
def test_deepseek_v4_mxfp4_layer_runs_ours(configs, seed, mxfp4_act, monkeypatch, act):
    """DeepSeek-V4's fp4 experts (vLLM's Mxfp4MoEMethod, taken weights-only on the CPU) run as our a16w4 or
    a8w4 with the clamped SiLU at swiglu_limit; gate/up SEPARATED as vLLM's loader fills w13; every element
    equals the fp32 reference on the checkpoint's own bytes, and the clamp is live (the unclamped layer is not)."""
    from vllm.model_executor.layers.quantization.mxfp4 import Mxfp4MoEMethod

    from atom_moe.plugins.vllm.method import AtomMoEMethod

    mxfp4_act(act)
    method, out, (x, w, ids), ref = _v4_layer_run(configs["dsv4"], seed, monkeypatch)
    assert isinstance(method, AtomMoEMethod) and type(method.inner) is Mxfp4MoEMethod
    scheme = Scheme.A8W4 if act == "fp8" else Scheme.A16W4
    spec = method.plan.spec
    assert spec.scheme is scheme and spec.activation == Activation(ActivationKind.SWIGLU_CLAMP, limit=V4_LIMIT)
    assert method.plan.layout is GateUpLayout.SEPARATED and not spec.has_bias
    assert method.weights.w13.kind is (GateUpKind.MX_QUADS if act == "fp8" else GateUpKind.MX_TILES)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert_matches(out, v4_expected(x, w, ids, ref, scheme))
    with pytest.raises(AssertionError, match="elements off"):  # the data make the clamp decide the result
        assert_matches(out, v4_expected(x, w, ids, ref, scheme, Activation()))


@pytest.mark.parametrize("plant", ["clamp_ignored", "gate_up_swap"])
def test_deepseek_v4_planted_bug_fails(configs, seed, mxfp4_act, monkeypatch, plant):
    """The check above must catch the clamp dropped (plain SiLU) and w13's halves read as interleaved pairs."""
    from dataclasses import replace

    from atom_moe.plugins.vllm import method as m

    mxfp4_act("bf16")
    real = m.plan_layer

    def planted(*args):
        plan = real(*args)
        if plant == "clamp_ignored":
            return replace(plan, spec=replace(plan.spec, activation=Activation()))
        return replace(plan, layout=GateUpLayout.INTERLEAVED)

    monkeypatch.setattr(m, "plan_layer", planted)
    method, out, (x, w, ids), ref = _v4_layer_run(configs["dsv4"], seed, monkeypatch)
    with pytest.raises(AssertionError, match="elements off"):
        assert_matches(out, v4_expected(x, w, ids, ref, Scheme.A16W4))


def build_keeps_vllms_method(build_layer):
    """Build a layer our plugin declines: vLLM's own method, or vLLM's own no-kernel error where it has none.

    Whether vLLM finds an MXFP4 kernel on a CPU depends on what its environment resolved (a fresh
    vLLM 0.30.0 env of 2026-12-02 found one where an older build raised "No MXFP4 MoE backend").
    """
    from atom_moe.plugins.vllm.method import AtomMoEMethod

    try:
        runner = build_layer()
    except NotImplementedError as exc:
        assert "No MXFP4 MoE backend" in str(exc), exc
        return
    method = runner.routed_experts.quant_method
    assert not isinstance(method, AtomMoEMethod), method


def test_generic_mxfp4_swigluoai_keeps_vllms_path(configs, monkeypatch):
    """swigluoai on the generic Mxfp4MoEMethod: its gate/up rows depend on the model's loader, so not ours (vLLM's
    own method, or its own no-kernel error on a CPU where it has none)."""
    from atom_moe.plugins.vllm import method as m

    plans = []
    real = m.plan_layer
    monkeypatch.setattr(m, "plan_layer", lambda *a: plans.append(real(*a)) or plans[-1])
    build_keeps_vllms_method(lambda: build_v4(configs["dsv4"], activation="swigluoai", swiglu_limit=None))
    assert len(plans) == 1 and "swigluoai on the generic Mxfp4MoEMethod" in plans[0], plans


def test_silu_limit_zero_keeps_vllms_path(configs, caplog):
    """swiglu_limit=0 means no clamp to vLLM's Triton kernels and a clamp at 0 to its CUDA op: not ours to pick.
    A bf16 layer falls back with one warning; the V4 MXFP4 layer keeps vLLM's method (or vLLM's own no-kernel
    error, unchanged, where it has no CPU kernel)."""
    from atom_moe.plugins import common

    common._warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.atom_moe"):
        runner = build("bf16", configs["bf16"], swiglu_limit=0.0)
    assert type(runner.routed_experts.quant_method) is UnquantizedFusedMoEMethod
    warnings = [r.getMessage() for r in caplog.records if "keep vLLM's own path" in r.getMessage()]
    assert len(warnings) == 1 and "silu with swiglu_limit=0.0" in warnings[0], warnings
    build_keeps_vllms_method(lambda: build_v4(configs["dsv4"], swiglu_limit=0.0))


def test_forward_runs_our_apply_when_custom_ops_are_off(configs, seed, monkeypatch):
    """Under Inductor vLLM disables CustomOps (forward_native); our apply must still be what runs."""
    from vllm.config import CompilationConfig

    from atom_moe.plugins.vllm import method as m

    calls = []
    real = m.AtomMoEMethod.apply
    monkeypatch.setattr(m.AtomMoEMethod, "apply", lambda self, *a, **kw: calls.append(1) or real(self, *a, **kw))
    inductor = VllmConfig(compilation_config=CompilationConfig(custom_ops=["none"]))
    gen = torch.Generator().manual_seed(seed)
    with set_current_vllm_config(inductor):
        runner = build("bf16", inductor)
        assert not UnquantizedFusedMoEMethod.enabled()  # vLLM's own method would take forward_native here
        tensors, ref = hf_tensors("bf16", gen)
        load(runner, "bf16", tensors)
        process(runner)
        x, logits = torch.randn(9, H, generator=gen).bfloat16(), torch.randn(9, E, generator=gen)
        out = forward(inductor, runner, x, logits)
    assert calls == [1]
    assert_matches(out, expected("bf16", x, logits, ref))


def test_degenerate_dummy_routing(configs, seed):
    """vLLM's dummy/profile runs repeat one token: every token goes to the same experts."""
    cfg = configs["fp8"]
    gen = torch.Generator().manual_seed(seed)
    runner = build("fp8", cfg)
    tensors, ref = hf_tensors("fp8", gen)
    load(runner, "fp8", tensors)
    process(runner)
    x = torch.randn(1, H, generator=gen).bfloat16().expand(64, H).contiguous()
    logits = torch.randn(1, E, generator=gen).expand(64, E).contiguous()
    out = forward(cfg, runner, x, logits)
    assert_matches(out, expected("fp8", x, logits, ref))


# ---------------------------------------------------------------- fused shared experts (one shared expert, id E)
RSF = 2.5  # DeepSeek-V3's routed_scaling_factor


def _torch_topk_sigmoid(topk_weights, topk_ids, token_expert_indices, gating_output, renormalize, bias,
                        routed_scaling_factor=1.0):
    """vLLM's topk_sigmoid (a CUDA op) in torch, for the CPU: biased choice, unbiased weights, then the factor."""
    scores = gating_output.float().sigmoid()
    ids = (scores + bias.float()).topk(topk_weights.shape[1], dim=-1).indices
    w = scores.gather(1, ids)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    topk_weights.copy_(w * routed_scaling_factor)
    topk_ids.copy_(ids)
    return topk_weights, topk_ids


def shared_runner(scheme: str, cfg: VllmConfig, monkeypatch, scale_on_output: bool):
    """A DeepSeek-style layer with vLLM's shared-expert fusion (ROCm AITER's, here on the CPU).

    vLLM fuses only where AITER asks for it; its one CUDA-only step at construction is AITER's
    routing buffer, which the bias router (shared_routing) does not use, so it is skipped here.
    """
    import vllm.model_executor.layers.fused_moe.expert_map_manager as emm

    monkeypatch.setattr(emm, "init_aiter_topK_meta_data", lambda **kw: None)
    return build(scheme, cfg, n_shared_experts=1, fuse_shared_experts=True, scoring_func="sigmoid",
                 e_score_correction_bias=torch.zeros(E), routed_scaling_factor=RSF,
                 apply_routed_scale_to_output=scale_on_output)


def shared_routing(x, logits, scale_on_output: bool, monkeypatch):
    """(topk_weights, topk_ids) from vLLM's FusedTopKBiasRouter: K routed slots, then the shared id E.

    The router FusedMoEFactory builds on a GPU for this layer (on the CPU it builds CPURouter, which
    fuses no shared expert), with the factory's arguments: the routed weights scaled by the factor,
    the shared slot 1; or, when the runner scales the output, routed unscaled and the shared slot
    1/factor. Its CUDA top-k is replaced by a torch one; appending the shared slot is vLLM's code.
    """
    import vllm.model_executor.layers.fused_moe.router.fused_topk_bias_router as bias_router

    monkeypatch.setattr(bias_router, "vllm_topk_sigmoid", _torch_topk_sigmoid)
    router = bias_router.FusedTopKBiasRouter(
        top_k=K, global_num_experts=E, e_score_correction_bias=torch.zeros(E), renormalize=True,
        routed_scaling_factor=1.0 if scale_on_output else RSF, scoring_func="sigmoid", num_fused_shared_experts=1,
        shared_expert_weight=1 / RSF if scale_on_output else 1.0)
    w, ids = router._compute_routing(x, logits, torch.int32)
    assert (ids[:, -1] == E).all() and ids.shape[1] == K + 1
    return w.contiguous(), ids.contiguous()


def expected_shared(scheme: str, x, w, ids, ref) -> torch.Tensor:
    """The routed experts on the first K slots plus the shared expert on its own, at the weights vLLM gave."""
    from shared_common import split_reference

    return split_reference(ref, activation_of(scheme), x, w, ids, E, 1, {"fp8": Scheme.FP8}.get(scheme))


@pytest.mark.parametrize("scheme, scale_on_output", [("bf16", False), ("bf16", True), ("fp8", False),
                                                     ("fp8", True)])
def test_fused_shared_expert_runs_as_a_routed_one(configs, seed, monkeypatch, scheme, scale_on_output):
    """E + 1 experts, K + 1 slots; the shared weight exactly 1.0 or 1/rsf; 200 tokens, every element."""
    from atom_moe.plugins.vllm.method import AtomMoEMethod

    cfg = configs[scheme]
    runner = shared_runner(scheme, cfg, monkeypatch, scale_on_output)
    experts = runner.routed_experts
    method = experts.quant_method
    assert isinstance(method, AtomMoEMethod), type(method)
    spec = method.plan.spec
    assert (spec.num_experts, spec.top_k, spec.shared_experts) == (E + 1, K + 1, 1)
    gen = torch.Generator().manual_seed(seed)
    tensors, ref = hf_tensors(scheme, gen, num_experts=E + 1)  # expert E: the shared one (mlp.experts.E)
    load(runner, scheme, tensors)
    process(runner)
    assert experts.atom_moe_weights.num_local_experts == E + 1
    x = torch.randn(200, H, generator=gen).bfloat16()
    logits = torch.randn(200, E, generator=gen)
    w, ids = shared_routing(x, logits, scale_on_output, monkeypatch)
    assert torch.equal(w[:, -1], torch.full((200,), 1 / RSF if scale_on_output else 1.0))
    want = expected_shared(scheme, x, w, ids, ref)
    assert_matches(method.apply(experts, x, w, ids), want)
    planted = torch.cat([w[:, :-1], 0.4 * w[:, -1:]], dim=1).contiguous()  # the shared slot under-weighted
    with pytest.raises(AssertionError, match="elements off"):
        assert_matches(method.apply(experts, x, planted, ids), want)


@pytest.mark.parametrize("world", [2, 4])
def test_fused_shared_expert_tp_ranks(seed, world):
    """TP 2 and 4 (no EP): every rank holds every expert's I/TP shard, the shared one included; vLLM all-reduces."""
    _launch("tp_shared", "bf16", seed, world=world)


def test_fused_shared_expert_with_ep_keeps_vllms_path(seed):
    """EP 2: vLLM's map holds the shared expert only under AITER (and AITER's EP routing masks it by token
    round robin), so the plugin leaves the layer to vLLM with one warning naming why."""
    _launch("ep_shared", "bf16", seed, world=2)


# ---------------------------------------------------------------- fallbacks
@pytest.mark.parametrize("overrides, reason", [
    (dict(activation="gelu"), "activation gelu"),
    (dict(apply_router_weight_on_input=True, top_k=1), "apply_router_weight_on_input=True"),
    (dict(params_dtype=torch.float16), "unquantized weights in torch.float16"),
])
def test_unsupported_layer_falls_back_with_one_warning(configs, caplog, overrides, reason):
    from atom_moe.plugins import common

    common._warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.atom_moe"):
        first, second = build("bf16", configs["bf16"], **overrides), build("bf16", configs["bf16"], **overrides)
    for runner in (first, second):
        assert type(runner.routed_experts.quant_method) is UnquantizedFusedMoEMethod
    warnings = [r.getMessage() for r in caplog.records if "keep vLLM's own path" in r.getMessage()]
    assert len(warnings) == 1 and reason in warnings[0], warnings


@pytest.mark.parametrize("overrides, reason", [
    (dict(quant_config=Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                                 weight_block_size=[64, 64])), "weight_block_size=[64, 64]"),
    (dict(intermediate_size=192), "refined below 128"),  # vLLM upsamples the scales of a partial block
])
def test_unsupported_fp8_falls_back(configs, caplog, overrides, reason):
    from atom_moe.plugins import common

    common._warned.clear()
    with caplog.at_level(logging.WARNING, logger="vllm.atom_moe"):
        runner = build("fp8", configs["fp8"], **overrides)
    assert type(runner.routed_experts.quant_method) is Fp8MoEMethod
    assert any(reason in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------- two ranks
def _launch(mode: str, scheme: str, seed: int, world: int = 2) -> list[str]:
    port = free_port()
    return run_ranks(lambda rank: [sys.executable, str(HERE / "vllm_worker.py"), mode, scheme, str(rank), str(world),
                                   str(port), str(seed)], world)


@pytest.mark.parametrize("scheme", SCHEMES)
def test_tp_ep_two_ranks(scheme, seed):
    """TP=2 with EP: every rank sees every token, computes its experts' share; vLLM all-reduces."""
    _launch("tp_ep", scheme, seed)


@pytest.mark.parametrize("scheme", ["bf16", "mxfp4", "a8w4", "dsv4_a8w4"])
def test_dp_ep_fused_two_ranks(scheme, seed):
    """DP=2 attention + EP=2 with ATOM_USE_FLYDSL_FUSED=1: MegaMoE dispatches; vLLM must not.

    a8w4: the gpt-oss layer with ATOM_MOE_MXFP4_ACT=fp8 (MegaMoE on a8w4 weights); dsv4_a8w4: DeepSeek-V4's
    fp4 experts (Mxfp4MoEMethod, clamped SiLU) the same way, the seed recipe's V4-Pro a8w4 fused layer."""
    _launch("dp_ep", scheme, seed)


@pytest.mark.parametrize("mode", ["eplb", "eplb_dp"])
def test_eplb_two_ranks(mode, seed):
    """vLLM's EPLB on (2 redundant experts), TP+EP or DP+EP fused: our path runs on the physical slots vLLM's
    router maps to, vLLM's load counters fill, and vLLM's own rearrangement mid-run moves our tensors."""
    _launch(mode, "bf16", seed)


def test_eplb_planted_bug_fails(seed):
    """vLLM's rearrangement handed tensors that are not ours (the planted bug): the forward after it fails."""
    with pytest.raises(AssertionError, match="elements off"):
        _launch("eplb_plant", "bf16", seed)


@pytest.mark.parametrize("scheme", ["bf16", "a8w4"])
def test_dp_ep_decode_prefill_switch(scheme, seed):
    """DP=2 + EP=2 fused with ATOM_MOE_DECODE_TOKENS=8: a decode and a prefill MegaMoE per layer shape, the
    same weights; vLLM's DP-wide count picks the op on both ranks; outputs = the reference on both sides;
    ranks with differing views of the counts raise on both (tests/vllm_worker.py, dp_ep_switch)."""
    _launch("dp_ep_switch", scheme, seed)


def test_start_up_limit_names_largest_safe_value(seed):
    """DP+EP fused with a --max-num-batched-tokens whose buffers pass int32: both ranks fail at
    construction, naming the largest safe value (not at the first big batch)."""
    _launch("dp_ep_limit", "bf16", seed)
