"""Expert parallelism: the MegaMoE op, its buffer sizing, transports and launch helpers (docs/ep.md)."""

from .buffers import BufferLimitError, BufferSpec, buffer_plan, buffer_sizes, check_limits
from .instances import DECODE_TOKENS, SMALL_DECODE_TOKENS, MegaMoEInstances, decode_capacities
from .launch import DistInfo, init_distributed
from .op import MegaMoE, MegaMoEError, WarmupCase, auto_transport
from .transports import LocalTransport, TorchTransport, Transport

__all__ = [
    "auto_transport", "DECODE_TOKENS", "SMALL_DECODE_TOKENS", "MegaMoEInstances", "decode_capacities",
    "BufferLimitError", "BufferSpec", "DistInfo", "LocalTransport", "MegaMoE", "MegaMoEError", "TorchTransport",
    "Transport", "WarmupCase", "buffer_plan", "buffer_sizes", "check_limits", "init_distributed",
]
