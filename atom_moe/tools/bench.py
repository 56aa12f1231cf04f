"""`atom-moe bench`: time the fused experts path against its floor and a torch._grouped_mm baseline.

Per (shape, scheme, T) row: CUDA-graph replay of the whole layer (routing metadata
included) with L2 flushed before every replay, median of `--iters`. In the same run it
measures the HBM read ceiling (a streaming-read kernel over a tensor far larger than L2)
and dense bf16 / fp8 matmul rates, and reports
    floor = max((bytes of distinct experts hit + activations) / read ceiling, flops / matmul rate)
with us, achieved TB/s and fraction of floor. Writes a CSV and a roofline PNG.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .args import RunFailure, positive_float, positive_int
from .common import SHAPES, SHARED, TOKENS, Timer, bench_spec, cfg_str, floor_terms, make_routing, measure_ceilings, plot, random_weights, write_csv
CSV_COLUMNS = ("device", "shape", "scheme", "T", "routing", "impl", "us", "floor_us", "frac_of_floor",
               "tbps", "tflops", "bytes", "flops", "config", "note")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to `parser`."""
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES),
                        help="model shapes (H, I, E, top_k and fused shared experts of each preset)")
    parser.add_argument("--schemes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "a16w4", "a8w4"],
                        help="schemes to time")
    parser.add_argument("--tokens", nargs="+", type=positive_int, default=list(TOKENS), help="tokens per call")
    parser.add_argument("--routing", default="uniform", choices=["uniform", "skewed"],
                        help="uniform random top-k, or skewed (Zipf-like expert popularity)")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed graph replays per row (median)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the torch._grouped_mm baseline")
    parser.add_argument("--tune", action="store_true", help="time a few tile configs per row, keep the best")
    parser.add_argument("--tune-budget", type=positive_float, default=1e9, help="seconds of tuning, then heuristic only")
    parser.add_argument("--tuned-csv", type=Path, default=None, help="write the best configs as a tuning table")
    parser.add_argument("--ep", type=positive_int, default=1,
                        help="EP size W > 1: W simulated ranks of the symm transport on this GPU, timed stage by "
                             "stage (dispatch, routing, GEMM1, GEMM2, combine) next to the local path; see "
                             "atom_moe/tools/bench_ep.py")
    parser.add_argument("--vllm-src", type=vllm_src_dir, default=None,
                        help="folder made by scripts/vllm_baseline_src.py: adds vLLM 0.33's Triton fused_moe rows "
                             "(impl vllm: its default config; vllm-tuned: its shipped H200 table) for bf16 and fp8, "
                             "on the same inputs, each checked against the reference first; see "
                             "atom_moe/tools/vllm_baseline.py")
    parser.add_argument("--vllm-check-rows", type=positive_int, default=4,
                        help="rows of each vllm check against the fp32 reference (it dequantizes the experts they hit)")
    parser.add_argument("--csv", type=Path, default=Path("bench.csv"), help="rows written here")
    parser.add_argument("--plot", type=Path, default=None, help="roofline PNG (default: CSV path with .png)")


def grouped_mm_pipeline(x, w, ids, w13, w2):
    """bf16 baseline: sort by expert, torch._grouped_mm twice, SwiGLU, weighted scatter-add."""
    T, k = ids.shape
    E = w13.shape[0]
    flat = ids.flatten().long()
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    tok = order // k
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    a = (torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]).to(torch.bfloat16)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y.float() * w.flatten()[order, None]
    return torch.zeros(T, x.shape[1], device=x.device).index_add_(0, tok, y).to(x.dtype)


# ---------------------------------------------------------------- vLLM's kernel beside ours
def vllm_src_dir(text: str) -> Path:
    """argparse type: a folder made by scripts/vllm_baseline_src.py."""
    from .vllm_baseline import FUSED_MOE
    if not (Path(text) / FUSED_MOE / "fused_moe.py").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} has no {FUSED_MOE}/fused_moe.py; allowed: a folder made by "
                                         f"`python3 scripts/vllm_baseline_src.py` (default .cache/vllm-0.33.0)")
    return Path(text)


def vllm_layers(vllm, weights, spec, device: str) -> list:
    """vLLM's layer for this shape with its default config, and with its tuned table where one fits."""
    from . import vllm_baseline
    try:
        layer = vllm_baseline.from_prepared(vllm, weights, spec)
    except ValueError as exc:
        print(f"  no vllm rows: {exc}", flush=True)
        return []
    tuned = layer.with_tuned(device)
    if tuned is None:
        print(f"  no vllm-tuned rows: vLLM ships no table for {device} with this dtype", flush=True)
    return [layer] if tuned is None else [layer, tuned]


