"""Our loaders and layer against HuggingFace transformers itself.

Tiny random-init Qwen3-MoE, DeepSeek-V3 (sigmoid + correction bias, grouped top-k, scaling
factor, shared expert) and gpt-oss (router bias, expert biases, a live clamp) models are built
from configs (no download), written with save_pretrained in each on-disk style transformers has
(per-expert and, with save_original_format=False, fused), read back with
atom_moe.checkpoint.load_model + prepare_experts / reference_experts, and our layer is compared
with the HF MoE block's own output. Routing (expert sets and weights) is compared with the HF
router's. gpt-oss MXFP4 and DeepSeek fp8 checkpoints are written from the same weights in the
released formats; the HF model is then given transformers' own dequantization of the MXFP4
blocks (integrations.mxfp4.convert_moe_packed_tensors), so a misread byte order would show.

Tolerances: fp32 through the reference 1e-5 (fp32 summation order only); bf16 1e-2 (both
sides round activations and weights to bf16: ~4e-3 each, observed 3-5e-3).
"""

from __future__ import annotations

import glob
import json

import pytest
import torch

from atom_moe import formats
from atom_moe.checkpoint import load_model, prepare_experts, reference_experts
from atom_moe.experts_torch import experts_torch
from atom_moe.reference import reference_moe
from atom_moe.routing import route
from atom_moe.spec import FP8_BLOCK

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

PREFIX = "model.layers.0.mlp"
# the Triton path: real kernels on a GPU, Triton's interpreter on the CPU (scripts/test.sh sets TRITON_INTERPRET=1)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
T = 24
H = 64


def _config(kind: str):
    common = dict(hidden_size=H, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  vocab_size=32, head_dim=32)
    if kind == "qwen3_moe":
        return transformers.Qwen3MoeConfig(moe_intermediate_size=32, intermediate_size=96, num_experts=8,
                                           num_experts_per_tok=3, norm_topk_prob=True, **common)
    if kind == "deepseek_v3":
        return transformers.DeepseekV3Config(
            moe_intermediate_size=32, intermediate_size=96, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
            topk_group=2, n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=2.5, norm_topk_prob=True,
            q_lora_rank=None, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, **common)
    # a low swiglu_limit, so the clamp is live at these weight scales (and read from the config)
    return transformers.GptOssConfig(intermediate_size=32, num_local_experts=8, num_experts_per_tok=3,
                                     swiglu_limit=2.5, **common)


def _model(kind: str):
    """A random-init tiny model whose MoE block has every parameter redrawn at a scale where each semantic matters."""
    model = transformers.AutoModelForCausalLM.from_config(_config(kind)).eval()
    block = model.model.layers[0].mlp
    if kind == "gpt_oss":
        # transformers < 5.18 hard-codes the clamp at 7.0 (the released checkpoints' swiglu_limit) and
        # ignores the config's; our loader reads the config, so the HF block is told the same limit
        block.experts.limit = model.config.swiglu_limit
    with torch.no_grad():
        for name, p in list(block.named_parameters()) + list(block.named_buffers()):
            fan_in = p.shape[-1] if p.dim() > 1 else 1
            if kind == "gpt_oss" and name == "experts.gate_up_proj":
                fan_in = p.shape[1]  # input x output
            if kind == "gpt_oss" and name == "experts.down_proj":
                fan_in = p.shape[1]
            p.copy_(torch.randn(p.shape) * (1.5 if p.dim() > 1 else 0.3) / fan_in ** 0.5)
    return model, block


def _save(model, tmp_path, style: str) -> tuple[dict, dict]:
    """save_pretrained in `style` ('per_expert' or 'fused'); -> (config.json dict, all tensors)."""
    model.save_pretrained(tmp_path, save_original_format=style == "per_expert")
    config = json.loads((tmp_path / "config.json").read_text())
    tensors = {}
    for f in glob.glob(str(tmp_path / "*.safetensors")):
        tensors.update(safetensors_torch.load_file(f))
    return config, tensors


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _hf_route(kind: str, block, x: torch.Tensor, with_logits: bool = False):
    """(weights fp32 [T, k], ids [T, k]) as the HF router chose them (and its logits, if asked)."""
    logits, w, ids = (block.router if kind == "gpt_oss" else block.gate)(x)
    return (w.float(), ids, logits) if with_logits else (w.float(), ids)


