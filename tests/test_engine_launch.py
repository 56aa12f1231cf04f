"""engine_common.run_ranks, the multi-rank launcher of the engine suites: a hang or a failing rank ends in
bounded time with every rank's output (a hung rank's Python stacks included), never a silent 15-minute wait."""

from __future__ import annotations

import sys
import time

import pytest

from engine_common import run_ranks

WORKER = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)
rank, plan = int(sys.argv[1]), sys.argv[2].split(",")
print(f"rank {rank} started", flush=True)
if plan[rank] == "hang":
    def wait_for_a_peer_that_left():
        time.sleep(600)
    wait_for_a_peer_that_left()
if plan[rank] == "fail":
    raise SystemExit("planted failure")
print(f"RANK {rank} OK", flush=True)
"""


def _argv(plan: str):
    return lambda rank: [sys.executable, "-c", WORKER, str(rank), plan]


def test_every_rank_ok_returns_outputs():
    outs = run_ranks(_argv("ok,ok,ok"), 3, timeout=60)
    assert [f"RANK {r} OK" in out for r, out in enumerate(outs)] == [True] * 3


def test_hang_stops_with_the_hung_ranks_stacks():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"ran past 5 s \(hang\): ranks \[1\] stopped") as err:
        run_ranks(_argv("ok,hang"), 2, timeout=5)
    assert time.monotonic() - start < 30
    assert "wait_for_a_peer_that_left" in str(err.value) and "RANK 0 OK" in str(err.value)


def test_failing_rank_stops_the_others_after_the_grace():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank 0 exited 1; the others got 3 s") as err:
        run_ranks(_argv("fail,hang"), 2, timeout=120, grace=3)
    assert time.monotonic() - start < 30
    assert "planted failure" in str(err.value) and "wait_for_a_peer_that_left" in str(err.value)


def test_rank_without_its_ok_line_fails():
    with pytest.raises(AssertionError, match="rank 1 failed"):
        run_ranks(lambda rank: [sys.executable, "-c", f"print('RANK {2 * rank} OK')"], 2, timeout=60)
