"""vLLM plugin: swap our MoE experts step (or the full fused EP path) into vLLM 0.30-0.33.

vLLM loads `register` through the `vllm.general_plugins` entry point in every process
(API server, engine core, each worker) before any model is built. With no ATOM flag set
it returns at once and vLLM runs unchanged. With a flag set it registers, once per
process, an out-of-tree `RoutedExperts` (a vLLM PluggableLayer, replaceable through
`register_oot`) whose quant-method choice wraps vLLM's bf16, fp8-block and MXFP4 (gpt-oss's
and the generic one DeepSeek-V4 loads into) methods with ours (MXFP4 as a16w4 or a8w4, by
ATOM_MOE_MXFP4_ACT); everything else keeps
vLLM's method with one warning per layer type.
docs/vllm.md has the launch recipes.
"""

from __future__ import annotations

import logging
import sys

from ..common import Flags, Mode, parse_flags, schemes_detail, startup_line, warn_once

# A child of vLLM's "vllm" logger, so vLLM's own handler prints our lines with its format.
log = logging.getLogger("vllm.atom_moe")

SUPPORTED = ((0, 30), (0, 33))  # inclusive (major, minor) range: FusedMoEFactory -> MoERunner/RoutedExperts

_registered_cls: type | None = None  # our RoutedExperts class, once registered in this process


def vllm_version() -> str:
    """The installed vLLM version string."""
    import vllm

    return vllm.__version__


def version_supported(version: str) -> bool:
    """True for vLLM 0.30.x through 0.33.x (the MoERunner/RoutedExperts API we hook)."""
    try:
        major, minor = (int(p) for p in version.split(".")[:2])
    except ValueError:
        return False
    return SUPPORTED[0] <= (major, minor) <= SUPPORTED[1]


def register() -> None:
    """vllm.general_plugins entry point: install our MoE path if an ATOM flag is set (idempotent)."""
    global _registered_cls
    flags = parse_flags()
    if flags.mode is Mode.OFF:
        return
    version = vllm_version()
    if not version_supported(version):
        warn_once(log, "vllm-version",
                  f"atom_moe supports vLLM {SUPPORTED[0][0]}.{SUPPORTED[0][1]} to {SUPPORTED[1][0]}.{SUPPORTED[1][1]}; "
                  f"found {version}: every MoE layer keeps vLLM's own path")
        return
    from .method import install

    cls = install(flags)
    if cls is None or cls is _registered_cls:
        return
    _registered_cls = cls
    mxfp4 = "gpt-oss; DeepSeek-V4 and other Mxfp4MoEMethod layers"
    line = startup_line("vLLM", version, flags, schemes_detail(flags, mxfp4))
    if log.hasHandlers():
        log.info(line)
    else:  # vLLM 0.33 configures its log handler later in some processes: the line must still show
        print(f"INFO {log.name}: {line}", file=sys.stderr, flush=True)


def active_flags() -> Flags:
    """The flags this process runs with (for tests and `atom-moe` diagnostics)."""
    return parse_flags()
