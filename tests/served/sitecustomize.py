"""Test-only start-up hook for the served-model test (tests/test_vllm_serve.py puts this folder on PYTHONPATH).

It runs in every process of the server (API server, engine cores, workers: each a fresh
interpreter that inherits PYTHONPATH), before vLLM loads our plugin:

* ATOM_MOE_SERVED_PROBE=<dir>: every handle bound in atom_moe.ops appends one line to
  <dir>/<pid>.txt on its first call: proof that the served forward ran our custom ops.
* ATOM_MOE_SERVED_PLANT=gate_up_swap: the planted bug: SEPARATED w13 arrives with its gate and
  up halves swapped (the classic mispairing), so the test must see the logprobs move.
"""

import os

if os.environ.get("ATOM_MOE_SERVED_PROBE") or os.environ.get("ATOM_MOE_SERVED_PLANT"):
    from atom_moe import ops, weights

    probe = os.environ.get("ATOM_MOE_SERVED_PROBE")
    if probe:
        _add = ops._add

        def _probed_add(kind, run):
            handle = None
            seen = []

            def probed(x, topk_weights, topk_ids):
                if not seen:
                    seen.append(True)
                    with open(os.path.join(probe, f"{os.getpid()}.txt"), "a") as f:
                        f.write(f"{handle} T={x.shape[0]}\n")
                return run(x, topk_weights, topk_ids)
            handle = _add(kind, probed)
            return handle
        ops._add = _probed_add

    plant = os.environ.get("ATOM_MOE_SERVED_PLANT")
    if plant:
        if plant != "gate_up_swap":
            raise SystemExit(f"ATOM_MOE_SERVED_PLANT={plant!r}: only gate_up_swap is known")
        _prepare = weights.prepare_stacked

        def _swapped(spec, w13, w2, *, layout, **kw):
            if str(getattr(layout, "value", layout)).lower() == "separated" and kw.get("w13_scale") is None:
                inter = w13.shape[1] // 2
                w13 = w13.roll(inter, dims=1)  # [up; gate] instead of [gate; up]
            return _prepare(spec, w13, w2, layout=layout, **kw)
        weights.prepare_stacked = _swapped
