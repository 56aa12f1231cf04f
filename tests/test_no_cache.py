"""Regression guard for the seed OOM: nothing may keep a tensor produced by a forward.

64 layer calls over several layers' weights; afterwards the live tensors (CPU: every
torch.Tensor the garbage collector can see) or the allocated CUDA memory must be back
at the baseline taken after one warm-up call per layer.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from atom_moe.experts_torch import experts_torch
from atom_moe.spec import MoESpec
from atom_moe.tools.synthetic import random_layer, random_tokens
from atom_moe.weights import prepare_stacked

NUM_LAYERS = 4
CALLS = 64


def _layers(spec: MoESpec, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(NUM_LAYERS):
        raw = random_layer(spec, generator=gen, device=device)
        layers.append(prepare_stacked(spec, raw.w13, raw.w2, layout="separated"))
    return layers, gen


def _live_tensors() -> int:
    gc.collect()
    with warnings.catch_warnings():  # isinstance() on torch.distributed's deprecated reduce_op warns
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for obj in gc.get_objects() if isinstance(obj, torch.Tensor))


def _paths(device: str):
    paths = [experts_torch]
    if device == "cuda":
        from atom_moe.experts import fused_experts

        paths.append(fused_experts)
    return paths


def _run_calls(path, layers, spec, gen, device, calls=CALLS):
    for i in range(calls):
        x, w, ids = random_tokens(spec, 16 + i % 7, generator=gen, device=device)
        out = path(x, w, ids, layers[i % NUM_LAYERS], spec)
        assert torch.isfinite(out).all()
        del x, w, ids, out


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4"])
def test_no_tensor_survives_forward_cpu(scheme, seed):
    spec = MoESpec.create(hidden_size=128, intermediate_size=96, num_experts=8, top_k=2, scheme=scheme)
    layers, gen = _layers(spec, "cpu", seed)
    for path in _paths("cpu"):
        _run_calls(path, layers, spec, gen, "cpu", calls=NUM_LAYERS)  # warm-up: what is built once per layer
        baseline = _live_tensors()
        _run_calls(path, layers, spec, gen, "cpu")
        assert _live_tensors() == baseline, f"{path.__name__} kept tensors alive across forwards"


@pytest.mark.gpu
@pytest.mark.parametrize("scheme", ["bf16", "fp8"])
def test_no_tensor_survives_forward_gpu(scheme, seed):
    spec = MoESpec.create(hidden_size=1024, intermediate_size=512, num_experts=16, top_k=4, scheme=scheme)
    layers, gen = _layers(spec, "cuda", seed)
    for path in _paths("cuda"):
        _run_calls(path, layers, spec, gen, "cuda")
        torch.cuda.synchronize()
        gc.collect()
        baseline = torch.cuda.memory_allocated()
        _run_calls(path, layers, spec, gen, "cuda")
        torch.cuda.synchronize()
        gc.collect()
        assert torch.cuda.memory_allocated() == baseline, f"{path.__name__} kept CUDA memory across forwards"
