"""Tile configs: tuned CSV tables (kernels/configs/*.csv plus override dirs), else a heuristic.

A row's key is (device, scheme, H, I, E, top_k) and a token bucket; the lookup takes the
row of the nearest bucket (in log2 tokens) for the exact key. CSVs in the directories
named by ATOM_FLYDSL_KERNELS_PATH or ATOM_MOE_CONFIG_DIR (os.pathsep-separated) take
precedence over the shipped ones. Without a row the heuristic answers, logged once per shape.
Caches are keyed on plain values (paths, shapes), never on tensors.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

log = logging.getLogger("atom_moe.kernels")

CONFIG_DIR = Path(__file__).parent / "configs"
ENV_VARS = ("ATOM_FLYDSL_KERNELS_PATH", "ATOM_MOE_CONFIG_DIR")
KEY_COLUMNS = ("device", "scheme", "H", "I", "E", "top_k", "tokens")
CONFIG_COLUMNS = ("block_m", "block_n1", "block_k1", "warps1", "stages1",
                  "block_n2", "block_k2", "warps2", "stages2", "group_m", "split_k1", "split_k2",
                  "maxnreg1", "maxnreg2", "ahead2")
# tables written before these columns existed read as unsplit, uncapped and without lookahead
OPTIONAL_COLUMNS = {"split_k1": 1, "split_k2": 1, "maxnreg1": 0, "maxnreg2": 0, "ahead2": 0}
COLUMNS = KEY_COLUMNS + CONFIG_COLUMNS + ("us",)


class ConfigError(ValueError):
    """A malformed tile-config table or an invalid tile config."""


@dataclass(frozen=True)
class TileConfig:
    """Tiles and launch shape of the three kernels (BLOCK_M is shared: it pads the routing)."""

    block_m: int
    block_n1: int
    block_k1: int
    warps1: int
    stages1: int
    block_n2: int
    block_k2: int
    warps2: int
    stages2: int
    group_m: int = 8
    split_k1: int = 1  # GEMM1's K split (small batches): kernels/gemm1.py
    split_k2: int = 1  # GEMM2's K split (small batches, local counter combine): kernels/gemm2.py
    # registers per thread ptxas may use (Triton's maxnreg, NVIDIA only; 0: no cap): a cap trades spills
    # for resident CTAs (a16w4's 128-k tiles: 122 registers, 4 CTAs per SM; docs/perf/a16w4-rotation-h200.md)
    maxnreg1: int = 0
    maxnreg2: int = 0
    # GEMM2 programs ask L2 for the weight tile of the program this many places later (0: off; NVIDIA sm_90+,
    # unsplit GEMM2): kernels/gemm2.py `ahead`
    ahead2: int = 0

    def check(self, scheme: str) -> None:
        """Raise ConfigError unless the kernels accept this config for `scheme`."""
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name.startswith("maxnreg"):
                if not isinstance(v, int) or not (v == 0 or MIN_MAXNREG <= v <= MAX_MAXNREG):
                    raise ConfigError(f"tile config {f.name}={v!r}: allowed 0 (no cap) or {MIN_MAXNREG}..{MAX_MAXNREG}")
            elif f.name == "ahead2":
                if not isinstance(v, int) or not 0 <= v <= MAX_AHEAD:
                    raise ConfigError(f"tile config ahead2={v!r}: allowed 0 (off) to {MAX_AHEAD} programs")
            elif not isinstance(v, int) or v < 1:
                raise ConfigError(f"tile config {f.name} must be a positive int, got {v!r}")
        for name in ("block_m", "block_n1", "block_k1", "block_n2", "block_k2"):
            v = getattr(self, name)
            if v & (v - 1) or v < 16:
                raise ConfigError(f"tile config {name}={v}: allowed powers of two >= 16")
        if self.block_m > MAX_BLOCK_M:
            raise ConfigError(f"block_m={self.block_m} exceeds the workspace bound {MAX_BLOCK_M}")
        if self.block_n2 < MIN_BLOCK_N2:
            raise ConfigError(f"block_n2={self.block_n2} is below {MIN_BLOCK_N2} (combine counters per token)")
        # GEMM1's tile holds whole quant groups of GEMM2's input (fp8 128, a8w4 64) and GEMM2 steps K by
        # one group; a8w4's GEMM1 may step K by 64 too (x's scale, per 128-group, is applied per step)
        if scheme == "fp8" and (self.block_n1, self.block_k1, self.block_k2) != (256, 128, 128):
            raise ConfigError(f"fp8 needs block_n1=256, block_k1=128, block_k2=128 (whole 128-groups), got "
                              f"{self.block_n1}, {self.block_k1}, {self.block_k2}")
        if scheme == "fp8" and self.block_n2 > 256:  # GEMM2 reads two 128-row w2 scale blocks per tile at most
            raise ConfigError(f"fp8 needs block_n2 <= 256 (at most two 128-row blocks of w2's scales), got "
                              f"{self.block_n2}")
        if scheme == "a8w4" and (self.block_n1 not in (128, 256) or self.block_k1 not in (64, 128)
                                 or self.block_k2 != 64):
            raise ConfigError(f"a8w4 needs block_n1 in (128, 256), block_k1 in (64, 128) and block_k2=64 (whole "
                              f"64-groups of GEMM2's input), got {self.block_n1}, {self.block_k1}, {self.block_k2}")
        for name in ("split_k1", "split_k2"):
            if getattr(self, name) > MAX_SPLIT_K:
                raise ConfigError(f"{name}={getattr(self, name)}: allowed 1..{MAX_SPLIT_K}")
        if self.ahead2 and self.split_k2 > 1:
            raise ConfigError(f"ahead2={self.ahead2} prefetches whole-K GEMM2 tiles: allowed with split_k2=1 only, "
                              f"got split_k2={self.split_k2}")
        if scheme in MXFP4 and (self.block_n1 % 16 or self.block_n2 % 16 or self.block_k1 % 64 or self.block_k2 % 64):
            raise ConfigError(f"{scheme} needs block_n1, block_n2 multiples of 16 and block_k1, block_k2 multiples "
                              f"of 64 (whole MX tile blocks), got n {self.block_n1}, {self.block_n2}, "
                              f"k {self.block_k1}, {self.block_k2}")


FP8_ACT = ("fp8", "a8w4")  # e4m3 activations: tiles hold whole quant groups (Scheme.inter_group)
MXFP4 = ("a16w4", "a8w4")  # e2m1 weights with one e8m0 scale per 32 along K
MAX_BLOCK_M = 128  # the workspace is sized for the largest BLOCK_M
MIN_MAXNREG, MAX_MAXNREG = 64, 255  # the floor keeps a typo from building a spill-bound kernel; 255 is the per-thread limit
MAX_SPLIT_K = 8  # kernels/common.py's bound (no triton import here)
MAX_AHEAD = 4096  # kernels/common.py's
SPLIT_MAX_PAIRS = 128  # kernels/common.py's: split-K only for decode batches
MIN_BLOCK_M = 16
FILL_PROGRAMS = 160  # bf16 / fp8 at T = 1: GEMM1's K split doubles while its programs stay within this many
A8W4_FILL_PROGRAMS = 300  # ... and a8w4's
FILL_MAX_SPLIT = 4
# A tuned row serves T up to this factor away from its bucket; further out the heuristic, which follows the rows per
# expert, runs: the H100 table's one qwen3 a8w4 row (T = 1, 16-row tiles) took 3.0x the heuristic's time at T = 8192
# (2026-12-06, docs/perf/a8w4-128-row-tune-h100-2026-12-06-trials.csv). The shipped tables step by 4x, so every T
# between two buckets is within 2x of one
BUCKET_REACH = 4
A8W4_ROWS_16 = 8  # a8w4 from T = 2: 16-row tiles up to this many rows per expert, 32-row ones above
A8W4_ROWS_64 = 32  # ... and 64-row ones from this many on
A8W4_ROWS_128 = 160  # ... and 128-row ones with 8 warps from this many on
MIN_BLOCK_N2 = 32

_tables: dict[tuple[str, ...], list[list[dict]]] = {}
_warned: set[tuple] = set()


def clear_cache() -> None:
    """Forget loaded tables and logged shapes (tests, or after editing CSVs)."""
    _tables.clear()
    _warned.clear()


def override_dirs() -> tuple[str, ...]:
    """Directories named by the override env vars, in precedence order."""
    out: list[str] = []
    for var in ENV_VARS:
        out += [d for d in os.environ.get(var, "").split(os.pathsep) if d]
    return tuple(out)


def _read_csv(path: Path) -> list[dict]:
    rows = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or []) and c not in OPTIONAL_COLUMNS]
        if missing:
            raise ConfigError(f"{path}: missing columns {missing}; expected {','.join(COLUMNS)}")
        for line, raw in enumerate(reader, start=2):
            try:
                row = {"device": raw["device"].strip().lower(), "scheme": raw["scheme"].strip().lower()}
                for c in KEY_COLUMNS[2:] + CONFIG_COLUMNS:
                    row[c] = int(raw[c]) if raw.get(c) not in (None, "") else OPTIONAL_COLUMNS[c]
                row["us"] = float(raw["us"]) if raw["us"].strip() else math.nan
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{path}:{line}: bad value ({exc}); columns: {','.join(COLUMNS)}") from None
            rows.append(row)
    return rows


def _load(dirs: tuple[str, ...]) -> list[list[dict]]:
    """Rows grouped by source, highest precedence first."""
    if dirs not in _tables:
        groups = []
        for d in dirs:
            path = Path(d)
            if not path.is_dir():
                raise ConfigError(f"config dir {d!r} (from {' or '.join(ENV_VARS)}) is not a directory")
            groups.append([r for f in sorted(path.glob("*.csv")) for r in _read_csv(f)])
        groups.append([r for f in sorted(CONFIG_DIR.glob("*.csv")) for r in _read_csv(f)])
        _tables[dirs] = groups
    return _tables[dirs]


def heuristic(scheme: str, hidden: int, inter: int, num_experts: int, top_k: int, tokens: int) -> TileConfig:
    """A config from the shape alone: BLOCK_M follows the rows per expert; tiles are the ones
    that won most often in the H200 tuning (kernels/configs/nvidia_h200.csv)."""
    rows = tokens * top_k / max(1, num_experts)  # rows per expert under uniform routing
    bm = 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 128 else 128
    # MXFP4 schemes start from their activation twin's tiles (a8w4 ~ fp8, a16w4 ~ bf16), all of
    # them whole MX tile blocks; their own H200 rows come from `atom-moe tune`.
    if scheme == "a8w4":  # two fp32 accumulators of block_n1 x BLOCK_M: GEMM1 128 rows wide; BLOCK_M <= 64
        # (on an H200, gpt-oss, 128 rows beat 256 at every T measured, docs/perf/mxfp4-h200.md; on an H100 256
        # rows ran 1.2-1.6x slower at T = 1-512 on DeepSeek-V3). GEMM1 steps K by 128 from T = 2 on: on an H100
        # (2026-12-06, `atom-moe tune --configs`, six served shapes, T = 8-8192) the layer took 0.87-0.99 of
        # the 64-k step's time in 27 of 28 keys, 2 % more in one (docs/perf/a8w4-tiles-sass.md)
        if tokens == 1:  # top_k pairs: few GEMM1 programs, split as bf16 / fp8's are but to more of them (a8w4's
            # lighter programs, 84 registers against fp8's 178, fit more per SM): on an H100 (2026-12-07, `atom-moe
            # tune --space split`, docs/perf/split-fill-h100.md) split 4 took 0.92-0.93 of split 2's time at 36-72
            # programs (GLM-5.2-TP8 / TP4, V4.1-Flash-TP4), 2 was best at 108 (V4.1-Flash-TP2), none at 192
            # (GLM-4.5); the 64-k step lost to this 128-k one at T = 1 too (gpt-oss, 1.10x)
            return _fill(TileConfig(16, 128, 128, 4, 4, 64, 64, 4, 4), hidden, inter, num_experts, top_k, tokens,
                         A8W4_FILL_PROGRAMS)
        # BLOCK_M by its own thresholds, GEMM2 128 wide with 4 warps at 64 rows: on an H200 (2026-12-06, `atom-moe
        # tune --configs`, eight served shapes x T = 1-8192, docs/perf/tune-h200-a8w4-2026-12-06.md) 32-row tiles
        # won all five keys with 8 < rows < 32 (16 rows took 1.21-1.34x), 64 rows with that GEMM2 all 17 keys
        # from 32 rows on (the 256-wide 8-warp GEMM2 took 1.06-1.10x, 32 rows 1.02-1.43x). At 8 rows 32 won
        # twice (V4.1-Flash T = 512: 16 rows 1.08-1.13x) and lost once (Qwen3 T = 128: 1.17x): 8 rows keep 16
        if rows <= A8W4_ROWS_16:
            return TileConfig(16, 128, 128, 4, 4, 64, 64, 4, 4)
        if rows < A8W4_ROWS_64:
            return TileConfig(32, 128, 128, 4, 4, 64, 64, 4, 4)
        # With one accumulator in both GEMMs (GEMM2's input per token), 128-row tiles no longer spill: on an H100
        # (2026-12-06, `tune --configs`) 128 x 128 x 128 with a 256-wide GEMM2, 8 warps each, took 0.89-0.96 of
        # the 64-row time at T = 8192 on five served shapes (170-512 rows); at T = 2048 (43-128 rows) 64 rows
        # stayed best (docs/perf/a8w4-one-accumulator-h100.md, section 6)
        if rows >= A8W4_ROWS_128:
            return TileConfig(128, 128, 128, 8, 3, 256, 64, 8, 3)
        return TileConfig(64, 128, 128, 4, 3, 128, 64, 4, 3)
    if scheme in FP8_ACT:  # BLOCK_M 128 with a 256-wide fp32 tile spills: cap at 64
        # From 17 rows per expert on, 64-row tiles with 8 warps: on an H200 (2026-12-02) the 32-row
        # 4-warp tile ran 2.0-2.7x slower at 18-32 rows (GLM-5.2 T=512, DeepSeek-V4.1-Flash T=2048)
        if bm <= 16:
            return _fill(TileConfig(bm, 256, 128, 4, 4, 128, 128, 4, 4), hidden, inter, num_experts, top_k, tokens)
        return TileConfig(64, 256, 128, 8, 3, 128, 128, 8, 3)
    if scheme == "bf16" and tokens >= 2048 and 16 < rows <= 128:
        # On an H200 (2026-12-05, `atom-moe tune --configs`) 128 x 256 tiles with 4 stages beat the configs run
        # before (32- and 64-row, 4 warps) by 3-27 % on all 9 keys timed: T = 2048 and 8192, 32-128 rows per
        # expert, seven shapes; where a 64-row 8-warp tile won, it was by 2 % at most (docs/perf/kernels-h200.md)
        return TileConfig(128, 256, 64, 8, 4, 256, 64, 8, 4)
    if bm == 16 and scheme == "bf16":
        return _fill(TileConfig(16, 128, 128, 4, 3, 128, 128, 4, 3), hidden, inter, num_experts, top_k, tokens)
    if bm <= 64:  # a16w4 at 16 rows too: on an H200 (2026-12-04) its 128-k step was 1-13 % slower than this 64-k
        # one at T = 1-512 on kimi-k2, glm-4.5, qwen3 and deepseek-v3 (docs/perf/a16w4-rotation-h200.md)
        return TileConfig(bm, 128, 64, 4, 4, 128, 64, 4, 4)
    return TileConfig(128, 256, 64, 8, 3, 256, 64, 8, 3)


def _fill(cfg: TileConfig, hidden: int, inter: int, num_experts: int, top_k: int, tokens: int,
          limit: int = FILL_PROGRAMS) -> TileConfig:
    """cfg with GEMM1's K split at T = 1, so the top_k experts' few GEMM1 programs fill more SMs: the split doubles,
    up to FILL_MAX_SPLIT, while programs x split stays within `limit` and each slice keeps a K step. The
    seed shapes run 18-72 programs at T = 1 (GLM-5.2-TP8 fp8: 9 experts x 2 tiles); on an H200 the tuner's split
    sweep picked 4 for 18-36 programs and 2 for 54 (kernels/configs/nvidia_h200.csv); at 96 (Qwen3) no split won,
    and at 128 (DeepSeek-V3) its split-2 pick lost to the unsplit row in the bench (docs/perf/split-k-h200.md).
    This rule makes the same choices. On an H100 it took 0.74-1.00 of the unsplit time on
    the seven seed keys it changes (docs/perf/split-fill-h100.md); at T = 4 (GLM-5.2-TP8 fp8, 72 programs, split 2)
    1 % more, so it stays a T = 1 rule."""
    if tokens != 1:
        return cfg
    programs = min(num_experts, top_k) * -(-2 * inter // cfg.block_n1)
    steps = -(-hidden // cfg.block_k1)
    split = 1
    while split < FILL_MAX_SPLIT and programs * split * 2 <= limit and steps >= 2 * split:
        split *= 2
    return replace(cfg, split_k1=split)


def lookup(device: str, scheme: str, hidden: int, inter: int, num_experts: int, top_k: int,
           tokens: int) -> TileConfig:
    """Tuned config of the nearest token bucket for this exact shape, if within BUCKET_REACH of T; else the
    heuristic (logged once per shape and reason)."""
    device, scheme = device.strip().lower(), scheme.lower()
    key = (device, scheme, hidden, inter, num_experts, top_k)
    for group in _load(override_dirs()):
        rows = [r for r in group if (r["device"], r["scheme"], r["H"], r["I"], r["E"], r["top_k"]) == key]
        if rows:
            best = min(rows, key=lambda r: (bucket_distance(r["tokens"], tokens), r["tokens"]))
            if not within_reach([best["tokens"]], tokens):
                if (key, "far") not in _warned:
                    _warned.add((key, "far"))
                    log.warning("tuned rows for %s are at T = %s only: T = %d and others more than %dx away from "
                                "them use the heuristic", _describe(key),
                                ", ".join(str(t) for t in sorted({r["tokens"] for r in rows})), tokens, BUCKET_REACH)
                break
            cfg = TileConfig(**{c: best[c] for c in CONFIG_COLUMNS})
            cfg.check(scheme)
            return cfg
    else:
        if key not in _warned:
            _warned.add(key)
            log.warning("no tuned config for %s, using heuristic", _describe(key))
    return heuristic(scheme, hidden, inter, num_experts, top_k, tokens)


def bucket_distance(bucket: int, tokens: int) -> float:
    """How far a tuned token bucket is from T, in doublings."""
    return abs(math.log2(bucket) - math.log2(max(tokens, 1)))


def within_reach(buckets: list[int], tokens: int) -> bool:
    """Whether `lookup` takes a tuned row for T from these buckets, rather than the heuristic."""
    return any(bucket_distance(b, tokens) <= math.log2(BUCKET_REACH) for b in buckets)


def tuned_buckets(device: str, scheme: str, hidden: int, inter: int, num_experts: int, top_k: int
                  ) -> tuple[list[int], str | None]:
    """Token buckets with a row for this exact shape in the table `lookup` would read, and its source."""
    key = (device.strip().lower(), scheme.lower(), hidden, inter, num_experts, top_k)
    sources = list(override_dirs()) + [str(CONFIG_DIR)]
    for source, group in zip(sources, _load(override_dirs())):
        rows = [r for r in group if (r["device"], r["scheme"], r["H"], r["I"], r["E"], r["top_k"]) == key]
        if rows:
            return sorted({r["tokens"] for r in rows}), source
    return [], None


def table_devices() -> list[str]:
    """Every device named in the tables `lookup` reads (lower case)."""
    return sorted({r["device"] for group in _load(override_dirs()) for r in group})


def _describe(key: tuple) -> str:
    device, scheme, hidden, inter, num_experts, top_k = key
    return f"device={device} scheme={scheme} H={hidden} I={inter} E={num_experts} top_k={top_k}"
