"""Engine-neutral plugin pieces: flags, the start-up line, layer specs, limits, warn-once.

The vLLM plugin (atom_moe.plugins.vllm) and the SGLang plugin (atom_moe.plugins.sglang) use
these. Nothing here imports an engine.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from ..spec import Activation, MoESpec, Placement, Scheme, SpecError, shared_physical_map

FLAG_FUSED = "ATOM_USE_FLYDSL_FUSED"  # full fused EP path: our dispatch + experts + combine
FLAG_EXPERTS = "ATOM_USE_FLYDSL"  # our experts step; the engine keeps its dispatch and combine
FLAG_KERNELS_PATH = "ATOM_FLYDSL_KERNELS_PATH"  # extra tuned tables (read by atom_moe.kernels.tuning)
FLAG_CONFIG_DIR = "ATOM_MOE_CONFIG_DIR"  # its alias; tuning reads both, in this order
FLAG_TRANSPORT = "ATOM_MOE_TRANSPORT"  # fused mode's EP transport: auto (default), symm or torch
TRANSPORTS = ("auto", "symm", "torch")
FLAG_MXFP4_ACT = "ATOM_MOE_MXFP4_ACT"  # activations of MXFP4 expert layers: bf16 (a16w4, default) or fp8 (a8w4)
# bf16 is the default: on one H200 (docs/perf/after-merge-h200.md) a16w4 is faster from T=128 on
# and ~20x more accurate; a8w4 wins only at T=1 (docs/vllm.md has the numbers)
MXFP4_ACTS = {"bf16": Scheme.A16W4, "fp8": Scheme.A8W4}
# fused mode: a second, small MegaMoE per layer shape for steps of at most this many tokens per rank
# (atom_moe.ep.MegaMoEInstances; default atom_moe.ep.DECODE_TOKENS = 128; 0: one op for every step),
# and below it one of atom_moe.ep.SMALL_DECODE_TOKENS = 8 (atom_moe.ep.decode_capacities)
FLAG_DECODE_TOKENS = "ATOM_MOE_DECODE_TOKENS"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


class FlagError(ValueError):
    """An ATOM_* environment flag with a value we cannot read."""


class Mode(str, enum.Enum):
    """What the plugin replaces."""

    OFF = "off"  # nothing: the engine runs exactly as without the plugin
    EXPERTS = "experts"  # ATOM_USE_FLYDSL=1: our experts step inside the engine's dispatch/combine
    FUSED = "fused"  # ATOM_USE_FLYDSL_FUSED=1: MegaMoE dispatch + experts + combine (DP+EP layers)


@dataclass(frozen=True)
class Flags:
    """The plugin's settings, read from the environment."""

    mode: Mode
    kernels_path: str | None = None
    transport: str = "auto"
    mxfp4_act: str = "bf16"  # ATOM_MOE_MXFP4_ACT: a key of MXFP4_ACTS
    decode_tokens: int = 128  # ATOM_MOE_DECODE_TOKENS: the decode MegaMoE's capacity per rank; 0 = none

    @property
    def mxfp4_scheme(self) -> Scheme:
        """Our scheme for the engine's MXFP4 expert layers: a16w4 (bf16 activations) or a8w4 (fp8)."""
        return MXFP4_ACTS[self.mxfp4_act]


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "")
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise FlagError(f"{name}={raw!r} is not a boolean; use 1 (on) or 0 (off)")


