"""MegaMoE on CUDA with the Triton experts: local path, graph capture + replay, no host syncs, flat memory.

The NCCL all-to-all path runs in spawned ranks (tests/ep_worker.py gpu_graph): 1 rank on a
single GPU, 2 ranks where two GPUs exist.
"""

from __future__ import annotations

import pytest
import torch

from atom_moe.ep import MegaMoE, buffer_sizes
from atom_moe.reference import ReferenceWeights, reference_moe
from atom_moe.spec import MoESpec
from atom_moe.tools.synthetic import random_layer, random_tokens
from atom_moe.weights import prepare_stacked

from test_ep_multiproc import assert_all_passed, run_ranks

H, I, E, K, C = 256, 128, 8, 2, 64
TOL = 1e-2


def small_spec(scheme: str) -> MoESpec:
    return MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme=scheme)


def cuda_layer(spec: MoESpec, seed: int):
    raw = random_layer(spec, generator=torch.Generator().manual_seed(seed))
    prepared = prepare_stacked(spec, raw.w13, raw.w2, layout="separated", device="cuda")
    return prepared, ReferenceWeights.from_prepared(prepared)


def check(out, x, w, ids, ref, spec):
    act_quant = spec.scheme if spec.scheme.fp8_activations else None
    expect = reference_moe(x, w, ids, ref, spec.activation, act_quant=act_quant)
    assert out.shape == expect.shape and out.dtype == x.dtype and torch.isfinite(out).all()
    scale, err = expect.norm(), (out.float() - expect).norm()
    assert (err <= TOL * scale) if scale > 0 else err == 0, f"rel err {err / scale}"


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_local_graph_replays_sync_free(scheme, seed):
    spec = small_spec(scheme)
    prepared, ref = cuda_layer(spec, seed)
    op = MegaMoE(spec, None, max_tokens_per_rank=C, experts_backend="triton", device="cuda")
    assert op.transport_name == "local" and op.experts_backend == "triton"
    assert op.allocated_bytes() == sum(buffer_sizes(spec, 1, C, experts_backend="triton").values())
    for case in op.warmup(prepared, seed=seed):
        check(case.out, case.x, case.topk_weights, case.topk_ids, ref, spec)
    g = torch.Generator().manual_seed(seed)
    T = C - 5
    x_s = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    w_s = torch.empty(T, K, device="cuda")
    ids_s = torch.empty(T, K, dtype=torch.int64, device="cuda")
    x, w, ids = random_tokens(spec, T, generator=g, device="cuda")
    x_s.copy_(x), w_s.copy_(w), ids_s.copy_(ids)
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = op.forward(x_s, w_s, ids_s)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    check(eager, x, w, ids, ref, spec)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = op.forward(x_s, w_s, ids_s)
    for i in range(5):
        x, w, ids = random_tokens(spec, T, generator=g, device="cuda", skew=1.5 * i)
        if i == 4:
            ids[:, :] = 3  # every token to one expert
        x_s.copy_(x), w_s.copy_(w), ids_s.copy_(ids)
        graph.replay()
        check(out_s, x, w, ids, ref, spec)
    op.close()


@pytest.mark.gpu
def test_memory_flat_over_many_layers(seed):
    """1000 calls over 61 bound layers: allocated bytes after the first round equal those at the end."""
    spec = MoESpec.create(hidden_size=128, intermediate_size=64, num_experts=8, top_k=2)
    layers = [cuda_layer(spec, seed + i)[0] for i in range(61)]
    op = MegaMoE(spec, None, max_tokens_per_rank=16, experts_backend="triton", device="cuda")
    x, w, ids = random_tokens(spec, 16, generator=torch.Generator().manual_seed(seed), device="cuda")
    for i in range(61):
        op(x, w, ids, layers[i]).sum()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for i in range(1000):
        y = op(x, w, ids, layers[i % 61])
    torch.cuda.synchronize()
    del y
    assert torch.cuda.memory_allocated() <= before, (before, torch.cuda.memory_allocated())
    op.close()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_nccl_transport_graph(world, seed):
    """The torch transport over NCCL: warm-up, sync-free eager call, graph capture, replays with new routing."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    assert_all_passed(run_ranks("gpu_graph", world, seed, timeout=300))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_symm_transport_graph(world, seed):
    """The symm transport over torch symmetric memory: routing cases, mixed combine modes, graph replays,
    flat memory, and a teardown that finishes (the launcher's timeout fails a hang)."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    runs = run_ranks("gpu_symm", world, seed, timeout=300)
    assert_all_passed(runs)
    for rc, out, _ in runs:
        assert "DONE rank=" in out
