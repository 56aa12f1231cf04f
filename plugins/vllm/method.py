"""Our RoutedExperts / MoE method for vLLM 0.30-0.33 (imported only once a flag is on).

Hook: `RoutedExperts` is a vLLM PluggableLayer, so `RoutedExperts.register_oot` makes
`FusedMoEFactory` build `AtomRoutedExperts` instead. Its `_get_quant_method` asks vLLM
for the method it would use (quant methods are not CustomOps, so this is the one place
that sees all of them) and wraps the ones we support in `AtomMoEMethod`:

* `create_weights` is vLLM's own, so vLLM's weight loader fills the usual parameters;
* `process_weights_after_loading` builds our PreparedWeights from them and deletes
  vLLM's parameters (the KV cache gets that memory);
* `apply` runs our experts step (vLLM routes, and in TP/EP also all-reduces), or in
  fused mode the MegaMoE op (our dispatch + experts + combine, vLLM's dispatch off).

`apply` is a plain method, not a CustomOp forward, so the same path runs with and
without Inductor (vLLM calls `quant_method.apply` in both).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from vllm.config import get_current_vllm_config
from vllm.distributed import get_ep_group, get_tensor_model_parallel_world_size
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.quantization.fp8 import Fp8MoEMethod
from vllm.model_executor.layers.quantization.mxfp4 import GptOssMxfp4Config, GptOssMxfp4MoEMethod, Mxfp4MoEMethod

from ...experts import choose_backend
from ...layouts.gate_up import GateUpLayout
from ...spec import Activation, ActivationKind, MoESpec, Scheme, SpecError
from ...weights import PreparedWeights, prepare_stacked
from ..common import (FLAG_FUSED, Flags, LimitError, Mode, bind_layer, check_start_limits, decode_capacity,
                      fused_transport, layer_spec, local_experts_from_map, tokens_per_rank, warn_once)
from ..eplb import eplb_problem, slot_views
from . import cpu_linear

# the package's logger, by name: the package imports this module, so importing it back would be a cycle
log = logging.getLogger("vllm.atom_moe")

# vLLM parameters each scheme's weights arrive in (w13, w2, w13 scale, w2 scale).
_PARAMS = {
    Scheme.BF16: ("w13_weight", "w2_weight", None, None),
    Scheme.FP8: ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv"),
    Scheme.A16W4: ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"),
}
_PARAMS[Scheme.A8W4] = _PARAMS[Scheme.A16W4]  # one MXFP4 checkpoint either way: only our layout differs
_MXFP4_METHODS = (GptOssMxfp4MoEMethod, Mxfp4MoEMethod)  # exact types: the same parameters, e8m0 scales as uint8
_BIASES = ("w13_bias", "w2_bias")

_flags: Flags | None = None
_shared: dict = {}  # per process: one MegaMoE op / experts workspace per layer shape (built at load, reused)


@dataclass(frozen=True)
class LayerPlan:
    """How one vLLM MoE layer runs on our path (decided at construction)."""

    spec: MoESpec
    layout: GateUpLayout  # gate/up layout of vLLM's w13 (and its scales, bias)
    fused: bool  # MegaMoE dispatch + experts + combine (DP+EP); else the experts step only
    backend: str  # experts backend: "triton" (fused_experts) or "torch" (experts_torch)
    tokens: int  # rows the experts step / MegaMoE must hold per call on this rank
    transport: str = "local"  # MegaMoE's EP transport in fused mode (plugins.common.fused_transport)


def install(flags: Flags) -> type | None:
    """Register AtomRoutedExperts with vLLM (once per process); None if another plugin took the slot."""
    global _flags
    _flags = flags
    current = op_registry_oot.get(RoutedExperts.__name__)
    if current is AtomRoutedExperts:
        return AtomRoutedExperts
    if current is not None:
        warn_once(log, "oot-taken", f"atom_moe: another plugin already replaced vLLM's RoutedExperts with "
                                    f"{current.__module__}.{current.__qualname__}; atom_moe stays off")
        return None
    RoutedExperts.register_oot(AtomRoutedExperts)
    cpu_linear.install()  # vLLM's CPU build only: keeps its gate GEMM ordered before the router in compiled graphs
    return AtomRoutedExperts


class AtomRoutedExperts(RoutedExperts):
    """vLLM's RoutedExperts, with our method chosen for the layers we support."""

    def _get_quant_method(self, prefix, quant_config, moe_config) -> FusedMoEMethodBase:
        no_kernel = None
        try:
            inner = super()._get_quant_method(prefix, quant_config, moe_config)
        except NotImplementedError as exc:  # vLLM has no kernel for this device; we may still serve the layer
            inner, no_kernel = _weights_only_method(quant_config, moe_config, exc), exc
            if inner is None:
                raise
        if _flags is None or _flags.mode is Mode.OFF:
            if no_kernel is not None:
                raise no_kernel
            return inner
        plan = plan_layer(self, inner, moe_config)
        if isinstance(plan, str):
            if no_kernel is not None:
                raise no_kernel  # vLLM's own path cannot run here either: its error, unchanged
            name = type(inner).__name__
            warn_once(log, f"fallback:{name}:{plan}",
                      f"atom_moe: MoE layers using {name} keep vLLM's own path: {plan} (first: {prefix or '?'})")
            return inner
        return AtomMoEMethod(inner, plan)

    def get_expert_weights(self) -> list[torch.Tensor]:
        """What vLLM's EPLB rearrangement moves: our prepared per-slot tensors once they exist."""
        method = getattr(self, "quant_method", None)
        if isinstance(method, AtomMoEMethod) and method.weights is not None:
            return slot_views(method.weights)
        return super().get_expert_weights()


