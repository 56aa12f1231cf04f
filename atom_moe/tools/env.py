"""`atom-moe env`: what this environment gives atom_moe, and what would get in its way.

Prints the versions (python, torch, triton, vLLM, SGLang), the device, which schemes run on
our Triton kernels here, for a model or preset which (shape, token bucket) pairs have tuned
tile rows and which fall to the heuristic, whether vLLM's and SGLang's plugin entry points
see atom_moe, and whether a stray atom_moe.egg-info or a source checkout on sys.path
shadows the installed package. Exit 0: nothing in the way; 1: a problem is listed under
"problems" (each says what to do); 2: a bad value.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
from pathlib import Path

import torch

from ..spec import Scheme, SpecError
from .args import UsageError, positive_int
from .common import TOKENS

# engine -> (distribution, entry-point group, the value our pyproject.toml registers)
ENTRY_POINTS = {
    "vllm": ("vllm", "vllm.general_plugins", "atom_moe.plugins.vllm:register"),
    "sglang": ("sglang", "sglang.srt.plugins", "atom_moe.plugins.sglang:register"),
}
FP8_DOT_SCHEMES = (Scheme.FP8, Scheme.A8W4)  # e4m3 tl.dot: NVIDIA compute capability >= 8.9


def version_of(dist: str) -> str | None:
    """The installed version of a distribution (without importing it), or None."""
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def versions() -> dict[str, str]:
    """python, atom_moe, torch, triton, vllm, sglang versions ('absent' where not installed)."""
    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for name, dist in (("atom_moe", "atom-moe"), ("triton", "triton"), ("vllm", "vllm"), ("sglang", "sglang")):
        out[name] = version_of(dist) or "absent"
    return out


def device_line() -> str:
    """The device torch sees: name, capability and memory, or why there is none."""
    if not torch.cuda.is_available():
        return "cpu (torch sees no CUDA/ROCm device)"
    props = torch.cuda.get_device_properties(0)
    kind = f"ROCm {torch.version.hip}" if torch.version.hip else f"CUDA {torch.version.cuda}"
    return (f"{torch.cuda.device_count()} x {props.name} (compute capability {props.major}.{props.minor}, "
            f"{props.total_memory / 2**30:.1f} GiB, {kind})")


def kernel_schemes() -> list[tuple[str, str]]:
    """(scheme, how it runs here) for every scheme: our Triton kernels, the interpreter, or the torch twin."""
    from ..experts import SUPPORTED

    try:
        import triton  # noqa: F401
    except ImportError:
        return [(s.value, "torch twin only: triton is not installed") for s in Scheme]
    if not torch.cuda.is_available():
        how = ("Triton kernels in Triton's interpreter (TRITON_INTERPRET=1 is set: correctness, not speed)"
               if os.environ.get("TRITON_INTERPRET") == "1" else
               "torch twin; the Triton kernels only in Triton's interpreter (TRITON_INTERPRET=1)")
        return [(s.value, how if s in SUPPORTED else "torch twin only") for s in Scheme]
    cap = torch.cuda.get_device_capability(0)
    rows = []
    for s in Scheme:
        if s not in SUPPORTED:
            rows.append((s.value, "torch twin only: the Triton kernels do not take it"))
        elif torch.version.hip:
            rows.append((s.value, "Triton kernels (never run on AMD by us: untested)"))
        elif s in FP8_DOT_SCHEMES and cap < (8, 9):
            rows.append((s.value, f"torch twin: fp8 dots need compute capability >= 8.9, this GPU has "
                                  f"{cap[0]}.{cap[1]}"))
        else:
            rows.append((s.value, "Triton kernels"))
    return rows


def tuned_coverage(model: str, scheme: str | None, eps: list[int], tokens: list[int], devices: list[str]
                   ) -> list[str]:
    """Per (device, scheme, EP, local shape): the token buckets with tuned rows and those left to the heuristic."""
    from ..checkpoint.config import load_model
    from ..experts import SUPPORTED
    from ..kernels import tuning

    schemes = [Scheme.parse(scheme)] if scheme else [s for s in Scheme if s in SUPPORTED]
    lines = []
    for s in schemes:
        layer = load_model(model, s)
        spec = layer.spec
        for ep in eps:
            if spec.num_experts % ep:
                raise UsageError(f"--ep {ep}: {layer.name} has {spec.num_experts} experts; allowed: divisors of "
                                 f"{spec.num_experts}")
            E = spec.num_experts // ep
            # the MegaMoE op looks up a rank's tokens; the rows it receives are up to EP x that
            shape = f"H={spec.hidden_size} I={spec.intermediate_size} E_local={E} top_k={spec.top_k}"
            for dev in devices:
                have, source = tuning.tuned_buckets(dev, s.value, spec.hidden_size, spec.intermediate_size, E,
                                                    spec.top_k)
                head = f"  {dev} {s.value} EP {ep} ({shape}):"
                if not have:
                    lines.append(f"{head} no tuned rows: every T uses the heuristic tiles")
                    continue
                near = [t for t in tokens if t not in have and tuning.within_reach(have, t)]
                far = [t for t in tokens if not tuning.within_reach(have, t)]
                where = "built-in table" if source == str(tuning.CONFIG_DIR) else source
                lines.append(f"{head} tuned at T = {', '.join(map(str, have))} ({where})"
                             + (f"; T = {', '.join(map(str, near))} use the nearest tuned bucket" if near else "")
                             + (f"; T = {', '.join(map(str, far))} use the heuristic (more than "
                                f"{tuning.BUCKET_REACH}x from a tuned bucket)" if far else ""))
    return lines


def entry_point_lines() -> tuple[list[str], list[str]]:
    """(report lines, problems) for the engines' plugin entry points."""
    lines, problems = [], []
    for engine, (dist, group, value) in ENTRY_POINTS.items():
        found = [ep for ep in md.entry_points(group=group) if ep.name == "atom_moe"]
        installed = version_of(dist)
        if found and all(ep.value == value for ep in found):
            lines.append(f"  {engine}: {group} -> {value}" + ("" if installed else f" ({engine} not installed)"))
        elif found:
            got = ", ".join(ep.value for ep in found)
            lines.append(f"  {engine}: {group} -> {got} (expected {value})")
            problems.append(f"the {group} entry point atom_moe points at {got}, not {value}: a stale install; "
                            f"reinstall atom_moe (pip install -e <checkout>)")
        else:
            lines.append(f"  {engine}: no atom_moe entry point in {group}")
            problems.append(f"{engine} would not load the plugin: no atom_moe entry point in {group}; "
                            f"pip install atom_moe into this environment (sys.path changes are not enough)")
    return lines, problems


