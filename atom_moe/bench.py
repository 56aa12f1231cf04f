"""`atom-moe bench`: time the fused experts path against its floor and a torch._grouped_mm baseline.

Per (shape, scheme, T) row: CUDA-graph replay of the whole layer (routing metadata
included) with L2 flushed before every replay, median of `--iters`. In the same run it
measures the HBM read ceiling (a streaming-read kernel over a tensor far larger than L2)
and dense bf16 / fp8 matmul rates, and reports
    floor = max((bytes of distinct experts hit + activations) / read ceiling, flops / matmul rate)
with us, achieved TB/s and fraction of floor. Writes a CSV and a roofline PNG.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

SHAPES = {  # name: (H, I, E, top_k)
    "deepseek-v3": (7168, 2048, 256, 8),
    "kimi-k2": (7168, 2048, 384, 8),
    "gpt-oss-120b": (2880, 2880, 128, 4),
    "qwen3-235b-a22b": (4096, 1536, 128, 8),
    "glm-4.5": (5120, 1536, 160, 8),
}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
CSV_COLUMNS = ("device", "shape", "scheme", "T", "routing", "impl", "us", "floor_us", "frac_of_floor",
               "tbps", "tflops", "bytes", "flops", "config", "note")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the benchmark's options to `parser`."""
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--schemes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8", "a16w4", "a8w4"])
    parser.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    parser.add_argument("--routing", default="uniform", choices=["uniform", "skewed"],
                        help="uniform random top-k, or skewed (Zipf-like expert popularity)")
    parser.add_argument("--iters", type=int, default=20, help="timed graph replays per row (median)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the torch._grouped_mm baseline")
    parser.add_argument("--tune", action="store_true", help="time a few tile configs per row, keep the best")
    parser.add_argument("--tune-budget", type=float, default=1e9, help="seconds of tuning, then heuristic only")
    parser.add_argument("--tuned-csv", type=Path, default=None, help="write the best configs as a tuning table")
    parser.add_argument("--ep", type=int, default=1,
                        help="EP size W > 1: W simulated ranks of the symm transport on this GPU, timed stage by "
                             "stage (dispatch, routing, GEMM1, GEMM2, combine) next to the local path; see "
                             "atom_moe/bench_ep.py")
    parser.add_argument("--csv", type=Path, default=Path("bench.csv"))
    parser.add_argument("--plot", type=Path, default=None, help="roofline PNG (default: CSV path with .png)")


# ---------------------------------------------------------------- timing
class Timer:
    """Median time of a CUDA graph's replays, L2 flushed before each one."""

    def __init__(self, iters: int) -> None:
        self.iters = iters
        self.flush = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # >> 60 MB L2

    def graph_us(self, fn: Callable[[], object], prepare: Callable[[], object] | None = None) -> float:
        """Capture fn() in a CUDA graph and time its replays (us, median); see replay_us for prepare."""
        fn()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return self.replay_us(graph.replay, prepare)

    def replay_us(self, replay: Callable[[], object], prepare: Callable[[], object] | None = None) -> float:
        """Median us of replay() with L2 flushed before each call; prepare() (untimed) runs before each flush."""
        if prepare is not None:
            prepare()
        replay()
        times = []
        for _ in range(self.iters):
            if prepare is not None:
                prepare()  # e.g. state a lone kernel expects (breakdown: GEMM2's combine counters)
            self.flush.random_(0, 255)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return statistics.median(times)


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def stream_read(src, dst, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
        pid = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        base = pid.to(tl.int64) * BLOCK * ITERS
        for i in range(ITERS):
            offs = base + i * BLOCK + tl.arange(0, BLOCK)
            acc += tl.load(src + offs, mask=offs < n, other=0.0).to(tl.float32)
        tl.store(dst + pid, tl.sum(acc, 0))

    return stream_read


def measure_ceilings(timer: Timer) -> dict[str, float]:
    """HBM read TB/s (streaming read of 8 GiB), dense bf16 and fp8 TFLOP/s (8192^3, random data)."""
    import triton
    n = 4 * 2**30  # bf16 elements: 8 GiB
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    block, iters = 4096, 16
    grid = triton.cdiv(n, block * iters)
    dst = torch.empty(grid, dtype=torch.float32, device="cuda")
    kernel = _read_kernel()
    us = timer.graph_us(lambda: kernel[(grid,)](src, dst, n, BLOCK=block, ITERS=iters, num_warps=8))
    read_tbps = n * 2 / us / 1e6
    del src, dst
    m = 8192
    a = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(m, m, device="cuda", dtype=torch.bfloat16)
    bf16_tflops = 2 * m**3 / timer.graph_us(lambda: a @ b) / 1e6
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    fp8_tflops = 2 * m**3 / timer.graph_us(
        lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16)) / 1e6
    return {"read_tbps": read_tbps, "bf16_tflops": bf16_tflops, "fp8_tflops": fp8_tflops}


