"""`atom-moe plan`: how large can --max-num-batched-tokens (vLLM) / --chunked-prefill-size (SGLang) be?

For a preset or a HuggingFace config.json, a parallel layout and a GPU, prints the routed
experts' weight bytes per rank, the MegaMoE op's buffer bytes per rank at the token
budget, every int32-limited quantity with its margin, the largest safe budget (int32 and
memory), and the engine flags to start vLLM and SGLang with. The MegaMoE fused path runs
with DP attention + EP: attention TP 1, EP size = DP size = GPUs, experts spread linearly.

Sizes come from the op's own functions (atom_moe.ep.buffers.buffer_plan / buffer_sizes /
check_limits); a test builds the op at the planned size and compares allocated bytes.
Exit 0: the budget fits; 1: it overflows an int32 limit or the memory; 2: bad input.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field, replace

import torch

from ..ep.instances import DECODE_TOKENS, decode_capacities
from ..ep.buffers import INT32_MAX, INT64_INDEXED, WIRES, BufferLimitError, buffer_plan, buffer_sizes, check_limits, largest_true
from ..checkpoint.config import ModelLayer, load_model
from ..presets import PRESETS
from ..spec import MoESpec, Scheme, SpecError
from ..weights import prepared_nbytes
from .args import fraction, nonnegative_float, nonnegative_int, positive_float, positive_int

GiB = 2**30
SEARCH_CAP = 2**20  # tokens per rank: a budget search stops here (no engine step is this large)
ENGINES = ("vllm", "sglang")


class PlanError(ValueError):
    """Inputs that cannot be planned (bad sizes, layouts the fused path does not run)."""


def experts_backend_for(spec: MoESpec, requested: str = "auto") -> str:
    """The experts backend the op picks on a GPU for 'auto': triton where the fused kernels take the scheme."""
    if requested != "auto":
        return requested
    from ..experts import SUPPORTED  # no Triton import: the kernels load lazily
    return "triton" if spec.scheme in SUPPORTED else "torch"


def int32_quantities(spec: MoESpec, ep: int, tokens: int, wire: str, transport: str,
                     backend: str) -> list[tuple[str, int]]:
    """Every quantity check_limits bounds by 2**31 - 1: each buffer's bytes, and the (token, expert) pairs."""
    plan = buffer_plan(spec, ep, tokens, wire, transport=transport, experts_backend=backend)
    rows = [(f"{name} {list(b.shape)} {str(b.dtype).removeprefix('torch.')} bytes", b.nbytes)
            for name, b in plan.items() if name not in INT64_INDEXED]
    # mirrors ep/buffers._violations: the pairs one rank's experts step may receive
    return rows + [("(token, expert) pairs one rank's experts may receive", ep * tokens * spec.top_k)]


LAYOUTS = {  # name -> what it is; the docs' recipes (docs/vllm.md, docs/sglang.md) use the first three
    "dp-ep": "DP attention + EP, MegaMoE fused (our dispatch, experts and combine)",
    "tp-ep": "TP attention + EP, our experts step (every rank sees every token; the engine all-reduces)",
    "ep": "DP attention + EP with the engine's own dispatch, our experts step (every rank gets all DP ranks' tokens)",
    "replicate": "one full copy of the model per GPU (DP, no EP), our experts step: the comparison",
}
TP_DP = "tp-dp-ep"  # --tp > 1 with --dp > 1: the engine's dispatch, experts mode


def layout_sizes(layout: str, gpus: int) -> tuple[int, int, int]:
    """(tp, dp, ep) of a named layout on `gpus` GPUs."""
    return {"dp-ep": (1, gpus, gpus), "tp-ep": (gpus, 1, gpus), "ep": (1, gpus, gpus),
            "replicate": (1, gpus, 1)}[layout]


def round_budget(tokens: int) -> int:
    """A budget to type: a multiple of 256 from 256 up, else a power of two (0 stays 0)."""
    if tokens >= 256:
        return tokens // 256 * 256
    return 1 << (tokens.bit_length() - 1) if tokens else 0


