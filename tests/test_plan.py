"""`atom-moe plan`: config parsing, weight and buffer bytes from the library's own sizing, limits, flags, exits."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.distributed as dist

from atom_moe.tools.cli import main
from atom_moe.ep import BufferLimitError, MegaMoE, buffer_sizes, check_limits
from atom_moe.checkpoint.config import ModelLayer, load_model, spec_from_config
from atom_moe.presets import PRESET_MOE_LAYERS
from atom_moe.tools.plan import GiB, PlanError, make_plan
from atom_moe.weights import prepared_nbytes
from atom_moe.presets import PRESETS
from atom_moe.spec import MoESpec, Scheme, SpecError
from atom_moe.tools.synthetic import random_layer
from atom_moe.weights import prepare_stacked

FP8_Q = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# the MoE fields of the models' public config.json files
CONFIGS = {
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=256,
                        num_experts_per_tok=8, n_group=8, topk_group=4, routed_scaling_factor=2.5,
                        scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, num_hidden_layers=61,
                        first_k_dense_replace=3, moe_layer_freq=1, quantization_config=FP8_Q),
    "kimi-k2": dict(model_type="kimi_k2", hidden_size=7168, moe_intermediate_size=2048, n_routed_experts=384,
                    num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.827,
                    scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True, num_hidden_layers=61,
                    first_k_dense_replace=1, moe_layer_freq=1, quantization_config=FP8_Q),
    "gpt-oss-120b": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=128,
                         experts_per_token=4, num_experts_per_tok=4, num_hidden_layers=36, swiglu_limit=7.0,
                         quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["router"]}),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, moe_intermediate_size=1536, num_experts=128,
                            num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=94, decoder_sparse_step=1,
                            mlp_only_layers=[]),
    "glm-4.5": dict(model_type="glm4_moe", hidden_size=5120, moe_intermediate_size=1536, n_routed_experts=160,
                    num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                    num_hidden_layers=92, first_k_dense_replace=3),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_config_gives_the_preset(name, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]))
    for layer in (spec_from_config(CONFIGS[name]), load_model(str(path)), load_model(str(tmp_path))):
        assert layer.spec == PRESETS[name]
        assert layer.moe_layers == PRESET_MOE_LAYERS[name]
    assert load_model(str(path), "bf16").spec.scheme is Scheme.BF16


def test_hf_config_errors_name_the_problem(tmp_path):
    bad_q = dict(CONFIGS["deepseek-v3"], quantization_config={"quant_method": "awq"})
    with pytest.raises(SpecError, match="quant_method 'awq' not supported; allowed: fp8"):
        spec_from_config(bad_q)
    with pytest.raises(SpecError, match=r"weight_block_size \[64, 64\] not supported"):
        spec_from_config(dict(CONFIGS["deepseek-v3"], quantization_config=dict(FP8_Q, weight_block_size=[64, 64])))
    missing = {k: v for k, v in CONFIGS["qwen3-235b-a22b"].items() if k != "moe_intermediate_size"}
    with pytest.raises(SpecError, match="missing moe_intermediate_size"):
        spec_from_config(missing)
    with pytest.raises(SpecError, match="not a MoE family atom_moe reads; allowed model_type"):
        spec_from_config({"hidden_size": 4096, "num_hidden_layers": 32, "model_type": "llama"})
    with pytest.raises(SpecError, match="neither a preset"):
        load_model(str(tmp_path / "nope.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(SpecError, match="not a readable JSON config"):
        load_model(str(tmp_path / "broken.json"))


@pytest.mark.parametrize("scheme", list(Scheme))
@pytest.mark.parametrize("bias", [False, True])
def test_weight_bytes_equal_prepared_weights(scheme, bias, seed):
    """The planned weight bytes are what prepare_stacked really builds (H, I not multiples of 128)."""
    g = torch.Generator().manual_seed(seed)
    H, I = (int(v) * 32 for v in torch.randint(2, 6, (2,), generator=g))  # MXFP4 needs multiples of 32
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=4, top_k=2, scheme=scheme,
                          has_bias=bias).for_rank(1, 2)
    raw = random_layer(spec, generator=g)
    prepared = prepare_stacked(spec, raw.w13, raw.w2, layout="separated", w13_bias=raw.w13_bias, w2_bias=raw.w2_bias)
    assert prepared_nbytes(spec) == prepared.nbytes()


SMALL = MoESpec.create(hidden_size=320, intermediate_size=192, num_experts=8, top_k=3, scheme="fp8")


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_op_allocates_the_planned_bytes_local(backend, monkeypatch, seed):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the op accepts the triton backend on the CPU only then
    tokens = int(torch.randint(1, 200, (1,)).item())
    plan = make_plan(ModelLayer("small", SMALL, 2), ep=1, tokens=tokens, gpu_bytes=GiB, reserve_bytes=0,
                     experts_backend=backend)
    assert not plan.problems and plan.transport == "local"
    with MegaMoE(SMALL, max_tokens_per_rank=tokens, experts_backend=backend, device="cpu") as op:
        assert op.allocated_bytes() == plan.buffer_bytes
    assert (plan.buffer_bytes > 0) == (backend == "triton")


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
def test_op_allocates_the_planned_bytes_torch_transport(wire, monkeypatch, seed):
    """The torch transport's buffers (a 1-rank gloo group) and the Triton workspace, at the planned size."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tokens = int(torch.randint(1, 100, (1,)).item())
    plan = make_plan(ModelLayer("small", SMALL, 2), ep=1, tokens=tokens, gpu_bytes=GiB, wire="bf16",
                     experts_backend="triton", transport="torch")
    if wire == "fp8":  # make_plan refuses the fp8 wire at EP 1 (engines run local there): plan it directly
        plan.buffer_bytes = sum(buffer_sizes(SMALL, 1, tokens, "fp8", transport="torch",
                                             experts_backend="triton").values())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with MegaMoE(SMALL, max_tokens_per_rank=tokens, transport="torch", wire=wire, experts_backend="triton",
                     device="cpu") as op:
            assert op.allocated_bytes() == plan.buffer_bytes
    finally:
        dist.destroy_process_group()


