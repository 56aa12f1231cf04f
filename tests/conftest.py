"""Shared test setup: GPU-marked tests are skipped, with a reason, where CUDA is absent."""

from __future__ import annotations

import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
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
