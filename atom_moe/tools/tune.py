"""`atom-moe tune`: tile configs for the fused experts, measured inside the MegaMoE op, as a CSV table.

Per table key (device, scheme, H, I, E local, top_k) and token bucket:
1. candidates: every kernel family's tile configs (`FAMILIES`; `--only FAMILY` restricts);
   each is first run on random routed tokens and checked against the fp32 reference
   (the scheme's dequantized weights and activation quantization); wrong or failing
   candidates are dropped, with the reason;
2. the survivors are timed in the production op: EP 1 runs MegaMoE's forward (local
   transport) with the candidate as the op's `tile_config` (instead of the table lookup); EP > 1 runs the
   op's experts step on the rows the torch transport delivers to rank 0 (N = EP x tokens
   rows, unused ones with id -1), because one process cannot run the all-to-all (its cost
   does not depend on the tile config);
3. merge: the fastest over all families; then the pick and the heuristic
   (`kernels.tuning.heuristic`) are re-timed back to back in the same process; a pick
   more than 3% slower than the heuristic becomes a `heuristic_fallback` row carrying the
   heuristic's config and its measured time.
Rows are appended to the CSV (kernels/configs format plus `heuristic_us`, `source`) as
each key finishes, so a stopped run resumes; keys already in the file are skipped
unless --retune. The timing source is a parameter: on the GPU, CUDA-graph replays with
L2 flushed, median (atom_moe.tools.common.Timer); `--timer wall` (host clock) only for smoke
runs under the CPU interpreter, where times mean nothing.
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, astuple, dataclass, field, replace
from pathlib import Path

import torch

from ..checkpoint.config import load_model
from .args import RunFailure, positive_float, positive_int
from ..spec import MoESpec, Scheme, SpecError

FALLBACK_SLOWDOWN = 1.03  # a pick more than 3% slower than the heuristic falls back to it
EXTRA_COLUMNS = ("heuristic_us", "source")  # the kernels' reader ignores columns it does not know
DEFAULT_TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
Timer = Callable[[Callable[[], object]], float]  # us of one call of fn (median of many, however measured)


class TuneError(ValueError):
    """Bad input: unknown family or scheme, a table that cannot be read, no device to time on."""


def _tuning():
    from ..kernels import tuning  # lazy: the kernels package is optional
    return tuning


@dataclass(frozen=True)
class Key:
    """One table row's key: what the kernels' lookup matches on, plus the token bucket."""

    device: str
    scheme: str
    H: int
    I: int  # noqa: E741  (the table's column name)
    E: int  # local experts the kernels see
    top_k: int
    tokens: int  # rows the experts step is called with (EP x tokens per rank at EP > 1)

    def normalized(self) -> "Key":
        """The key as the lookup compares it: device names match case-insensitively."""
        return replace(self, device=self.device.strip().lower(), scheme=self.scheme.lower())


@dataclass
class Trial:
    """One candidate: its family, config, and what happened to it."""

    family: str
    config: object  # kernels.tuning.TileConfig
    us: float = math.nan
    error: float = math.nan  # relative error against the reference
    dropped: str = ""  # why it was dropped ("" = valid)


@dataclass
class Result:
    """The outcome for one key: the row to write and what it was chosen from."""

    key: Key
    config: object
    us: float  # measured time of `config` in the final comparison
    heuristic_us: float
    source: str  # "tuned" or "heuristic_fallback"
    family: str
    trials: list[Trial] = field(default_factory=list)

    def row(self) -> dict:
        """The CSV row: the kernels' columns plus heuristic_us and source."""
        return {**asdict(self.key), **asdict(self.config), "us": round(self.us, 2),
                "heuristic_us": round(self.heuristic_us, 2), "source": self.source}


