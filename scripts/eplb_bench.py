#!/usr/bin/env python3
"""Skewed routing with and without redundant experts: the slowest rank's experts step, W simulated ranks on one GPU.

    python scripts/eplb_bench.py                                   # one GPU, defaults below, writes the CSV
    TRITON_INTERPRET=1 python scripts/eplb_bench.py --tiny --csv /tmp/eplb.csv   # the CPU, tiny layer

Every rank draws T tokens whose k experts follow Zipf popularity (expert of popularity rank
i has weight 1 / i^alpha, alpha 1.2, over a random order of the experts). Three placements
of the same layer are compared:
    linear       one slot per expert, experts e*W/N.. on rank r (no EPLB)
    rearranged   one slot per expert, placed by atom_moe.balance.balanced_placement
    redundant    N + R slots: the hottest experts replicated, then balanced (one row per --redundant R)
The placements come from the counts of a separate calibration batch of the same distribution
(what the op's load statistic records). W symm ranks run in this process
(atom_moe.ep.simulate): the tokens are dispatched, then each rank's experts step
(routing + GEMM1 + GEMM2 with its pushes back) is timed alone, in a CUDA graph, median
of --iters replays. That step is where skew lands: dispatch and combine cost each rank the
same for equal T. slowest_us is the step time of the slowest rank, the one every rank
waits for. forward_us times the whole simulated forward (all W ranks back to back on the
one GPU: a sum, not a multi-GPU step). Every output is checked against the fp32 reference
first (rel_err; the script exits 1 above the bound). On the CPU (--tiny, Triton's
interpreter) the times are one wall-clock call each and mean nothing beyond the plumbing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from atom_moe.balance import balanced_placement, rank_loads
from atom_moe.ep.simulate import SimulatedSymmGroup
from atom_moe.ep.symm import FUSED
from atom_moe.experts import fused_experts
from atom_moe.placement import ExpertPlacement, physical_ids
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import MoESpec
from atom_moe.tools import common
from atom_moe.tools.synthetic import random_layer
from atom_moe.weights import prepare_stacked

COLUMNS = ("device", "placement", "ep", "experts", "slots", "H", "I", "top_k", "T", "scheme", "alpha",
           "expected_max_share", "rank_pairs", "slowest_pairs", "slowest_us", "mean_us", "rank_us",
           "speedup_vs_linear", "forward_us", "rel_err")
# relative Frobenius error against the fp32 reference (fp8: with the kernels' activation quant); fp8 also
# re-quantizes GEMM1's output, which the reference does not
BOUND = {"bf16": 1e-2, "fp8": 2e-2}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ep", type=int, default=8, help="simulated ranks (default 8)")
    p.add_argument("--experts", type=int, default=128, help="logical experts N (default 128)")
    p.add_argument("--redundant", default="32", help="comma list of extra slots R, each a row (default 32)")
    p.add_argument("--hidden", type=int, default=4096, help="default 4096 (Qwen3-235B)")
    p.add_argument("--inter", type=int, default=1536, help="default 1536")
    p.add_argument("--top-k", type=int, default=8, help="default 8")
    p.add_argument("--tokens", type=int, default=512, help="tokens per rank T (default 512: a prefill chunk)")
    p.add_argument("--scheme", default="bf16", choices=sorted(BOUND), help="default bf16")
    p.add_argument("--alpha", type=float, default=1.2, help="Zipf exponent (default 1.2)")
    p.add_argument("--iters", type=int, default=20, help="timed replays per rank (GPU; default 20)")
    p.add_argument("--seed", type=int, default=0, help="default 0")
    p.add_argument("--tiny", action="store_true", help="a tiny layer for the CPU (Triton's interpreter)")
    p.add_argument("--csv", type=Path, default=Path("eplb-bench.csv"), help="default ./eplb-bench.csv")
    a = p.parse_args(argv)
    if a.tiny:
        a.ep, a.experts, a.hidden, a.inter, a.top_k, a.tokens, a.redundant = 2, 6, 64, 32, 2, 6, "2"
    try:
        a.redundant = [int(r) for r in a.redundant.split(",") if r.strip()]
    except ValueError:
        p.error(f"--redundant {a.redundant!r}: allowed: a comma list of integers >= 1")
    for name in ("ep", "experts", "hidden", "inter", "top_k", "tokens", "iters"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(a, name)}: allowed: >= 1")
    if a.experts % a.ep:
        p.error(f"--experts {a.experts} must be a multiple of --ep {a.ep} (the linear placement)")
    bad = [r for r in a.redundant if r < 1 or (a.experts + r) % a.ep]
    if bad:
        p.error(f"--redundant {bad}: allowed: R >= 1 with experts + R a multiple of --ep {a.ep}")
    if a.top_k > a.experts:
        p.error(f"--top-k {a.top_k} exceeds --experts {a.experts}")
    return a


def zipf_batch(T: int, N: int, k: int, alpha: float, order: torch.Tensor,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights, int64 ids) [T, k]: k distinct experts per token, expert order[i] with popularity 1/(i+1)^alpha."""
    pop = torch.empty(N, dtype=torch.float64)
    pop[order] = 1.0 / torch.arange(1, N + 1, dtype=torch.float64) ** alpha
    ids = torch.multinomial(pop.expand(T, N), k, replacement=False, generator=gen)
    w = torch.rand(T, k, generator=gen) + 0.1
    return (w / w.sum(1, keepdim=True)).float(), ids


