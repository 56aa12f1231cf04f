"""One SGLang FusedMoE layer -> our plan (or why it keeps SGLang's path) -> prepared weights.

Everything here runs once per layer, at weight-processing time (before SGLang sizes its
KV pool), and reads SGLang's own description of the layer: its quant method, runner
config, expert placement and server arguments. Nothing is inferred from tensor shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...experts import choose_backend
from ...layouts.gate_up import GateUpLayout
from ...spec import Activation, ActivationKind, MoESpec, Scheme, SpecError
from ...weights import PreparedWeights, prepare_stacked
from ..common import (Flags, LimitError, Mode, check_start_limits, fused_transport, layer_spec,
                      local_experts_from_map, tokens_per_rank)
from ..eplb import eplb_problem, slot_views

# SGLang parameters each scheme's weights arrive in (w13, w2, w13 scale, w2 scale).
PARAMS = {
    Scheme.BF16: ("w13_weight", "w2_weight", None, None),
    Scheme.FP8: ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"),
    Scheme.A16W4: ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"),
}
PARAMS[Scheme.A8W4] = PARAMS[Scheme.A16W4]  # the same loaded MXFP4 parameters: only our layout differs
BIASES = ("w13_weight_bias", "w2_weight_bias")


@dataclass(frozen=True)
class LayerPlan:
    """How one SGLang MoE layer runs on our path (decided at weight-processing time)."""

    spec: MoESpec
    layout: GateUpLayout  # gate/up layout of SGLang's loaded w13 (and its scales, bias)
    fused: bool  # MegaMoE dispatch + experts + combine (DP attention + EP); else our experts step
    backend: str  # "triton" (fused_experts) or "torch" (experts_torch)
    tokens: int  # rows one call may bring on this rank (buffers and workspace are sized for it)
    scale: float  # SGLang's routed_scaling_factor, which its runners apply to the expert sum
    all_reduce: bool  # SGLang's forward_impl all-reduces after the experts: so do we
    transport: str = "local"  # MegaMoE's EP transport in fused mode (plugins.common.fused_transport)


def scheme_of(layer, method, mxfp4_scheme: Scheme = Scheme.A16W4) -> Scheme | str:
    """Our scheme for SGLang's quant method (MXFP4 layers as `mxfp4_scheme`), or why we do not take it."""
    from sglang.srt.layers.quantization.fp8 import Fp8MoEMethod
    from sglang.srt.layers.quantization.mxfp4 import Mxfp4MoEMethod
    from sglang.srt.layers.quantization.unquant import UnquantizedFusedMoEMethod

    kind = type(method)  # exact types: subclasses may load or lay out weights differently
    if kind is UnquantizedFusedMoEMethod:
        if layer.params_dtype != torch.bfloat16:
            return f"unquantized weights in {layer.params_dtype} (we take bfloat16 only)"
        return Scheme.BF16
    if kind is Fp8MoEMethod:
        if getattr(method, "use_mxfp8", False) or getattr(method, "is_fp4_expert", False):
            return "fp8 method with MXFP8 or FP4 experts (we take 128x128 block fp8 only)"
        if not method.block_quant or list(method.weight_block_size or ()) != [128, 128]:
            return f"fp8 with weight_block_size={method.weight_block_size} (we take 128x128 block scales only)"
        if layer.w13_weight.dtype != torch.float8_e4m3fn:
            return f"fp8 weights in {layer.w13_weight.dtype} (we take float8_e4m3fn only)"
        return Scheme.FP8
    if kind is Mxfp4MoEMethod:
        return mxfp4_scheme
    return f"quant method {kind.__name__} is not one we replace (bf16, fp8 128x128 blocks, mxfp4)"


