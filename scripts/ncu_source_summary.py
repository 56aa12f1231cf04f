#!/usr/bin/env python3
"""Summarize Nsight Compute's per-SASS-line counters (scripts/ncu_profile.sh --source) kernel by kernel.

    python3 scripts/ncu_source_summary.py ncu-deepseek-v3-a8w4-source.csv [--csv loads.csv] [--top 8]

The CSV is `ncu --import R --page source --csv --print-source sass`: one block per profiled launch, each opened by a
"Kernel Name" line. Per launch it prints the warp-stall samples by reason, the hottest SASS lines with their two
largest stall reasons (a stall is charged to the instruction that waits, often the one after a DEPBAR / scoreboard
wait), and every memory instruction that moves shared-memory wavefronts or L2 sectors with its excess over ncu's
ideal (bank conflicts on the shared side, uncoalesced sectors on the global side). --csv writes the memory table.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
MEMORY = ("L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal", "L2 Theoretical Sectors Global",
          "L2 Theoretical Sectors Global Ideal")
COLUMNS = ("launch", "kernel", "sass", "executed", "shared_wavefronts", "shared_ideal", "shared_excess",
           "l2_sectors", "l2_ideal", "l2_excess")


def number(text: str) -> float:
    """A counter cell as a float ('' and '-' are 0)."""
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def launches(path: Path) -> list[tuple[str, list[dict]]]:
    """(kernel name, SASS rows as dicts) per profiled launch, in the file's order."""
    out: list[tuple[str, list[dict]]] = []
    header: list[str] | None = None
    for row in csv.reader(path.read_text().splitlines()):
        if not row:
            continue
        if row[0] == "Kernel Name":
            out.append((row[1], []))
            header = None
        elif row[0] == "Address":
            header = row
        elif out and header is not None and len(row) == len(header):
            out[-1][1].append(dict(zip(header, row)))
    if not out:
        raise SystemExit(f"{path}: no 'Kernel Name' block: is it ncu's source page as CSV (--page source --csv)?")
    return out


def ratio(got: float, ideal: float) -> float:
    """got / ideal, 0 where nothing was ideal."""
    return round(got / ideal, 2) if ideal else 0.0


def summarize(name: str, rows: list[dict], top: int) -> tuple[list[str], list[dict]]:
    """(printed lines, memory-table rows) of one launch."""
    samples = sum(number(r.get(SAMPLES, "")) for r in rows) or 1.0
    stalls = collections.Counter()
    for r in rows:
        for column, value in r.items():
            if column.startswith("stall_") and "Not Issued" not in column:
                stalls[column[6:]] += number(value)
    lines = [f"{name}: {samples:.0f} warp samples, {sum(number(r['Instructions Executed']) for r in rows):.3g} "
             f"warp instructions",
             "  stalls: " + ", ".join(f"{k} {100 * v / samples:.1f}%" for k, v in stalls.most_common(6))]
    for r in sorted(rows, key=lambda r: -number(r.get(SAMPLES, "")))[:top]:
        why = sorted(((number(v), c[6:]) for c, v in r.items() if c.startswith("stall_") and "Not Issued" not in c),
                     reverse=True)[:2]
        lines.append(f"  {100 * number(r.get(SAMPLES, '')) / samples:5.1f}%  {r['Source'].strip()[:64]:64s} "
                     + ", ".join(f"{c} {v:.0f}" for v, c in why))
    table = []
    for r in rows:
        wf, wf_ideal, sec, sec_ideal = (number(r.get(c, "")) for c in MEMORY)
        if wf or sec:
            table.append(dict(kernel=name, sass=r["Source"].strip(), executed=number(r["Instructions Executed"]),
                              shared_wavefronts=wf, shared_ideal=wf_ideal, shared_excess=ratio(wf, wf_ideal),
                              l2_sectors=sec, l2_ideal=sec_ideal, l2_excess=ratio(sec, sec_ideal)))
    wf = sum(t["shared_wavefronts"] for t in table)
    ideal = sum(t["shared_ideal"] for t in table)
    lines.append(f"  shared wavefronts {wf:.3g} (ideal {ideal:.3g}, x{ratio(wf, ideal)}); worst loads:")
    for t in sorted(table, key=lambda t: -(t["shared_wavefronts"] - t["shared_ideal"]))[:4]:
        if t["shared_wavefronts"] > t["shared_ideal"]:
            lines.append(f"    x{t['shared_excess']:<5} {t['shared_wavefronts']:.3g} wavefronts  {t['sass'][:60]}")
    return lines, table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source_csv", type=Path)
    p.add_argument("--csv", type=Path, help="write every memory instruction's wavefronts and sectors here")
    p.add_argument("--top", type=int, default=8, help="hottest SASS lines per launch")
    args = p.parse_args(argv)
    if args.top < 1:  # standard library only: the summary runs wherever the CSV is, no torch needed
        p.error(f"--top {args.top}: allowed are 1 or more lines")
    if not args.source_csv.is_file():
        p.error(f"{args.source_csv}: no such file (ncu_profile.sh --source writes ncu-<tag>-source.csv)")
    table = []
    for i, (name, rows) in enumerate(launches(args.source_csv)):
        lines, mem = summarize(name, rows, args.top)
        print(f"== launch {i}: " + "\n".join(lines))
        table += [{"launch": i, **t} for t in mem]
    if args.csv:
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            w.writerows(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