def parse_flags(env: Mapping[str, str] | None = None) -> Flags:
    """Read ATOM_USE_FLYDSL_FUSED / ATOM_USE_FLYDSL / table folders / ATOM_MOE_TRANSPORT / ATOM_MOE_MXFP4_ACT.

    FlagError on bad values.

    The table folders are ATOM_FLYDSL_KERNELS_PATH then its alias ATOM_MOE_CONFIG_DIR, the
    order atom_moe.kernels.tuning reads them in; a folder that does not exist is an error.
    """
    env = os.environ if env is None else env
    fused, experts = _flag(env, FLAG_FUSED), _flag(env, FLAG_EXPERTS)
    mode = Mode.FUSED if fused else Mode.EXPERTS if experts else Mode.OFF
    dirs = []
    for var in (FLAG_KERNELS_PATH, FLAG_CONFIG_DIR):
        folders = [p for p in env.get(var, "").strip().split(os.pathsep) if p]
        missing = [p for p in folders if not os.path.isdir(p)]
        if missing and mode is not Mode.OFF:
            raise FlagError(f"{var} names folders that do not exist: {', '.join(missing)} "
                            f"(a {os.pathsep}-separated list of folders of tuned-table CSV files)")
        dirs += folders
    path = os.pathsep.join(dirs) or None
    transport = env.get(FLAG_TRANSPORT, "").strip().lower() or "auto"
    if transport not in TRANSPORTS:
        raise FlagError(f"{FLAG_TRANSPORT}={env.get(FLAG_TRANSPORT)!r}; allowed: {', '.join(TRANSPORTS)}")
    act = env.get(FLAG_MXFP4_ACT, "").strip().lower() or "bf16"
    if act not in MXFP4_ACTS:
        raise FlagError(f"{FLAG_MXFP4_ACT}={env.get(FLAG_MXFP4_ACT)!r}; allowed: "
                        + ", ".join(f"{k} ({v.value})" for k, v in MXFP4_ACTS.items()))
    return Flags(mode, path, transport, act, _decode_tokens(env))


def _decode_tokens(env: Mapping[str, str]) -> int:
    from ..ep.instances import DECODE_TOKENS

    raw = env.get(FLAG_DECODE_TOKENS, "").strip()
    if not raw:
        return DECODE_TOKENS
    if not raw.isdigit():
        raise FlagError(f"{FLAG_DECODE_TOKENS}={env.get(FLAG_DECODE_TOKENS)!r} is not a token count; use an integer "
                        f">= 0 (tokens per rank of the decode MegaMoE; 0: one MegaMoE for every step)")
    return int(raw)


def fused_transport(flags: Flags, ep_size: int, device: torch.device, backend: str, spec: MoESpec) -> str:
    """The EP transport of the fused path: the flag's choice, else what MegaMoE's 'auto' picks (bf16 wire)."""
    from ..ep import auto_transport

    if ep_size == 1:
        return "local"
    return flags.transport if flags.transport != "auto" else auto_transport(ep_size, device, backend, "bf16", spec)


def decode_capacity(flags: Flags, tokens: int) -> int | None:
    """The decode MegaMoE's capacity for a fused layer sized for `tokens` per rank, or None (one op serves all)."""
    return flags.decode_tokens if 0 < flags.decode_tokens < tokens else None


def build_fused_op(spec: MoESpec, group, cpu_group, *, tokens: int, decode_tokens: int | None, transport: str,
                   backend: str, device: torch.device):
    """One MegaMoE sized for `tokens` per rank, or with decode_tokens a decode + prefill pair (MegaMoEInstances).

    The pair's decode buffers come on top of the planned ones: on CUDA they must fit in what is free.
    """
    from ..ep import MegaMoE, MegaMoEInstances, buffer_sizes, decode_capacities

    if decode_tokens is None:
        return MegaMoE(spec, group, cpu_group=cpu_group, max_tokens_per_rank=tokens, transport=transport,
                       experts_backend=backend, device=device)
    if device.type == "cuda":
        capacities = decode_capacities(decode_tokens) + (tokens,)
        need = sum(sum(buffer_sizes(spec, spec.placement.world_size, c, "bf16", transport=transport,
                                    experts_backend=backend).values()) for c in capacities)
        free = torch.cuda.mem_get_info(device)[0]
        if need > free:
            raise LimitError(f"the decode ({' and '.join(map(str, capacities[:-1]))} tokens per rank) and prefill "
                             f"({tokens}) MegaMoE buffers "
                             f"need {need / 2**30:.2f} GiB per rank but only {free / 2**30:.2f} GiB is free; lower "
                             f"the token budget or set {FLAG_DECODE_TOKENS}=0 (one MegaMoE)")
    return MegaMoEInstances(spec, group, cpu_group=cpu_group, max_tokens_per_rank=tokens,
                            decode_tokens=decode_tokens, transport=transport, experts_backend=backend, device=device)