def _our_route(kind: str, spec, tensors: dict, x: torch.Tensor):
    """Our route() from the checkpoint's router tensors (logits in fp32 as the HF routers compute them)."""
    if kind == "gpt_oss":
        logits = torch.nn.functional.linear(x.float(), tensors[f"{PREFIX}.router.weight"].float(),
                                            tensors[f"{PREFIX}.router.bias"].float())
        return route(logits, spec.routing, spec.top_k)
    logits = x.float() @ tensors[f"{PREFIX}.gate.weight"].float().T
    bias = tensors.get(f"{PREFIX}.gate.e_score_correction_bias")
    return route(logits, spec.routing, spec.top_k, correction_bias=bias)


def _check_routing(hf_w, hf_ids, w, ids) -> None:
    """Same expert set per token, same weight per expert (order within the top-k is free)."""
    assert torch.equal(hf_ids.sort(1).values, ids.sort(1).values), "expert sets differ from the HF router's"
    order_hf, order = hf_ids.argsort(1), ids.argsort(1)
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, order_hf), rtol=1e-5, atol=1e-6)


def _check_routing_on_hf_logits(kind: str, spec, tensors: dict, hf_logits, hf_w, hf_ids) -> None:
    """Our route() on the HF router's own logits picks experts of the same scores and the same weights.

    In bf16 the Qwen3 and gpt-oss routers compute logits in bf16 (F.linear on bf16 x), where equal
    logits are common; which of two tied experts topk returns is arbitrary, so a tie at the k-th
    place is accepted when the chosen experts' logits are the same values. DeepSeek's router is fp32.
    """
    bias = tensors.get(f"{PREFIX}.gate.e_score_correction_bias")
    w, ids = route(hf_logits.float(), spec.routing, spec.top_k, correction_bias=bias)
    if kind == "deepseek_v3":
        _check_routing(hf_w, hf_ids, w, ids)
        return
    # softmax is monotonic, so the logits order the choice for both routers
    ours_vals = hf_logits.float().gather(1, ids).sort(1).values
    hf_vals = hf_logits.float().gather(1, hf_ids).sort(1).values
    assert torch.equal(ours_vals, hf_vals), "chosen experts' logits differ from the HF router's"
    torch.testing.assert_close(w.sort(1).values, hf_w.sort(1).values, rtol=1e-2, atol=1e-3)


