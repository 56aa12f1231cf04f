"""Shared pieces of the SGLang plugin tests (imported inside the SGLang env only).

SGLang's runtime context (server args, parallel state) set up through SGLang's own
publish / init_distributed_environment / initialize_model_parallel; FusedMoE layers built
as the models build them; random checkpoint tensors fed through SGLang's weight loaders;
and the fp32 reference (atom_moe.reference) of what the layer must return.
"""

from __future__ import annotations

import itertools

import torch

from engine_common import (INTER, SCHEMES, a8w4_spec, activation_of, assert_bitwise, assert_matches,  # noqa: F401
                           free_port, hf_checkpoint, our_mxfp4_twin, run_ranks)  # (the cases use them as c.*)
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import Scheme

E, K, H = 8, 2, 256
SCALE = {"bf16": 1.0, "fp8": 2.5, "mxfp4": 1.0, "a8w4": 1.0}  # DeepSeek-style routed_scaling_factor on fp8
_ids = itertools.count()


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


def checkpoint(scheme: str, gen: torch.Generator, num_experts: int = E) -> tuple[dict, ReferenceWeights]:
    """Random checkpoint tensors in the scheme's HF naming (keys under `experts.`), and their reference.

    With fused shared experts, expert E is the shared one (DeepSeek's loader renames
    mlp.shared_experts to mlp.experts.E).
    """
    return hf_checkpoint(scheme, gen, num_experts, H, key_prefix="experts.")


def load(layer, scheme: str, tensors: dict, num_experts: int = E) -> int:
    """Feed the tensors through SGLang's weight loaders, as the models' load_weights do; return calls made."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    calls = 0
    if scheme == "mxfp4":  # GptOssForCausalLM._load_mxfp4_experts_weights: this EP rank's experts, whole
        per = num_experts // layer.moe_ep_size
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
                                                  ckpt_up_proj_name="up_proj", num_experts=num_experts)
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


def expected(scheme: str, x, w, ids, ref: ReferenceWeights, experts=None) -> torch.Tensor:
    """SGLang's semantics: routed_scaling_factor times the weighted expert sum.

    "a8w4" is the MXFP4 layer run with ATOM_MOE_MXFP4_ACT=fp8: the reference quantizes activations as a8w4 does.
    """
    out = reference_moe(x, w, ids.long(), ref, activation_of(scheme), experts=experts,
                        act_quant={"fp8": Scheme.FP8, "a8w4": Scheme.A8W4}.get(scheme))
    return out * SCALE[scheme]


# ---------------------------------------------------------------- fused shared experts (one shared expert, id E)
RSF = 2.5  # DeepSeek-V3's routed_scaling_factor


def _eager(fn):
    """SGLang's torch.compile-decorated routing function, uncompiled (same code, no Inductor on the CPU)."""
    return getattr(fn, "_torchdynamo_orig_callable", fn)


def shared_topk(kind: str, x: torch.Tensor, logits: torch.Tensor, rsf: float | None,
                shared: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32, topk_ids int32) with `shared` fused shared columns, from SGLang's own routing code.

    biased: DeepSeek-V3's biased grouped top-k (shared weight 1/rsf, or 1.0 without a factor);
    grouped: grouped softmax top-k, renormalized (shared weight routed sum / rsf before the renormalization,
    which then divides it by that sum plus SGLang's epsilon: 1/rsf up to rounding, per token).
    """
    from sglang.srt.layers.moe import topk as sg

    if kind == "biased":
        bias = torch.zeros(logits.shape[1])
        return _eager(sg.biased_grouped_topk_impl)(x, logits, bias, K + shared, True, num_expert_group=4,
                                                   topk_group=2, num_fused_shared_experts=shared,
                                                   routed_scaling_factor=rsf)
    return _eager(sg.grouped_topk_gpu)(x, logits, K + shared, True, num_expert_group=4, topk_group=2,
                                       num_fused_shared_experts=shared, routed_scaling_factor=rsf)


def per_rank_shared_topk(x: torch.Tensor, logits: torch.Tensor, rsf: float) -> tuple[torch.Tensor, torch.Tensor,
                                                                                       torch.Tensor, torch.Tensor]:
    """megamoe's per-rank shared slots: (weights, ids) SGLang hands the layer, and the logical (weights, ids).

    The routed top-k, then SGLang's remap_topk_for_per_rank_shared_slots (routed ids spread over
    rank-major blocks of E/W + 1 slots, the shared column naming this rank's own slot).
    """
    from sglang.srt.layers.moe import topk as sg

    w, ids = _eager(sg.biased_grouped_topk_impl)(x, logits, torch.zeros(E), K, True, num_expert_group=4,
                                                 topk_group=2, routed_scaling_factor=rsf)
    cfg = sg.TopKConfig(top_k=K + 1, routed_scaling_factor=rsf)
    ids_phys, w_phys = sg.remap_topk_for_per_rank_shared_slots(ids, w, 1, E, cfg)
    logical_w = torch.cat([w, w_phys[:, -1:]], dim=1)
    logical_ids = torch.cat([ids, torch.full_like(ids[:, :1], E)], dim=1)
    return w_phys.contiguous(), ids_phys.contiguous(), logical_w, logical_ids


def expected_shared(scheme: str, x, w, ids, ref: ReferenceWeights, rsf: float | None) -> torch.Tensor:
    """SGLang's semantics with the shared expert computed on its own: rsf x (routed sum + shared slot x shared MLP)."""
    from shared_common import split_reference

    act = {"fp8": Scheme.FP8, "a8w4": Scheme.A8W4}.get(scheme)
    return split_reference(ref, activation_of(scheme), x, w, ids, E, 1, act) * (rsf or 1.0)