@dataclass
class Plan:
    """Everything `atom-moe plan` prints, as numbers (bytes per rank)."""

    layer: ModelLayer
    spec: MoESpec  # rank 0's view at the planned token budget
    ep: int
    dp: int
    tp: int
    tokens: int  # tokens per rank per forward (the budget)
    wire: str
    transport: str
    backend: str
    gpu_bytes: int
    utilization: float
    reserve_bytes: int
    weight_bytes: int  # all MoE layers' routed experts on this rank
    buffer_bytes: int
    buffers: dict[str, int]
    quantities: list[tuple[str, int]]
    max_tokens_int32: int
    max_tokens_memory: int
    problems: list[str] = field(default_factory=list)
    layout: str = "dp-ep"
    fused: bool = True  # MegaMoE dispatch + combine; else our experts step inside the engine's dispatch
    rows_per_call: int = 0  # tokens one rank's MoE call holds at the budget (DP x budget where the engine gathers)
    recommended: int = 0  # largest round budget whose buffers stay within buffer_share of the engine's memory
    buffer_share: float = 0.1
    # fused: the decode MegaMoE beside the budget-sized one (atom_moe.ep.MegaMoEInstances); 0: none
    decode_tokens: int = 0
    decode_bytes: int = 0  # its buffers per rank (the weights are shared: no second copy)

    @property
    def engine_bytes(self) -> int:
        return int(self.gpu_bytes * self.utilization)

    @property
    def left_bytes(self) -> int:
        """What the engine has left for everything else (dense weights, activations, KV cache)."""
        return self.engine_bytes - self.weight_bytes - self.buffer_bytes - self.decode_bytes

    @property
    def max_tokens(self) -> int:
        return min(self.max_tokens_int32, self.max_tokens_memory)

    @property
    def gpus(self) -> int:
        return self.tp * self.dp