def bind_layer(plan, weights, *, decode_tokens: int | None, device: torch.device, shared: dict,
               ep_groups: Callable[[], tuple], agreed_tokens: Callable[[], int | None]) -> tuple[object, str]:
    """(the layer shape's MegaMoE op(s) or experts workspace, this layer's handle for atom_moe.ops).

    The op or workspace is built once per layer shape and kept in `shared` (every layer of that shape
    binds its own weights to it, per call); `ep_groups()` gives the EP (device, cpu) groups, asked only
    when a fused op is built; `agreed_tokens` is the engine's DP-wide token count, which picks the
    decode or the prefill op of a pair. `plan` carries spec, fused, backend, tokens and transport.
    """
    from .. import ops

    key = (plan.spec, plan.fused, plan.backend, plan.tokens, decode_tokens, device)
    if key not in shared:
        if plan.fused:
            group, cpu_group = ep_groups()
            shared[key] = build_fused_op(plan.spec, group, cpu_group, tokens=plan.tokens, decode_tokens=decode_tokens,
                                         transport=plan.transport, backend=plan.backend, device=device)
        elif plan.backend == "triton":
            from ..experts import allocate_workspace

            shared[key] = allocate_workspace(plan.spec, plan.tokens, device)
        else:
            shared[key] = None  # experts_torch needs no workspace
    runtime = shared[key]
    if plan.fused:
        return runtime, ops.bind_mega_moe(runtime, weights,
                                          agreed_tokens=agreed_tokens if decode_tokens is not None else None)
    return runtime, ops.bind_experts(weights, plan.spec, backend=plan.backend, workspace=runtime)


def versions() -> dict[str, str]:
    """Versions worth naming in a start-up or bug-report line."""
    from .. import __version__

    out = {"atom_moe": __version__, "torch": torch.__version__}
    try:
        import triton

        out["triton"] = triton.__version__
    except ImportError:
        out["triton"] = "absent"
    return out


def _small_decode(decode_tokens: int) -> str:
    from ..ep import decode_capacities

    smaller = decode_capacities(decode_tokens)[:-1]
    return "".join(f", and one for <= {c}" for c in smaller)


def startup_line(engine: str, engine_version: str, flags: Flags, detail: str = "") -> str:
    """The one line a plugin logs when it activates: mode, flags, versions."""
    v = versions()
    what = {
        Mode.FUSED: f"{FLAG_FUSED}=1: MegaMoE fused dispatch + experts + combine on DP+EP layers ("
                    + (f"a decode MegaMoE for steps of <= {flags.decode_tokens} tokens per rank, "
                       f"{FLAG_DECODE_TOKENS}={flags.decode_tokens}" + _small_decode(flags.decode_tokens)
                       if flags.decode_tokens
                       else f"one MegaMoE for every step, {FLAG_DECODE_TOKENS}=0")
                    + "), our experts step on the others",
        Mode.EXPERTS: f"{FLAG_EXPERTS}=1: our experts step; {engine} keeps its dispatch and combine",
        Mode.OFF: "off",
    }[flags.mode]
    tables = flags.kernels_path or "built-in"
    line = (f"atom_moe {v['atom_moe']} active in {engine} {engine_version} (torch {v['torch']}, "
            f"triton {v['triton']}): {what}; tuned tables: {tables}")
    return f"{line}; {detail}" if detail else line


def schemes_detail(flags: Flags, mxfp4_models: str) -> str:
    """The start-up line's list of the schemes we take, naming what MXFP4 layers run as."""
    return (f"schemes: bf16, fp8 (128x128 blocks), mxfp4 ({mxfp4_models}) as {flags.mxfp4_scheme.value} "
            f"({FLAG_MXFP4_ACT}={flags.mxfp4_act})")


_warned: set[str] = set()


def warn_once(logger: logging.Logger, key: str, message: str) -> bool:
    """Log `message` as a warning the first time `key` is seen in this process; True if logged."""
    if key in _warned:
        return False
    _warned.add(key)
    logger.warning(message)
    return True


def local_experts_from_map(expert_map: torch.Tensor | None, num_experts: int) -> tuple[int, ...]:
    """Global expert ids in local-slot order from an engine's expert map (global id -> slot or -1).

    Read once at weight-processing time (a host copy of a [E] table), never per forward.
    None means every expert is local (no expert parallelism).
    """
    if expert_map is None:
        return tuple(range(num_experts))
    table = expert_map.detach().to("cpu", torch.int64)
    if table.dim() != 1 or table.numel() != num_experts:
        raise ValueError(f"expert map must be [num_experts={num_experts}], got {tuple(table.shape)}")
    slots = {int(slot): e for e, slot in enumerate(table.tolist()) if slot >= 0}
    if sorted(slots) != list(range(len(slots))):
        raise ValueError(f"expert map slots must be 0..L-1 without gaps, got {sorted(slots)}")
    return tuple(slots[s] for s in range(len(slots)))


