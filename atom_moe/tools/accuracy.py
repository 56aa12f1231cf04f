"""`atom-moe accuracy`: layer-level relative error of the MegaMoE forward against fp32.

For each model (preset or config.json), scheme and token count: random bf16 checkpoint
weights (std 1/sqrt(fan_in)) and random routed tokens, or recorded inputs (`--inputs
file.pt` holding x [T, H], topk_weights [T, k], topk_ids [T, k]). Each path runs the
MegaMoE op (EP 1, `local` transport, in this process) with that experts backend; with
`--ep N` each simulated rank runs its share with its own PreparedWeights through the
experts step and the shares are summed (as `atom-moe demo` does). The paths `symm-fused`
and `symm-split` run the symm transport end to end over N simulated ranks
(atom_moe.ep.simulate: dispatch, experts, pushes back, combine), the tokens split over the
ranks in contiguous chunks; `--compare symm-fused,triton` sets the transports side by side. Errors are
||out - ref|| / ||ref|| against
  rel_err          the fp32 reference on the scheme's dequantized weights (kernel error,
                   activation quantization included), and
  rel_err_vs_bf16  the fp32 reference on the original bf16 weights (adds what the weight
                   quantization costs).
A scheme a path does not implement gets a row saying so. `--compare triton,torch` adds
rows with the relative difference between two paths. The table is printed and saved as
markdown and CSV. Exit 1 when --max-rel-err is given and a row exceeds it; 2 on bad input.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..checkpoint.config import load_model
from ..presets import scaled_down
from ..reference import ReferenceWeights, reference_moe
from .args import RunFailure, positive_float, positive_int
from ..spec import MoESpec, Scheme, SpecError
from .synthetic import random_layer, random_tokens
from ..weights import PreparedWeights, prepare_stacked

# experts backends of the op, and the symm transport's two combine modes over --ep simulated ranks
PATHS = ("triton", "torch", "symm-fused", "symm-split")
COLUMNS = ("model", "scheme", "shape", "tokens", "ep", "path", "rel_err", "rel_err_vs_bf16", "note")


class AccuracyError(ValueError):
    """Bad input: unknown path, malformed recorded inputs, sizes that do not match."""


@dataclass
class Inputs:
    """One batch: bf16 tokens and their routing (global expert ids)."""

    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


def triton_status(device: torch.device) -> str | None:
    """None when the fused Triton path can run here, else why not."""
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "unavailable on CPU without TRITON_INTERPRET=1 (use --interpret)"
    try:
        importlib.import_module("triton")  # the fused path's one optional dependency
    except ImportError as exc:
        return f"unavailable: {exc}"
    return None


def path_problem(path: str, scheme: Scheme, device: torch.device) -> str | None:
    """Why `path` cannot run `scheme` here (the table row's note), or None."""
    if path == "triton" or path.startswith("symm"):
        status = triton_status(device)
        if status:
            return status
        from ..experts import SUPPORTED
        if scheme not in SUPPORTED:
            return f"{scheme.value} not implemented by the fused (triton) path yet"
    return None


def _symm_forward(path: str, spec: MoESpec, inputs: Inputs, raw, ep: int, device: torch.device) -> torch.Tensor:
    """The tokens split over `ep` simulated symm ranks (contiguous chunks), outputs back in order."""
    from ..ep.simulate import SimulatedSymmGroup
    from ..ep.symm import FUSED, SPLIT
    chunks = torch.arange(inputs.x.shape[0], device=device).tensor_split(ep)
    specs = [spec.for_rank(r, ep) for r in range(ep)]
    wire = "fp8" if spec.scheme.fp8_activations else "bf16"  # the fp8 wire feeds fp8 activations as they are
    group = SimulatedSymmGroup(specs, max(max(len(c) for c in chunks), 1), wire, device)
    xs, ws, ids = ([t[c].contiguous() for c in chunks] for t in (inputs.x, inputs.topk_weights, inputs.topk_ids))
    outs = [torch.empty_like(x) for x in xs]
    mode = FUSED if path == "symm-fused" else SPLIT
    group.forward([_prepare(s, raw, device) for s in specs], xs, ws, ids, outs, [mode] * ep)
    return torch.cat(outs).float()


def parse_paths(text: str, what: str) -> tuple[str, ...]:
    """'triton,torch' -> ('triton', 'torch'), with a clear error for unknown names."""
    names = tuple(p.strip().lower() for p in text.split(",") if p.strip())
    bad = [p for p in names if p not in PATHS]
    if bad or not names:
        raise AccuracyError(f"{what} {text!r}: unknown {bad or 'empty'}; allowed: {', '.join(PATHS)}")
    if len(set(names)) != len(names):
        raise AccuracyError(f"{what} {text!r} names a path twice")
    return names


def load_inputs(path: str, spec: MoESpec, device: torch.device) -> Inputs:
    """Recorded inputs from a torch.save'd dict {x, topk_weights, topk_ids}, checked against `spec`."""
    file = Path(path)
    if not file.is_file():
        raise AccuracyError(f"--inputs {path}: no such file (expected torch.save({{'x', 'topk_weights', "
                            f"'topk_ids'}}))")
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip or safety errors all mean the same to the user
        raise AccuracyError(f"--inputs {path}: not a torch.save'd dict of tensors ({exc})") from None
    need = ("x", "topk_weights", "topk_ids")
    if not isinstance(data, dict) or any(not isinstance(data.get(k), torch.Tensor) for k in need):
        raise AccuracyError(f"--inputs {path}: expected a dict with tensors {', '.join(need)}, got "
                            f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    x, w, ids = data["x"], data["topk_weights"], data["topk_ids"]
    H, k, E = spec.hidden_size, spec.top_k, spec.num_experts
    if x.dim() != 2 or x.shape[1] != H:
        raise AccuracyError(f"--inputs {path}: x is {tuple(x.shape)}, the layer needs [T, H={H}] "
                            f"(set --hidden/--intermediate/--experts to the recording's sizes)")
    T = x.shape[0]
    for name, t in (("topk_weights", w), ("topk_ids", ids)):
        if tuple(t.shape) != (T, k):
            raise AccuracyError(f"--inputs {path}: {name} is {tuple(t.shape)}, expected [T, top_k] = [{T}, {k}]")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise AccuracyError(f"--inputs {path}: topk_ids must be integers, got {ids.dtype}")
    if T and (ids.min() < -1 or ids.max() > E):
        raise AccuracyError(f"--inputs {path}: topk_ids outside [0, {E}) and the sentinels -1 / {E}: "
                            f"min {int(ids.min())}, max {int(ids.max())} (is --experts the model's count?)")
    return Inputs(x.to(device, torch.bfloat16).contiguous(), w.to(device, torch.float32).contiguous(),
                  ids.to(device, torch.int64).contiguous())


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    """||a - ref|| / ||ref|| in fp32 (0 for an all-zero pair)."""
    num, den = (a.float() - ref.float()).norm().item(), ref.float().norm().item()
    return num / den if den else (0.0 if num == 0 else math.inf)


def run_path(path: str, spec: MoESpec, inputs: Inputs, raw, ep: int, device: torch.device) -> torch.Tensor:
    """One path's fp32 output: the op at EP 1, else the sum of `ep` simulated ranks' experts steps."""
    x, w, ids = inputs.x, inputs.topk_weights, inputs.topk_ids
    if path.startswith("symm"):
        return _symm_forward(path, spec, inputs, raw, ep, device)
    if ep == 1:
        from ..ep import MegaMoE
        weights = _prepare(spec, raw, device)
        with MegaMoE(spec, max_tokens_per_rank=max(x.shape[0], 1), transport="local", experts_backend=path,
                     device=device) as op:
            return op(x, w, ids, weights).float()
    if path == "triton":
        from ..experts import fused_experts as step
    else:
        from ..experts_torch import experts_torch as step
    total = torch.zeros(x.shape[0], spec.hidden_size, dtype=torch.float32, device=device)
    for r in range(ep):
        rank_spec = spec.for_rank(r, ep)
        total += step(x, w, ids, _prepare(rank_spec, raw, device), rank_spec).float()
    return total


def _prepare(spec: MoESpec, raw, device: torch.device) -> PreparedWeights:
    return prepare_stacked(spec, raw.w13, raw.w2, layout="separated", w13_bias=raw.w13_bias, w2_bias=raw.w2_bias,
                           device=device)


def layer_spec(base: MoESpec, scheme: Scheme, device: torch.device, sizes: tuple[int | None, int | None, int | None],
               full: bool) -> MoESpec:
    """The model's layer in `scheme`, at the requested sizes, else scaled to the device."""
    spec = replace(base, scheme=scheme)
    H, I, E = sizes
    if full:
        dflt = (spec.hidden_size, spec.intermediate_size, spec.num_experts)
    elif device.type == "cuda":  # real H and I; up to 64 experts keeps random weights quick to build
        dflt = (spec.hidden_size, spec.intermediate_size, min(spec.num_experts, 64))
    else:
        dflt = (320, 192, 16)
    return scaled_down(spec, hidden_size=H or dflt[0], intermediate_size=I or dflt[1], num_experts=E or dflt[2])


def evaluate(model: str, scheme: Scheme, tokens: int | None, *, ep: int, paths: tuple[str, ...],
             compare: tuple[str, ...] | None, device: torch.device, seed: int,
             sizes: tuple[int | None, int | None, int | None] = (None, None, None),
             inputs_file: str | None = None) -> list[dict]:
    """The table rows of one (model, scheme, tokens): one per path, plus the comparison row."""
    layer = load_model(model)
    spec = layer_spec(layer.spec, scheme, device, sizes, full=inputs_file is not None)
    if ep < 1:
        raise AccuracyError(f"--ep must be >= 1, got {ep}")
    try:
        spec.for_rank(0, ep)
    except SpecError as exc:
        raise AccuracyError(f"--ep {ep}: {exc}") from None
    gen = torch.Generator().manual_seed(seed)
    raw = random_layer(spec, generator=gen, device=device)
    if inputs_file is not None:
        inputs = load_inputs(inputs_file, spec, device)
    else:
        inputs = Inputs(*random_tokens(spec, tokens, generator=gen, device=device, correction_bias=raw.correction_bias))
    T = inputs.x.shape[0]
    spec = replace(spec, max_tokens_per_rank=max(T, 1))
    refs = {"bf16": reference_moe(inputs.x, inputs.topk_weights, inputs.topk_ids,
                                  ReferenceWeights.from_separated(raw.w13, raw.w2, raw.w13_bias, raw.w2_bias),
                                  spec.activation)}
    refs["scheme"] = refs["bf16"] if scheme is Scheme.BF16 else reference_moe(
        inputs.x, inputs.topk_weights, inputs.topk_ids, ReferenceWeights.from_prepared(_prepare(spec, raw, device)),
        spec.activation)
    base = dict(model=layer.name, scheme=scheme.value, tokens=T, ep=ep,
                shape=f"H{spec.hidden_size} I{spec.intermediate_size} E{spec.num_experts} k{spec.top_k}")
    how = "op, local transport" if ep == 1 else f"simulated EP {ep}: per-rank experts, summed"
    symm_how = f"symm transport, {ep} simulated rank(s): dispatch, experts, pushes back, combine"
    rows, outs = [], {}
    for path in dict.fromkeys(paths + (compare or ())):
        problem = path_problem(path, scheme, device)
        if problem:
            rows.append({**base, "path": path, "rel_err": math.nan, "rel_err_vs_bf16": math.nan, "note": problem})
            continue
        out = outs[path] = run_path(path, spec, inputs, raw, ep, device)
        if path in paths:
            rows.append({**base, "path": path, "rel_err": rel(out, refs["scheme"]),
                         "rel_err_vs_bf16": rel(out, refs["bf16"]),
                         "note": f"{symm_how if path.startswith('symm') else how}; {_source(inputs_file)}"})
    if compare:
        a, b = compare
        row = {**base, "path": f"{a} vs {b}", "rel_err_vs_bf16": math.nan}
        if a in outs and b in outs:
            rows.append({**row, "rel_err": rel(outs[a], outs[b]), "note": f"||{a} - {b}|| / ||{b}||"})
        else:
            missing = [p for p in compare if p not in outs]
            rows.append({**row, "rel_err": math.nan, "note": f"not compared: {', '.join(missing)} did not run"})
    return rows


def _source(inputs_file: str | None) -> str:
    return f"inputs {inputs_file}" if inputs_file else "random inputs"


def _fmt(v) -> str:
    if isinstance(v, float):
        return "n/a" if math.isnan(v) else f"{v:.3e}"
    return str(v)


def format_markdown(rows: list[dict]) -> str:
    """The table as markdown (also what is printed)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def write_csv(path: Path, rows: list[dict]) -> None:
    """The table as CSV (errors as plain floats, nan where a path did not run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(COLUMNS))
        writer.writeheader()
        writer.writerows({c: r[c] for c in COLUMNS} for r in rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `atom-moe accuracy`'s options."""
    parser.add_argument("models", nargs="*", default=["deepseek-v3"],
                        help="presets or config.json paths (default: deepseek-v3)")
    parser.add_argument("--scheme", action="append", choices=[s.value for s in Scheme],
                        help="repeatable; default: all schemes")
    parser.add_argument("--tokens", type=positive_int, action="append", help="repeatable; default 32 (CPU), 512 (GPU)")
    parser.add_argument("--ep", type=positive_int, default=1, help="EP ranks simulated in this process (default 1: the op)")
    parser.add_argument("--paths", default="triton,torch", help="experts backends to run (default triton,torch)")
    parser.add_argument("--compare", default=None,
                        help="two paths to compare with each other, e.g. triton,torch; none: each against fp32")
    parser.add_argument("--inputs", default=None,
                        help="recorded inputs: torch.save({x, topk_weights, topk_ids}); none: random tokens")
    parser.add_argument("--hidden", type=positive_int, default=None,
                        help="hidden size override (default: scaled to device)")
    parser.add_argument("--intermediate", type=positive_int, default=None,
                        help="intermediate size override (default: scaled to device)")
    parser.add_argument("--experts", type=positive_int, default=None,
                        help="expert count override (default: scaled to device)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    parser.add_argument("--interpret", action="store_true", help="on the CPU, run Triton under TRITON_INTERPRET=1")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    parser.add_argument("--out", type=Path, default=Path("accuracy"), help="writes OUT.md and OUT.csv")
    parser.add_argument("--max-rel-err", type=positive_float, default=None,
                        help="exit 1 if any rel_err is above this; none: no gate")


def run(args: argparse.Namespace) -> int:
    """Entry point of `atom-moe accuracy`; returns the process exit code."""
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are first imported
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise RunFailure("--device cuda asked for, but torch sees no CUDA device here (allowed here: cpu)")
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        paths = parse_paths(args.paths, "--paths")
        compare = parse_paths(args.compare, "--compare") if args.compare else None
        if compare is not None and len(compare) != 2:
            raise AccuracyError(f"--compare takes exactly two paths, e.g. triton,torch; got {args.compare!r}")
        tokens = args.tokens or [512 if device.type == "cuda" else 32]
        if any(t < 1 for t in tokens):
            raise AccuracyError(f"--tokens must be >= 1, got {tokens}")
        if args.inputs and args.tokens:
            raise AccuracyError("--inputs fixes the tokens: drop --tokens")
        for name in ("hidden", "intermediate", "experts"):
            if getattr(args, name) is not None and getattr(args, name) < 1:
                raise AccuracyError(f"--{name} must be >= 1")
        schemes = [Scheme.parse(s) for s in (args.scheme or [s.value for s in Scheme])]
        sizes = (args.hidden, args.intermediate, args.experts)
        rows = []
        for model in args.models:
            for scheme in schemes:
                for T in ([None] if args.inputs else tokens):
                    rows += evaluate(model, scheme, T, ep=args.ep, paths=paths, compare=compare, device=device,
                                     seed=args.seed, sizes=sizes, inputs_file=args.inputs)
    except (AccuracyError, SpecError) as exc:
        print(f"atom-moe accuracy: error: {exc}", file=sys.stderr)
        return 2
    table = format_markdown(rows)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    interp = " (Triton interpreter)" if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1" else ""
    header = f"atom-moe accuracy: device {name}{interp}, torch {torch.__version__}, seed {args.seed}"
    print(header)
    print(table)
    md, csv_path = Path(f"{args.out}.md"), Path(f"{args.out}.csv")
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text(f"{header}\n\n{table}\n\nrel_err: vs fp32 on the scheme's dequantized weights; rel_err_vs_bf16: "
                  f"vs fp32 on the original bf16 weights.\n")
    write_csv(csv_path, rows)
    print(f"wrote {md} and {csv_path}")
    if args.max_rel_err is not None:
        over = [r for r in rows if not math.isnan(r["rel_err"]) and r["rel_err"] > args.max_rel_err]
        if over:
            print(f"atom-moe accuracy: {len(over)} row(s) above --max-rel-err {args.max_rel_err}: "
                  + "; ".join(f"{r['model']} {r['scheme']} T={r['tokens']} {r['path']} {r['rel_err']:.3e}"
                              for r in over), file=sys.stderr)
            return 1
    return 0
