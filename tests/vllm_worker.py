"""One rank of a 2-rank vLLM MoE check on the CPU (launched by tests/vllm_cases.py).

    python vllm_worker.py MODE SCHEME RANK WORLD PORT SEED

SCHEME is bf16, fp8, mxfp4 (gpt-oss style, a16w4) or a8w4 (that checkpoint with
ATOM_MOE_MXFP4_ACT=fp8); dp_ep also takes dsv4_a8w4 (DeepSeek-V4's fp4 experts through vLLM's
Mxfp4MoEMethod, clamped SiLU, with ATOM_MOE_MXFP4_ACT=fp8).

MODE tp_ep: TP=WORLD with expert parallelism, DP=1 (ATOM_USE_FLYDSL=1). Every rank gets
the same tokens; its share (our apply) must equal the reference over its local experts,
and vLLM's MoERunner output (after vLLM's all-reduce) the full reference.
MODE dp_ep: DP=WORLD attention + EP=WORLD with ATOM_USE_FLYDSL_FUSED=1. Each rank has
its own tokens; MegaMoE dispatches and combines, vLLM must not, and each rank's output
must equal the full reference for its tokens.
MODE dp_ep_limit: as dp_ep with --max-num-batched-tokens too large for int32 buffers at
H=7168: building the layer must raise LimitError naming the largest safe value.
MODE eplb / eplb_dp: as tp_ep / dp_ep with vLLM's EPLB on (2 redundant experts): vLLM's factory, loader
(initial physical placement), router (logical -> physical replica, load recorded into expert_load_view)
and rearrange_expert_weights_inplace over the EP group move our tensors mid-run; outputs must match the
reference before and after. vLLM refuses EPLB off CUDA in ParallelConfig and maps ids only in a CUDA
Triton kernel: here the flag is set after validation and the kernel's rule runs as torch ops
(eplb_map_twin). MODE eplb_plant: eplb with the planted bug that get_expert_weights lists vLLM's
(released) parameters instead of ours: the forward after the rearrangement fails.
MODE dp_ep_switch: as dp_ep with ATOM_MOE_DECODE_TOKENS=8: the layer holds a decode and a
prefill MegaMoE; steps whose DP-wide largest count (vLLM's forward context) is <= 8 run the
decode op, larger ones the prefill op, whatever this rank's own count; every output equals the
full reference; ranks whose views of the DP counts differ raise MegaMoEError on both ranks.
Prints "RANK r OK" on success; any failure raises (non-zero exit).
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys

faulthandler.register(signal.SIGUSR1, all_threads=True)  # engine_common.run_ranks asks a hung rank for its stacks
mode, scheme, rank, world, port, seed = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
for name in ("ATOM_USE_FLYDSL", "ATOM_USE_FLYDSL_FUSED"):
    os.environ.pop(name, None)
os.environ["ATOM_USE_FLYDSL_FUSED" if mode.startswith("dp_ep") or mode == "eplb_dp" else "ATOM_USE_FLYDSL"] = "1"
if mode == "dp_ep_switch":
    os.environ["ATOM_MOE_DECODE_TOKENS"] = "8"
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
ckpt = {"a8w4": "mxfp4", "dsv4_a8w4": "dsv4"}.get(scheme, scheme)  # the checkpoint; a8w4 is our scheme, by flag
os.environ["ATOM_MOE_MXFP4_ACT"] = "fp8" if scheme.endswith("a8w4") else "bf16"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

import vllm_cases as cases  # noqa: E402
from engine_common import random_placement, record_instance_calls  # noqa: E402
from atom_moe.plugins.vllm.method import AtomMoEMethod  # noqa: E402


REDUNDANT = 2


def eplb_map_twin(topk_ids, expert_load_view, logical_to_physical_map, logical_replica_count, record_enabled,
                  num_unpadded_tokens=None):
    """vLLM's CUDA kernel _eplb_map_and_record_i32_kernel as torch ops: replica (token * 2654435769 mod 2^32)
    mod count of each valid logical id; the load of unpadded pairs counted per physical slot."""
    ids = topk_ids.long()
    T, k = ids.shape
    valid = (ids >= 0) & (ids < logical_replica_count.shape[0])
    safe = torch.where(valid, ids, 0)
    count = logical_replica_count[safe].clamp(min=1)
    token = torch.arange(T).unsqueeze(1).expand(T, k)
    replica = ((token * 2654435769) & 0xFFFFFFFF) % count
    phys = torch.where(valid, logical_to_physical_map[safe, replica], -1)
    if bool(record_enabled):
        keep = phys >= 0
        if num_unpadded_tokens is not None:
            keep &= token < int(num_unpadded_tokens)
        expert_load_view.index_add_(0, phys[keep], torch.ones_like(phys[keep], dtype=expert_load_view.dtype))
    return phys.to(topk_ids.dtype)


def tables(p2l: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's [N, X] logical_to_physical_map (-1 padded) and [N] logical_replica_count of a placement."""
    l2p = torch.full((cases.E, REDUNDANT + 1), -1, dtype=torch.int64)
    count = torch.zeros(cases.E, dtype=torch.int64)
    for slot, e in enumerate(p2l):
        l2p[e, count[e]] = slot
        count[e] += 1
    return l2p, count