def test_largest_budget_is_exact():
    """At the reported maxima the library's check_limits and the memory sum pass; one token more fails."""
    layer = load_model("deepseek-v3")
    plan = make_plan(layer, ep=8, gpu_bytes=int(140.4 * GiB), reserve_bytes=10 * GiB)
    assert plan.max_tokens_int32 == 16319  # docs/ep.md: DeepSeek-V3 EP8 fp8, Triton workspace.inter binds
    spec = layer.spec.for_rank(0, 8)
    check_limits(spec, 8, 16319, experts_backend="triton")
    with pytest.raises(BufferLimitError, match="workspace.inter"):
        check_limits(spec, 8, 16320, experts_backend="triton")
    # a GPU just large enough for 700 tokens: memory binds, exactly at 700
    at700 = make_plan(layer, ep=8, tokens=700, gpu_bytes=GiB, reserve_bytes=0)
    need = at700.weight_bytes + at700.buffer_bytes + at700.decode_bytes  # the decode ops' 8 and 128 tokens too
    assert at700.decode_tokens == 128 and at700.decode_bytes == sum(
        sum(buffer_sizes(layer.spec.for_rank(0, 8), 8, cap, transport=at700.transport,
                         experts_backend="triton").values()) for cap in (8, 128))
    tight = make_plan(layer, ep=8, gpu_bytes=need, utilization=1.0, reserve_bytes=0)
    assert tight.max_tokens_memory == 700 and tight.tokens == tight.recommended <= 700 and not tight.problems
    over = make_plan(layer, ep=8, tokens=701, gpu_bytes=need, utilization=1.0, reserve_bytes=0)
    assert over.problems and "largest budget that fits is 700" in over.problems[0]


def _flags(out: str, engine: str) -> str:
    return next(line for line in out.splitlines() if line.strip().startswith(f"{engine}:"))


