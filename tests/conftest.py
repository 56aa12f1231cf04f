"""Shared test setup: GPU-marked tests are skipped, with a reason, where CUDA is absent."""

from __future__ import annotations

import os

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