def _weights_only_method(quant_config, moe_config, exc: NotImplementedError) -> FusedMoEMethodBase | None:
    """vLLM's MXFP4 method without its kernel choice, for its create_weights only (None: not an MXFP4 method).

    GptOssMxfp4MoEMethod.__init__ and Mxfp4MoEMethod.__init__ raise when vLLM has no MXFP4 kernel
    for the device (the CPU, for one); their create_weights needs only `self.moe`. The gpt-oss
    method is known from its config. The generic one is chosen by several configs (Mxfp4Config,
    DeepSeek-V4/V4.1's, Fp8Config's MXFP4 experts), so rather than re-deriving their choice we take
    the object vLLM was building: the frame of Mxfp4MoEMethod.__init__ that raised holds it, with
    its base class and checkpoint settings already set (the kernel choice comes after them).
    """
    if type(quant_config) is GptOssMxfp4Config:
        method = GptOssMxfp4MoEMethod.__new__(GptOssMxfp4MoEMethod)
        FusedMoEMethodBase.__init__(method, moe_config)
        return method
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code is Mxfp4MoEMethod.__init__.__code__ and type(frame.f_locals.get("self")) is Mxfp4MoEMethod:
            return frame.f_locals["self"]  # exact type only: subclasses (AMD's V4 method, W4A8) load differently
        tb = tb.tb_next
    return None


def _scheme_of(layer: RoutedExperts, inner: FusedMoEMethodBase) -> Scheme | str:
    """Our scheme for vLLM's method, or why we do not take it."""
    kind = type(inner)  # exact types: subclasses (other checkpoint formats) may load differently
    if kind is UnquantizedFusedMoEMethod:
        if layer.params_dtype != torch.bfloat16:
            return f"unquantized weights in {layer.params_dtype} (we take bfloat16 only)"
        return Scheme.BF16
    if kind is Fp8MoEMethod:
        if not inner.block_quant or list(inner.weight_block_size) != [128, 128]:
            return f"fp8 with weight_block_size={inner.weight_block_size} (we take 128x128 block scales only)"
        if inner.weight_scale_refine is not None:
            return "fp8 block scales refined below 128 to fit the TP shard (we take 128x128 only)"
        if inner.quant_config.activation_scheme != "dynamic":
            return f"fp8 activation_scheme={inner.quant_config.activation_scheme} (we take dynamic only)"
        from vllm.platforms import current_platform
        if current_platform.is_fp8_fnuz():
            return "fp8 e4m3fnuz platform (we take e4m3fn only)"
        return Scheme.FP8
    if kind is Mxfp4MoEMethod and getattr(inner.moe, "use_mxfp4_w4a4_dsv4", False):
        return "MXFP4 activations asked for (VLLM_ROCM_USE_AITER_MOE_A4W4_DSV4=1; we run bf16 or fp8 activations)"
    if kind in _MXFP4_METHODS:
        # a16w4 or a8w4 by ATOM_MOE_MXFP4_ACT; same parameters, same loader. Mxfp4MoEMethod's activation_key
        # (DeepSeek-V4's MXFP8) is a hint to vLLM's kernels only (vLLM's Triton and emulation backends run bf16
        # activations): the model is the MXFP4 weights and the activation, both taken as they are.
        return _flags.mxfp4_scheme
    return f"quant method {kind.__name__} is not one we replace (bf16, fp8 128x128 blocks, mxfp4)"


