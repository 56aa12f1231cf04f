"""Where does a compiled + graphed transformers model with our experts leave the fp32 reference? (GPU)

Diagnostic for tests/test_transformers_gpu.py. Every call of our experts op inside the captured
decode graph also copies its inputs (x, topk weights, topk ids) and its output into static buffers;
the copies are captured with the kernels, so after each replay the buffers hold what that replay
computed. Per replay this prints, as one JSON line:

- `equal_eager`: the replay's output equals our op run eagerly on the recorded inputs, bit for bit
  (a race or an uninitialised read inside the graph breaks this);
- `repeat_equal`: 20 eager reruns on the same inputs are bitwise identical (a race in the kernels);
- `rel_fp32`: the output against atom_moe's fp32 reference on the recorded inputs;
- `router_ids_equal` / `router_w_diff`: the recorded top-k against the model's router run eagerly on
  the recorded hidden states (Inductor's router kernel against eager's: a near-tie flip shows here).

Then the run's distance to the eager fp32-experts generation, as the test computes it.

    python scripts/transformers_graph_diag.py --model deepseek_v3 --seeds 886167172 1397397608
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import test_transformers_gpu as tg  # noqa: E402

from atom_moe import ops  # noqa: E402
from atom_moe.reference import ReferenceWeights, reference_moe  # noqa: E402


class RecordingExperts(tg.AtomExperts):
    """AtomExperts whose op body also copies inputs and output into static buffers (captured too)."""

    def __init__(self, experts, top_k):
        super().__init__(experts, top_k)
        h = experts.gate_up_proj.shape[2]
        dev = experts.gate_up_proj.device
        self.x = torch.zeros(tg.MAX_TOKENS, h, dtype=torch.bfloat16, device=dev)
        self.out = torch.zeros_like(self.x)
        self.ids = torch.zeros(tg.MAX_TOKENS, top_k, dtype=torch.int64, device=dev)
        self.w = torch.zeros(tg.MAX_TOKENS, top_k, dtype=torch.float32, device=dev)
        self.tokens = 0
        self.ref = ReferenceWeights.from_separated(experts.gate_up_proj.data, experts.down_proj.data)
        counted = ops._bound[self.handle]
        self.run = counted

        def recording(x, w, ids):
            out = counted(x, w, ids)
            t = x.shape[0]
            self.tokens = t
            self.x[:t].copy_(x), self.w[:t].copy_(w), self.ids[:t].copy_(ids), self.out[:t].copy_(out)
            return out
        ops._bound[self.handle] = recording


def eager_router(mlp, x):
    """(weights, ids) of the model's own router on hidden states x [T, H], eagerly."""
    got = mlp.gate(x)
    if isinstance(got, tuple) and len(got) == 3:  # transformers >= 5.2x: (logits, weights, ids)
        return got[1], got[2]
    ids, w = mlp.route_tokens_to_experts(got)  # transformers 5.17
    return w, ids


def check_replay(rec: RecordingExperts, mlp, seed: int, run: int, step: int) -> dict:
    t = rec.tokens
    x, w, ids, out = rec.x[:t].clone(), rec.w[:t].clone(), rec.ids[:t].clone(), rec.out[:t].clone()
    again = rec.run(x, w.to(torch.float32), ids)
    repeat = all(torch.equal(rec.run(x, w, ids), again) for _ in range(20))
    ref = reference_moe(x, w.float(), ids, rec.ref, tg.Activation())
    rel = float((out.float() - ref).norm() / ref.norm().clamp_min(1e-30))
    rw, rids = eager_router(mlp, x)
    same_ids = bool(torch.equal(torch.sort(rids, 1).values, torch.sort(ids, 1).values))
    wdiff = float((torch.sort(rw.float(), 1).values - torch.sort(w.float(), 1).values).abs().max()) if same_ids else None
    return dict(seed=seed, run=run, step=step, tokens=t, equal_eager=bool(torch.equal(out, again)), repeat_equal=repeat,
                rel_fp32=rel, router_ids_equal=same_ids, router_w_diff=wdiff)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="deepseek_v3", choices=sorted(tg.CONFIGS))
    ap.add_argument("--seeds", type=int, nargs="+", required=True)
    args = ap.parse_args()
    for seed in args.seeds:
        model = tg.build(args.model, seed)
        batches = tg.make_batches(seed)
        with torch.no_grad():
            f32 = tg.fp32_reference(model, batches)
            recs = tg.swap_experts(model, RecordingExperts)
            mlps = [m for m in model.modules() if any(getattr(m, "experts", None) is r for r in recs)]
            state = {"run": 0}

            def after(step):
                for rec, mlp in zip(recs, mlps):
                    print(json.dumps(check_replay(rec, mlp, seed, state["run"], step)), flush=True)
            runs = []
            torch._dynamo.reset()
            compiled = torch.compile(model.forward, mode="default", dynamic=False)
            for n in range(2):
                for ids in batches:
                    runs.append(tg.graphed_greedy(model, compiled, ids, after))
                    state["run"] += 1
            for n, (ref, got) in enumerate(zip(f32 * 2, runs)):
                worst, problems = tg.distance(ref, got, 0.5)
                print(json.dumps(dict(seed=seed, run=n, distance=worst, problems=problems[:3])), flush=True)
            tg.restore_experts(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
