"""Shared pieces of the SGLang plugin tests (imported inside the SGLang env only).

SGLang's runtime context (server args, parallel state) set up through SGLang's own
publish / init_distributed_environment / initialize_model_parallel; FusedMoE layers built
as the models build them; random checkpoint tensors fed through SGLang's weight loaders;
and the fp32 reference (atom_moe.reference) of what the layer must return.
"""

from __future__ import annotations

import itertools
import socket

import torch

from atom_moe import formats
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import Activation, ActivationKind, Scheme

E, K, H = 8, 2, 256
INTER = {"bf16": 192, "fp8": 256, "mxfp4": 192}  # MXFP4 needs multiples of 32; fp8 blocks of 128
SCHEMES = ("bf16", "fp8", "mxfp4")
SCALE = {"bf16": 1.0, "fp8": 2.5, "mxfp4": 1.0}  # DeepSeek-style routed_scaling_factor on the fp8 layer
_ids = itertools.count()


def free_port() -> int:
    """A free TCP port on the loopback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_runtime(rank: int = 0, world: int = 1, port: int | None = None, *, dp: bool = False,
                  a2a: str = "none", chunked: int = 512, **extra) -> None:
    """SGLang's runtime context for one scheduler rank: server args published, groups initialized (gloo)."""
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    args = dict(model_path="dummy", tp_size=world, ep_size=world, device="cpu", chunked_prefill_size=chunked,
                moe_a2a_backend=a2a, **extra)
    if dp:
        args.update(enable_dp_attention=True, dp_size=world)
    reset_context()
    publish(ServerArgs(**args), role="test", ranks=SpawnRanks(world_rank=rank))
    ps.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port or free_port()}")
    ps.initialize_model_parallel(backend="gloo")
    initialize_moe_config()


def stop_runtime() -> None:
    """Tear this rank's SGLang groups down (collective: every rank calls it). Left to interpreter
    exit, their gloo threads can abort the process after the checks passed ("terminate called
    without an active exception", seen once in CI on test_two_ranks[dp_ep-fp8])."""
    from sglang.srt.distributed import parallel_state as ps

    ps.destroy_model_parallel()
    ps.destroy_distributed_environment()


def quant_config(scheme: str):
    """SGLang's quant config for a checkpoint of this scheme (what its model config builds)."""
    if scheme == "fp8":
        from sglang.srt.layers.quantization.fp8 import Fp8Config

        return Fp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic", weight_block_size=[128, 128])
    if scheme == "mxfp4":
        from sglang.srt.layers.quantization.mxfp4 import Mxfp4Config

        return Mxfp4Config(is_checkpoint_mxfp4_serialized=True)
    return None


