"""What the vLLM and SGLang plugin suites share: random checkpoint tensors with their fp32
reference, the int32-limit check at layer build, running an engine suite in its own
cached environment, and launching a multi-rank worker with a bounded wait.

Imported from inside the engines' environments too (tests/ is on sys.path there), so it
needs torch and atom_moe only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from atom_moe import formats
from atom_moe.ep.launch import free_port  # noqa: F401  (the engine cases' ports)
from atom_moe.reference import ReferenceWeights
from atom_moe.spec import Activation, ActivationKind

REPO = Path(__file__).resolve().parents[1]
INTER = {"bf16": 192, "fp8": 256, "mxfp4": 192}  # MXFP4 needs multiples of 32; fp8 blocks of 128
SCHEMES = ("bf16", "fp8", "mxfp4")


def hf_checkpoint(scheme: str, gen: torch.Generator, num_experts: int, hidden: int,
                  key_prefix: str = "") -> tuple[dict, ReferenceWeights]:
    """Random checkpoint tensors in the scheme's HF naming, and their fp32 reference weights.

    bf16 / fp8: per-expert `{key_prefix}{e}.{gate,up,down}_proj.weight` (fp8 with 128x128
    `weight_scale_inv`); mxfp4: gpt-oss's stacked blocks, scales and biases, gate/up
    rows interleaved.
    """
    def randn(*shape, std):
        return torch.randn(*shape, generator=gen) * std

    E, H, I = num_experts, hidden, INTER[scheme]
    gate, up, down = randn(E, I, H, std=H**-0.5), randn(E, I, H, std=H**-0.5), randn(E, H, I, std=I**-0.5)
    if scheme == "mxfp4":
        w13 = torch.stack((gate, up), dim=2).reshape(E, 2 * I, H)  # rows g0, u0, g1, u1, ...
        q13, s13 = formats.quantize_mxfp4(w13)
        q2, s2 = formats.quantize_mxfp4(down)
        b13, b2 = randn(E, 2 * I, std=0.05).bfloat16(), randn(E, H, std=0.05).bfloat16()
        tensors = {"gate_up_proj_blocks": q13.view(E, 2 * I, H // 32, 16), "gate_up_proj_scales": s13,
                   "gate_up_proj_bias": b13, "down_proj_blocks": q2.view(E, H, I // 32, 16),
                   "down_proj_scales": s2, "down_proj_bias": b2}
        full13 = formats.dequantize_mxfp4(q13, s13)
        return tensors, ReferenceWeights(full13[:, 0::2], full13[:, 1::2], formats.dequantize_mxfp4(q2, s2),
                                         tuple(range(E)), b13[:, 0::2].float(), b13[:, 1::2].float(), b2.float())
    tensors, g, u, d = {}, [], [], []
    for e in range(E):
        for name, w, out in (("gate_proj", gate[e], g), ("up_proj", up[e], u), ("down_proj", down[e], d)):
            key = f"{key_prefix}{e}.{name}"
            if scheme == "fp8":
                q, s = formats.quantize_fp8_block(w, 128)
                tensors[f"{key}.weight"], tensors[f"{key}.weight_scale_inv"] = q, s
                out.append(formats.dequantize_fp8_block(q, s, 128))
            else:
                tensors[f"{key}.weight"] = w.bfloat16()
                out.append(w.bfloat16().float())
    return tensors, ReferenceWeights(torch.stack(g), torch.stack(u), torch.stack(d), tuple(range(E)))


def random_placement(num_experts: int, redundant: int, gen: torch.Generator) -> list[int]:
    """An EPLB physical -> logical map: every expert once plus `redundant` replicas of two hot ones, shuffled
    (the same on every rank, given the same generator state)."""
    hot = torch.randperm(num_experts, generator=gen)[:2]
    phys = list(range(num_experts)) + hot[torch.randint(0, 2, (redundant,), generator=gen)].tolist()
    return [phys[i] for i in torch.randperm(len(phys), generator=gen).tolist()]


def record_instance_calls(pair, decode_tokens: int, prefill_tokens: int) -> list[str]:
    """Check a decode/prefill MegaMoE pair's capacities; the returned list gets the op each forward runs."""
    from atom_moe.ep import MegaMoEInstances

    assert isinstance(pair, MegaMoEInstances), type(pair)
    assert pair.decode.max_tokens_per_rank == decode_tokens, pair.decode.max_tokens_per_rank
    assert pair.prefill.max_tokens_per_rank == prefill_tokens > decode_tokens, pair.prefill.max_tokens_per_rank
    ran = []
    for name in ("decode", "prefill"):
        op = getattr(pair, name)
        op.forward = lambda *a, _f=op.forward, _n=name, **k: (ran.append(_n), _f(*a, **k))[1]
    return ran


