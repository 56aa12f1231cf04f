#!/usr/bin/env python3
"""Benchmark the fused experts path on a GPU: `python scripts/bench.py --help` (logic in atom_moe/tools/bench.py)."""

from atom_moe.tools.bench import main

if __name__ == "__main__":
    main()