def layer_spec(*, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, scheme: Scheme,
               activation: Activation, has_bias: bool, local_experts: tuple[int, ...], ep_rank: int,
               ep_size: int, max_tokens_per_rank: int, shared_experts: int = 0,
               replicate_shared: bool = False) -> MoESpec:
    """The MoESpec of one engine layer as this rank sees it (local experts from the engine's map).

    shared_experts: the engine's fused shared experts, the last ids of num_experts (top_k counts
    their slots). replicate_shared (MegaMoE with EP > 1): the engine keeps them on every rank, so
    they become physical slots there and each token's shared slots are served at home.
    """
    placement = Placement(ep_rank, ep_size, tuple(local_experts))
    if shared_experts and replicate_shared and ep_size > 1:
        phys = shared_physical_map(num_experts, shared_experts, ep_size)
        per = len(phys) // ep_size
        if tuple(local_experts) != phys[ep_rank * per:(ep_rank + 1) * per]:
            raise SpecError(f"the engine's local experts {tuple(local_experts)} are not the routed experts placed "
                            f"linearly plus the shared ones {phys[ep_rank * per:(ep_rank + 1) * per]}")
        placement = Placement(ep_rank, ep_size, None, phys)
    return MoESpec(hidden_size=hidden_size, intermediate_size=intermediate_size, num_experts=num_experts,
                   top_k=top_k, scheme=scheme, activation=activation, placement=placement,
                   max_tokens_per_rank=max_tokens_per_rank, has_bias=has_bias, shared_experts=shared_experts)


def tokens_per_rank(max_num_batched_tokens: int, capture_sizes: list[int] | tuple[int, ...] | None = None,
                    max_capture_size: int | None = None) -> int:
    """The most tokens one rank can feed one MoE call: the scheduler's budget or the largest graph."""
    sizes = [int(max_num_batched_tokens)] + [int(s) for s in (capture_sizes or ())]
    if max_capture_size:
        sizes.append(int(max_capture_size))
    return max(sizes)


class LimitError(ValueError):
    """A start-up limit (int32 range or device memory) that the engine's settings exceed."""


def check_start_limits(spec: MoESpec, *, ep_size: int, tokens: int, wire: str, transport: str,
                       experts_backend: str, free_bytes: int | None, flag: str, scale: int = 1) -> int:
    """Raise LimitError naming the largest safe engine setting if `tokens` per rank does not fit; return bytes.

    `tokens` is what one rank's buffers must hold (the engine setting times `scale`, e.g.
    the DP size when the engine gathers every rank's tokens first); `flag` names the
    engine setting in the message. Checks the int32 byte/index guard of every buffer and,
    when `free_bytes` is given, that the buffers fit in free device memory.
    """
    from ..ep.buffers import BufferLimitError, buffer_sizes, check_limits, largest_true

    def setting(rows: int) -> int:
        return rows // scale

    try:
        check_limits(spec, ep_size, tokens, wire, transport=transport, experts_backend=experts_backend)
    except BufferLimitError as exc:
        safe = largest_true(lambda t: _fits_int32(spec, ep_size, t, wire, transport, experts_backend), tokens)
        raise LimitError(f"{flag}={setting(tokens)} is too large for this MoE layer: {exc} "
                         f"The largest safe {flag} is {setting(safe)}.") from None
    need = sum(buffer_sizes(spec, ep_size, tokens, wire, transport=transport, experts_backend=experts_backend).values())
    if free_bytes is not None and need > free_bytes:
        def fits(t: int) -> bool:
            sizes = buffer_sizes(spec, ep_size, t, wire, transport=transport, experts_backend=experts_backend)
            return sum(sizes.values()) <= free_bytes
        safe = largest_true(fits, tokens)
        raise LimitError(f"{flag}={setting(tokens)} needs {need / 2**30:.2f} GiB of MoE buffers per rank but only "
                         f"{free_bytes / 2**30:.2f} GiB is free; the largest safe {flag} is {setting(safe)}")
    return need


def _fits_int32(spec, ep_size, tokens, wire, transport, backend) -> bool:
    from ..ep.buffers import BufferLimitError, check_limits

    try:
        check_limits(spec, ep_size, tokens, wire, transport=transport, experts_backend=backend)
    except BufferLimitError:
        return False
    return True