def _activation_of(layer: RoutedExperts, moe) -> tuple[Activation, GateUpLayout] | str:
    act = moe.activation
    if act is MoEActivation.SILU:
        # vLLM's loader puts w1 (gate) in w13's first half and w3 (up) in its second (_load_w13), for every
        # method's weights and block scales alike (0.30-0.33)
        limit = layer.swiglu_limit
        if limit is None:
            return Activation(ActivationKind.SWIGLU), GateUpLayout.SEPARATED
        if isinstance(limit, bool) or not (isinstance(limit, (int, float)) and math.isfinite(limit) and limit > 0):
            # vLLM's kernels disagree on a limit of 0 (its Triton clamp skips it, its CUDA op clamps at 0)
            return f"silu with swiglu_limit={limit} (we take a finite limit > 0, or none)"
        return Activation(ActivationKind.SWIGLU_CLAMP, limit=float(limit)), GateUpLayout.SEPARATED
    if act is MoEActivation.SWIGLUOAI:
        if layer.swiglu_beta not in (None, 1.0):
            return f"swigluoai with beta={layer.swiglu_beta} (we take beta=1)"
        # vLLM's swigluoai defaults: alpha 1.702, limit 7.0; rows interleaved as in gpt-oss
        alpha = 1.702 if layer.swiglu_alpha is None else float(layer.swiglu_alpha)
        limit = 7.0 if layer.swiglu_limit is None else float(layer.swiglu_limit)
        return Activation(ActivationKind.SWIGLU_OAI, alpha, limit), GateUpLayout.INTERLEAVED
    return f"activation {act.value} (we take silu and swigluoai)"



def _eplb_reason(moe, scheme: Scheme) -> str | None:
    """Why this EPLB layer keeps vLLM's path, or None (also None with EPLB off).

    With EPLB vLLM's router maps logical ids to physical replicas and records the load
    before `apply`, so our spec's experts are the P physical slots (plugins/eplb.py).
    """
    pc = moe.moe_parallel_config
    if not pc.enable_eplb:
        return None
    redundant = get_current_vllm_config().parallel_config.eplb_config.num_redundant_experts
    if moe.num_experts != moe.num_logical_experts + redundant:
        return (f"EPLB layer with {moe.num_experts} physical experts for {moe.num_logical_experts} logical ones and "
                f"{redundant} redundant (fused shared experts under EPLB)")
    return eplb_problem(scheme)


