"""`atom-moe breakdown`: the per-kernel byte/flop formulas (hand-computed), launch recording and replay."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from atom_moe.tools import breakdown, common
from atom_moe.tools.breakdown import KernelTerms, kernel_terms

# A tiny layer: H=256, I=192 (not a multiple of 128: partial fp8 blocks), T=3 tokens,
# top_k=2 (6 pairs), 4 distinct experts hit. Every number below is worked out by hand.
H, I, T, K, HIT = 256, 192, 3, 2, 4

ROUTING_BASE = {"topk_ids read": 6 * 4, "sorted ids write": 6 * 4, "counters zero": 3 * 8 * 4}
ROUTING_QUANT = {"x read": 3 * 256 * 2, "x_q write": 3 * 256, "x_scale write": 3 * 2 * 4}
GEMM2_TAIL = {"partial write": 6 * 256 * 4, "partial read": 6 * 256 * 4, "out write": 3 * 256 * 2}
GEMM1_FLOPS = 2 * 6 * 384 * 256  # 2 * pairs * 2I * H
GEMM2_FLOPS = 2 * 6 * 256 * 192  # 2 * pairs * H * I

EXPECTED = {
    "bf16": {
        "routing": ROUTING_BASE,
        "gemm1": {"w13": 4 * 384 * 256 * 2, "x rows read": 3 * 256 * 2, "inter write": 6 * 192 * 2},
        "gemm2": {"w2": 4 * 256 * 192 * 2, "inter read": 6 * 192 * 2, **GEMM2_TAIL},
    },
    "fp8": {
        "routing": {**ROUTING_BASE, **ROUTING_QUANT},
        # w13 scales: [ceil(192/128)=2, 2, ceil(256/128)=2] fp32 per expert = 32 bytes
        "gemm1": {"w13": 4 * 384 * 256, "w13 scales": 4 * 32, "x rows read": 3 * 256, "x scales read": 3 * 2 * 4,
                  "inter write": 6 * 192, "inter scales write": 6 * 2 * 4},
        # w2 scales: [2, 2] fp32 per expert = 16 bytes
        "gemm2": {"w2": 4 * 256 * 192, "w2 scales": 4 * 16, "inter read": 6 * 192, "inter scales read": 6 * 2 * 4,
                  **GEMM2_TAIL},
    },
    "a16w4": {
        "routing": ROUTING_BASE,
        "gemm1": {"w13": 4 * 384 * 128, "w13 scales": 4 * 384 * 8, "x rows read": 3 * 256 * 2,
                  "inter write": 6 * 192 * 2},
        "gemm2": {"w2": 4 * 256 * 96, "w2 scales": 4 * 256 * 6, "inter read": 6 * 192 * 2, **GEMM2_TAIL},
    },
    "a8w4": {  # GEMM2's input in 64-groups: ceil(192/64) = 3 scales per row
        "routing": {**ROUTING_BASE, **ROUTING_QUANT},
        "gemm1": {"w13": 4 * 384 * 128, "w13 scales": 4 * 384 * 8, "x rows read": 3 * 256,
                  "x scales read": 3 * 2 * 4, "inter write": 6 * 192, "inter scales write": 6 * 3 * 4},
        "gemm2": {"w2": 4 * 256 * 96, "w2 scales": 4 * 256 * 6, "inter read": 6 * 192, "inter scales read": 6 * 3 * 4,
                  **GEMM2_TAIL},
    },
}
TOTALS = {  # the same sums, added up by hand: a dropped or changed term fails here too
    "bf16": (144, 790272, 409344),
    "fp8": (2472, 395336, 211696),
    "a16w4": (144, 212736, 120576),
    "a8w4": (2472, 210912, 119496),
}


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
def test_kernel_terms_by_hand(scheme):
    terms = kernel_terms(scheme, H, I, T, K, HIT)
    assert set(terms) == {"routing", "gemm1", "gemm2"}
    for stage in terms:
        assert terms[stage].bytes_by_term == EXPECTED[scheme][stage], stage
    assert tuple(terms[s].bytes for s in ("routing", "gemm1", "gemm2")) == TOTALS[scheme]
    assert (terms["routing"].flops, terms["gemm1"].flops, terms["gemm2"].flops) == (0, GEMM1_FLOPS, GEMM2_FLOPS)


def test_kernel_terms_with_pair_blocks():
    # T = 1, no routing launch: GEMM1 reads the ids, zeroes the counters and (fp8) quantizes x itself;
    # nobody writes a sorted pair list. By hand: 2 pairs, 8 counters, 2 groups of 128 in H = 256
    terms = kernel_terms("fp8", H, I, 1, K, 2, pair_blocks=True)
    assert set(terms) == {"gemm1", "gemm2"}
    assert terms["gemm1"].bytes_by_term == {
        "topk_ids read": 2 * 4, "counters zero": 8 * 4, "x read": 256 * 2, "x_q write": 256, "x_scale write": 2 * 4,
        "w13": 2 * 384 * 256, "w13 scales": 2 * 32, "x rows read": 256, "x scales read": 2 * 4,
        "inter write": 2 * 192, "inter scales write": 2 * 2 * 4}
    assert terms["gemm1"].flops == 2 * 2 * 384 * 256
    assert terms["gemm2"] == kernel_terms("fp8", H, I, 1, K, 2)["gemm2"]
    assert set(kernel_terms("bf16", H, I, 1, K, 2, pair_blocks=True)["gemm1"].bytes_by_term) == {
        "topk_ids read", "counters zero", "w13", "x rows read", "inter write"}


def test_kernel_terms_with_the_inter_quant_launch():
    # a8w4's GEMM2 input per token: GEMM1 writes bf16 and no scales; the quant launch reads it back and writes the
    # e4m3 rows and one fp32 scale per row; GEMM2 reads those. By hand: 6 pairs, I = 192
    terms = kernel_terms("a8w4", H, I, T, K, HIT, inter_quant=True)
    group = kernel_terms("a8w4", H, I, T, K, HIT)
    assert set(terms) == {"routing", "gemm1", "inter_quant", "gemm2"}
    assert terms["gemm1"].bytes_by_term == {"w13": 4 * 384 * 128, "w13 scales": 4 * 384 * 8, "x rows read": 3 * 256,
                                            "x scales read": 3 * 2 * 4, "inter write": 6 * 192 * 2}
    assert terms["inter_quant"].bytes_by_term == {"inter read": 6 * 192 * 2, "inter_q write": 6 * 192,
                                                  "inter scales write": 6 * 4}
    assert terms["inter_quant"].flops == 0
    assert terms["gemm2"].bytes_by_term == {**EXPECTED["a8w4"]["gemm2"], "inter scales read": 6 * 4}
    assert terms["routing"] == group["routing"] and terms["gemm1"].flops == group["gemm1"].flops
    # GEMM1 split 3 ways: its fp32 K slices of the pre-activation (2I = 384 wide) go to the quant launch instead
    split = kernel_terms("a8w4", H, I, T, K, HIT, inter_quant=True, slices=3)
    unsplit = {t: b for t, b in terms["gemm1"].bytes_by_term.items() if t != "inter write"}
    assert split["gemm1"].bytes_by_term == {**unsplit, "K slices write": 3 * 6 * 384 * 4}
    assert split["inter_quant"].bytes_by_term == {"K slices read": 3 * 6 * 384 * 4, "inter_q write": 6 * 192,
                                                  "inter scales write": 6 * 4}
    assert split["gemm2"] == terms["gemm2"]


def test_kernel_terms_scale_with_hits_and_tokens():
    # weights scale with distinct experts only; activations with tokens only
    one, two = kernel_terms("fp8", H, I, T, K, 1), kernel_terms("fp8", H, I, T, K, 2)
    assert two["gemm1"].bytes - one["gemm1"].bytes == 384 * 256 + 32
    assert two["gemm2"].bytes - one["gemm2"].bytes == 256 * 192 + 16
    assert two["routing"] == one["routing"]
    t2 = kernel_terms("bf16", H, I, 2 * T, K, HIT)
    assert t2["gemm1"].flops == 2 * GEMM1_FLOPS and t2["gemm2"].flops == 2 * GEMM2_FLOPS


def test_floor_is_the_larger_term():
    t = KernelTerms({"a": 3_000_000}, 4_000_000_000)
    assert t.bytes == 3_000_000
    # 3 MB at 1 TB/s = 3 us; 4 GFLOP at 1000 TFLOP/s = 4 us
    assert breakdown.floor_us(t.bytes, t.flops, 1.0, 1000.0) == pytest.approx(4.0)
    assert breakdown.floor_us(t.bytes, t.flops, 0.5, 1000.0) == pytest.approx(6.0)


def test_compiled_info_and_occupancy_degrade_to_none():
    info = common.compiled_info(None)
    assert info == {"n_regs": None, "n_spills": None, "shared_bytes": None, "num_warps": None}
    assert breakdown.ctas_per_sm(info) is None
    # 128 regs x 4 warps = 16384 regs per CTA -> 4 per SM; 64 KB smem (+1 KB) -> 3 per SM
    assert breakdown.ctas_per_sm({"n_regs": 128, "num_warps": 4, "shared_bytes": 65536}) == 3
    assert breakdown.ctas_per_sm({"n_regs": 128, "num_warps": 4, "shared_bytes": 0}) == 4


def test_active_programs_counts_used_blocks():
    ids = torch.tensor([[0, 1], [0, 2], [0, 1]], dtype=torch.int32)  # expert 0: 3 rows, 1: 2, 2: 1
    # block_m 16: 3 used blocks of max_blocks = 6 // 16 + min(4, 6) = 4; 8 programs = 4 blocks x 2 tiles
    assert breakdown.active_programs("gemm1", 8, ids, 4, 2, 16) == 6
    # block_m 2: expert 0 takes 2 blocks -> 4 used of 6 // 2 + 4 = 7; 21 programs = 7 blocks x 3 tiles
    assert breakdown.active_programs("gemm2", 21, ids, 4, 2, 2) == 12
    assert breakdown.active_programs("routing", 7, ids, 4, 2, 16) == 7
    assert breakdown.active_programs("gemm1", 10, ids[:1], 4, 2, 16, pair_blocks=True) == 10  # 2 pairs x 5 tiles


def _device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


class CallTimer:
    """Stands in for bench.Timer: a warm-up call, then `replays` x (prepare(), fn()); a fixed time."""

    def __init__(self, replays: int = 2) -> None:
        self.replays = replays

    def graph_us(self, fn, prepare=None) -> float:
        fn()
        for _ in range(self.replays):
            if prepare is not None:
                prepare()
            fn()
        return 2.0


def _tiny_layer(scheme: str):
    from atom_moe.tools.common import random_weights
    from atom_moe.experts import allocate_workspace
    from atom_moe.spec import MoESpec
    device = _device()
    spec = MoESpec(hidden_size=128, intermediate_size=64, num_experts=4, top_k=2, scheme=scheme)
    gen = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(5)]).to(torch.int32).to(device)
    w = (torch.rand(5, 2, generator=gen) + 0.1).to(device)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16).to(device)
    return spec, random_weights(spec, device), allocate_workspace(spec, 5, device), x, w, ids


CEIL = {"read_tbps": 4.0, "bf16_tflops": 800.0, "fp8_tflops": 1500.0}


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_measure_rows_replays_each_launch_alone(scheme):
    pytest.importorskip("triton")
    if _device() is None:
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
    spec, weights, ws, x, w, ids = _tiny_layer(scheme)
    rows = breakdown.measure_rows(CallTimer(), spec, weights, ws, x, w, ids, CEIL, sms=132, labels={"shape": "tiny"})
    assert [r["kernel"] for r in rows] == ["routing", "gemm1", "gemm2", "layer"]
    terms = kernel_terms(scheme, 128, 64, 5, 2, int(torch.unique(ids).numel()))
    for r in rows[:3]:
        t = terms[r["kernel"]]
        assert r["us"] == 2.0 and r["shape"] == "tiny" and r["programs"] >= r["active_programs"] >= 1
        assert (r["bytes"], r["flops"]) == (t.bytes, t.flops)
        rate = CEIL["fp8_tflops" if scheme == "fp8" else "bf16_tflops"]
        assert r["frac_of_floor"] == round(breakdown.floor_us(t.bytes, t.flops, 4.0, rate) / 2.0, 3)
    # the last timed GEMM2 replay (counters zeroed, output poisoned before it) rebuilt the output
    assert rows[3]["note"] == "sum of kernels 6.0 us"
    assert rows[3]["bytes"] > 0 and rows[3]["programs"] == sum(r["programs"] for r in rows[:3])
    for r in rows:
        breakdown._print_row(r, "[0.0 s]")
    table = breakdown.markdown(rows).splitlines()
    assert len(table) == 2 + 4 and all(line.count("|") == table[0].count("|") for line in table)


def test_measure_rows_a8w4_names_the_quant_launch(monkeypatch):
    # a8w4 (GEMM2's input per token, the default): the quant launch between the GEMMs gets its own row and terms
    pytest.importorskip("triton")
    if _device() is None:
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
    monkeypatch.delenv("ATOM_MOE_A8W4_INTER", raising=False)
    spec, weights, ws, x, w, ids = _tiny_layer("a8w4")
    rows = breakdown.measure_rows(CallTimer(), spec, weights, ws, x, w, ids, CEIL, sms=132)
    assert [r["kernel"] for r in rows] == ["routing", "gemm1", "inter_quant", "gemm2", "layer"]
    terms = kernel_terms("a8w4", 128, 64, 5, 2, int(torch.unique(ids).numel()), inter_quant=True)
    for r in rows[:4]:
        assert (r["bytes"], r["flops"]) == (terms[r["kernel"]].bytes, terms[r["kernel"]].flops), r["kernel"]
    assert rows[4]["note"] == "sum of kernels 8.0 us"


@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_measure_rows_at_one_token(scheme, monkeypatch):
    # T = 1 with pair blocks is two launches: GEMM1's row carries the routing work's bytes, and the lone
    # GEMM2 replay still rebuilds the output
    pytest.importorskip("triton")
    if _device() is None:
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
    monkeypatch.delenv("ATOM_MOE_PAIR_BLOCKS", raising=False)  # the default at T = 1
    monkeypatch.setenv("ATOM_MOE_TMA", "1")  # a flag away from its default is named in the row
    spec, weights, ws, x, w, ids = _tiny_layer(scheme)
    rows = breakdown.measure_rows(CallTimer(), spec, weights, ws, x[:1], w[:1], ids[:1], CEIL, sms=132)
    assert [r["kernel"] for r in rows] == ["gemm1", "gemm2", "layer"]
    terms = kernel_terms(scheme, 128, 64, 1, 2, 2, pair_blocks=True)
    for r in rows[:2]:
        assert (r["bytes"], r["flops"]) == (terms[r["kernel"]].bytes, terms[r["kernel"]].flops)
        assert r["programs"] == r["active_programs"]
    assert rows[2]["note"] == "sum of kernels 4.0 us; ATOM_MOE_TMA=1"


def test_measure_rows_separate_combine_and_split_sort(monkeypatch):
    # large-T launches: the split routing sort's second launch and the separate combine get
    # their own rows and byte terms, and the last lone replay (the combine) rebuilds the output
    pytest.importorskip("triton")
    if _device() is None:
        pytest.skip("needs a CUDA GPU or TRITON_INTERPRET=1")
    from atom_moe.kernels import routing
    monkeypatch.setattr(routing, "SPLIT_PAIRS", 4)
    spec, weights, ws, x, w, ids = _tiny_layer("bf16")
    rows = breakdown.measure_rows(CallTimer(), spec, weights, ws, x, w, ids, CEIL, sms=132, combine="separate")
    assert [r["kernel"] for r in rows] == ["routing", "routing.sort", "gemm1", "gemm2", "combine", "layer"]
    terms = kernel_terms("bf16", 128, 64, 5, 2, int(torch.unique(ids).numel()), separate=True, split_sort=True)
    for r in rows[:5]:
        assert (r["bytes"], r["flops"]) == (terms[r["kernel"]].bytes, terms[r["kernel"]].flops)
    assert terms["combine"].bytes_by_term["partial read"] == terms["gemm2"].bytes_by_term["partial write"] == 10 * 128 * 2
    whole = kernel_terms("bf16", 128, 64, 5, 2, 4)
    assert terms["routing"].bytes + terms["routing.sort"].bytes == whole["routing"].bytes + 10 * 4
    assert "did not rebuild" not in rows[-1]["note"] and "launches" in rows[-1]["note"]


def test_breakdown_help_runs_without_a_gpu():
    proc = subprocess.run([sys.executable, "-m", "atom_moe.tools.cli", "breakdown", "--help"], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "--routing" in proc.stdout and "--ceilings" in proc.stdout
