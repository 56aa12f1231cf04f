#!/usr/bin/env python3
"""Markdown tables from `atom-moe bench` CSVs: fraction of floor per shape and T against the issue targets.

    python scripts/bench_tables.py docs/perf/kernels-h200.csv [more.csv ...] > tables.md
    python scripts/bench_tables.py run/*.csv --plot roofline.png --ceilings 4.54 793 1472 > tables.md

One table per scheme (atom_moe rows; other impls of the same scheme in parentheses, e.g.
grouped_mm for bf16, triton_kernels for a16w4), then one row per (shape, scheme, T) with us, floor, TB/s and config.
A cell below its target is marked with a cross. `--ratios` prints the issues' required comparisons instead
(`ratio_tables`): the peer's time over ours per (shape, T), each cell below its required ratio crossed.
`--write-csv F` also writes the merged rows to F (scripts/device_tables.sh merges its per-shape CSVs so).
"""

from __future__ import annotations

import argparse
import csv
import math
from collections import defaultdict
from pathlib import Path

TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
REQUIRED = ("shape", "scheme", "T", "impl", "us", "floor_us", "frac_of_floor", "tbps", "tflops", "config")
# (T = 1, T = 8..512, T = 2048, T = 8192) per scheme, from the kernels and MXFP4 issues
TARGETS = {"bf16": (0.85, 0.92, 0.85, 0.70), "fp8": (0.80, 0.88, 0.75, 0.55),
           "a16w4": (0.75, 0.85, 0.75, 0.65), "a8w4": (0.75, 0.85, 0.75, 0.55)}
# the issues' required comparisons: (title, scheme of ours, the peer's (scheme, impls: the fastest counts),
# required peer time / our time, which T); vLLM's and triton_kernels' rows come from the same bench process
RATIOS = (
    ("bf16: vLLM's best (default or tuned config) / ours", "bf16", ("bf16", ("vllm", "vllm-tuned")), 1.1, None),
    ("fp8: vLLM's best (default or tuned config) / ours", "fp8", ("fp8", ("vllm", "vllm-tuned")), 1.1, None),
    ("a16w4: triton_kernels' matmul_ogs / ours", "a16w4", ("a16w4", ("triton_kernels",)), 1.2, None),
    ("a8w4: our fp8 / our a8w4, T <= 512", "a8w4", ("fp8", ("atom_moe",)), 1.5, lambda t: t <= 512),
    ("a8w4: our a16w4 / our a8w4, T >= 512", "a8w4", ("a16w4", ("atom_moe",)), 1.0, lambda t: t >= 512),
)


def target(scheme: str, tokens: int) -> float:
    """The target fraction of the floor for (scheme, T)."""
    t1, mid, t2048, t8192 = TARGETS[scheme]
    return t1 if tokens == 1 else t2048 if tokens == 2048 else t8192 if tokens == 8192 else mid


def read(paths: list[Path]) -> list[dict]:
    """All rows of the CSVs, later files overriding earlier ones for the same (shape, scheme, T, impl)."""
    rows: dict[tuple, dict] = {}
    for path in paths:
        if not Path(path).is_file():
            raise SystemExit(f"{path}: no such CSV (pass atom-moe bench CSVs)")
        with open(path, newline="") as fh:
            reader = csv.DictReader(fh)
            missing = set(REQUIRED) - set(reader.fieldnames or ())
            if missing:
                raise SystemExit(f"{path}: not an atom-moe bench CSV, missing columns {sorted(missing)} "
                                 f"(needs {', '.join(REQUIRED)})")
            for r in reader:
                rows[(r["shape"], r["scheme"], int(r["T"]), r["impl"])] = r
    return list(rows.values())


def fraction_tables(rows: list[dict]) -> str:
    """Per scheme: shape x T fraction of floor, other impls in parentheses, the target row last."""
    by = {(r["shape"], r["scheme"], int(r["T"]), r["impl"]): float(r["frac_of_floor"]) for r in rows}
    out = []
    for scheme in TARGETS:
        shapes = sorted({s for s, sc, _, i in by if sc == scheme and i == "atom_moe"})
        if not shapes:
            continue
        others = sorted({i for _, sc, _, i in by if i != "atom_moe" and sc == scheme})
        head = f"### {scheme}: fraction of floor (atom_moe" + (f"; {', '.join(others)} in parentheses" if others else "")
        out += [head + ")", "", "| shape | " + " | ".join(f"T={t}" for t in TOKENS) + " |",
                "|---|" + "---|" * len(TOKENS)]
        for shape in shapes:
            cells = []
            for t in TOKENS:
                f = by.get((shape, scheme, t, "atom_moe"))
                if f is None:
                    cells.append("n/a")
                    continue
                cell = f"{f:.2f}" + (" ✗" if f < target(scheme, t) else "")
                extra = [f"{by[(shape, scheme, t, i)]:.2f}" for i in others if (shape, scheme, t, i) in by]
                cells.append(cell + (f" ({', '.join(extra)})" if extra else ""))
            out.append(f"| {shape} | " + " | ".join(cells) + " |")
        out += ["| target | " + " | ".join(f"{target(scheme, t):.2f}" for t in TOKENS) + " |", ""]
    return "\n".join(out)


