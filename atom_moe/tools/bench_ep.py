"""`atom-moe bench --ep W`: the expert-parallel forward on one GPU, stage by stage.

W ranks of the symm transport run in this process (atom_moe.ep.simulate), each with its
own heap, buffers and weights, exactly as MegaMoE builds them. Per (shape, scheme, T
tokens per rank, combine mode) the forward is cut into its stages, each over all W ranks:
    dispatch   the push kernels + the barrier
    routing    the receive side's routing launches
    gemm1      GEMM1 (+SwiGLU, +fp8 quant)
    gemm2      GEMM2 (+routing weight, + the pushes back to the source ranks)
    combine    the barrier + the summing kernels
Each stage is captured alone in a CUDA graph and timed like `atom-moe bench` (L2 flushed
before every replay, median); GEMM2's combine counters are re-zeroed (untimed) before each
replay of GEMM2 alone, as the routing launch does in the layer. The whole forward is timed
the same way, and so is the local path (EP 1: one fused_experts over all W*T tokens with
every expert). On one GPU the W ranks share one HBM, so the rows show what each stage costs,
not multi-GPU speed (scripts/ep_bench.py measures that on real GPUs).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Callable

import torch

from . import common
from .args import RunFailure

CSV_COLUMNS = ("device", "shape", "scheme", "ep", "T", "routing", "impl", "dispatch_us", "routing_us", "gemm1_us",
               "gemm2_us", "combine_us", "sum_of_stages_us", "forward_us", "floor_us", "frac_of_floor", "config")
STAGES = ("dispatch", "routing", "gemm1", "gemm2", "combine")


def stage_steps(group, weights: list, xs: list[torch.Tensor], topk_weights: list[torch.Tensor],
                topk_ids: list[torch.Tensor], outs: list[torch.Tensor], mode: int,
                config=None) -> dict[str, Callable[[], None]]:
    """The simulated forward as one callable per stage (run in STAGES order they equal group.forward).

    Calls the experts step once per rank, recording its Triton launches, so the receive
    buffers must hold this call's dispatch (the dispatch stage runs first, here).
    """
    from .common import record_launches
    from ..experts import fused_experts

    trs = group.transports

    def barrier() -> None:
        for tr in trs:
            tr.barrier(signal=True, wait=False)
        for tr in trs:
            tr.barrier(signal=False, wait=True)

    def dispatch() -> None:
        for r, tr in enumerate(trs):
            tr.dispatch(xs[r], topk_weights[r], topk_ids[r], mode)
        barrier()

    dispatch()
    launches: dict[str, list] = {s: [] for s in ("routing", "gemm1", "gemm2")}
    for r, tr in enumerate(trs):
        rows, scales, w, ids = tr.received()
        recorded = record_launches(lambda: fused_experts(rows, w, ids, weights[r], group.specs[r],
                                                         workspace=group.workspaces[r], config=config,
                                                         x_scale=scales, remote=tr.remote_output()))
        for launch in recorded:  # a8w4's quant of GEMM1's output counts with GEMM1, whose epilogue did it before
            launches["gemm1" if launch.stage == "inter_quant" else launch.stage].append(launch)

    def run_all(stage: str) -> Callable[[], None]:
        def go() -> None:
            for launch in launches[stage]:
                launch()
        return go

    def combine() -> None:
        barrier()
        for r, tr in enumerate(trs):
            tr.combine(topk_ids[r], outs[r], mode)

    return {"dispatch": dispatch, "routing": run_all("routing"), "gemm1": run_all("gemm1"),
            "gemm2": run_all("gemm2"), "combine": combine}


def run(args: argparse.Namespace) -> list[dict]:
    """Time the simulated EP forward stage by stage (and the local path); write the CSV; return the rows."""
    from ..ep.simulate import SimulatedSymmGroup
    from ..ep.symm import FUSED, SPLIT
    from ..experts import allocate_workspace, device_name, fused_experts
    from ..kernels.tuning import lookup

    if not torch.cuda.is_available():
        raise RunFailure("--ep needs a CUDA GPU: torch sees none here")
    W = args.ep
    timer = common.Timer(args.iters)
    ceil = common.measure_ceilings(timer)
    dev = device_name(torch.device("cuda"))
    print(f"device {dev}: HBM read {ceil['read_tbps']:.2f} TB/s, bf16 {ceil['bf16_tflops']:.0f}, "
          f"fp8 {ceil['fp8_tflops']:.0f} TFLOP/s; {W} simulated ranks", flush=True)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    rows: list[dict] = []
    t0 = time.monotonic()
    for name in args.shapes:
        H, I, E, k = common.SHAPES[name]
        for scheme in args.schemes:
            full = common.bench_spec(name, scheme)  # fused shared experts: a replica on every rank
            specs = [full.for_rank(r, W) for r in range(W)]
            weights = [common.random_weights(s) for s in specs]
            rate = ceil["fp8_tflops" if scheme in ("fp8", "a8w4") else "bf16_tflops"]
            wire = "fp8" if full.scheme.fp8_activations else "bf16"
            for T in args.tokens:
                routed = [common.make_routing(T, E, k, args.routing, gen, full.shared_experts) for _ in range(W)]
                xs = [torch.randn(T, H, device="cuda", dtype=torch.bfloat16) for _ in range(W)]
                ws, ids = [r[0] for r in routed], [r[1] for r in routed]
                outs = [torch.empty_like(x) for x in xs]
                all_ids = torch.cat(ids)
                nbytes, flops = common.floor_terms(full, all_ids, 2)
                floor_us = max(nbytes / (ceil["read_tbps"] * 1e6), flops / (rate * 1e6))
                cfg = lookup(dev, scheme, H, I, specs[0].num_local_experts, k, T)
                group = SimulatedSymmGroup(specs, T, wire, "cuda")
                for label, mode in (("fused", FUSED), ("split", SPLIT)):
                    steps = stage_steps(group, weights, xs, ws, ids, outs, mode, config=cfg)
                    counters = [g.counters for g in group.workspaces]
                    times = {s: timer.graph_us(steps[s], prepare=(lambda: [c.zero_() for c in counters])
                                               if s == "gemm2" else None) for s in STAGES}
                    forward = timer.graph_us(lambda: group.forward(weights, xs, ws, ids, outs, [mode] * W, cfg))
                    rows.append(_row(dev, name, scheme, W, T, args.routing, f"symm-sim {label}", times, forward,
                                     floor_us, common.cfg_str(cfg)))
                del group
                # the local path over the same tokens: EP 1, every expert, W*T tokens
                x_all = torch.cat(xs)
                local_w = common.random_weights(full)
                lws = allocate_workspace(full, W * T, "cuda")
                out_all = torch.empty_like(x_all)
                lcfg = lookup(dev, scheme, H, I, E, k, W * T)
                w_all = torch.cat(ws)
                us = timer.graph_us(lambda: fused_experts(x_all, w_all, all_ids, local_w, full, workspace=lws,
                                                          config=lcfg, out=out_all))
                rows.append(_row(dev, name, scheme, 1, W * T, args.routing, "local", {}, us, floor_us,
                                 common.cfg_str(lcfg)))
                del local_w, lws
                for r in rows[-3:]:
                    print(" ".join(f"{c}={r[c]}" for c in CSV_COLUMNS[1:-1]), f"[{time.monotonic() - t0:.0f}s]",
                          flush=True)
            del weights
            torch.cuda.empty_cache()
    common.write_csv(args.csv, rows, CSV_COLUMNS)
    return rows


def _row(dev, shape, scheme, ep, T, routing, impl, times: dict, forward: float, floor_us: float, config: str) -> dict:
    stages = {f"{s}_us": round(times[s], 2) if s in times else "" for s in STAGES}
    return dict(device=dev, shape=shape, scheme=scheme, ep=ep, T=T, routing=routing, impl=impl, **stages,
                sum_of_stages_us=round(sum(times.values()), 2) if times else "", forward_us=round(forward, 2),
                floor_us=round(floor_us, 2), frac_of_floor=round(floor_us / forward, 3), config=config)


def default_csv(path: Path, ep: int) -> Path:
    """bench.csv -> bench-ep4.csv when --ep is given and the CSV path was left at its default."""
    return path.with_name(f"{path.stem}-ep{ep}{path.suffix}")
