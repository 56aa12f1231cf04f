"""Fused or split combine for the symm transport, chosen per call from measured thresholds.

fused: GEMM2's epilogue pushes one weighted row per (token, slot) to the token's rank;
        no local combine pass, k rows per token cross the link.
split: GEMM2 first combines a token's slots on each owning rank (the counter pass of
        kernels/gemm2.py), then pushes one row per (token, rank): fewer bytes on the link,
        one more local round trip.
Thresholds live beside the tile tables, in `configs/ep/*.csv` under kernels/ and under
every directory of ATOM_FLYDSL_KERNELS_PATH / ATOM_MOE_CONFIG_DIR (which take precedence):
    device, scheme, H, I, E, top_k, ep, wire, fused_max_tokens, fused_us, split_us
A call with T <= fused_max_tokens tokens on this rank runs fused, else split. They are
written by `scripts/ep_bench.py` from measurements; with no row the op runs fused at every
size and logs that once per shape.
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path

import torch

from ..spec import MoESpec
from .symm import FUSED, SPLIT

log = logging.getLogger("atom_moe.ep")

COLUMNS = ("device", "scheme", "H", "I", "E", "top_k", "ep", "wire", "fused_max_tokens", "fused_us", "split_us")
_cache: dict[tuple, int | None] = {}
_warned: set[tuple] = set()


def _dirs() -> list[Path]:
    from ..kernels import tuning  # the tile tables' directories, same precedence

    return [Path(d) / "ep" for d in tuning.override_dirs()] + [tuning.CONFIG_DIR / "ep"]


def read_thresholds(path: Path) -> list[dict]:
    """Rows of one threshold CSV, typed; ValueError naming the file and line on a bad row."""
    rows = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: missing columns {missing}; expected {','.join(COLUMNS)}")
        for line, raw in enumerate(reader, start=2):
            try:
                rows.append({"device": raw["device"].strip().lower(), "scheme": raw["scheme"].strip().lower(),
                             "wire": raw["wire"].strip().lower(),
                             **{c: int(raw[c]) for c in ("H", "I", "E", "top_k", "ep", "fused_max_tokens")}})
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{line}: bad value ({exc}); columns: {','.join(COLUMNS)}") from None
    return rows


def fused_max_tokens(device: str, scheme: str, hidden: int, inter: int, num_experts: int, top_k: int, ep: int,
                     wire: str) -> int | None:
    """The measured threshold for this shape, or None when no table has a row."""
    key = (device.strip().lower(), scheme, hidden, inter, num_experts, top_k, ep, wire)
    if key not in _cache:
        _cache[key] = None
        for d in _dirs():
            rows = [r for f in sorted(d.glob("*.csv")) for r in read_thresholds(f)
                    if (r["device"], r["scheme"], r["H"], r["I"], r["E"], r["top_k"], r["ep"], r["wire"]) == key]
            if rows:
                _cache[key] = rows[0]["fused_max_tokens"]
                break
    return _cache[key]


def clear_cache() -> None:
    """Forget loaded thresholds (tests, or after editing CSVs)."""
    _cache.clear()
    _warned.clear()


def combine_mode(spec: MoESpec, ep: int, wire: str, tokens: int, device: torch.device) -> int:
    """FUSED or SPLIT for a call with `tokens` tokens on this rank."""
    from ..experts import device_name

    name = device_name(device)
    limit = fused_max_tokens(name, spec.scheme.value, spec.hidden_size, spec.intermediate_size, spec.num_experts,
                             spec.top_k, ep, wire)
    if limit is None:
        key = (name, spec.scheme.value, spec.hidden_size, spec.intermediate_size, spec.num_experts, spec.top_k, ep, wire)
        if key not in _warned:
            _warned.add(key)
            log.warning("no measured fused/split threshold for device=%s scheme=%s H=%d I=%d E=%d top_k=%d ep=%d "
                        "wire=%s; using the fused combine at every size", *key)
        return FUSED
    return FUSED if tokens <= limit else SPLIT
