"""Compile every Triton kernel our ops launch, with the arguments they launch it with, for a GPU this
machine does not have (sm_90a: H100/H200; gfx942, gfx950: MI300X, MI355X). No GPU needed.

    python scripts/compile_all.py                      # sm_90a, every kernel and tile variant
    python scripts/compile_all.py --target gfx942 gfx950

The real launchers run on small CPU tensors with Triton's launch replaced by a recorder: the
experts step (routing, GEMM1, GEMM2, the separate combine) for every scheme and every tile
variant the tables or the heuristic can pick (bf16 and fp8 row-block-16 tiles also with GEMM1 split
over K, both of its launches; bf16 and fp8 also with TMA descriptors, a16w4 and a8w4 with GEMM2's rows
through one; a8w4 with its quant launch and also with ATOM_MOE_A8W4_INTER=group), and MegaMoE's
symm transport (dispatch, barrier, combine) with two simulated ranks; then the same for the served
presets' routing geometry (E 257 with a fused shared slot and top-k 9, E 384 with top-k 6) with the
heuristic's picks for their real shapes, the two-launch routing sort included. Each distinct (kernel, argument types, compile-time values, warps, stages) is then
compiled for each target, with the interpreter's workarounds (INTERP, EMULATE) off, as a GPU
build has them. Kernel outputs are never computed: nothing here checks numbers (the
interpreter tests do); it catches what only a GPU compile would (a triton upgrade that no
longer lowers a kernel, a tile that does not fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
if os.environ.get("TRITON_INTERPRET") == "1":  # @triton.jit would give interpreter functions, not compilable ones
    sys.exit("compile_all.py compiles the real kernels: run it without TRITON_INTERPRET=1")

from atom_moe.kernels import common as kcommon  # noqa: E402
from atom_moe.kernels import gemm1, gemm2, inter_quant, mxfp4, routing, transport, tuning  # noqa: E402
from atom_moe.spec import MoESpec  # noqa: E402

TARGETS = {"sm_90a": GPUTarget("cuda", 90, 32), "gfx942": GPUTarget("hip", "gfx942", 64),
           "gfx950": GPUTarget("hip", "gfx950", 64)}
SCHEMES = ("bf16", "fp8", "a16w4", "a8w4")
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)  # the token buckets the heuristic is asked about
INTERPRETER_SWITCHES = ("INTERP", "EMULATE")  # constexprs that only the interpreter sets True
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int32: "i32",
           torch.int64: "i64", torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.bool: "i1",
           torch.float8_e4m3fn: "fp8e4nv"}

launches: dict[tuple, tuple] = {}  # key -> (kernel, signature, constexprs, divisible args, options)


def _arg_type(value) -> str:
    if isinstance(value, TensorDescriptor):  # the launcher's type for a TMA descriptor argument
        return f"tensordesc<{_DTYPES[value.base.dtype]}{list(value.block_shape)}>"
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(value).__name__}")


def _divisible(value) -> bool:
    """Triton's launcher specializes 16-aligned pointers and ints divisible by 16; so do we."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr() % 16 == 0
    return isinstance(value, int) and not isinstance(value, bool) and value % 16 == 0


