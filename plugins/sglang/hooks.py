"""The AROUND hooks the SGLang plugin registers (see __init__.py for which targets).

A layer is ours once `process_weights_after_loading` has built its prepared weights
(`layer.atom_moe` is set, SGLang's expert parameters are gone); from then on every
forward of that layer must run here. Layers we do not take keep SGLang's method and
forward untouched, after one warning per reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ...weights import PreparedWeights
from ..common import FLAG_FUSED, Flags, Mode, bind_layer, decode_capacity, warn_once
from .weights import LayerPlan, build_weights, eplb_active, expose_for_eplb, plan_layer

# the package's logger, by name: the package imports this module, so importing it back would be a cycle
log = logging.getLogger("sglang.atom_moe")

_flags: Flags | None = None
_shared: dict = {}  # per process: one MegaMoE op / experts workspace per layer shape, built at load
_fused_layers = 0  # layers on the MegaMoE path in this process
_fused_ok = True  # this SGLang lets us tell it that MegaMoE's output is complete


@dataclass
class LayerState:
    """One layer's plan, prepared weights and (shared) runtime objects."""

    plan: LayerPlan
    weights: PreparedWeights
    op: object | None = None  # MegaMoE, or a decode + prefill MegaMoEInstances (fused)
    workspace: object | None = field(default=None, repr=False)  # fused_experts workspace (triton backend)
    handle: str = ""  # atom_moe.ops handle: the custom op's bound runtime


def configure(flags: Flags, fused_ok: bool = True) -> None:
    """Set the flags the hooks act on (called by register); fused_ok False keeps layers off MegaMoE."""
    global _flags, _fused_ok
    _flags, _fused_ok = flags, fused_ok


def process_weights_after_loading(orig, method, layer) -> None:
    """Build our weights for layers we take and free SGLang's; others go through SGLang's method."""
    global _fused_layers
    if _flags is None or _flags.mode is Mode.OFF or getattr(layer, "atom_moe", None) is not None:
        return orig(method, layer)
    fused = _flags.mode is Mode.FUSED and _fused_ok
    # LimitError propagates: a start-up error
    plan = plan_layer(layer, method, fused, _flags.transport, _flags.mxfp4_scheme)
    if isinstance(plan, str):
        from sglang.srt.layers.moe.utils import get_moe_a2a_backend

        if fused and get_moe_a2a_backend().is_megamoe():
            # SGLang's own path under megamoe would not sum this layer the way our hook tells it to
            raise RuntimeError(f"atom_moe: {FLAG_FUSED}=1 with --moe-a2a-backend megamoe cannot run "
                               f"{getattr(layer, 'layer_name', '?')}: {plan}. Unset {FLAG_FUSED} or use "
                               "--moe-a2a-backend none (our experts step)")
        name = type(method).__name__
        warn_once(log, f"fallback:{name}:{plan}", f"atom_moe: MoE layers using {name} keep SGLang's own path: "
                                                  f"{plan} (first: {getattr(layer, 'layer_name', '') or '?'})")
        return orig(method, layer)
    weights = build_weights(layer, plan)
    if eplb_active():  # SGLang's rearrangement must move our tensors (plugins/eplb.py)
        expose_for_eplb(layer, weights)
    state = LayerState(plan, weights)
    _build_runtime(state, weights.w2.device)
    layer.atom_moe = state  # the tag: this layer runs on our prepared weights
    _fused_layers += int(plan.fused)


def _build_runtime(state: LayerState, device: torch.device) -> None:
    """Allocate now (before SGLang sizes its KV pool) everything a forward uses; nothing grows later.

    Fused mode: a decode MegaMoE beside the planned one when the budget is larger than the decode
    capacity (ATOM_MOE_DECODE_TOKENS), picked per step by SGLang's DP-wide token counts.
    """
    plan = state.plan

    def ep_groups():
        from sglang.srt.distributed.parallel_state import get_moe_ep_group

        ep = get_moe_ep_group()
        return ep.device_group, ep.cpu_group
    runtime, state.handle = bind_layer(plan, state.weights, decode_tokens=_decode_tokens(plan), device=device,
                                       shared=_shared, ep_groups=ep_groups, agreed_tokens=dp_max_tokens)
    if plan.fused:
        state.op = runtime
    else:
        state.workspace = runtime


