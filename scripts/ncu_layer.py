#!/usr/bin/env python3
"""Run the fused experts layer eagerly for Nsight Compute (`ncu`), one (shape, scheme, T) per case.

    ncu --profile-from-start off --clock-control none --set full -o report \
        python3 scripts/ncu_layer.py --shape deepseek-v3 --scheme a16w4 --tokens 1 128 2048

Each case builds the bench's synthetic layer (tools.common.random_weights, make_routing; uniform
or skewed routing), calls fused_experts twice outside the profiled range (compile, autotune-free
warm-up), then once between cudaProfilerStart/Stop, so ncu sees exactly one launch of each kernel
of the layer per case, launched outside CUDA graphs (ncu cannot attribute graph replays per kernel).
NVTX ranges name the case ("deepseek-v3/a16w4/T128") for `ncu --nvtx`. Prints one line per case.
"""

from __future__ import annotations

import argparse

import torch

from atom_moe.experts import allocate_workspace, fused_experts
from atom_moe.tools.common import SHAPES, bench_spec, make_routing, random_weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="deepseek-v3", choices=list(SHAPES))
    p.add_argument("--scheme", nargs="+", default=["a16w4"], choices=["bf16", "fp8", "a16w4", "a8w4"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 128, 2048])
    p.add_argument("--routing", default="uniform", choices=["uniform", "skewed"])
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_layer.py: needs a CUDA GPU")
    H, I, E, k = SHAPES[args.shape]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    cudart = torch.cuda.cudart()
    for scheme in args.scheme:
        spec = bench_spec(args.shape, scheme)
        weights = random_weights(spec)
        ws = allocate_workspace(spec, max(args.tokens), "cuda")
        for T in args.tokens:
            w, ids = make_routing(T, E, k, args.routing, gen, spec.shared_experts)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(x)
            for _ in range(2):
                fused_experts(x, w, ids, weights, spec, workspace=ws, out=out)
            torch.cuda.synchronize()
            name = f"{args.shape}/{scheme}/T{T}"
            cudart.cudaProfilerStart()
            torch.cuda.nvtx.range_push(name)
            fused_experts(x, w, ids, weights, spec, workspace=ws, out=out)
            torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
            print(f"profiled {name}: out finite {bool(torch.isfinite(out).all())}", flush=True)
        del weights, ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