def plant_a8w4_bug(plant: str, mxfp4_act, monkeypatch, module) -> None:
    """One planted bug the a8w4 bitwise check must catch: 'a16w4_ran' (the fp8 request never reaches the
    layer) or 'gate_up_swap' (the engine's interleaved rows read as separated halves, via module.plan_layer)."""
    from dataclasses import replace

    from atom_moe.layouts.gate_up import GateUpLayout

    if plant == "a16w4_ran":
        mxfp4_act("bf16")
        return
    mxfp4_act("fp8")
    real = module.plan_layer
    monkeypatch.setattr(module, "plan_layer", lambda *a: replace(real(*a), layout=GateUpLayout.SEPARATED))


def activation_of(scheme: str) -> Activation:
    """The layers' activation: gpt-oss's clamped SwiGLU for the MXFP4 (gpt-oss style) layer, else SiLU.

    "a8w4" names that MXFP4 layer run with ATOM_MOE_MXFP4_ACT=fp8 (the multi-rank workers' scheme argument).
    """
    return Activation(ActivationKind.SWIGLU_OAI, 1.702, 7.0) if scheme in ("mxfp4", "a8w4") else Activation()


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Every element within bf16-level error of the fp32 reference (scaled by the output's magnitude)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.isfinite(out).all()
    scale = ref.abs().max().item()
    assert scale > 0
    err = (out.float() - ref).abs()
    bound = 2e-2 * scale + 2e-2 * ref.abs()
    bad = (err > bound).sum().item()
    assert bad == 0, f"{bad} of {err.numel()} elements off; max error {err.max().item():.4g}, scale {scale:.4g}"


def a8w4_spec(num_experts: int, hidden: int, top_k: int):
    """The gpt-oss style test layer as our a8w4 scheme sees it, built here (not read from a plugin's plan)."""
    from atom_moe.spec import MoESpec, Scheme

    return MoESpec(hidden_size=hidden, intermediate_size=INTER["mxfp4"], num_experts=num_experts, top_k=top_k,
                   scheme=Scheme.A8W4, activation=activation_of("mxfp4"), has_bias=True)


def our_mxfp4_twin(tensors: dict, spec, x, topk_weights, topk_ids) -> torch.Tensor:
    """Our torch twin on weights we prepare ourselves from the gpt-oss checkpoint tensors (atom_moe.checkpoint,
    not the engine's loader), in spec's MXFP4 scheme (a16w4 or a8w4)."""
    from atom_moe.checkpoint.gpt_oss import prepare_gpt_oss
    from atom_moe.experts_torch import experts_torch

    weights = prepare_gpt_oss(spec, {f"experts.{k}": v for k, v in tensors.items()}, "experts")
    return experts_torch(x, topk_weights, topk_ids, weights, spec)


def assert_bitwise(out: torch.Tensor, want: torch.Tensor) -> None:
    """Every element of out equal to want's, bit for bit (same scheme, same weights, same routing)."""
    assert out.shape == want.shape and out.dtype == want.dtype, (out.shape, out.dtype, want.shape, want.dtype)
    bad = (out.view(torch.int16) != want.view(torch.int16)).sum().item() if out.dtype == torch.bfloat16 else \
        (out != want).sum().item()
    assert bad == 0, (f"{bad} of {out.numel()} elements differ; max |diff| "
                      f"{(out.float() - want.float()).abs().max().item():.4g}")


def check_limit_error(build: Callable[[], object], flag: str, too_large: int, spec, ep: int, **limits) -> None:
    """build() must fail naming `flag`={too_large} and the largest safe value, which must fit, one more not."""
    from atom_moe.ep.buffers import BufferLimitError, check_limits
    from atom_moe.plugins.common import LimitError

    try:
        build()
    except LimitError as exc:
        msg = str(exc)
    else:
        raise AssertionError("a layer whose buffers pass int32 was built")
    assert f"{flag}={too_large}" in msg, msg
    safe = int(re.search(rf"largest safe {flag} is (\d+)", msg).group(1))
    check_limits(spec, ep, safe, **limits)  # the named value fits ...
    try:
        check_limits(spec, ep, safe + 1, **limits)  # ... and is the largest that does
    except BufferLimitError:
        return
    raise AssertionError(f"{safe} is not the largest safe value")


def run_ranks(argv_of: Callable[[int], list[str]], world: int, timeout: float = 300, grace: float = 30,
              env: dict[str, str] | None = None) -> list[str]:
    """Run one process per rank (argv_of(rank)) and return each rank's output; every rank must print "RANK r OK".

    A rank that exits non-zero gives the others `grace` seconds, a run past `timeout` stops: either way every
    rank still running first gets SIGUSR1 (the workers register faulthandler on it, so a hung rank prints its
    Python stacks), then is killed, and the failure shows every rank's output. Output goes to files, not
    pipes, so a chatty rank cannot block on a full pipe while another is waited on.
    """
    with tempfile.TemporaryDirectory() as tmp:
        logs = [open(Path(tmp) / f"rank{r}.log", "w+") for r in range(world)]
        procs = [subprocess.Popen(argv_of(r), stdout=logs[r], stderr=subprocess.STDOUT, text=True, env=env)
                 for r in range(world)]
        stop_at, why = time.monotonic() + timeout, f"ran past {timeout:.0f} s (hang)"
        while any(p.poll() is None for p in procs) and time.monotonic() < stop_at:
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed and why.endswith("(hang)"):
                stop_at = min(stop_at, time.monotonic() + grace)
                why = f"rank {failed[0]} exited {procs[failed[0]].returncode}; the others got {grace:.0f} s"
            time.sleep(0.2)
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for r in hung:
            procs[r].send_signal(signal.SIGUSR1)
        time.sleep(2 if hung else 0)
        for r in hung:
            procs[r].kill()
            procs[r].wait()
        outs = []
        for log in logs:
            log.seek(0)
            outs.append(log.read())
            log.close()
    report = "\n".join(f"--- rank {r} (exit {p.returncode}{', hung' if r in hung else ''}):\n{out[-5000:]}"
                       for r, (p, out) in enumerate(zip(procs, outs)))
    assert not hung, f"{why}: ranks {hung} stopped\n{report}"
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"RANK {r} OK" in out, f"rank {r} failed\n{report}"
    return outs


def engine_env_python(script: str, *args: str) -> str:
    """Build (once, cached) an engine environment with scripts/<script> and return its interpreter."""
    proc = subprocess.run(["bash", str(REPO / "scripts" / script), *args], capture_output=True, text=True,
                          timeout=3600)
    assert proc.returncode == 0, f"{script} {' '.join(args)} failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]


def all_engine_cases() -> bool:
    """ATOM_MOE_ENGINE_ALL_CASES=1 (or the older ATOM_MOE_VLLM_ALL_CASES=1): run every engine case, not CI's subset."""
    return "1" in (os.environ.get("ATOM_MOE_ENGINE_ALL_CASES"), os.environ.get("ATOM_MOE_VLLM_ALL_CASES"))


def run_engine_suite(python: str, cases: str, label: str, min_passed: int, select: str | None = None,
                     **env_vars: str) -> None:
    """Run tests/<cases> under `python` with ATOM_USE_FLYDSL=1; every case must pass, none skipped.

    select: a pytest -k expression; then exactly `min_passed` cases must pass and the rest be deselected."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ATOM_USE_FLYDSL", "ATOM_FLYDSL", "ATOM_MOE_MXFP4_ACT"))}
    env.update(ATOM_USE_FLYDSL="1", **env_vars)  # MXFP4 layers at the default (a16w4) unless a case sets it
    env.pop("TRITON_INTERPRET", None)  # the engines' CPU path is experts_torch; cases that need it set it
    # -P: keep the checkout root off sys.path, so a stale in-tree *.egg-info cannot hide our entry point
    proc = subprocess.run([python, "-P", "-m", "pytest", f"tests/{cases}", "-q", "-p", "no:cacheprovider",
                           "-o", "addopts=", "-rfEs", "--durations=12"] + (["-k", select] if select else []),
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=3300)
    out = proc.stdout + proc.stderr
    print(out[-6000:])
    assert proc.returncode == 0, f"{label} cases failed:\n{out[-12000:]}"
    summary = re.search(r"(\d+) passed", out)
    if select:
        assert summary and int(summary.group(1)) == min_passed, out[-3000:]
        assert not re.search(r"\d+ (failed|skipped|error)", out), out[-3000:]
    else:
        assert summary and int(summary.group(1)) >= min_passed, out[-3000:]
        assert not re.search(r"\d+ (failed|skipped|error|deselected)", out), out[-3000:]