def _decode_tokens(plan: LayerPlan) -> int | None:
    """The decode MegaMoE's capacity per rank for this layer, or None (one MegaMoE serves every step).

    When SGLang lets each DP rank pick its own decode graph (require_mlp_tp_gather() False, e.g.
    --moe-dense-tp-size 1 with --enable-dp-lm-head), ranks may replay graphs of different sizes in
    one step, and no host code runs in a replay to compare picks: then the decode op is made large
    enough for every decode graph, so every graph runs the same op.
    """
    decode = decode_capacity(_flags, plan.tokens) if plan.fused else None
    if decode is None:
        return None
    from sglang.srt.utils import require_mlp_tp_gather

    if require_mlp_tp_gather():
        return decode  # every DP rank runs the graph of the largest rank's batch
    from .weights import server_args

    args = server_args()
    per_req = (getattr(args, "speculative_num_draft_tokens", None) or 1) if getattr(
        args, "speculative_algorithm", None) else 1  # tokens per request in a decode graph
    cg = getattr(args, "cuda_graph_config", None)
    largest = getattr(getattr(cg, "decode", None), "max_bs", None) or 0
    decode = max(decode, int(largest) * per_req)
    return decode if decode < plan.tokens else None


def dp_max_tokens() -> int | None:
    """The most tokens any DP rank brings to this forward, as SGLang told every rank (None when unset).

    SGLang gathers every DP rank's count before each batch (`prepare_mlp_sync_batch`) and, for
    graph capture, sets the graph's size for every rank; a host list, so no device sync.
    """
    from sglang.srt.layers.dp_attention import get_dp_global_num_tokens

    counts = get_dp_global_num_tokens()
    return max(counts) if counts else None


def _routing(topk_output) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights, topk_ids) from SGLang's top-k output (standard, or lazy 'bypassed')."""
    from sglang.srt.layers.moe.topk import TopKOutputChecker

    if TopKOutputChecker.format_is_bypassed(topk_output):
        topk_output = topk_output.to_standard()
    if not TopKOutputChecker.format_is_standard(topk_output):
        raise RuntimeError(f"atom_moe: top-k output format {topk_output.format.name} reached a layer on our path "
                           "(only standard top-k is taken at load time)")
    return topk_output.topk_weights.contiguous(), topk_output.topk_ids.contiguous()


def forward_impl(orig, layer, hidden_states: torch.Tensor, topk_output, *args, **kwargs) -> torch.Tensor:
    """Our MoE output for a layer we built, else SGLang's own forward_impl."""
    state: LayerState | None = getattr(layer, "atom_moe", None)
    if state is None:
        return orig(layer, hidden_states, topk_output, *args, **kwargs)
    plan = state.plan
    weights, ids = _routing(topk_output)
    # padded graph rows carry topk_ids = num_experts (or -1): they contribute nothing below
    x = hidden_states if hidden_states.is_contiguous() else hidden_states.contiguous()
    # one custom op call (atom_moe.ops): SGLang's torch.compile paths never trace into our path
    if plan.fused:
        out = torch.ops.atom_moe.mega_moe(x, weights, ids, state.handle)
    else:
        out = torch.ops.atom_moe.experts(x, weights, ids, state.handle)
    if plan.scale != 1.0:
        out = out * plan.scale  # SGLang's runners apply routed_scaling_factor to the expert sum
    if plan.all_reduce:
        from sglang.srt.distributed import tensor_model_parallel_all_reduce

        out = tensor_model_parallel_all_reduce(out)
    return out


def post_experts_output_is_complete(orig, *args, **kwargs) -> bool:
    """True once MegaMoE layers exist: their combine already summed every token over EP."""
    return _fused_layers > 0 or orig(*args, **kwargs)


def reset_for_tests() -> None:
    """Forget the shared runtime objects (tests build several engines in one process)."""
    global _fused_layers
    for obj in _shared.values():
        close = getattr(obj, "close", None)
        if close is not None:
            close()
    _shared.clear()
    _fused_layers = 0
