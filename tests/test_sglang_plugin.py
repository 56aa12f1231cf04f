"""The SGLang plugin against the real SGLang 0.5.23 package (CPU).

scripts/sglang_env.sh builds the SGLang env once (cached in
${ATOM_MOE_CACHE:-~/.cache/atom_moe}/sglang-0.5.23, about 1.5 minutes and 2 GB the first
time). Inside it, tests/sglang_cases.py runs with SGLang's own plugin loader, layers,
weight loaders and distributed init; this test passes only if every case there passes
(none skipped, none deselected).
"""

from __future__ import annotations

import os

import pytest
from engine_common import engine_env_python, run_engine_suite

VERSION = os.environ.get("ATOM_MOE_SGLANG_VERSION", "0.5.23")


def sglang_python() -> str:
    """Build (once, cached) and return the interpreter of the SGLang env."""
    return engine_env_python("sglang_env.sh", VERSION)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_sglang_plugin_cases(seed):
    run_engine_suite(sglang_python(), "sglang_cases.py", "SGLang", 45, ATOM_MOE_SEED=str(seed))