def placements(a: argparse.Namespace, counts: torch.Tensor) -> list[tuple[str, ExpertPlacement | None]]:
    """(name, placement) rows: linear (None: a plain spec), rearranged, and redundant per R."""
    N, W = a.experts, a.ep
    rows: list[tuple[str, ExpertPlacement | None]] = [("linear", None),
                                                      ("rearranged", balanced_placement(counts, N, W))]
    return rows + [(f"redundant+{R}", balanced_placement(counts, N + R, W)) for R in a.redundant]


def time_us(fn, timer: common.Timer | None) -> float:
    """A CUDA graph's median replay (GPU) or one wall-clock call (CPU)."""
    if timer is not None:
        return timer.graph_us(fn)
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def run_placement(a, full: MoESpec, raw, ref_w, placed: ExpertPlacement | None, batch, device,
                  timer) -> dict:
    """Check the outputs, then time each rank's experts step and the whole forward for one placement."""
    W, T = a.ep, a.tokens
    phys = None if placed is None else placed.slots()
    specs = [full.for_rank(r, W, physical_experts=phys) if phys else full.for_rank(r, W) for r in range(W)]
    weights = [prepare_stacked(s, raw.w13, raw.w2, layout="separated", device=device) for s in specs]
    group = SimulatedSymmGroup(specs, T, "bf16", device)
    xs, ws, ids = ([b[i].to(device) for b in batch] for i in range(3))
    outs = [torch.full_like(x, float("nan")) for x in xs]
    group.forward(weights, xs, ws, ids, outs, [FUSED] * W)
    errs = []
    for x, w, i, o in zip(xs, ws, ids, outs):
        ref = reference_moe(x, w, i, ref_w, full.activation,
                            act_quant=full.scheme if full.scheme.fp8_activations else None)
        errs.append(float((o.float() - ref).norm() / ref.norm()))
    err = float(torch.tensor(errs).max())  # torch's max keeps a NaN (an unwritten row), Python's would drop it
    # the experts step of each rank alone: dispatch every rank's tokens (slot ids, as the forward does) once
    slot_ids = ids if placed is None else [
        physical_ids(i, t["replica_slots"], t["replica_count"], t["pair_index"], t["slot_ids"]).clone()
        for i, t in zip(ids, group.tables)]
    for r, tr in enumerate(group.transports):
        tr.dispatch(xs[r], ws[r], slot_ids[r], FUSED)
    for tr in group.transports:
        tr.barrier(signal=True, wait=False)
    for tr in group.transports:
        tr.barrier(signal=False, wait=True)
    rank_us, pairs = [], []
    for r, tr in enumerate(group.transports):
        rows, scales, w, rid = tr.received()
        pairs.append(int(((rid >= 0) & (rid < group.specs[r].num_experts)).sum()))  # setup only: a host sync
        launches = common.record_launches(lambda: fused_experts(
            rows, w, rid, weights[r], group.specs[r], workspace=group.workspaces[r], x_scale=scales,
            remote=tr.remote_output()))
        rank_us.append(time_us(lambda: [launch() for launch in launches], timer))
    forward_us = time_us(lambda: group.forward(weights, xs, ws, ids, outs, [FUSED] * W), timer)
    assert group.errors() == [0] * W, f"symm barrier gave up: {group.errors()}"
    slowest = max(range(W), key=lambda r: rank_us[r])
    return dict(slots=specs[0].num_physical_experts, rank_pairs=";".join(map(str, pairs)),
                slowest_pairs=pairs[slowest], slowest_us=round(rank_us[slowest], 2),
                mean_us=round(sum(rank_us) / W, 2), rank_us=";".join(f"{u:.1f}" for u in rank_us),
                forward_us=round(forward_us, 2), rel_err=f"{err:.2e}")