# ---------------------------------------------------------------- candidate space
TILES = ((64, 64), (64, 128), (128, 64), (128, 128), (256, 64), (256, 128))  # (block_n, block_k)
LAUNCH = ((4, 3), (4, 4), (8, 3), (8, 4))  # (num_warps, num_stages)
BLOCK_MS = (16, 32, 64, 128)
SPLITS = (2, 4, 8)  # K splits tried for decode batches (kernels/common.py: SPLIT_MAX_PAIRS)
# GEMM2 lookahead prefetch distances tried (programs; kernels/gemm2.py `ahead`): about one to eight waves of resident
# decode programs on an H100 / H200 (132 SMs, 2-5 GEMM2 programs each)
AHEADS = (256, 512, 1024, 2048)
# register caps tried on a scheme's 128-k, 4-warp tiles up to 32 rows: a16w4 keeps a K step's decoded
# operands live, 122 registers at 16 x 128 x 128, so 4 CTAs per SM (docs/perf/a16w4-rotation-h200.md)
REG_CAPS = {"a16w4": (96,)}


def triton_candidates(key: Key, space: str = "tied") -> list:
    """Tile configs of the 3-launch Triton path, built from TileConfig's fields, filtered by TileConfig.check.

    BLOCK_M: the heuristic's and its neighbours. "tied": GEMM2 uses GEMM1's tile (unless the
    scheme constrains the tiles: then every allowed GEMM2 width with GEMM1's K step) and both
    GEMMs share warps/stages; "full": every GEMM1 tile x GEMM2 tile x launch shape; "split": the
    configs the op runs today (the table's row for the key and the heuristic), each with GEMM1 and
    GEMM2 unsplit or split over K in SPLITS (a short decode sweep); "ahead": those configs with GEMM2 unsplit and
    its lookahead prefetch at each of AHEADS (NVIDIA sm_90+). "tied" and "full" split GEMM1 only,
    and add REG_CAPS variants of the scheme's unsplit 128-k tiles.
    """
    t = _tuning()
    h = t.heuristic(key.scheme, key.H, key.I, key.E, key.top_k, key.tokens)
    if space == "split":
        return split_candidates(t, key, h)
    if space == "ahead":
        return ahead_candidates(t, key, h)
    bms = [b for b in BLOCK_MS if h.block_m / 2 <= b <= h.block_m * 2]
    # e4m3 activations tie the tiles to quant groups (GEMM1's width, GEMM2's K step): GEMM2's width is
    # swept on its own there
    constrained = key.scheme in t.FP8_ACT
    out = [h]
    for bm in bms:
        for n1, k1 in TILES:
            for n2, k2 in TILES:
                if space == "tied" and ((n2, k2) != (n1, k1) if not constrained else k2 != k1):
                    continue
                for w, s in LAUNCH:
                    launches = [(w, s, w, s)] if space == "tied" else [(w, s, w2, s2) for w2, s2 in LAUNCH]
                    for w1, s1, w2, s2 in launches:
                        cfg = t.TileConfig(bm, n1, k1, w1, s1, n2, k2, w2, s2, h.group_m)
                        if _valid(t, *_tiles(cfg), key.scheme):
                            out.append(cfg)
    # decode: GEMM1 split over K, for the smallest row block's configs
    if key.tokens * key.top_k <= t.SPLIT_MAX_PAIRS:
        out += [replace(c, split_k1=s) for c in out if c.block_m == min(bms) for s in SPLITS]
    out += [replace(c, maxnreg1=r, maxnreg2=r) for c in out for r in REG_CAPS.get(key.scheme, ())
            if c.block_k1 == c.block_k2 == 128 and c.block_m <= 32 and c.warps1 == c.warps2 == 4
            and c.split_k1 == 1]
    return list(dict.fromkeys(out))


def split_candidates(t, key: Key, heuristic) -> list:
    """The table's config for the key and the heuristic, each at every (split_k1, split_k2) in 1 + SPLITS."""
    if key.tokens * key.top_k > t.SPLIT_MAX_PAIRS:
        raise TuneError(f"--space split: GEMM1 splits K at <= {t.SPLIT_MAX_PAIRS} (token, slot) pairs; "
                        f"{key.tokens} tokens x top_k {key.top_k} has none to sweep")
    table = t.lookup(key.device, key.scheme, key.H, key.I, key.E, key.top_k, key.tokens)
    bases = list(dict.fromkeys(replace(c, split_k1=1, split_k2=1) for c in (table, heuristic)))
    splits = (1,) + SPLITS
    return list(dict.fromkeys([replace(c, split_k1=s1, split_k2=s2) for c in bases for s1 in splits for s2 in splits]))


