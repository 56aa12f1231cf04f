"""atom_moe: a portable (Triton) fused expert-parallel MoE layer, "MegaMoE", for vLLM and SGLang.

Data flow: route -> dispatch -> gemm1 (+SwiGLU) -> quant -> gemm2 -> combine.
docs/architecture.md maps each stage to its module; docs/api.md shows this API end to end.

What a user needs is exported here:
- describe a layer: `MoESpec` (with `Routing`, `Activation`, `Scheme`, `Placement`), `preset`, `PRESETS`;
- prepare its weights once: `load_model` (config.json -> spec), `prepare_experts` (a checkpoint's
  tensors in any on-disk format, docs/formats.md; or the readers `prepare_hf_experts`,
  `prepare_gpt_oss`), `prepare_stacked` (engine tensors);
- run it: `route` (logits -> top-k), `fused_experts` with `allocate_workspace` (one rank),
  `MegaMoE` (expert parallel, dispatch and combine included);
- balance it (redundant experts, EPLB): `ExpertPlacement` (replica tables), `balanced_placement`
  (recorded per-expert counts -> a placement), `MegaMoE.rebalance` (applies one in place);
- check it: `reference_moe` on `ReferenceWeights` (the fp32 oracle).
Importing this package loads no Triton kernel; the kernels compile on first use.
"""

from .balance import balanced_placement
from .checkpoint import ModelLayer, load_model, prepare_experts, prepare_gpt_oss, prepare_hf_experts
from .ep import MegaMoE, MegaMoEError
from .experts import Workspace, allocate_workspace, fused_experts
from .layouts.gate_up import GateUpLayout, GateUpTensor, LayoutError
from .placement import ExpertPlacement, PlacementError
from .presets import PRESETS, preset
from .reference import ReferenceWeights, reference_moe
from .routing import route
from .spec import Activation, ActivationKind, MoESpec, Placement, Routing, Scheme, Scoring, SpecError
from .weights import PreparedWeights, WeightError, prepare_stacked

__version__ = "0.1.0"

__all__ = [
    "Activation", "ActivationKind", "ExpertPlacement", "GateUpLayout", "GateUpTensor", "LayoutError", "MegaMoE", "MegaMoEError",
    "ModelLayer", "MoESpec", "PRESETS", "Placement", "PlacementError", "PreparedWeights", "ReferenceWeights", "Routing", "Scheme",
    "Scoring", "SpecError", "WeightError", "Workspace", "__version__", "allocate_workspace", "balanced_placement", "fused_experts",
    "load_model", "preset", "prepare_experts", "prepare_gpt_oss", "prepare_hf_experts", "prepare_stacked",
    "reference_moe", "route",
]
