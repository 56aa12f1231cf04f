"""Shared test setup: GPU-marked tests are skipped, with a reason, where CUDA is absent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch


# The engine suites run first. They are the longest tests by far (CPU machine, 2026-12-03, one serial
# run of the whole suite in 5013 s: the vLLM cases 919 s under 0.33.0 and 790 s under 0.30.0, the served
# test 734 s, the SGLang cases 447 s, served DP + EP 333 s), so under pytest-xdist (.ci/run: two workers,
# one test at a time) they start at once beside the short ones instead of leaving one worker alone at
# the end with them.
LONG_FIRST = ("test_vllm_plugin.py", "test_vllm_serve.py", "test_sglang_plugin.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name not in LONG_FIRST)  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    reason = "needs a CUDA GPU (run on the H200 device machine; see docs/testing.md)"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def seed() -> int:
    """A fresh seed per test run, printed so a failure can be replayed with ATOM_MOE_SEED."""
    value = int(os.environ.get("ATOM_MOE_SEED", torch.seed() % (2**31)))
    torch.manual_seed(value)
    print(f"seed={value}")
    return value


@pytest.fixture(scope="session")
def vllm_src() -> Path:
    """vLLM 0.33.0's sources for the baselines (fused_moe and the vendored triton_kernels), fetched once when absent:
    ATOM_MOE_VLLM_SRC, else .cache/vllm-0.33.0 of this checkout (scripts/vllm_baseline_src.py; the wheel is cached
    in $ATOM_MOE_CACHE/wheels). The tests that need them skip, saying so, only when that fetch fails (no PyPI)."""
    root = Path(__file__).resolve().parents[1]
    src = Path(os.environ.get("ATOM_MOE_VLLM_SRC", root / ".cache" / "vllm-0.33.0"))
    wanted = ("vllm/model_executor/layers/fused_moe/fused_moe.py", "vllm/third_party/triton_kernels/routing.py",
              # a folder fetched before the H100 tables were unpacked lacks this one: fetch again
              "vllm/model_executor/layers/fused_moe/configs/E=128,N=2880,device_name=NVIDIA_H100_80GB_HBM3.json")
    if not all((src / w).is_file() for w in wanted):
        run = subprocess.run([sys.executable, str(root / "scripts" / "vllm_baseline_src.py"), "--dest", str(src)],
                             capture_output=True, text=True, timeout=900)
        if run.returncode != 0:
            pytest.skip(f"vLLM 0.33.0 sources are not at {src} and scripts/vllm_baseline_src.py could not fetch "
                        f"them (no PyPI here?): {(run.stderr.strip().splitlines() or [''])[-1]}")
    return src
