"""SGLang plugin: our MoE experts step (or the full fused EP path) inside SGLang >= 0.5.14.

SGLang's `load_plugins()` calls `register` (the `sglang.srt.plugins` entry point) in every
scheduler process, each a fresh interpreter. With no ATOM flag set it returns at once and
SGLang runs unchanged. With a flag set it registers, once per process, AROUND hooks with
SGLang's `HookRegistry` (applied by `load_plugins` right after):

* the MoE quant methods' `process_weights_after_loading` (bf16, fp8 128x128 blocks,
  MXFP4, as a16w4 or a8w4 by ATOM_MOE_MXFP4_ACT): build our prepared weights from SGLang's
  loaded parameters and free those;
* `FusedMoE.forward_impl`: run our experts step (or MegaMoE) for the layers built above;
* in fused mode, `post_experts_output_is_complete`: MegaMoE's combine already summed
  each token, so SGLang must not sum it again over EP.

docs/sglang.md has the launch recipes.
"""

from __future__ import annotations

import logging
import sys

from ..common import Flags, Mode, parse_flags, schemes_detail, startup_line, warn_once

# A child of SGLang's "sglang" logger: SGLang's handler prints our lines in its format.
log = logging.getLogger("sglang.atom_moe")

MIN_VERSION = (0, 5, 14)  # the first release with sglang.srt.plugins and HookRegistry

FORWARD = "sglang.srt.layers.moe.fused_moe_triton.layer.FusedMoE.forward_impl"
PROCESS_WEIGHTS = (
    "sglang.srt.layers.quantization.unquant.UnquantizedFusedMoEMethod.process_weights_after_loading",
    "sglang.srt.layers.quantization.fp8.Fp8MoEMethod.process_weights_after_loading",
    "sglang.srt.layers.quantization.mxfp4.Mxfp4MoEMethod.process_weights_after_loading",
)
COMPLETE = "sglang.srt.layers.moe.utils.post_experts_output_is_complete"

_registered: Flags | None = None  # the flags this process registered its hooks with


def sglang_version() -> str:
    """The installed SGLang version string."""
    from importlib.metadata import version

    return version("sglang")


def version_supported(version: str) -> bool:
    """True for SGLang 0.5.14 and newer (the plugin framework we hook through)."""
    try:
        parts = tuple(int(p) for p in version.split("+")[0].split(".")[:3])
    except ValueError:
        return False
    return parts >= MIN_VERSION


def register() -> None:
    """sglang.srt.plugins entry point: register our hooks if an ATOM flag is set (idempotent)."""
    global _registered
    flags = parse_flags()
    if flags.mode is Mode.OFF or _registered is not None:
        return
    version = sglang_version()
    if not version_supported(version):
        warn_once(log, "sglang-version", f"atom_moe supports SGLang >= {'.'.join(map(str, MIN_VERSION))}; found "
                                         f"{version}: every MoE layer keeps SGLang's own path")
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import hooks

    import sglang.srt.layers.moe.utils as moe_utils

    # Before 0.5.23-era SGLang there is no post_experts_output_is_complete to tell that
    # MegaMoE's combine already summed each token: there, fused mode keeps SGLang's path.
    fused_ok = hasattr(moe_utils, COMPLETE.rsplit(".", 1)[1])
    if flags.mode is Mode.FUSED and not fused_ok:
        warn_once(log, "fused-version", f"atom_moe: SGLang {version} has no {COMPLETE}; the fused EP path is off "
                                        "and layers run our experts step where SGLang's dispatch is 'none'")
    hooks.configure(flags, fused_ok)
    HookRegistry.register(FORWARD, hooks.forward_impl, HookType.AROUND)
    for target in PROCESS_WEIGHTS:
        HookRegistry.register(target, hooks.process_weights_after_loading, HookType.AROUND)
    if flags.mode is Mode.FUSED and fused_ok:
        HookRegistry.register(COMPLETE, hooks.post_experts_output_is_complete, HookType.AROUND)
    _registered = flags
    line = startup_line("SGLang", version, flags, schemes_detail(flags, "gpt-oss style"))
    if log.hasHandlers():
        log.info(line)
    else:  # SGLang configures logging per process; the line must show either way
        print(f"INFO {log.name}: {line}", file=sys.stderr, flush=True)


__all__ = ["COMPLETE", "FORWARD", "PROCESS_WEIGHTS", "register", "sglang_version", "version_supported"]
