#!/usr/bin/env python3
"""Summarise an Nsight Compute report of scripts/ncu_layer.py into one row per kernel launch.

    ncu --import report.ncu-rep --csv --page raw --print-units base > raw.csv
    python3 scripts/ncu_summary.py raw.csv --csv summary.csv   # also prints a markdown table

Columns: the NVTX case, kernel, duration, DRAM bytes read and throughput (TB/s), memory
throughput (% of peak, the busiest memory unit), issue slots busy, ALU / FMA / tensor pipes busy (%),
global-load sectors per request at L1 and at L2, achieved occupancy, registers per thread,
local-memory (spill) sectors, instructions executed per DRAM byte read, and the three largest
warp-stall reasons other than 'selected' (warps stalled per issued instruction).
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

CASE = re.compile(r"[\w.-]+/(bf16|fp8|a16w4|a8w4)/T\d+(/[\w-]+)?")  # NVTX ranges of ncu_layer.py, tk_baseline.py --profile
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")


def num(row: dict, key: str) -> float:
    """The metric's value as a float (0 where absent or blank)."""
    v = (row.get(key) or "").replace(",", "")
    try:
        return float(v)
    except ValueError:
        return 0.0


def summarise(rows: list[dict]) -> list[dict]:
    """One summary dict per profiled launch."""
    out = []
    for r in rows:
        if not r.get("Kernel Name"):
            continue
        secs = num(r, "gpu__time_duration.sum") * 1e-9
        rd = num(r, "dram__bytes_read.sum")
        # 'selected' is the issuing warp itself (about 1 per instruction): the other reasons say why not more
        stalls = sorted(((num(r, k), m.group(1)) for k in r if (m := STALL.match(k)) and m.group(1) != "selected"),
                        reverse=True)[:3]
        l1s, l1r = num(r, "l1tex__t_sectors_pipe_lsu_mem_global_op_ld.sum"), num(r, "l1tex__t_requests_pipe_lsu_mem_global_op_ld.sum")
        l2s, l2r = num(r, "lts__t_sectors_srcunit_tex_op_read.sum"), num(r, "lts__t_requests_srcunit_tex_op_read.sum")
        case = next((m.group(0) for v in r.values() if v and (m := CASE.search(v))), "")
        out.append(dict(
            case=case,
            kernel=re.sub(r"^_|_kernel.*$", "", r["Kernel Name"].split("(")[0]),
            grid=r.get("Grid Size", ""), us=round(secs * 1e6, 1),
            dram_read_MB=round(rd / 1e6, 1), read_TBps=round(rd / secs / 1e12, 2) if secs else 0,
            mem_pct=round(num(r, "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"), 1),
            issue_pct=round(num(r, "sm__issue_active.avg.pct_of_peak_sustained_elapsed"), 1),
            alu_pct=round(num(r, "sm__pipe_alu_cycles_active.avg.pct_of_peak_sustained_elapsed"), 1),
            fma_pct=round(num(r, "sm__pipe_fma_cycles_active.avg.pct_of_peak_sustained_elapsed"), 1),
            tensor_pct=round(num(r, "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed"), 1),
            l1_sectors_per_req=round(l1s / l1r, 2) if l1r else 0,
            l2_sectors_per_req=round(l2s / l2r, 2) if l2r else 0,
            occupancy_pct=round(num(r, "sm__warps_active.avg.pct_of_peak_sustained_active"), 1),
            regs=int(num(r, "launch__registers_per_thread")),
            local_sectors=int(num(r, "l1tex__t_sectors_pipe_lsu_mem_local_op_ld.sum")
                              + num(r, "l1tex__t_sectors_pipe_lsu_mem_local_op_st.sum")),
            inst_per_byte=round(num(r, "smsp__inst_executed.sum") * 32 / rd, 2) if rd else 0,
            top_stalls=", ".join(f"{n} {v:.1f}" for v, n in stalls),
        ))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw", type=Path, help="ncu --csv --page raw --print-units base output")
    p.add_argument("--csv", type=Path, default=None)
    args = p.parse_args()
    text = args.raw.read_text().splitlines()
    start = next(i for i, line in enumerate(text) if line.startswith('"ID"'))
    rows = list(csv.DictReader(text[start:]))[1:]  # the row after the header holds the units
    summary = summarise(rows)
    if not summary:
        sys.exit("ncu_summary.py: no kernel rows in the report")
    cols = list(summary[0])
    if args.csv:
        with args.csv.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            w.writerows(summary)
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for s in summary:
        print("| " + " | ".join(str(s[c]) for c in cols) + " |")


if __name__ == "__main__":
    main()
