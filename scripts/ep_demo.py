#!/usr/bin/env python3
"""Expert-parallel MegaMoE example: every rank checks its output against the single-rank fp32 reference.

    torchrun --nproc-per-node 2 scripts/ep_demo.py
    mpiexec -n 2 python scripts/ep_demo.py --scheme fp8 --wire fp8
    python scripts/ep_demo.py                      # one process: the local transport

CPU ranks use gloo and the torch experts; GPU ranks use NCCL and the Triton experts.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from atom_moe.ep import MegaMoE, init_distributed
from atom_moe.formats import dequantize_fp8_per_group, quantize_fp8_per_group
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import MoESpec
from atom_moe.tools.synthetic import random_layer, random_tokens
from atom_moe.weights import prepare_stacked


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--inter", type=int, default=128)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--scheme", default="bf16", choices=["bf16", "fp8", "a16w4", "a8w4"])
    p.add_argument("--wire", default="bf16", choices=["bf16", "fp8"])
    p.add_argument("--tokens", type=int, default=48, help="tokens on rank r: tokens - r (at least 0)")
    p.add_argument("--max-tokens-per-rank", type=int, default=64)
    p.add_argument("--layers", type=int, default=3, help="layers served by the one op")
    p.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> int:
    args = parse()
    info = init_distributed()
    rank, world = info.rank, info.world_size
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    spec_full = MoESpec.create(hidden_size=args.hidden, intermediate_size=args.inter, num_experts=args.experts,
                               top_k=args.top_k, scheme=args.scheme)
    spec = spec_full.for_rank(rank, world)
    layers = []
    for i in range(args.layers):  # the same random layers on every rank (shared seed)
        raw = random_layer(spec_full, generator=torch.Generator().manual_seed(args.seed + i))
        mine = prepare_stacked(spec, raw.w13, raw.w2, layout="separated", device=device)
        # the reference runs on the op's device: near-tie fp8 roundings differ across devices' matmuls
        full = prepare_stacked(spec_full, raw.w13, raw.w2, layout="separated", device=device)
        layers.append((mine, ReferenceWeights.from_prepared(full)))
    op = MegaMoE(spec, max_tokens_per_rank=args.max_tokens_per_rank, wire=args.wire,
                 experts_backend=args.backend, device=device)
    op.warmup(layers[0][0])
    T = max(args.tokens - rank, 0)
    x, w, ids = random_tokens(spec_full, T, generator=torch.Generator().manual_seed(args.seed * 1000 + rank),
                              device=device)
    worst = 0.0
    start = time.perf_counter()
    for mine, ref in layers:
        out = op(x, w, ids, mine)
        xr = x
        act_quant = spec.scheme if spec.scheme.fp8_activations else None
        if args.wire == "fp8" and act_quant is None and T:
            xr = dequantize_fp8_per_group(*quantize_fp8_per_group(x))
        expect = reference_moe(xr, w, ids, ref, spec.activation, act_quant=act_quant)
        if T:
            worst = max(worst, ((out.float() - expect).norm() / expect.norm()).item())
    elapsed = time.perf_counter() - start
    print(f"rank {rank}/{world} ({info.launcher}): transport={op.transport_name} wire={op.wire} "
          f"experts={op.experts_backend} tokens={T} layers={args.layers} buffers={op.allocated_bytes()} B "
          f"max rel err vs fp32 reference={worst:.2e} ({elapsed * 1e3:.1f} ms)", flush=True)
    op.close()
    dist.destroy_process_group()
    return 0 if worst <= 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
