"""Helpers every benchmarking tool shares: bench shapes, the CUDA-graph timer, measured
ceilings and floors, synthetic weights and routing, CSV and roofline output, and the
recording of a layer's Triton launches. Tools import these; none of them imports another tool.
"""

from __future__ import annotations

import csv
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..presets import PRESETS
from ..spec import MoESpec

# name: (H, I, E, top_k) of every preset (atom_moe/presets.py), the served TP shards included
SHAPES = {name: (s.hidden_size, s.intermediate_size, s.num_experts, s.top_k) for name, s in PRESETS.items()}
# name: fused shared experts (the last S of E, named by every token's last S slots; glm-5.2-tpN: 1)
SHARED = {name: s.shared_experts for name, s in PRESETS.items()}


def bench_spec(name: str, scheme: str, **fields) -> MoESpec:
    """The bench layer of shape `name` in `scheme`: its H, I, E, top_k and fused shared experts (default
    SwiGLU and routing: the benchmarks hand the kernels their ids), with `fields` overriding."""
    H, I, E, k = SHAPES[name]
    shape = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, shared_experts=SHARED[name])
    return MoESpec(**{**shape, "scheme": scheme, **fields})


TOKENS = (1, 8, 32, 128, 512, 2048, 8192)


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


def kernel_times(fn: Callable[[], object], iters: int = 10) -> dict[str, tuple[float, int]]:
    """Per GPU kernel of fn(): (device us per call, launches per call), from torch.profiler over iters calls."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    times = {}
    for event in prof.key_averages():
        us = event.self_device_time_total
        if us > 0:
            times[event.key] = (us / iters, event.count // iters)
    return dict(sorted(times.items(), key=lambda kv: -kv[1][0]))


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
    from ..layouts.gate_up import GateUpKind, GateUpLayout, GateUpTensor
    from ..spec import Scheme
    from ..weights import PreparedWeights
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
    from ..weights import prepare_mxfp4_local
    H, I, E = spec.hidden_size, spec.intermediate_size, spec.num_local_experts
    u8 = dict(dtype=torch.uint8, device=device)

    def experts():  # random bytes are valid in any gate/up layout: they are taken as INTERLEAVED rows
        for _ in range(E):
            yield (torch.randint(0, 256, (2 * I, H // 2), **u8), torch.randint(116, 122, (2 * I, H // 32), **u8),
                   torch.randint(0, 256, (H, I // 2), **u8), torch.randint(116, 122, (H, I // 32), **u8))
    return prepare_mxfp4_local(spec, experts(), device=device)


def make_routing(T: int, E: int, k: int, mode: str, gen: torch.Generator,
                 shared: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 weights, int32 ids) [T, k]: uniform random distinct experts, or Zipf-skewed popularity.

    shared > 0: fused shared experts, as the engines route them: the first k - shared slots pick
    among the E - shared routed experts, the last `shared` slots name experts E - shared .. E - 1.
    """
    dev = gen.device
    routed, rk = E - shared, k - shared
    if mode == "uniform":
        ids = torch.rand(T, routed, generator=gen, device=dev).topk(rk, dim=1).indices
    else:
        pop = 1.0 / torch.arange(1, routed + 1, device=dev, dtype=torch.float32) ** 1.2
        ids = torch.multinomial(pop.expand(T, routed), rk, replacement=False, generator=gen)
    if shared:
        ids = torch.cat([ids, torch.arange(routed, E, device=dev).expand(T, shared)], dim=1)
    w = torch.rand(T, k, generator=gen, device=dev) + 0.1
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


def cfg_str(cfg) -> str:
    """A tile config in one short string, as the CSVs and tables print it."""
    return (f"bm{cfg.block_m} n1={cfg.block_n1} k1={cfg.block_k1} w{cfg.warps1} s{cfg.stages1} "
            f"n2={cfg.block_n2} k2={cfg.block_k2} w{cfg.warps2} s{cfg.stages2}"
            + (f" split{cfg.split_k1}" if getattr(cfg, "split_k1", 1) > 1 else "")
            + (f" split_k2={cfg.split_k2}" if getattr(cfg, "split_k2", 1) > 1 else "")
            + (f" ahead2={cfg.ahead2}" if getattr(cfg, "ahead2", 0) else ""))


def write_csv(path: Path, rows: list[dict], columns) -> None:
    """Write `rows` (extra keys ignored) under a header of `columns`, creating the folder."""
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


# Triton kernel name -> stage name used in kernel_terms and the tables
STAGES = {"_routing_kernel": "routing", "_gemm1_kernel": "gemm1", "_inter_quant_kernel": "inter_quant",
          "_finish_kernel": "inter_quant", "_gemm2_kernel": "gemm2", "_combine_kernel": "combine"}


# ---------------------------------------------------------------- launch recording
@dataclass
class Launch:
    """One recorded Triton launch: kernel, grid, arguments and (compiled mode) the CompiledKernel."""

    fn: Any  # triton JITFunction (InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple
    args: tuple
    kwargs: dict
    compiled: Any = None
    name: str = field(init=False)

    def __post_init__(self) -> None:
        self.name = getattr(self.fn, "__name__", type(self.fn).__name__)

    @property
    def stage(self) -> str:
        """'routing', 'gemm1', 'inter_quant', 'gemm2', 'combine', or the kernel's own name."""
        return STAGES.get(self.name, self.name)

    @property
    def programs(self) -> int:
        """Programs launched (product of the grid)."""
        return math.prod(int(g) for g in self.grid)

    def __call__(self) -> None:
        """Launch it again with the same grid and arguments."""
        self.fn[self.grid](*self.args, **self.kwargs)


def record_launches(fn: Callable[[], Any]) -> list[Launch]:
    """Call fn() once and return every Triton launch it made, in order.

    Wraps KernelInterface.__getitem__ (the `kernel[grid]` of every @triton.jit function)
    for the duration of the call, so the launches are the layer's own, whatever its
    wrappers compute; no kernel code is touched.
    """
    from triton.runtime.jit import KernelInterface
    launches: list[Launch] = []
    original = KernelInterface.__getitem__

    def getitem(self, grid):
        launch = original(self, grid)

        def recorded(*args, **kwargs):
            compiled = launch(*args, **kwargs)  # JITFunction.run returns the CompiledKernel
            launches.append(Launch(self, tuple(grid) if isinstance(grid, (tuple, list)) else (grid,),
                                   args, kwargs, compiled))
            return compiled
        return recorded

    KernelInterface.__getitem__ = getitem
    try:
        fn()
    finally:
        KernelInterface.__getitem__ = original
    if not launches:
        raise RuntimeError("no Triton launch was recorded: this triton's kernel[grid] does not go through "
                           "KernelInterface.__getitem__ (written for triton 3.6)")
    return launches


def compiled_info(compiled: Any) -> dict[str, int | None]:
    """n_regs, n_spills, shared_bytes, num_warps of a CompiledKernel; None where unavailable."""
    info: dict[str, int | None] = {"n_regs": None, "n_spills": None, "shared_bytes": None, "num_warps": None}
    if compiled is None:
        return info
    try:  # triton 3.6: set when the binary is loaded, i.e. by the launch that returned it
        info["n_regs"] = getattr(compiled, "n_regs", None)
        info["n_spills"] = getattr(compiled, "n_spills", None)
        meta = getattr(compiled, "metadata", None)
        info["shared_bytes"] = getattr(meta, "shared", None)
        info["num_warps"] = getattr(meta, "num_warps", None)
    except Exception:  # other Triton versions or backends: report n/a, never fail the run
        pass
    return info
