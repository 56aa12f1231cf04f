"""A/B on a GPU of how the layer's launches are chained and load their tiles: the routing launch or pair
blocks at T = 1 (kernels/routing.py `PairBlocks`), with and without programmatic dependent launch
(ATOM_MOE_PDL) and TMA tile descriptors (ATOM_MOE_TMA, both kernels/common.py), same process, same weights
and routing.

Arms: `sorted` (routing + GEMM1 + GEMM2), `pairs` (T = 1 only: GEMM1 + GEMM2), `sorted+pdl`, `pairs+pdl`,
`sorted+tma` and `sorted+pdl+tma` (bf16 / fp8: weight tiles and GEMM2's rows; a16w4 / a8w4: GEMM2's rows only,
the packed MX weights stay per-thread), `sorted+rowscales` (fp8 and
a8w4 only: GEMM2's input scales row-major [rows, groups], as before 2026-12-05, instead of the workspace's
group-major layout; the kernels read either through the strides).
`--tiles BM,N1,K1,W1,S1,N2,K2,W2,S2` adds an arm `tiles=...` per value: the sorted path with that tile config
instead of the table's (other tiles sum in another order: checked against the first arm to 1 % of its largest
element, not bit for bit).
Per (shape, scheme, T): check that every arm gives the first arm's output bit for bit, then time the arms
in turn `--rounds` times (CUDA-graph replays, L2 flushed, median of `--iters`) and print / write each arm's
median over rounds, its ratio to the first arm and its fraction of the layer floor.

    python scripts/launch_ab.py --csv launch-ab.csv
    python scripts/launch_ab.py --shapes deepseek-v3 glm-5.2-tp8 --schemes fp8 --tokens 1 8 --rounds 3
    python scripts/launch_ab.py --schemes bf16 fp8 --tokens 512 2048 8192 --arms sorted sorted+tma
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atom_moe.experts import allocate_workspace, device_name, fused_experts  # noqa: E402
from atom_moe.kernels.common import PDL_FLAG, TMA_FLAG  # noqa: E402
from atom_moe.kernels.tuning import TileConfig, lookup  # noqa: E402
from atom_moe.tools import common  # noqa: E402
from atom_moe.tools.tune import parse_tile_config  # noqa: E402

ARMS = ("sorted", "pairs", "sorted+pdl", "pairs+pdl", "sorted+tma", "sorted+pdl+tma", "sorted+rowscales")
COLUMNS = ("shape", "scheme", "T", "routing", "config", "arm", "us", "vs_first", "floor_us", "frac", "read_tbps")


def arms_at(arms: list[str], T: int, scheme: str) -> list[str]:
    """The arms that run at T for `scheme`: pair blocks only for one token, row-major scales only for the e4m3
    activations (fp8, a8w4); TMA for every scheme."""
    return [a for a in arms if (T == 1 or not a.startswith("pairs"))
            and (scheme in ("fp8", "a8w4") or not a.endswith("+rowscales"))]


def tile_config(arm: str) -> TileConfig | None:
    """The tile config of a `tiles=BM,N1,K1,W1,S1,N2,K2,W2,S2[,...]` arm (tune.CONFIG_SYNTAX); None for the other
    arms (the table's)."""
    if not arm.startswith("tiles="):
        return None
    try:
        return parse_tile_config(arm.removeprefix("tiles="))
    except argparse.ArgumentTypeError as exc:
        raise SystemExit(f"--tiles {exc}") from None


def run_arm(arm: str, fn) -> object:
    """fn() with the arm's PDL and TMA settings in the environment (kernels/common.py reads them per call)."""
    parts = [] if arm.startswith("tiles=") else arm.split("+")[1:]
    old = {flag: os.environ.get(flag) for flag in (PDL_FLAG, TMA_FLAG)}
    os.environ[PDL_FLAG] = "1" if "pdl" in parts else "0"
    os.environ[TMA_FLAG] = "1" if "tma" in parts else "0"
    try:
        return fn()
    finally:
        for flag, value in old.items():
            if value is None:
                os.environ.pop(flag)
            else:
                os.environ[flag] = value


def measure(args: argparse.Namespace) -> list[dict]:
    """Every (shape, scheme, T, arm) row of the A/B."""
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
            ws = allocate_workspace(spec, max(args.tokens), "cuda")
            # the same buffers but GEMM2's input scales row-major (contiguous [rows, groups])
            ws_rows = ws if ws.inter_scale is None else \
                dataclasses.replace(ws, inter_scale=torch.empty(ws.inter_scale.shape, device="cuda"))
            for T in args.tokens:
                w, ids = common.make_routing(T, E, k, args.routing, gen, common.SHARED[name])
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                arms = arms_at(args.arms, T, scheme) + [f"tiles={t}" for t in args.tiles]
                outs = {arm: torch.empty_like(x) for arm in arms}

                def layer(arm: str):
                    arm_ws = ws_rows if arm.endswith("+rowscales") else ws
                    return lambda: fused_experts(x, w, ids, weights, spec, workspace=arm_ws, out=outs[arm],
                                                 config=tile_config(arm),
                                                 pair_blocks=arm.startswith("pairs"))
                for arm in arms:
                    run_arm(arm, layer(arm))
                    same = torch.equal(outs[arm], outs[arms[0]]) if tile_config(arm) is None else \
                        (outs[arm] - outs[arms[0]]).abs().max() <= 0.01 * outs[arms[0]].abs().max()
                    if not same:
                        raise SystemExit(f"{name} {scheme} T={T}: arm {arm} differs from {arms[0]}")
                times = {arm: [] for arm in arms}
                for _ in range(args.rounds):
                    for arm in arms:
                        times[arm].append(run_arm(arm, lambda: timer.graph_us(layer(arm))))
                nbytes, flops = common.floor_terms(spec, ids, x.element_size())
                rate = ceil["fp8_tflops" if scheme in ("fp8", "a8w4") else "bf16_tflops"]
                floor = max(nbytes / (ceil["read_tbps"] * 1e6), flops / (rate * 1e6))
                first = statistics.median(times[arms[0]])
                table = common.cfg_str(lookup(device_name(x.device), scheme, H, I, E, k, T))
                for arm in arms:
                    us = statistics.median(times[arm])
                    config = common.cfg_str(tile_config(arm)) if tile_config(arm) else table
                    row = dict(shape=name, scheme=scheme, T=T, routing=args.routing, config=config, arm=arm,
                               us=round(us, 2), vs_first=round(first / us, 3), floor_us=round(floor, 2),
                               frac=round(floor / us, 3), read_tbps=round(ceil["read_tbps"], 2))
                    print(" ".join(f"{c}={row[c]}" for c in COLUMNS), flush=True)
                    rows.append(row)
            del weights, ws, ws_rows
            torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=list(common.SHAPES), choices=list(common.SHAPES))
    p.add_argument("--schemes", nargs="+", default=["bf16", "fp8", "a16w4", "a8w4"],
                   choices=["bf16", "fp8", "a16w4", "a8w4"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 8])
    p.add_argument("--arms", nargs="+", default=list(ARMS[:4]), choices=list(ARMS))
    p.add_argument("--tiles", nargs="+", default=[], metavar="BM,N1,K1,W1,S1,N2,K2,W2,S2",
                   help="extra arms: the sorted path with these tile configs")
    p.add_argument("--routing", default="uniform", choices=["uniform", "skewed"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--csv", type=Path)
    args = p.parse_args(argv)
    if min(args.tokens) < 1:
        p.error("--tokens: allowed are positive token counts")
    for t in args.tiles:
        tile_config(f"tiles={t}")  # a malformed value fails here, before any GPU work
    if not torch.cuda.is_available():
        raise SystemExit("launch_ab.py times kernels: it needs a CUDA GPU")
    rows = measure(args)
    if args.csv:
        common.write_csv(args.csv, rows, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
