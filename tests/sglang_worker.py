"""One rank of a 2-rank SGLang MoE check on the CPU (launched by tests/sglang_cases.py).

    python sglang_worker.py MODE SCHEME RANK WORLD PORT SEED

MODE tp_ep: --tp 2 --ep-size 2, --moe-a2a-backend none, ATOM_USE_FLYDSL=1. Every rank sees
the same tokens; a layer without reduce_results returns this rank's share (the reference
over its local experts, from SGLang's placement), SGLang's own post_experts_all_reduce of
it and a layer with reduce_results both equal the full reference.
MODE dp_ep: --tp 2 --ep-size 2 --enable-dp-attention --dp 2 --moe-a2a-backend megamoe,
ATOM_USE_FLYDSL_FUSED=1. Tokens differ per rank; MegaMoE dispatches and combines, each
rank's output equals the full reference for its tokens, and SGLang's post-experts
reduction leaves it alone (no double counting).
Prints "RANK r OK" on success, after tearing SGLang's groups down; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys

mode, scheme, rank, world, port, seed = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
os.environ["ATOM_USE_FLYDSL_FUSED" if mode.startswith("dp_ep") else "ATOM_USE_FLYDSL"] = "1"
# SCHEME a8w4: the MXFP4 (gpt-oss style) checkpoint with ATOM_MOE_MXFP4_ACT=fp8
ckpt = "mxfp4" if scheme == "a8w4" else scheme
os.environ["ATOM_MOE_MXFP4_ACT"] = "fp8" if scheme == "a8w4" else "bf16"
# MODE limit (WORLD 1): --chunked-prefill-size 4194304 at H=7168 must fail naming the largest safe value.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

import sglang_common as c  # noqa: E402


def start(dp: bool) -> None:
    """SGLang's runtime for this rank; megamoe's server-arg check wants a GPU, so on the CPU we set the flag."""
    if not dp:
        return c.start_runtime(rank, world, port, chunked=256)
    try:
        c.start_runtime(rank, world, port, dp=True, a2a="megamoe", chunked=256)
    except ValueError as exc:  # "--moe-a2a-backend megamoe needs a CUDA SM90 GPU ..." (CPU machine)
        assert "megamoe" in str(exc), exc
        c.start_runtime(rank, world, port, dp=True, a2a="none", chunked=256)
        from sglang.srt.layers.moe.utils import MoeA2ABackend
        from sglang.srt.runtime_context import get_flags

        get_flags().moe.a2a_backend = MoeA2ABackend.MEGAMOE


def check_limit() -> None:
    """Building a layer whose buffers pass int32 fails with the largest safe --chunked-prefill-size."""
    from atom_moe.spec import MoESpec
    from engine_common import check_limit_error

    # the Triton experts' workspace passes int32 there: combine counters [T*H/32] int32 and GEMM2's
    # input [T*k, I] (the fp32 partials are int64-indexed and exempt, see ep/buffers.INT64_INDEXED)
    c.start_runtime(rank, world, port, chunked=2**22)
    os.environ["TRITON_INTERPRET"] = "1"
    layer = c.build(scheme, hidden_size=7168)
    spec = MoESpec(hidden_size=7168, intermediate_size=c.INTER[scheme], num_experts=c.E, top_k=c.K)
    check_limit_error(lambda: c.process(layer), "--chunked-prefill-size", 4194304, spec, 1, transport="local",
                      experts_backend="triton")


def main_shared(dp: bool) -> None:
    """Fused shared experts over `world` ranks (modes tp_ep_shared, dp_ep_shared).

    tp_ep_shared: --moe-a2a-backend none; every rank holds the shared expert (expert E) and sees every
    token, SGLang's DeepSeek model scales the shared weight by 1/EP (its fused_shared_experts_scaling_factor),
    each rank's output is its share, SGLang's all-reduce completes it.
    dp_ep_shared: megamoe; SGLang numbers E + W slots rank-major (E/W routed + 1 shared per rank) and points
    each token's shared column at its own rank's slot; MegaMoE returns every token complete.
    Both: every element against the routed reference plus the shared expert on its own, and the same call
    with the shared weight at 0.4x must fail that check.
    """
    start(dp)
    from sglang.srt.layers.moe.utils import post_experts_all_reduce

    from engine_common import assert_matches

    ckpt_experts = c.E + 1  # the checkpoint's shared expert is expert E
    layer = c.build(scheme, num_experts=c.E + (world if dp else 1), num_fused_shared_experts=1, top_k=c.K + 1,
                    routed_scaling_factor=c.RSF)
    tensors, ref = c.checkpoint(scheme, torch.Generator().manual_seed(seed), num_experts=ckpt_experts)
    assert c.load(layer, scheme, tensors, num_experts=ckpt_experts) > 0
    c.process(layer)
    plan = layer.atom_moe.plan
    per = c.E // world
    if dp:  # per-rank slots: ordinary experts to us, this rank's block of E/W + 1
        assert plan.fused and plan.spec.shared_experts == 0 and plan.spec.num_experts == c.E + world, plan.spec
        assert plan.spec.local_experts == tuple(range(rank * (per + 1), (rank + 1) * (per + 1))), plan.spec
    else:
        assert not plan.fused and plan.spec.shared_experts == 1 and plan.spec.num_experts == c.E + 1, plan.spec
        assert plan.spec.local_experts == tuple(range(rank * per, (rank + 1) * per)) + (c.E,), plan.spec
    layer.dispatcher.dispatch = layer.dispatcher.combine = None  # SGLang's dispatcher must not run

    tok = torch.Generator().manual_seed(seed * 31 + (rank if dp else 0) + 1)  # DP: tokens differ per rank
    T = 160 + (7 * rank if dp else 0)
    x = torch.randn(T, c.H, generator=tok).bfloat16()
    logits = torch.randn(T, c.E, generator=tok)
    if dp:
        w, ids, ref_w, ref_ids = c.per_rank_shared_topk(x, logits, c.RSF)
        assert (ids[:, -1] == rank * (per + 1) + per).all()  # the shared column names this rank's slot
    else:
        w, ids = c.shared_topk("biased", x, logits, c.RSF)
        w[:, -1] *= 1.0 / world  # DeepseekV2MoE: fused_shared_experts_scaling_factor = 1 / moe_ep_size
        ref_w, ref_ids = w.clone(), ids.clone()
        ref_w[:, -1] *= world  # the reference counts the shared expert once, on the full weight
    full = c.expected_shared(scheme, x, ref_w, ref_ids, ref, c.RSF)
    for planted in (False, True):
        wp = w.clone()
        if planted:
            wp[:, -1] *= 0.4
        out = layer.forward(x, c.topk_output(wp.contiguous(), ids, logits))
        if not dp:
            out = post_experts_all_reduce(out.clone())
        try:
            assert_matches(out, full)
        except AssertionError:
            assert planted, "the shared expert's output differs from the reference"
        else:
            assert not planted, "a 0.4x shared weight passed the check"


def main() -> None:
    load_plugins()
    if mode == "limit":
        return check_limit()
    if mode.endswith("_shared"):
        return main_shared(mode.startswith("dp"))
    dp = mode == "dp_ep"
    start(dp)
    from sglang.srt.layers.moe.utils import (get_moe_a2a_backend, is_moe_input_scattered_across_dp_ranks,
                                             post_experts_all_reduce, post_experts_output_is_complete)

    assert get_moe_a2a_backend().is_megamoe() == dp and is_moe_input_scattered_across_dp_ranks() == dp
    per = c.E // world
    tensors, ref = c.checkpoint(ckpt, torch.Generator().manual_seed(seed))  # same weights on every rank
    layers = {}
    for reduce in (False, True):
        layer = c.build(ckpt, reduce_results=reduce)
        assert c.load(layer, ckpt, tensors) > 0
        c.process(layer)
        state = layer.atom_moe
        if ckpt == "mxfp4":
            assert state.plan.spec.scheme.value == ("a8w4" if scheme == "a8w4" else "a16w4"), state.plan.spec
        # local experts come from SGLang's placement: E/world contiguous per rank
        assert state.plan.spec.local_experts == tuple(range(rank * per, (rank + 1) * per)), state.plan.spec
        assert state.weights.num_local_experts == per and state.plan.fused == dp
        layer.dispatcher.dispatch = layer.dispatcher.combine = None  # SGLang's dispatcher must not run
        layers[reduce] = layer

    tok = torch.Generator().manual_seed(seed * 31 + (rank if dp else 0) + 1)  # DP: tokens differ per rank
    T = 23 + (5 * rank if dp else 0)
    x = torch.randn(T, c.H, generator=tok).bfloat16()
    logits = torch.randn(T, c.E, generator=tok)
    w, ids = c.route(logits)
    ids[-1] = c.E  # a padded graph row
    full = c.expected(scheme, x, w, ids, ref)
    out = layers[False].forward(x, c.topk_output(w, ids, logits))
    if dp:
        c.assert_matches(out, full)  # MegaMoE combined every expert's share
        assert post_experts_output_is_complete(is_tp_path=False) and post_experts_output_is_complete(is_tp_path=True)
        assert torch.equal(post_experts_all_reduce(out.clone()), out)  # SGLang sums nothing again
    else:
        c.assert_matches(out, c.expected(scheme, x, w, ids, ref, experts=range(rank * per, (rank + 1) * per)))
        assert not post_experts_output_is_complete(is_tp_path=False)
        c.assert_matches(post_experts_all_reduce(out.clone()), full)  # SGLang's own reduction completes it
        c.assert_matches(layers[True].forward(x, c.topk_output(w, ids, logits)), full)
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))
    if dp:  # under megamoe SGLang's own path would be summed wrongly: an unsupported layer stops start-up
        layer = c.build("bf16", params_dtype=torch.float16)
        try:
            c.process(layer)
        except RuntimeError as exc:
            assert "cannot run" in str(exc) and "float16" in str(exc), exc
        else:
            raise AssertionError("an unsupported layer under fused megamoe was accepted")


if __name__ == "__main__":
    main()
    c.stop_runtime()  # OK means the teardown finished too
    print(f"RANK {rank} OK", flush=True)
