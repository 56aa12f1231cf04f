#!/usr/bin/env python3
"""Baseline: OpenAI triton_kernels' MXFP4 MoE on Hopper, timed exactly like `atom-moe bench`.

    python3 scripts/vllm_baseline_src.py      # once, where PyPI is reachable: -> .cache/vllm-0.33.0
    PYTHONPATH=.cache/vllm-0.33.0/vllm/third_party python scripts/tk_baseline.py --csv out/tk.csv --ours

triton_kernels is not part of atom_moe and is not committed. Two sources work:
- the copy vLLM 0.33 ships as vllm/third_party/triton_kernels (triton_kernels' 3.5.1 API: routing
  through `triton_kernels.routing`), which is what a vLLM install without a separate
  triton_kernels runs; scripts/vllm_baseline_src.py unzips it from the vllm wheel;
- python/triton_kernels/triton_kernels of triton's v3.6.0 tag (3.6 API: topk returns a
  SparseMatrix), exported by hand into .cache/tk/python on an earlier machine.
Either is the Hopper path vLLM uses for gpt-oss: bf16 activations, MXFP4 weights in
triton_kernels' Hopper layouts, two matmul_ogs calls with routing (gather plus fused SwiGLU-OAI,
then scatter plus top-k combine), called the way vLLM's gpt_oss_triton_kernels_moe.py does for
that API. The 3.5.1 routing kernels need a power-of-two top-k (vLLM patches them for
DeepSeek-V4's 6; this script does not): at another top-k (GLM-5.2's 9, V4.1's 6) the routing
metadata is built once in torch before timing (`routing_any_topk`), so triton_kernels' rows
time its two matmul_ogs calls only while ours include our routing kernel (the CSV note says so),
and --topk-select skips the shape.

Per (shape, T): the same random MXFP4 bytes as atom_moe's bench (common.random_weights), the
same routing generator (common.make_routing), the same timer (common.Timer: CUDA-graph replay,
L2 flushed before each replay, median) and the same a16w4 floor (common.floor_terms at the
bf16 matmul rate). The timed region starts from given top-k ids and weights, like ours:
routing metadata (topk with the ids given, bitmatrix sort, ragged metadata) + GEMM1 + GEMM2
+ combine. `--topk-select` instead lets topk pick the experts from logits, which is vLLM's
exact per-forward sequence (impl triton_kernels_topk). Rows use bench.CSV_COLUMNS, so they
concatenate with docs/perf/kernels-h200.csv. `--ours` adds atom_moe's a16w4 row on the same
inputs in the same process. Both use gpt-oss's SwiGLU (alpha 1.702, limit 7) on every
shape (triton_kernels fuses no other activation); no biases.

Before timing, each shape is checked: triton_kernels' own MXFP4 decode of our bytes must equal
atom_moe.formats', topk's routing metadata must be that of the ids, and the layer output at
--check-tokens must match atom_moe.reference.

The given ids reach topk as int32: with int16 ids (what vLLM's topk returns) v3.6's
_topk_forward packs the bitmatrix with `1 << (id % 32)` computed in int16, which drops every
expert with id % 32 >= 16 and smears id % 32 == 15 over bits 15-31; vLLM never hands ids to
topk (it packs the bitmatrix itself with a uint32 one).

    PYTHONPATH=.cache/vllm-0.33.0/vllm/third_party python scripts/tk_baseline.py --diagnose

checks each piece alone at a small shape (routing metadata; GEMM1 alone; GEMM1 with gather and
SwiGLU; GEMM2 with scatter and gammas; the layer), for each weight layout (--layout), prints a
line per check and exits non-zero unless the chosen layout passes them all.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import sys
import time
import traceback
from pathlib import Path

import torch

from atom_moe.tools import bench, common
from atom_moe.tools.accuracy import rel
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import Activation, ActivationKind, MoESpec
from atom_moe.weights import plain_mxfp4

ALPHA, LIMIT = 1.702, 7.0  # gpt-oss SwiGLU, as vLLM passes to triton_kernels
MAX_REL_ERR = 2e-2  # bf16 activations and bf16 intermediate: errors of a few 1e-3 expected
LAYOUTS = ("hopper", "strided")  # Hopper-swizzled values+scales (vLLM on sm_90), or plain column-major
# --diagnose: gpt-oss-120b's routing geometry (E 128, top-4, T 8: ids >= 16 exist, unlike E 4) at tiny H, I;
# H = 2I makes GEMM1's weight square (so the other orientation can be tested too); H % 128 = 64 and
# I / 32 = 5 scale groups give K and N tails like 2880's (K % 128 = 64, 90 groups padded to 92)
DIAG_H, DIAG_I, DIAG_E, DIAG_K, DIAG_T = 320, 160, 128, 4, 8
TK_HINT = ("run with PYTHONPATH=.cache/vllm-0.33.0/vllm/third_party (vLLM's copy, unzipped by "
           "scripts/vllm_baseline_src.py) or PYTHONPATH=.cache/tk/python (triton v3.6.0's, exported there); "
           "the PyPI package `triton-kernels` is an unrelated placeholder")
API = {"version": None}  # "3.6" or "3.5.1", set by import_tk


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line; bad values are rejected here with a message (exit 2)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["gpt-oss-120b"], choices=list(common.SHAPES))
    p.add_argument("--tokens", nargs="+", type=int, default=list(common.TOKENS))
    p.add_argument("--routing", default="uniform", choices=["uniform", "skewed"], help="as in atom_moe bench")
    p.add_argument("--iters", type=int, default=20, help="timed graph replays per row (median)")
    p.add_argument("--csv", type=Path, default=Path("tk_baseline.csv"))
    p.add_argument("--ceilings", nargs=3, type=float, default=None, metavar=("READ_TBPS", "BF16_TFLOPS", "FP8_TFLOPS"),
                   help="use these ceilings (from a bench run) instead of measuring them")
    p.add_argument("--ours", action="store_true", help="also time atom_moe's a16w4 fused_experts on the same inputs")
    p.add_argument("--topk-select", action="store_true",
                   help="let topk select the experts from logits inside the timed region (vLLM's exact path)")
    p.add_argument("--check-tokens", type=int, default=8, help="tokens of the correctness check per shape")
    p.add_argument("--layout", default="hopper", choices=LAYOUTS,
                   help="weight layout: hopper = vLLM's swizzled Hopper layouts (default); strided = plain")
    p.add_argument("--diagnose", action="store_true",
                   help="check routing, GEMM1, GEMM1+gather+SwiGLU, GEMM2+scatter and the layer at a small "
                        "shape for every layout, then exit (0 only if --layout passes all)")
    p.add_argument("--profile", action="store_true",
                   help="for Nsight Compute (scripts/ncu_profile.sh --tk): no timing, no CSV; per (shape, T) run each "
                        "implementation eagerly twice, then once inside cudaProfilerStart/Stop and an NVTX range "
                        "SHAPE/a16w4/T<T>/<impl>")
    args = p.parse_args(argv)
    if any(t < 1 for t in args.tokens):
        p.error(f"--tokens must be positive integers, got {args.tokens}")
    if args.iters < 1:
        p.error(f"--iters must be >= 1, got {args.iters}")
    if args.check_tokens < 1:
        p.error(f"--check-tokens must be >= 1, got {args.check_tokens}")
    if args.ceilings is not None and min(args.ceilings) <= 0:
        p.error(f"--ceilings must be positive (READ_TBPS BF16_TFLOPS FP8_TFLOPS), got {args.ceilings}")
    return args


def import_tk():
    """Import triton_kernels (matmul_ogs with the 3.6 or the 3.5.1 routing API) or exit 2 naming PYTHONPATH."""
    try:
        import triton_kernels
        import triton_kernels.matmul_ogs  # noqa: F401  (3.8 drops matmul_ogs)
        import triton_kernels.swiglu  # noqa: F401
        import triton_kernels.topk  # noqa: F401
        import triton_kernels.tensor as tensor
        if hasattr(tensor, "SparseMatrix"):
            API["version"] = "3.6"
        else:  # 3.5.1: no SparseMatrix; routing metadata from triton_kernels.routing
            from triton_kernels.routing import routing  # noqa: F401
            API["version"] = "3.5.1"
    except ImportError as exc:
        print(f"tk_baseline: cannot import triton_kernels ({exc}); {TK_HINT}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"tk_baseline: triton_kernels {API['version']} API from {Path(triton_kernels.__file__).parent}", flush=True)
    return triton_kernels


def check_device() -> None:
    """Fail unless a Hopper GPU is present: the weight layouts and vLLM's scale padding are Hopper's."""
    if not torch.cuda.is_available():
        raise SystemExit("tk_baseline needs a CUDA GPU (Hopper, sm_90)")
    cap = torch.cuda.get_device_capability()
    if cap[0] != 9:
        raise SystemExit(f"tk_baseline reproduces vLLM's Hopper (sm_90) path; this GPU is sm_{cap[0]}{cap[1]}")


def tk_weight(q: torch.Tensor, s: torch.Tensor, layout: str):
    """Checkpoint-form [E, N, K/2] e2m1 bytes and [E, N, K/32] e8m0 -> (w [E, K, N] Tensor, PrecisionConfig)."""
    from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig
    from triton_kernels.numerics import InFlexData
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details import layout as tkl
    if layout == "hopper":
        # vLLM (#47303) pads the scale groups to a multiple of 4 with zeros: triton 3.6's Hopper
        # kernel reads the swizzled scales unmasked past K, and stray 0xFF bytes there are NaN
        s = torch.nn.functional.pad(s, (0, -s.shape[-1] % 4))
        value_layout, value_opts = tkl.make_default_matmul_mxfp4_w_layout(mx_axis=1)
        scale_layout, scale_opts = tkl.make_default_matmul_mxfp4_w_scale_layout(mx_axis=1, num_warps=8)
    else:  # vLLM's Hopper fallback (torch < 2.8.1): plain layouts, the kernel masks the scales itself
        value_layout, value_opts, scale_layout, scale_opts = tkl.StridedLayout, {}, tkl.StridedLayout, {}
    # matmul_ogs wants w as [E, K, N] with the MX axis (K) at dim 1, column-major: transposed views, as vLLM
    w = convert_layout(wrap_torch_tensor(q.transpose(-2, -1), dtype=FP4), value_layout, **value_opts)
    ws = convert_layout(wrap_torch_tensor(s.transpose(-2, -1)), scale_layout, **scale_opts)
    return w, PrecisionConfig(weight_scale=ws, flex_ctx=FlexCtx(rhs_data=InFlexData()))


def swiglu_act():
    """gpt-oss SwiGLU fused into GEMM1 (reads gate/up interleaved along N: even columns gate, odd up)."""
    from triton_kernels.matmul_ogs import FnSpecs, FusedActivation
    from triton_kernels.swiglu import swiglu_fn
    if API["version"] == "3.5.1":  # there the reduction width is FusedActivation's, not FnSpecs'
        return FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), (ALPHA, LIMIT), 2)
    return FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit"), reduction_n=2), (ALPHA, LIMIT))


@dataclasses.dataclass
class RoutedSlots:
    """What triton_kernels' routing made of one batch, in either API's terms, for the checks."""
    indx: torch.Tensor  # [T, k] expert per slot
    vals: torch.Tensor  # [T, k] gate per slot
    col_sum: torch.Tensor  # [E] slots per expert
    col_sorted_indx: torch.Tensor  # row in expert-sorted order -> slot
    row_sorted_indx: torch.Tensor  # slot -> row in expert-sorted order


def kernel_routing(k: int) -> bool:
    """Whether triton_kernels' own routing kernels take this top-k (3.5.1's need a power of two)."""
    return API["version"] != "3.5.1" or k & (k - 1) == 0


def routing_any_topk(logits: torch.Tensor, ids: torch.Tensor, k: int, E: int):
    """3.5.1's (RoutingData, GatherIndx, ScatterIndx, None) for given ids [T, k] (each row sorted) at any top-k,
    built in torch: the gates are the softmax over the selected logits (as topk's), the slots sorted by expert,
    the per-block tile maps from triton_kernels' own torch twin (compute_expt_data_torch). It synchronises
    with the host (boolean masks), so it is built once, outside the timed region."""
    from triton_kernels.routing import GatherIndx, RoutingData, ScatterIndx, compute_expt_data_torch
    gates = torch.softmax(torch.take_along_dim(logits, ids.long(), dim=1).float(), dim=-1).to(logits.dtype)
    flat = ids.reshape(-1).to(torch.int32)
    combine = torch.argsort(flat, stable=True).int()  # row in expert-sorted order -> slot
    dispatch = torch.argsort(combine, stable=True).int()  # slot -> row
    hist = torch.bincount(flat, minlength=E).int()
    rdata = RoutingData(gates.reshape(-1)[combine.long()], hist, E, k, compute_expt_data_torch(hist, E, flat.numel()))
    return rdata, GatherIndx(combine, dispatch), ScatterIndx(dispatch, combine), None


def tk_routing(logits: torch.Tensor, ids: torch.Tensor | None, k: int, E: int):
    """topk (ids None: it selects) -> (RoutingData, GatherIndx, ScatterIndx, topk's SparseMatrix or None), as vLLM
    builds them; what the timed forward runs (where `kernel_routing(k)`)."""
    if not kernel_routing(k):
        if ids is None:
            raise ValueError(f"top-k {k}: triton_kernels 3.5.1 cannot select experts (its topk needs a power of two)")
        return routing_any_topk(logits, ids, k, E)
    if API["version"] == "3.5.1":
        from triton_kernels.routing import routing
        # renormalize=True (gpt-oss): softmax over the selected logits; expt_indx=ids skips selection
        return (*routing(logits, k, sm_first=False, expt_indx=ids), None)
    from triton_kernels.matmul_ogs import GatherIndx, RoutingData, ScatterIndx
    from triton_kernels.tensor import make_ragged_tensor_metadata
    from triton_kernels.topk import topk
    sparse = topk(logits, k, apply_softmax=True, y_indx=ids)
    dispatch = sparse.mask_metadata.row_sorted_indx  # slot (token * k + j) -> row in expert-sorted order
    combine = sparse.mask_metadata.col_sorted_indx  # row in expert-sorted order -> slot
    meta = make_ragged_tensor_metadata(sparse.mask_metadata.col_sum, dispatch.shape[0])
    rdata = RoutingData(sparse.vals.flatten()[combine], meta.slice_sizes, E, k, meta)
    return rdata, GatherIndx(combine, dispatch), ScatterIndx(dispatch, combine), sparse


def routed_slots(rdata, gather, sparse, T: int, k: int, E: int) -> RoutedSlots:
    """The per-slot view of tk_routing's result (outside the timed region: 3.5.1 needs a few torch ops for it)."""
    combine, dispatch = gather.src_indx, gather.dst_indx
    if sparse is not None:
        return RoutedSlots(sparse.indx, sparse.vals, sparse.mask_metadata.col_sum, combine, dispatch)
    # sorted row r holds slot combine[r]; the rows come expert by expert, expt_hist[e] of them each
    experts = torch.repeat_interleave(torch.arange(E, device=combine.device), rdata.expt_hist.long())
    indx = torch.empty_like(experts).scatter_(0, combine.long(), experts)
    vals = torch.empty_like(rdata.gate_scal).scatter_(0, combine.long(), rdata.gate_scal)
    return RoutedSlots(indx.view(T, k), vals.view(T, k), rdata.expt_hist, combine, dispatch)


def routed(logits: torch.Tensor, ids: torch.Tensor | None, k: int, E: int):
    """tk_routing plus its per-slot view: (RoutedSlots, RoutingData, GatherIndx, ScatterIndx), for the checks."""
    rdata, gather, scatter, sparse = tk_routing(logits, ids, k, E)
    return routed_slots(rdata, gather, sparse, logits.shape[0], k, E), rdata, gather, scatter


def routing_error(slots: RoutedSlots, ids: torch.Tensor, E: int) -> str | None:
    """Why the routing metadata is not that of `ids` [T, k] (None when it is): the slots grouped by expert in
    ascending order (any order inside an expert: the GEMMs gather and scatter through the same indices)."""
    flat = ids.reshape(-1).long()
    if not torch.equal(slots.indx.long(), ids.long()):
        return "topk routed to other experts than asked"
    if not torch.equal(slots.col_sum.long(), torch.bincount(flat, minlength=E)):
        return f"col_sum (from the bitmatrix) counts {int(slots.col_sum.sum())} slots, the ids have {flat.numel()}"
    order = slots.col_sorted_indx.long()
    if not torch.equal(torch.sort(order).values, torch.arange(flat.numel(), device=order.device)):
        return "col_sorted_indx is not a permutation of the slots"
    if not torch.equal(flat[order], torch.sort(flat).values):
        return "col_sorted_indx does not group the slots by expert in ascending order"
    if not torch.equal(slots.row_sorted_indx.long(), torch.argsort(order)):
        return "row_sorted_indx is not the inverse of col_sorted_indx"
    return None


def router_logits(w: torch.Tensor, ids: torch.Tensor, E: int) -> torch.Tensor:
    """bf16 [T, E] logits whose softmax over `ids` is `w`; the others sit far below, so topk picks exactly `ids`."""
    logits = torch.full((w.shape[0], E), -30.0, device=w.device, dtype=torch.bfloat16)
    return logits.scatter_(1, ids.long(), w.log().to(torch.bfloat16))


class TritonKernelsMoE:
    """One layer in triton_kernels' format, run with the calls vLLM makes (its 3.6 or 3.5.1 API)."""

    def __init__(self, weights, spec: MoESpec, layout: str = "hopper") -> None:
        import triton_kernels.matmul_ogs_details.opt_flags as opt_flags
        # vLLM sets this on sm_90 before building the weights (mxfp4 + scatter never split K anyway)
        opt_flags.update_opt_flags_constraints({"split_k": 1})
        self.E, self.k, self.H, self.I = spec.num_local_experts, spec.top_k, spec.hidden_size, spec.intermediate_size
        # our w13 rows are INTERLEAVED [g0, u0, g1, ...]: the pairing triton_kernels' swiglu_fn reads.
        # Ours are MX tiles: triton_kernels gets the plain MXFP4 they untile to (same bytes, same meaning)
        q13, s13, q2, s2 = plain_mxfp4(weights)
        self.w1, self.pc1 = tk_weight(q13.data, s13.data, layout)
        self.w2, self.pc2 = tk_weight(q2, s2, layout)
        del q13, s13, q2, s2
        self.act = swiglu_act()

    def inputs(self, w: torch.Tensor, ids: torch.Tensor, x: torch.Tensor, select: bool) -> dict:
        """Router logits whose softmax over `ids` is `w`, plus the buffers vLLM preallocates; where triton_kernels'
        routing kernels cannot take this top-k, the routing metadata too (`routing_any_topk`, built here)."""
        T = x.shape[0]
        logits = router_logits(w, ids, self.E)
        # int32, never int16: see the module docstring (v3.6 topk packs int16 ids' bits in int16)
        ids32 = None if select else ids.to(torch.int32).contiguous()
        return dict(x=x, logits=logits, ids=ids32,
                    inter=torch.empty(1, T * self.k, self.I, device=x.device, dtype=torch.bfloat16),
                    out=torch.empty(1, T, self.H, device=x.device, dtype=torch.bfloat16),
                    routing=None if kernel_routing(self.k) else tk_routing(logits, ids32, self.k, self.E))

    def forward(self, x, logits, ids, inter, out, routing=None) -> torch.Tensor:
        """topk -> routing data (or the given `routing`) -> matmul_ogs(gather, SwiGLU) -> matmul_ogs(scatter,
        gammas, combine); [T, H]."""
        from triton_kernels.matmul_ogs import matmul_ogs
        T = x.shape[0]
        rdata, gather, scatter, sparse = routing or tk_routing(logits, ids, self.k, self.E)
        matmul_ogs(x, self.w1, None, rdata, gather_indx=gather, precision_config=self.pc1,
                   fused_activation=self.act, y=inter)
        matmul_ogs(inter.view(T * self.k, self.I), self.w2, None, rdata, scatter_indx=scatter,
                   precision_config=self.pc2, gammas=rdata.gate_scal, y=out)
        self.last_routing = (rdata, gather, sparse)  # for the checks; not read inside the timed graph
        return out.view(T, self.H)


def check_format(weights) -> None:
    """triton_kernels' MXFP4 decode of our expert 0 must equal atom_moe.formats' (same bytes, same meaning)."""
    # their torch decode defines their format; it is also free of kernel-specific masking questions
    from triton_kernels.numerics_details.mxfp import upcast_from_mxfp_torch
    from atom_moe import formats
    q13, s13, _, _ = plain_mxfp4(weights, slice(0, 1))  # our MX tiles, untiled: checkpoint-form bytes
    q, s = q13.data, s13.data
    theirs = upcast_from_mxfp_torch(q, s, torch.float32, axis=-1)
    ours = formats.dequantize_mxfp4(q, s)
    if not torch.equal(theirs, ours):
        raise RuntimeError(f"MXFP4 decode differs between triton_kernels and atom_moe.formats: max |diff| "
                           f"{(theirs - ours).abs().max().item():.3e}; the byte conventions do not match")


def reference_for(weights, topk_ids: torch.Tensor) -> ReferenceWeights:
    """fp32 reference weights of only the experts hit (a full dequantization of large shapes would not fit)."""
    hit = weights.expert_map[torch.unique(topk_ids.long())].tolist()  # the local experts hit
    return ReferenceWeights.from_prepared(weights.restricted(hit))


def check_outputs(name: str, tk: TritonKernelsMoE, weights, spec: MoESpec, T: int, args, gen) -> None:
    """Routing metadata vs the ids, layer output vs atom_moe.reference (fp32, same weights, topk's gates)."""
    w, ids = sorted_routing(T, spec, args.routing, gen)
    x = torch.randn(T, spec.hidden_size, device="cuda", dtype=torch.bfloat16)
    y = tk.forward(**tk.inputs(w, ids, x, args.topk_select)).clone()
    # both modes return the slots in ascending expert order, which sorted_routing already uses
    slots = routed_slots(*tk.last_routing, T, spec.top_k, spec.num_local_experts)
    why = routing_error(slots, ids, spec.num_local_experts)
    if why is not None:
        raise RuntimeError(f"{name}: triton_kernels routing metadata is wrong: {why}")
    got_ids, gates = slots.indx.long(), slots.vals.float()
    if not (gates - w).abs().max().item() <= 1e-2:  # bf16 logits: gates within bf16 rounding of w
        raise RuntimeError(f"{name}: triton_kernels gates differ from the routing weights by more than 1e-2")
    ref = reference_moe(x, gates, got_ids, reference_for(weights, got_ids), spec.activation)
    err = rel(y, ref)
    msg = f"{name}: check T={T}: triton_kernels ({args.layout}) vs atom_moe.reference rel err {err:.2e}"
    if args.ours:
        from atom_moe.experts import fused_experts
        err_ours = rel(fused_experts(x, gates, got_ids.to(torch.int32), weights, spec), ref)
        msg += f"; atom_moe {err_ours:.2e}"
        if not err_ours <= MAX_REL_ERR:
            raise RuntimeError(f"{msg}: atom_moe above {MAX_REL_ERR}")
    print(msg, flush=True)
    if not err <= MAX_REL_ERR:  # also catches NaN
        raise RuntimeError(f"{msg}: above {MAX_REL_ERR}; the baseline does not compute this layer "
                           f"(run --diagnose to see which piece)")


def diag_check(results: list, layout: str | None, name: str, fn, required: bool) -> bool:
    """Run one --diagnose check fn() -> (error, text), print its line, record it; an exception fails it."""
    try:
        err, text = fn()
        torch.cuda.synchronize()  # an asynchronous kernel fault belongs to this check, not the next
        ok = err <= MAX_REL_ERR  # also catches NaN
    except Exception as exc:  # report and go on: one broken piece must not hide the others
        where = traceback.extract_tb(exc.__traceback__)[-1]
        ok, text = False, (f"error {type(exc).__name__} at {Path(where.filename).name}:{where.lineno}: "
                           f"{(str(exc).splitlines() or [''])[0][:200]}")
    label = f"[{layout}] {name}" if layout else name
    print(f"  {label:52s} {'ok  ' if ok else 'FAIL'}  {text}{'' if required else '  (info)'}", flush=True)
    results.append((layout, name, ok, required))
    return ok


def diagnose(args) -> int:
    """--diagnose: routing, GEMM1, GEMM1+gather+SwiGLU, GEMM2+scatter+gammas, layer, per layout; exit status."""
    from triton_kernels.matmul_ogs import matmul_ogs
    from atom_moe import formats
    from atom_moe.reference import apply_activation
    t0 = time.perf_counter()
    H, I, E, k, T = DIAG_H, DIAG_I, DIAG_E, DIAG_K, DIAG_T
    spec = MoESpec(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, scheme="a16w4",
                   activation=Activation(ActivationKind.SWIGLU_OAI, alpha=ALPHA, limit=LIMIT))
    print(f"diagnose: H={H} I={I} E={E} top-{k} T={T}, gpt-oss SwiGLU; a line per check, rel err limit "
          f"{MAX_REL_ERR}", flush=True)
    torch.manual_seed(0)
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    weights = common.random_weights(spec)
    check_format(weights)
    q13, s13, q2, s2 = plain_mxfp4(weights)  # triton_kernels takes plain MXFP4 (small shape: all experts)
    q13, s13 = q13.data, s13.data
    w, ids = sorted_routing(T, spec, "uniform", gen)
    # token 0 on experts whose id % 32 is 15, 16, 31: the ones an int16 bitmatrix pack gets wrong
    ids[0] = torch.tensor([15, 16, 31, E - 1], device=ids.device, dtype=ids.dtype)
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    logits = router_logits(w, ids, E)
    results: list = []

    # (0) routing metadata: topk with the ids given (int32: the script's path; int16: its old one), or selecting
    def routing(y_indx):
        slots = routed(logits, y_indx, k, E)[0]
        why = routing_error(slots, ids, E)
        gate_err = (slots.vals.float() - w).abs().max().item()
        if why is None and gate_err > 1e-2:
            why = f"gates differ from the routing weights by {gate_err:.1e}"
        return (0.0, "metadata groups the ids' slots by expert") if why is None else (float("inf"), why)

    print("(0) routing metadata (topk, bitmatrix sort, ragged metadata) vs torch", flush=True)
    diag_check(results, None, "ids given as int32", lambda: routing(ids.to(torch.int32).contiguous()), True)
    diag_check(results, None, "topk selects from logits", lambda: routing(None), True)
    diag_check(results, None, "ids given as int16 (the old script's call)",
               lambda: routing(ids.to(torch.int16).contiguous()), False)

    # fp32 references, all from atom_moe's decode of the same bytes (independent of triton_kernels' layouts)
    e = E - 1
    w13_e = formats.dequantize_mxfp4(q13[e], s13[e])  # [2I, H], interleaved rows
    refw = reference_for(weights, ids)
    flat = ids.reshape(-1).long()
    slots, rdata, gather, scatter = routed(logits, ids.to(torch.int32).contiguous(), k, E)
    order = slots.col_sorted_indx.long()  # expert-sorted row -> slot, triton_kernels' order (checked in (0))
    tok = order // k
    rows = torch.tensor([refw.experts.index(int(i)) for i in flat[order].tolist()], device=flat.device)
    xs = x.float()[tok]
    inter_ref = apply_activation(torch.einsum("ph,pih->pi", xs, refw.gate[rows]),
                                 torch.einsum("ph,pih->pi", xs, refw.up[rows]), spec.activation)
    inter_in = inter_ref.to(torch.bfloat16)  # GEMM2's input in (c): exact, so (c) sees only GEMM2's error
    gam = rdata.gate_scal.float()  # topk's gates (bf16 softmax), in expert-sorted order
    y2_rows = torch.einsum("pi,phi->ph", inter_in.float(), refw.down[rows])
    y2_ref = torch.zeros(T, H, device=x.device).index_add_(0, tok, y2_rows * gam[:, None])
    y2_nogam = torch.zeros(T, H, device=x.device).index_add_(0, tok, y2_rows)
    layer_ref = reference_moe(x, slots.vals.float(), ids.long(), refw, spec.activation)

    def gemm1_plain(layout):
        wt, pc = tk_weight(q13[e:e + 1], s13[e:e + 1], layout)
        y = matmul_ogs(x, wt, None, precision_config=pc).reshape(T, 2 * I).float()
        ref = x.float() @ w13_e.T
        col_ok = ((y - ref).norm(dim=0) <= MAX_REL_ERR * ref.norm(dim=0)).float().mean().item()
        # what the output would be with the weight in the other orientation (square here: H = 2I)
        err = rel(y, ref)
        return err, f"rel err {err:.2e}; columns ok {col_ok:.0%}; vs x @ W (other orientation) " \
                    f"{rel(y, x.float() @ w13_e):.2e}"

    def gemm1_gather(layout):
        wt, pc = tk_weight(q13, s13, layout)
        y = matmul_ogs(x, wt, None, rdata, gather_indx=gather, precision_config=pc,
                       fused_activation=swiglu_act()).reshape(T * k, I).float()
        swapped = apply_activation(torch.einsum("ph,pih->pi", xs, refw.up[rows]),
                                   torch.einsum("ph,pih->pi", xs, refw.gate[rows]), spec.activation)
        err = rel(y, inter_ref)
        return err, f"rel err {err:.2e}; vs gate/up swapped {rel(y, swapped):.2e}"

    def gemm2_scatter(layout):
        wt, pc = tk_weight(q2, s2, layout)
        y = matmul_ogs(inter_in, wt, None, rdata, scatter_indx=scatter, precision_config=pc,
                       gammas=rdata.gate_scal).reshape(T, H).float()
        err = rel(y, y2_ref)
        return err, f"rel err {err:.2e}; vs without gammas {rel(y, y2_nogam):.2e}"

    def layer(layout, mode):
        tk = TritonKernelsMoE(weights, spec, layout)
        li = tk.inputs(w, ids, x, select=(mode == "select"))
        if mode == "int16":
            li["ids"] = ids.to(torch.int16).contiguous()
        y = tk.forward(**li).float()
        err = rel(y, layer_ref)
        return err, f"rel err {err:.2e}"

    def run_bcd(layout, required):
        """(b)-(d) for one layout; True when all pass."""
        ok = diag_check(results, layout, "(b) GEMM1 + gather + SwiGLU", lambda: gemm1_gather(layout), required)
        ok &= diag_check(results, layout, "(c) GEMM2 + scatter + gammas", lambda: gemm2_scatter(layout), required)
        ok &= diag_check(results, layout, "(d) layer, ids given (int32)", lambda: layer(layout, "ids"), required)
        ok &= diag_check(results, layout, "(d) layer, topk selects", lambda: layer(layout, "select"), required)
        return ok

    others = [lay for lay in LAYOUTS if lay != args.layout]
    print("(a) GEMM1 alone (no routing, one expert), every layout; [E, K, N] = transposed checkpoint bytes",
          flush=True)
    a_ok = {lay: diag_check(results, lay, f"(a) GEMM1 alone, expert {e}", lambda lay=lay: gemm1_plain(lay),
                            lay == args.layout) for lay in (args.layout, *others)}
    print(f"(b)-(d) with --layout {args.layout}", flush=True)
    chosen_ok = run_bcd(args.layout, True) and a_ok[args.layout]
    diag_check(results, args.layout, "(d) layer, ids given as int16 (old call)", lambda: layer(args.layout, "int16"),
               False)
    working = [args.layout] if chosen_ok else []
    if not chosen_ok:  # is there a layout that works? (only then: each costs compiles)
        for lay in others:
            print(f"(b)-(d) with --layout {lay} (the chosen layout failed)", flush=True)
            if run_bcd(lay, False) and a_ok[lay]:
                working.append(lay)
    failed = [(lay, n) for lay, n, ok, req in results if req and not ok]
    print(f"diagnose: {time.perf_counter() - t0:.0f} s", flush=True)
    if not failed:
        print(f"diagnose: PASS: routing and layout {args.layout} compute the layer; run the benchmark with "
              f"--layout {args.layout}", flush=True)
        return 0
    names = "; ".join(f"[{lay}] {n}" if lay else n for lay, n in failed)
    if working:
        print(f"diagnose: FAIL: {names}. Layout {working[0]} passes every check: rerun with --layout {working[0]}",
              flush=True)
    else:
        print(f"diagnose: FAIL: {names}. No layout computes this layer", flush=True)
    return 1


def sorted_routing(T: int, spec: MoESpec, mode: str, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """common.make_routing, slots sorted by expert id (topk's own output order; the sum does not care)."""
    w, ids = common.make_routing(T, spec.num_experts, spec.top_k, mode, gen, spec.shared_experts)
    ids, order = ids.sort(1)
    return w.gather(1, order), ids


def profiled(name: str, fn) -> None:
    """Run fn twice (compile, warm-up), then once inside the profiler range and an NVTX range `name`."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    torch.cuda.nvtx.range_push(name)
    fn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {name}", flush=True)


def record_opt_flags(tk_module) -> list:
    """Record the tile choices matmul_ogs makes (observes make_opt_flags; changes nothing)."""
    seen: list = []
    original = tk_module.make_opt_flags

    def recording(*a, **kw):
        flags = original(*a, **kw)
        seen.append(flags)
        return flags

    tk_module.make_opt_flags = recording
    return seen


def flags_str(flags) -> str:
    """Short text of GEMM1's and GEMM2's opt flags."""
    return " | ".join(f"bm{f.block_m} bn{f.block_n} bk{f.block_k} w{f.num_warps} s{f.num_stages}"
                      f"{' persistent' if f.is_persistent else ''}" for f in flags)


def main(argv: list[str] | None = None) -> None:
    """Run the baseline described by the command line and write the CSV."""
    args = parse(argv)
    tkpkg = import_tk()
    check_device()
    import triton
    print(f"triton {triton.__version__}, torch {torch.__version__}, triton_kernels from {tkpkg.__path__[0]}",
          flush=True)
    if args.diagnose:
        raise SystemExit(diagnose(args))
    import triton_kernels.matmul_ogs as tk_matmul
    from atom_moe.experts import allocate_workspace, device_name, fused_experts
    from atom_moe.kernels.tuning import lookup
    seen_flags = record_opt_flags(tk_matmul)
    timer = common.Timer(args.iters)
    ceil = common.ceilings(timer, args.ceilings)
    dev = device_name(torch.device("cuda"))
    print(f"device {dev}: HBM read {ceil['read_tbps']:.2f} TB/s, bf16 {ceil['bf16_tflops']:.0f} TFLOP/s, "
          f"fp8 {ceil['fp8_tflops']:.0f} TFLOP/s{' (given)' if args.ceilings else ''}", flush=True)
    impl = ("triton_kernels_topk" if args.topk_select else "triton_kernels") + (
        "" if args.layout == "hopper" else f"_{args.layout}")
    note = (f"triton_kernels {API['version']} API matmul_ogs, vLLM gpt-oss call sequence; {args.layout} weight layout; "
            f"swiglu_oai; no bias; routing "
            f"{'selected by topk from logits' if args.topk_select else 'ids given (topk y_indx, int32)'}")
    rows: list[dict] = []
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    for name in args.shapes:
        H, I, E, k = common.SHAPES[name]
        shape_note = note
        if not kernel_routing(k):
            if args.topk_select:
                print(f"{name}: not run: triton_kernels 3.5.1's topk needs a power-of-two top-k, this shape has {k} "
                      f"(--topk-select times it)", flush=True)
                continue
            shape_note = (f"{note}; top-k {k}: routing metadata built once outside the timed region in torch "
                          f"(3.5.1's routing kernels need a power of two; vLLM patches them): only the two "
                          f"matmul_ogs calls are timed, ours includes its routing kernel")
            print(f"{name}: top-k {k}: triton_kernels' rows time its two matmul_ogs calls only (routing metadata "
                  f"built once beforehand)", flush=True)
        spec = common.bench_spec(name, "a16w4", activation=Activation(ActivationKind.SWIGLU_OAI, alpha=ALPHA,
                                                                      limit=LIMIT))
        weights = common.random_weights(spec)
        tk = TritonKernelsMoE(weights, spec, args.layout)
        check_format(weights)
        check_outputs(name, tk, weights, spec, args.check_tokens, args, gen)
        ws = allocate_workspace(spec, max(args.tokens), "cuda") if args.ours else None
        for T in args.tokens:
            w, ids = sorted_routing(T, spec, args.routing, gen)
            x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
            nbytes, flops = common.floor_terms(spec, ids, 2)
            floor_us = max(nbytes / (ceil["read_tbps"] * 1e6), flops / (ceil["bf16_tflops"] * 1e6))

            def row(impl_name: str, us: float, config: str, row_note: str) -> None:
                rows.append(dict(device=dev, shape=name, scheme="a16w4", T=T, routing=args.routing, impl=impl_name,
                                 us=round(us, 2), floor_us=round(floor_us, 2),
                                 frac_of_floor=round(floor_us / us, 3), tbps=round(nbytes / us / 1e6, 3),
                                 tflops=round(flops / us / 1e6, 1), bytes=nbytes, flops=flops, config=config,
                                 note=row_note))
                print(f"{name:16s} a16w4 T={T:5d} {impl_name:20s} {us:10.1f} us  floor {floor_us:9.1f}  "
                      f"frac {floor_us / us:5.3f}  {nbytes / us / 1e6:5.2f} TB/s  {config}", flush=True)

            inp = tk.inputs(w, ids, x, args.topk_select)
            if args.profile:
                profiled(f"{name}/a16w4/T{T}/{impl}", lambda: tk.forward(**inp))
                if args.ours:
                    out = torch.empty_like(x)
                    profiled(f"{name}/a16w4/T{T}/atom_moe",
                             lambda: fused_experts(x, w, ids, weights, spec, workspace=ws, out=out))
                continue
            seen_flags.clear()
            tk.forward(**inp)  # eager once: records the tile choices (the timer warms up again itself)
            config = flags_str(seen_flags[:2])
            row(impl, timer.graph_us(lambda: tk.forward(**inp)), config, shape_note)
            if args.ours:
                out = torch.empty_like(x)
                us = timer.graph_us(lambda: fused_experts(x, w, ids, weights, spec, workspace=ws, out=out))
                row("atom_moe", us, common.cfg_str(lookup(dev, "a16w4", H, I, E, k, T)),
                    "same inputs as the triton_kernels row; swiglu_oai")
        weights = tk = ws = None  # free this shape's weights before the next one is built
        torch.cuda.empty_cache()
    if args.profile:
        return
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(bench.CSV_COLUMNS))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {len(rows)} rows to {args.csv}", flush=True)


if __name__ == "__main__":
    main()
