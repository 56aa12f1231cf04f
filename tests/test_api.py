"""The public API: what atom_moe exports, and docs/api.md's example, run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import atom_moe

DOC = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def test_public_names_exist_and_are_documented():
    for name in atom_moe.__all__:
        obj = getattr(atom_moe, name)  # AttributeError if __all__ names something missing
        if callable(obj) and not name.startswith("_"):
            doc = (obj.__doc__ or "").strip()
            assert doc, f"atom_moe.{name} has no docstring"
    for name in ("MoESpec", "preset", "load_model", "prepare_hf_experts", "prepare_gpt_oss", "prepare_stacked",
                 "route", "fused_experts", "allocate_workspace", "MegaMoE", "reference_moe", "ReferenceWeights"):
        assert name in atom_moe.__all__ and f"`{name}" in DOC.read_text(), name


def _example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/api.md should hold one python example"
    return blocks[0]


def _runs_here() -> bool:
    import os
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _runs_here(), reason="the example's fused_experts needs a GPU or TRITON_INTERPRET=1")
def test_api_example_runs_and_matches_the_reference(seed):
    scope: dict = {}
    exec(compile(_example(), str(DOC), "exec"), scope)
    assert scope["rel_err"] < 1e-2
    assert not any(k.endswith(".weight") and ".experts." in k for k in scope["ckpt"]), "the loader consumes the tensors"


def test_api_example_fails_on_a_planted_gate_up_swap(seed):
    """The example's check is real: with gate and up swapped on one side it fails."""
    if not _runs_here():
        pytest.skip("the example's fused_experts needs a GPU or TRITON_INTERPRET=1")
    gate, up = 'ckpt[f"{prefix}.{e}.gate_proj.weight"]', 'ckpt[f"{prefix}.{e}.up_proj.weight"]'
    code = _example()
    assert code.count(gate) == 1 and code.count(up) == 1
    code = code.replace(gate, "@GATE@").replace(up, gate).replace("@GATE@", up)  # the reference reads them swapped
    with pytest.raises(AssertionError):
        exec(compile(code, str(DOC), "exec"), {})