def _hf_out(kind: str, block, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(routed experts' output [T, H], what the block adds on top: DeepSeek's shared expert, else 0)."""
    out = block(x.unsqueeze(0))
    out = (out[0] if isinstance(out, tuple) else out)[0]
    shared = block.shared_experts(x) if kind == "deepseek_v3" else torch.zeros_like(out)
    return out, shared


def _check_clamp_live(kind: str, block, x: torch.Tensor, limit: float) -> None:
    if kind != "gpt_oss":
        return
    h = torch.einsum("th,ehn->ten", x.float(), block.experts.gate_up_proj.float()) + block.experts.gate_up_proj_bias
    assert (h.abs() > limit).float().mean() > 0.02, "the clamp is not live at these weights"


STYLES = [("qwen3_moe", "per_expert"), ("qwen3_moe", "fused"), ("deepseek_v3", "per_expert"),
          ("deepseek_v3", "fused"), ("gpt_oss", "bf16")]


@pytest.mark.parametrize("kind,style", STYLES)
def test_fp32_reference_matches_transformers(kind, style, tmp_path, seed):
    model, block = _model(kind)
    config, tensors = _save(model, tmp_path, style)
    layer = load_model(str(tmp_path))
    spec = layer.spec
    assert (spec.num_experts, spec.top_k, spec.intermediate_size) == (8, 3, 32)
    x = torch.randn(T, H)
    _check_clamp_live(kind, block, x, 2.5)
    with torch.no_grad():
        hf_w, hf_ids = _hf_route(kind, block, x)
        w, ids = _our_route(kind, spec, tensors, x)
        _check_routing(hf_w, hf_ids, w, ids)
        ref = reference_experts(config, spec, dict(tensors), f"{PREFIX}.experts")
        ours = reference_moe(x, w, ids, ref, spec.activation)
        hf, shared = _hf_out(kind, block, x)
    assert torch.isfinite(ours).all()
    assert _rel(ours + shared, hf) <= 1e-5


def _bf16_case(kind, style, tmp_path):
    model, _ = _model(kind)
    model = model.to(torch.bfloat16)
    block = model.model.layers[0].mlp
    config, tensors = _save(model, tmp_path, style)
    spec = load_model(str(tmp_path)).spec
    return block, config, tensors, spec


@pytest.mark.parametrize("kind,style", STYLES)
def test_bf16_torch_twin_matches_transformers(kind, style, tmp_path, seed):
    block, config, tensors, spec = _bf16_case(kind, style, tmp_path)
    for t in tensors.values():
        assert t.dtype == torch.bfloat16, "the checkpoint is written in bf16"
    x = torch.randn(T, H).to(torch.bfloat16)
    with torch.no_grad():
        hf_w, hf_ids, hf_logits = _hf_route(kind, block, x, with_logits=True)
        _check_routing_on_hf_logits(kind, spec, tensors, hf_logits, hf_w, hf_ids)
        prepared = prepare_experts(config, spec, dict(tensors), f"{PREFIX}.experts")
        # the experts step on the HF router's choice, so a bf16 logit tie cannot pick another expert
        ours = experts_torch(x, hf_w, hf_ids, prepared, spec)
        hf, shared = _hf_out(kind, block, x)
    assert ours.dtype == torch.bfloat16 and torch.isfinite(ours).all()
    assert _rel(ours.float() + shared.float(), hf.float()) <= 1e-2


@pytest.mark.parametrize("kind,style", STYLES)
def test_bf16_triton_matches_transformers(kind, style, tmp_path, seed):
    pytest.importorskip("triton")
    from atom_moe.experts import fused_experts
    block, config, tensors, spec = _bf16_case(kind, style, tmp_path)
    x = torch.randn(T, H).to(torch.bfloat16)
    with torch.no_grad():
        w, ids = _hf_route(kind, block, x)  # the HF router's choice (see the torch-twin test)
        prepared = prepare_experts(config, spec, dict(tensors), f"{PREFIX}.experts", device=DEVICE)
        ours = fused_experts(x.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), prepared, spec).cpu()
        hf, shared = _hf_out(kind, block, x)
    assert torch.isfinite(ours).all()
    assert _rel(ours.float() + shared.float(), hf.float()) <= 1e-2


def _gpt_oss_mxfp4(tmp_path):
    """A gpt-oss layer as released: MXFP4 blocks/scales (from the random weights) + float biases; the HF
    model holds transformers' own dequantization of those blocks."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    model, block = _model("gpt_oss")
    config, tensors = _save(model, tmp_path, "bf16")
    ex = block.experts
    for name in ("gate_up_proj", "down_proj"):
        w = tensors.pop(f"{PREFIX}.experts.{name}").transpose(1, 2)  # [E, out, in]
        packed, scales = formats.quantize_mxfp4(w)
        blocks = packed.reshape(*packed.shape[:-1], -1, 16)
        tensors[f"{PREFIX}.experts.{name}_blocks"], tensors[f"{PREFIX}.experts.{name}_scales"] = blocks, scales
        with torch.no_grad():
            getattr(ex, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    return model, block, config, tensors


def test_gpt_oss_mxfp4_matches_transformers(tmp_path, seed):
    pytest.importorskip("triton")
    from atom_moe.experts import fused_experts
    model, block, config, tensors = _gpt_oss_mxfp4(tmp_path)
    spec = load_model(str(tmp_path)).spec  # no quantization_config written: bf16 unless overridden
    x = torch.randn(T, H)
    with torch.no_grad():
        w, ids = _our_route("gpt_oss", spec, tensors, x)
        hf, _ = _hf_out("gpt_oss", block, x)
        ref = reference_experts(config, spec, dict(tensors), f"{PREFIX}.experts")
        assert _rel(reference_moe(x, w, ids, ref, spec.activation), hf) <= 1e-5
        a16w4 = load_model(str(tmp_path), "a16w4").spec
        prepared = prepare_experts(config, a16w4, dict(tensors), f"{PREFIX}.experts")
        on_dev = prepare_experts(config, a16w4, dict(tensors), f"{PREFIX}.experts", device=DEVICE)
        xb = x.to(torch.bfloat16)
        # HF's experts in bf16 on our routing: its bf16 router may pick another expert at a near-tie (seed
        # 1320759747 routed 1 of 24 tokens differently), which is not what this compares
        experts_b = model.to(torch.bfloat16).model.layers[0].mlp.experts
        hf_b = experts_b(xb, ids.long(), w.to(torch.bfloat16))
        triton_out = fused_experts(xb.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), on_dev, a16w4).cpu()
        for out in (experts_torch(xb, w, ids, prepared, a16w4), triton_out):
            assert torch.isfinite(out).all()
            assert _rel(out, hf_b) <= 1e-2


def test_deepseek_fp8_checkpoint_matches_transformers(tmp_path, seed):
    """DeepSeek's fp8 layout (e4m3 weights + fp32 weight_scale_inv per 128x128 block, partial blocks at I=160)."""
    pytest.importorskip("triton")
    from atom_moe.experts import fused_experts
    cfg = _config("deepseek_v3")
    cfg.moe_intermediate_size, cfg.hidden_size = 160, 192
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    block = model.model.layers[0].mlp
    with torch.no_grad():
        for _, p in list(block.named_parameters()) + list(block.named_buffers()):
            p.copy_(torch.randn(p.shape) * (1.5 / p.shape[-1] ** 0.5 if p.dim() > 1 else 0.3))
    config, tensors = _save(model, tmp_path, "per_expert")
    ex = block.experts
    for e in range(8):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            key = f"{PREFIX}.experts.{e}.{proj}.weight"
            q, s = formats.quantize_fp8_block(tensors[key], FP8_BLOCK)
            tensors[key], tensors[key + "_scale_inv"] = q, s
        with torch.no_grad():  # the HF model gets the fp8 checkpoint's values
            deq = {p: formats.dequantize_fp8_block(tensors[f"{PREFIX}.experts.{e}.{p}.weight"],
                                                   tensors[f"{PREFIX}.experts.{e}.{p}.weight_scale_inv"])
                   for p in ("gate_proj", "up_proj", "down_proj")}
            ex.gate_up_proj[e].copy_(torch.cat((deq["gate_proj"], deq["up_proj"])))
            ex.down_proj[e].copy_(deq["down_proj"])
    spec = load_model(str(tmp_path)).spec
    x = torch.randn(T, 192)
    with torch.no_grad():
        w, ids = _our_route("deepseek_v3", spec, tensors, x)
        hf_w, hf_ids = _hf_route("deepseek_v3", block, x)
        _check_routing(hf_w, hf_ids, w, ids)
        hf, shared = _hf_out("deepseek_v3", block, x)
        ref = reference_experts(config, spec, dict(tensors), f"{PREFIX}.experts")
        assert _rel(reference_moe(x, w, ids, ref, spec.activation) + shared, hf) <= 1e-5
        prepared = prepare_experts(config, spec, dict(tensors), f"{PREFIX}.experts")  # fp8 -> bf16 scheme
        on_dev = prepare_experts(config, spec, dict(tensors), f"{PREFIX}.experts", device=DEVICE)
        xb = x.to(torch.bfloat16)
        triton_out = fused_experts(xb.to(DEVICE), w.to(DEVICE), ids.to(DEVICE), on_dev, spec).cpu()
        for out in (experts_torch(xb, w, ids, prepared, spec), triton_out):
            assert _rel(out.float() + shared, hf) <= 1e-2


def test_transformers5_qwen3_config_is_not_gpt_oss(tmp_path):
    """transformers 5 writes num_local_experts into Qwen3-MoE configs: still Qwen3 (moe_intermediate_size, SwiGLU)."""
    model, _ = _model("qwen3_moe")
    config, _ = _save(model, tmp_path, "fused")
    assert "num_local_experts" in config and "num_experts" not in config  # what transformers 5 writes
    spec = load_model(str(tmp_path)).spec
    assert spec.intermediate_size == 32 and spec.activation.kind.value == "swiglu" and not spec.has_bias
