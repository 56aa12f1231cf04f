"""MegaMoE ops of several capacities for one layer shape: decode ops and a planner-sized prefill op, one per call.

The receive side's grids are static, sized for W x max_tokens_per_rank rows: an op built for 8192
tokens per rank serving 8 runs 2-3x slower than one built for 8 (docs/perf/ep-h200x2.md). So a
decode batch (at most `decode_tokens` per rank) runs on an op of that capacity and anything larger
on the prefill op. Below it, steps of at most `small_tokens` per rank get an op of their own: on one
H200 the 128-token op at T = 1 spent 17-19 us per rank more than an op sized for the batch (GEMM2's
empty programs 9-13 us, the routing kernel 9 us; 8-13 % of the step); the 8-token op, with the
routing kernel's owner pass bounded by the blocks in use, 0.3-1.6 % (docs/perf/ep-instances-h200.md).
Every op binds the same prepared weights per call (no second copy); their buffers are the only extra
memory.

Every rank must pick the same op in the same step (their collectives must pair up). The pick comes
from a count every rank holds alike: the engine's largest token count across DP ranks (`agreed_tokens`),
else the most tokens of any rank, gathered here (the same host gather the op's per-call check makes,
done once for all ops), and while a CUDA graph is captured the graph's own size (engines pad every DP
rank to one graph size; the gather cannot run inside a capture). A rank that still picks differently
from its peers raises MegaMoEError on every rank (the ops' per-call check compares their capacities).
"""

from __future__ import annotations

import torch

from ..spec import MoESpec
from ..weights import PreparedWeights
from .op import MegaMoE, MegaMoEError, _capturing

# Default decode capacity per rank: AMD's MegaMoE keeps its fixed-slot instance for <= 128 tokens per
# rank, for the same static-grid reason; decode batches (one token per running request) sit below it.
DECODE_TOKENS = 128
# The smallest decode op's capacity, built when it is below decode_tokens (measured above: T <= 8 is
# where the 128-token op's fixed cost shows; from T = 8 on it stays within 2 % of an exact op).
SMALL_DECODE_TOKENS = 8


def decode_capacities(decode_tokens: int, small_tokens: int = SMALL_DECODE_TOKENS) -> tuple[int, ...]:
    """Capacities of the decode ops, ascending: small_tokens (when 0 < it < decode_tokens), then decode_tokens."""
    return ((small_tokens,) if 0 < small_tokens < decode_tokens else ()) + (decode_tokens,)


class MegaMoEInstances:
    """Decode MegaMoEs (capacities `decode_capacities(decode_tokens, small_tokens)`) and a prefill one, one EP group.

    Built collectively like MegaMoE (same keyword arguments); every op reuses the largest decode op's
    gloo side group, so a rank that picks another op still meets its peers in the same gather.
    `decode` is the largest decode op, `decode_ops` all of them (ascending), `prefill` the prefill op.
    """

    def __init__(self, spec: MoESpec, group=None, *, max_tokens_per_rank: int,
                 decode_tokens: int = DECODE_TOKENS, small_tokens: int = SMALL_DECODE_TOKENS, **kwargs) -> None:
        if not isinstance(decode_tokens, int) or not 1 <= decode_tokens < max_tokens_per_rank:
            raise MegaMoEError(f"decode_tokens={decode_tokens!r} must be an int in [1, max_tokens_per_rank="
                               f"{max_tokens_per_rank}); with no smaller decode batch build one MegaMoE")
        if not isinstance(small_tokens, int) or small_tokens < 0:
            raise MegaMoEError(f"small_tokens={small_tokens!r} must be an int >= 0 (0: no smaller decode op)")
        if kwargs.get("check_tokens") is False:
            raise MegaMoEError("MegaMoEInstances needs check_tokens=True: without the per-call gather a rank that "
                               "picked the other op would not be caught")
        self.decode = MegaMoE(spec, group, max_tokens_per_rank=decode_tokens, **kwargs)
        built = [self.decode]
        try:
            kwargs["cpu_group"] = self.decode.cpu_group  # one gather group for all: picks are compared
            smaller = [MegaMoE(spec, group, max_tokens_per_rank=c, **kwargs)
                       for c in decode_capacities(decode_tokens, small_tokens)[:-1]]
            built += smaller
            self.prefill = MegaMoE(spec, group, max_tokens_per_rank=max_tokens_per_rank, **kwargs)
        except BaseException:
            for op in reversed(built):  # the largest decode op, owner of the gather group, last
                op.close()
            raise
        self.decode_ops = tuple(smaller) + (self.decode,)
        self.spec = spec
        self.world = self.decode.world
        self.max_tokens_per_rank = max_tokens_per_rank
        self.decode_tokens = decode_tokens
        self._weights: PreparedWeights | None = None

    def bind(self, weights: PreparedWeights) -> "MegaMoEInstances":
        """Point the pair at one layer's prepared weights (checked now; the picked op binds them per call, no copy)."""
        self.decode.bind(weights)  # same spec and device as the prefill op: one check serves both
        self._weights = weights
        return self

    def pick(self, agreed_tokens: int) -> MegaMoE:
        """The op for a step whose largest per-rank token count (the same on every rank) is agreed_tokens."""
        return next((op for op in self.decode_ops if agreed_tokens <= op.max_tokens_per_rank), self.prefill)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                agreed_tokens: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H]: the bound layer's output from the op the step's agreed token count picks.

        agreed_tokens: the most tokens any EP rank brings to this step, as the engine knows it on
        every rank (or the padded graph size); None: gathered here (one host round trip), or the
        graph's size while capturing.
        """
        if agreed_tokens is not None:
            # the picked op's own per-call check compares the ops' capacities across ranks
            return self._bound(self.pick(int(agreed_tokens))).forward(x, topk_weights, topk_ids, out=out)
        agreed = self.decode.agree(x, topk_weights, topk_ids, out=out, capacity=self.max_tokens_per_rank)
        op = self._bound(self.pick(agreed))
        if self.world > 1 and not _capturing(self.decode.device):
            return op.forward(x, topk_weights, topk_ids, out=out, agreed_max=agreed)  # checked once, above
        return op.forward(x, topk_weights, topk_ids, out=out)

    def _bound(self, op: MegaMoE) -> MegaMoE:
        # unbound: the op's own call check reports "no weights bound" on every rank
        return op if self._weights is None else op.bind(self._weights)

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 weights: PreparedWeights, agreed_tokens: int | None = None) -> torch.Tensor:
        """bind(weights) then forward."""
        return self.bind(weights).forward(x, topk_weights, topk_ids, agreed_tokens=agreed_tokens)

    @property
    def ops(self) -> tuple[MegaMoE, ...]:
        """Every op, smallest capacity first."""
        return self.decode_ops + (self.prefill,)

    def warmup(self, weights: PreparedWeights | None = None, *, seed: int = 0) -> list:
        """Every op's warm-up batches (collective; before any capture), smallest capacity first."""
        return [batch for op in self.ops for batch in op.warmup(weights, seed=seed)]

    def allocated_bytes(self) -> int:
        """Bytes of every op's persistent buffers (the weights are shared and not counted)."""
        return sum(op.allocated_bytes() for op in self.ops)

    def close(self) -> None:
        """Close the prefill op, the smaller decode ops, then the largest (owner of the shared gloo group, if any)."""
        for op in (self.prefill,) + self.decode_ops[-2::-1] + (self.decode,):
            op.close()

    def __enter__(self) -> "MegaMoEInstances":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
