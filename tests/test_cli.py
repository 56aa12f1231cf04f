"""The README's main command: `atom-moe demo` prints its table with small errors."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from atom_moe.tools import demo
from atom_moe.tools.cli import main


def test_demo_table_bf16_error_small(capsys):
    assert main(["demo", "--device", "cpu", "--tokens", "24", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("torch ")]
    assert {r[1] for r in rows} == {"bf16", "fp8", "a16w4", "a8w4"}
    errors = {}
    for r in rows:
        match = re.search(r"\s(\d\.\d\de-\d\d)\s", " ".join(r) + " ")
        errors[r[1]] = float(match.group(1))
    assert errors["bf16"] < 1e-2 and errors["a16w4"] < 1e-2
    assert errors["fp8"] < 5e-2 and errors["a8w4"] < 5e-2


def test_demo_ep_shares_sum_to_layer():
    rows = demo.run_scheme("qwen3-235b-a22b", demo.Scheme.BF16, demo.torch.device("cpu"), ep=4, tokens=16,
                           seed=3, paths=[p for p in demo.available_paths(demo.torch.device("cpu"))
                                          if p.name == "torch"], repeats=1)
    assert rows[0]["ep"] == 4 and rows[0]["rel_err"] < 1e-2


def test_demo_reports_unavailable_paths_with_reason(capsys):
    main(["demo", "--device", "cpu", "--scheme", "bf16", "--tokens", "8", "--repeats", "1"])
    out = capsys.readouterr().out
    triton_rows = [line for line in out.splitlines() if line.startswith("triton ")]
    assert triton_rows, "the Triton path must be listed, with numbers or with the reason it did not run"
    for line in triton_rows:
        assert ("n/a" not in line) or ("unavailable" in line) or ("not implemented" in line)


def test_cli_entry_point_runs_as_module():
    proc = subprocess.run([sys.executable, "-m", "atom_moe.tools.cli", "demo", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--model" in proc.stdout


def test_bad_arguments_exit_with_message():
    with pytest.raises(SystemExit):
        main(["demo", "--model", "no-such-model"])
    with pytest.raises(SystemExit, match="--ep must be >= 1"):
        main(["demo", "--device", "cpu", "--ep", "0"])