def ratio_tables(rows: list[dict]) -> str:
    """Per required comparison with rows on both sides: shape x T of the peer's time over ours, crossed below
    the required ratio. A dagger marks a cell where the peer already runs above 1 / ratio of the floor, so
    that no time at or above the floor could reach the ratio."""
    by = {(r["shape"], r["scheme"], int(r["T"]), r["impl"]): r for r in rows}
    out = []
    for title, scheme, (peer_scheme, impls), need, at in RATIOS:
        cells_by_shape = {}
        for (shape, sc, t, impl), ours in by.items():
            if sc != scheme or impl != "atom_moe" or (at and not at(t)):
                continue
            peers = [by[(shape, peer_scheme, t, i)] for i in impls if (shape, peer_scheme, t, i) in by]
            if not peers:
                continue
            best = min(peers, key=lambda r: float(r["us"]))
            ratio = math.floor(float(best["us"]) / float(ours["us"]) * 100 + 1e-9) / 100  # truncated: 1.098 is 1.09
            bound = float(best["frac_of_floor"]) * need > 1 and peer_scheme == scheme
            cells_by_shape.setdefault(shape, {})[t] = f"{ratio:.2f}" + (" ✗" if ratio < need else "") \
                + (" †" if bound else "")
        if not cells_by_shape:
            continue
        tokens = [t for t in TOKENS if any(t in c for c in cells_by_shape.values())]
        out += [f"### {title} (>= {need} wanted)", "", "| shape | " + " | ".join(f"T={t}" for t in tokens) + " |",
                "|---|" + "---|" * len(tokens)]
        for shape in sorted(cells_by_shape):
            out.append(f"| {shape} | " + " | ".join(cells_by_shape[shape].get(t, "n/a") for t in tokens) + " |")
        misses = sum(c.count("✗") for cells in cells_by_shape.values() for c in cells.values())
        total = sum(len(c) for c in cells_by_shape.values())
        out += ["", f"{total - misses} of {total} cells meet it.", ""]
    return "\n".join(out)


def write_rows(rows: list[dict], path: Path) -> None:
    """The merged rows as one CSV (columns in the order the inputs first name them)."""
    columns = list(dict.fromkeys(c for r in rows for c in r))
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)


def detail_table(rows: list[dict]) -> str:
    """One line per atom_moe row: us, floor, fraction, TB/s, TFLOP/s, config."""
    groups = defaultdict(list)
    for r in rows:
        if r["impl"] == "atom_moe":
            groups[(r["shape"], r["scheme"])].append(r)
    lines = ["| shape | scheme | T | us | floor us | frac | TB/s | TFLOP/s | config |", "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted(groups):
        for r in sorted(groups[key], key=lambda r: int(r["T"])):
            lines.append(f"| {r['shape']} | {r['scheme']} | {r['T']} | {r['us']} | {r['floor_us']} | "
                         f"{r['frac_of_floor']} | {r['tbps']} | {r['tflops']} | {r['config']} |")
    return "\n".join(lines)


def main() -> None:
    """Print both tables for the CSVs on the command line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path, help="also draw the roofline PNG (atom_moe.tools.common.plot)")
    parser.add_argument("--ceilings", nargs=3, type=float, metavar=("READ_TBPS", "BF16_TFLOPS", "FP8_TFLOPS"),
                        help="the ceilings the bench measured in the same run (needed with --plot)")
    parser.add_argument("--ratios", action="store_true", help="print the required comparisons (ratio_tables) only")
    parser.add_argument("--write-csv", type=Path, help="also write the merged rows (later CSVs win) to this CSV")
    args = parser.parse_args()
    if args.plot and not args.ceilings:
        parser.error("--plot needs --ceilings READ_TBPS BF16_TFLOPS FP8_TFLOPS (printed by the bench run)")
    rows = read(args.csv)
    if args.write_csv:
        write_rows(rows, args.write_csv)
    if args.plot:
        from atom_moe.tools.common import CEILING_KEYS, plot
        plot(rows, dict(zip(CEILING_KEYS, args.ceilings)), args.plot)
    if args.ratios:
        print(ratio_tables(rows))
        return
    print(fraction_tables(rows))
    print("### Time (us) and achieved TB/s, atom_moe\n")
    print(detail_table(rows))


if __name__ == "__main__":
    main()
