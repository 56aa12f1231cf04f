"""`atom-moe env`: versions, device, schemes, tuned-row coverage read against the CSVs themselves,
the engines' entry points, and what would shadow the installed package."""

from __future__ import annotations

import csv
import importlib.metadata as md
import shutil

import torch

from atom_moe.kernels import tuning
from atom_moe.tools import env
from atom_moe.tools.cli import main


def _csv_buckets(device: str, scheme: str, H: int, I: int, E: int, k: int) -> list[int]:
    """The token buckets of the shipped tables for a key, read with csv alone (not through tuning)."""
    out = set()
    for path in sorted(tuning.CONFIG_DIR.glob("*.csv")):
        with open(path, newline="") as fh:
            for r in csv.DictReader(fh):
                if (r["device"].strip().lower(), r["scheme"], int(r["H"]), int(r["I"]), int(r["E"]),
                        int(r["top_k"])) == (device, scheme, H, I, E, k):
                    out.add(int(r["tokens"]))
    return sorted(out)


def test_report_lists_versions_schemes_and_tuned_coverage(capsys, monkeypatch):
    for var in tuning.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    assert main(["env", "gpt-oss-120b", "--device-name", "NVIDIA H200", "--ep", "1", "--ep", "4"]) == 0
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out and f"atom_moe {md.version('atom-moe')}" in out
    for scheme in ("bf16", "fp8", "a16w4", "a8w4"):
        assert f"  {scheme:<6} " in out
    tuned = _csv_buckets("nvidia h200", "a16w4", 2880, 2880, 128, 4)
    assert tuned, "the shipped table has gpt-oss a16w4 rows at EP 1"
    assert (f"nvidia h200 a16w4 EP 1 (H=2880 I=2880 E_local=128 top_k=4): tuned at T = "
            f"{', '.join(map(str, tuned))} (built-in table)") in out
    assert not _csv_buckets("nvidia h200", "a16w4", 2880, 2880, 32, 4)
    assert "nvidia h200 a16w4 EP 4 (H=2880 I=2880 E_local=32 top_k=4): no tuned rows: every T uses the heuristic" in out


def test_override_dir_from_either_variable_is_read_first(tmp_path, capsys, monkeypatch, seed):
    tokens = 16 + seed % 100
    shipped = (tuning.CONFIG_DIR / "nvidia_h200.csv").read_text().splitlines()
    row = shipped[1].split(",")
    row[4], row[6] = "32", str(tokens)  # deepseek-v3 bf16 at E_local = 32 (EP 8): not in the shipped table
    (tmp_path / "mine.csv").write_text(shipped[0] + "\n" + ",".join(row) + "\n")
    for var in tuning.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ATOM_MOE_CONFIG_DIR", str(tmp_path))  # the alias of ATOM_FLYDSL_KERNELS_PATH
    assert main(["env", "deepseek-v3", "--scheme", "bf16", "--ep", "8", "--device-name", "NVIDIA H200",
                 "--tokens", str(tokens), str(2 * tokens), "8192"]) == 0
    out = capsys.readouterr().out
    assert (f"EP 8 (H=7168 I=2048 E_local=32 top_k=8): tuned at T = {tokens} ({tmp_path}); T = {2 * tokens} use the "
            f"nearest tuned bucket; T = 8192 use the heuristic (more than {tuning.BUCKET_REACH}x from a tuned bucket)"
            ) in out
    monkeypatch.setenv("ATOM_MOE_CONFIG_DIR", str(tmp_path / "missing"))
    assert main(["env"]) == 1
    assert "names folders that do not exist" in capsys.readouterr().out


def test_entry_points_of_this_install_are_seen():
    lines, problems = env.entry_point_lines()
    assert not problems, problems  # the test environment has atom_moe installed (scripts/env.sh)
    assert any("vllm.general_plugins -> atom_moe.plugins.vllm:register" in line for line in lines)
    assert any("sglang.srt.plugins -> atom_moe.plugins.sglang:register" in line for line in lines)


def test_stray_egg_info_and_foreign_checkout_are_problems(tmp_path, monkeypatch):
    root = env.installed_root()
    assert root is not None
    lines, problems = env.shadowing(path=[str(root)])
    assert not problems, problems  # the install itself shadows nothing
    (tmp_path / "atom_moe.egg-info").mkdir()
    monkeypatch.chdir(tmp_path)
    lines, problems = env.shadowing(path=["", str(root)])  # '' is the current folder, as with python -m
    assert len(problems) == 1 and "atom_moe.egg-info is on sys.path (the current folder)" in problems[0]
    other = tmp_path / "old-checkout"
    shutil.copytree(root / "atom_moe", other / "atom_moe", ignore=shutil.ignore_patterns("__pycache__"))
    lines, problems = env.shadowing(path=[str(other), str(root)])
    assert len(problems) == 1 and f"finds the source checkout {other}" in problems[0]
