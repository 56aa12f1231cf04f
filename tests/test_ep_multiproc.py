"""Multi-process expert parallelism on the CPU (gloo): 2 and 4 ranks, torchrun-style env and mpiexec.

Each test launches tests/ep_worker.py once per rank with a hard timeout (a hang fails the
test, and every rank is killed). The workers check every output against the single-rank
fp32 reference and print one RESULT line per check; here we require every rank to exit 0,
to have run the expected number of checks, and every check to have passed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from atom_moe.ep.launch import free_port

WORKER = Path(__file__).with_name("ep_worker.py")
def checks_correctness(world: int, schemes: int = 4) -> int:
    """launcher + per (scheme, wire): bytes, 4 routings (output + slots per rank), 4 warm-ups."""
    return 1 + schemes * 2 * (1 + 4 * (1 + world) + 4)


def _clean_env(seed: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("OMPI_", "PMI_", "PMIX_", "MV2_"))}
    env.update(OMP_NUM_THREADS="1", EP_TEST_SEED=str(seed), PYTHONUNBUFFERED="1", **extra)
    return env


def _wait(procs: list[subprocess.Popen], timeout: float, grace: float = 30.0) -> list[tuple[int, str, str]]:
    """Wait for all; fail with what every process printed when one runs past `timeout`, or when a rank failed and
    the others are still running `grace` seconds later (an error must reach every rank, not leave them hanging)."""
    outputs: list[tuple[str, str] | None] = [None] * len(procs)

    def drain(i: int) -> None:  # one reader per process: a rank blocked on a full pipe would look like a hang
        outputs[i] = procs[i].communicate()

    readers = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(procs))]
    for t in readers:
        t.start()
    deadline, stuck_after = time.monotonic() + timeout, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        failed = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
        if failed and stuck_after is None:
            stuck_after = now + grace
        if now > deadline or (stuck_after is not None and now > stuck_after):
            alive = [i for i, p in enumerate(procs) if p.poll() is None]
            for p in procs:
                p.kill()
            for t in readers:
                t.join()
            why = (f"ranks {failed} failed and ranks {alive} were still running {grace:.0f}s later"
                   if failed else f"EP ranks did not finish within {timeout}s (hang)")
            pytest.fail(why + ":\n" + "\n".join(f"--- proc {i} rc={p.returncode}\n{o[-3000:]}\n{e[-3000:]}"
                                                 for i, (p, (o, e)) in enumerate(zip(procs, outputs))))
        time.sleep(0.2)
    for t in readers:
        t.join()
    return [(p.returncode, *out) for p, out in zip(procs, outputs)]


def run_ranks(scenario: str, world: int, seed: int, timeout: float = 150, worker: Path = WORKER, **extra: str):
    """Launch `world` workers with torchrun-style env; return [(rc, stdout, stderr)] by rank."""
    env = _clean_env(seed, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world), **extra)
    procs = [subprocess.Popen([sys.executable, str(worker), scenario],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    return _wait(procs, timeout)


def results_of(out: str) -> list[dict]:
    return [json.loads(line[len("RESULT "):]) for line in out.splitlines() if line.startswith("RESULT ")]


def assert_all_passed(runs, expected_checks: int | None = None, ranks: list[int] | None = None) -> list[dict]:
    """Every listed rank exited 0, ran the expected number of checks, and passed all of them."""
    everything = []
    for r in ranks if ranks is not None else range(len(runs)):
        rc, out, err = runs[r]
        res = results_of(out)
        failed = [x for x in res if not x["ok"]]
        assert rc == 0 and not failed, \
            f"rank {r} rc={rc} failed={failed}\nstdout tail:\n{out[-3000:]}\nstderr:\n{err[-5000:]}"
        if expected_checks is not None:
            assert len(res) == expected_checks, f"rank {r} ran {len(res)} checks, expected {expected_checks}"
        everything += res
    return everything


@pytest.mark.parametrize("world", [2, 4])
def test_ep_matches_reference(world, seed):
    """All schemes x both wires x 4 routings (+ warm-ups), uneven token counts incl. 0, 2 layers per op."""
    res = assert_all_passed(run_ranks("correctness", world, seed), checks_correctness(world))
    assert {r["tokens"] for r in res if "tokens" in r} >= {0, 12}  # empty and full ranks were exercised


@pytest.mark.parametrize("world", [2, 4])
def test_ep_errors_reach_every_rank(world, seed):
    """Mismatched max_tokens_per_rank, wrong placement, int32 limit, overflow, bad input: every rank raises."""
    res = assert_all_passed(run_ranks("errors", world, seed, EP_TEST_PG_TIMEOUT="20"))
    names = {r["check"] for r in res}
    assert {"mismatched max_tokens_per_rank", "overflow on rank 0", "overflow wrote nothing",
            "bad input on last rank", "int32 limit at build", "forward after errors", "expert on two ranks",
            "unowned expert", "forward without agreement"} <= names


@pytest.mark.parametrize("die", [False, True], ids=["peer_raises_and_lingers", "peer_process_dies"])
def test_peer_failure_is_an_error_not_a_hang(die, seed):
    """The last rank fails before forward; rank 0 gets MegaMoEError within the process-group timeout."""
    runs = run_ranks("peer_dies" if die else "peer_fails", 2, seed, timeout=60, EP_TEST_PG_TIMEOUT="4")
    res = assert_all_passed(runs, ranks=[0])
    assert {r["check"] for r in res} >= {"peer failure surfaces", "peer failure within timeout"}
    assert runs[1][0] == (17 if die else 0), runs[1]


def _mpiexec() -> str | None:
    here = Path(sys.executable).with_name("mpiexec")
    return str(here) if here.exists() else shutil.which("mpiexec")


def test_under_mpiexec(seed, tmp_path):
    """2 ranks launched by mpiexec: mpi4py supplies rank, world and the rendezvous (no torchrun env)."""
    mpiexec = _mpiexec()
    if mpiexec is None:
        pytest.skip("mpiexec is not installed (pip install mpich mpi4py: the test extra installs both)")
    pytest.importorskip("mpi4py", reason="mpi4py is not installed (the test extra installs it)")
    env = _clean_env(seed, EP_TEST_LAUNCHER="mpi", EP_TEST_OUT=str(tmp_path))
    proc = subprocess.Popen([mpiexec, "-n", "2", sys.executable, str(WORKER), "smoke"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    (rc, out, err), = _wait([proc], 150)
    assert rc == 0, f"mpiexec rc={rc}\n{out[-3000:]}\n{err[-5000:]}"
    for r in range(2):  # each rank writes its own file (mpiexec interleaves the ranks' stdout)
        res = [json.loads(line) for line in (tmp_path / f"rank{r}.jsonl").read_text().splitlines()]
        failed = [x for x in res if not x["ok"]]
        assert not failed and len(res) == checks_correctness(2, 2), f"rank {r}: {len(res)} checks, failed={failed}"
        assert res[0]["check"] == "launcher" and res[0]["launcher"] == "mpi" and res[0]["world"] == 2
        # teardown finished: read from the rank's file, since mpiexec's stdout lost rank 1's DONE line once
        assert (tmp_path / f"rank{r}.done").read_text().startswith(f"DONE rank={r} failed=[]")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the symm transport's kernels run on the CPU "
                    "only under TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_symm_transport_matches_reference(seed):
    """2 processes, shared-file heaps, the op's symm transport: 4 schemes x 4 routings (mixed combine modes)."""
    res = assert_all_passed(run_ranks("symm", 2, seed, timeout=400), 1 + 4 * (1 + 4 + 4 + 1) + 1)
    assert {r["tokens"] for r in res if "tokens" in r} >= {0, 12}


def test_wait_stops_soon_after_one_rank_fails():
    """A rank that exits non-zero while another hangs fails the test after the grace period, not the timeout."""
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for code in ("import sys; print('rank 0 gave up'); sys.exit(3)", "import time; time.sleep(600)")]
    t0 = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0\] failed and ranks \[1\] were still running") as err:
        _wait(procs, timeout=300, grace=1.0)
    assert time.monotonic() - t0 < 30 and "rank 0 gave up" in str(err.value)
    assert procs[1].returncode is not None  # killed, not left behind