def test_cli_prints_plan_and_engine_flags(capsys):
    assert main(["plan", "kimi-k2", "--dp", "16", "--gpu-memory-gib", "140", "--tokens", "512",
                 "--model-path", "moonshotai/Kimi-K2-Instruct"]) == 0
    out = capsys.readouterr().out
    assert "EP 16 (24 experts per rank)" in out and "60 MoE layers" in out
    assert re.search(r"workspace\.inter \[68608, 2048\] float8_e4m3fn bytes +140,509,184 +15\.28x", out)
    assert "workspace.partial" not in out.split("int32-limited")[1]  # int64-indexed: not an int32 quantity
    vllm, sglang = _flags(out, "vllm"), _flags(out, "sglang")
    assert ("ATOM_USE_FLYDSL_FUSED=1 vllm serve moonshotai/Kimi-K2-Instruct --tensor-parallel-size 1 "
            "--data-parallel-size 16 --enable-expert-parallel --max-num-batched-tokens 512 "
            "--gpu-memory-utilization 0.90") in vllm
    # SGLang divides --chunked-prefill-size by the DP size under --enable-dp-attention: 512 per rank x 16
    assert ("ATOM_USE_FLYDSL_FUSED=1 python -m sglang.launch_server --model-path moonshotai/Kimi-K2-Instruct "
            "--tp-size 16 --ep-size 16 --dp-size 16 --enable-dp-attention --moe-a2a-backend megamoe") in sglang
    assert ("--chunked-prefill-size 8192 --max-running-requests 512 --cuda-graph-max-bs-decode 512 "
            "--mem-fraction-static 0.90") in sglang
    assert main(["plan", "gpt-oss-120b", "--gpu-memory-gib", "140", "--tokens", "256"]) == 0
    out = capsys.readouterr().out  # EP 1: the experts step alone; small budgets cap the graphs and batches
    assert ("ATOM_USE_FLYDSL=1 vllm serve gpt-oss-120b --tensor-parallel-size 1 --data-parallel-size 1 "
            "--max-num-batched-tokens 256") in _flags(out, "vllm")
    assert "--max-num-seqs 256 --compilation-config '{\"max_cudagraph_capture_size\": 256}'" in _flags(out, "vllm")
    assert "--tp-size 1 --disable-shared-experts-fusion --chunked-prefill-size 256" in _flags(out, "sglang")
    assert "ATOM_MOE_MXFP4_ACT" not in out  # the checkpoint's MXFP4 runs as a16w4, the plugins' default
    assert main(["plan", "gpt-oss-120b", "--gpu-memory-gib", "140", "--tokens", "256", "--scheme", "a8w4"]) == 0
    out = capsys.readouterr().out  # a8w4 must be asked for: the printed commands set the plugins' flag
    for engine in ("vllm", "sglang"):
        assert _flags(out, engine).split(":", 1)[1].strip().startswith("ATOM_USE_FLYDSL=1 ATOM_MOE_MXFP4_ACT=fp8 ")


def test_cli_exit_1_when_the_budget_overflows(capsys):
    assert main(["plan", "deepseek-v3", "--ep", "8", "--gpu-memory-gib", "140", "--tokens", "17000"]) == 1
    captured = capsys.readouterr()
    assert "workspace.inter" in captured.err and "largest safe budget is 16319" in captured.err
    assert "engine flags" not in captured.out and "DOES NOT FIT" in captured.out
    assert main(["plan", "deepseek-v3", "--ep", "8", "--gpu-memory-gib", "80", "--tokens", "512"]) == 1
    assert "but the engine gets 72.00 GiB" in capsys.readouterr().err  # 76 GiB of fp8 experts alone


