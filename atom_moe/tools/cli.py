"""The `atom-moe` command line: one subcommand per tool module."""

from __future__ import annotations

import importlib
import sys

from .args import FAILURE, USAGE, Parser, RunFailure, UsageError

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "demo": ("atom_moe.tools.demo", "run a preset layer against the fp32 reference and print a table"),
    "bench": ("atom_moe.tools.bench", "time the experts step against the measured roofline of this GPU"),
    "breakdown": ("atom_moe.tools.breakdown", "time each launch of the experts step (routing, GEMM1, GEMM2) vs its floor"),
    "gsm8k": ("atom_moe.tools.gsm8k", "GSM8K accuracy of a live OpenAI-compatible server (vLLM, SGLang)"),
    "plan": ("atom_moe.tools.plan", "largest safe token budget, memory per rank and engine flags for a MoE model"),
    "accuracy": ("atom_moe.tools.accuracy", "layer-level relative error of MegaMoE against the fp32 reference"),
    "tune": ("atom_moe.tools.tune", "tune the kernels' tile configs inside the MegaMoE op; write the CSV table"),
    "place": ("atom_moe.tools.place", "propose a redundant-expert placement (EPLB) from recorded per-expert counts"),
    "env": ("atom_moe.tools.env", "versions, device, schemes on our kernels, tuned rows, plugin entry points, shadowing"),
}


def build_parser() -> tuple[Parser, dict]:
    """The `atom-moe` parser with every subcommand, and the subcommand modules by name."""
    parser = Parser(prog="atom-moe", description="atom_moe: fused expert-parallel MoE tools\n\n"
                    "exit codes: 0 done, 1 a runtime failure (no GPU, server down, does not fit), 2 a bad value")
    sub = parser.add_subparsers(dest="command", parser_class=Parser)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        module.add_arguments(sub.add_parser(name, help=help_text, description=module.__doc__))
        modules[name] = module
    return parser, modules


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run one subcommand."""
    argv = sys.argv[1:] if argv is None else argv
    parser, modules = build_parser()
    try:
        args = parser.parse_args(argv or ["demo"])  # no arguments: run the demo on what the machine has
    except SystemExit as exc:  # --help (0) or a bad value (2, one line already printed by Parser.error)
        return exc.code if isinstance(exc.code, int) else USAGE
    command = args.command or "demo"
    try:
        result = modules[command].run(args)
    except UsageError as exc:
        print(f"atom-moe {command}: error: {exc}", file=sys.stderr)
        return USAGE
    except RunFailure as exc:
        print(f"atom-moe {command}: {exc}", file=sys.stderr)
        return FAILURE
    # bench.run returns its rows, not an exit code: sys.exit(rows) would print them and exit 1
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
