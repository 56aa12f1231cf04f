"""scripts/mxfp4_lab.py: the reference dequant, the repacks, and --check on a few variants (subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "mxfp4_lab.py"


def _lab():
    """Import the lab script as a module."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("mxfp4_lab", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("mxfp4_lab", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_ref_dequant_matches_formats():
    from atom_moe.formats import dequantize_mxfp4
    lab = _lab()
    packed = torch.arange(256, dtype=torch.uint8).repeat(3, 1)  # every byte, K = 512
    scales = torch.tensor([[0, 1, 100, 127, 128, 200, 254, 127, 126, 125, 124, 123, 122, 121, 120, 119]] * 3,
                          dtype=torch.uint8)
    assert torch.equal(lab.ref_dequant(packed, scales), dequantize_mxfp4(packed, scales))


@pytest.mark.parametrize("block_k", [64, 128, 256])
def test_split_repack_round_trip(block_k):
    lab = _lab()
    g, n, k = 2, 5, 320
    packed = torch.randint(0, 256, (g, n, k // 2), dtype=torch.uint8)
    scales = torch.randint(100, 140, (g, n, k // 32), dtype=torch.uint8)
    w = lab.repack_nk_split(packed, scales, block_k)["w"].to(torch.int64)
    lo, hi = w & 15, w >> 4
    kp = w.shape[-1] * 2
    codes = torch.stack([lo.reshape(g, n, -1, block_k // 2), hi.reshape(g, n, -1, block_k // 2)], 3).reshape(g, n, kp)
    p = packed.to(torch.int64)
    want = torch.stack([p & 15, p >> 4], -1).reshape(g, n, k)
    assert torch.equal(codes[..., :k], want) and not codes[..., k:].any()
    kn = lab.repack_kn_split(packed, scales, block_k)
    assert torch.equal(kn["w"], lab.repack_nk_split(packed, scales, block_k)["w"].transpose(1, 2))


@pytest.mark.slow
def test_check_cli_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, str(SCRIPT), "--check", "--variants", "base", "swap", "nk_split",
                          "dot_scaled"], env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "dot_scaled       a16w4: UNSUPPORTED" in res.stdout or "dot_scaled       a16w4: PASS" in res.stdout