def main(argv: list[str] | None = None) -> int:
    """Run every placement, print and write the rows; 1 if an output misses the reference bound."""
    a = parse(argv)
    cuda = torch.cuda.is_available() and not a.tiny
    device = torch.device("cuda" if cuda else "cpu")
    timer = common.Timer(a.iters) if cuda else None
    dev = torch.cuda.get_device_name() if cuda else "cpu (interpreter)"
    full = MoESpec.create(hidden_size=a.hidden, intermediate_size=a.inter, num_experts=a.experts, top_k=a.top_k,
                          scheme=a.scheme, max_tokens_per_rank=a.tokens)
    gen = torch.Generator().manual_seed(a.seed)
    raw = random_layer(full, generator=torch.Generator(device).manual_seed(a.seed), device=device)
    ref_w = ReferenceWeights.from_prepared(prepare_stacked(full, raw.w13, raw.w2, layout="separated", device=device))
    order = torch.randperm(a.experts, generator=gen)
    calib = torch.cat([zipf_batch(a.tokens, a.experts, a.top_k, a.alpha, order, gen)[1] for _ in range(a.ep)])
    counts = torch.bincount(calib.view(-1), minlength=a.experts)
    batch = []
    for _ in range(a.ep):
        w, ids = zipf_batch(a.tokens, a.experts, a.top_k, a.alpha, order, gen)
        batch.append((torch.randn(a.tokens, a.hidden, generator=gen).to(torch.bfloat16), w, ids))
    print(f"{dev}: {a.ep} simulated ranks, H{a.hidden} I{a.inter} N{a.experts} k{a.top_k} T{a.tokens}/rank "
          f"{a.scheme}, Zipf alpha {a.alpha}; hottest expert {int(counts.max())} of {int(counts.sum())} "
          f"calibration pairs", flush=True)
    rows, t0 = [], time.monotonic()
    for name, placed in placements(a, counts):
        got = run_placement(a, full, raw, ref_w, placed, batch, device, timer)
        row = dict(device=dev, placement=name, ep=a.ep, experts=a.experts, H=a.hidden, I=a.inter, top_k=a.top_k,
                   T=a.tokens, scheme=a.scheme, alpha=a.alpha, **got)
        row["speedup_vs_linear"] = round(rows[0]["slowest_us"] / row["slowest_us"], 3) if rows else 1.0
        # the busiest rank's share of the calibration pairs under this placement (linear: the identity map)
        shares = rank_loads(placed or ExpertPlacement.identity(a.experts), counts, a.ep)
        row["expected_max_share"] = round(max(shares) / float(counts.sum()), 3)
        rows.append(row)
        print(" ".join(f"{c}={row[c]}" for c in COLUMNS[1:]), f"[{time.monotonic() - t0:.0f}s]", flush=True)
        torch.cuda.empty_cache() if cuda else None
    common.write_csv(a.csv, rows, COLUMNS)
    print(f"wrote {a.csv}")
    bad = [r["placement"] for r in rows if not float(r["rel_err"]) <= BOUND[a.scheme]]  # NaN fails
    if bad:
        print(f"FAILED: outputs of {bad} exceed rel_err {BOUND[a.scheme]} against the fp32 reference", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