def installed_root() -> Path | None:
    """The folder the installed atom-moe distribution serves atom_moe from (an editable install's checkout)."""
    try:
        dist = md.distribution("atom-moe")
    except md.PackageNotFoundError:
        return None
    direct = dist.read_text("direct_url.json")
    if direct:
        url = json.loads(direct).get("url", "")
        if url.startswith("file://") and json.loads(direct).get("dir_info", {}).get("editable"):
            return Path(url.removeprefix("file://"))
    return Path(str(dist.locate_file("")))


def shadowing(path: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(report lines, problems): which atom_moe `import` finds on `path` (sys.path), and stray metadata on it."""
    path = sys.path if path is None else path
    lines, problems = [], []
    root = installed_root()
    # sys.path entries are searched before an editable install's finder: the first checkout there wins
    first = next((Path(e or os.getcwd()).resolve() for e in path
                  if (Path(e or os.getcwd()) / "atom_moe" / "__init__.py").is_file()), None)
    imported = first or (root.resolve() if root else None)
    lines.append(f"  import atom_moe -> {imported}" + (f" (installed: {root})" if root else " (not installed)"))
    if root is not None and first is not None and first != root.resolve() and first.parent != root.resolve():
        problems.append(f"`import atom_moe` finds the source checkout {first}, not the installed package at {root}: "
                        f"it is on sys.path (e.g. the current folder); run from another folder or reinstall from it")
    for entry in path:
        folder = Path(entry or os.getcwd())
        for stray in sorted(folder.glob("atom_moe.egg-info")) + sorted(folder.glob("atom_moe-*.egg-info")):
            lines.append(f"  stray metadata on sys.path: {stray}")
            problems.append(f"{stray} is on sys.path ({'the current folder' if not entry else entry}): "
                            f"engines may read its stale entry points instead of the installed ones; delete it "
                            f"(a build left it) or launch from another folder")
    return lines, problems


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `atom-moe env`'s options."""
    parser.add_argument("model", nargs="?", default=None,
                        help="a preset (deepseek-v3, kimi-k2, gpt-oss-120b, qwen3-235b-a22b, glm-4.5) or a "
                             "HuggingFace config.json: report which of its shapes have tuned tile rows")
    parser.add_argument("--scheme", choices=[s.value for s in Scheme], default=None,
                        help="the model's scheme; none: every scheme the Triton kernels take")
    parser.add_argument("--ep", type=positive_int, action="append", default=None,
                        help="EP size(s) to report (local experts = E / EP), repeatable; none: 1 and 8")
    parser.add_argument("--tokens", type=positive_int, nargs="+", default=list(TOKENS),
                        help="token buckets to check")
    parser.add_argument("--device-name", action="append", default=None,
                        help="table device name(s), e.g. 'NVIDIA H200', repeatable; none: this GPU, or every "
                             "device in the tables on a CPU")


def run(args: argparse.Namespace) -> int:
    """Entry point of `atom-moe env`; 0 nothing in the way, 1 problems listed."""
    from ..kernels import tuning

    v = versions()
    out = ["versions: " + ", ".join(f"{k} {val}" for k, val in v.items()),
           f"device: {device_line()}",
           "schemes here:"]
    out += [f"  {s:<6} {how}" for s, how in kernel_schemes()]
    dirs = tuning.override_dirs()
    out.append(f"tuned tables: {', '.join(dirs) + ' before ' if dirs else ''}{tuning.CONFIG_DIR} "
               f"(overrides: {' / '.join(tuning.ENV_VARS)})")
    problems = []
    missing = [d for d in dirs if not os.path.isdir(d)]
    if missing:
        problems.append(f"{' or '.join(tuning.ENV_VARS)} names folders that do not exist: {', '.join(missing)}")
    if args.model is not None and not missing:
        if args.device_name:
            devices = [d.lower() for d in args.device_name]
        elif torch.cuda.is_available():
            devices = [torch.cuda.get_device_name(0).lower()]
        else:
            devices = tuning.table_devices()
        try:
            out.append(f"tuned rows for {args.model} (T = tokens per call on a rank):")
            out += tuned_coverage(args.model, args.scheme, args.ep or [1, 8], args.tokens, devices)
        except SpecError as exc:
            raise UsageError(str(exc)) from None
    lines, found = entry_point_lines()
    out += ["engine plugin entry points:"] + lines
    problems += found
    lines, found = shadowing()
    out += ["which atom_moe is imported:"] + lines
    problems += found
    out += ["problems:"] + ([f"  - {p}" for p in problems] or ["  none"])
    print("\n".join(out))
    return 1 if problems else 0
