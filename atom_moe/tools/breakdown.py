"""`atom-moe breakdown`: time each launch of the fused experts layer against its own floor.

The layer is three Triton launches: routing metadata (kernels/routing.py), GEMM1 (+SwiGLU,
+fp8 quant; kernels/gemm1.py) and GEMM2 (+weighted combine; kernels/gemm2.py); at T = 1 two by default
(pair blocks: GEMM1 does the routing launch's work; ATOM_MOE_PAIR_BLOCKS=0 keeps three); at large T the routing
sort takes a second launch ("routing.sort") and the combine its own ("combine", `--combine` forces either combine). Per
(shape, scheme, T) this builds the bench's synthetic layer (common.random_weights,
common.make_routing), calls fused_experts once (tile config from kernels.tuning.lookup,
exactly as the layer resolves it) with every Triton launch recorded (kernel, grid,
arguments, compiled kernel), then captures each recorded launch alone in a CUDA graph and
times it with common.Timer (L2 flushed before every replay, median of --iters), and the
whole layer the same way. Per kernel it reports us, the bytes it must move and its flops
(`kernel_terms`), its own floor max(bytes / HBM read ceiling, flops / matmul rate), the
fraction of that floor, programs launched / doing work vs the SM count, and Triton's
registers, spills and shared memory per program. Writes a CSV and a markdown table (also
printed).
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import common
from .args import RunFailure, positive_int
from .common import Launch, compiled_info, record_launches
from ..spec import Scheme

DEFAULT_SHAPES = ("deepseek-v3", "gpt-oss-120b")
DEFAULT_SCHEMES = ("bf16", "fp8", "a16w4", "a8w4")
DEFAULT_TOKENS = (1, 128, 2048, 8192)
CSV_COLUMNS = ("device", "shape", "scheme", "T", "routing", "kernel", "us", "floor_us", "frac_of_floor", "bound",
               "tbps", "tflops", "bytes", "flops", "programs", "active_programs", "sms", "ctas_per_sm_est",
               "waves_est", "n_regs", "n_spills", "shared_bytes", "num_warps", "config", "note")
FP8_GROUP = 128  # fp8 block-scale edge and activation quant group
MX_BLOCK = 32  # MXFP4: one e8m0 scale byte per 32 weights along K
# Hopper per-SM limits, used only where torch does not report them
SM_REGS, SM_SHARED, SM_THREADS, SM_CTAS = 65536, 233472, 2048, 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the breakdown's options to `parser`."""
    parser.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), choices=list(common.SHAPES),
                        help="model shapes (H, I, E, top_k of each preset)")
    parser.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES), choices=list(DEFAULT_SCHEMES),
                        help="schemes to break down")
    parser.add_argument("--tokens", nargs="+", type=positive_int, default=list(DEFAULT_TOKENS), help="tokens per call")
    parser.add_argument("--routing", default="uniform", choices=["uniform", "skewed"],
                        help="uniform random top-k, or skewed (Zipf-like expert popularity), as in bench")
    parser.add_argument("--iters", type=positive_int, default=10, help="timed graph replays per kernel (median)")
    parser.add_argument("--ceilings", nargs=3, type=float, default=None,
                        metavar=("READ_TBPS", "BF16_TFLOPS", "FP8_TFLOPS"),
                        help="use these ceilings instead of measuring them (saves ~10 s)")
    parser.add_argument("--combine", default="auto", choices=["auto", "counter", "separate"],
                        help="GEMM2's top-k combine: auto (by pair count, as the layer), inside GEMM2, or its own launch")
    parser.add_argument("--csv", type=Path, default=Path("breakdown.csv"),
                        help="CSV path; the markdown table goes next to it (.md)")


# ---------------------------------------------------------------- bytes and flops
@dataclass(frozen=True)
class KernelTerms:
    """What one launch must move and compute: bytes per named term, and flops."""

    bytes_by_term: dict[str, int]
    flops: int

    @property
    def bytes(self) -> int:
        """Total bytes of all terms."""
        return sum(self.bytes_by_term.values())


def _weight_bytes(scheme: str, rows: int, cols: int) -> int:
    """Bytes of one expert's weight matrix [rows, cols] (K = cols) without its scales."""
    if scheme in ("a16w4", "a8w4"):
        return rows * cols // 2  # e2m1: two codes per byte
    return rows * cols * (1 if scheme == "fp8" else 2)