def build(scheme: str, **overrides):
    """A FusedMoE as the models build it (DeepSeek/Mixtral style; gpt-oss style for MXFP4)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    mx = scheme == "mxfp4"
    kwargs = dict(num_experts=E, hidden_size=H, intermediate_size=INTER[scheme], layer_id=next(_ids), top_k=K,
                  params_dtype=torch.bfloat16, quant_config=quant_config(scheme),
                  prefix=f"model.layers.{next(_ids)}.mlp.experts", activation="silu", with_bias=mx,
                  routed_scaling_factor=SCALE[scheme] if SCALE[scheme] != 1.0 else None)
    if mx:
        kwargs.update(gemm1_alpha=1.702, gemm1_clamp_limit=7.0)
    kwargs.update(overrides)
    return FusedMoE(**kwargs)


def checkpoint(scheme: str, gen: torch.Generator) -> tuple[dict, ReferenceWeights]:
    """Random checkpoint tensors in the scheme's HF naming, and their fp32 reference weights."""
    def randn(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    I = INTER[scheme]
    gate, up, down = randn(E, I, H, std=H**-0.5), randn(E, I, H, std=H**-0.5), randn(E, H, I, std=I**-0.5)
    if scheme == "mxfp4":  # gpt-oss: one tensor per projection, gate/up rows interleaved, biases
        w13 = torch.stack((gate, up), dim=2).reshape(E, 2 * I, H)  # rows g0, u0, g1, u1, ...
        q13, s13 = formats.quantize_mxfp4(w13)
        q2, s2 = formats.quantize_mxfp4(down)
        b13, b2 = randn(E, 2 * I, std=0.05).bfloat16(), randn(E, H, std=0.05).bfloat16()
        tensors = {"gate_up_proj_blocks": q13.view(E, 2 * I, H // 32, 16), "gate_up_proj_scales": s13,
                   "gate_up_proj_bias": b13, "down_proj_blocks": q2.view(E, H, I // 32, 16),
                   "down_proj_scales": s2, "down_proj_bias": b2}
        full13 = formats.dequantize_mxfp4(q13, s13)
        return tensors, ReferenceWeights(full13[:, 0::2], full13[:, 1::2], formats.dequantize_mxfp4(q2, s2),
                                         tuple(range(E)), b13[:, 0::2].float(), b13[:, 1::2].float(), b2.float())
    tensors, g, u, d = {}, [], [], []
    for e in range(E):
        for name, w, out in (("gate_proj", gate[e], g), ("up_proj", up[e], u), ("down_proj", down[e], d)):
            if scheme == "fp8":
                q, s = formats.quantize_fp8_block(w, 128)
                tensors[f"experts.{e}.{name}.weight"], tensors[f"experts.{e}.{name}.weight_scale_inv"] = q, s
                out.append(formats.dequantize_fp8_block(q, s, 128))
            else:
                tensors[f"experts.{e}.{name}.weight"] = w.bfloat16()
                out.append(w.bfloat16().float())
    return tensors, ReferenceWeights(torch.stack(g), torch.stack(u), torch.stack(d), tuple(range(E)))


def load(layer, scheme: str, tensors: dict) -> int:
    """Feed the tensors through SGLang's weight loaders, as the models' load_weights do; return calls made."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    calls = 0
    if scheme == "mxfp4":  # GptOssForCausalLM._load_mxfp4_experts_weights: this EP rank's experts, whole
        per = E // layer.moe_ep_size
        lo, hi = layer.moe_ep_rank * per, (layer.moe_ep_rank + 1) * per
        for param_name, key in (("w13_weight", "gate_up_proj_blocks"), ("w2_weight", "down_proj_blocks"),
                                ("w13_weight_scale", "gate_up_proj_scales"), ("w2_weight_scale", "down_proj_scales"),
                                ("w13_weight_bias", "gate_up_proj_bias"), ("w2_weight_bias", "down_proj_bias")):
            t = tensors[key]
            t = t.flatten(-2) if t.dim() == 4 else t
            param = getattr(layer, param_name)
            param.weight_loader(param, t[lo:hi], weight_name=param_name, shard_id=None, expert_id=None)
            calls += 1
        return calls
    params = dict(layer.named_parameters())
    mapping = FusedMoE.make_expert_params_mapping(ckpt_gate_proj_name="gate_proj", ckpt_down_proj_name="down_proj",
                                                  ckpt_up_proj_name="up_proj", num_experts=E)
    for name, tensor in tensors.items():
        for param_name, weight_name, expert_id, shard_id in mapping:
            if weight_name not in name:
                continue
            pname = name.replace(weight_name, param_name).removeprefix("experts.")
            param = params[pname]
            param.weight_loader(param, tensor, pname, shard_id=shard_id, expert_id=expert_id)
            calls += 1
            break
    return calls


def process(layer) -> None:
    """What SGLang's model loader does after loading: the quant method's post-processing."""
    layer.quant_method.process_weights_after_loading(layer)


def route(logits: torch.Tensor, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k with renormalization, computed independently of SGLang."""
    w, ids = torch.topk(torch.softmax(logits.float(), dim=-1), k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).contiguous(), ids.to(torch.int32).contiguous()


def topk_output(w: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor):
    """SGLang's StandardTopKOutput, as its TopK op hands it to FusedMoE."""
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    return StandardTopKOutput(topk_weights=w, topk_ids=ids, router_logits=logits)


def activation_of(scheme: str) -> Activation:
    return Activation(ActivationKind.SWIGLU_OAI, 1.702, 7.0) if scheme == "mxfp4" else Activation()


def expected(scheme: str, x, w, ids, ref: ReferenceWeights, experts=None) -> torch.Tensor:
    """SGLang's semantics: routed_scaling_factor times the weighted expert sum."""
    out = reference_moe(x, w, ids.long(), ref, activation_of(scheme), experts=experts,
                        act_quant=Scheme.FP8 if scheme == "fp8" else None)
    return out * SCALE[scheme]


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element within bf16-level error of the fp32 reference (scaled by the output's magnitude)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all()
    scale = ref.abs().max().item()
    assert scale > 0
    err = (out.float() - ref).abs()
    bound = 2e-2 * scale + 2e-2 * ref.abs()
    bad = (err > bound).sum().item()
    assert bad == 0, f"{bad} of {err.numel()} elements off; max error {err.max().item():.4g}, scale {scale:.4g}"