@pytest.mark.parametrize("argv, message", [
    (["deepseek-v3", "--tp", "2", "--dp", "4", "--gpus", "4"], "= 8 GPUs, but --gpus 4"),
    (["deepseek-v3", "--tp", "8", "--ep", "1"], "shards every expert by TP"),
    (["deepseek-v3", "--layout", "tp-ep", "--ep", "8"], "drop --tp/--dp/--ep, or drop --layout"),
    (["deepseek-v3", "--ep", "8", "--dp", "4"], "EP size must equal TP x DP = 4"),
    (["deepseek-v3", "--ep", "3"], "num_experts divisible by the EP world size"),
    (["deepseek-v3", "--wire", "fp8"], "--wire fp8 needs EP > 1"),
    (["llama-3", "--ep", "8"], "neither a preset"),
    (["deepseek-v3", "--ep", "8", "--gpu-memory-utilization", "1.5"], "'1.5' is out of range; allowed: a number in (0, 1]"),
    (["deepseek-v3", "--ep", "8", "--tokens", "0"], "argument --tokens: '0' is out of range"),
])
def test_cli_bad_input_exit_2(argv, message, capsys):
    assert main(["plan", *argv, "--gpu-memory-gib", "140"]) == 2
    assert message in capsys.readouterr().err


def test_plan_error_for_triton_on_unsupported_scheme(monkeypatch):
    import atom_moe.experts as experts
    monkeypatch.setattr(experts, "SUPPORTED", (Scheme.BF16,))
    with pytest.raises(PlanError, match="do not take scheme fp8 yet"):
        make_plan(load_model("deepseek-v3"), ep=8, gpu_bytes=140 * GiB, experts_backend="triton")
    plan = make_plan(load_model("deepseek-v3"), ep=8, gpu_bytes=140 * GiB)  # auto -> torch experts
    assert plan.backend == "torch" and not any(n.startswith("workspace.") for n in plan.buffers)


# ---- layouts, the recommended budget, instance sizes, the verdict, --gpus


def _workspace_bytes(spec, rows: int) -> int:
    """The experts workspace's bytes, read off a real (meta-device) allocation."""
    from atom_moe.experts import allocate_workspace
    ws = allocate_workspace(spec, rows, "meta")
    return sum(t.numel() * t.element_size() for t in vars(ws).values() if isinstance(t, torch.Tensor))


def test_experts_mode_layouts_size_the_workspace_for_the_rows_a_rank_gets(seed):
    layer = load_model("deepseek-v3", "bf16")
    B = 64 + seed % 512
    kw = dict(tokens=B, gpu_bytes=140 * GiB, experts_backend="triton")
    tp_ep = make_plan(layer, ep=8, dp=1, tp=8, **kw)
    assert (tp_ep.layout, tp_ep.fused, tp_ep.transport, tp_ep.gpus) == ("tp-ep", False, "local", 8)
    spec = layer.spec.for_rank(0, 8)
    assert tp_ep.buffer_bytes == _workspace_bytes(spec, B)  # every rank sees the engine's B tokens
    ep = make_plan(layer, ep=8, dp=8, tp=1, fused=False, **kw)
    assert ep.layout == "ep" and ep.rows_per_call == 8 * B  # the engine's DP dispatch gathers 8 ranks' tokens
    assert ep.buffer_bytes == _workspace_bytes(spec, 8 * B)
    both = make_plan(layer, ep=8, dp=4, tp=2, **kw)
    assert both.layout == "tp-dp-ep" and both.buffer_bytes == _workspace_bytes(spec, 4 * B)
    rep = make_plan(layer, ep=1, dp=8, tp=1, **kw)
    assert rep.layout == "replicate" and abs(rep.weight_bytes / tp_ep.weight_bytes - 8) < 1e-4  # 256 experts per GPU
    with pytest.raises(PlanError, match="fused path runs with attention TP 1"):
        make_plan(layer, ep=8, dp=1, tp=8, fused=True, **kw)