def kernel_terms(scheme: str, H: int, I: int, T: int, top_k: int, n_hit: int, *,
                 x_bytes: int = 2, id_bytes: int = 4, separate: bool = False,
                 split_sort: bool = False, pair_blocks: bool = False,
                 inter_quant: bool = False, slices: int = 1) -> dict[str, KernelTerms]:
    """Bytes each launch must move and flops it must do, for T tokens at EP size 1.

    pairs = T * top_k (every slot local), n_hit = distinct experts hit. Activations are
    e4m3 (1 byte, fp32 scale per 128; GEMM2's input per Scheme.inter_group: 64 for a8w4) for
    fp8 and a8w4, else bf16 (2 bytes). Weights:
    bf16 2 bytes, fp8 1 byte + fp32 128x128 block scales, MXFP4 0.5 byte + one e8m0 byte
    per 32 along K. Padding rows, block tables, expert_map and topk weights are left out
    (< 0.1% at these shapes).

    routing: topk_ids read (pairs * id_bytes), sorted pair list write (pairs * 4), combine
        counters zeroed (T * ceil(H/32) * 4); fp8/a8w4 also x read (T*H*x_bytes), x_q
        write (T*H) and x_scale write (T * ceil(H/128) * 4). No flops counted.
    gemm1: w13 of the hit experts (n_hit * 2I*H weights) + their scales (fp8:
        2*ceil(I/128)*ceil(H/128) fp32, MXFP4: 2I*H/32 bytes), each token row read once
        (T*H*act bytes; the other k-1 reads of a row are assumed L2 hits) + its scales,
        the activation written (pairs*I*act bytes) + its scales. flops 2*pairs*2I*H.
    gemm2: w2 of the hit experts (n_hit * H*I) + scales (fp8: ceil(H/128)*ceil(I/128)
        fp32, MXFP4: H*I/32 bytes), the activation read back (+ scales), fp32 partials
        written and read once by the combine (2 * pairs*H*4), out written (T*H*x_bytes).
        flops 2*pairs*H*I.
    separate (GEMM2's combine in its own launch): gemm2 writes the weighted rows in the
        output dtype (pairs*H*x_bytes) and `combine` reads them back and writes out.
    split_sort (the routing sort over two launches, kernels/routing.py): `routing.sort`, the
        second launch, reads topk_ids again and writes the sorted pair list (moved there
        from `routing`).
    pair_blocks (T = 1: no routing launch, kernels/routing.py): GEMM1 does the routing launch's work
        and takes its terms, less the sorted pair list it does not write.
    inter_quant (a8w4's GEMM2 input per token, Scheme.inter_per_token): GEMM1 writes bf16 (pairs*I*2) and no
        scales; `inter_quant` reads it back and writes the e4m3 rows and one fp32 scale per row, which GEMM2 reads.
        With slices > 1 (GEMM1 split K that many ways; kernels/inter_quant.py `finish_rows`) GEMM1 writes its fp32
        K slices of the pre-activation instead (slices*pairs*2I*4) and `inter_quant` reads them.
    The sum over kernels exceeds common.floor_terms (the layer's compulsory I/O) by the
    intermediate round trips (activation, partials) and the routing launch's own traffic.
    """
    pairs = T * top_k
    fp8_act = scheme in ("fp8", "a8w4")
    mx = scheme in ("a16w4", "a8w4")
    act = 1 if fp8_act else 2
    gH, gI = math.ceil(H / FP8_GROUP), math.ceil(I / FP8_GROUP)
    g_inter = math.ceil(I / Scheme(scheme).inter_group) if fp8_act else 0  # GEMM2's input scales per row
    n_counters = math.ceil(H / 32)  # kernels.tuning.MIN_BLOCK_N2: one counter per 32 columns

    routing = {"topk_ids read": pairs * id_bytes, "sorted ids write": pairs * 4, "counters zero": T * n_counters * 4}
    if fp8_act:
        routing |= {"x read": T * H * x_bytes, "x_q write": T * H, "x_scale write": T * gH * 4}

    gemm1 = {"w13": n_hit * _weight_bytes(scheme, 2 * I, H)}
    if scheme == "fp8":
        gemm1["w13 scales"] = n_hit * 2 * gI * gH * 4
    elif mx:
        gemm1["w13 scales"] = n_hit * 2 * I * H // MX_BLOCK
    gemm1["x rows read"] = T * H * act
    if fp8_act:
        gemm1["x scales read"] = T * gH * 4
    if inter_quant:
        g_inter = 1
        if slices > 1:
            gemm1["K slices write"] = slices * pairs * 2 * I * 4
            quant = {"K slices read": slices * pairs * 2 * I * 4}
        else:
            gemm1["inter write"] = pairs * I * 2
            quant = {"inter read": pairs * I * 2}
        quant |= {"inter_q write": pairs * I, "inter scales write": pairs * 4}
    else:
        gemm1["inter write"] = pairs * I * act
        if fp8_act:
            gemm1["inter scales write"] = pairs * g_inter * 4

    gemm2 = {"w2": n_hit * _weight_bytes(scheme, H, I)}
    if scheme == "fp8":
        gemm2["w2 scales"] = n_hit * gH * gI * 4
    elif mx:
        gemm2["w2 scales"] = n_hit * H * I // MX_BLOCK
    gemm2["inter read"] = pairs * I * act
    if fp8_act:
        gemm2["inter scales read"] = pairs * g_inter * 4
    terms = {"gemm1": KernelTerms(gemm1, 2 * pairs * 2 * I * H)}
    if inter_quant:
        terms["inter_quant"] = KernelTerms(quant, 0)
    if separate:
        gemm2["partial write"] = pairs * H * x_bytes
        terms["combine"] = KernelTerms({"topk_ids read": pairs * id_bytes, "partial read": pairs * H * x_bytes,
                                        "out write": T * H * x_bytes}, 0)
    else:
        gemm2 |= {"partial write": pairs * H * 4, "partial read": pairs * H * 4, "out write": T * H * x_bytes}
    terms["gemm2"] = KernelTerms(gemm2, 2 * pairs * H * I)
    if pair_blocks:
        del routing["sorted ids write"]
        terms["gemm1"] = KernelTerms({**routing, **gemm1}, terms["gemm1"].flops)
        return terms
    if split_sort:
        sort = {"topk_ids read": pairs * id_bytes, "sorted ids write": routing.pop("sorted ids write")}
        terms["routing.sort"] = KernelTerms(sort, 0)
    terms["routing"] = KernelTerms(routing, 0)
    return terms


