#!/usr/bin/env python3
"""What GEMM2's e4m3 input granularity costs a8w4 in accuracy: the layer in fp32 on the CPU, no kernels.

    python3 scripts/inter_quant_probe.py --shapes deepseek-v3 gpt-oss-120b --experts 16 --tokens 192

a8w4 quantizes GEMM2's input (the SwiGLU output) per (token, 64-group) today, so GEMM2 keeps a second
accumulator and promotes every K step (docs/perf/a8w4-one-accumulator-h100.md). One scale per token would let it
keep one accumulator, as GEMM1 does. This probe measures what that costs, on each preset's real H and I (E cut
to --experts), MXFP4 weights from random bf16 ones, and x through GEMM1's per-token e4m3 as the scheme does:

  group64     today: e4m3 per (token, 64-group) from fp32;
  token       one scale per token from fp32;
  token_bf16  one scale per token from the values rounded to bf16 (a bf16 intermediate quantized later);
  token_fp8   the group64 codes requantized to one scale per token (what a launch after GEMM1 could do
              without a bf16 intermediate): a second rounding.

Errors are ||out - ref|| / ||ref|| against the fp32 layer on the same MXFP4 weights with no activation quant.
"""

from __future__ import annotations

import argparse
import csv
import sys
from collections.abc import Callable

import torch

from atom_moe import formats
from atom_moe.presets import preset, scaled_down
from atom_moe.reference import apply_activation, quant_dequant_activations
from atom_moe.spec import A8W4_INTER_GROUP, Scheme, SpecError
from atom_moe.tools.synthetic import random_layer, random_tokens


def group64(a: torch.Tensor) -> torch.Tensor:
    """Today's GEMM2 input: e4m3 per (token, 64-group), dequantized."""
    return quant_dequant_activations(a, Scheme.A8W4, inter=True)


def token(a: torch.Tensor) -> torch.Tensor:
    """One e4m3 scale per token, from the fp32 values, dequantized."""
    q, s = formats.quantize_fp8_per_token(a)
    return q.float() * s


def token_bf16(a: torch.Tensor) -> torch.Tensor:
    """One e4m3 scale per token, from the values rounded to bf16 first, dequantized."""
    return token(a.bfloat16().float())


def token_fp8(a: torch.Tensor) -> torch.Tensor:
    """The 64-group codes rescaled to the row's largest group scale and rounded to e4m3 again, dequantized."""
    q, s = formats.quantize_fp8_per_group(a, A8W4_INTER_GROUP)
    s_row = s.amax(dim=1, keepdim=True)
    groups = q.float().view(q.shape[0], -1, A8W4_INTER_GROUP) * (s / s_row).unsqueeze(-1)
    return groups.reshape(q.shape).to(torch.float8_e4m3fn).float() * s_row


VARIANTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "group64": group64, "token": token, "token_bf16": token_bf16, "token_fp8": token_fp8}


def layer_errors(name: str, experts: int, tokens: int, seed: int) -> dict[str, float]:
    """Relative error of the a8w4 layer against fp32, for each GEMM2-input variant, on one preset's H and I."""
    base = preset(name, scheme="a8w4")
    spec = scaled_down(base, hidden_size=base.hidden_size, intermediate_size=base.intermediate_size,
                       num_experts=experts, top_k=min(base.top_k, experts))
    gen = torch.Generator().manual_seed(seed)
    raw = random_layer(spec, generator=gen)
    I = spec.intermediate_size
    w13 = formats.dequantize_mxfp4(*formats.quantize_mxfp4(raw.w13.float()))
    w2 = formats.dequantize_mxfp4(*formats.quantize_mxfp4(raw.w2.float()))
    x, topk_w, ids = random_tokens(spec, tokens, generator=gen)
    xq = quant_dequant_activations(x, Scheme.A8W4)  # GEMM1's input, per token
    ref = torch.zeros(tokens, spec.hidden_size)
    outs = {v: torch.zeros_like(ref) for v in VARIANTS}
    for e in range(experts):
        rows, slots = (ids == e).nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        gate_up = [xin[rows] @ w13[e].T for xin in (x.float(), xq)]
        if raw.w13_bias is not None:
            gate_up = [h + raw.w13_bias[e] for h in gate_up]
        exact, quant = (apply_activation(h[:, :I], h[:, I:], spec.activation) for h in gate_up)
        weight = topk_w[rows, slots].float().unsqueeze(1)
        bias = 0 if raw.w2_bias is None else raw.w2_bias[e]
        ref.index_add_(0, rows, (exact @ w2[e].T + bias) * weight)
        for v, fn in VARIANTS.items():
            outs[v].index_add_(0, rows, (fn(quant) @ w2[e].T + bias) * weight)
    return {v: float((out - ref).norm() / ref.norm()) for v, out in outs.items()}


def main(argv: list[str] | None = None) -> int:
    """Print (and optionally save) one row per shape: the layer's error under each GEMM2-input variant."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["deepseek-v3", "gpt-oss-120b"])
    p.add_argument("--experts", type=int, default=16, help="experts kept per shape (default 16)")
    p.add_argument("--tokens", type=int, default=192)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--csv", help="also write the rows here")
    args = p.parse_args(argv)
    if args.experts < 1 or args.tokens < 1:
        p.error(f"--experts {args.experts} / --tokens {args.tokens}: both must be positive")
    rows = []
    print(f"{'shape':26s}" + "".join(f"{v:>12s}" for v in VARIANTS))
    for name in args.shapes:
        try:
            errs = layer_errors(name, args.experts, args.tokens, args.seed)
        except SpecError as exc:
            p.error(str(exc))
        rows.append({"shape": name, "experts": args.experts, "tokens": args.tokens, "seed": args.seed, **errs})
        print(f"{name:26s}" + "".join(f"{errs[v]:12.4e}" for v in VARIANTS), flush=True)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
