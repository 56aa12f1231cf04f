"""Programmatic dependent launch (ATOM_MOE_PDL, kernels/common.py): the switch, and on a GPU the same bits as
plain stream order.

With PDL the routing launch and GEMM1 let the next launch start early; GEMM1 and GEMM2 wait for the
launch before them before reading anything it writes, and GEMM2 reads its expert and asks L2 for its
weight tile meanwhile. A misplaced wait shows as a race: wrong or changing bits. The GPU test chains
layers in one CUDA graph (one layer's output is the next one's input) and replays it with new routing,
at T = 1 (sorted and pair blocks), 8 (split-K too), 64 and 512 (the separate combine).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import assert_near_twin, make_layer, make_routing  # noqa: E402

from atom_moe.experts import allocate_workspace, fused_experts  # noqa: E402
from atom_moe.experts_torch import experts_torch  # noqa: E402
from atom_moe.kernels import common  # noqa: E402
from atom_moe.kernels.tuning import heuristic  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def test_the_switch(monkeypatch):
    monkeypatch.delenv("ATOM_MOE_PDL", raising=False)
    assert not common.pdl(torch.device("cpu"))
    monkeypatch.setenv("ATOM_MOE_PDL", "1")
    assert not common.pdl(torch.device("cpu"))  # a CUDA GPU of sm_90 or later only
    if torch.cuda.is_available() and not common.interpreting():
        want = torch.version.hip is None and torch.cuda.get_device_capability() >= (9, 0)
        assert common.pdl(torch.device("cuda")) == want
    monkeypatch.setenv("ATOM_MOE_PDL", "on")
    with pytest.raises(ValueError, match="ATOM_MOE_PDL='on': allowed are 1"):
        common.pdl(torch.device("cpu"))
    assert common.pdl_options(True) == {"launch_pdl": True} and common.pdl_options(False) == {}


def test_launch_flags_are_named_for_benchmark_rows(monkeypatch):
    from atom_moe.experts import launch_flags
    monkeypatch.delenv("ATOM_MOE_PDL", raising=False)
    monkeypatch.delenv("ATOM_MOE_PAIR_BLOCKS", raising=False)
    monkeypatch.delenv("ATOM_MOE_TMA", raising=False)
    monkeypatch.delenv("ATOM_MOE_A8W4_INTER", raising=False)
    monkeypatch.delenv("ATOM_MOE_SWAP", raising=False)
    assert launch_flags() == ""
    monkeypatch.setenv("ATOM_MOE_PDL", "1")
    assert launch_flags() == "ATOM_MOE_PDL=1"
    monkeypatch.setenv("ATOM_MOE_PAIR_BLOCKS", "1")  # the default spelled out: not named
    assert launch_flags() == "ATOM_MOE_PDL=1"
    monkeypatch.setenv("ATOM_MOE_PAIR_BLOCKS", "0")
    assert launch_flags() == "ATOM_MOE_PAIR_BLOCKS=0 ATOM_MOE_PDL=1"
    monkeypatch.setenv("ATOM_MOE_PDL", "0")
    assert launch_flags() == "ATOM_MOE_PAIR_BLOCKS=0"
    monkeypatch.setenv("ATOM_MOE_TMA", "1")
    assert launch_flags() == "ATOM_MOE_PAIR_BLOCKS=0 ATOM_MOE_TMA=1"
    monkeypatch.setenv("ATOM_MOE_A8W4_INTER", "token")  # the default: not named
    assert launch_flags() == "ATOM_MOE_PAIR_BLOCKS=0 ATOM_MOE_TMA=1"
    monkeypatch.setenv("ATOM_MOE_SWAP", "1")
    assert launch_flags() == "ATOM_MOE_PAIR_BLOCKS=0 ATOM_MOE_TMA=1 ATOM_MOE_SWAP=1"
    monkeypatch.setenv("ATOM_MOE_SWAP", "0")  # bf16 unswapped too: away from the default, named
    assert launch_flags() == "ATOM_MOE_PAIR_BLOCKS=0 ATOM_MOE_TMA=1 ATOM_MOE_SWAP=0"
    monkeypatch.setenv("ATOM_MOE_SWAP", "1")
    monkeypatch.setenv("ATOM_MOE_A8W4_INTER", "group")
    assert launch_flags() == "ATOM_MOE_A8W4_INTER=group ATOM_MOE_PAIR_BLOCKS=0 ATOM_MOE_TMA=1 ATOM_MOE_SWAP=1"


def _chain(spec, p, xs, w, ids, ws, outs, **kwargs) -> None:
    """Three layers in a row on the same weights: each one's output is the next one's input."""
    for i in range(3):
        fused_experts(xs[i], w, ids, p, spec, workspace=ws, out=outs[i], **kwargs)
        if i < 2:
            xs[i + 1].copy_(outs[i])


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
def test_pdl_gives_the_same_bits(seed, monkeypatch, scheme):
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    H, I, E, k = 7168, 2048, 16, 8
    spec, p = make_layer(H, I, E, k, scheme, device="cuda")
    split = dataclasses.replace(heuristic(scheme, H, I, E, k, 8), split_k1=2, split_k2=2)
    cases = [(1, {}), (1, dict(pair_blocks=True)), (8, {}), (8, dict(config=split)), (64, {}), (512, {})]
    ws = allocate_workspace(spec, 512, "cuda")
    for T, kwargs in cases:
        w, ids = make_routing(T, E, k, device="cuda")
        xs = [torch.randn(T, H, device="cuda").to(torch.bfloat16) for _ in range(3)]
        plain = [torch.empty_like(xs[0]) for _ in range(3)]
        outs = [torch.empty_like(xs[0]) for _ in range(3)]
        monkeypatch.setenv("ATOM_MOE_PDL", "1")
        assert common.pdl(xs[0].device)
        _chain(spec, p, xs, w, ids, ws, outs, **kwargs)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _chain(spec, p, xs, w, ids, ws, outs, **kwargs)
        for replay in range(4):
            w2, ids2 = make_routing(T, E, k, device="cuda")
            w.copy_(w2), ids.copy_(ids2), xs[0].copy_(torch.randn(T, H, device="cuda"))
            x0 = xs[0].clone()
            for o in outs:
                o.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            monkeypatch.setenv("ATOM_MOE_PDL", "0")
            ref = [x0] + [torch.empty_like(x0) for _ in range(2)]
            _chain(spec, p, ref, w, ids, allocate_workspace(spec, T, "cuda"), plain, **kwargs)
            monkeypatch.setenv("ATOM_MOE_PDL", "1")
            what = f"T={T} {kwargs} replay {replay}"
            for i in range(3):
                assert torch.equal(outs[i], plain[i]), f"{what}: layer {i} differs from plain stream order"
            assert_near_twin(outs[0], experts_torch(x0, w, ids, p, spec), x0, w, ids, spec, p, what)
