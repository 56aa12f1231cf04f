"""The `atom-moe` command line: the demo's table (Triton rows included on the CPU), and for every
subcommand one-line errors naming the bad value, exit 2 for usage errors and 1 for runtime failures,
and help text with the default for every option."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

import pytest
import torch

from atom_moe.tools import demo
from atom_moe.tools.cli import SUBCOMMANDS, build_parser, main

NO_GPU = not torch.cuda.is_available()
ROW = re.compile(r"^(triton|torch)\s+(\w+)\s+H(\d+) I(\d+) E(\d+) k(\d+) T(\d+)\s+(\d+)\s+(\S+)\s+(\S+)\s+(.*)$")


def _rows(out: str) -> dict[tuple[str, str], re.Match]:
    return {(m[1], m[2]): m for m in map(ROW.match, out.splitlines()) if m}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU demo's Triton rows need the "
                    "interpreter, which must be chosen before the kernels are imported (test.sh does on a CPU)")
def test_cpu_demo_runs_the_triton_kernels_next_to_the_torch_twin(capsys, seed):
    assert main(["demo", "--device", "cpu", "--repeats", "1", "--seed", str(seed)]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert {k for k in rows} == {(p, s) for p in ("triton", "torch") for s in ("bf16", "fp8", "a16w4", "a8w4")}
    assert "scaled to H128 I128 E8 k4 T16 for Triton's interpreter on the CPU" in out
    assert "deepseek-v3 is H7168 I2048 E256 k8" in out
    for (path, scheme), m in rows.items():
        err, ms = float(m[9]), float(m[10])  # numbers, never n/a: the kernels ran
        # vs the fp32 reference: bf16/a16w4 weights are the reference's; fp8/a8w4 quantize activations too
        assert 0 < err < (1e-2 if scheme in ("bf16", "a16w4") else 5e-2), (path, scheme, err)
        assert ms > 0
        if path == "triton":
            assert "Triton kernels in Triton's interpreter" in m[11]
            # the kernels and their torch twin compute the same thing: their errors vs fp32 agree
            assert abs(err - float(rows[("torch", scheme)][9])) < 0.2 * err
    assert "the Triton rows are one call in Triton's interpreter" in out and re.search(r"done in [\d.]+ s", out)


def test_demo_ep_shares_sum_to_layer(seed):
    rows = demo.run_scheme("qwen3-235b-a22b", demo.Scheme.BF16, torch.device("cpu"), ep=4, tokens=16,
                           seed=seed, paths=[p for p in demo.available_paths(torch.device("cpu"))
                                             if p.name == "torch"], repeats=1)
    assert rows[0]["ep"] == 4 and rows[0]["rel_err"] < 1e-2


def test_demo_no_triton_says_why(capsys):
    assert main(["demo", "--device", "cpu", "--scheme", "bf16", "--tokens", "8", "--repeats", "1",
                 "--no-triton"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows[("triton", "bf16")][9] == "n/a" and "left out (--no-triton)" in rows[("triton", "bf16")][11]
    assert float(rows[("torch", "bf16")][9]) < 1e-2


def test_demo_ep_is_checked_against_the_scaled_layer():
    cpu = torch.device("cpu")
    assert demo.allowed_ep("deepseek-v3", cpu) == [1, 2, 4, 8]  # 8 experts on the CPU; 256 divide by all
    assert demo.allowed_ep("glm-4.5", torch.device("cuda")) == [1, 2, 4, 8, 16, 32]  # 64 experts; 160 not by 64


def test_demo_closing_lines_say_what_the_numbers_mean():
    rows = [{"path": "triton", "scheme": "bf16", "ms": 0.5}, {"path": "torch", "scheme": "bf16", "ms": 2.0},
            {"path": "triton", "scheme": "fp8", "ms": float("nan")}, {"path": "torch", "scheme": "fp8", "ms": 3.0}]
    gpu = demo.meaning(torch.device("cuda"), 5, rows)
    assert gpu[0].startswith("rel_err: ||out - ref|| / ||ref||")
    assert "median wall time of 5 CUDA-synchronized calls" in gpu[1] and gpu[1].endswith("torch twin: bf16 4.0x")
    cpu = demo.meaning(torch.device("cpu"), 3, rows)
    assert "one call in Triton's interpreter" in cpu[1] and "speed-up" not in cpu[1]


def test_cli_entry_point_runs_as_module():
    proc = subprocess.run([sys.executable, "-m", "atom_moe.tools.cli", "demo", "--help"], capture_output=True,
                          text=True)
    assert proc.returncode == 0 and "--model" in proc.stdout and "(default: deepseek-v3)" in proc.stdout


# (argv, exit code, text the one error line must contain)
BAD = [
    (["demo", "--model", "no-such-model"], 2, "argument --model: invalid choice: 'no-such-model'"),
    (["demo", "--tokens", "-5"], 2, "argument --tokens: '-5' is out of range; allowed: an integer >= 1"),
    (["demo", "--tokens", "0"], 2, "argument --tokens: '0' is out of range"),
    (["demo", "--tokens", "many"], 2, "argument --tokens: 'many' is not a number"),
    (["demo", "--device", "cpu", "--ep", "3"], 2, "--ep 3: allowed for deepseek-v3 on cpu: 1, 2, 4, 8"),
    (["demo", "--ep", "0"], 2, "argument --ep: '0' is out of range"),
    (["demo", "--repeats", "0"], 2, "argument --repeats: '0' is out of range"),
    (["demo", "--scheme", "int4"], 2, "argument --scheme: invalid choice: 'int4'"),
    (["nope"], 2, "invalid choice: 'nope'"),
    (["bench", "--tokens", "0"], 2, "argument --tokens: '0' is out of range"),
    (["bench", "--shapes", "llama"], 2, "argument --shapes: invalid choice: 'llama'"),
    (["bench", "--vllm-src", "/no/such/dir"], 2,
     "argument --vllm-src: '/no/such/dir' has no vllm/model_executor/layers/fused_moe/fused_moe.py; allowed: a folder"),
    (["bench", "--vllm-check-rows", "0"], 2, "argument --vllm-check-rows: '0' is out of range"),
    (["breakdown", "--iters", "-1"], 2, "argument --iters: '-1' is out of range"),
    (["gsm8k", "--concurrency", "0"], 2, "argument --concurrency: '0' is out of range"),
    (["gsm8k", "--base-url", "localhost:1"], 2, "--base-url must start with http://"),
    (["plan", "deepseek-v3", "--gpu-memory-gib", "140", "--ep", "-8"], 2, "argument --ep: '-8' is out of range"),
    (["plan", "deepseek-v3", "--gpu-memory-gib", "140", "--buffer-share", "2"], 2,
     "argument --buffer-share: '2' is out of range; allowed: a number in (0, 1]"),
    (["plan", "deepseek-v3", "--gpu-memory-gib", "140", "--tp", "8", "--dp", "8", "--gpus", "8"], 2,
     "--tp 8 x --dp 8 = 64 GPUs, but --gpus 8"),
    (["plan", "deepseek-v3", "--gpu-memory-gib", "140", "--ep", "8", "--tokens", "17000"], 1,
     "does not fit"),
    (["accuracy", "--tokens", "0"], 2, "argument --tokens: '0' is out of range"),
    (["accuracy", "--paths", "cuda"], 2, "unknown ['cuda']; allowed: triton, torch"),
    (["tune", "deepseek-v3", "--ep", "0"], 2, "argument --ep: '0' is out of range"),
    (["env", "deepseek-v3", "--ep", "3"], 2, "--ep 3: deepseek-v3 has 256 experts; allowed: divisors of 256"),
    (["env", "deepseek-v3", "--scheme", "int4"], 2, "argument --scheme: invalid choice: 'int4'"),
    (["env", "no-such-model"], 2, "neither a preset"),
]
if NO_GPU:  # valid requests this machine cannot carry out: runtime failures
    BAD += [(["demo", "--device", "cuda"], 1, "--device cuda asked for, but torch sees no CUDA device here"),
            (["bench"], 1, "needs a CUDA GPU"), (["breakdown"], 1, "needs a CUDA GPU"),
            (["tune", "deepseek-v3"], 1, "no CUDA GPU here"),
            (["accuracy", "--device", "cuda"], 1, "torch sees no CUDA device here")]


@pytest.mark.parametrize("argv, code, text", BAD, ids=[" ".join(b[0]) for b in BAD])
def test_bad_values_give_one_line_and_the_exit_code(argv, code, text, capsys, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "0"))  # restored afterwards
    assert main(argv) == code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    command = argv[0] if argv[0] in SUBCOMMANDS else None
    assert err and text in err[-1], err
    assert all("Traceback" not in line for line in err)
    if code == 2:  # usage errors: exactly one line, naming the command
        assert len(err) == 1 and err[0].startswith(f"atom-moe {command}: error:" if command else "atom-moe: error:")


def test_every_option_has_help_and_shows_its_default():
    parser, _ = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert set(sub.choices) == set(SUBCOMMANDS)
    for name, p in sub.choices.items():
        text = p.format_help()
        for action in p._actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = action.option_strings[-1]
            assert action.help, f"atom-moe {name} {flag} has no help text"
            if action.nargs == 0:
                continue  # a switch: off unless given
            shown = p._get_formatter()._get_help_string(action)
            assert "default" in shown or "none:" in shown, f"atom-moe {name} {flag}: no default shown ({shown!r})"
        assert "(default:" in text