CEILING_KEYS = ("read_tbps", "bf16_tflops", "fp8_tflops")


def ceilings(timer: Timer, given: list[float] | None) -> dict[str, float]:
    """The given (READ_TBPS, BF16_TFLOPS, FP8_TFLOPS) as a ceilings dict, else measured now."""
    if given:
        return dict(zip(CEILING_KEYS, given))
    measured = measure_ceilings(timer)
    torch.cuda.empty_cache()
    return measured


# ---------------------------------------------------------------- problem setup
def random_weights(spec, device: str = "cuda"):
    """PreparedWeights with random values in the kernels' formats (built per expert: no fp32 copy)."""
    from .layout import GateUpKind, GateUpLayout, GateUpTensor
    from .spec import Scheme
    from .weights import PreparedWeights
    H, I, E = spec.hidden_size, spec.intermediate_size, spec.num_local_experts
    if spec.scheme.is_mxfp4:
        return _random_mxfp4_weights(spec, device)
    fp8 = spec.scheme is Scheme.FP8
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    w13 = torch.empty(E, 2 * I, H, dtype=dtype, device=device)
    w2 = torch.empty(E, H, I, dtype=dtype, device=device)
    for e in range(E):  # random values are valid in any gate/up layout: tag them INTERLEAVED
        w13[e] = (torch.randn(2 * I, H, device=device, dtype=torch.bfloat16) * (32 if fp8 else H ** -0.5)).to(dtype)
        w2[e] = (torch.randn(H, I, device=device, dtype=torch.bfloat16) * (32 if fp8 else I ** -0.5)).to(dtype)
    s13 = s2 = None
    if fp8:
        nb, kb = -(-I // 128), -(-H // 128)
        s13 = GateUpTensor(torch.rand(E, nb, 2, kb, device=device) * (2 / 32 / H ** 0.5), GateUpLayout.INTERLEAVED,
                           GateUpKind.BLOCK_SCALE)
        s2 = torch.rand(E, -(-H // 128), nb, device=device) * (2 / 32 / I ** 0.5)
    emap = torch.full((spec.num_experts,), -1, dtype=torch.int32)
    emap[list(spec.local_experts)] = torch.arange(E, dtype=torch.int32)
    return PreparedWeights(spec.scheme, H, I, spec.num_experts, spec.local_experts, E, emap.to(device),
                           GateUpTensor(w13, GateUpLayout.INTERLEAVED), s13, w2, s2)


def _random_mxfp4_weights(spec, device: str):
    """Random e2m1 bytes with e8m0 scales near 2^-8 (rows of unit-ish gain at these sizes), as MX tiles.

    Drawn and tiled one expert at a time (weights.prepare_mxfp4_local): no plain copy of the layer.
    """
    from .weights import prepare_mxfp4_local
    H, I, E = spec.hidden_size, spec.intermediate_size, spec.num_local_experts
    u8 = dict(dtype=torch.uint8, device=device)

    def experts():  # random bytes are valid in any gate/up layout: they are taken as INTERLEAVED rows
        for _ in range(E):
            yield (torch.randint(0, 256, (2 * I, H // 2), **u8), torch.randint(116, 122, (2 * I, H // 32), **u8),
                   torch.randint(0, 256, (H, I // 2), **u8), torch.randint(116, 122, (H, I // 32), **u8))
    return prepare_mxfp4_local(spec, experts(), device=device)


def make_routing(T: int, E: int, k: int, mode: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights, int32 ids) [T, k]: uniform random distinct experts, or Zipf-skewed popularity."""
    if mode == "uniform":
        ids = torch.rand(T, E, generator=gen, device="cuda").topk(k, dim=1).indices
    else:
        pop = 1.0 / torch.arange(1, E + 1, device="cuda", dtype=torch.float32) ** 1.2
        ids = torch.multinomial(pop.expand(T, E), k, replacement=False, generator=gen)
    w = torch.rand(T, k, generator=gen, device="cuda") + 0.1
    return (w / w.sum(1, keepdim=True)), ids.to(torch.int32)


def floor_terms(spec, ids: torch.Tensor, x_bytes: int) -> tuple[float, float]:
    """(bytes, flops) the layer must move / do: distinct experts' weights + activations; 2*pairs*3*H*I."""
    H, I = spec.hidden_size, spec.intermediate_size
    hit = int(torch.unique(ids).numel())  # bench setup only: outside the timed region
    # bytes per weight: bf16 2, fp8 1, MXFP4 0.5 (e2m1) + 1/32 (one e8m0 byte per 32)
    w_bytes = {"fp8": 1, "a16w4": 0.5 + 1 / 32, "a8w4": 0.5 + 1 / 32}.get(spec.scheme.value, 2)
    per_expert = int(3 * H * I * w_bytes)
    if spec.scheme.value == "fp8":
        per_expert += 4 * (2 * math.ceil(I / 128) * math.ceil(H / 128) + math.ceil(H / 128) * math.ceil(I / 128))
    T = ids.shape[0]
    return hit * per_expert + T * H * (x_bytes + 2), 2.0 * ids.numel() * 3 * H * I


def grouped_mm_pipeline(x, w, ids, w13, w2):
    """bf16 baseline: sort by expert, torch._grouped_mm twice, SwiGLU, weighted scatter-add."""
    T, k = ids.shape
    E = w13.shape[0]
    flat = ids.flatten().long()
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)
    tok = order // k
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    a = (torch.nn.functional.silu(h[:, 0::2]) * h[:, 1::2]).to(torch.bfloat16)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    y = y.float() * w.flatten()[order, None]
    return torch.zeros(T, x.shape[1], device=x.device).index_add_(0, tok, y).to(x.dtype)


# ---------------------------------------------------------------- driver
def candidates(scheme: str, tokens: int, spec) -> list:
    """A few tile configs around the heuristic's, for --tune (BLOCK_M by rows per expert)."""
    from .kernels.tuning import TileConfig, heuristic
    base = heuristic(scheme, spec.hidden_size, spec.intermediate_size, spec.num_local_experts, spec.top_k, tokens)
    T = TileConfig
    if scheme in ("fp8", "a8w4"):  # GEMM1 tile fixed at 256 x 128 (whole activation groups)
        small = [T(16, 256, 128, 4, 4, 64, 128, 4, 4), T(16, 256, 128, 4, 3, 128, 128, 4, 4),
                 T(16, 256, 128, 8, 4, 128, 128, 4, 5), T(32, 256, 128, 4, 4, 128, 128, 4, 4)]
        large = [T(64, 256, 128, 4, 4, 128, 128, 4, 4), T(64, 256, 128, 8, 3, 128, 128, 8, 3),
                 T(64, 256, 128, 8, 4, 256, 128, 8, 3), T(128, 256, 128, 8, 3, 128, 128, 8, 3)]
    else:
        small = [T(16, 128, 64, 4, 4, 128, 64, 4, 4), T(16, 64, 128, 4, 4, 64, 128, 4, 4),
                 T(16, 128, 128, 4, 3, 128, 128, 4, 3), T(32, 128, 64, 4, 4, 128, 64, 4, 4)]
        large = [T(64, 128, 64, 4, 4, 128, 64, 4, 4), T(64, 256, 64, 8, 3, 256, 64, 8, 3),
                 T(128, 128, 64, 8, 3, 128, 64, 8, 3), T(128, 256, 64, 8, 3, 256, 64, 8, 3)]
    pool = small if base.block_m <= 32 else large
    if base.block_m == 32 or base.block_m == 64:
        pool = small[-2:] + large[:2]
    return list(dict.fromkeys([base, *pool]))


def run(args: argparse.Namespace) -> list[dict]:
    """Run the benchmark described by args; write the CSV (and PNG); return the rows."""
    from .experts import allocate_workspace, device_name, fused_experts
    from .spec import MoESpec
    if getattr(args, "ep", 1) > 1:
        from . import bench_ep
        if args.csv == Path("bench.csv"):
            args.csv = bench_ep.default_csv(args.csv, args.ep)
        return bench_ep.run(args)
    if not torch.cuda.is_available():
        raise SystemExit("atom-moe bench needs a CUDA GPU")
    timer = Timer(args.iters)
    ceil = measure_ceilings(timer)
    dev = device_name(torch.device("cuda"))
    print(f"device {dev}: HBM read {ceil['read_tbps']:.2f} TB/s, bf16 {ceil['bf16_tflops']:.0f} TFLOP/s, "
          f"fp8 {ceil['fp8_tflops']:.0f} TFLOP/s", flush=True)
    grouped = hasattr(torch, "_grouped_mm")
    if not grouped and not args.no_baseline:
        print("baseline: torch._grouped_mm is unavailable in this torch; no baseline rows", flush=True)
    rows, tuned = [], []
    t_start = time.monotonic()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for name in args.shapes:
        H, I, E, k = SHAPES[name]
        for scheme in args.schemes:
            spec = MoESpec(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, scheme=scheme)
            weights = random_weights(spec)
            ws = allocate_workspace(spec, max(args.tokens), "cuda")
            # compute floor at the issue's MMA rate: fp8 for fp8 and a8w4 (a8w4's target, though its
            # kernels dot in bf16 today), bf16 otherwise
            rate = ceil["fp8_tflops" if scheme in ("fp8", "a8w4") else "bf16_tflops"]
            for T in args.tokens:
                w, ids = make_routing(T, E, k, args.routing, gen)
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                out = torch.empty_like(x)
                nbytes, flops = floor_terms(spec, ids, 2)
                floor_us = max(nbytes / (ceil["read_tbps"] * 1e6), flops / (rate * 1e6))

                def row(impl, us, config="", note=""):
                    r = dict(device=dev, shape=name, scheme=scheme, T=T, routing=args.routing, impl=impl,
                             us=round(us, 2), floor_us=round(floor_us, 2), frac_of_floor=round(floor_us / us, 3),
                             tbps=round(nbytes / us / 1e6, 3), tflops=round(flops / us / 1e6, 1), bytes=nbytes,
                             flops=flops, config=config, note=note)
                    rows.append(r)
                    print(f"{name:16s} {scheme:5s} T={T:5d} {impl:12s} {us:10.1f} us  floor {floor_us:9.1f}  "
                          f"frac {floor_us / us:5.3f}  {nbytes / us / 1e6:5.2f} TB/s  {config}", flush=True)

                tuning_on = args.tune and time.monotonic() - t_start < args.tune_budget
                configs = candidates(scheme, T, spec) if tuning_on else [None]
                best = None
                for cfg in configs:
                    try:
                        us = timer.graph_us(lambda: fused_experts(x, w, ids, weights, spec, workspace=ws,
                                                                  config=cfg, out=out))
                    except Exception as exc:  # a candidate that does not compile or fit is skipped
                        print(f"  config {cfg} failed: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                        continue
                    if best is None or us < best[0]:
                        best = (us, cfg)
                if best is None:
                    raise RuntimeError(f"no config ran for {name} {scheme} T={T}")
                from .kernels.tuning import lookup
                used = best[1] or lookup(dev, scheme, H, I, E, k, T)
                row("atom_moe", best[0], config=_cfg_str(used))
                tuned.append(dict(device=dev, scheme=scheme, H=H, I=I, E=E, top_k=k, tokens=T, **asdict(used),
                                  us=round(best[0], 2)))
                if scheme == "bf16" and grouped and not args.no_baseline:
                    try:
                        us = timer.graph_us(lambda: grouped_mm_pipeline(x, w, ids, weights.w13.data, weights.w2))
                        row("grouped_mm", us, note="torch._grouped_mm bf16")
                    except Exception as exc:
                        print(f"  baseline failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            del weights, ws
            torch.cuda.empty_cache()
    _write_csv(args.csv, rows, CSV_COLUMNS)
    if args.tuned_csv is not None:
        from .kernels.tuning import COLUMNS
        _write_csv(args.tuned_csv, tuned, COLUMNS)
    plot(rows, ceil, args.plot or args.csv.with_suffix(".png"))
    return rows


def _cfg_str(cfg) -> str:
    return (f"bm{cfg.block_m} n1={cfg.block_n1} k1={cfg.block_k1} w{cfg.warps1} s{cfg.stages1} "
            f"n2={cfg.block_n2} k2={cfg.block_k2} w{cfg.warps2} s{cfg.stages2}")


def _write_csv(path: Path, rows: list[dict], columns) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(columns), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], ceil: dict[str, float], path: Path) -> None:
    """Roofline: achieved TFLOP/s vs arithmetic intensity, with the measured ceilings."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", flush=True)
        return
    fig, ax = plt.subplots(figsize=(9, 6))
    xs = [10 ** (i / 20) for i in range(-20, 100)]
    for key, style in (("bf16_tflops", "-"), ("fp8_tflops", "--")):
        ax.plot(xs, [min(ceil[key], x * ceil["read_tbps"]) for x in xs], "k" + style, lw=1,
                label=f"roof {key.split('_')[0]} ({ceil[key]:.0f} TFLOP/s, {ceil['read_tbps']:.2f} TB/s)")
    markers = {"bf16": "o", "fp8": "s", "a16w4": "^", "a8w4": "D"}
    impls = ["atom_moe"] + sorted({r["impl"] for r in rows} - {"atom_moe"})
    for impl, color in zip(impls, ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")):
        for scheme in markers:
            sel = [r for r in rows if r["impl"] == impl and r["scheme"] == scheme]
            if sel:
                ax.scatter([float(r["flops"]) / float(r["bytes"]) for r in sel], [float(r["tflops"]) for r in sel], c=color,
                           marker=markers[scheme], s=18, label=f"{impl} {scheme}", alpha=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte of distinct experts + activations)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"atom_moe fused experts, {rows[0]['device'] if rows else ''} ({time.strftime('%Y-%m-%d')})")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    """Standalone entry point (scripts/bench.py)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