def plan_layer(layer: RoutedExperts, inner: FusedMoEMethodBase, moe) -> LayerPlan | str:
    """Our plan for this layer, or the reason it keeps vLLM's path. Raises LimitError on bad limits."""
    pc = moe.moe_parallel_config
    if moe.is_lora_enabled:
        return "LoRA is enabled"
    if layer.apply_router_weight_on_input:
        return "apply_router_weight_on_input=True"
    if moe.num_experts != moe.num_logical_experts and not pc.enable_eplb:
        return "redundant experts without EPLB"
    if moe.intermediate_pad is not None:
        return f"intermediate_pad={moe.intermediate_pad}"
    if pc.pcp_size > 1:
        return "prefill context parallelism"
    scheme = _scheme_of(layer, inner)
    if not isinstance(scheme, Scheme):  # a reason (Scheme is a str enum: test the enum)
        return scheme
    eplb = _eplb_reason(moe, scheme)
    if eplb:
        return eplb
    act = _activation_of(layer, moe)
    if isinstance(act, str):
        return act
    activation, layout = act
    if type(inner) is Mxfp4MoEMethod and activation.kind is ActivationKind.SWIGLU_OAI:
        # gpt-oss's interleaved rows come with its own method and loader; a generic MXFP4 layer's rows follow its
        # model's loader (per-expert w1/w3 halves, or 0.33's uninterleaved swigluoai): not assumed
        return "swigluoai on the generic Mxfp4MoEMethod (its gate/up rows depend on the model; we take its silu layers)"
    device = torch.device(moe.device) if moe.device is not None else torch.device("cpu")
    backend = choose_backend(scheme, device)
    if backend is None:
        return f"our GPU experts do not take scheme {scheme.value} yet"

    shared = _shared_experts(layer, moe)
    if isinstance(shared, str):
        return shared
    fused = _flags.mode is Mode.FUSED and pc.use_ep and pc.dp_size > 1
    if fused and (get_tensor_model_parallel_world_size() > 1 or pc.is_sequence_parallel):
        warn_once(log, "fused-tp", f"atom_moe: {FLAG_FUSED}=1 runs the fused EP path only with attention TP=1 "
                                   f"(DP attention + EP); with TP>1 vLLM keeps its dispatch/combine and our "
                                   f"experts step runs")
        fused = False
    cfg = get_current_vllm_config()
    mnbt = cfg.scheduler_config.max_num_batched_tokens
    per_rank = tokens_per_rank(mnbt, None, getattr(moe, "max_capture_size", None))
    # without our dispatch, DP+EP layers see every DP rank's tokens (vLLM gathers them first)
    gathered = pc.dp_size if (not fused and pc.dp_size > 1) else 1
    # fused shared experts are ids num_experts.. (vLLM's map holds them on every rank, after the routed ones)
    local = local_experts_from_map(layer._expert_map, moe.num_experts + shared)
    try:
        spec = layer_spec(hidden_size=layer.hidden_size, intermediate_size=moe.intermediate_size_per_partition,
                          num_experts=moe.num_experts + shared, top_k=moe.experts_per_token + shared, scheme=scheme,
                          activation=activation, has_bias=moe.has_bias, local_experts=local,
                          ep_rank=pc.ep_rank if pc.use_ep else 0, ep_size=pc.ep_size if pc.use_ep else 1,
                          max_tokens_per_rank=per_rank, shared_experts=shared, replicate_shared=fused)
    except SpecError as exc:
        return f"layer shape not supported: {exc}"
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    ep_size = spec.placement.world_size if fused else 1
    transport = fused_transport(_flags, ep_size, device, backend, spec)
    check_start_limits(spec, ep_size=ep_size, tokens=per_rank * gathered, wire="bf16",
                       transport=transport, experts_backend=backend, free_bytes=free,
                       flag="--max-num-batched-tokens", scale=gathered)
    return LayerPlan(spec, layout, fused, backend, per_rank * gathered, transport)


def _shared_experts(layer: RoutedExperts, moe) -> int | str:
    """vLLM's fused shared experts of this layer (0: none), or why we do not take them.

    vLLM fuses them on ROCm with AITER (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS): expert ids
    num_experts + j, each token's last top-k slots, with the router's weight (1, or
    1/routed_scaling_factor when the runner scales the output). With EP, AITER's routing buffer
    adds a slot and gives each token's shared slot to one rank only (tokens round robin, every
    rank seeing every token), which neither our spec's top-k nor our dispatch matches.
    """
    manager = getattr(layer, "expert_map_manager", None)
    shared = int(getattr(manager, "num_fused_shared_experts", 0) or 0)
    if not shared:
        return 0
    pc = moe.moe_parallel_config
    if pc.use_ep and pc.ep_size > 1 and getattr(moe, "rocm_aiter_fmoe_enabled", False):
        return ("fused shared experts with EP under AITER (its routing buffer has top_k + shared + 1 slots and "
                "sends each token's shared slot to one rank)")
    emap = layer._expert_map
    if emap is not None and emap.numel() != moe.num_experts + shared:
        return (f"fused shared experts: vLLM's expert map has {emap.numel()} entries, not the "
                f"{moe.num_experts} routed + {shared} shared experts")
    return shared


