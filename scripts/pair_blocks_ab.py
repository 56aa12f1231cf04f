"""A/B on a GPU: the layer at T = 1 with pair blocks (two launches, kernels/routing.py `PairBlocks`) against
the sorted path (routing launch + GEMM1 + GEMM2), same process, same weights and routing.

Per (shape, scheme): check that both paths give the same output bit for bit, then time them alternately
(`--rounds` x sorted, pairs; CUDA-graph replays, L2 flushed, median of `--iters`) and print / write each
arm's median over rounds, the ratio, and each arm's fraction of the layer floor.

    python scripts/pair_blocks_ab.py --csv pair-blocks-ab.csv
    python scripts/pair_blocks_ab.py --shapes deepseek-v3 glm-5.2-tp8 --schemes fp8 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atom_moe.experts import allocate_workspace, device_name, fused_experts  # noqa: E402
from atom_moe.kernels.tuning import lookup  # noqa: E402
from atom_moe.tools import common  # noqa: E402

COLUMNS = ("shape", "scheme", "routing", "config", "sorted_us", "pairs_us", "speedup", "floor_us", "sorted_frac",
           "pairs_frac", "read_tbps")


def measure(args: argparse.Namespace) -> list[dict]:
    """Every (shape, scheme) row of the A/B."""
    timer = common.Timer(args.iters)
    ceil = common.measure_ceilings(timer)
    print(f"HBM read {ceil['read_tbps']:.2f} TB/s, bf16 {ceil['bf16_tflops']:.0f}, fp8 {ceil['fp8_tflops']:.0f} "
          f"TFLOP/s", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name in args.shapes:
        H, I, E, k = common.SHAPES[name]
        for scheme in args.schemes:
            spec = common.bench_spec(name, scheme)
            weights = common.random_weights(spec)
            ws = allocate_workspace(spec, 1, "cuda")
            w, ids = common.make_routing(1, E, k, args.routing, gen, common.SHARED[name])
            x = torch.randn(1, H, device="cuda", dtype=torch.bfloat16)
            outs = {arm: torch.empty_like(x) for arm in (False, True)}

            def layer(arm: bool):
                return lambda: fused_experts(x, w, ids, weights, spec, workspace=ws, out=outs[arm], pair_blocks=arm)
            layer(False)(), layer(True)()
            if not torch.equal(outs[False], outs[True]):
                raise SystemExit(f"{name} {scheme}: pair blocks and the sorted path differ")
            times = {False: [], True: []}
            for _ in range(args.rounds):
                for arm in (False, True):
                    times[arm].append(timer.graph_us(layer(arm)))
            sorted_us, pairs_us = (statistics.median(times[a]) for a in (False, True))
            nbytes, flops = common.floor_terms(spec, ids, x.element_size())
            rate = ceil["fp8_tflops" if scheme in ("fp8", "a8w4") else "bf16_tflops"]
            floor = max(nbytes / (ceil["read_tbps"] * 1e6), flops / (rate * 1e6))
            row = dict(shape=name, scheme=scheme, routing=args.routing,
                       config=common.cfg_str(lookup(device_name(x.device), scheme, H, I, E, k, 1)),
                       sorted_us=round(sorted_us, 2), pairs_us=round(pairs_us, 2),
                       speedup=round(sorted_us / pairs_us, 3), floor_us=round(floor, 2),
                       sorted_frac=round(floor / sorted_us, 3), pairs_frac=round(floor / pairs_us, 3),
                       read_tbps=round(ceil["read_tbps"], 2))
            print(" ".join(f"{c}={row[c]}" for c in COLUMNS), flush=True)
            rows.append(row)
            del weights, ws
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(common.SHAPES), choices=list(common.SHAPES))
    p.add_argument("--schemes", nargs="+", default=["bf16", "fp8", "a16w4", "a8w4"],
                   choices=["bf16", "fp8", "a16w4", "a8w4"])
    p.add_argument("--routing", default="uniform", choices=["uniform", "skewed"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--csv", type=Path)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("pair_blocks_ab.py times kernels: it needs a CUDA GPU")
    rows = measure(args)
    if args.csv:
        common.write_csv(args.csv, rows, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