def floor_us(nbytes: float, flops: float, read_tbps: float, tflops: float) -> float:
    """max(bytes / read ceiling, flops / matmul rate) in us."""
    return max(nbytes / (read_tbps * 1e6), flops / (tflops * 1e6))


def ctas_per_sm(info: dict[str, int | None], props: Any = None) -> int | None:
    """Resident programs per SM allowed by registers, shared memory and threads (estimate; None if unknown)."""
    regs, warps, shared = info.get("n_regs"), info.get("num_warps"), info.get("shared_bytes")
    if not regs or not warps:
        return None
    sm_regs = getattr(props, "regs_per_multiprocessor", None) or SM_REGS
    sm_shared = getattr(props, "shared_memory_per_multiprocessor", None) or SM_SHARED
    sm_threads = getattr(props, "max_threads_per_multi_processor", None) or SM_THREADS
    per_warp = math.ceil(regs * 32 / 256) * 256  # registers are allocated per warp in units of 256
    limits = [sm_regs // (per_warp * warps), sm_threads // (32 * warps), SM_CTAS]
    if shared:
        limits.append(sm_shared // (shared + 1024))  # the driver reserves 1 KB per CTA
    return max(0, min(limits))


def active_programs(stage: str, programs: int, ids: torch.Tensor, num_experts: int, top_k: int,
                    block_m: int, pair_blocks: bool = False) -> int:
    """Programs that do work: GEMM grids are max_blocks x tiles and blocks past the used ones exit (with
    pair blocks every block is a pair, each with work at EP size 1)."""
    if stage not in ("gemm1", "gemm2") or pair_blocks:
        return programs
    pairs = ids.numel()
    n_blocks = pairs // block_m + min(num_experts, pairs)  # kernels.routing.max_blocks
    counts = torch.bincount(ids.flatten().long(), minlength=num_experts)
    used = int(((counts + block_m - 1) // block_m).sum())
    return used * (programs // n_blocks) if programs % n_blocks == 0 else programs


# ---------------------------------------------------------------- driver
def run(args: argparse.Namespace) -> int:
    """Entry point of `atom-moe breakdown`; returns the process exit code."""
    measure(args)
    return 0


def measure(args: argparse.Namespace) -> list[dict]:
    """Run the breakdown described by args; write the CSV and markdown; return the rows."""
    from ..experts import allocate_workspace, device_name
    if not torch.cuda.is_available():
        raise RunFailure("needs a CUDA GPU: torch sees none here")
    t0 = time.monotonic()

    def stamp() -> str:
        return f"[{time.monotonic() - t0:6.1f} s]"

    timer = common.Timer(args.iters)
    ceil = common.ceilings(timer, args.ceilings)
    dev = device_name(torch.device("cuda"))
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"{stamp()} device {dev} ({sms} SMs): HBM read {ceil['read_tbps']:.2f} TB/s, bf16 "
          f"{ceil['bf16_tflops']:.0f} TFLOP/s, fp8 {ceil['fp8_tflops']:.0f} TFLOP/s"
          f"{' (given)' if args.ceilings else ''}", flush=True)
    rows: list[dict] = []
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for name in args.shapes:
        H, I, E, k = common.SHAPES[name]
        for scheme in args.schemes:
            spec = common.bench_spec(name, scheme)
            weights = common.random_weights(spec)
            ws = allocate_workspace(spec, max(args.tokens), "cuda")
            print(f"{stamp()} {name} {scheme}: weights built", flush=True)
            for T in args.tokens:
                w, ids = common.make_routing(T, E, k, args.routing, gen, common.SHARED[name])
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                for r in measure_rows(timer, spec, weights, ws, x, w, ids, ceil, sms=sms, props=props,
                                      labels=dict(device=dev, shape=name, routing=args.routing),
                                      combine=args.combine):
                    rows.append(r)
                    _print_row(r, stamp())
            del weights, ws
            torch.cuda.empty_cache()
    common.write_csv(args.csv, rows, CSV_COLUMNS)
    table = markdown(rows)
    md_path = args.csv.with_suffix(".md")
    md_path.write_text(f"# atom-moe breakdown, {dev}, routing {args.routing} "
                       f"({time.strftime('%Y-%m-%d')})\n\n{table}\n")
    print(f"\n{table}\n{stamp()} wrote {args.csv} and {md_path}", flush=True)
    return rows


def measure_rows(timer: Any, spec: Any, weights: Any, ws: Any, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor,
                 ceil: dict[str, float], *, sms: int, props: Any = None, labels: dict | None = None,
                 combine: str = "auto") -> list[dict]:
    """One row per launch of fused_experts(x, w, ids) plus a 'layer' row; timer.graph_us(fn, prepare) times each."""
    from ..experts import device_name, fused_experts, launch_flags
    from ..kernels.tuning import lookup
    H, I, k, E = spec.hidden_size, spec.intermediate_size, spec.top_k, spec.num_local_experts
    scheme, T = spec.scheme.value, x.shape[0]
    rate = ceil["fp8_tflops" if scheme in ("fp8", "a8w4") else "bf16_tflops"]  # the floor rate
    out = torch.empty_like(x)
    cfg = lookup(device_name(x.device), scheme, H, I, E, k, T)  # what fused_experts resolves
    n_hit = int(torch.unique(ids).numel())  # setup only, outside every timed region

    def layer() -> None:
        fused_experts(x, w, ids, weights, spec, workspace=ws, out=out, combine=None if combine == "auto" else combine)

    base = dict(labels or {}, scheme=scheme, T=T, sms=sms, config=common.cfg_str(cfg))

    def reset() -> None:
        # Untimed, before each replay: a lone GEMM2 needs the combine counters the routing
        # launch zeroes, and a NaN output shows whether the last timed launch (GEMM2 or the
        # separate combine) wrote every row.
        ws.counters.zero_()
        out.fill_(float("nan"))

    layer_us = timer.graph_us(layer)
    launches = record_launches(layer)
    ref = out.clone()
    stages = [launch.stage for launch in launches]
    pair_blocks = "routing" not in stages
    terms = kernel_terms(scheme, H, I, T, k, n_hit, separate="combine" in stages,
                         split_sort=stages.count("routing") > 1, pair_blocks=pair_blocks,
                         inter_quant="inter_quant" in stages,
                         slices=cfg.split_k1 if any(launch.name == "_finish_kernel" for launch in launches) else 1)
    rows = []
    for i, launch in enumerate(launches):
        # the second routing launch is the split sort's scatter (kernels/routing.py)
        stage = "routing.sort" if launch.stage == "routing" and "routing" in stages[:i] else launch.stage
        us = timer.graph_us(launch, prepare=reset)
        info = compiled_info(launch.compiled)
        occ = ctas_per_sm(info, props)
        active = active_programs(stage, launch.programs, ids, E, k, cfg.block_m, pair_blocks)
        r = dict(base, kernel=stage, us=round(us, 2), programs=launch.programs, active_programs=active,
                 ctas_per_sm_est=occ, waves_est=round(active / (sms * occ), 2) if occ else None, **info)
        t = terms.get(stage)
        if t is not None:
            r.update(_floor_columns(t.bytes, t.flops, us, ceil["read_tbps"], rate))
        else:
            r.update(note="unknown kernel: no byte/flop terms")
        rows.append(r)
    note = f"sum of kernels {sum(r['us'] for r in rows):.1f} us"
    if launch_flags():
        note += f"; {launch_flags()}"
    if not torch.equal(out, ref):
        note += "; the last lone replay did not rebuild the layer's output (its time is suspect)"
    if [s for s in stages if s != "inter_quant"] not in (["routing", "gemm1", "gemm2"], ["gemm1", "gemm2"]):
        note += f"; launches {stages}"
    nbytes, flops = common.floor_terms(spec, ids, x.element_size())
    rows.append(dict(base, kernel="layer", us=round(layer_us, 2), programs=sum(r["programs"] for r in rows),
                     note=note, **_floor_columns(nbytes, flops, layer_us, ceil["read_tbps"], rate)))
    return rows


def _floor_columns(nbytes: float, flops: float, us: float, read_tbps: float, tflops: float) -> dict:
    f_us = floor_us(nbytes, flops, read_tbps, tflops)
    return dict(floor_us=round(f_us, 2), frac_of_floor=round(f_us / us, 3),
                bound="hbm" if nbytes / read_tbps >= flops / tflops else "mma", bytes=nbytes, flops=flops,
                tbps=round(nbytes / us / 1e6, 3), tflops=round(flops / us / 1e6, 1))


def _na(v: Any) -> str:
    return "n/a" if v is None or v == "" else str(v)


def _print_row(r: dict, stamp: str) -> None:
    print(f"{stamp} {r['shape']:14s} {r['scheme']:5s} T={r['T']:5d} {r['kernel']:8s} {r['us']:10.1f} us  "
          f"floor {_na(r.get('floor_us')):>9s}  frac {_na(r.get('frac_of_floor')):>5s} {_na(r.get('bound')):3s}  "
          f"progs {_na(r.get('programs'))}/{_na(r.get('active_programs'))}  regs {_na(r.get('n_regs'))} "
          f"spills {_na(r.get('n_spills'))}  {r.get('note') or ''}", flush=True)


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (one line per kernel, then the layer)."""
    head = ("| shape | scheme | T | kernel | us | floor us | frac | bound | TB/s | TFLOP/s | programs (active) "
            "| CTAs/SM est | waves est | regs | spills | smem KB | warps | config / note |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        smem = r.get("shared_bytes")
        progs = f"{_na(r.get('programs'))} ({_na(r.get('active_programs'))})" if r["kernel"] != "layer" else ""
        extra = r["config"] if r["kernel"] == "layer" else ""
        if r.get("note"):
            extra = f"{extra}; {r['note']}" if extra else r["note"]
        cells = [r["shape"], r["scheme"], r["T"], r["kernel"], r["us"], r.get("floor_us"), r.get("frac_of_floor"),
                 r.get("bound"), r.get("tbps"), r.get("tflops"), progs, r.get("ctas_per_sm_est"),
                 r.get("waves_est"), r.get("n_regs"), r.get("n_spills"),
                 None if smem is None else round(smem / 1024, 1), r.get("num_warps"), extra]
        if r["kernel"] == "layer":
            cells[11:17] = [""] * 6  # per-kernel columns
        lines.append("| " + " | ".join(_na(c) if c != "" else "" for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Standalone entry point (python -m atom_moe.tools.breakdown)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    measure(parser.parse_args(argv))


if __name__ == "__main__":
    main()
