"""Redundant experts on 2 and 4 gloo ranks (tests/ep_worker.py scenario "redundant").

Random placements with several replicas for some experts and shuffled replica tables: every
output element against the single-rank fp32 reference, the slot routing picks for every
(token, slot), the load statistic against a bincount of the ids, rebalancing mid-run
(addresses unchanged, every slot holding its expert's weights after), and wrong tables
raising at build and at rebalance on every rank.
"""

from __future__ import annotations

import os

import pytest

from test_ep_multiproc import assert_all_passed, run_ranks

CASES = 3  # (scheme, wire) combinations in ep_worker.REDUNDANT_CASES
# per combination: bytes; 2 phases x 3 routings x (output, every element, replica choice, load); 2 balanced
# replicas; addresses and slot contents after the rebalance; 4 warm-ups x (output, every element); load reset;
# bad rebalance (error, differing tables, nothing moved). Then 7 build errors, and the launcher line.
CHECKS = 1 + CASES * (1 + 2 * 3 * 4 + 2 + 2 + 8 + 1 + 3) + 7


@pytest.mark.parametrize("world", [2, 4])
def test_redundant_experts_match_reference(world, seed):
    res = assert_all_passed(run_ranks("redundant", world, seed, timeout=300), CHECKS)
    names = {r["check"] for r in res}
    assert {"redundant torch bf16/bf16 rebalance keeps addresses", "redundant torch fp8/fp8 after one_expert replica "
            "choice", "build: slot out of range", "build: expert without replica"} <= names


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the symm transport's kernels run on the CPU "
                    "only under TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_redundant_experts_symm_transport(seed):
    """2 processes, the op's symm transport (shared-file heaps, Triton under the interpreter), bf16."""
    res = assert_all_passed(run_ranks("redundant_symm", 2, seed, timeout=400), 1 + (1 + 2 * 3 * 4 + 2 + 2 + 8 + 1 + 3))
    assert {"redundant symm bf16/bf16 rebalance keeps addresses"} <= {r["check"] for r in res}
