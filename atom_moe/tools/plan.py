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
from dataclasses import dataclass, field

import torch

from ..ep.buffers import INT32_MAX, INT64_INDEXED, WIRES, BufferLimitError, buffer_plan, buffer_sizes, check_limits, largest_true
from ..checkpoint.config import ModelLayer, load_model
from ..spec import MoESpec, SpecError
from ..weights import prepared_nbytes

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

    @property
    def engine_bytes(self) -> int:
        return int(self.gpu_bytes * self.utilization)

    @property
    def left_bytes(self) -> int:
        """What the engine has left for everything else (dense weights, activations, KV cache)."""
        return self.engine_bytes - self.weight_bytes - self.buffer_bytes

    @property
    def max_tokens(self) -> int:
        return min(self.max_tokens_int32, self.max_tokens_memory)


def make_plan(layer: ModelLayer, *, ep: int, dp: int | None = None, tp: int = 1, tokens: int | None = None,
              gpu_bytes: int, utilization: float = 0.9, reserve_bytes: int = 0, wire: str = "bf16",
              experts_backend: str = "auto", transport: str | None = None) -> Plan:
    """Plan one layout; `tokens=None` plans the largest safe budget. Raises PlanError on bad input."""
    dp = ep if dp is None else dp
    for name, value in (("--ep", ep), ("--dp", dp), ("--tp", tp)):
        if not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a positive int, got {value!r}")
    if tp != 1:
        raise PlanError(f"--tp {tp}: the MegaMoE fused path runs with attention TP 1 (DP attention + EP); "
                        f"use --tp 1 --dp {tp * dp} --ep {tp * dp}")
    if ep != dp * tp:
        raise PlanError(f"--ep {ep} with --dp {dp} --tp {tp}: the engines spread the experts over every GPU, so "
                        f"the EP size must equal TP x DP = {dp * tp}")
    if wire not in WIRES:
        raise PlanError(f"--wire {wire!r}; allowed: {', '.join(WIRES)}")
    if wire == "fp8" and ep == 1:
        raise PlanError("--wire fp8 needs EP > 1: at EP 1 the local transport moves no tokens (use --wire bf16)")
    if not 0 < utilization <= 1:
        raise PlanError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    if tokens is not None and tokens < 1:
        raise PlanError(f"--tokens must be a positive int, got {tokens}")
    if gpu_bytes <= 0 or reserve_bytes < 0:
        raise PlanError(f"GPU memory must be > 0 and the reserve >= 0, got {gpu_bytes} and {reserve_bytes} bytes")
    try:
        spec = layer.spec.for_rank(0, ep)
    except SpecError as exc:
        raise PlanError(f"{layer.name} at EP {ep}: {exc}") from None
    backend = experts_backend_for(spec, experts_backend)
    if backend not in ("triton", "torch"):
        raise PlanError(f"--experts-backend {experts_backend!r}; allowed: auto, triton, torch")
    if transport is None:  # what MegaMoE's transport="auto" picks on the deployment's CUDA GPUs
        from ..ep import auto_transport
        transport = auto_transport(ep, "cuda", backend, wire, spec)
    if backend == "triton":
        from ..experts import SUPPORTED
        if spec.scheme not in SUPPORTED:
            raise PlanError(f"--experts-backend triton: the fused kernels do not take scheme {spec.scheme.value} "
                            f"yet (they take {', '.join(s.value for s in SUPPORTED)}); use auto or torch")
    # every rank owns the same number of experts under linear placement: rank 0 stands for all
    weight_bytes = layer.moe_layers * prepared_nbytes(spec)
    engine = int(gpu_bytes * utilization)

    def sizes(t: int) -> dict[str, int]:
        return buffer_sizes(spec, ep, t, wire, transport=transport, experts_backend=backend)

    def fits_int32(t: int) -> bool:
        try:
            check_limits(spec, ep, t, wire, transport=transport, experts_backend=backend)
        except BufferLimitError:
            return False
        return True

    def fits_memory(t: int) -> bool:
        return weight_bytes + sum(sizes(t).values()) + reserve_bytes <= engine

    max_int32 = largest_true(fits_int32, SEARCH_CAP)
    max_mem = largest_true(fits_memory, SEARCH_CAP)
    budget = tokens if tokens is not None else max(1, min(max_int32, max_mem))
    buffers = sizes(budget)
    problems = []
    if not fits_int32(budget):
        bad = [name for name, v in int32_quantities(spec, ep, budget, wire, transport, backend) if v > INT32_MAX]
        problems.append(f"{budget} tokens per rank overflow the int32 range in: {'; '.join(bad)}; the largest safe "
                        f"budget is {max_int32}" + ("" if max_int32 else " (none fits: raise the EP size)"))
    if not fits_memory(budget):
        need = weight_bytes + sum(buffers.values()) + reserve_bytes
        problems.append(f"{budget} tokens per rank need {need / GiB:.2f} GiB (expert weights "
                        f"{weight_bytes / GiB:.2f} + MegaMoE buffers {sum(buffers.values()) / GiB:.2f} + reserve "
                        f"{reserve_bytes / GiB:.2f}) but the engine gets {engine / GiB:.2f} GiB "
                        f"({utilization:.2f} of {gpu_bytes / GiB:.2f}); the largest budget that fits is {max_mem}"
                        + ("" if max_mem else " (none fits: raise the EP size or lower the reserve)"))
    return Plan(layer, spec, ep, dp, tp, budget, wire, transport, backend, gpu_bytes, utilization, reserve_bytes,
                weight_bytes, sum(buffers.values()), buffers,
                int32_quantities(spec, ep, budget, wire, transport, backend), max_int32, max_mem, problems)


