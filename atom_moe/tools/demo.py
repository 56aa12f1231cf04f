"""`atom-moe demo`: build a preset layer with random weights, run our paths, compare with fp32.

Both paths run on every machine: the Triton kernels (on a CPU inside Triton's interpreter,
which executes the kernels' code with numpy, slowly) and their torch twin. The layer is
scaled to what the device runs in seconds, and the header says how: on a CPU an
interpreter-sized layer (H128 I128, 8 experts, top-4, 16 tokens), on a GPU the preset's
real hidden and intermediate sizes with up to 64 experts. With --ep N the layer is split
over N expert-parallel ranks simulated in this process; the ranks' shares are summed.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..presets import PRESETS, preset, scaled_down
from ..reference import ReferenceWeights, reference_moe
from ..spec import MoESpec, Scheme
from ..weights import PreparedWeights, prepare_stacked
from .args import RunFailure, UsageError, positive_int
from .synthetic import random_layer, random_tokens

Path = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PreparedWeights, MoESpec], torch.Tensor]

# (H, I, E, top_k cap, tokens): the CPU layer, sized so all four schemes' Triton runs in the
# interpreter take ~15 s together on one core (a8w4's e4m3 decode is the slowest, ~6 s)
CPU_LAYER = (128, 128, 8, 4, 16)
GPU_MAX_EXPERTS = 64  # real H and I; 64 experts keep the four schemes' weights and fp32 reference ~30 GB
GPU_TOKENS = 256


@dataclass
class PathChoice:
    name: str
    fn: Path | None
    note: str  # why it is unavailable, or how it runs
    schemes: tuple[Scheme, ...] = tuple(Scheme)  # the schemes this path implements
    interpreted: bool = False  # runs in Triton's interpreter: no compilation, one timed call is enough


def available_paths(device: torch.device, triton: bool = True) -> list[PathChoice]:
    """Every experts path, best first; unavailable ones carry the reason."""
    from ..experts_torch import experts_torch

    paths = []
    if not triton:
        paths.append(PathChoice("triton", None, "left out (--no-triton)"))
    else:
        interpreting = os.environ.get("TRITON_INTERPRET") == "1"
        if device.type == "cpu" and not interpreting:
            paths.append(PathChoice("triton", None, "unavailable on the CPU without TRITON_INTERPRET=1"))
        else:
            try:
                from ..experts import SUPPORTED, fused_experts

                note = "Triton kernels in Triton's interpreter (CPU)" if device.type == "cpu" else "Triton kernels"
                paths.append(PathChoice("triton", fused_experts, note, SUPPORTED, device.type == "cpu"))
            except ImportError as exc:  # triton missing, or the kernels not built in this install
                paths.append(PathChoice("triton", None, f"unavailable: {exc}"))
    paths.append(PathChoice("torch", experts_torch, "torch twin (host-synced, not graph-safe)"))
    return paths


def demo_spec(model: str, device: torch.device, scheme: Scheme, tokens: int) -> MoESpec:
    """The preset, scaled to the device, with the given scheme and max_tokens_per_rank >= tokens."""
    base = preset(model, scheme=scheme, max_tokens_per_rank=max(tokens, 1))
    if device.type == "cuda":
        return scaled_down(base, hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
                           num_experts=min(base.num_experts, GPU_MAX_EXPERTS))
    H, I, E, k, _ = CPU_LAYER
    return scaled_down(base, hidden_size=H, intermediate_size=I, num_experts=E, top_k=min(k, base.top_k))


def allowed_ep(model: str, device: torch.device) -> list[int]:
    """EP sizes the demo can simulate: divisors of both the preset's and the scaled layer's expert counts."""
    full = preset(model).num_experts
    scaled = demo_spec(model, device, Scheme.BF16, 1).num_experts
    return [n for n in range(1, scaled + 1) if scaled % n == 0 and full % n == 0]


def shape_str(spec: MoESpec, tokens: int | None = None) -> str:
    """H.. I.. E.. k.. (T..): the short shape the table prints."""
    s = f"H{spec.hidden_size} I{spec.intermediate_size} E{spec.num_experts} k{spec.top_k}"
    return s if tokens is None else f"{s} T{tokens}"


class _Progress:
    """A tqdm bar on stderr; plain '[i/n] step' lines where tqdm is not installed (GPU boxes without network)."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar, self.done, self.total = None, 0, total
        else:
            self.bar = tqdm(total=total, unit="step", file=sys.stderr, dynamic_ncols=True,
                            bar_format="{desc:<34} {bar} {n_fmt}/{total_fmt} [{elapsed}]")

    def step(self, what: str) -> None:
        """Announce the step about to run (shown while it runs, e.g. during a first-call compile)."""
        if self.bar is None:
            print(f"[{self.done + 1}/{self.total}] {what}", file=sys.stderr, flush=True)
        else:
            self.bar.set_description_str(what)
            self.bar.refresh()

    def advance(self) -> None:
        """Mark the announced step done."""
        if self.bar is None:
            self.done += 1
        else:
            self.bar.update(1)

    def close(self) -> None:
        """Finish the bar."""
        if self.bar is not None:
            self.bar.close()