def activation_of(layer) -> tuple[Activation, GateUpLayout] | str:
    """Our activation and SGLang's gate/up row layout, or why we do not take the layer."""
    cfg = layer.moe_runner_config
    if not cfg.is_gated or cfg.activation not in ("silu", "swiglu", "swigluoai"):
        return f"activation {cfg.activation} (gated={cfg.is_gated}); we take gated silu / gpt-oss swiglu"
    if getattr(cfg, "swiglu_limit", None) is not None:
        return f"silu with swiglu_limit={cfg.swiglu_limit} (clamped SiLU is not wired for SGLang yet)"
    # SGLang's own description of the loaded rows: gpt-oss checkpoints arrive interleaved
    layout = GateUpLayout.INTERLEAVED if getattr(cfg, "gate_up_interleaved", True) else GateUpLayout.SEPARATED
    if cfg.gemm1_alpha is None and cfg.gemm1_clamp_limit is None:
        # plain SwiGLU layers load gate rows then up rows (FusedMoE._load_w13)
        return Activation(ActivationKind.SWIGLU), GateUpLayout.SEPARATED
    if cfg.gemm1_alpha is None or cfg.gemm1_clamp_limit is None or getattr(cfg, "gemm1_beta", None) not in (None, 1.0):
        beta = getattr(cfg, "gemm1_beta", None)
        return (f"gemm1_alpha={cfg.gemm1_alpha}, clamp={cfg.gemm1_clamp_limit}, beta={beta} "
                "(we take gpt-oss swiglu: alpha and clamp set, beta 1)")
    return Activation(ActivationKind.SWIGLU_OAI, float(cfg.gemm1_alpha), float(cfg.gemm1_clamp_limit)), layout


def local_experts(layer) -> tuple[int, ...] | str:
    """Global ids of this rank's experts in slot order, from SGLang's own placement.

    Under EPLB these are physical slot ids: SGLang's top-k hands physical ids and its loader
    fills every slot with its logical expert's rows (plugins/eplb.py), so the slots are our experts.
    """
    if eplb_active() and _moe_args().ep_dispatch_algorithm is None:
        return ("a non-trivial expert placement without --ep-dispatch-algorithm (SGLang's top-k would hand "
                "logical ids to physical slots)")
    if eplb_active() and shared_experts(layer):
        return "fused shared experts under EPLB (the two together are not tested; SGLang's path runs)"
    if per_rank_shared_slots(layer):
        # megamoe / DeepEP: rank r's slots are ids [r*L, (r+1)*L), routed then shared (SGLang's TopK numbers
        # them so); SGLang's loader map speaks checkpoint ids, so the slots are counted here
        L, r, W = layer.num_local_experts, layer.moe_ep_rank, layer.moe_ep_size
        if layer.num_experts != L * W:
            return f"per-rank shared slots: {layer.num_experts} experts are not {W} ranks x {L} slots"
        return tuple(range(r * L, (r + 1) * L))
    # the same function SGLang's weight loader uses to place expert e: slot or -1
    table = torch.tensor([layer._map_global_expert_id_to_local_expert_id(e) for e in range(layer.num_experts)])
    return local_experts_from_map(table, layer.num_experts)


def _moe_args():
    """SGLang's resolved MoE settings (runtime_context in 0.5.23; the server arguments before it)."""
    try:
        from sglang.srt.runtime_context import get_exec
    except ImportError:
        return server_args()
    return get_exec().moe


def eplb_active() -> bool:
    """Whether SGLang places physical expert replicas (EPLB, redundant experts or a given placement)."""
    moe = _moe_args()
    return bool(moe.enable_eplb or moe.init_expert_location != "trivial" or moe.ep_num_redundant_experts > 0)


def expose_for_eplb(layer, weights: PreparedWeights) -> list[str]:
    """Register our per-slot tensors as the layer's parameters, which SGLang's EPLB rearrangement moves.

    The models' get_moe_weights() list the FusedMoE parameters with one row per local slot;
    ours are views of the prepared tensors (no copy), so a move lands in what our kernels read.
    """
    names = []
    for i, t in enumerate(slot_views(weights)):
        name = f"atom_moe_slots_{i}"
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
        names.append(name)
    return names


def shared_experts(layer) -> int:
    """SGLang's fused shared experts of this layer (0: none, or the model runs them itself)."""
    return int(getattr(layer, "num_fused_shared_experts", 0) or 0)


