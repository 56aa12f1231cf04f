"""The `atom-moe` command line: one subcommand per tool module."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "demo": ("atom_moe.tools.demo", "run a preset layer against the fp32 reference and print a table"),
    "bench": ("atom_moe.tools.bench", "time the experts step against the measured roofline of this GPU"),
    "breakdown": ("atom_moe.tools.breakdown", "time each launch of the experts step (routing, GEMM1, GEMM2) vs its floor"),
    "gsm8k": ("atom_moe.tools.gsm8k", "GSM8K accuracy of a live OpenAI-compatible server (vLLM, SGLang)"),
    "plan": ("atom_moe.tools.plan", "largest safe token budget, memory per rank and engine flags for a MoE model"),
    "accuracy": ("atom_moe.tools.accuracy", "layer-level relative error of MegaMoE against the fp32 reference"),
    "tune": ("atom_moe.tools.tune", "tune the kernels' tile configs inside the MegaMoE op; write the CSV table"),
}


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run one subcommand."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="atom-moe", description="atom_moe: fused expert-parallel MoE tools")
    sub = parser.add_subparsers(dest="command")
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__))
        modules[name] = module
    args = parser.parse_args(argv or ["demo"])  # no arguments: run the demo on what the machine has
    result = modules[args.command or "demo"].run(args)
    # bench.run returns its rows, not an exit code: sys.exit(rows) would print them and exit 1
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
