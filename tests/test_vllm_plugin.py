"""The vLLM plugin against the real vLLM 0.30.0 and 0.33.0 packages (CPU).

Each version has its own cached environment (scripts/engine_env.sh builds it once, in
${ATOM_MOE_CACHE:-~/.cache/atom_moe}/vllm-<version>, minutes and gigabytes the first
time). Inside it, tests/vllm_cases.py runs with vLLM's own plugin loader, factory,
weight loader, runner and distributed init; this test passes only if every case there
passes (none skipped, none deselected). ATOM_MOE_VLLM_VERSIONS="0.33.0" narrows the set.
"""

from __future__ import annotations

import os

import pytest
from engine_common import engine_env_python, run_engine_suite

VERSIONS = os.environ.get("ATOM_MOE_VLLM_VERSIONS", "0.30.0 0.33.0").split()


def engine_python(version: str) -> str:
    """Build (once, cached) and return the interpreter of the vLLM `version` environment."""
    return engine_env_python("engine_env.sh", "vllm", version)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_plugin_cases(version, seed):
    run_engine_suite(engine_python(version), "vllm_cases.py", f"vLLM {version}", 48, VLLM_TARGET_DEVICE="cpu",
                     ATOM_MOE_SEED=str(seed))
