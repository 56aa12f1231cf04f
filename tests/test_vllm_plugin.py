"""The vLLM plugin against the real vLLM 0.30.0 and 0.33.0 packages (CPU).

Each version has its own cached environment (scripts/engine_env.sh builds it once, in
${ATOM_MOE_CACHE:-~/.cache/atom_moe}/vllm-<version>, minutes and gigabytes the first
time). Inside it, tests/vllm_cases.py runs with vLLM's own plugin loader, factory,
weight loader, runner and distributed init; this test passes only if every case there
passes (none skipped, none deselected). ATOM_MOE_VLLM_VERSIONS="0.33.0" narrows the set.

The newest version runs every case. Older ones run the single-process cases and one TP + EP and
one DP + EP case (bf16): the other multi-rank cases start two or four vLLM processes each and were
four fifths of a version's 14 minutes (CPU, 2026-12-03), and the distributed paths they cover
are the newest version's. ATOM_MOE_VLLM_ALL_CASES=1 runs every case on every version.
"""

from __future__ import annotations

import os

import pytest
from engine_common import engine_env_python, run_engine_suite

VERSIONS = os.environ.get("ATOM_MOE_VLLM_VERSIONS", "0.30.0 0.33.0").split()
NEWEST = "0.33.0"
# older versions: no multi-rank case but these two (34 of the 48 cases)
OLDER_CASES = ("not two_ranks and not tp_ranks and not with_ep and not eplb and not decode_prefill "
               "and not start_up_limit or tp_ep_two_ranks[bf16] or dp_ep_fused_two_ranks[bf16]")
OLDER_COUNT = 34


def engine_python(version: str) -> str:
    """Build (once, cached) and return the interpreter of the vLLM `version` environment."""
    return engine_env_python("engine_env.sh", "vllm", version)


@pytest.mark.slow
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_plugin_cases(version, seed):
    every = version == NEWEST or os.environ.get("ATOM_MOE_VLLM_ALL_CASES") == "1"
    run_engine_suite(engine_python(version), "vllm_cases.py", f"vLLM {version}", 48 if every else OLDER_COUNT,
                     select=None if every else OLDER_CASES, VLLM_TARGET_DEVICE="cpu", ATOM_MOE_SEED=str(seed))