def _timed(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int, warmup: bool = True
           ) -> tuple[torch.Tensor, float]:
    if warmup:
        out = fn()  # compilation and first-touch stay out of the time
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return out, statistics.median(times) * 1e3


def run_scheme(model: str, scheme: Scheme, device: torch.device, ep: int, tokens: int, seed: int,
               paths: list[PathChoice], repeats: int, progress: _Progress | None = None) -> list[dict]:
    """One table row per path for one scheme; steps (build, then warm-up and timing per path) go to `progress`."""
    say = progress.step if progress else (lambda what: None)
    done = progress.advance if progress else (lambda: None)
    spec = demo_spec(model, device, scheme, tokens)
    say(f"{scheme.value}: building the layer")
    # a generator on the device: a real-size layer is drawn there, not on the host
    gen = torch.Generator(device=device).manual_seed(seed)
    raw = random_layer(spec, generator=gen, device=device)
    x, topk_w, topk_ids = random_tokens(spec, tokens, generator=gen, device=device,
                                        correction_bias=raw.correction_bias)
    full = prepare_stacked(spec, raw.w13, raw.w2, layout="separated", w13_bias=raw.w13_bias, w2_bias=raw.w2_bias)
    ref_weights = (ReferenceWeights.from_separated(raw.w13, raw.w2, raw.w13_bias, raw.w2_bias)
                   if scheme is Scheme.BF16 else ReferenceWeights.from_prepared(full))
    del full
    ref = reference_moe(x, topk_w, topk_ids, ref_weights, spec.activation)
    del ref_weights
    ranks = [spec.for_rank(r, ep) for r in range(ep)]
    shards = [prepare_stacked(s, raw.w13, raw.w2, layout="separated", w13_bias=raw.w13_bias,
                              w2_bias=raw.w2_bias) for s in ranks]
    del raw
    done()
    rows = []
    for path in paths:
        row = {"path": path.name, "scheme": scheme.value, "shape": shape_str(spec, tokens), "ep": ep}
        if path.fn is None or scheme not in path.schemes:
            note = path.note if path.fn is None else f"{scheme.value} not implemented by this path yet"
            rows.append({**row, "rel_err": float("nan"), "ms": float("nan"), "note": note})
            continue

        def layer() -> torch.Tensor:
            total = torch.zeros_like(ref)
            for s, w in zip(ranks, shards):
                total += path.fn(x, topk_w, topk_ids, w, s).float()
            return total

        first = "compiling (first call)" if path.name == "triton" and device.type == "cuda" else "warm-up"
        if path.interpreted:  # nothing to compile, and each interpreted call takes seconds: time one
            say(f"{scheme.value} {path.name}: interpreting")
            out, ms = _timed(layer, device, 1, warmup=False)
        else:
            say(f"{scheme.value} {path.name}: {first}")
            layer()
            done()
            say(f"{scheme.value} {path.name}: timing {repeats} calls")
            out, ms = _timed(layer, device, repeats, warmup=False)
        done()
        err = ((out - ref).norm() / ref.norm()).item()
        rows.append({**row, "rel_err": err, "ms": ms, "note": path.note + tiles_note(path, ranks[0], tokens, device)})
    return rows


def tiles_note(path: PathChoice, spec: MoESpec, tokens: int, device: torch.device) -> str:
    """On a GPU, whether the Triton rows ran tuned tiles or the heuristic (the demo's 64 experts are rarely tuned)."""
    if path.name != "triton" or device.type != "cuda":
        return ""
    from ..experts import device_name
    from ..kernels import tuning
    have, _ = tuning.tuned_buckets(device_name(device), spec.scheme.value, spec.hidden_size,
                                   spec.intermediate_size, spec.num_local_experts, spec.top_k)
    if not have:
        return ", heuristic tiles (no tuned row for this shape)"
    return ", tuned tiles" if tuning.within_reach(have, tokens) else ", heuristic tiles (no tuned row near this T)"


def format_table(rows: list[dict]) -> str:
    """A plain-text table: path, scheme, shape, EP, relative error vs fp32, time."""
    head = f"{'path':<8} {'scheme':<7} {'shape':<30} {'ep':>3} {'rel_err':>10} {'ms':>10}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        err = "n/a" if r["rel_err"] != r["rel_err"] else f"{r['rel_err']:.2e}"
        ms = "n/a" if r["ms"] != r["ms"] else f"{r['ms']:.3f}"
        lines.append(f"{r['path']:<8} {r['scheme']:<7} {r['shape']:<30} {r['ep']:>3} {err:>10} {ms:>10}  {r['note']}")
    return "\n".join(lines)