def eplb(cfg) -> None:
    """vLLM's EPLB around our layer: its placement, router mapping and load counters, its rearrangement."""
    import inspect

    from vllm.distributed import get_ep_group
    from vllm.distributed.eplb import rebalance_execute
    from vllm.model_executor.layers.fused_moe.router import base_router

    from atom_moe.ep.rebalance import slot_tensors
    from atom_moe.weights import prepare_stacked

    dp = mode == "eplb_dp"
    base_router.eplb_map_to_physical_and_record = eplb_map_twin  # vLLM's CUDA kernel, as torch ops
    P = cases.E + REDUNDANT
    per = P // world
    runner = cases.build(scheme, cfg, enable_eplb=True, num_redundant_experts=REDUNDANT)
    experts = runner.routed_experts
    method = experts.quant_method
    assert isinstance(method, AtomMoEMethod), type(method)  # our path took the EPLB layer
    spec = method.plan.spec
    assert spec.num_experts == P and spec.local_experts == tuple(range(rank * per, (rank + 1) * per)), spec
    assert method.plan.fused == dp
    gen = torch.Generator().manual_seed(seed)  # same weights and placements on every rank
    tensors, ref = cases.hf_tensors(scheme, gen)
    cases.load(runner, scheme, tensors)  # vLLM's expert mapping fills the initial placement: slot s holds s % N
    cases.process(runner)
    if mode == "eplb_plant":  # the planted bug: vLLM's rearrangement is handed tensors that are not ours
        experts.get_expert_weights = lambda: [torch.zeros(per, 8)]
    # what vLLM's MixtureOfExperts.set_eplb_state and EplbState.add_model do for one layer
    listed = [w.view(torch.uint8) if w.element_size() == 1 else w for w in runner.get_expert_weights()]
    p2l = [s % cases.E for s in range(P)]
    l2p, count = (t.unsqueeze(0).contiguous() for t in tables(p2l))
    load = torch.zeros(1, P, dtype=torch.int32)
    runner.set_eplb_state(0, load, l2p, count)
    state = runner.router.eplb_state
    state.should_record_tensor = torch.ones((), dtype=torch.bool)
    state.num_unpadded_tokens_tensors = [torch.tensor(0, dtype=torch.int32)]

    def check(step: int) -> None:
        tok = torch.Generator().manual_seed(seed * 31 + 7 * step + (rank if dp else 0))
        T = 23 + (5 * rank if dp else 0)
        x = torch.randn(T, cases.H, generator=tok).bfloat16()
        logits = torch.randn(T, cases.E, generator=tok)
        state.num_unpadded_tokens_tensors[0].fill_(T)
        load.zero_()
        across = torch.tensor([23 + 5 * r for r in range(world)]) if dp else None
        with set_forward_context(None, cfg, num_tokens=T, num_tokens_across_dp=across):
            out = runner.forward(x, logits)
        cases.assert_matches(out, cases.expected(scheme, x, logits, ref))
        w, ids = cases.route(logits)
        placed = torch.tensor(p2l)
        got = torch.bincount(placed[eplb_map_twin(ids, torch.zeros(P, dtype=torch.int32), l2p[0], count[0],
                                                  torch.zeros((), dtype=torch.bool))].view(-1), minlength=cases.E)
        assert torch.equal(got, torch.bincount(ids.view(-1), minlength=cases.E))  # replicas of the right experts
        assert int(load.sum()) == ids.numel(), load  # vLLM's load counters were filled by its router
        want = prepare_stacked(spec, *stacked(tensors, p2l), layout="separated")
        same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                for a, b in zip(slot_tensors(method.weights), slot_tensors(want))]
        assert all(same), f"step {step}: our slot tensors differ from the placement {p2l}: {same}"

    check(0)
    new = random_placement(cases.E, REDUNDANT, gen)
    ptrs = [t.data_ptr() for t in slot_tensors(method.weights)]
    old = torch.tensor([p2l])
    buffers = [torch.empty_like(w) for w in listed]
    kwargs = dict(old_global_expert_indices=old, new_global_expert_indices=torch.tensor([new]),
                  expert_weights=[listed], expert_buffer=buffers, ep_group=get_ep_group().device_group)
    if "communicator" in inspect.signature(rebalance_execute.rearrange_expert_weights_inplace).parameters:
        from vllm.distributed.eplb.eplb_communicator import create_eplb_communicator

        # "torch_nccl" on CPU tensors: isend/irecv over the EP group's gloo CPU group (vLLM's docstring); its
        # "torch_gloo" stages through CUDA streams, which a CPU torch lacks
        kwargs["communicator"] = create_eplb_communicator(group_coordinator=get_ep_group(), backend="torch_nccl",
                                                          expert_weights=[listed], expert_buffer=buffers)
    rebalance_execute.rearrange_expert_weights_inplace(**kwargs)
    new_l2p, new_count = tables(new)  # EplbState.rearrange: the maps are rewritten in place
    l2p[0].copy_(new_l2p), count[0].copy_(new_count)
    p2l[:] = new
    assert [t.data_ptr() for t in slot_tensors(method.weights)] == ptrs
    check(1)


