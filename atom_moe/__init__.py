"""atom_moe: a portable (Triton) fused expert-parallel MoE layer, "MegaMoE", for vLLM and SGLang.

Data flow: route -> dispatch -> gemm1 (+SwiGLU) -> quant -> gemm2 -> combine.
docs/architecture.md maps each stage to its module.
"""

from .layout import GateUpLayout, GateUpTensor, LayoutError
from .presets import PRESETS, preset
from .spec import Activation, ActivationKind, MoESpec, Placement, Routing, Scheme, Scoring, SpecError
from .weights import PreparedWeights, WeightError, prepare_gpt_oss, prepare_hf_experts, prepare_stacked

__version__ = "0.1.0"

__all__ = [
    "Activation", "ActivationKind", "GateUpLayout", "GateUpTensor", "LayoutError", "MoESpec", "PRESETS",
    "Placement", "PreparedWeights", "Routing", "Scheme", "Scoring", "SpecError", "WeightError",
    "__version__", "preset", "prepare_gpt_oss", "prepare_hf_experts", "prepare_stacked",
]
