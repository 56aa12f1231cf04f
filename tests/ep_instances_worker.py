"""One EP rank of the decode/prefill instance test: `python tests/ep_instances_worker.py SCENARIO` (torchrun env).

Every rank builds MegaMoEInstances over one random layer and runs steps whose per-rank token
counts (drawn from the shared seed, so every rank knows them) fall on both sides of the decode
capacity and on it: every output element against the single-rank fp32 reference, which op ran,
that both ops hold the same weights, the planned bytes, and the errors: ranks that pick
different ops, an agreed count below a rank's real one (the decode op above its capacity), a bad
decode capacity. Prints one RESULT line per check (tests/test_ep_instances.py counts them).
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from atom_moe.ep import MegaMoEError, MegaMoEInstances, buffer_sizes, init_distributed
from atom_moe.spec import MoESpec
from atom_moe.tools.synthetic import random_tokens
from ep_worker import H, I, E, K, Checks, compare_elements, make_layer, reference

CD, CP = 4, 12  # decode and prefill capacity per rank
# per-rank token counts of each step: below, at and above CD, one rank empty, the full prefill capacity
STEPS = ((1, 3), (4, 0), (4, 4), (5, 1), (0, 12), (2, 9), (12, 12), (3, 2))


def spy(op) -> list[int]:
    """Count the op's forward calls (which op of the pair ran)."""
    calls = [0]
    forward = op.forward

    def counted(*args, **kwargs):
        calls[0] += 1
        return forward(*args, **kwargs)
    op.forward = counted
    return calls


def step_counts(world: int, i: int) -> list[int]:
    base = STEPS[i % len(STEPS)]
    return [base[r % 2] for r in range(world)]


def scenario_instances(checks: Checks, rank: int, world: int, seed: int, scheme: str, transport: str) -> None:
    spec_full = MoESpec.create(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K, scheme=scheme,
                               max_tokens_per_rank=CP)
    spec = spec_full.for_rank(rank, world)
    layers = [make_layer(spec_full, spec, seed + li) for li in range(2)]
    pair = MegaMoEInstances(spec, None, max_tokens_per_rank=CP, decode_tokens=CD, transport=transport,
                            experts_backend="torch" if transport == "torch" else "triton", device="cpu")
    tag = f"{scheme}/{transport}"
    for name, op, cap in (("decode", pair.decode, CD), ("prefill", pair.prefill, CP)):
        planned = buffer_sizes(spec, world, cap, "bf16", transport=op.transport_name,
                               experts_backend=op.experts_backend)
        got = {n: t.numel() * t.element_size() for n, t in op.buffers.items()}
        checks.record(f"{tag} {name} bytes", got == planned and op.max_tokens_per_rank == cap,
                      planned=sum(planned.values()), got=sum(got.values()))
    calls = {"decode": spy(pair.decode), "prefill": spy(pair.prefill)}
    for i in range(len(STEPS)):
        counts = step_counts(world, i)
        for mode in ("gathered", "engine"):
            g = torch.Generator().manual_seed(seed * 7919 + 31 * i + rank + (mode == "engine"))
            x, w, ids = random_tokens(spec_full, counts[rank], generator=g)
            mine, ref = layers[i % 2]
            before = dict(decode=calls["decode"][0], prefill=calls["prefill"][0])
            agreed = max(counts) if mode == "engine" else None
            out = pair(x, w.contiguous(), ids.contiguous(), mine, agreed_tokens=agreed)
            want = "decode" if max(counts) <= CD else "prefill"
            ran = [n for n in calls if calls[n][0] > before[n]]
            checks.record(f"{tag} step {i} {mode} picks {want}", ran == [want], counts=counts, ran=ran)
            compare_elements(checks, f"{tag} step {i} {mode}", out, reference(spec_full, ref, x, w, ids, "bf16"), x)
            checks.record(f"{tag} step {i} {mode} shared weights", getattr(pair, want)._weights is mine)
    mine, ref = layers[0]
    for wc in pair.warmup(mine, seed=seed):
        compare_elements(checks, f"{tag} warmup {wc.name} T{wc.x.shape[0]}", wc.out,
                         reference(spec_full, ref, wc.x, wc.topk_weights, wc.topk_ids, "bf16"), wc.x)
    # ranks that pick different ops in one step: caught on every rank by the ops' capacity check
    g = torch.Generator().manual_seed(seed + 5)
    x, w, ids = random_tokens(spec_full, 2, generator=g)
    checks.expect_error(f"{tag} ranks pick different ops",
                        lambda: pair(x, w.contiguous(), ids.contiguous(), mine, agreed_tokens=1 if rank == 0 else CP),
                        "different max_tokens_per_rank", "rank 0: 4", "rank 1: 12")
    # an agreed count below a rank's real one would run the decode op above its capacity: refused everywhere
    x, w, ids = random_tokens(spec_full, CD + 3 if rank == world - 1 else 1, generator=g)
    checks.expect_error(f"{tag} decode op above its capacity",
                        lambda: pair(x, w.contiguous(), ids.contiguous(), mine, agreed_tokens=1),
                        f"tokens exceed max_tokens_per_rank={CD}", f"rank {world - 1} ({CD + 3} tokens)")
    # more than the prefill capacity on one rank: refused on every rank, gathered path
    x, w, ids = random_tokens(spec_full, CP + 1 if rank == 0 else 1, generator=g)
    checks.expect_error(f"{tag} above the prefill capacity", lambda: pair(x, w.contiguous(), ids.contiguous(), mine),
                        f"tokens exceed max_tokens_per_rank={CP}", f"rank 0 ({CP + 1} tokens)")
    # after the errors, a valid step still runs and is right (nothing was left half-sent)
    counts = step_counts(world, 3)
    x, w, ids = random_tokens(spec_full, counts[rank], generator=g)
    compare_elements(checks, f"{tag} after errors", pair(x, w.contiguous(), ids.contiguous(), mine),
                     reference(spec_full, ref, x, w, ids, "bf16"), x)
    pair.close()
    checks.expect_error(f"{tag} decode_tokens >= max", lambda: MegaMoEInstances(
        spec, None, max_tokens_per_rank=CP, decode_tokens=CP, transport=transport, experts_backend="torch",
        device="cpu"), "decode_tokens=12 must be an int in [1, max_tokens_per_rank=12)")


def main() -> int:
    scenario = sys.argv[1]
    info = init_distributed("gloo", timeout=timedelta(seconds=float(os.environ.get("EP_TEST_PG_TIMEOUT", "60"))))
    rank, world = info.rank, info.world_size
    seed = int(os.environ.get("EP_TEST_SEED", "1234"))
    torch.manual_seed(seed + rank)
    checks = Checks(rank)
    try:
        scheme, transport = scenario.split("/")
        scenario_instances(checks, rank, world, seed, scheme, transport)
    except Exception:
        traceback.print_exc()
        checks.failed.append("exception")
    start = time.monotonic()
    dist.destroy_process_group()
    print(f"DONE rank={rank} failed={checks.failed} teardown_s={time.monotonic() - start:.2f}", flush=True)
    return 1 if checks.failed else 0


if __name__ == "__main__":
    code = main()
    # Everything is checked and the groups are destroyed; skip interpreter finalization, where
    # gloo's worker threads can abort the process ("terminate called without an active exception",
    # rc -6 after DONE: CI 2026-12-02; pytorch/pytorch#179291 describes the finalization race).
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)