def stacked(tensors: dict, p2l: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 checkpoint's w13 [P, 2I, H] (gate rows, then up) and w2 [P, H, I] laid out by slot."""
    assert scheme == "bf16", "the slot-content check reads bf16 checkpoint tensors"
    w13 = torch.stack([torch.cat([tensors[f"{e}.gate_proj.weight"], tensors[f"{e}.up_proj.weight"]]) for e in p2l])
    return w13, torch.stack([tensors[f"{e}.down_proj.weight"] for e in p2l])


def main_shared() -> None:
    """Fused shared experts (modes tp_shared, ep_shared): TP=WORLD, without or with EP.

    tp_shared: every rank holds every expert's I/TP shard, the shared expert E too; each rank's apply is
    its shard's partial sum, vLLM's all-reduce completes it: every element against the routed reference
    plus the shared expert on its own. ep_shared: vLLM's expert map has no shared entry without AITER,
    so the layer keeps vLLM's method, with one warning naming why.
    """
    import logging

    import pytest

    from vllm.distributed import tensor_model_parallel_all_reduce

    pc = ParallelConfig(tensor_parallel_size=world, enable_expert_parallel=mode == "ep_shared")
    cfg = cases.vllm_config(ckpt, Path(tempfile.mkdtemp()), parallel_config=pc)
    with set_current_vllm_config(cfg):
        init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
        initialize_model_parallel(world, 1)
        mp = pytest.MonkeyPatch()
        if mode == "ep_shared":
            records = []
            handler = logging.Handler()
            handler.emit = records.append
            logging.getLogger("vllm.atom_moe").addHandler(handler)
            runner = cases.shared_runner(ckpt, cfg, mp, False)
            assert not isinstance(runner.routed_experts.quant_method, AtomMoEMethod)
            msgs = [r.getMessage() for r in records if "keep vLLM's own path" in r.getMessage()]
            assert len(msgs) == 1 and "fused shared experts: vLLM's expert map has" in msgs[0], msgs
            # No collective follows the build here: without this barrier rank 0 (the writer of vLLM's shm
            # broadcaster) can exit while rank 1 still waits for its READY message.
            torch.distributed.barrier()
            print(f"RANK {rank} OK", flush=True)
            return
        runner = cases.shared_runner(ckpt, cfg, mp, True)
        experts = runner.routed_experts
        method = experts.quant_method
        assert isinstance(method, AtomMoEMethod), type(method)
        spec = method.plan.spec
        assert spec.local_experts == tuple(range(cases.E + 1)) and spec.shared_experts == 1
        assert spec.intermediate_size == cases.INTER[ckpt] // world
        tensors, ref = cases.hf_tensors(ckpt, torch.Generator().manual_seed(seed), num_experts=cases.E + 1)
        cases.load(runner, ckpt, tensors)
        cases.process(runner)
        tok = torch.Generator().manual_seed(seed * 31 + 1)  # the same tokens on every rank
        x = torch.randn(160, cases.H, generator=tok).bfloat16()
        logits = torch.randn(160, cases.E, generator=tok)
        w, ids = cases.shared_routing(x, logits, True, mp)
        want = cases.expected_shared(ckpt, x, w, ids, ref)
        cases.assert_matches(tensor_model_parallel_all_reduce(method.apply(experts, x, w, ids)), want)
        planted = torch.cat([w[:, :-1], 0.4 * w[:, -1:]], dim=1).contiguous()
        with pytest.raises(AssertionError, match="elements off"):
            cases.assert_matches(tensor_model_parallel_all_reduce(method.apply(experts, x, planted, ids)), want)
        mp.undo()
    print(f"RANK {rank} OK", flush=True)


def main() -> None:
    load_general_plugins()
    if mode.endswith("_shared"):
        return main_shared()
    dp = mode.startswith("dp") or mode == "eplb_dp"
    if dp:
        pc = ParallelConfig(data_parallel_size=world, data_parallel_rank=rank, data_parallel_size_local=world,
                            data_parallel_master_ip="127.0.0.1", data_parallel_master_port=port,
                            enable_expert_parallel=True)
    else:
        pc = ParallelConfig(tensor_parallel_size=world, enable_expert_parallel=True)
    cfg = cases.vllm_config(ckpt, Path(tempfile.mkdtemp()), parallel_config=pc)
    if dp:  # vLLM's engine hands every DP rank one config; here each process builds its own: agree on ports
        cfg.parallel_config._data_parallel_master_port_list = [port + 4, port + 3, port + 2, port + 1]
        cfg.parallel_config.data_parallel_master_port = port
    if mode == "dp_ep_limit":
        cfg.scheduler_config.max_num_batched_tokens = 2**17
    if mode.startswith("eplb"):  # vLLM refuses EPLB off CUDA when validating; the layers read these fields
        cfg.parallel_config.enable_eplb = True
        cfg.parallel_config.eplb_config.num_redundant_experts = REDUNDANT
    with set_current_vllm_config(cfg):
        if dp:
            init_distributed_environment(1, 0, "env://", 0, backend="gloo")  # vLLM offsets rank/port for DP
            initialize_model_parallel(1, 1)
        else:
            init_distributed_environment(world, rank, f"tcp://127.0.0.1:{port}", rank, backend="gloo")
            initialize_model_parallel(world, 1)
        if mode == "dp_ep_limit":
            check_limit(cfg)
            print(f"RANK {rank} OK", flush=True)
            return
        if mode.startswith("eplb"):
            eplb(cfg)
            print(f"RANK {rank} OK", flush=True)
            return
        v4 = ckpt == "dsv4"
        runner = cases.build_v4(cfg) if v4 else cases.build(ckpt, cfg)
        experts = runner.routed_experts
        method = experts.quant_method
        assert isinstance(method, AtomMoEMethod), type(method)
        spec = method.plan.spec
        # local experts come from vLLM's expert map (linear placement: E/world contiguous per rank)
        per = cases.E // world
        assert spec.local_experts == tuple(range(rank * per, (rank + 1) * per)), spec.local_experts
        assert spec.placement.world_size == world and spec.placement.rank == rank
        assert method.plan.fused == mode.startswith("dp_ep")
        if ckpt in ("mxfp4", "dsv4"):
            assert spec.scheme is (cases.Scheme.A8W4 if scheme.endswith("a8w4") else cases.Scheme.A16W4)
        assert not runner.do_naive_dispatch_combine  # vLLM must not dispatch around MegaMoE

        gen = torch.Generator().manual_seed(seed)  # same weights on every rank
        if v4:  # vLLM's per-expert loader takes this rank's experts and skips the others
            tensors, ref = cases.v4_checkpoint(gen, 30.0)
            assert len(list(runner.load_weights(iter(tensors.items())))) == len(tensors) // world
        else:
            tensors, ref = cases.hf_tensors(ckpt, gen)
            cases.load(runner, ckpt, tensors, ep_range=(rank * per, (rank + 1) * per))
        cases.process(runner)
        assert experts.atom_moe_weights.num_local_experts == per
        if mode == "dp_ep_switch":
            switch_steps(runner, method, cfg, ref)
            print(f"RANK {rank} OK", flush=True)
            return

        tok = torch.Generator().manual_seed(seed * 31 + (rank if dp else 0) + 1)  # DP: tokens differ per rank
        T = 23 + (5 * rank if dp else 0)
        x = torch.randn(T, cases.H, generator=tok).bfloat16()
        logits = torch.randn(T, cases.E, generator=tok)
        if mode == "tp_ep":
            w, ids = cases.route(logits)
            share = method.apply(experts, x, w.contiguous(), ids.to(torch.int32).contiguous())
            cases.assert_matches(share, cases.expected(scheme, x, logits, ref, experts=spec.local_experts))
        num_tokens_across_dp = torch.tensor([23 + 5 * r for r in range(world)]) if dp else None
        with set_forward_context(None, cfg, num_tokens=T, num_tokens_across_dp=num_tokens_across_dp):
            out = runner.forward(x, logits)
        if v4:  # every element of this rank's tokens against the clamped layer, and the clamp is live
            w, ids = cases.route(logits)
            cases.assert_matches(out, cases.v4_expected(x, w, ids, ref, spec.scheme))
            try:
                cases.assert_matches(out, cases.v4_expected(x, w, ids, ref, spec.scheme, cases.Activation()))
            except AssertionError:
                pass
            else:
                raise AssertionError("the unclamped layer matches too: the clamp is not live on these data")
        else:
            cases.assert_matches(out, cases.expected(scheme, x, logits, ref))
    print(f"RANK {rank} OK", flush=True)


def switch_steps(runner, method, cfg, ref) -> None:
    """Decode and prefill steps through vLLM's MoERunner; the op is picked by the DP-wide count."""
    from atom_moe.ep import MegaMoEError
    from atom_moe.plugins.vllm.method import dp_max_tokens

    pair = method._op
    ran = record_instance_calls(pair, 8, method.plan.tokens)
    tok = torch.Generator().manual_seed(seed * 131 + rank)
    # (tokens per DP rank, the op every rank must run): a peer's count alone can move both to prefill
    steps = (((3, 5), "decode"), ((8, 8), "decode"), ((2, 20), "prefill"), ((23, 28), "prefill"), ((1, 6), "decode"))
    for counts, want in steps:
        T = counts[rank]
        x = torch.randn(T, cases.H, generator=tok).bfloat16()
        logits = torch.randn(T, cases.E, generator=tok)
        with set_forward_context(None, cfg, num_tokens=T, num_tokens_across_dp=torch.tensor(counts)):
            assert dp_max_tokens() == max(counts)
            out = runner.forward(x, logits)
        assert ran[-1] == want, (counts, ran)
        cases.assert_matches(out, cases.expected(scheme, x, logits, ref))
    assert pair.decode._weights is pair.prefill._weights is runner.routed_experts.atom_moe_weights  # one copy
    # an engine whose ranks disagree on the DP counts: rank 0 picks decode, rank 1 prefill; both raise
    counts, view = (3, 4), ((3, 4), (20, 4))[rank]
    x = torch.randn(counts[rank], cases.H, generator=tok).bfloat16()
    logits = torch.randn(counts[rank], cases.E, generator=tok)
    with set_forward_context(None, cfg, num_tokens=counts[rank], num_tokens_across_dp=torch.tensor(view)):
        try:
            runner.forward(x, logits)
        except MegaMoEError as exc:
            assert "different max_tokens_per_rank" in str(exc), exc
        else:
            raise AssertionError("ranks that picked different MegaMoE ops were not caught")
    with set_forward_context(None, cfg, num_tokens=counts[rank], num_tokens_across_dp=torch.tensor(counts)):
        out = runner.forward(x, logits)  # the next step runs normally
    cases.assert_matches(out, cases.expected(scheme, x, logits, ref))


def check_limit(cfg) -> None:
    """Construction fails with the largest safe --max-num-batched-tokens, which does fit."""
    from engine_common import check_limit_error

    spec = cases.MoESpec(hidden_size=7168, intermediate_size=cases.INTER[scheme], num_experts=cases.E, top_k=cases.K)
    check_limit_error(lambda: cases.build(scheme, cfg, hidden_size=7168), "--max-num-batched-tokens", 131072, spec,
                      world, transport="torch")


if __name__ == "__main__":
    main()
