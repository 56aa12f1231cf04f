"""`atom-moe demo`: build a preset layer with random weights, run our paths, compare with fp32.

The layer is scaled down to what the device holds comfortably: on the CPU a few hundred
wide with 16 experts, on a GPU the real hidden and intermediate sizes with up to 64
experts. With --ep N the layer is split over N expert-parallel ranks simulated in this
process; each rank computes its share and the shares are summed.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..presets import PRESETS, preset, scaled_down
from ..reference import ReferenceWeights, reference_moe
from ..spec import MoESpec, Scheme
from .synthetic import random_layer, random_tokens
from ..weights import PreparedWeights, prepare_stacked

Path = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, PreparedWeights, MoESpec], torch.Tensor]


@dataclass
class PathChoice:
    name: str
    fn: Path | None
    note: str  # why it is unavailable, or how it runs
    schemes: tuple[Scheme, ...] = tuple(Scheme)  # the schemes this path implements


def available_paths(device: torch.device) -> list[PathChoice]:
    """Every experts path, best first; unavailable ones carry the reason."""
    from ..experts_torch import experts_torch

    paths = []
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type == "cuda" or interpreting:
        try:
            from ..experts import SUPPORTED, fused_experts

            note = "Triton interpreter (CPU)" if device.type == "cpu" else "Triton kernels"
            paths.append(PathChoice("triton", fused_experts, note, SUPPORTED))
        except ImportError as exc:  # triton missing, or the kernels not built in this install
            paths.append(PathChoice("triton", None, f"unavailable: {exc}"))
    else:
        paths.append(PathChoice("triton", None, "unavailable on CPU without TRITON_INTERPRET=1 (use --interpret)"))
    paths.append(PathChoice("torch", experts_torch, "torch twin (host-synced, not graph-safe)"))
    return paths


def demo_spec(model: str, device: torch.device, scheme: Scheme, tokens: int) -> MoESpec:
    """The preset, scaled to the device, with the given scheme and max_tokens_per_rank >= tokens."""
    base = preset(model, scheme=scheme, max_tokens_per_rank=max(tokens, 1))
    if device.type == "cuda":
        return scaled_down(base, hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
                           num_experts=min(base.num_experts, 64))
    return scaled_down(base, hidden_size=320, intermediate_size=192, num_experts=16)


def _timed(fn: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> tuple[torch.Tensor, float]:
    out = fn()  # warm-up: compilation and first-touch stay out of the time
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
               paths: list[PathChoice], repeats: int) -> list[dict]:
    """One table row per available path for one scheme."""
    spec = demo_spec(model, device, scheme, tokens)
    gen = torch.Generator().manual_seed(seed)
    raw = random_layer(spec, generator=gen, device=device)
    x, topk_w, topk_ids = random_tokens(spec, tokens, generator=gen, device=device,
                                        correction_bias=raw.correction_bias)
    full = prepare_stacked(spec, raw.w13, raw.w2, layout="separated", w13_bias=raw.w13_bias, w2_bias=raw.w2_bias)
    ref_weights = (ReferenceWeights.from_separated(raw.w13, raw.w2, raw.w13_bias, raw.w2_bias)
                   if scheme is Scheme.BF16 else ReferenceWeights.from_prepared(full))
    del full
    ref = reference_moe(x, topk_w, topk_ids, ref_weights, spec.activation)
    ranks = [spec.for_rank(r, ep) for r in range(ep)]
    shards = [prepare_stacked(s, raw.w13, raw.w2, layout="separated", w13_bias=raw.w13_bias,
                              w2_bias=raw.w2_bias) for s in ranks]
    rows = []
    for path in paths:
        row = {"path": path.name, "scheme": scheme.value, "shape": f"H{spec.hidden_size} I{spec.intermediate_size} "
               f"E{spec.num_experts} k{spec.top_k} T{tokens}", "ep": ep}
        if path.fn is None or scheme not in path.schemes:
            note = path.note if path.fn is None else f"{scheme.value} not implemented by this path yet"
            rows.append({**row, "rel_err": float("nan"), "ms": float("nan"), "note": note})
            continue

        def layer() -> torch.Tensor:
            total = torch.zeros_like(ref)
            for s, w in zip(ranks, shards):
                total += path.fn(x, topk_w, topk_ids, w, s).float()
            return total

        out, ms = _timed(layer, device, repeats)
        err = ((out - ref).norm() / ref.norm()).item()
        rows.append({**row, "rel_err": err, "ms": ms, "note": path.note})
    return rows


def format_table(rows: list[dict]) -> str:
    """A plain-text table: path, scheme, shape, EP, relative error vs fp32, time."""
    head = f"{'path':<8} {'scheme':<7} {'shape':<28} {'ep':>3} {'rel_err':>10} {'ms':>9}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        err = "n/a" if r["rel_err"] != r["rel_err"] else f"{r['rel_err']:.2e}"
        ms = "n/a" if r["ms"] != r["ms"] else f"{r['ms']:.3f}"
        lines.append(f"{r['path']:<8} {r['scheme']:<7} {r['shape']:<28} {r['ep']:>3} {err:>10} {ms:>9}  {r['note']}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="deepseek-v3", choices=sorted(PRESETS), help="layer preset")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    parser.add_argument("--ep", type=int, default=1, help="simulated expert-parallel ranks (in this process)")
    parser.add_argument("--scheme", action="append", choices=[s.value for s in Scheme],
                        help="repeatable; default: all schemes")
    parser.add_argument("--tokens", type=int, default=None, help="tokens in the batch (default 64 CPU, 256 GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (median reported)")
    parser.add_argument("--interpret", action="store_true",
                        help="on the CPU, also run the Triton kernels under TRITON_INTERPRET=1 (slow)")


def run(args: argparse.Namespace) -> int:
    """Entry point of `atom-moe demo`; returns the process exit code."""
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("atom-moe demo: --device cuda asked for, but torch sees no CUDA device")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.ep < 1:
        raise SystemExit(f"atom-moe demo: --ep must be >= 1, got {args.ep}")
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first imported
    tokens = args.tokens or (256 if device.type == "cuda" else 64)
    repeats = args.repeats or (5 if device.type == "cuda" else 3)
    schemes = [Scheme.parse(s) for s in (args.scheme or [s.value for s in Scheme])]
    paths = available_paths(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"atom-moe demo: model={args.model} device={name} ep={args.ep} torch={torch.__version__}")
    rows = []
    for scheme in schemes:
        rows += run_scheme(args.model, scheme, device, args.ep, tokens, args.seed, paths, repeats)
    print(format_table(rows))
    print("rel_err: ||out - ref|| / ||ref|| against the fp32 reference on the layer's (dequantized) weights")
    return 0
