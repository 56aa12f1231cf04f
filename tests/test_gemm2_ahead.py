"""GEMM2's lookahead prefetch (kernels/gemm2.py `ahead`, a tile config's ahead2).

CPU (interpreter): the program a lookahead names is the one that many places later in the launch, with the
expert that program reads, in every tile order and row mode; the launch and the config refuse what they cannot
run; the op with ahead2 gives the same bytes (the interpreter skips the PTX prefetch itself). GPU: the same
bytes with the prefetch issued, in a CUDA graph replayed with new routing.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kernel_cases import make_layer, make_routing  # noqa: E402

from atom_moe.experts import allocate_workspace, fused_experts  # noqa: E402
from atom_moe.kernels import common, gemm2, tuning  # noqa: E402
from atom_moe.kernels.tuning import ConfigError, TileConfig  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _probe_kernel(block_expert_ptr, n_blocks, n_col_tiles, ids_ptr, emap_ptr, num_experts, out_ptr,
                  GROUP_M: tl.constexpr, PAIRS: tl.constexpr, AHEAD: tl.constexpr):
    ahead_n, ahead_expert = gemm2.ahead_tile(block_expert_ptr, n_blocks, n_col_tiles, GROUP_M, ids_ptr, emap_ptr,
                                             num_experts, PAIRS, AHEAD)
    pid = tl.program_id(0)
    tl.store(out_ptr + 2 * pid, ahead_n)
    tl.store(out_ptr + 2 * pid + 1, ahead_expert)


def _probe(block_expert, n_blocks, n_tiles, ids, emap, group_m, pairs, ahead) -> torch.Tensor:
    """[grid, 2]: (column tile, expert) each program's lookahead names."""
    grid = n_blocks * n_tiles
    out = torch.full((grid, 2), -7, dtype=torch.int32, device=DEVICE)
    _probe_kernel[(grid,)](block_expert, n_blocks, n_tiles, ids, emap, emap.shape[0], out, GROUP_M=group_m,
                           PAIRS=pairs, AHEAD=ahead)
    return out.cpu()


@pytest.mark.parametrize("pairs", [False, True], ids=["sorted", "pairs"])
@pytest.mark.parametrize("group_m", [1, 4, 8])
def test_the_lookahead_names_the_program_that_many_places_later(seed, pairs, group_m):
    g = torch.Generator().manual_seed(seed)
    n_experts = 6
    emap = torch.randint(-1, n_experts, (n_experts + 3,), generator=g, dtype=torch.int32)  # -1: another rank's
    for n_blocks, n_tiles in ((5, 3), (13, 7), (1, 4)):
        # sorted: a block's expert or -1 (no expert); pairs: topk ids with sentinels, some out of range
        block_expert = torch.randint(-1, n_experts, (n_blocks,), generator=g, dtype=torch.int32)
        ids = torch.randint(-2, emap.shape[0] + 2, (n_blocks,), generator=g, dtype=torch.int64)
        args = [t.to(DEVICE) for t in (block_expert, ids, emap)]
        here = _probe(args[0], n_blocks, n_tiles, args[1], args[2], group_m, pairs, 0)
        grid = n_blocks * n_tiles
        # AHEAD = 0 names each program itself: every (block, tile) once, each tile's expert as the kernel reads it
        tiles = set()
        for pid in range(grid):
            per_group = group_m * n_tiles
            first = pid // per_group * group_m
            size = min(n_blocks - first, group_m)
            m, n = first + pid % per_group % size, pid % per_group // size
            tiles.add((m, n))
            if pairs:
                gid = int(ids[m])
                expert = int(emap[gid]) if 0 <= gid < emap.shape[0] else -1
            else:
                expert = int(block_expert[m])
            assert (int(here[pid, 0]), int(here[pid, 1])) == (n, expert), (pid, n_blocks, n_tiles)
        assert len(tiles) == grid
        for ahead in (1, 6, grid - 1, grid, 40):
            got = _probe(args[0], n_blocks, n_tiles, args[1], args[2], group_m, pairs, ahead)
            for pid in range(grid):
                want = here[pid + ahead].tolist() if pid + ahead < grid else [0, -1]
                assert got[pid].tolist() == want, (ahead, pid, n_blocks, n_tiles)


CASES = [("bf16", 256, 128, 8, 4), ("fp8", 256, 256, 6, 3), ("a16w4", 256, 192, 8, 4), ("a8w4", 320, 256, 6, 3)]


