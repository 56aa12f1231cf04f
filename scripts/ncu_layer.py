#!/usr/bin/env python3
"""Run the fused experts layer eagerly for Nsight Compute (`ncu`), one (shape, scheme, T) per case.

    ncu --profile-from-start off --clock-control none --set full -o report \
        python3 scripts/ncu_layer.py --shape deepseek-v3 --scheme a16w4 --tokens 1 128 2048

Each case builds the bench's synthetic layer (tools.common.random_weights, make_routing; uniform
or skewed routing), calls fused_experts twice outside the profiled range (compile, autotune-free
warm-up), then once between cudaProfilerStart/Stop, so ncu sees exactly one launch of each kernel
of the layer per case, launched outside CUDA graphs (ncu cannot attribute graph replays per kernel).
NVTX ranges name the case ("deepseek-v3/a16w4/T128") for `ncu --nvtx`. Prints one line per case.

With --vllm-src (bf16 / fp8), vLLM 0.33's fused_experts runs on the same inputs after ours, with its default
config ("<case>/vllm") and, where vLLM ships a table for the device, its tuned one ("<case>/vllm-tuned"): the same
warm-up and one profiled call each (atom_moe.tools.vllm_baseline; the folder scripts/vllm_baseline_src.py makes).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from atom_moe.experts import allocate_workspace, fused_experts
from atom_moe.tools.bench import vllm_layers
from atom_moe.tools.common import SHAPES, bench_spec, make_routing, random_weights


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="deepseek-v3", choices=list(SHAPES))
    p.add_argument("--scheme", nargs="+", default=["a16w4"], choices=["bf16", "fp8", "a16w4", "a8w4"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 128, 2048])
    p.add_argument("--routing", default="uniform", choices=["uniform", "skewed"])
    p.add_argument("--vllm-src", type=Path, default=None,
                   help="also profile vLLM's fused_moe (bf16 / fp8) on the same inputs: .cache/vllm-0.33.0")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("ncu_layer.py: needs a CUDA GPU")
    vllm = None
    if args.vllm_src is not None:
        if set(args.scheme) - {"bf16", "fp8"}:
            raise SystemExit(f"ncu_layer.py: --vllm-src profiles bf16 and fp8 only (vLLM's Triton fused_moe), got "
                             f"schemes {args.scheme}")
        from atom_moe.tools import vllm_baseline
        vllm = vllm_baseline.load(args.vllm_src)
    H, I, E, k = SHAPES[args.shape]
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    cudart = torch.cuda.cudart()
    for scheme in args.scheme:
        spec = bench_spec(args.shape, scheme)
        weights = random_weights(spec)
        ws = allocate_workspace(spec, max(args.tokens), "cuda")
        peers = [] if vllm is None else vllm_layers(vllm, weights, spec, torch.cuda.get_device_name())
        for T in args.tokens:
            w, ids = make_routing(T, E, k, args.routing, gen, spec.shared_experts)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(x)
            name = f"{args.shape}/{scheme}/T{T}"
            ours = profile_once(name, lambda: fused_experts(x, w, ids, weights, spec, workspace=ws, out=out), cudart)
            for layer in peers:  # its distance from ours is printed: a wrong peer is no baseline
                theirs = profile_once(f"{name}/{'vllm' if layer.table is None else 'vllm-tuned'}",
                                      lambda: layer.forward(x, w, ids), cudart)
                err = ((theirs.float() - ours.float()).norm() / ours.float().norm().clamp_min(1e-30)).item()
                print(f"  {layer.config_name}: {layer.config(T)}; relative distance from ours {err:.2e}", flush=True)
        del weights, ws, peers
        torch.cuda.empty_cache()


def profile_once(name: str, call, cudart) -> torch.Tensor:
    """Two warm-up calls (compiles), then one between cudaProfilerStart/Stop in an NVTX range `name`."""
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    cudart.cudaProfilerStart()
    torch.cuda.nvtx.range_push(name)
    out = call()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    cudart.cudaProfilerStop()
    print(f"profiled {name}: out finite {bool(torch.isfinite(out).all())}", flush=True)
    return out


if __name__ == "__main__":
    main()