def test_recommended_budget_keeps_the_buffer_share(seed):
    layer = load_model("deepseek-v3")
    share = [0.05, 0.1, 0.2][seed % 3]
    plan = make_plan(layer, ep=8, gpu_bytes=int(140.4 * GiB), reserve_bytes=10 * GiB, buffer_share=share)
    assert plan.tokens == plan.recommended and 0 < plan.recommended <= plan.max_tokens
    assert plan.recommended % 256 == 0
    assert plan.buffer_bytes + plan.decode_bytes <= share * plan.engine_bytes  # both MegaMoE ops count
    above = make_plan(layer, ep=8, tokens=plan.recommended + 256, gpu_bytes=int(140.4 * GiB),
                      reserve_bytes=10 * GiB)
    assert above.buffer_bytes + above.decode_bytes > share * plan.engine_bytes  # the next round budget: more
    wider = make_plan(layer, ep=8, gpu_bytes=int(140.4 * GiB), reserve_bytes=10 * GiB, buffer_share=share * 2)
    assert wider.recommended > plan.recommended and wider.max_tokens == plan.max_tokens


def test_cli_plans_every_layout_within_the_gpus_given(capsys):
    assert main(["plan", "deepseek-v3", "--gpus", "8", "--gpu-memory-gib", "140.4"]) == 0
    out = capsys.readouterr().out
    table = out.split("layouts on 8 GPU(s)")[1]
    for name in ("dp-ep", "tp-ep", "ep", "replicate"):
        assert re.search(rf"^  {name} ", table, re.M), name
    for tp, dp in re.findall(r"--tensor-parallel-size (\d+) --data-parallel-size (\d+)", out):
        assert int(tp) * int(dp) <= 8
    for tp, dp, _ep in re.findall(r"^  \S+ +(\d+) +(\d+) +(\d+) ", table, re.M):
        assert int(tp) * int(dp) <= 8
    rec = int(re.search(r"recommended budget: ([\d,]+)", out)[1].replace(",", ""))
    assert f"--max-num-batched-tokens {rec} " in out and "maximum: 16,319" in out
    assert "verdict: EP is needed" in out  # 609 GiB of fp8 experts do not fit one GPU
    assert re.search(r"^  replicate .*does not fit", table, re.M)
    assert main(["plan", "deepseek-v3", "--gpus", "8", "--layout", "tp-ep", "--gpu-memory-gib", "140.4",
                 "--model-path", "m"]) == 0
    out = capsys.readouterr().out
    assert "ATOM_USE_FLYDSL=1 vllm serve m --tensor-parallel-size 8 --data-parallel-size 1 --enable-expert-parallel" in out
    assert "--tp-size 8 --ep-size 8 --moe-a2a-backend none" in out


def test_instance_sizes_and_the_replication_verdict(capsys):
    from atom_moe.tools.plan import instance_size
    layer = load_model("deepseek-v3")
    kw = dict(gpu_bytes=int(140.4 * GiB), reserve_bytes=10 * GiB)
    assert make_plan(layer, ep=4, tokens=256, **kw).problems  # 152 GiB of experts per rank at EP 4
    assert not make_plan(layer, ep=8, tokens=256, **kw).problems
    assert instance_size(layer, "dp-ep", 8, 256, **kw) == 8
    assert instance_size(layer, "dp-ep", 4, 256, **kw) is None  # never more GPUs than given
    assert instance_size(layer, "replicate", 8, 256, **kw) is None
    # gpt-oss-120b's MXFP4 experts fit one H200: replication is the layout to beat
    assert main(["plan", "gpt-oss-120b", "--gpus", "8", "--gpu-memory-gib", "140.4"]) == 0
    out = capsys.readouterr().out
    assert "verdict: EP is not expected to pay here: gpt-oss-120b fits on one GPU" in out
    assert re.search(r"^  replicate +1 +8 +1 .* +1 +1$", out, re.M)  # decode and prefill instances: 1 GPU


