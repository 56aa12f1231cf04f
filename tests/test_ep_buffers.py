"""Buffer sizing: the planned shapes follow the documented formulas; the int32 limit names the largest safe value."""

from __future__ import annotations

import pytest
import torch

from atom_moe.ep import BufferLimitError, buffer_plan, buffer_sizes, check_limits
from atom_moe.presets import preset
from atom_moe.spec import MoESpec

INT32_MAX = 2**31 - 1


def expected_torch_plan(W: int, C: int, H: int, k: int, E: int, wire: str) -> dict[str, tuple[tuple, torch.dtype]]:
    """docs/ep.md's table, written out independently of atom_moe.ep.buffers."""
    N, G = W * C, (-(-H // 128) if wire == "fp8" else 0)
    wd = torch.float8_e4m3fn if wire == "fp8" else torch.bfloat16
    plan = {
        "expert_owner": ((E + 1,), torch.int64), "rank_offsets": ((W,), torch.int64),
        "send_x": ((N + 1, H), wd), "send_meta": ((N + 1, 2 * k + G), torch.int32),
        "recv_x": ((N, H), wd), "recv_meta": ((N, 2 * k + G), torch.int32),
        "expert_ids": ((N, k), torch.int32), "expert_w": ((N, k), torch.float32),
        "combine_recv": ((N + 1, H), torch.bfloat16), "dest_index": ((C, W), torch.int64),
        "combine_acc": ((C, H), torch.float32), "combine_tmp": ((C, H), torch.bfloat16),
    }
    if wire == "fp8":
        plan["expert_x"] = ((N, H), torch.bfloat16)
    return plan


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
@pytest.mark.parametrize("W, C", [(2, 12), (4, 7), (8, 1)])
def test_plan_matches_formulas(W, C, wire):
    spec = MoESpec.create(hidden_size=300, intermediate_size=64, num_experts=16, top_k=5).for_rank(0, W)
    plan = buffer_plan(spec, W, C, wire)
    expect = expected_torch_plan(W, C, 300, 5, 16, wire)
    assert {n: (b.shape, b.dtype) for n, b in plan.items()} == expect
    sizes = buffer_sizes(spec, W, C, wire)
    for name, (shape, dtype) in expect.items():
        assert sizes[name] == torch.empty(shape, dtype=dtype, device="meta").nbytes, name


def test_local_plan_is_empty():
    spec = MoESpec.create(hidden_size=64, intermediate_size=64, num_experts=4, top_k=2)
    assert buffer_sizes(spec, 1, 16) == {}
    with pytest.raises(ValueError, match="local transport serves EP size 1 only"):
        buffer_plan(spec, 2, 16, transport="local")
    for kwargs, pattern in ((dict(ep_size=0), "ep_size must be a positive int"),
                            (dict(max_tokens_per_rank=0), "max_tokens_per_rank must be a positive int"),
                            (dict(wire="int4"), "unknown wire 'int4'; allowed: bf16, fp8")):
        args = dict(ep_size=1, max_tokens_per_rank=16, wire="bf16") | kwargs
        with pytest.raises(ValueError, match=pattern):
            buffer_plan(spec, **args)


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
def test_int32_limit_names_largest_safe_value(wire):
    """DeepSeek-V3 at EP8: (8*C + 1) rows of 7168 bf16 in combine_recv must stay under 2**31 bytes."""
    spec = preset("deepseek-v3").for_rank(0, 8)
    safe = ((INT32_MAX // (7168 * 2)) - 1) // 8
    assert safe == 18724
    check_limits(spec, 8, safe, wire)  # the largest safe value passes
    with pytest.raises(BufferLimitError, match=f"largest safe max_tokens_per_rank is {safe}\\.") as info:
        check_limits(spec, 8, safe + 1, wire)
    assert "combine_recv [149801, 7168] bfloat16" in str(info.value)
    with pytest.raises(BufferLimitError, match=f"largest safe max_tokens_per_rank is {safe}\\."):
        check_limits(spec, 8, 10**7, wire)


def test_int32_limit_on_pairs_when_nothing_fits():
    spec = MoESpec.create(hidden_size=32, intermediate_size=32, num_experts=64, top_k=64)
    with pytest.raises(BufferLimitError, match="largest safe max_tokens_per_rank is 33554431\\."):
        check_limits(spec, 1, 2**25)  # 2**25 tokens * 64 pairs = 2**31 (token, expert) pairs
    check_limits(spec, 1, 2**25 - 1)
