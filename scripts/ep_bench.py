#!/usr/bin/env python3
"""Expert-parallel benchmark on W GPUs of one host: transports and the full MegaMoE layer.

    python scripts/ep_bench.py --world 2 --out docs/perf/ep-h200x2.csv \
        --thresholds kernels/configs/ep/nvidia_h200.csv

Starts one process per GPU itself (NCCL, no launcher needed). Every timing is the median
over `--reps` rounds of `--inner` back-to-back CUDA-graph replays on every rank at once
(the graphs hold their own barriers, so ranks stay in step; a round's time is divided by
`--inner`). Rows, all for DeepSeek-V3's layer (H 7168, I 2048, E 256, top-8) split over
W ranks with uniform random routing; every op is built with capacity (max_tokens_per_rank)
equal to the measured T, the way engines capture one graph per batch size:
  transport  symm: dispatch (push + barrier); torch: dispatch (index + 2 all-to-all) and
             combine (all-to-all + sum) on their own. The symm combine leg has no row of its
             own: GEMM2's epilogue does the pushes, so it is inside the layer rows.
  layer      the whole op forward: torch transport, symm fused, symm split (outputs are
             cross-checked); plus one symm row at the smallest T on an op sized for the
             largest, which shows what the capacity-sized static grids cost
Floors (the slowest rank's): max(distinct local experts' weight bytes / read ceiling,
received (token, expert) pairs' flops / matmul rate). `--thresholds` writes the
fused/split threshold rows (atom_moe/ep/paths.py): the largest measured T where fused <= split.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

H, I, E, K = 7168, 2048, 256, 8
COLUMNS = ("device", "ep", "kind", "impl", "scheme", "wire", "tokens_per_rank", "us", "bytes_per_rank", "gbps",
           "floor_us", "frac_of_floor", "note")


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=torch.cuda.device_count())
    p.add_argument("--transport-tokens", type=int, nargs="+", default=[1, 8, 128, 4096])
    p.add_argument("--layer-tokens", type=int, nargs="+", default=[8, 128, 1024, 8192])
    p.add_argument("--schemes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "a8w4"])
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("ep_bench.csv"))
    p.add_argument("--thresholds", type=Path, default=None)
    p.add_argument("--ceilings", type=float, nargs=3, default=None, metavar=("READ_TBPS", "BF16_TFLOPS", "FP8_TFLOPS"),
                   help="measured ceilings (default: measure them on rank 0)")
    return p.parse_args()


def launch(args: argparse.Namespace) -> int:
    """Start one worker per GPU with torchrun-style env; return the worst exit code."""
    from atom_moe.ep.launch import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(args.world),
           "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
           "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, *sys.argv], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(args.world)]
    return max(p.wait() for p in procs)


class Bench:
    """Times graphs replayed on every rank together."""

    def __init__(self, args, rank: int, device: torch.device) -> None:
        self.args, self.rank, self.device = args, rank, device

    def graph_us(self, fn) -> float:
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(self.args.reps):
            dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(self.args.inner):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / self.args.inner)
        del graph
        # every rank reports its own median; the slowest rank is the layer's time
        t = torch.tensor([statistics.median(times)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)


def make_weights(spec_rank, device):
    from atom_moe.weights import prepare_stacked

    g = torch.Generator(device=device).manual_seed(1000 + spec_rank.placement.rank)
    El = spec_rank.num_local_experts
    w13 = torch.randn(El, 2 * I, H, device=device, dtype=torch.bfloat16, generator=g) * (1.0 / H ** 0.5)
    w2 = torch.randn(El, H, I, device=device, dtype=torch.bfloat16, generator=g) * (1.0 / I ** 0.5)
    return prepare_stacked(spec_rank, w13, w2, layout="separated", expert_ids=spec_rank.local_experts,
                           device=device)


def tokens(T: int, device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.rand(T, K, device=device, generator=g)
    ids = torch.rand(T, E, device=device, generator=g).argsort(dim=1)[:, :K].contiguous()
    return x, w, ids


def weight_bytes_hit(ids_all: torch.Tensor, local: tuple[int, ...], per_expert: int) -> int:
    hit = torch.zeros(E, dtype=torch.bool, device=ids_all.device)
    hit[ids_all.flatten()] = True
    return int(hit[list(local)].sum()) * per_expert


def worker(args: argparse.Namespace) -> None:
    from atom_moe.tools.common import Timer, measure_ceilings
    from atom_moe.ep import MegaMoE, init_distributed
    from atom_moe.ep.symm import FUSED, SPLIT
    from atom_moe.experts import device_name
    from atom_moe.spec import MoESpec

    info = init_distributed("nccl", timeout=timedelta(minutes=5))
    rank, W = info.rank, info.world_size
    device = torch.device("cuda", info.local_rank)
    torch.cuda.set_device(device)
    bench = Bench(args, rank, device)
    rows: list[dict] = []
    name = device_name(device)
    ceil = args.ceilings
    if ceil is None:
        m = measure_ceilings(Timer(5)) if rank == 0 else {}
        ceil = [m.get("read_tbps", 0.0), m.get("bf16_tflops", 0.0), m.get("fp8_tflops", 0.0)]
        t = torch.tensor(ceil, device=device)
        dist.broadcast(t, 0)
        ceil = t.tolist()
    read_tbps = ceil[0]
    t0 = time.monotonic()

    def emit(**row):
        row = {"device": name, "ep": W, **row}
        rows.append(row)
        if rank == 0:
            print(" ".join(f"{k}={row.get(k, '')}" for k in COLUMNS[2:]), f"[{time.monotonic() - t0:.0f}s]",
                  flush=True)

    for scheme in args.schemes:
        wire = "bf16" if scheme == "bf16" else "fp8"
        full = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme=scheme)
        spec = full.for_rank(rank, W)
        weights = make_weights(spec, device)
        per_expert = (weights.w13.data.numel() * weights.w13.data.element_size()
                      + weights.w2.numel() * weights.w2.element_size()) // spec.num_local_experts
        rate = ceil[1] if scheme == "bf16" else ceil[2]
        flops_per_pair = 2 * (2 * I * H + H * I)

        def build(mtpr: int) -> dict:
            ops = {"symm": MegaMoE(spec, max_tokens_per_rank=mtpr, transport="symm", wire=wire,
                                   experts_backend="triton", device=device),
                   "torch": MegaMoE(spec, max_tokens_per_rank=mtpr, transport="torch", wire=wire,
                                    experts_backend="triton", device=device)}
            for op in ops.values():
                op.bind(weights)
                op.check_tokens = False  # every rank has the same T here; no host agreement per call
            return ops

        def layer_rows(ops: dict, T: int, impls, tag: str = "") -> None:
            x, w, ids = tokens(T, device, 11 * rank + T)
            ids_all = [torch.empty_like(ids) for _ in range(W)]
            dist.all_gather(ids_all, ids)
            every = torch.cat(ids_all)
            mine = (every.unsqueeze(-1) == torch.tensor(spec.local_experts, device=device)).any(-1).sum()
            need = torch.tensor([weight_bytes_hit(every, spec.local_experts, per_expert) / (read_tbps * 1e6),
                                 float(mine) * flops_per_pair / (rate * 1e6)], device=device)
            dist.all_reduce(need, op=dist.ReduceOp.MAX)  # the slowest rank's floors
            floor_us = float(need.max())
            out = torch.empty_like(x)
            results = {}
            for impl in impls:
                op, mode = (ops["symm"], FUSED if impl == "symm fused" else SPLIT) if impl.startswith("symm") \
                    else (ops["torch"], None)
                op.combine_override = mode
                results[impl] = op.forward(x, w, ids).float()
                us = bench.graph_us(lambda: op.forward(x, w, ids, out=out))
                emit(kind="layer", impl=impl + tag, scheme=scheme, wire=wire, tokens_per_rank=T, us=round(us, 2),
                     floor_us=round(floor_us, 2), frac_of_floor=round(floor_us / us, 3),
                     note=f"floor: {'hbm' if need[0] >= need[1] else 'mma'}; capacity {op.max_tokens_per_rank}")
            ref = results[impls[0]]
            for impl in impls[1:]:
                err = float((results[impl] - ref).norm() / ref.norm())
                if err > 1e-2:
                    raise SystemExit(f"rank {rank}: {impl} differs from {impls[0]} by {err:.3g} at T={T}")

        for T in sorted(set(args.transport_tokens) | set(args.layer_tokens)):
            ops = build(T)  # capacity = T: a graph sized for this batch, as engines capture them
            if T in args.transport_tokens:
                x, w, ids = tokens(T, device, 7 * rank + T)
                sym = ops["symm"].transport
                row_bytes = H * (1 if wire == "fp8" else 2)
                sent = int(((ids.unsqueeze(-1) // (E // W)) == torch.arange(W, device=device)).any(1).sum())

                def symm_dispatch():
                    sym.dispatch(x, w, ids, FUSED)
                    sym.barrier()
                us = bench.graph_us(symm_dispatch)
                emit(kind="transport", impl="symm dispatch", scheme=scheme, wire=wire, tokens_per_rank=T,
                     us=round(us, 2), bytes_per_rank=sent * row_bytes, gbps=round(sent * row_bytes / us / 1e3, 1),
                     note="push + barrier")
                tt = ops["torch"].transport
                us = bench.graph_us(lambda: tt.dispatch(x, w, ids))
                emit(kind="transport", impl="torch dispatch", scheme=scheme, wire=wire, tokens_per_rank=T,
                     us=round(us, 2), bytes_per_rank=sent * row_bytes, gbps=round(sent * row_bytes / us / 1e3, 1),
                     note="index + 2 all-to-all (NCCL)")
                y = torch.randn(tt.rows, H, device=device, dtype=torch.bfloat16)
                us = bench.graph_us(lambda: tt.combine(y, T))
                emit(kind="transport", impl="torch combine", scheme=scheme, wire=wire, tokens_per_rank=T,
                     us=round(us, 2), bytes_per_rank=sent * H * 2, gbps=round(sent * H * 2 / us / 1e3, 1),
                     note="all-to-all (NCCL) + sum")
            if T in args.layer_tokens:
                layer_rows(ops, T, ("torch", "symm fused", "symm split"))
            for op in ops.values():
                op.close()
        big = max(args.layer_tokens)
        ops = build(big)  # one op sized for prefill serving a decode batch: what the static grid costs
        layer_rows(ops, min(args.layer_tokens), ("symm fused",), tag=f" (capacity {big})")
        for op in ops.values():
            op.close()
        del weights
        torch.cuda.empty_cache()

    if rank == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w", newline="") as fh:
            wr = csv.DictWriter(fh, fieldnames=COLUMNS)
            wr.writeheader()
            for r in rows:
                wr.writerow({c: r.get(c, "") for c in COLUMNS})
        print(f"wrote {args.out} ({len(rows)} rows); read ceiling {read_tbps:.2f} TB/s", flush=True)
        if args.thresholds is not None:
            write_thresholds(args.thresholds, rows, name, W)
    dist.barrier()
    start = time.monotonic()
    dist.destroy_process_group()
    print(f"rank {rank}: teardown {time.monotonic() - start:.2f}s", flush=True)


def write_thresholds(path: Path, rows: list[dict], device: str, ep: int) -> None:
    """One row per scheme: the largest measured T where the fused layer was no slower than split."""
    from atom_moe.ep.paths import COLUMNS as TCOLS

    out = []
    for scheme in sorted({r["scheme"] for r in rows}):
        layer = {(r["impl"], r["tokens_per_rank"]): r for r in rows if r["kind"] == "layer" and r["scheme"] == scheme}
        Ts = sorted({T for _, T in layer})
        fused_ok = [T for T in Ts if layer[("symm fused", T)]["us"] <= layer[("symm split", T)]["us"]]
        limit = max(fused_ok) if fused_ok else 0
        at = limit if fused_ok else Ts[0]
        wire = layer[("symm fused", at)]["wire"]
        out.append(dict(device=device, scheme=scheme, H=H, I=I, E=E, top_k=K, ep=ep, wire=wire, fused_max_tokens=limit,
                        fused_us=layer[("symm fused", at)]["us"], split_us=layer[("symm split", at)]["us"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = []
    if path.exists():  # other EP sizes / shapes already in the table stay
        with open(path, newline="") as fh:
            keep = [r for r in csv.DictReader(fh) if not (r["device"] == device and int(r["ep"]) == ep
                                                          and int(r["H"]) == H and int(r["E"]) == E)]
    with open(path, "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=TCOLS)
        wr.writeheader()
        for r in keep + out:
            wr.writerow(r)
    print(f"wrote {path}: {out}", flush=True)


def main() -> int:
    args = parse()
    if "RANK" not in os.environ:
        return launch(args)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
