"""a8w4 through tl.dot_scaled (kernels/mxfp4.py SCALED: gfx950's scaled MFMA): the switch, and the layer.

On the CPU the kernels run under Triton's interpreter, which has no dot_scaled: there
`dot_scaled_emulated` multiplies the same operands in fp32, so these tests check what the
switch adds (MX quad words unpacked to plain e2m1 bytes, residuals turned into e8m0 scales,
the flush) and the interpreter checks nothing of tl.dot_scaled itself. That runs on a GPU
(tests/test_kernels_gpu.py, forced on; Triton decomposes it on Hopper) and compiles for gfx950
(scripts/hip_compile.py, tests/test_perf_scripts.py).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import flushable_mxfp4, make_layer, make_routing, rel_err  # noqa: E402

from atom_moe.experts import fused_experts  # noqa: E402
from atom_moe.experts_torch import experts_torch  # noqa: E402
from atom_moe.kernels import mxfp4  # noqa: E402
from atom_moe.kernels.tuning import TileConfig  # noqa: E402
from atom_moe.layouts import mx_quads  # noqa: E402
from atom_moe.spec import MoESpec  # noqa: E402
from atom_moe.weights import prepare_mxfp4_local  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_switch_defaults_and_flag(monkeypatch):
    """gfx950 from a 128-k step on by default, nowhere else; the flag forces either way; a bad value is named."""
    assert mxfp4.scaled_by_default("gfx950", 128) and mxfp4.scaled_by_default("gfx950:sramecc+:xnack-", 256)
    assert not any(mxfp4.scaled_by_default(arch, bk) for arch, bk in
                   (("gfx950", 64), ("gfx942", 128), ("sm_90a", 128), ("gfx90a", 256)))
    monkeypatch.delenv(mxfp4.SCALED_DOT_FLAG, raising=False)
    assert not mxfp4.scaled_dot(torch.device("cpu"), 128)
    monkeypatch.setenv(mxfp4.SCALED_DOT_FLAG, "1")
    assert mxfp4.scaled_dot(torch.device("cpu"), 64)
    monkeypatch.setenv(mxfp4.SCALED_DOT_FLAG, "0")
    assert not mxfp4.scaled_dot(torch.device("cpu"), 128)
    monkeypatch.setenv(mxfp4.SCALED_DOT_FLAG, "yes")
    with pytest.raises(ValueError, match=r"ATOM_MOE_SCALED_DOT='yes': allowed are 1 .*, 0 .*, or unset"):
        mxfp4.scaled_dot(torch.device("cpu"), 128)


@pytest.mark.parametrize("H,I,T,act,bias,cfg", [
    (160, 96, 5, "oai", True, TileConfig(16, 128, 64, 4, 2, 32, 64, 4, 2)),
    (224, 160, 21, "swiglu", False, TileConfig(32, 256, 128, 4, 2, 64, 64, 4, 2)),
    (96, 224, 13, "swiglu", True, TileConfig(64, 128, 128, 4, 2, 128, 64, 4, 2)),
])
def test_layer_through_dot_scaled_matches_twin(seed, monkeypatch, H, I, T, act, bias, cfg):
    """Forced on: the a8w4 layer equals the torch twin (1e-2), every element written and finite, and
    agrees with the e4m3 decode of the same weights."""
    spec, p = make_layer(H, I, 6, 3, "a8w4", oai=act == "oai", bias=bias, device=DEVICE)
    w, ids = make_routing(T, 6, 3, mode="sentinels", device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    monkeypatch.setenv(mxfp4.SCALED_DOT_FLAG, "1")
    out = torch.full((T, H), float("nan"), device=DEVICE, dtype=torch.bfloat16)  # an unwritten element stays NaN
    got = fused_experts(x, w, ids, p, spec, config=cfg, out=out)
    assert got.data_ptr() == out.data_ptr() and torch.isfinite(got).all()
    assert rel_err(got, experts_torch(x, w, ids, p, spec)) <= 1e-2
    monkeypatch.setenv(mxfp4.SCALED_DOT_FLAG, "0")
    # the same exact products, summed in another order (and requantized between the GEMMs)
    assert rel_err(got, fused_experts(x, w, ids, p, spec, config=cfg)) <= 1e-2


def test_flushed_blocks_through_dot_scaled(seed, monkeypatch):
    """Blocks a8w4 flushes (more than 2^11 below their row's largest scale) are zeroed as the twin
    zeroes them; with the flush switch off the same weights miss the twin."""
    H, I, E, k, T = 192, 128, 3, 2, 11
    spec = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=k, scheme="a8w4")

    experts = flushable_mxfp4(E, H, I, 0.35)
    assert sum(int(mx_quads.flushed_blocks(q, s).sum()) for ex in experts for q, s in (ex[:2], ex[2:])) > 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the flush warning (tests/test_mx_quads.py)
        p = prepare_mxfp4_local(spec, [tuple(t.to(DEVICE) for t in ex) for ex in experts])
    assert p.mx_flush is True
    w, ids = make_routing(T, E, k, mode="random", device=DEVICE)
    x = torch.randn(T, H, device=DEVICE).to(torch.bfloat16)
    cfg = TileConfig(16, 128, 128, 4, 2, 64, 64, 4, 2)
    twin = experts_torch(x, w, ids, p, spec)
    monkeypatch.setenv(mxfp4.SCALED_DOT_FLAG, "1")
    got = fused_experts(x, w, ids, p, spec, config=cfg)
    assert torch.isfinite(got).all() and rel_err(got, twin) <= 1e-2
    # unflushed, those blocks take the scale 2^0 (quad_scales), 2^-6 of a row's largest blocks: a smaller
    # error than the e4m3 decode's garbage table, but well past the bound
    assert rel_err(fused_experts(x, w, ids, dataclasses.replace(p, mx_flush=False), spec, config=cfg), twin) > 2e-2
