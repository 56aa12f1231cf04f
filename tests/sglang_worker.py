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
MODE eplb / eplb_dp: as tp_ep / dp_ep with SGLang's EPLB on (--enable-eplb, 2 redundant experts, a random
initial placement): SGLang's top-k maps ids to physical replicas with its tables, our layer runs on the
physical slots, then SGLang's own ExpertLocationUpdater rearranges the experts (weights over gloo P2P,
tables in place) mid-run and the next forward must still equal the reference. MODE eplb_plant: eplb
with the planted bug that our tensors are not exposed to SGLang's rearrangement: the check after it fails.
MODE dp_ep_switch: as dp_ep with ATOM_MOE_DECODE_TOKENS=8: a decode and a prefill MegaMoE per
layer shape; steps whose DP-wide largest count (SGLang's get_dp_global_num_tokens) is <= 8 run
the decode op, larger ones the prefill op, whatever this rank's own count; every output equals
the full reference; ranks whose views of the DP counts differ raise MegaMoEError on both ranks.
Prints "RANK r OK" on success, after tearing SGLang's groups down; any failure raises (non-zero exit).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

faulthandler.register(signal.SIGUSR1, all_threads=True)  # engine_common.run_ranks asks a hung rank for its stacks
mode, scheme, rank, world, port, seed = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
os.environ["ATOM_USE_FLYDSL_FUSED" if mode.startswith("dp_ep") or mode == "eplb_dp" else "ATOM_USE_FLYDSL"] = "1"
os.environ["SGLANG_EXPERT_LOCATION_UPDATER_CANARY"] = "1"  # SGLang checks its own transfer of each slot's map
if mode == "dp_ep_switch":
    os.environ["ATOM_MOE_DECODE_TOKENS"] = "8"
# SCHEME a8w4: the MXFP4 (gpt-oss style) checkpoint with ATOM_MOE_MXFP4_ACT=fp8
ckpt = "mxfp4" if scheme == "a8w4" else scheme
os.environ["ATOM_MOE_MXFP4_ACT"] = "fp8" if scheme == "a8w4" else "bf16"
# MODE limit (WORLD 1): --chunked-prefill-size 4194304 at H=7168 must fail naming the largest safe value.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from sglang.srt.plugins import load_plugins  # noqa: E402

import sglang_common as c  # noqa: E402
from engine_common import random_placement, record_instance_calls  # noqa: E402


def start(dp: bool, **extra) -> None:
    """SGLang's runtime for this rank; megamoe's server-arg check wants a GPU, so on the CPU we set the flag."""
    if not dp:
        return c.start_runtime(rank, world, port, chunked=256, **extra)
    try:
        c.start_runtime(rank, world, port, dp=True, a2a="megamoe", chunked=256, **extra)
    except ValueError as exc:  # "--moe-a2a-backend megamoe needs a CUDA SM90 GPU ..." (CPU machine)
        assert "megamoe" in str(exc), exc
        c.start_runtime(rank, world, port, dp=True, a2a="none", chunked=256, **extra)
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


REDUNDANT = 2


def eplb() -> None:
    """SGLang's EPLB around our layer: its placement, its top-k mapping, its rearrangement mid-run."""
    from sglang.srt.eplb import expert_location as el
    from sglang.srt.eplb.expert_location_dispatch import ExpertLocationDispatchInfo, topk_ids_logical_to_physical
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater
    from sglang.srt.layers.moe.utils import filter_moe_weight_param_global_expert

    from atom_moe.ep.rebalance import slot_tensors
    from atom_moe.plugins.sglang import hooks
    from atom_moe.weights import prepare_stacked

    dp = mode == "eplb_dp"
    # what a server resolves for these flags (arg_groups' handle_eplb_and_dispatch; publish() here does not
    # resolve): static picks with an a2a backend (megamoe), dynamic (rank-invariant) without
    start(dp, enable_eplb=True, ep_num_redundant_experts=REDUNDANT, ep_dispatch_algorithm="static" if dp else "dynamic")
    P = c.E + REDUNDANT
    per = P // world

    def meta(p2l: list[int]):  # SGLang's own tables of a placement (what init_by_mapping builds from a model)
        m = torch.tensor([p2l])
        every = el._compute_logical_to_all_physical_map(m, num_logical_experts=c.E, ep_size=world, moe_ep_rank=rank)
        return el.ExpertLocationMetadata._init_raw(ep_size=world, physical_to_logical_map=m,
                                                   logical_to_all_physical_map=every, moe_ep_rank=rank)

    gen = torch.Generator().manual_seed(seed)  # same placements and weights on every rank
    first = random_placement(c.E, REDUNDANT, gen)
    el.set_global_expert_location_metadata(meta(first), allow_overwrite=True)
    if mode == "eplb_plant":  # the planted bug: SGLang's rearrangement does not see our tensors
        hooks.expose_for_eplb = lambda layer, weights: []
    tensors, ref = c.checkpoint(scheme, gen)
    layer = c.build(scheme, num_experts=P, layer_id=0, reduce_results=not dp)
    assert c.load(layer, scheme, tensors) > 0  # SGLang's loader: each logical expert into all its slots
    c.process(layer)
    state = layer.atom_moe  # our path took the layer (no attribute: SGLang's own path)
    spec = state.plan.spec
    assert spec.num_experts == P and spec.local_experts == tuple(range(rank * per, (rank + 1) * per)), spec
    assert state.plan.fused == dp
    info = ExpertLocationDispatchInfo.init_new(layer_id=0)
    assert info is not None and info.ep_dispatch_algorithm == ("static" if dp else "dynamic"), info

    def check(step: int, p2l: list[int]) -> None:
        tok = torch.Generator().manual_seed(seed * 31 + step * 7 + (rank if dp else 0))
        T = 23 + (5 * rank if dp else 0)
        x = torch.randn(T, c.H, generator=tok).bfloat16()
        logits = torch.randn(T, c.E, generator=tok)
        w, ids = c.route(logits)
        phys = topk_ids_logical_to_physical(ids, info)  # SGLang's top-k mapping, from its live tables
        assert torch.equal(torch.tensor(p2l)[phys.long()], ids.long()), "a replica of another expert"
        out = layer.forward(x, c.topk_output(w, phys, logits))
        c.assert_matches(out, c.expected(scheme, x, w, ids, ref))
        # every local slot holds its logical expert's rows under the current map, bit for bit
        want = prepare_stacked(spec, *_stacked(tensors, p2l), layout="separated")  # gate rows, then up
        same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(slot_tensors(state.weights), slot_tensors(want))]
        assert all(same), f"step {step}: slot tensors differ from the placement {p2l}: {same}"

    check(0, first)
    second = random_placement(c.E, REDUNDANT, gen)
    while second == first:
        second = random_placement(c.E, REDUNDANT, gen)
    listed = [p.data for n, p in layer.named_parameters()  # what the models' get_moe_weights() hand SGLang
              if filter_moe_weight_param_global_expert(n, p, layer.num_local_experts)]
    ptrs = [t.data_ptr() for t in slot_tensors(state.weights)]
    updater = ExpertLocationUpdater()
    updater._first_execution = False  # its first call empties the device cache: torch.cpu has no empty_cache
    updater.update({0: listed}, meta(second), update_layer_ids=[0], nnodes=1, rank=rank)
    assert el.get_global_expert_location_metadata().physical_to_logical_map_cpu[0].tolist() == second
    assert [t.data_ptr() for t in slot_tensors(state.weights)] == ptrs  # moved in place
    check(1, second)


