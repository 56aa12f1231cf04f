#!/usr/bin/env python3
"""Decode-sized vs exact vs prefill-sized MegaMoE on one GPU, W simulated ranks (atom_moe.ep.simulate).

    python scripts/ep_instances_bench.py --out docs/perf/ep-instances-h200.csv      # one GPU, ~3 min

MegaMoEInstances runs batches of at most --decode-capacity tokens per rank on an op of that
capacity, and batches of at most --small-capacity on a smaller one (atom_moe.ep.decode_capacities).
This measures what the decode op the instances pick for T costs against an op sized exactly for
the batch (the target: within 5 %), and what the prefill-sized op (--prefill-capacity, what one op
for every step would be) costs at the same decode sizes. Per T (tokens per rank) three symm ops over the same
weights and tokens: exact (capacity T), decode, prefill; the tile config is looked up by T and the
combine mode by paths.combine_mode, as MegaMoE does, so only the capacity differs. Each forward
(all W ranks) is captured in one CUDA graph and timed like `atom-moe bench` (L2 flushed, median).
Before timing, the decode and prefill outputs are compared with the exact op's, every element
(max |diff| <= 1e-2 max |exact|): a row is written only after that check passed, and the script
exits 1 if any failed. The W ranks share one HBM: the rows compare capacities, not multi-GPU speed.

`--kernels` also prints, per op and T, each GPU kernel's time per forward (torch.profiler, not
graphed): where an op's extra time over the exact op goes.

On a machine without CUDA (`--device cpu`, under TRITON_INTERPRET=1) the same code runs at a tiny
shape with one wall-clock call per op: a check of the script, not a measurement.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

COLUMNS = ("device", "shape", "scheme", "ep", "tokens_per_rank", "impl", "capacity", "us", "vs_exact",
           "max_diff_vs_exact", "mode", "config")
TINY = (128, 64, 8, 2)  # H, I, E, top_k for --device cpu (the interpreter)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from atom_moe.ep.instances import DECODE_TOKENS, SMALL_DECODE_TOKENS
    from atom_moe.tools.common import SHAPES

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, default=2, help="simulated ranks")
    p.add_argument("--shape", default="deepseek-v3", choices=sorted(SHAPES))
    p.add_argument("--schemes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "a16w4", "a8w4"])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 128], help="tokens per rank")
    p.add_argument("--decode-capacity", type=int, default=DECODE_TOKENS)
    p.add_argument("--small-capacity", type=int, default=SMALL_DECODE_TOKENS,
                   help="the smaller decode op's capacity (MegaMoEInstances' small_tokens; 0: none)")
    p.add_argument("--prefill-capacity", type=int, default=8192)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    p.add_argument("--out", type=Path, default=Path("ep_instances_bench.csv"))
    p.add_argument("--kernels", action="store_true", help="print per-kernel GPU time per forward (torch.profiler)")
    args = p.parse_args(argv)
    if any(t < 1 or t > args.decode_capacity for t in args.tokens):
        p.error(f"--tokens must lie in [1, --decode-capacity={args.decode_capacity}] (decode batches)")
    if args.small_capacity < 0:
        p.error(f"--small-capacity {args.small_capacity}: allowed an int >= 0 (0: no smaller decode op)")
    if args.prefill_capacity <= args.decode_capacity:
        p.error(f"--prefill-capacity {args.prefill_capacity} must exceed --decode-capacity {args.decode_capacity}")
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        p.error("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
    return args


def routing(T: int, E: int, k: int, gen: torch.Generator, device: str,
            shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniform random distinct experts per token, weights summing to 1; fused shared experts in the last slots."""
    ids = torch.rand(T, E - shared, generator=gen).topk(k - shared, dim=1).indices
    ids = torch.cat([ids, torch.arange(E - shared, E).expand(T, shared)], dim=1).to(device, torch.int32)
    w = torch.rand(T, k, generator=gen) + 0.1
    return (w / w.sum(1, keepdim=True)).to(device), ids