def _record(self: JITFunction, *args, grid, warmup, **kwargs):
    """Stands in for JITFunction.run: note the launch's signature, launch nothing."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "maxnreg", "launch_pdl") if k in kwargs}
    bound = dict(zip(self.arg_names, args))
    bound.update(kwargs)
    sig, ce, div = {}, {}, []
    for p in self.params:
        value = bound.get(p.name, p.default)
        if isinstance(value, tl.constexpr):
            value = value.value
        if p.is_constexpr or value is None:
            ce[p.name] = False if p.name in INTERPRETER_SWITCHES else value
            continue
        if type(value) is int and value == 1 and not p.do_not_specialize:  # as Triton's launcher: 1 is a constant
            ce[p.name] = 1
            continue
        sig[p.name] = _arg_type(value)
        if _divisible(value):
            div.append(p.name)
    key = (self.__name__, tuple(sig.items()), tuple(sorted(ce.items(), key=lambda kv: kv[0])),
           tuple(div), tuple(sorted(options.items())))
    launches.setdefault(key, (self, sig, ce, div, options))


def _exercise() -> None:
    """Run every launcher the ops use, with the recorder in place of Triton's launch."""
    from atom_moe.experts import fused_experts
    from dataclasses import replace

    from atom_moe.spec import Activation, ActivationKind
    from atom_moe.tools.synthetic import random_layer, random_tokens
    from atom_moe.weights import prepare_stacked

    g = torch.Generator().manual_seed(0)
    H, I, E, K, T = 256, 256, 8, 4, 16
    configs = table_configs(SCHEMES)
    for scheme in SCHEMES:
        spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme=scheme,
                              max_tokens_per_rank=T)
        raw = random_layer(spec, generator=g)
        weights = prepare_stacked(spec, raw.w13, raw.w2, layout="separated")
        x, w, ids = random_tokens(spec, T, generator=g)
        fused_experts(x, w, ids, weights, spec)  # the table's or heuristic's own pick
        clamped = replace(spec, activation=Activation(ActivationKind.SWIGLU_CLAMP, limit=10.0))  # DeepSeek-V4's
        fused_experts(x, w, ids, weights, clamped)
        fused_experts(x, w, ids, weights, spec, combine="separate")
        for config in configs.get(scheme, ()):
            if config.split_k1 == config.split_k2 == 1:
                fused_experts(x, w, ids, weights, spec, config=config)
        # tuned split-K rows (split 2..8, a constexpr each): a layer with K steps for the largest split
        split_rows = [c for c in configs.get(scheme, ()) if c.split_k1 > 1 or c.split_k2 > 1]
        if split_rows:
            wide = MoESpec.create(hidden_size=tuning.MAX_SPLIT_K * 128, intermediate_size=tuning.MAX_SPLIT_K * 128,
                                  num_experts=E, top_k=K, scheme=scheme, max_tokens_per_rank=T)
            wide_raw = random_layer(wide, generator=g)
            wide_weights = prepare_stacked(wide, wide_raw.w13, wide_raw.w2, layout="separated")
            wx, ww, wids = random_tokens(wide, T, generator=g)
            for config in split_rows:
                fused_experts(wx, ww, wids, wide_weights, wide, config=config)
                fused_experts(wx[:1], ww[:1], wids[:1], wide_weights, wide, config=config, pair_blocks=True)
        # split-K GEMM1 (both launches) and GEMM2, as tune may pick them for decode; and T = 1's pair blocks
        # (no routing launch, kernels/routing.py) for every config T = 1 may pick, split or not
        for config in {c for c in configs.get(scheme, ()) if c.block_m == tuning.MIN_BLOCK_M}:
            split = dataclasses.replace(config, split_k1=2, split_k2=2)
            fused_experts(x, w, ids, weights, spec, config=split)
            for c in (dataclasses.replace(config, split_k1=1, split_k2=1), split):
                fused_experts(x[:1], w[:1], ids[:1], weights, spec, config=c, pair_blocks=True)
        # programmatic dependent launch (ATOM_MOE_PDL=1 on sm_90+): the default picks, sorted and pair blocks,
        # and split-K's extra launch
        pdl, kcommon.pdl = kcommon.pdl, lambda device: True
        try:
            fused_experts(x, w, ids, weights, spec)
            fused_experts(x[:1], w[:1], ids[:1], weights, spec, pair_blocks=True)
            small = tuning.heuristic(scheme, H, I, E, K, 1)
            fused_experts(x, w, ids, weights, spec, config=dataclasses.replace(small, split_k1=2, split_k2=2))
        finally:
            kcommon.pdl = pdl
        # TMA tile descriptors (ATOM_MOE_TMA=1 on sm_90+): bf16 / fp8 weights and every scheme's GEMM2 rows, for
        # every table row and heuristic pick, split-K and pair blocks included (MXFP4's pair blocks take none)
        tma, kcommon.tma = kcommon.tma, lambda device: True
        try:
            for config in configs.get(scheme, ()):
                if config.split_k1 == config.split_k2 == 1:
                    fused_experts(x, w, ids, weights, spec, config=config)
                    fused_experts(x, w, ids, weights, spec, config=config, combine="separate")
            small = tuning.heuristic(scheme, H, I, E, K, 1)
            fused_experts(x, w, ids, weights, spec, config=dataclasses.replace(small, split_k1=2, split_k2=2))
            fused_experts(x[:1], w[:1], ids[:1], weights, spec, config=small, pair_blocks=True)
            # GEMM2 pushing rows to their source ranks, on the scheme's own activation wire
            _exercise_symm(spec, raw, "fp8" if spec.scheme.fp8_activations else "bf16", T, g)
        finally:
            kcommon.tma = tma
        # GEMM2's lookahead prefetch (a table's ahead2, NVIDIA sm_90+, which this CPU recording is not: its device
        # check is lifted as PDL's is): counter and separate combine, pair blocks
        check_ahead = kcommon.check_ahead  # the op checks it up front, gemm2 again
        kcommon.check_ahead = gemm2.check_ahead = lambda *args: None
        try:
            ahead = dataclasses.replace(tuning.heuristic(scheme, H, I, E, K, T), split_k2=1, ahead2=512)
            fused_experts(x, w, ids, weights, spec, config=ahead)
            fused_experts(x, w, ids, weights, spec, config=ahead, combine="separate")
            ahead = dataclasses.replace(tuning.heuristic(scheme, H, I, E, K, 1), split_k2=1, ahead2=512)
            fused_experts(x[:1], w[:1], ids[:1], weights, spec, config=ahead, pair_blocks=True)
        finally:
            kcommon.check_ahead = gemm2.check_ahead = check_ahead
        if scheme == "a8w4":  # ATOM_MOE_A8W4_INTER=group: GEMM1 quantizes per 64-group, GEMM2's two accumulators
            _exercise_inter_per_group(x, w, ids, weights, spec, configs.get(scheme, ()))
        for wire in ("bf16", "fp8") if spec.scheme.fp8_activations else ("bf16",):
            _exercise_symm(spec, raw, wire, T, g)
    _exercise_served(g)