def ahead_candidates(t, key: Key, heuristic) -> list:
    """The table's config for the key and the heuristic as they are, then each with GEMM2 unsplit at every lookahead
    distance in AHEADS."""
    table = t.lookup(key.device, key.scheme, key.H, key.I, key.E, key.top_k, key.tokens)
    bases = list(dict.fromkeys((table, heuristic)))
    return list(dict.fromkeys(bases + [replace(c, split_k2=1, ahead2=a) for c in bases for a in AHEADS]))


CONFIG_SYNTAX = "BM,N1,K1,W1,S1,N2,K2,W2,S2[,GROUP_M[,SPLIT1[,SPLIT2[,MAXNREG1[,MAXNREG2[,AHEAD2]]]]]]"


def parse_tile_config(text: str):
    """A TileConfig from its fields in a table row's column order: the nine tile and launch fields, then optionally
    group_m, split_k1, split_k2, maxnreg1, maxnreg2, ahead2 (left out: the TileConfig defaults)."""
    values = text.split(",")
    if not 9 <= len(values) <= 15 or not all(v.isdigit() for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: allowed are 9 to 15 integers {CONFIG_SYNTAX}")
    return _tuning().TileConfig(*map(int, values))


def given_candidates(key: Key, configs: list) -> list:
    """--configs: the config the op runs today for the key (its table row or the heuristic), the heuristic, then
    the given configs, so a pick is never slower than what runs today."""
    t = _tuning()
    check_given(key.scheme, configs)
    today = t.lookup(key.device, key.scheme, key.H, key.I, key.E, key.top_k, key.tokens)
    return list(dict.fromkeys([today, t.heuristic(key.scheme, key.H, key.I, key.E, key.top_k, key.tokens),
                               *configs]))


def check_given(scheme: str, configs: list) -> None:
    """Raise TuneError naming the first --configs value the scheme's kernels refuse."""
    t = _tuning()
    for cfg in configs:
        try:
            cfg.check(scheme)
        except t.ConfigError as exc:
            raise TuneError(f"--configs {','.join(map(str, astuple(cfg)))}: {exc}") from None


def _tiles(cfg) -> tuple:
    return cfg.block_m, cfg.block_n1, cfg.block_k1, cfg.block_n2, cfg.block_k2


def _valid(t, bm, n1, k1, n2, k2, scheme) -> bool:
    try:
        t.TileConfig(bm, n1, k1, 4, 3, n2, k2, 4, 3).check(scheme)
    except t.ConfigError:
        return False
    return True


# kernel family -> candidate generator; every family runs through the same op (fused_experts)
FAMILIES: dict[str, Callable[[Key, str], list]] = {"triton": triton_candidates}


# ---------------------------------------------------------------- the bench: check and time one config
@dataclass
class LayerData:
    """One scheme's random layer as rank 0 holds it: prepared local experts and router bias."""

    spec: MoESpec  # the full layer (placement: EP 1)
    rank_spec: MoESpec  # rank 0 of EP
    weights: object  # PreparedWeights of rank 0's experts
    correction_bias: torch.Tensor | None

    @staticmethod
    def build(spec: MoESpec, ep: int, device: torch.device, seed: int) -> "LayerData":
        """Random bf16 weights for rank 0's experts only (EP 8 builds 1/8 of the layer), prepared for the scheme."""
        from ..spec import Routing
        from .synthetic import random_layer
        from ..weights import prepare_stacked
        gen = torch.Generator().manual_seed(seed)
        rank_spec = spec.for_rank(0, ep)
        local = rank_spec.num_local_experts
        # a layer of just the local experts: random_layer reads only E, H, I and has_bias from it
        shard = replace(spec, num_experts=local, top_k=min(spec.top_k, local), routing=Routing(),
                        placement=replace(spec.placement, local_experts=None, world_size=1, rank=0))
        raw = random_layer(shard, generator=gen, device=device)
        weights = prepare_stacked(rank_spec, raw.w13, raw.w2, layout="separated", w13_bias=raw.w13_bias,
                                  w2_bias=raw.w2_bias, expert_ids=rank_spec.local_experts, device=device)
        del raw
        bias = (torch.randn(spec.num_experts, generator=gen) * 0.1).to(device) if spec.routing.correction_bias \
            else None  # the router's e_score_correction_bias, as synthetic.random_layer draws it
        return LayerData(spec, rank_spec, weights, bias)


class OpBench:
    """Routed tokens for one key on one scheme's layer; runs the production op with a forced config."""

    def __init__(self, layer: LayerData, ep: int, tokens: int, device: torch.device, timer: Timer, seed: int,
                 tol: float) -> None:
        from ..reference import reference_moe_prepared
        from .synthetic import random_tokens
        self.timer, self.tol, self.ep, self.device = timer, tol, ep, device
        gen = torch.Generator().manual_seed(seed + tokens)
        full = replace(layer.spec, max_tokens_per_rank=tokens)
        self.spec, self.weights = replace(layer.rank_spec, max_tokens_per_rank=tokens), layer.weights
        if ep == 1:
            self.x, self.w, self.ids = random_tokens(full, tokens, generator=gen, device=device,
                                                     correction_bias=layer.correction_bias)
        else:
            self.x, self.w, self.ids = transport_rows(full, ep, tokens, gen, device, layer.correction_bias)
        # dequantized a few experts at a time: the fp32 copy of a whole layer (Kimi-K2) did not fit an H200
        self.ref = reference_moe_prepared(self.x, self.w, self.ids, layer.weights, self.spec.activation,
                                          act_quant=self.spec.scheme if self.spec.scheme.fp8_activations else None)
        self._call = self._build_call()

    def _build_call(self) -> Callable[[object], torch.Tensor]:
        if self.ep == 1:  # the real op: MegaMoE forward, local transport, fused experts
            from ..ep import MegaMoE
            self.op = MegaMoE(self.spec, max_tokens_per_rank=self.x.shape[0], transport="local",
                              experts_backend="triton", device=self.device)
            self.op.bind(self.weights)
            return lambda cfg: self._op_forward(cfg)
        # EP > 1: the op's experts step as MegaMoE._experts calls it (workspace and output for N rows)
        from ..experts import allocate_workspace, fused_experts
        ws = allocate_workspace(self.spec, self.x.shape[0], self.device)
        out = torch.empty_like(self.x)
        return lambda cfg: fused_experts(self.x, self.w, self.ids, self.weights, self.spec, workspace=ws, out=out,
                                         config=cfg)

    def _op_forward(self, cfg) -> torch.Tensor:
        self.op.tile_config = cfg  # the op then runs exactly as with a tuned row for cfg
        try:
            return self.op.forward(self.x, self.w, self.ids)
        finally:
            self.op.tile_config = None

    def check(self, cfg) -> float:
        """Relative error of `cfg`'s output against the reference (raises if the config fails)."""
        out = self._call(cfg)
        ref = self.ref
        den = ref.norm().item()
        return (out.float() - ref).norm().item() / den if den else 0.0

    def time(self, cfg) -> float:
        """us of one forward with `cfg`, by the injected timer."""
        return self.timer(lambda: self._call(cfg))

    def close(self) -> None:
        if getattr(self, "op", None) is not None:
            self.op.close()


def transport_rows(spec: MoESpec, ep: int, tokens: int, gen: torch.Generator, device: torch.device,
                   correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The N = ep * tokens rows rank 0's experts step sees under the torch transport.

    Block s holds the tokens of source rank s that have an expert on rank 0 (at its start,
    with all k global ids), then unused rows (ids -1, weights 0, x 0), as dispatch leaves them.
    """
    from .synthetic import random_tokens
    local = set(spec.for_rank(0, ep).local_experts)
    xs, ws, idss = [], [], []
    for _ in range(ep):
        x, w, ids = random_tokens(spec, tokens, generator=gen, device=device, correction_bias=correction_bias)
        hit = torch.tensor([any(int(e) in local for e in row) for row in ids.tolist()], dtype=torch.bool,
                           device=device)
        n = int(hit.sum())
        bx, bw = torch.zeros_like(x), torch.zeros_like(w)
        bids = torch.full_like(ids, -1)
        bx[:n], bw[:n], bids[:n] = x[hit], w[hit], ids[hit]
        xs.append(bx), ws.append(bw), idss.append(bids)
    return torch.cat(xs), torch.cat(ws), torch.cat(idss)


def progress(items: list, **kwargs):
    """A tqdm bar over items (tools/test extra); the plain list where tqdm is not installed."""
    try:
        from tqdm import tqdm  # lazy: an optional dependency
    except ImportError:
        return items
    return tqdm(items, **kwargs)


# ---------------------------------------------------------------- merge and fallback
def tune_key(key: Key, families: dict[str, list], bench, *, confirm: int = 3) -> Result:
    """Check, time and merge every family's candidates for one key; compare the pick with the heuristic.

    `bench` has check(cfg) -> relative error (raises on failure), time(cfg) -> us and a `tol`.
    """
    t = _tuning()
    trials = []
    flat = [(family, cfg) for family, configs in families.items() for cfg in configs]
    for family, cfg in progress(flat, desc=f"{key.scheme} T={key.tokens}", unit="cfg", leave=False):
        trial = Trial(family, cfg)
        trials.append(trial)
        try:
            trial.error = bench.check(cfg)
        except Exception as exc:  # a config the compiler or the kernels refuse is dropped, not fatal
            trial.dropped = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
            continue
        if not trial.error <= bench.tol:  # NaN counts as wrong
            trial.dropped = f"wrong: rel_err {trial.error:.3e} > {bench.tol:.1e}"
            continue
        trial.us = bench.time(cfg)
    valid = [tr for tr in trials if not tr.dropped]
    heuristic = t.heuristic(key.scheme, key.H, key.I, key.E, key.top_k, key.tokens)
    if not valid:
        raise TuneError(f"no candidate passed the correctness check for {key}; first failures: "
                        + "; ".join(tr.dropped for tr in trials[:3]))
    best = min(valid, key=lambda tr: tr.us)
    # back to back in the same process: the sweep's times drift (clocks, other work), this comparison does not
    pick_us, heur_us = [], []
    for _ in range(confirm):
        pick_us.append(bench.time(best.config))
        heur_us.append(bench.time(heuristic))
    p, h = statistics.median(pick_us), statistics.median(heur_us)
    if best.config == heuristic or p <= h * FALLBACK_SLOWDOWN:
        return Result(key, best.config, p, h, "tuned", best.family, trials)
    return Result(key, heuristic, h, h, "heuristic_fallback", "heuristic", trials)


# ---------------------------------------------------------------- the table
def read_done(path: Path) -> set[Key]:
    """Keys already in the table at `path` (validated by the kernels' own reader)."""
    if not path.exists():
        return set()
    t = _tuning()
    try:
        rows = t._read_csv(path)  # the kernels' reader: same columns and errors as the lookup
    except t.ConfigError as exc:
        raise TuneError(f"--out {path}: {exc}") from None
    return {Key(r["device"], r["scheme"], r["H"], r["I"], r["E"], r["top_k"], r["tokens"]).normalized() for r in rows}


def columns() -> tuple[str, ...]:
    """The output columns: the kernels' table columns, then ours."""
    return tuple(_tuning().COLUMNS) + EXTRA_COLUMNS


def drop_rows(path: Path, keys: set[Key]) -> None:
    """Rewrite the table without the rows of `keys` (for --retune), keeping every other row as it is."""
    if not path.exists() or not keys:
        return
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        fieldnames, rows = reader.fieldnames, list(reader)
    names = ("device", "scheme", "H", "I", "E", "top_k", "tokens")
    wanted = {tuple(str(v).lower() for v in asdict(k).values()) for k in keys}
    keep = [r for r in rows if tuple(r[c].strip().lower() for c in names) not in wanted]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(keep)


TRIAL_COLUMNS = ("family", "rel_err", "dropped")


def trial_rows(result: Result) -> list[dict]:
    """One row per candidate of a key: key, config, its sweep time (us, empty if dropped), error, drop reason."""
    return [{**asdict(result.key), **asdict(tr.config), "us": "" if math.isnan(tr.us) else round(tr.us, 2),
             "family": tr.family, "rel_err": f"{tr.error:.3e}", "dropped": tr.dropped} for tr in result.trials]


def append_row(path: Path, row: dict, fieldnames: tuple[str, ...] | None = None) -> None:
    """Append one finished row (header first for a new file): a stopped run keeps what it finished."""
    new = not path.exists() or path.stat().st_size == 0
    fieldnames = list(fieldnames or columns())
    if not new:
        upgrade_header(path, fieldnames)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fieldnames, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)


def upgrade_header(path: Path, fieldnames: list[str]) -> None:
    """Rewrite a table written before an optional column existed (split_k2) under `fieldnames`, the
    new columns at their defaults, so appended rows line up; any other header mismatch is an error."""
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        header, rows = list(reader.fieldnames or []), list(reader)
    if header == fieldnames:
        return
    missing = [c for c in fieldnames if c not in header]
    optional = _tuning().OPTIONAL_COLUMNS
    if [c for c in header if c not in fieldnames] or [c for c in missing if c not in optional]:
        raise TuneError(f"{path}: its columns {header} do not match this tuner's {fieldnames}; write to a new file")
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows({**{c: optional[c] for c in missing}, **r} for r in rows)


# ---------------------------------------------------------------- timers
def wall_timer(iters: int = 3) -> Timer:
    """Host-clock median (CPU interpreter smoke runs only: these times mean nothing for a GPU)."""
    def timer(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6
    return timer


def cuda_graph_timer(iters: int = 20) -> Timer:
    """CUDA-graph replays with L2 flushed before each, median (atom_moe.tools.common.Timer)."""
    from .common import Timer as BenchTimer
    return BenchTimer(iters).graph_us


# ---------------------------------------------------------------- driver
def plan_keys(spec: MoESpec, schemes: list[Scheme], ep: int, tokens: list[int], device_name: str) -> list[tuple]:
    """(key, spec in that scheme, tokens per rank) for every scheme x token bucket."""
    out = []
    for scheme in schemes:
        s = replace(spec, scheme=scheme)
        try:
            local = s.for_rank(0, ep)
        except SpecError as exc:
            raise TuneError(f"--ep {ep}: {exc}") from None
        for T in tokens:
            out.append((Key(device_name, scheme.value, s.hidden_size, s.intermediate_size, local.num_local_experts,
                            s.top_k, ep * T if ep > 1 else T), s, T))
    return out


def run_tuning(spec: MoESpec, *, schemes: list[Scheme], ep: int, tokens: list[int], out: Path, timer: Timer,
               device: torch.device, families: list[str] | None = None, space: str = "tied", retune: bool = False,
               seed: int = 0, tol: float = 2e-2, bench_factory=None, log=print,
               trials_out: Path | None = None, configs: list | None = None) -> list[Result]:
    """Tune every (scheme, bucket) not yet in `out`; append each row (every candidate's to trials_out) as it ends.

    `configs` (--configs) replaces the kernel families' spaces: only the key's config of today, the heuristic
    and these are timed."""
    from ..experts import SUPPORTED, device_name
    chosen = families or list(FAMILIES)
    unknown = [f for f in chosen if f not in FAMILIES]
    if unknown:
        raise TuneError(f"--only {','.join(unknown)}: unknown kernel family; allowed: {', '.join(FAMILIES)}")
    bad = [s.value for s in schemes if s not in SUPPORTED]
    if bad:
        raise TuneError(f"scheme(s) {', '.join(bad)}: the fused kernels do not take them; allowed: "
                        f"{', '.join(s.value for s in SUPPORTED)}")
    for scheme in schemes if configs else ():
        check_given(scheme.value, configs)  # before any GPU work
    keys = plan_keys(spec, schemes, ep, tokens, device_name(device))
    done = read_done(out)
    if retune:
        drop_rows(out, {k.normalized() for k, _, _ in keys} & done)
        done = set()
    todo = [(k, s, T) for k, s, T in keys if k.normalized() not in done]
    for k, _, _ in keys:
        if k.normalized() in done:
            log(f"skip (already in {out}; --retune to redo): {k}")
    layers: dict[Scheme, LayerData] = {}  # one random layer per scheme, shared by its token buckets

    def default_bench(s: MoESpec, T: int) -> OpBench:
        if s.scheme not in layers:
            layers.clear()  # one scheme's weights at a time on the device
            layers[s.scheme] = LayerData.build(s, ep, device, seed)
        return OpBench(layers[s.scheme], ep, T, device, timer, seed, tol)

    make_bench = bench_factory or default_bench
    results = []
    for key, s, T in progress(todo, desc="atom-moe tune", unit="shape", disable=not todo):
        candidates = {"triton": given_candidates(key, configs)} if configs else \
            {f: FAMILIES[f](key, space) for f in chosen}
        bench = make_bench(s, T)
        try:
            result = tune_key(key, candidates, bench)
        finally:
            close = getattr(bench, "close", None)
            if close:
                close()
        append_row(out, result.row())
        if trials_out is not None:
            for row in trial_rows(result):
                append_row(trials_out, row, tuple(_tuning().KEY_COLUMNS + _tuning().CONFIG_COLUMNS) + ("us",)
                           + TRIAL_COLUMNS)
        results.append(result)
    return results


def table_rows(path: Path, keys: set[Key]) -> list[dict]:
    """The table's rows for `keys` as written (extra columns included), for the summary of a resumed run."""
    if not path.exists():
        return []
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    out = []
    for r in rows:
        key = Key(r["device"], r["scheme"].strip(), *(int(r[c]) for c in ("H", "I", "E", "top_k", "tokens")))
        if key.normalized() in {k.normalized() for k in keys}:
            out.append(r)
    return out


def format_summary(results: list[Result], earlier: list[dict] = ()) -> str:
    """Per key: tuned / heuristic time, the row's source, candidates valid / dropped; which rows fell back."""
    head = f"{'scheme':<6} {'H':>5} {'I':>5} {'E':>4} {'k':>2} {'tokens':>6} {'us':>10} {'heur us':>10} " \
           f"{'ratio':>6} {'valid':>5} {'dropped':>7}  source / config"
    lines = [head, "-" * len(head)]
    rows = [(r.row(), str(sum(1 for tr in r.trials if not tr.dropped)),
             str(sum(1 for tr in r.trials if tr.dropped)), f" ({r.family})") for r in results]
    rows += [(r, "-", "-", " (earlier run)") for r in earlier]
    for row, valid, dropped, note in rows:
        us, heur = float(row["us"]), float(row["heuristic_us"] or "nan")
        cfg = (f"bm{row['block_m']} n1={row['block_n1']} k1={row['block_k1']} w{row['warps1']} s{row['stages1']} "
               f"n2={row['block_n2']} k2={row['block_k2']} w{row['warps2']} s{row['stages2']}")
        lines.append(f"{row['scheme']:<6} {row['H']:>5} {row['I']:>5} {row['E']:>4} {row['top_k']:>2} "
                     f"{row['tokens']:>6} {us:>10.1f} {heur:>10.1f} {us / heur:>6.3f} {valid:>5} {dropped:>7}  "
                     f"{row['source']}{note} {cfg}")
    fell = [row for row, *_ in rows if row["source"] == "heuristic_fallback"]
    lines.append(f"{len(fell)} of {len(rows)} rows fell back to the heuristic"
                 + (": " + ", ".join(f"{r['scheme']} tokens={r['tokens']}" for r in fell) if fell else ""))
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `atom-moe tune`'s options."""
    parser.add_argument("model", help="a preset or a HuggingFace config.json (its MoE layer's shape)")
    parser.add_argument("--scheme", action="append", choices=[s.value for s in Scheme],
                        help="repeatable; default: the model's scheme")
    parser.add_argument("--ep", type=positive_int, default=1, help="EP size: E local = E / EP, buckets of EP x tokens rows")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=list(DEFAULT_TOKENS),
                        help="token buckets per rank (default 1 8 32 128 512 2048 8192)")
    parser.add_argument("--only", default=None, help=f"kernel families, comma-separated (default all: "
                                                     f"{', '.join(FAMILIES)})")
    parser.add_argument("--space", choices=("tied", "full", "split", "ahead"), default=None,
                        help="candidate space (see docs/tune.md; default tied)")
    parser.add_argument("--configs", nargs="+", type=parse_tile_config, default=None,
                        metavar="CONFIG",
                        help=f"{CONFIG_SYNTAX}: time only these tile configs beside the key's config of today "
                             "and the heuristic (instead of --space)")
    parser.add_argument("--out", type=Path, default=Path("tuned.csv"), help="table to write / resume")
    parser.add_argument("--retune", action="store_true", help="redo keys already in --out")
    parser.add_argument("--trials", type=Path, default=None,
                        help="also append every candidate (config, sweep us, rel_err, why dropped) to this CSV")
    parser.add_argument("--timer", choices=("cuda-graph", "wall"), default=None,
                        help="default cuda-graph on a GPU; wall is for CPU interpreter smoke runs only")
    parser.add_argument("--iters", type=positive_int, default=20, help="timed repeats per measurement (median)")
    parser.add_argument("--hidden", type=positive_int, default=None,
                        help="hidden size override (small CPU smoke runs); none: the model's")
    parser.add_argument("--intermediate", type=positive_int, default=None,
                        help="intermediate size override; none: the model's")
    parser.add_argument("--experts", type=positive_int, default=None, help="expert count override; none: the model's")
    parser.add_argument("--tol", type=positive_float, default=2e-2,
                        help="relative error above which a candidate is dropped")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and tokens")
    parser.add_argument("--interpret", action="store_true", help="CPU: run Triton under TRITON_INTERPRET=1")


def run(args: argparse.Namespace) -> int:
    """Entry point of `atom-moe tune`; returns the process exit code."""
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        cuda = torch.cuda.is_available()
        timer_name = args.timer or ("cuda-graph" if cuda else None)
        if timer_name is None:
            raise RunFailure("no CUDA GPU here: tuning times the op on a GPU. For a CPU smoke run of the whole flow "
                            "pass --interpret --timer wall (the times mean nothing)")
        if timer_name == "cuda-graph" and not cuda:
            raise RunFailure("--timer cuda-graph needs a CUDA GPU: torch sees none here")
        if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise TuneError("on the CPU the kernels run only under the interpreter: add --interpret")
        if args.ep < 1 or any(t < 1 for t in args.tokens) or args.iters < 1:
            raise TuneError("--ep, --tokens and --iters must be >= 1")
        if args.configs and (args.space or args.only):
            raise TuneError("--configs names the candidates itself: drop --space / --only")
        layer = load_model(args.model)
        spec = layer.spec
        if args.hidden or args.intermediate or args.experts:
            from ..presets import scaled_down
            spec = scaled_down(spec, hidden_size=args.hidden or spec.hidden_size,
                               intermediate_size=args.intermediate or spec.intermediate_size,
                               num_experts=args.experts or spec.num_experts)
        schemes = [Scheme.parse(s) for s in (args.scheme or [spec.scheme.value])]
        families = [f.strip() for f in args.only.split(",")] if args.only else None
        timer = cuda_graph_timer(args.iters) if timer_name == "cuda-graph" else wall_timer(args.iters)
        device = torch.device("cuda" if cuda else "cpu")
        results = run_tuning(spec, schemes=schemes, ep=args.ep, tokens=args.tokens, out=args.out, timer=timer,
                             device=device, families=families, space=args.space or "tied",
                             retune=args.retune, seed=args.seed, tol=args.tol, trials_out=args.trials,
                             configs=args.configs)
        from ..experts import device_name
        keys = {k for k, _, _ in plan_keys(spec, schemes, args.ep, args.tokens, device_name(device))}
        earlier = table_rows(args.out, {k for k in keys if k not in {r.key for r in results}})
    except (TuneError, SpecError) as exc:
        print(f"atom-moe tune: error: {exc}", file=sys.stderr)
        return 2
    print(format_summary(results, earlier))
    print(f"table: {args.out} (timer {timer_name}{'; CPU interpreter: times mean nothing' if not cuda else ''})")
    return 0