def _stacked(tensors: dict, p2l: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 checkpoint's w13 [P, 2I, H] (gate rows, then up) and w2 [P, H, I] laid out by slot."""
    assert scheme == "bf16", "the slot-content check reads bf16 checkpoint tensors"
    w13 = torch.stack([torch.cat([tensors[f"experts.{e}.gate_proj.weight"], tensors[f"experts.{e}.up_proj.weight"]])
                       for e in p2l])
    w2 = torch.stack([tensors[f"experts.{e}.down_proj.weight"] for e in p2l])
    return w13, w2


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
    if mode.startswith("eplb"):
        return eplb()
    if mode.endswith("_shared"):
        return main_shared(mode.startswith("dp"))
    dp = mode.startswith("dp_ep")
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

    if mode == "dp_ep_switch":
        return switch_steps(layers[False], ref)
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


def switch_steps(layer, ref) -> None:
    """Decode and prefill steps through SGLang's FusedMoE; the op is picked by the DP-wide count."""
    from sglang.srt.layers.dp_attention import set_dp_buffer_len

    from atom_moe.ep import MegaMoEError
    from atom_moe.plugins.sglang.hooks import dp_max_tokens

    state = layer.atom_moe
    pair = state.op
    ran = record_instance_calls(pair, 8, state.plan.tokens)
    tok = torch.Generator().manual_seed(seed * 131 + rank)

    def step(counts, view=None):
        T = counts[rank]
        x = torch.randn(T, c.H, generator=tok).bfloat16()
        logits = torch.randn(T, c.E, generator=tok)
        w, ids = c.route(logits)
        view = list(view or counts)
        set_dp_buffer_len(sum(view), T, False, view)  # what SGLang sets per batch under DP attention
        assert dp_max_tokens() == max(view)
        return layer.forward(x, c.topk_output(w, ids, logits)), c.expected(scheme, x, w, ids, ref)

    # (tokens per DP rank, the op every rank must run): a peer's count alone can move both to prefill
    for counts, want in (((3, 5), "decode"), ((8, 8), "decode"), ((2, 20), "prefill"), ((23, 28), "prefill"),
                         ((1, 6), "decode")):
        out, full = step(counts)
        assert ran[-1] == want, (counts, ran)
        c.assert_matches(out, full)
    assert pair.decode._weights is pair.prefill._weights is state.weights  # one copy of the weights
    # an engine whose ranks disagree on the DP counts: rank 0 picks decode, rank 1 prefill; both raise
    try:
        step((3, 4), ((3, 4), (20, 4))[rank])
    except MegaMoEError as exc:
        assert "different max_tokens_per_rank" in str(exc), exc
    else:
        raise AssertionError("ranks that picked different MegaMoE ops were not caught")
    out, full = step((3, 4))  # the next step runs normally
    c.assert_matches(out, full)


if __name__ == "__main__":
    main()
    c.stop_runtime()  # OK means the teardown finished too
    print(f"RANK {rank} OK", flush=True)