def main(argv: list[str] | None = None) -> int:
    """Measure, write the CSV; 1 if an op's output disagreed with the exact op's (that row is not written)."""
    args = parse(argv)
    from atom_moe.ep.instances import decode_capacities
    from atom_moe.ep.paths import combine_mode
    from atom_moe.ep.simulate import SimulatedSymmGroup
    from atom_moe.ep.symm import FUSED
    from atom_moe.experts import device_name
    from atom_moe.kernels.tuning import lookup
    from atom_moe.spec import MoESpec
    from atom_moe.tools.common import SHAPES, SHARED, Timer, cfg_str, kernel_times, random_weights, write_csv

    dev, W = args.device, args.ep
    H, I, E, k = SHAPES[args.shape] if dev == "cuda" else TINY
    shape = args.shape if dev == "cuda" else "tiny"
    name = device_name(torch.device(dev))
    timer = Timer(args.iters) if dev == "cuda" else None
    gen = torch.Generator().manual_seed(0)
    rows, failed, t0 = [], [], time.monotonic()
    for scheme in args.schemes:
        S = SHARED[args.shape] if dev == "cuda" else 0  # fused shared experts: a replica on every rank
        full = MoESpec(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, scheme=scheme, shared_experts=S)
        specs = [full.for_rank(r, W) for r in range(W)]
        weights = [random_weights(s, dev) for s in specs]
        wire = "fp8" if full.scheme.fp8_activations else "bf16"
        caps = decode_capacities(args.decode_capacity, args.small_capacity)
        decode_ops = {c: SimulatedSymmGroup(specs, c, wire, dev) for c in caps}
        prefill = SimulatedSymmGroup(specs, args.prefill_capacity, wire, dev)
        for T in args.tokens:
            routed = [routing(T, E, k, gen, dev, S) for _ in range(W)]
            xs = [torch.randn(T, H, generator=gen).to(dev, torch.bfloat16) for _ in range(W)]
            ws, ids = [r[0] for r in routed], [r[1] for r in routed]
            cfg = lookup(name, scheme, H, I, specs[0].num_local_experts, k, T)
            mode = combine_mode(specs[0], W, wire, T, torch.device(dev))
            # the decode op MegaMoEInstances picks for T: the smallest capacity that holds it
            groups = {"exact": SimulatedSymmGroup(specs, T, wire, dev),
                      "decode": decode_ops[next(c for c in caps if T <= c)], "prefill": prefill}
            outs = {n: [torch.full_like(x, float("nan")) for x in xs] for n in groups}

            def forward(n: str) -> None:
                groups[n].forward(weights, xs, ws, ids, outs[n], [mode] * W, cfg)

            for n in groups:  # the oracle first: no time is reported for an op that disagrees
                forward(n)
            ref = torch.cat(outs["exact"]).float()
            diffs = {n: float((torch.cat(outs[n]).float() - ref).abs().max()) for n in groups}
            limit = 1e-2 * float(ref.abs().max())
            bad = [n for n, d in diffs.items() if not d <= limit] + (["exact"] if not torch.isfinite(ref).all() else [])
            if bad:
                failed.append(f"{scheme} T={T}: {bad} differ from the exact op ({diffs}, limit {limit:.3g})")
                print("MISMATCH", failed[-1], flush=True)
                continue
            us = {}
            for n in groups:
                if timer is not None:
                    us[n] = timer.graph_us(lambda n=n: forward(n))
                else:
                    start = time.perf_counter()
                    forward(n)
                    us[n] = (time.perf_counter() - start) * 1e6
            if args.kernels and dev == "cuda":
                for n in groups:
                    print(f"kernels {scheme} T={T} {n} (capacity {groups[n].capacity}):", flush=True)
                    for key, (k_us, launches) in list(kernel_times(lambda n=n: forward(n)).items())[:10]:
                        print(f"  {k_us:9.1f} us  x{launches:<3d} {key[:90]}", flush=True)
            for n, g in groups.items():
                rows.append(dict(device=name, shape=shape, scheme=scheme, ep=W, tokens_per_rank=T, impl=n,
                                 capacity=g.capacity, us=round(us[n], 2), vs_exact=round(us[n] / us["exact"], 4),
                                 max_diff_vs_exact=f"{diffs[n]:.3g}", mode="fused" if mode == FUSED else "split",
                                 config=cfg_str(cfg)))
                print(" ".join(f"{c}={rows[-1][c]}" for c in COLUMNS[1:-1]), f"[{time.monotonic() - t0:.0f}s]",
                      flush=True)
            del groups["exact"]
        del decode_ops, prefill, weights
        if dev == "cuda":
            torch.cuda.empty_cache()
    write_csv(args.out, rows, COLUMNS)
    print(f"wrote {args.out} ({len(rows)} rows) in {time.monotonic() - t0:.0f} s")
    worst = [r for r in rows if r["impl"] == "decode" and r["vs_exact"] > 1.05 and dev == "cuda"]
    for r in worst:
        print(f"decode op above the 5 % target: {r['scheme']} T={r['tokens_per_rank']}: {r['vs_exact']:.3f}x exact")
    for f in failed:
        print("FAILED:", f, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