def test_decode_and_prefill_ops_both_reported(capsys):
    """The fused path's decode MegaMoE: its bytes per rank beside the budget-sized op's, in the memory sums."""
    layer = load_model("deepseek-v3")
    kw = dict(ep=8, tokens=4096, gpu_bytes=int(140.4 * GiB), reserve_bytes=10 * GiB)
    spec = layer.spec.for_rank(0, 8)
    for cap in (4, 8, 128, 512):  # the small decode op (8 tokens) beside every capacity above it
        plan = make_plan(layer, decode_tokens=cap, **kw)
        want = sum(sum(buffer_sizes(spec, 8, c, transport=plan.transport, experts_backend="triton").values())
                   for c in ((8, cap) if cap > 8 else (cap,)))
        assert plan.decode_tokens == cap and plan.decode_bytes == want
        assert plan.buffer_bytes == sum(buffer_sizes(spec, 8, 4096, transport=plan.transport,
                                                     experts_backend="triton").values())
        assert plan.left_bytes == plan.engine_bytes - plan.weight_bytes - plan.buffer_bytes - want
    one = make_plan(layer, decode_tokens=0, **kw)
    assert one.decode_tokens == one.decode_bytes == 0 and one.buffer_bytes == plan.buffer_bytes
    small = make_plan(layer, ep=8, tokens=128, gpu_bytes=int(140.4 * GiB))  # the budget is a decode batch
    assert small.decode_tokens == small.decode_bytes == 0
    experts_mode = make_plan(layer, ep=8, tp=8, dp=1, tokens=4096, gpu_bytes=int(140.4 * GiB))
    assert experts_mode.decode_bytes == 0  # no MegaMoE there
    assert main(["plan", "deepseek-v3", "--ep", "8", "--gpu-memory-gib", "140.4", "--tokens", "4096"]) == 0
    out = capsys.readouterr().out
    d = make_plan(layer, **kw)
    assert re.search(rf"prefill op \(4096 tokens per rank\) +{d.buffer_bytes:,} B +{d.buffer_bytes / GiB:.3f} GiB",
                     out), out
    assert re.search(rf"decode ops \(8 and 128 tokens per rank; same weights, no copy\) +{d.decode_bytes:,} B "
                     rf"+{d.decode_bytes / GiB:.3f} GiB", out), out
    assert "ATOM_MOE_DECODE_TOKENS" not in _flags(out, "vllm")  # the plugins' default
    assert main(["plan", "deepseek-v3", "--ep", "8", "--gpu-memory-gib", "140.4", "--tokens", "4096",
                 "--decode-capacity", "0"]) == 0
    out = capsys.readouterr().out
    assert "decode ops" not in out and "ATOM_MOE_DECODE_TOKENS=0" in _flags(out, "sglang")
    assert main(["plan", "deepseek-v3", "--ep", "8", "--gpu-memory-gib", "140.4", "--decode-capacity", "-1"]) == 2


def test_fused_shared_experts_are_planned_as_slots(capsys):
    """--fused-shared-experts 1 on DeepSeek-V3: E 257 / top_k 9, a replica per rank, buffers for 9 slots a token."""
    layer = load_model("deepseek-v3")
    plain = make_plan(layer, ep=8, tokens=1024, gpu_bytes=int(140.4 * GiB))
    assert main(["plan", "deepseek-v3", "--gpus", "8", "--gpu-memory-gib", "140.4", "--tokens", "1024",
                 "--fused-shared-experts", "1"]) == 0
    out = capsys.readouterr().out
    assert "E=257 top_k=9" in out and "EP 8 (33 slots per rank: 32 routed + 1 fused shared)" in out
    assert "slot_ids [1024, 9] int64" in out  # every token's shared slot counted
    assert "--enforce-shared-experts-fusion" in _flags(out, "sglang")
    from atom_moe.tools.plan import with_fused_shared
    shared = make_plan(with_fused_shared(layer, 1), ep=8, tokens=1024, gpu_bytes=int(140.4 * GiB))
    assert shared.spec.local_experts == tuple(range(32)) + (256,)
    assert shared.weight_bytes * 32 == plain.weight_bytes * 33  # the shared expert's replica on every rank
    assert shared.buffer_bytes > plain.buffer_bytes
    assert main(["plan", "deepseek-v3", "--gpu-memory-gib", "140", "--fused-shared-experts", "1",
                 "--redundant-experts", "8"]) == 2
    assert "plan one of them" in capsys.readouterr().err