class AtomMoEMethod(FusedMoEMethodBase):
    """vLLM's weights and loader, our prepared weights and experts step (or fused EP path)."""

    def __init__(self, inner: FusedMoEMethodBase, plan: LayerPlan) -> None:
        super().__init__(inner.moe)
        self.inner = inner  # vLLM's method: its create_weights defines what the loader fills
        self.plan = plan
        self.weights: PreparedWeights | None = None
        self._op = None  # MegaMoE (fused mode), shared by every layer of this shape
        self._workspace = None  # fused_experts workspace (triton backend), shared likewise
        self._handle: str | None = None  # atom_moe.ops handle: the custom op's bound runtime
        # read by RoutedExperts.weight_loader: we accept unrefined block scales only
        self.weight_scale_refine = None

    @property
    def method_name(self) -> str:
        return f"atom_moe({type(self.inner).__name__})"

    @property
    def is_monolithic(self) -> bool:
        return False  # vLLM routes; we get topk ids and weights

    @property
    def supports_eplb(self) -> bool:
        return True  # vLLM routes to physical replicas; AtomRoutedExperts.get_expert_weights lists our tensors

    @property
    def supports_internal_mk(self) -> bool:
        # True stops vLLM's naive DP dispatch/combine: MegaMoE moves the tokens itself
        return self.plan.fused

    def maybe_roundup_sizes(self, hidden_size, intermediate_size_per_partition, act_dtype, moe_parallel_config):
        """No padding: our kernels take the true sizes (vLLM's MXFP4 and DeepEP paths would pad)."""
        return hidden_size, intermediate_size_per_partition

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs) -> None:
        """vLLM's own parameters and loaders, so every checkpoint vLLM reads loads unchanged."""
        self.inner.create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                                  **extra_weight_attrs)

    def get_fused_moe_quant_config(self, layer):
        return None  # no vLLM modular kernel is built for this layer

    def process_weights_after_loading(self, layer) -> None:
        """Build our prepared weights from vLLM's loaded parameters, then free vLLM's."""
        spec = self.plan.spec
        if layer.local_num_experts != spec.num_local_experts:
            raise RuntimeError(f"{layer.layer_name}: vLLM holds {layer.local_num_experts} local experts but its "
                               f"expert map gave {spec.num_local_experts}")
        w13, w2, s13, s2 = (None if n is None else getattr(layer, n) for n in _PARAMS[spec.scheme])
        b13, b2 = (getattr(layer, n) if spec.has_bias else None for n in _BIASES)
        self.weights = prepare_stacked(spec, w13.data, w2.data, layout=self.plan.layout,
                                       w13_scale=None if s13 is None else s13.data,
                                       w2_scale=None if s2 is None else s2.data,
                                       w13_bias=None if b13 is None else b13.data,
                                       w2_bias=None if b2 is None else b2.data,
                                       expert_ids=spec.local_experts, device=w13.device)
        del w13, w2, s13, s2, b13, b2
        for name in [n for n in _PARAMS[spec.scheme] + _BIASES if n is not None]:
            layer._parameters.pop(name, None)  # release vLLM's originals: the KV cache gets the memory
        layer.atom_moe_weights = self.weights  # the tag: this layer runs on our prepared weights
        device = self.weights.w2.device
        if device.type == "cuda":
            torch.cuda.empty_cache()
        self._build_runtime(device)

    def _build_runtime(self, device: torch.device) -> None:
        """Allocate now (before vLLM's profiling run) everything a forward will use; nothing grows later.

        Fused mode: a decode MegaMoE beside the planned one when the budget is larger than the
        decode capacity (ATOM_MOE_DECODE_TOKENS), picked per step by vLLM's DP-wide token count.
        """
        plan = self.plan

        def ep_groups():
            ep = get_ep_group()
            return ep.device_group, ep.cpu_group
        runtime, self._handle = bind_layer(plan, self.weights, shared=_shared, device=device, ep_groups=ep_groups,
                                           decode_tokens=decode_capacity(_flags, plan.tokens) if plan.fused else None,
                                           agreed_tokens=dp_max_tokens)
        if plan.fused:
            self._op = runtime
        else:
            self._workspace = runtime

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        """This rank's MoE output for x (vLLM runs shared experts and the TP/EP all-reduce itself).

        One custom op call (atom_moe.ops), so vLLM's torch.compile never traces into our path.
        """
        if self._handle is None:
            raise RuntimeError(f"{layer.layer_name}: forward before process_weights_after_loading")
        if self.plan.fused:
            return torch.ops.atom_moe.mega_moe(x, topk_weights, topk_ids, self._handle)
        return torch.ops.atom_moe.experts(x, topk_weights, topk_ids, self._handle)


def dp_max_tokens() -> int | None:
    """The most tokens any DP rank brings to this forward, as vLLM told every rank (None outside a DP forward).

    vLLM all-reduces the per-rank counts before each step (`coordinate_batch_across_dp`) and pads
    every rank to the same size when the step runs in a CUDA graph, so this value is the same on
    every rank, in graphs and out (a host tensor: no device sync).
    """
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        return None
    dp = get_forward_context().dp_metadata
    return None if dp is None else int(dp.num_tokens_across_dp_cpu.max())


__all__ = ["AtomMoEMethod", "AtomRoutedExperts", "LayerPlan", "LimitError", "install", "plan_layer"]