def _exercise_inter_per_group(x, w, ids, weights, spec, configs) -> None:
    """a8w4's launches with a scale per (token, 64-group) on GEMM2's input (not the default): every table row and
    the heuristic's pick, split-K and pair blocks."""
    from atom_moe.experts import fused_experts
    from atom_moe.spec import A8W4_INTER_FLAG

    before = os.environ.get(A8W4_INTER_FLAG)
    os.environ[A8W4_INTER_FLAG] = "group"
    try:
        fused_experts(x, w, ids, weights, spec)
        for config in configs:
            if config.split_k1 == config.split_k2 == 1:
                fused_experts(x, w, ids, weights, spec, config=config)
        small = tuning.heuristic(spec.scheme.value, spec.hidden_size, spec.intermediate_size, spec.num_experts,
                                 spec.top_k, 1)
        fused_experts(x, w, ids, weights, spec, config=dataclasses.replace(small, split_k1=2, split_k2=2))
        fused_experts(x[:1], w[:1], ids[:1], weights, spec, config=small, pair_blocks=True)
    finally:
        if before is None:
            os.environ.pop(A8W4_INTER_FLAG)
        else:
            os.environ[A8W4_INTER_FLAG] = before


def _exercise_symm(spec, raw, wire: str, T: int, g: torch.Generator) -> None:
    """MegaMoE's symm transport with two simulated ranks (fused shared experts: a replica on each)."""
    from atom_moe.ep.simulate import SimulatedSymmGroup
    from atom_moe.ep.symm import FUSED, SPLIT
    from atom_moe.tools.synthetic import random_tokens
    from atom_moe.weights import prepare_stacked
    specs = [spec.for_rank(r, 2) for r in range(2)]
    mine = [prepare_stacked(s, raw.w13, raw.w2, layout="separated") for s in specs]
    group = SimulatedSymmGroup(specs, T, wire)
    xs, ws, ts = zip(*(random_tokens(spec, T, generator=g) for _ in specs))
    outs = [torch.empty_like(xi) for xi in xs]
    group.forward(mine, list(xs), list(ws), list(ts), outs, [FUSED, SPLIT])


