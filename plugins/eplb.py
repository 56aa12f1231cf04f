"""Engine EPLB on our path: what the vLLM and SGLang plugins share (nothing here imports an engine).

Both engines own expert-parallel load balancing end to end, and our layer fits into it as
their own MoE kernels do:

* routing: the engine's router turns each (token, slot) logical expert into one physical
  replica with the engine's replica tables (vLLM `logical_to_physical_map` /
  `logical_replica_count`, SGLang `ExpertLocationMetadata`) and fills the engine's load
  counters (vLLM `expert_load_view`, SGLang's expert distribution recorder) before our
  experts step is called; our spec counts the P physical slots as its experts and this
  rank's slots are the engine's expert map. A rearrangement rewrites those tables in place,
  so the next call (eager or a graph replay) routes by the new placement.
* weights: the engine loads each logical expert's checkpoint rows into every slot holding
  it; we prepare one copy per local slot as usual and free the engine's tensors;
* rearrangement: the engine copies rows of each layer's per-slot tensors in place over
  its EP group. The tensors it lists must be ours (`slot_views`): same memory, so no
  buffer moves and captured graphs stay valid.
"""

from __future__ import annotations

import torch

from ..ep.rebalance import slot_tensors
from ..spec import Scheme
from ..weights import PreparedWeights


def slot_views(weights: PreparedWeights) -> list[torch.Tensor]:
    """Every per-slot tensor of our prepared layer as a [local slots, -1] view of the same memory."""
    return [t.view(t.shape[0], -1) for t in slot_tensors(weights)]


def eplb_problem(scheme: Scheme) -> str | None:
    """Why a layer of this scheme cannot run on our path under the engine's EPLB, or None."""
    if scheme.is_mxfp4:
        # the MXFP4 kernels choose their scale decode from host values measured on the local
        # experts at load (mx_scale_max, mx_flush); an engine rearrangement can bring a rank an
        # expert outside them, and the engines give us no call after it to re-measure
        return ("EPLB with MXFP4 experts (the kernels' scale flags are measured on the experts loaded "
                "here; the engine's rearrangement can bring others)")
    return None