def per_rank_shared_slots(layer) -> bool:
    """Whether SGLang gives each EP rank its own shared-expert slots (megamoe and DeepEP-class a2a backends).

    Then the top-k ids are physical slots, a token's shared ids already name its own rank's
    slot, and every slot is an ordinary expert to us.
    """
    if not shared_experts(layer):
        return False
    try:
        from sglang.srt.layers.moe.utils import has_per_rank_fused_shared_slots
    except ImportError:  # SGLang before per-rank slots: shared ids are global
        return False
    return bool(has_per_rank_fused_shared_slots(shared_experts(layer)))


def server_args():
    """SGLang's server arguments in this process (runtime_context in 0.5.23, a global in 0.5.14)."""
    try:
        from sglang.srt.runtime_context import get_server_args
    except ImportError:
        from sglang.srt.server_args import get_global_server_args as get_server_args
    return get_server_args()


def token_budget() -> tuple[int, str]:
    """Rows one MoE call may bring on one rank (before any DP gather) and the flag that sets it."""
    args = server_args()
    chunk = args.chunked_prefill_size
    if chunk is not None and chunk <= 0:
        raise LimitError("atom_moe needs chunked prefill to bound its MoE buffers: set --chunked-prefill-size "
                         "(e.g. 8192; see `atom-moe plan` for the memory it takes)")
    prefill = chunk if chunk is not None else args.max_prefill_tokens
    per_req = (getattr(args, "speculative_num_draft_tokens", None) or 1) if getattr(
        args, "speculative_algorithm", None) else 1
    graphs = []
    cg = getattr(args, "cuda_graph_config", None)
    decode = getattr(cg, "decode", None) if cg is not None else None
    if getattr(decode, "max_bs", None):
        graphs.append(int(decode.max_bs) * per_req)
    if getattr(args, "max_running_requests", None):
        graphs.append(int(args.max_running_requests) * per_req)  # eager decode batches
    return tokens_per_rank(prefill, graphs), "--chunked-prefill-size"


