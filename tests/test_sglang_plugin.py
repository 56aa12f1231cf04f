"""The SGLang plugin against the real SGLang 0.5.23 package (CPU).

scripts/sglang_env.sh builds the SGLang env once (cached in
${ATOM_MOE_CACHE:-~/.cache/atom_moe}/sglang-0.5.23, about 1.5 minutes and 2 GB the first
time). Inside it, tests/sglang_cases.py runs with SGLang's own plugin loader, layers,
weight loaders and distributed init; this test passes only if every case there passes
(none skipped, none deselected).
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
VERSION = os.environ.get("ATOM_MOE_SGLANG_VERSION", "0.5.23")


def sglang_python() -> str:
    """Build (once, cached) and return the interpreter of the SGLang env."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / "sglang_env.sh"), VERSION], capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, f"sglang_env.sh {VERSION} failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sglang_plugin_cases(seed):
    python = sglang_python()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATOM_USE_FLYDSL", "ATOM_FLYDSL"))}
    env.update(ATOM_USE_FLYDSL="1", ATOM_MOE_SEED=str(seed))
    env.pop("TRITON_INTERPRET", None)  # the CPU path is experts_torch; the limit case sets it itself
    # -P: keep the checkout root off sys.path, so only the installed entry point is found
    proc = subprocess.run([python, "-P", "-m", "pytest", "tests/sglang_cases.py", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", "-rfEs"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=3300)
    out = proc.stdout + proc.stderr
    print(out[-6000:])
    assert proc.returncode == 0, f"SGLang cases failed:\n{out[-12000:]}"
    summary = re.search(r"(\d+) passed", out)
    assert summary and int(summary.group(1)) >= 22, out[-3000:]
    assert not re.search(r"\d+ (failed|skipped|error|deselected)", out), out[-3000:]