def vllm_row(layer, weights, spec, x, w, ids, ours, args, timer, row) -> bool:
    """Check vLLM's layer on these inputs (reference and ours), then time it; False when the check fails."""
    from . import vllm_baseline
    impl = "vllm" if layer.table is None else "vllm-tuned"
    try:
        text = vllm_baseline.check(layer, weights, spec, x, w, ids, ours, args.vllm_check_rows)
        us = timer.graph_us(lambda: layer.forward(x, w, ids))
    except Exception as exc:  # a wrong result, or a config that does not compile here: no row, reported
        print(f"  {impl}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        return False
    cfg = layer.config(x.shape[0])
    config = (f"bm{cfg['BLOCK_SIZE_M']} bn{cfg['BLOCK_SIZE_N']} bk{cfg['BLOCK_SIZE_K']} g{cfg['GROUP_SIZE_M']} "
              f"w{cfg.get('num_warps', 4)} s{cfg.get('num_stages', 3)}")
    row(impl, us, config=config, note=f"vLLM 0.33 fused_moe_kernel, {layer.config_name}; check {text}")
    return True


# ---------------------------------------------------------------- driver
def candidates(scheme: str, tokens: int, spec) -> list:
    """A few tile configs around the heuristic's, for --tune (BLOCK_M by rows per expert)."""
    from ..kernels.tuning import TileConfig, heuristic
    base = heuristic(scheme, spec.hidden_size, spec.intermediate_size, spec.num_local_experts, spec.top_k, tokens)
    T = TileConfig
    if scheme in ("fp8", "a8w4"):  # GEMM1 tile fixed at 256 x 128 (whole activation groups)
        small = [T(16, 256, 128, 4, 4, 64, 128, 4, 4), T(16, 256, 128, 4, 3, 128, 128, 4, 4),
                 T(16, 256, 128, 8, 4, 128, 128, 4, 5), T(32, 256, 128, 4, 4, 128, 128, 4, 4)]
        large = [T(64, 256, 128, 4, 4, 128, 128, 4, 4), T(64, 256, 128, 8, 3, 128, 128, 8, 3),
                 T(64, 256, 128, 8, 4, 256, 128, 8, 3), T(128, 256, 128, 8, 3, 128, 128, 8, 3)]
    else:
        small = [T(16, 128, 64, 4, 4, 128, 64, 4, 4), T(16, 64, 128, 4, 4, 64, 128, 4, 4),
                 T(16, 128, 128, 4, 3, 128, 128, 4, 3), T(32, 128, 64, 4, 4, 128, 64, 4, 4)]
        large = [T(64, 128, 64, 4, 4, 128, 64, 4, 4), T(64, 256, 64, 8, 3, 256, 64, 8, 3),
                 T(128, 128, 64, 8, 3, 128, 64, 8, 3), T(128, 256, 64, 8, 3, 256, 64, 8, 3)]
    pool = small if base.block_m <= 32 else large
    if base.block_m == 32 or base.block_m == 64:
        pool = small[-2:] + large[:2]
    return list(dict.fromkeys([base, *pool]))


def run(args: argparse.Namespace) -> list[dict]:
    """Run the benchmark described by args; write the CSV (and PNG); return the rows."""
    from ..experts import allocate_workspace, device_name, fused_experts, launch_flags
    if getattr(args, "ep", 1) > 1:
        from . import bench_ep
        if args.csv == Path("bench.csv"):
            args.csv = bench_ep.default_csv(args.csv, args.ep)
        return bench_ep.run(args)
    if not torch.cuda.is_available():
        raise RunFailure("needs a CUDA GPU: torch sees none here")
    vllm = None
    if getattr(args, "vllm_src", None) is not None:
        from . import vllm_baseline
        try:
            vllm = vllm_baseline.load(args.vllm_src)
        except vllm_baseline.VllmSourceError as exc:
            raise RunFailure(str(exc)) from None
    timer = Timer(args.iters)
    ceil = measure_ceilings(timer)
    dev = device_name(torch.device("cuda"))
    print(f"device {dev}: HBM read {ceil['read_tbps']:.2f} TB/s, bf16 {ceil['bf16_tflops']:.0f} TFLOP/s, "
          f"fp8 {ceil['fp8_tflops']:.0f} TFLOP/s", flush=True)
    grouped = hasattr(torch, "_grouped_mm")
    if not grouped and not args.no_baseline:
        print("baseline: torch._grouped_mm is unavailable in this torch; no baseline rows", flush=True)
    rows, tuned, vllm_failed = [], [], []
    t_start = time.monotonic()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for name in args.shapes:
        H, I, E, k = SHAPES[name]
        for scheme in args.schemes:
            spec = bench_spec(name, scheme)
            weights = random_weights(spec)
            ws = allocate_workspace(spec, max(args.tokens), "cuda")
            # compute floor at the issue's MMA rate: fp8 for fp8 and a8w4 (a8w4's target, though its
            # kernels dot in bf16 today), bf16 otherwise
            rate = ceil["fp8_tflops" if scheme in ("fp8", "a8w4") else "bf16_tflops"]
            layers = vllm_layers(vllm, weights, spec, dev) if vllm is not None else []
            for T in args.tokens:
                w, ids = make_routing(T, E, k, args.routing, gen, SHARED[name])
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                out = torch.empty_like(x)
                nbytes, flops = floor_terms(spec, ids, 2)
                floor_us = max(nbytes / (ceil["read_tbps"] * 1e6), flops / (rate * 1e6))

                def row(impl, us, config="", note=""):
                    r = dict(device=dev, shape=name, scheme=scheme, T=T, routing=args.routing, impl=impl,
                             us=round(us, 2), floor_us=round(floor_us, 2), frac_of_floor=round(floor_us / us, 3),
                             tbps=round(nbytes / us / 1e6, 3), tflops=round(flops / us / 1e6, 1), bytes=nbytes,
                             flops=flops, config=config, note=note)
                    rows.append(r)
                    print(f"{name:16s} {scheme:5s} T={T:5d} {impl:12s} {us:10.1f} us  floor {floor_us:9.1f}  "
                          f"frac {floor_us / us:5.3f}  {nbytes / us / 1e6:5.2f} TB/s  {config}", flush=True)

                tuning_on = args.tune and time.monotonic() - t_start < args.tune_budget
                configs = candidates(scheme, T, spec) if tuning_on else [None]
                best = None
                for cfg in configs:
                    try:
                        us = timer.graph_us(lambda: fused_experts(x, w, ids, weights, spec, workspace=ws,
                                                                  config=cfg, out=out))
                    except Exception as exc:  # a candidate that does not compile or fit is skipped
                        print(f"  config {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                    if best is None or us < best[0]:
                        best = (us, cfg)
                if best is None:
                    raise RuntimeError(f"no config ran for {name} {scheme} T={T}")
                from ..kernels.tuning import SPLIT_MAX_PAIRS, lookup
                used = best[1] or lookup(dev, scheme, H, I, E, k, T)
                if T * k > SPLIT_MAX_PAIRS:  # fused_experts splits K at decode sizes only: print the tiles that ran
                    used = replace(used, split_k1=1, split_k2=1)
                row("atom_moe", best[0], config=cfg_str(used), note=launch_flags())
                tuned.append(dict(device=dev, scheme=scheme, H=H, I=I, E=E, top_k=k, tokens=T, **asdict(used),
                                  us=round(best[0], 2)))
                if scheme == "bf16" and grouped and not args.no_baseline:
                    try:
                        us = timer.graph_us(lambda: grouped_mm_pipeline(x, w, ids, weights.w13.data, weights.w2))
                        row("grouped_mm", us, note="torch._grouped_mm bf16")
                    except Exception as exc:
                        print(f"  baseline failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                for layer in layers:
                    if not vllm_row(layer, weights, spec, x, w, ids, out, args, timer, row):
                        vllm_failed.append(f"{name} {scheme} T={T} {layer.config_name}")
            del weights, ws, layers
            torch.cuda.empty_cache()
    write_csv(args.csv, rows, CSV_COLUMNS)
    if args.tuned_csv is not None:
        from ..kernels.tuning import COLUMNS
        write_csv(args.tuned_csv, tuned, COLUMNS)
    plot(rows, ceil, args.plot or args.csv.with_suffix(".png"))
    if vllm_failed:
        raise RunFailure(f"vllm baseline failed (no row written; the reason is printed above it) at "
                         f"{len(vllm_failed)} points: {'; '.join(vllm_failed)}")
    return rows


def main(argv: list[str] | None = None) -> None:
    """Standalone entry point (scripts/bench.py)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