def plan_layer(layer, method, fused_flag: bool, transport_flag: str = "auto",
               mxfp4_scheme: Scheme = Scheme.A16W4) -> LayerPlan | str:
    """Our plan for this layer (MXFP4 as `mxfp4_scheme`), or the reason it keeps SGLang's path.

    Raises LimitError on bad limits.
    """
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.layers.moe.utils import get_moe_a2a_backend
    from sglang.srt.runtime_context import get_parallel

    a2a = get_moe_a2a_backend()
    fused = fused_flag and a2a.is_megamoe()
    if not (a2a.is_none() or fused):
        return (f"--moe-a2a-backend {a2a.value} (our experts step runs with 'none'; the fused EP path "
                f"with 'megamoe' and ATOM_USE_FLYDSL_FUSED=1)")
    cfg = layer.moe_runner_config
    if cfg.apply_router_weight_on_input or cfg.no_combine:
        return "apply_router_weight_on_input / no_combine"
    if getattr(layer, "should_fuse_routed_scaling_factor_in_topk", False):
        return "routed scaling folded into the top-k weights by SGLang's runner"
    if getattr(layer, "_dwdp_bound", False) or getattr(layer, "_mega_moe_weights_built", False):
        return "weights already bound to another SGLang path (DWDP / MegaMoE)"
    runner = layer.runner_backend
    packed = ("is_triton_kernels", "is_flashinfer_trtllm_routed")  # predicates that exist in this version
    if runner is not None and any(getattr(runner, p, lambda: False)() for p in packed):
        return f"runner backend {runner.value} hands top-k in a packed format"
    scheme = scheme_of(layer, method, mxfp4_scheme)
    if not isinstance(scheme, Scheme):  # a reason (Scheme is a str enum: test the enum)
        return scheme
    if eplb_active() and eplb_problem(scheme):
        return eplb_problem(scheme)
    act = activation_of(layer)
    if isinstance(act, str):
        return act
    activation, layout = act
    w13 = layer.w13_weight
    if getattr(w13, "is_shuffled", False):
        return "w13 already shuffled for aiter (we read the checkpoint layout only)"
    I, H = layer.intermediate_size_per_partition, layer.hidden_size
    if getattr(layer, "hidden_size_unpadded", H) != H or getattr(method, "hidden_size", H) != H or getattr(
            method, "intermediate_size_per_partition", I) != I:
        return "padded hidden / intermediate size (a runner-specific layout)"
    experts = local_experts(layer)
    if isinstance(experts, str):
        return experts
    if len(experts) != layer.num_local_experts:
        return (f"SGLang's placement gives {len(experts)} local experts but the layer holds "
                f"{layer.num_local_experts}")
    backend = choose_backend(scheme, w13.device)
    if backend is None:
        return f"our GPU experts do not take scheme {scheme.value} yet"

    parallel = get_parallel()
    per_rank, flag = token_budget()
    if is_dp_attention_enabled():  # SGLang has already divided the chunk by the DP size (per DP rank)
        flag = f"{flag} per DP rank (the flag / --dp-size)"
    # without our dispatch, DP-attention layers see every DP rank's tokens (SGLang gathers them)
    gathered = parallel.attn_dp_size if (not fused and is_dp_attention_enabled()) else 1
    try:
        # fused shared experts: global ids after the routed ones, on every rank; with per-rank slots they
        # are ordinary experts (each rank's own), already named so by SGLang's top-k
        shared = 0 if per_rank_shared_slots(layer) else shared_experts(layer)
        spec = layer_spec(hidden_size=H, intermediate_size=I, num_experts=layer.num_experts, top_k=layer.top_k,
                          scheme=scheme, activation=activation, has_bias=bool(layer.with_bias),
                          local_experts=experts, ep_rank=layer.moe_ep_rank, ep_size=layer.moe_ep_size,
                          max_tokens_per_rank=per_rank, shared_experts=shared, replicate_shared=fused)
    except SpecError as exc:
        return f"layer shape not supported: {exc}"
    if fused and (parallel.moe_tp_size > 1 or parallel.moe_ep_size != parallel.tp_size):
        return ("fused EP needs every rank to own whole experts: --ep-size equal to --tp-size "
                f"(got moe_tp={parallel.moe_tp_size}, ep={parallel.moe_ep_size}, tp={parallel.tp_size})")
    free = torch.cuda.mem_get_info(w13.device)[0] if w13.device.type == "cuda" else None
    ep_size = layer.moe_ep_size if fused else 1
    transport = fused_transport(Flags(Mode.FUSED, None, transport_flag), ep_size, w13.device, backend, spec)
    check_start_limits(spec, ep_size=ep_size, tokens=per_rank * gathered, wire="bf16",
                       transport=transport, experts_backend=backend, free_bytes=free, flag=flag, scale=gathered)
    scale = 1.0 if cfg.routed_scaling_factor is None else float(cfg.routed_scaling_factor)
    all_reduce = bool(layer.reduce_results and (layer.moe_tp_size > 1 or layer.moe_ep_size > 1)) and not fused
    return LayerPlan(spec, layout, fused, backend, per_rank * gathered, scale, all_reduce, transport)


def build_weights(layer, plan: LayerPlan) -> PreparedWeights:
    """Our prepared weights from SGLang's loaded parameters; then SGLang's are released."""
    spec = plan.spec
    w13, w2, s13, s2 = (None if n is None else getattr(layer, n).data for n in PARAMS[spec.scheme])
    b13, b2 = (getattr(layer, n).data if spec.has_bias else None for n in BIASES)
    weights = prepare_stacked(spec, w13, w2, layout=plan.layout, w13_scale=s13, w2_scale=s2, w13_bias=b13,
                              w2_bias=b2, expert_ids=spec.local_experts, device=w13.device)
    del w13, w2, s13, s2, b13, b2
    release_originals(layer, spec.scheme)
    return weights


def release_originals(layer, scheme: Scheme) -> list[str]:
    """Drop SGLang's expert parameters so the KV pool gets their memory; return the names dropped."""
    names = [n for n in PARAMS[scheme] + BIASES if n is not None and n in layer._parameters]
    for name in names:
        del layer._parameters[name]
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return names
