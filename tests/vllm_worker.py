"""One rank of a 2-rank vLLM MoE check on the CPU (launched by tests/vllm_cases.py).

    python vllm_worker.py MODE SCHEME RANK WORLD PORT SEED

SCHEME is bf16, fp8, mxfp4 (gpt-oss style, a16w4) or a8w4 (that checkpoint with
ATOM_MOE_MXFP4_ACT=fp8).

MODE tp_ep: TP=WORLD with expert parallelism, DP=1 (ATOM_USE_FLYDSL=1). Every rank gets
the same tokens; its share (our apply) must equal the reference over its local experts,
and vLLM's MoERunner output (after vLLM's all-reduce) the full reference.
MODE dp_ep: DP=WORLD attention + EP=WORLD with ATOM_USE_FLYDSL_FUSED=1. Each rank has
its own tokens; MegaMoE dispatches and combines, vLLM must not, and each rank's output
must equal the full reference for its tokens.
MODE dp_ep_limit: as dp_ep with --max-num-batched-tokens too large for int32 buffers at
H=7168: building the layer must raise LimitError naming the largest safe value.
Prints "RANK r OK" on success; any failure raises (non-zero exit).
"""

from __future__ import annotations

import os
import sys

mode, scheme, rank, world, port, seed = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
for name in ("ATOM_USE_FLYDSL", "ATOM_USE_FLYDSL_FUSED"):
    os.environ.pop(name, None)
os.environ["ATOM_USE_FLYDSL_FUSED" if mode in ("dp_ep", "dp_ep_limit") else "ATOM_USE_FLYDSL"] = "1"
os.environ["VLLM_TARGET_DEVICE"] = "cpu"
ckpt = "mxfp4" if scheme == "a8w4" else scheme  # the checkpoint; a8w4 is our scheme for it, by flag
os.environ["ATOM_MOE_MXFP4_ACT"] = "fp8" if scheme == "a8w4" else "bf16"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

import vllm_cases as cases  # noqa: E402
from atom_moe.plugins.vllm.method import AtomMoEMethod  # noqa: E402


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
    dp = mode.startswith("dp")
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
        runner = cases.build(ckpt, cfg)
        experts = runner.routed_experts
        method = experts.quant_method
        assert isinstance(method, AtomMoEMethod), type(method)
        spec = method.plan.spec
        # local experts come from vLLM's expert map (linear placement: E/world contiguous per rank)
        per = cases.E // world
        assert spec.local_experts == tuple(range(rank * per, (rank + 1) * per)), spec.local_experts
        assert spec.placement.world_size == world and spec.placement.rank == rank
        assert method.plan.fused == (mode == "dp_ep")
        if ckpt == "mxfp4":
            assert spec.scheme is (cases.Scheme.A8W4 if scheme == "a8w4" else cases.Scheme.A16W4)
        assert not runner.do_naive_dispatch_combine  # vLLM must not dispatch around MegaMoE

        gen = torch.Generator().manual_seed(seed)  # same weights on every rank
        tensors, ref = cases.hf_tensors(ckpt, gen)
        cases.load(runner, ckpt, tensors, ep_range=(rank * per, (rank + 1) * per))
        cases.process(runner)
        assert experts.atom_moe_weights.num_local_experts == per

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
        cases.assert_matches(out, cases.expected(scheme, x, logits, ref))
    print(f"RANK {rank} OK", flush=True)


def check_limit(cfg) -> None:
    """Construction fails with the largest safe --max-num-batched-tokens, which does fit."""
    from engine_common import check_limit_error

    spec = cases.MoESpec(hidden_size=7168, intermediate_size=cases.INTER[scheme], num_experts=cases.E, top_k=cases.K)
    check_limit_error(lambda: cases.build(scheme, cfg, hidden_size=7168), "--max-num-batched-tokens", 131072, spec,
                      world, transport="torch")


if __name__ == "__main__":
    main()
