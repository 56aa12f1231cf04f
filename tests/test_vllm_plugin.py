"""The vLLM plugin against the real vLLM 0.30.0 and 0.33.0 packages (CPU).

Each version has its own cached environment (scripts/engine_env.sh builds it once, in
${ATOM_MOE_CACHE:-~/.cache/atom_moe}/vllm-<version>, minutes and gigabytes the first
time). Inside it, tests/vllm_cases.py runs with vLLM's own plugin loader, factory,
weight loader, runner and distributed init; this test passes only if every case there
passes (none skipped, none deselected). ATOM_MOE_VLLM_VERSIONS="0.33.0" narrows the set.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERSIONS = os.environ.get("ATOM_MOE_VLLM_VERSIONS", "0.30.0 0.33.0").split()


def engine_python(version: str) -> str:
    """Build (once, cached) and return the interpreter of the vLLM `version` environment."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / "engine_env.sh"), "vllm", version],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"engine_env.sh vllm {version} failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_plugin_cases(version, seed):
    python = engine_python(version)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATOM_USE_FLYDSL", "ATOM_FLYDSL"))}
    env.update(ATOM_USE_FLYDSL="1", VLLM_TARGET_DEVICE="cpu", ATOM_MOE_SEED=str(seed))
    env.pop("TRITON_INTERPRET", None)  # the engine env's CPU path is experts_torch
    # -P: keep the checkout root off sys.path, so a stale in-tree *.egg-info cannot hide our entry point
    proc = subprocess.run([python, "-P", "-m", "pytest", "tests/vllm_cases.py", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", "-rfEs"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=3300)
    out = proc.stdout + proc.stderr
    print(out[-6000:])
    assert proc.returncode == 0, f"vLLM {version} cases failed:\n{out[-12000:]}"
    summary = re.search(r"(\d+) passed", out)
    assert summary and int(summary.group(1)) >= 24, out[-3000:]
    assert not re.search(r"\d+ (failed|skipped|error|deselected)", out), out[-3000:]