def make_plan(layer: ModelLayer, *, ep: int, dp: int | None = None, tp: int = 1, tokens: int | None = None,
              gpu_bytes: int, utilization: float = 0.9, reserve_bytes: int = 0, wire: str = "bf16",
              experts_backend: str = "auto", transport: str | None = None, fused: bool | None = None,
              buffer_share: float = 0.1, redundant_experts: int = 0, decode_tokens: int = DECODE_TOKENS) -> Plan:
    """Plan one layout; `tokens=None` plans the recommended budget. Raises PlanError on bad input.

    fused=None: MegaMoE fused wherever the engines run it (TP 1, DP = EP > 1); False: the
    engine's own dispatch with our experts step (the "ep" layout). decode_tokens: the fused
    path's decode MegaMoE capacity per rank (the plugins' ATOM_MOE_DECODE_TOKENS), built beside
    the budget-sized op when the budget is larger; 0: one op.
    """
    dp = (ep // tp if ep > 1 else 1) if dp is None else dp
    for name, value in (("--ep", ep), ("--dp", dp), ("--tp", tp)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a positive int, got {value!r}")
    if ep not in (1, dp * tp):
        raise PlanError(f"--ep {ep} with --dp {dp} --tp {tp}: the engines spread the experts over every GPU, so "
                        f"the EP size must equal TP x DP = {dp * tp} (or 1: no EP, one full copy per DP rank)")
    if ep == 1 and tp > 1:
        raise PlanError(f"--tp {tp} without EP shards every expert by TP (the intermediate size), which the "
                        f"fused path does not run; allowed: --ep {tp * dp} (TP x EP), or --tp 1")
    can_fuse = tp == 1 and dp == ep > 1
    if fused and not can_fuse:
        raise PlanError(f"the MegaMoE fused path runs with attention TP 1 and DP = EP > 1, got --tp {tp} --dp {dp} "
                        f"--ep {ep}")
    fused = can_fuse if fused is None else fused
    layout = ("dp-ep" if fused else "replicate" if ep == 1 else "tp-ep" if dp == 1 else "ep" if tp == 1 else TP_DP)
    if wire not in WIRES:
        raise PlanError(f"--wire {wire!r}; allowed: {', '.join(WIRES)}")
    if wire == "fp8" and not fused:
        raise PlanError("--wire fp8 needs EP > 1 with the fused path: without MegaMoE's dispatch no tokens cross "
                        "our wire (use --wire bf16)")
    if not 0 < utilization <= 1:
        raise PlanError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if not 0 < buffer_share <= 1:
        raise PlanError(f"--buffer-share must be in (0, 1], got {buffer_share}")
    if tokens is not None and tokens < 1:
        raise PlanError(f"--tokens must be a positive int, got {tokens}")
    if not isinstance(decode_tokens, int) or decode_tokens < 0:
        raise PlanError(f"--decode-capacity must be an int >= 0 (0: one MegaMoE), got {decode_tokens!r}")
    if gpu_bytes <= 0 or reserve_bytes < 0:
        raise PlanError(f"GPU memory must be > 0 and the reserve >= 0, got {gpu_bytes} and {reserve_bytes} bytes")
    N, R = layer.spec.num_experts, redundant_experts
    if not isinstance(R, int) or R < 0:
        raise PlanError(f"--redundant-experts must be an int >= 0, got {R!r}")
    if R and (N + R) % ep:
        raise PlanError(f"--redundant-experts {R}: the {N} experts + {R} redundant = {N + R} slots must divide over "
                        f"EP {ep}; allowed: R with (N + R) % EP == 0, e.g. {R + (-(N + R)) % ep}")
    # sizes depend on the slot count alone: any map of N + R slots stands for the placement
    physical = tuple(range(N)) + tuple(e % N for e in range(R)) if R else None
    try:
        spec = layer.spec.for_rank(0, ep, physical_experts=physical)
    except SpecError as exc:
        raise PlanError(f"{layer.name} at EP {ep}: {exc}") from None
    backend = experts_backend_for(spec, experts_backend)
    if backend not in ("triton", "torch"):
        raise PlanError(f"--experts-backend {experts_backend!r}; allowed: auto, triton, torch")
    if transport is None and not fused:
        transport = "local"  # no MegaMoE transport: the op is the experts step alone
    elif transport is None:  # what MegaMoE's transport="auto" picks on the deployment's CUDA GPUs
        from ..ep import auto_transport
        transport = auto_transport(ep, "cuda", backend, wire, spec)
    if backend == "triton":
        from ..experts import SUPPORTED
        if spec.scheme not in SUPPORTED:
            raise PlanError(f"--experts-backend triton: the fused kernels do not take scheme {spec.scheme.value} "
                            f"yet (they take {', '.join(s.value for s in SUPPORTED)}); use auto or torch")
    if layer.moe_layers is None:
        raise PlanError(f"{layer.name}: its MoE layer count is not known here, so the weights per rank cannot be "
                        f"sized; allowed: the model's config.json (num_hidden_layers, first_k_dense_replace), or a "
                        f"preset with a known count")
    # every rank owns the same number of experts under linear placement: rank 0 stands for all
    weight_bytes = layer.moe_layers * prepared_nbytes(spec)
    engine = int(gpu_bytes * utilization)
    # experts mode behind the engine's DP dispatch: each rank's call holds every DP rank's tokens
    gather = 1 if fused or dp == 1 or ep == 1 else dp
    op_ep = ep if fused else 1

    def sizes(t: int) -> dict[str, int]:
        return buffer_sizes(spec, op_ep, gather * t, wire, transport=transport, experts_backend=backend)

    # every decode op (atom_moe.ep.decode_capacities: the small one below decode_tokens too)
    decode_total = sum(sum(sizes(c).values()) for c in decode_capacities(decode_tokens)) \
        if fused and decode_tokens else 0

    def decode_bytes(t: int) -> int:  # the decode op exists only below a larger budget
        return decode_total if 0 < decode_tokens < t else 0

    def all_buffers(t: int) -> int:
        return sum(sizes(t).values()) + decode_bytes(t)

    def fits_int32(t: int) -> bool:
        try:
            check_limits(spec, op_ep, gather * t, wire, transport=transport, experts_backend=backend)
        except BufferLimitError:
            return False
        return True

    def fits_memory(t: int) -> bool:
        return weight_bytes + all_buffers(t) + reserve_bytes <= engine

    max_int32 = largest_true(fits_int32, SEARCH_CAP)
    max_mem = largest_true(fits_memory, SEARCH_CAP)
    top = min(max_int32, max_mem)
    within_share = largest_true(lambda t: all_buffers(t) <= buffer_share * engine, top) if top else 0
    recommended = round_budget(within_share)
    budget = tokens if tokens is not None else max(1, recommended or top)
    buffers = sizes(budget)
    problems = []
    if not fits_int32(budget):
        bad = [name for name, v in int32_quantities(spec, op_ep, gather * budget, wire, transport, backend)
               if v > INT32_MAX]
        problems.append(f"{budget} tokens per rank overflow the int32 range in: {'; '.join(bad)}; the largest safe "
                        f"budget is {max_int32}" + ("" if max_int32 else " (none fits: raise the EP size)"))
    if not fits_memory(budget):
        need = weight_bytes + all_buffers(budget) + reserve_bytes
        problems.append(f"{budget} tokens per rank need {need / GiB:.2f} GiB (expert weights "
                        f"{weight_bytes / GiB:.2f} + MegaMoE buffers {all_buffers(budget) / GiB:.2f} + reserve "
                        f"{reserve_bytes / GiB:.2f}) but the engine gets {engine / GiB:.2f} GiB "
                        f"({utilization:.2f} of {gpu_bytes / GiB:.2f}); the largest budget that fits is {max_mem}"
                        + ("" if max_mem else " (none fits: raise the EP size or lower the reserve)"))
    return Plan(layer, spec, ep, dp, tp, budget, wire, transport, backend, gpu_bytes, utilization, reserve_bytes,
                weight_bytes, sum(buffers.values()), buffers,
                int32_quantities(spec, op_ep, gather * budget, wire, transport, backend), max_int32, max_mem, problems,
                layout, fused, gather * budget, recommended, buffer_share,
                decode_tokens if decode_bytes(budget) else 0, decode_bytes(budget))


def instance_size(layer: ModelLayer, layout: str, gpus: int, tokens: int, **kw) -> int | None:
    """The fewest GPUs (a power of two up to `gpus`) on which `layout` fits `tokens` per rank; None if none."""
    n = 1
    while n <= gpus:
        tp, dp, ep = layout_sizes(layout, n)
        if layout == "replicate" or (layer.spec.num_experts - layer.spec.shared_experts) % n == 0:
            try:
                plan = make_plan(layer, ep=ep, dp=dp, tp=tp, tokens=tokens, fused=(layout == "dp-ep" and n > 1)
                                 if layout in ("dp-ep", "ep") else None, **kw)
            except PlanError:
                plan = None
            if plan is not None and not plan.problems:
                return n
        if layout == "replicate":
            return None  # one copy per GPU: more GPUs do not make a copy fit
        n *= 2
    return None


def verdict(layer: ModelLayer, gpus: int, **kw) -> str:
    """One line: whether EP is expected to pay against plain replication on these GPUs."""
    one = make_plan(layer, ep=1, dp=1, **{k: v for k, v in kw.items() if k != "wire"})
    if one.max_tokens >= 1 and not one.problems:
        return (f"verdict: EP is not expected to pay here: {layer.name} fits on one GPU (routed experts "
                f"{one.weight_bytes / GiB:.1f} GiB of the engine's {one.engine_bytes / GiB:.1f} GiB), so {gpus} "
                f"replicas need no all-to-all; EP pays only when each replica's KV cache limits the batch. "
                f"Measure both (a field report saw EP 8 lose 28-38% to replication for a mid-size model)")
    return (f"verdict: EP is needed: without it the routed experts alone take {one.weight_bytes / GiB:.1f} GiB per "
            f"GPU, more than fits in the engine's {one.engine_bytes / GiB:.1f} GiB with the reserve")


def engine_flags(plan: Plan, engine: str, model: str = "<model>") -> str:
    """The command line that starts `engine` with this plan's layout and budget."""
    B, G, U, N = plan.tokens, plan.ep, plan.utilization, plan.gpus
    env = "ATOM_USE_FLYDSL_FUSED=1" if plan.fused else "ATOM_USE_FLYDSL=1"  # fused EP; else the experts step
    if plan.fused and plan.decode_tokens not in (0, DECODE_TOKENS):  # the plugins' default needs no flag
        env += f" ATOM_MOE_DECODE_TOKENS={plan.decode_tokens}"
    elif plan.fused and not plan.decode_tokens and DECODE_TOKENS < plan.tokens:  # asked for one op
        env += " ATOM_MOE_DECODE_TOKENS=0"
    if plan.spec.scheme is Scheme.A8W4:  # the plugins run MXFP4 layers as a16w4 unless told (docs/vllm.md)
        env += " ATOM_MOE_MXFP4_ACT=fp8"
    if engine == "vllm":
        # vLLM's --max-num-batched-tokens is per DP engine, i.e. per rank with TP 1 (docs/vllm.md)
        parts = [env, "vllm serve", model, f"--tensor-parallel-size {plan.tp}", f"--data-parallel-size {plan.dp}"]
        parts += ["--enable-expert-parallel"] if G > 1 else []
        parts += [f"--max-num-batched-tokens {B}", f"--gpu-memory-utilization {U:.2f}"]
        if B < 512:  # vLLM captures CUDA graphs up to 512 tokens by default; the op must hold the largest
            parts.append(f"--max-num-seqs {B} --compilation-config '{{\"max_cudagraph_capture_size\": {B}}}'")
        return " ".join(parts)
    if engine == "sglang":
        # with --enable-dp-attention SGLang divides --chunked-prefill-size by the DP size (server_args.py);
        # the plugin sizes for max(chunk per rank, decode graph size, --max-running-requests) (docs/sglang.md)
        parts = [env, "python -m sglang.launch_server --model-path", model]
        if plan.layout == "replicate":  # N independent schedulers behind SGLang's DP controller
            parts += [f"--tp-size 1 --dp-size {plan.dp}"] if plan.dp > 1 else ["--tp-size 1"]
            chunk = B
        elif plan.dp > 1:  # DP attention + EP, with our dispatch (megamoe) or SGLang's (none)
            a2a = "megamoe" if plan.fused else "none"
            parts += [f"--tp-size {N} --ep-size {G} --dp-size {plan.dp} --enable-dp-attention --moe-a2a-backend {a2a}"]
            chunk = B * plan.dp
        else:  # TP + EP: every rank sees every token
            parts += [f"--tp-size {N} --ep-size {G} --moe-a2a-backend none"]
            chunk = B
        # fused shared experts run on our path as routed ones (docs/sglang.md); else SGLang runs them itself
        fusion = "--enforce-shared-experts-fusion" if plan.spec.shared_experts else "--disable-shared-experts-fusion"
        parts += [fusion, f"--chunked-prefill-size {chunk}",
                  f"--max-running-requests {B}", f"--cuda-graph-max-bs-decode {min(B, 512)}",
                  f"--mem-fraction-static {U:.2f}"]
        return " ".join(parts)
    raise PlanError(f"unknown engine {engine!r}; allowed: {', '.join(ENGINES)}")


def _line(label: str, n: int) -> str:
    return f"  {label:<62} {n:>16,} B {n / GiB:9.3f} GiB"


def format_plan(plan: Plan, engines: tuple[str, ...], model: str) -> str:
    """The report `atom-moe plan` prints."""
    s, L = plan.spec, plan.layer
    out = [f"model: {L.name}: {L.moe_layers} MoE layers, scheme {s.scheme.value}, H={s.hidden_size} "
           f"I={s.intermediate_size} E={s.num_experts} top_k={s.top_k}",
           f"layout {plan.layout}: {LAYOUTS.get(plan.layout, 'TP x DP attention + EP with the engine dispatch, our experts step')}",
           f"  {plan.gpus} GPU(s), EP {plan.ep} ("
           + (f"{s.num_local_experts} slots per rank: {s.num_local_experts - s.shared_experts} routed + "
              f"{s.shared_experts} fused shared" if s.shared_experts
              else f"{s.num_local_experts} slots per rank: {s.num_physical_experts} = {s.num_experts} experts + "
              f"{s.num_physical_experts - s.num_experts} redundant" if s.redundant
              else f"{s.num_local_experts} experts per rank") + "), attention DP "
           f"{plan.dp}, TP {plan.tp}; transport {plan.transport if plan.fused else 'none (no MegaMoE dispatch)'}, "
           f"wire {plan.wire}, experts {plan.backend}",
           f"token budget: {plan.tokens} tokens per rank per forward"
           + (f" ({plan.rows_per_call} rows per MoE call: the engine gathers every DP rank's tokens)"
              if plan.rows_per_call != plan.tokens else ""),
           f"recommended budget: {plan.recommended:,} tokens per rank (the largest round budget whose MegaMoE "
           f"buffers take at most --buffer-share {plan.buffer_share:.2f} of the engine's memory, leaving the rest for "
           f"weights and the KV cache); maximum: {plan.max_tokens:,}",
           "",
           f"memory per rank (GPU {plan.gpu_bytes / GiB:.2f} GiB x utilization {plan.utilization:.2f} = "
           f"{plan.engine_bytes / GiB:.2f} GiB for the engine):",
           _line(f"routed-expert weights ({L.moe_layers} layers x {plan.weight_bytes // L.moe_layers:,} B)",
                 plan.weight_bytes),
           _line("MegaMoE buffers (once per rank, shared by all layers)", plan.buffer_bytes + plan.decode_bytes)]
    if plan.decode_tokens:
        out.append(_line(f"  prefill op ({plan.tokens} tokens per rank)", plan.buffer_bytes))
    for name, b in sorted(plan.buffers.items(), key=lambda kv: -kv[1]):
        out.append(_line(f"  {'  ' if plan.decode_tokens else ''}{name}", b))
    if plan.decode_tokens:
        caps = " and ".join(map(str, decode_capacities(plan.decode_tokens)))
        out.append(_line(f"  decode ops ({caps} tokens per rank; same weights, no copy)", plan.decode_bytes))
    out += [_line("reserve asked for (dense weights, activations, min KV)", plan.reserve_bytes),
            _line("left for the rest of the model and the KV cache", plan.left_bytes - plan.reserve_bytes),
            _line(f"leave free outside the engine ({1 - plan.utilization:.2f} of the GPU)",
                  plan.gpu_bytes - plan.engine_bytes),
            "",
            f"int32-limited quantities at {plan.tokens} tokens per rank (limit 2**31 - 1 = {INT32_MAX:,}):",
            f"  {'quantity':<62} {'value':>16} {'margin':>8}"]
    for name, value in sorted(plan.quantities, key=lambda kv: -kv[1]):
        margin = INT32_MAX / value if value else math.inf
        flag = "  OVER" if value > INT32_MAX else ""
        out.append(f"  {name:<62} {value:>16,} {margin:>7.2f}x{flag}")
    cap = lambda t: f">= {SEARCH_CAP:,} (searched up to there)" if t >= SEARCH_CAP else f"{t:,}"  # noqa: E731
    out += ["",
            f"largest safe token budget per rank: {cap(plan.max_tokens)} "
            f"(int32 limits: {cap(plan.max_tokens_int32)}; memory: {cap(plan.max_tokens_memory)})"]
    if not plan.problems:
        out += ["", "engine flags:"]
        out += [f"  {e}: {engine_flags(plan, e, model)}" for e in engines]
        if plan.wire != "bf16":  # plugins/{vllm,sglang} build the op with wire="bf16"
            out.append(f"  note: the engine plugins run the bf16 wire today; this {plan.wire}-wire plan is for "
                       f"direct MegaMoE use")
    else:
        out += ["", "DOES NOT FIT:"] + [f"  - {p}" for p in plan.problems]
    return "\n".join(out)


def format_layouts(layer: ModelLayer, gpus: int, decode: int, prefill: int, **kw) -> str:
    """Every layout on `gpus` GPUs side by side, with decode/prefill instance sizes and the EP verdict."""
    out = [f"layouts on {gpus} GPU(s) (recommended / maximum tokens per rank; GiB per rank; instance = fewest GPUs "
           f"that fit {decode} decode or {prefill} prefill tokens per rank):",
           f"  {'layout':<10} {'tp':>3} {'dp':>3} {'ep':>3} {'weights':>8} {'buffers':>8} {'left':>8} "
           f"{'recommended':>12} {'maximum':>9} {'decode':>7} {'prefill':>8}"]
    for name in LAYOUTS:
        tp, dp, ep = layout_sizes(name, gpus)
        row = f"  {name:<10} {tp:>3} {dp:>3} {ep:>3}"
        if name == "replicate":
            tp, dp, ep = 1, 1, 1  # a copy is one GPU: plan one, the others are the same
        try:
            plan = make_plan(layer, ep=ep, dp=dp, tp=tp, fused={"dp-ep": ep > 1, "ep": False}.get(name), **kw)
        except PlanError as exc:
            out.append(f"{row}  not possible: {exc}")
            continue
        sizes = [instance_size(layer, name, gpus, t, **{k: v for k, v in kw.items() if k != "wire"})
                 for t in (decode, prefill)]
        shown = [f"{n}" if n else "none" for n in sizes]
        if plan.max_tokens < 1:
            out.append(f"{row} {plan.weight_bytes / GiB:>8.1f}  does not fit: weights + reserve "
                       f"{(plan.weight_bytes + plan.reserve_bytes) / GiB:.1f} GiB > the engine's "
                       f"{plan.engine_bytes / GiB:.1f} GiB per GPU")
            continue
        out.append(f"{row} {plan.weight_bytes / GiB:>8.1f} {(plan.buffer_bytes + plan.decode_bytes) / GiB:>8.1f} "
                   f"{(plan.left_bytes - plan.reserve_bytes) / GiB:>8.1f} {plan.recommended:>12,} "
                   f"{plan.max_tokens:>9,} {shown[0]:>7} {shown[1]:>8}")
    out.append("  (tp-ep: tokens per engine, every rank sees all of them; the others: per DP rank. "
               "left: GiB per rank for the rest of the model and the KV cache at the recommended budget)")
    out.append(verdict(layer, gpus, **kw))
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `atom-moe plan`'s options."""
    parser.add_argument("model", help=f"a preset ({', '.join(PRESETS)}; a -tpN preset is one TP rank's shard of "
                                      f"the layer) or a HuggingFace config.json (or its directory)")
    parser.add_argument("--scheme", default=None, choices=[s.value for s in Scheme],
                        help="override the checkpoint's scheme; none: from its quantization_config")
    parser.add_argument("--gpus", type=positive_int, default=None,
                        help="GPUs you have; no plan uses more; none: this machine's GPU count, else TP x DP")
    parser.add_argument("--layout", choices=list(LAYOUTS), default=None,
                        help="the layout to detail on --gpus GPUs; none: from --tp/--dp/--ep, else dp-ep "
                             "(or replicate where the experts do not divide over the GPUs)")
    parser.add_argument("--ep", type=positive_int, default=None, help="EP size (TP x DP, or 1: no EP); none: TP x DP")
    parser.add_argument("--dp", type=positive_int, default=None, help="attention DP size; none: EP / TP")
    parser.add_argument("--tp", type=positive_int, default=1, help="attention TP size (the fused path runs with 1)")
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help="token budget per rank to check; none: plan the recommended one")
    parser.add_argument("--buffer-share", type=fraction, default=0.1,
                        help="share of the engine's memory the MegaMoE buffers may take at the recommended budget; "
                             "the rest stays for weights and the KV cache")
    parser.add_argument("--decode-tokens", type=positive_int, default=256,
                        help="tokens per rank a decode instance must hold (its batch)")
    parser.add_argument("--prefill-tokens", type=positive_int, default=8192,
                        help="tokens per rank a prefill instance must hold (its chunk)")
    parser.add_argument("--decode-capacity", type=nonnegative_int, default=DECODE_TOKENS,
                        help="fused path: tokens per rank of the decode MegaMoE built beside the budget-sized one "
                             "(the plugins' ATOM_MOE_DECODE_TOKENS); 0: one MegaMoE")
    parser.add_argument("--gpu-memory-gib", type=positive_float, default=None,
                        help="memory per GPU in GiB; none: this machine's GPU (required without one)")
    parser.add_argument("--gpu-memory-utilization", type=fraction, default=0.9,
                        help="fraction of the GPU the engine may use (vLLM --gpu-memory-utilization, "
                             "SGLang --mem-fraction-static)")
    parser.add_argument("--reserve-gib", type=nonnegative_float, default=10.0,
                        help="memory to keep for everything but the routed experts and MegaMoE buffers: dense and "
                             "attention weights, activations, a minimal KV cache")
    parser.add_argument("--wire", default="bf16", choices=WIRES, help="dispatch wire format (fused, EP > 1)")
    parser.add_argument("--redundant-experts", type=nonnegative_int, default=0,
                        help="extra physical expert slots (EPLB): weights and buffers count N + this many slots")
    parser.add_argument("--fused-shared-experts", type=nonnegative_int, default=0,
                        help="shared experts the engine fuses as routed ones (e.g. 1: E 257 / top_k 9 for a 256-expert "
                             "top-8 model); each EP rank holds a replica")
    parser.add_argument("--experts-backend", default="auto", choices=("auto", "triton", "torch"),
                        help="experts backend: auto is what the op picks on a GPU (Triton where it takes the scheme)")
    parser.add_argument("--engine", action="append", choices=ENGINES, help="repeatable; none: both")
    parser.add_argument("--model-path", default=None, help="model path/name for the engine commands; none: MODEL")


def with_fused_shared(layer: ModelLayer, shared: int, redundant: int = 0) -> ModelLayer:
    """The layer with `shared` shared experts fused as routed ones: E + S experts, top_k + S slots."""
    if not shared:
        return layer
    if layer.spec.shared_experts:
        raise PlanError(f"--fused-shared-experts {shared}: {layer.name} already fuses {layer.spec.shared_experts} "
                        f"shared expert(s) (E {layer.spec.num_experts}, top-k {layer.spec.top_k}); drop the option")
    if redundant:
        raise PlanError("--fused-shared-experts with --redundant-experts: plan one of them (the plugins take fused "
                        "shared experts without EPLB)")
    s = layer.spec
    return replace(layer, spec=replace(s, num_experts=s.num_experts + shared, top_k=s.top_k + shared,
                                       shared_experts=shared))


def run(args: argparse.Namespace) -> int:
    """Entry point of `atom-moe plan`; returns the process exit code."""
    try:
        layer = with_fused_shared(load_model(args.model, args.scheme), args.fused_shared_experts,
                                  args.redundant_experts)
        if args.gpu_memory_gib is None:
            if not torch.cuda.is_available():
                raise PlanError("no CUDA device here: pass --gpu-memory-gib (e.g. 140.4 for an H200)")
            gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        else:
            gpu_bytes = int(args.gpu_memory_gib * GiB)
        explicit = args.ep is not None or args.dp is not None or args.tp != 1
        if args.layout is not None and explicit:
            raise PlanError("--layout sets TP, DP and EP from --gpus: drop --tp/--dp/--ep, or drop --layout")
        tp = args.tp
        dp = args.dp or ((args.ep // tp if args.ep and args.ep > 1 else 1) if args.ep else 1)
        ep = args.ep or tp * dp
        gpus = args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() and not explicit else tp * dp)
        if explicit and tp * dp > gpus:
            raise PlanError(f"--tp {tp} x --dp {dp} = {tp * dp} GPUs, but --gpus {gpus}: allowed layouts use at "
                            f"most {gpus} GPUs")
        layout = args.layout
        if layout is None and not explicit:  # the docs' lead layout, where the experts divide over the GPUs
            layout = "dp-ep" if gpus > 1 and (layer.spec.num_experts - layer.spec.shared_experts) % gpus == 0 else "replicate"
        fused = None
        if layout is not None:
            tp, dp, ep = layout_sizes(layout, gpus)
            fused = {"dp-ep": ep > 1, "ep": False}.get(layout)
        kw = dict(gpu_bytes=gpu_bytes, utilization=args.gpu_memory_utilization,
                  reserve_bytes=int(args.reserve_gib * GiB), experts_backend=args.experts_backend,
                  buffer_share=args.buffer_share, decode_tokens=args.decode_capacity)
        plan = make_plan(layer, ep=ep, dp=dp, tp=tp, tokens=args.tokens, wire=args.wire, fused=fused,
                         redundant_experts=args.redundant_experts, **kw)
        summary = format_layouts(layer, gpus, args.decode_tokens, args.prefill_tokens, **kw)
    except (PlanError, SpecError, ValueError) as exc:
        print(f"atom-moe plan: error: {exc}", file=sys.stderr)
        return 2
    model = args.model_path or args.model
    print(format_plan(plan, tuple(args.engine or ENGINES), model))
    print()
    print(summary)
    if plan.problems:
        print("atom-moe plan: the requested budget does not fit: " + " | ".join(plan.problems), file=sys.stderr)
        return 1
    return 0