def meaning(device: torch.device, repeats: int, rows: Iterable[dict]) -> list[str]:
    """The closing lines: what rel_err and ms mean on this device."""
    out = ["rel_err: ||out - ref|| / ||ref|| against the fp32 reference on the layer's (dequantized) weights; "
           "fp8 and a8w4 also quantize the activations (~4e-2), bf16 and a16w4 do not (~2e-3)"]
    if device.type == "cpu":
        out.append("ms: the torch twin's median of " f"{repeats} calls after a warm-up; the Triton rows are one "
                   "call in Triton's interpreter, which checks the kernels' results, not their speed: "
                   "on a GPU, `atom-moe demo` times the compiled kernels")
    else:
        twin = {r["scheme"]: r["ms"] for r in rows if r["path"] == "torch"}
        ratios = [f"{r['scheme']} {twin[r['scheme']] / r['ms']:.1f}x" for r in rows
                  if r["path"] == "triton" and r["ms"] == r["ms"] and r["scheme"] in twin]
        out.append(f"ms: median wall time of {repeats} CUDA-synchronized calls after a compile/warm-up call "
                   "(eager launches, no CUDA graph: `atom-moe bench` gives graph-replay times against the HBM "
                   "floor); speed-up of the Triton kernels over the torch twin: " + (", ".join(ratios) or "n/a"))
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `atom-moe demo`'s options."""
    parser.add_argument("--model", default="deepseek-v3", choices=sorted(PRESETS), help="layer preset")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="where to run; none: cuda if torch sees a GPU, else cpu")
    parser.add_argument("--ep", type=positive_int, default=1,
                        help="expert-parallel ranks simulated in this process; a divisor of both the preset's and "
                             "the scaled layer's expert counts")
    parser.add_argument("--scheme", action="append", choices=[s.value for s in Scheme],
                        help="repeatable; none: all four schemes")
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help=f"tokens in the batch; none: {CPU_LAYER[4]} on the CPU, {GPU_TOKENS} on a GPU")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timed calls per row (median reported); none: 3 on the CPU, 5 on a GPU")
    parser.add_argument("--no-triton", action="store_true",
                        help="leave the Triton kernels out (on the CPU they run in Triton's interpreter: ~15 s)")


def run(args: argparse.Namespace) -> int:
    """Entry point of `atom-moe demo`; returns the process exit code."""
    start = time.perf_counter()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise RunFailure("--device cuda asked for, but torch sees no CUDA device here (allowed here: cpu)")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    allowed = allowed_ep(args.model, device)
    if args.ep not in allowed:
        scaled = demo_spec(args.model, device, Scheme.BF16, 1).num_experts
        raise UsageError(f"--ep {args.ep}: allowed for {args.model} on {device.type}: {', '.join(map(str, allowed))} "
                         f"(divisors of the preset's {preset(args.model).num_experts} experts and of the "
                         f"{scaled} experts of the demo's scaled layer)")
    if device.type == "cpu" and not args.no_triton:
        # read when the kernels are first imported: the CPU runs them in Triton's interpreter
        os.environ.setdefault("TRITON_INTERPRET", "1")
    tokens = args.tokens or (GPU_TOKENS if device.type == "cuda" else CPU_LAYER[4])
    repeats = args.repeats or (5 if device.type == "cuda" else 3)
    schemes = [Scheme.parse(s) for s in dict.fromkeys(args.scheme or [s.value for s in Scheme])]
    paths = available_paths(device, triton=not args.no_triton)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    full, scaled = preset(args.model), demo_spec(args.model, device, Scheme.BF16, tokens)
    where = "Triton's interpreter on the CPU" if device.type == "cpu" else name
    print(f"atom-moe demo: model={args.model} device={name} ep={args.ep} torch={torch.__version__}")
    print(f"layer: {args.model} is {shape_str(full)}; scaled to {shape_str(scaled, tokens)} for {where}", flush=True)
    steps = sum(1 + sum(1 if p.interpreted else 2 for p in paths if p.fn is not None and s in p.schemes)
                for s in schemes)
    # the table says tuned or heuristic per row: the kernels' once-per-shape warning would only break the bar
    kernels_log = logging.getLogger("atom_moe.kernels")
    level = kernels_log.level
    kernels_log.setLevel(logging.ERROR)
    progress = _Progress(steps)
    rows = []
    try:
        for scheme in schemes:
            rows += run_scheme(args.model, scheme, device, args.ep, tokens, args.seed, paths, repeats, progress)
    finally:
        progress.close()
        kernels_log.setLevel(level)
    print(format_table(rows))
    for line in meaning(device, repeats, rows):
        print(line)
    print(f"done in {time.perf_counter() - start:.1f} s")
    return 0