def served_schemes(spec) -> tuple[str, ...]:
    """A served preset's schemes: its own, and a8w4 too for MXFP4 (the plugins' ATOM_MOE_MXFP4_ACT=fp8)."""
    return tuple(dict.fromkeys((spec.scheme.value,) + (("a8w4",) if spec.scheme.is_mxfp4 else ())))


def served_configs(scheme: str, specs) -> list[tuning.TileConfig]:
    """The heuristic's pick for each of `specs` (real shapes) at every token bucket."""
    picks = {tuning.heuristic(scheme, s.hidden_size, s.intermediate_size, s.num_experts, s.top_k, tokens)
             for s in specs for tokens in TOKENS}
    return sorted(picks, key=str)


def _exercise_served(g: torch.Generator) -> None:
    """The served presets (atom_moe.presets.SERVED) in their schemes, at H = 512, I = 64: the kernels specialize
    on their E (257 with a fused shared slot, 384: 512 histogram bins), top-k (9, 6) and tiles, not on H and I
    beyond their divisibility by 16, which these share (T = 1's GEMM1 also on H in 128-groups: 4 here;
    scripts/hip_compile.py builds the real ones). H spans four 128-k steps, so a pick that splits GEMM1's K up to
    four ways (T = 1, kernels/tuning.py `_fill`) launches as it does on the real shape. Every heuristic pick for
    their real shapes with both combines, the one- and two-launch routing sort and T = 1's pair blocks, and the
    symm transport at EP 2 once per geometry."""
    from atom_moe.experts import fused_experts
    from atom_moe.presets import PRESETS, SERVED
    from atom_moe.tools.synthetic import random_layer, random_tokens
    from atom_moe.weights import prepare_stacked
    H, I, T = 512, 64, 16
    served = [PRESETS[name] for name in SERVED]
    for E, K, S in sorted({(s.num_experts, s.top_k, s.shared_experts) for s in served}):
        same = [s for s in served if (s.num_experts, s.top_k, s.shared_experts) == (E, K, S)]
        for i, scheme in enumerate(served_schemes(same[0])):
            spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, shared_experts=S,
                                  scheme=scheme, max_tokens_per_rank=T)
            raw = random_layer(spec, generator=g)
            weights = prepare_stacked(spec, raw.w13, raw.w2, layout="separated")
            x, w, ids = random_tokens(spec, T, generator=g)
            one_token = {tuning.heuristic(scheme, s.hidden_size, s.intermediate_size, s.num_experts, s.top_k, 1)
                         for s in same}
            for config in served_configs(scheme, same):
                for combine in ("counter", "separate"):
                    fused_experts(x, w, ids, weights, spec, config=config, combine=combine)
                if config in one_token:  # T = 1: pair blocks
                    fused_experts(x[:1], w[:1], ids[:1], weights, spec, config=config, pair_blocks=True)
                split, routing.SPLIT_PAIRS = routing.SPLIT_PAIRS, 0  # the two-launch sort of large T
                try:
                    fused_experts(x, w, ids, weights, spec, config=config)
                finally:
                    routing.SPLIT_PAIRS = split
            if i == 0:
                _exercise_symm(spec, raw, "fp8" if spec.scheme.fp8_activations else "bf16", T, g)


def table_configs(schemes: tuple[str, ...]) -> dict[str, list[tuning.TileConfig]]:
    """Every TileConfig the lookup can return, per scheme: each table row, and the heuristic's pick
    for every preset at every token bucket."""
    import csv

    from atom_moe.presets import PRESETS
    out: dict[str, set] = {scheme: set() for scheme in schemes}
    for path in sorted(tuning.CONFIG_DIR.glob("*.csv")):
        with open(path, newline="") as fh:
            for row in csv.DictReader(fh):
                if row["scheme"] in out:
                    out[row["scheme"]].add(tuning.TileConfig(*(int(row[c]) if row.get(c) else tuning.OPTIONAL_COLUMNS[c]
                                                               for c in tuning.CONFIG_COLUMNS)))
    for spec in PRESETS.values():
        for scheme in schemes:
            for tokens in TOKENS:
                out[scheme].add(tuning.heuristic(scheme, spec.hidden_size, spec.intermediate_size,
                                                 spec.num_experts, spec.top_k, tokens))
    return {k: sorted(v, key=str) for k, v in out.items()}


