#!/usr/bin/env python3
"""Where a8w4's error at decode sizes comes from, on a GPU: the layer against its torch twin and the fp32 layer.

    python3 scripts/a8w4_error_probe.py --shapes glm-5.2-tp4 deepseek-v4.1-flash-tp2 deepseek-v3 --seeds 8 --csv p.csv

Per (shape, T, seed): the bench's random weights and uniform routing, then fused_experts with the table's tiles
(`table`, split-K as the table or heuristic picks it) and with that config at GEMM1 split-K 1, 2 and 4
(`split1` ..., the table's own split left out). Each is compared with experts_torch (the twin: the same e4m3
quantization of x and of GEMM2's input, fp32 sums) and with the fp32 layer on the same MXFP4 weights (no
activation quant, `truth`); the twin's own distance to the truth is printed beside them. The GPU tests hold a8w4 to 2e-2 of the twin and to no more
than 1e-3 further from the truth than the twin (tests/kernel_cases.py `assert_near_twin`): this shows how often
and by how much each arm misses that.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from atom_moe.experts import allocate_workspace, device_name, fused_experts  # noqa: E402
from atom_moe.experts_torch import experts_torch  # noqa: E402
from atom_moe.kernels.tuning import MAX_SPLIT_K, lookup  # noqa: E402
from atom_moe.reference import reference_moe_prepared  # noqa: E402
from atom_moe.tools import common  # noqa: E402
from atom_moe.tools.accuracy import rel  # noqa: E402
from atom_moe.tools.args import positive_int  # noqa: E402

COLUMNS = ("shape", "T", "seed", "arm", "config", "vs_twin", "vs_truth", "twin_vs_truth", "excess")


def probe(args: argparse.Namespace) -> list[dict]:
    """Every (shape, T, seed, arm) row."""
    rows = []
    for name in args.shapes:
        spec = common.bench_spec(name, "a8w4")
        H, I, E, k = common.SHAPES[name]
        p = common.random_weights(spec, "cuda")
        ws = allocate_workspace(spec, max(args.tokens), "cuda")
        for T in args.tokens:
            table = lookup(device_name(torch.device("cuda")), "a8w4", H, I, E, k, T)
            # the table's own split is its `table` arm, not run twice
            arms = {"table": table, **{f"split{s}": dataclasses.replace(table, split_k1=s) for s in args.splits
                                       if s != table.split_k1}}
            for seed in range(args.seeds):
                gen = torch.Generator(device="cuda").manual_seed(seed)
                w, ids = common.make_routing(T, E, k, "uniform", gen, common.SHARED[name])
                x = torch.randn(T, H, device="cuda", generator=gen).to(torch.bfloat16)
                twin = experts_torch(x, w, ids, p, spec)
                truth = reference_moe_prepared(x, w, ids, p, spec.activation)
                base = rel(twin, truth)
                for arm, cfg in arms.items():
                    got = fused_experts(x, w, ids, p, spec, workspace=ws, config=cfg)
                    row = dict(shape=name, T=T, seed=seed, arm=arm, config=common.cfg_str(cfg),
                               vs_twin=round(rel(got, twin), 5), vs_truth=round(rel(got, truth), 5),
                               twin_vs_truth=round(base, 5), excess=round(rel(got, truth) - base, 5))
                    print(" ".join(f"{c}={row[c]}" for c in COLUMNS), flush=True)
                    rows.append(row)
        del p, ws
        torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["glm-5.2-tp4", "deepseek-v4.1-flash-tp2", "deepseek-v3"],
                    choices=list(common.SHAPES))
    ap.add_argument("--tokens", nargs="+", type=positive_int, default=[1, 8])
    ap.add_argument("--splits", nargs="+", type=int, default=[1, 2, 4])
    ap.add_argument("--seeds", type=positive_int, default=8)
    ap.add_argument("--csv", type=Path)
    args = ap.parse_args(argv)
    if not all(1 <= s <= MAX_SPLIT_K for s in args.splits):
        ap.error(f"--splits: allowed are 1..{MAX_SPLIT_K} (GEMM1's K splits)")
    if not torch.cuda.is_available():
        raise SystemExit("a8w4_error_probe.py runs the kernels: it needs a CUDA GPU")
    rows = probe(args)
    if args.csv:
        common.write_csv(args.csv, rows, COLUMNS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