def _small(scheme: str) -> TileConfig:
    if scheme == "fp8":
        return TileConfig(16, 256, 128, 4, 2, 64, 128, 4, 2)
    if scheme == "a8w4":
        return TileConfig(16, 128, 64, 4, 2, 64, 64, 4, 2)
    return TileConfig(16, 64, 64, 4, 2, 64, 64, 4, 2)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c[0])
def test_the_op_with_a_lookahead_gives_the_same_bytes(seed, case):
    scheme, H, I, E, k = case
    spec, p = make_layer(H, I, E, k, scheme, device=DEVICE)
    # the counter combine, the separate one, T = 1's pair blocks; a distance inside the grid and past its end
    for T, mode, combine, ahead in ((5, "sentinels", None, 1), (9, "random", "separate", 64), (1, "random", None, 3)):
        w, ids = make_routing(T, E, k, mode=mode, device=DEVICE)
        x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
        plain = fused_experts(x, w, ids, p, spec, config=_small(scheme), combine=combine)
        assert torch.isfinite(plain).all() and plain.abs().sum() > 0
        got = fused_experts(x, w, ids, p, spec, config=dataclasses.replace(_small(scheme), ahead2=ahead),
                            combine=combine)
        assert torch.equal(got, plain), (scheme, T, ahead)


def test_gemm2_and_the_config_refuse_what_the_lookahead_cannot_run(monkeypatch):
    for bad in (-1, common.MAX_AHEAD + 1, 2.0):
        with pytest.raises(ValueError, match="ahead must be an int"):
            common.check_ahead("GEMM2", bad, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="split_k=1 only"):
        common.check_ahead("GEMM2", 8, 2, torch.device("cpu"))
    common.check_ahead("GEMM2", 0, 4, torch.device("cpu"))  # off: anything goes
    monkeypatch.setattr(common, "interpreting", lambda: False)  # a real launch on a CPU tensor: no PTX prefetch
    with pytest.raises(ValueError, match="NVIDIA sm_90"):
        common.check_ahead("GEMM2", 8, 1, torch.device("cpu"))
    # the op refuses before any launch: the routing launch has not filled the workspace's sorted pair list
    spec, p = make_layer(128, 128, 4, 2, "bf16", device="cpu")
    w, ids = make_routing(3, 4, 2, mode="random", device="cpu")
    ws = allocate_workspace(spec, 3, "cpu")
    ws.sorted_ids.fill_(-5)
    with pytest.raises(ValueError, match="NVIDIA sm_90"):
        fused_experts(torch.randn(3, 128).to(torch.bfloat16), w, ids, p, spec, workspace=ws,
                      config=dataclasses.replace(_small("bf16"), ahead2=16))
    assert bool((ws.sorted_ids == -5).all())
    assert tuning.MAX_AHEAD == common.MAX_AHEAD and tuning.MAX_SPLIT_K == common.MAX_SPLIT_K
    base = _small("bf16")
    dataclasses.replace(base, ahead2=tuning.MAX_AHEAD).check("bf16")
    for bad in (-1, tuning.MAX_AHEAD + 1):
        with pytest.raises(ConfigError, match="ahead2"):
            dataclasses.replace(base, ahead2=bad).check("bf16")
    with pytest.raises(ConfigError, match="split_k2=1 only"):
        dataclasses.replace(base, ahead2=256, split_k2=2).check("bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
def test_the_prefetch_changes_no_byte_in_a_replayed_graph(seed, scheme):
    # the prefetch is issued here (sm_90+): a graph captured with ahead2 and replayed with new routing gives, each
    # time, the bytes of the same config without it; at GLM-5.2-TP8's H, I (GEMM2's short-K decode tiles)
    H, I, E, k, T = 6144, 256, 32, 8, 8
    spec, p = make_layer(H, I, E, k, scheme, device="cuda")
    cfg = tuning.heuristic(scheme, H, I, E, k, T)
    ahead = dataclasses.replace(cfg, split_k2=1, ahead2=512)
    ws = allocate_workspace(spec, T, "cuda")
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    w, ids = make_routing(T, E, k, mode="random", device="cuda")
    out = torch.empty_like(x)
    fused_experts(x, w, ids, p, spec, config=ahead, workspace=ws, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_experts(x, w, ids, p, spec, config=ahead, workspace=ws, out=out)
    for mode in ("random", "sentinels", "one_expert"):
        w2, ids2 = make_routing(T, E, k, mode=mode, device="cuda")
        w.copy_(w2)
        ids.copy_(ids2)
        x.copy_(torch.randn(T, H, device="cuda").to(torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        want = fused_experts(x, w, ids, p, spec, config=dataclasses.replace(ahead, ahead2=0))
        assert torch.isfinite(want).all() and torch.equal(out, want), mode