def run_builds(jobs: list[tuple[str, Callable[[], int]]], what: str) -> int:
    """Run each (label, build) job (build() -> binary size in bytes), print one line each and a
    summary; return the number that failed."""
    failed, start = 0, time.time()
    for label, build in jobs:
        try:
            print(f"{label} {build()} B", flush=True)
        except Exception as exc:  # report every failing build, then fail the run
            failed += 1
            print(f"{label} FAILED {type(exc).__name__}: {str(exc)[:400]}", flush=True)
    print(f"{len(jobs) - failed} of {len(jobs)} {what} in {time.time() - start:.0f} s (triton {triton.__version__})")
    return failed


def compile_one(kernel: JITFunction, sig: dict, ce: dict, div: list, options: dict, target: GPUTarget) -> int:
    """Build one recorded launch for `target`; return the binary's size in bytes."""
    names = list(kernel.arg_names)
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div}
    src = ASTSource(kernel, {**{n: ("constexpr" if n in ce else sig[n]) for n in names}}, constexprs=ce, attrs=attrs)
    compiled = triton.compile(src, target=target, options=dict(options))
    binary = compiled.asm.get("cubin") or compiled.asm.get("hsaco") or b""
    if not binary:
        raise RuntimeError("no binary produced")
    return len(binary)


def main(argv: list[str] | None = None) -> int:
    """Record every launch, compile each for every target, print one line each; exit 1 on any failure."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", nargs="+", default=["sm_90a"], choices=list(TARGETS))
    p.add_argument("--kernels", nargs="+", metavar="NAME", help="build only these kernels (default: all)")
    args = p.parse_args(argv)
    JITFunction.run = _record
    os.environ["TRITON_INTERPRET"] = "1"  # only so the ops accept CPU tensors; the kernels stay compilable
    for mod in (kcommon, gemm1, gemm2, inter_quant, mxfp4, routing, transport):
        if hasattr(mod, "interpreting"):
            mod.interpreting = lambda: False
    start = time.time()
    _exercise()
    os.environ.pop("TRITON_INTERPRET")
    print(f"{len(launches)} distinct launches recorded from {len({k[0] for k in launches})} kernels "
          f"in {time.time() - start:.0f} s", flush=True)
    if args.kernels:
        unknown = set(args.kernels) - {k[0] for k in launches}
        if unknown:
            p.error(f"--kernels: {', '.join(sorted(unknown))} not launched; launched: "
                    f"{', '.join(sorted({k[0] for k in launches}))}")
        for key in [k for k in launches if k[0] not in args.kernels]:
            del launches[key]
    jobs = []
    for target in args.target:
        for key, (kernel, sig, ce, div, options) in sorted(launches.items(), key=lambda kv: str(kv[0])):
            if TARGETS[target].backend == "hip" and (options.get("launch_pdl") or any(
                    ce.get(name) for name in ("PDL", "PDL_WAIT", "PDL_RELEASE", "TMA_A", "TMA_W", "AHEAD"))):
                continue  # PDL and the lookahead prefetch are PTX, TMA NVIDIA's: off on HIP (kernels/common.py)
            label = f"{target} {kernel.__name__} {options} " + " ".join(
                f"{k}={v}" for k, v in ce.items() if k.isupper() and v is not None and not callable(v)) + ":"
            jobs.append((label, _builder(kernel, sig, ce, div, options, target)))
    return 1 if run_builds(jobs, f"builds passed for {', '.join(args.target)}") else 0


def _builder(kernel, sig, ce, div, options, target: str):
    def build() -> int:
        # a ROCm torch sets this False: PTX's byte permute does not exist on AMD
        mxfp4.PRMT_OK = tl.constexpr(TARGETS[target].backend == "cuda")
        # what mxfp4.scaled_dot picks on that GPU: a8w4 (e4m3 x MX quads) through tl.dot_scaled on gfx950
        scaled = ({"SCALED": ce["FP8"] and ce["W4"] and mxfp4.scaled_by_default(target, ce["BLOCK_K"])}
                  if "SCALED" in ce else {})
        return compile_one(kernel, sig, {**ce, **scaled}, div, options, TARGETS[target])
    return build

if __name__ == "__main__":
    sys.exit(main())