def engine_flags(plan: Plan, engine: str, model: str = "<model>") -> str:
    """The command line that starts `engine` with this plan's layout and budget."""
    B, G, U = plan.tokens, plan.ep, plan.utilization
    env = "ATOM_USE_FLYDSL_FUSED=1" if G > 1 else "ATOM_USE_FLYDSL=1"  # fused EP at EP > 1; else the experts step
    if engine == "vllm":
        # vLLM's --max-num-batched-tokens is per DP engine, i.e. per rank with TP 1 (docs/vllm.md)
        parts = [env, "vllm serve", model, "--tensor-parallel-size 1", f"--data-parallel-size {G}"]
        parts += ["--enable-expert-parallel"] if G > 1 else []
        parts += [f"--max-num-batched-tokens {B}", f"--gpu-memory-utilization {U:.2f}"]
        if B < 512:  # vLLM captures CUDA graphs up to 512 tokens by default; the op must hold the largest
            parts.append(f"--max-num-seqs {B} --compilation-config '{{\"max_cudagraph_capture_size\": {B}}}'")
        return " ".join(parts)
    if engine == "sglang":
        # with --enable-dp-attention SGLang divides --chunked-prefill-size by the DP size (server_args.py);
        # the plugin sizes for max(chunk per rank, decode graph size, --max-running-requests) (docs/sglang.md)
        parts = [env, "python -m sglang.launch_server --model-path", model, f"--tp-size {G}"]
        parts += [f"--ep-size {G} --dp-size {G} --enable-dp-attention --moe-a2a-backend megamoe"] if G > 1 else []
        parts += ["--disable-shared-experts-fusion", f"--chunked-prefill-size {B * G}",
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
           f"layout: {plan.ep} GPU(s), EP {plan.ep} ({s.num_local_experts} experts per rank), attention DP "
           f"{plan.dp}, TP {plan.tp}; transport {plan.transport}, wire {plan.wire}, experts {plan.backend}",
           f"token budget: {plan.tokens} tokens per rank per forward",
           "",
           f"memory per rank (GPU {plan.gpu_bytes / GiB:.2f} GiB x utilization {plan.utilization:.2f} = "
           f"{plan.engine_bytes / GiB:.2f} GiB for the engine):",
           _line(f"routed-expert weights ({L.moe_layers} layers x {plan.weight_bytes // L.moe_layers:,} B)",
                 plan.weight_bytes),
           _line("MegaMoE buffers (once per rank, shared by all layers)", plan.buffer_bytes)]
    for name, b in sorted(plan.buffers.items(), key=lambda kv: -kv[1])[:6]:
        out.append(_line(f"  {name}", b))
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `atom-moe plan`'s options."""
    parser.add_argument("model", help="a preset (deepseek-v3, kimi-k2, gpt-oss-120b, qwen3-235b-a22b, glm-4.5) "
                                      "or a HuggingFace config.json (or its directory)")
    parser.add_argument("--scheme", default=None, help="override the checkpoint's scheme (bf16, fp8, a16w4, a8w4)")
    parser.add_argument("--ep", type=int, default=None, help="EP size = GPUs (default: --dp, else 1)")
    parser.add_argument("--dp", type=int, default=None, help="attention DP size (default: --ep)")
    parser.add_argument("--tp", type=int, default=1, help="attention TP size (the fused path runs with 1)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="token budget per rank to check (default: plan the largest safe one)")
    parser.add_argument("--gpu-memory-gib", type=float, default=None,
                        help="memory per GPU in GiB (default: this machine's GPU; required without one)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="fraction of the GPU the engine may use (vLLM --gpu-memory-utilization, "
                             "SGLang --mem-fraction-static)")
    parser.add_argument("--reserve-gib", type=float, default=10.0,
                        help="memory to keep for everything but the routed experts and MegaMoE buffers: dense and "
                             "attention weights, activations, a minimal KV cache (default 10)")
    parser.add_argument("--wire", default="bf16", choices=WIRES, help="dispatch wire format (EP > 1)")
    parser.add_argument("--experts-backend", default="auto", choices=("auto", "triton", "torch"))
    parser.add_argument("--engine", action="append", choices=ENGINES, help="repeatable; default: both")
    parser.add_argument("--model-path", default="<model>", help="model path/name to put in the engine commands")


def run(args: argparse.Namespace) -> int:
    """Entry point of `atom-moe plan`; returns the process exit code."""
    try:
        layer = load_model(args.model, args.scheme)
        if args.gpu_memory_gib is None:
            if not torch.cuda.is_available():
                raise PlanError("no CUDA device here: pass --gpu-memory-gib (e.g. 140.4 for an H200)")
            gpu_bytes = torch.cuda.get_device_properties(0).total_memory
        else:
            gpu_bytes = int(args.gpu_memory_gib * GiB)
        ep = args.ep or args.dp or 1
        plan = make_plan(layer, ep=ep, dp=args.dp, tp=args.tp, tokens=args.tokens, gpu_bytes=gpu_bytes,
                         utilization=args.gpu_memory_utilization, reserve_bytes=int(args.reserve_gib * GiB),
                         wire=args.wire, experts_backend=args.experts_backend)
    except (PlanError, SpecError, ValueError) as exc:
        print(f"atom-moe plan: {exc}", file=sys.stderr)
        return 2
    model = args.model_path if args.model_path != "<model>" else args.model
    print(format_plan(plan, tuple(args.engine or ENGINES), model))
    if plan.problems:
        print("atom-moe plan: the requested budget does not fit: " + " | ".join(plan.problems), file=sys.stderr)
        return 1
    return 0
