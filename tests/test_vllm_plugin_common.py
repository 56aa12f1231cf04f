"""Engine-neutral plugin pieces (atom_moe.plugins.common), without any engine installed."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from atom_moe.ep.buffers import BufferLimitError, buffer_sizes, check_limits
from atom_moe.plugins import common
from atom_moe.plugins.common import FlagError, LimitError, Mode, parse_flags
from atom_moe.spec import MoESpec, Scheme


@pytest.mark.parametrize("env, mode", [
    ({}, Mode.OFF),
    ({"ATOM_USE_FLYDSL": "0", "ATOM_USE_FLYDSL_FUSED": ""}, Mode.OFF),
    ({"ATOM_USE_FLYDSL": "1"}, Mode.EXPERTS),
    ({"ATOM_USE_FLYDSL": "true"}, Mode.EXPERTS),
    ({"ATOM_USE_FLYDSL_FUSED": "1"}, Mode.FUSED),
    ({"ATOM_USE_FLYDSL": "1", "ATOM_USE_FLYDSL_FUSED": "ON"}, Mode.FUSED),
])
def test_flags(env, mode):
    assert parse_flags(env).mode is mode


def test_bad_flags_are_clear_errors(tmp_path):
    with pytest.raises(FlagError, match=r"ATOM_USE_FLYDSL_FUSED='2' is not a boolean"):
        parse_flags({"ATOM_USE_FLYDSL_FUSED": "2"})
    with pytest.raises(FlagError, match="do not exist: /nope"):
        parse_flags({"ATOM_USE_FLYDSL": "1", "ATOM_FLYDSL_KERNELS_PATH": f"{tmp_path}:/nope"})
    # a path is only checked when the plugin is on
    assert parse_flags({"ATOM_FLYDSL_KERNELS_PATH": "/nope"}).mode is Mode.OFF
    assert parse_flags({"ATOM_USE_FLYDSL": "1", "ATOM_FLYDSL_KERNELS_PATH": str(tmp_path)}).kernels_path == str(tmp_path)


def test_config_dir_alias_is_checked_and_read_like_the_kernels_path(tmp_path):
    """ATOM_MOE_CONFIG_DIR is documented as an alias: start-up checks it too, and uses it after the main flag."""
    with pytest.raises(FlagError, match="ATOM_MOE_CONFIG_DIR names folders that do not exist: /nope"):
        parse_flags({"ATOM_USE_FLYDSL": "1", "ATOM_MOE_CONFIG_DIR": "/nope"})
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    flags = parse_flags({"ATOM_USE_FLYDSL": "1", "ATOM_MOE_CONFIG_DIR": str(second),
                         "ATOM_FLYDSL_KERNELS_PATH": str(first)})
    assert flags.kernels_path == f"{first}{os.pathsep}{second}"  # kernels.tuning's precedence order
    assert parse_flags({"ATOM_USE_FLYDSL": "1", "ATOM_MOE_CONFIG_DIR": str(second)}).kernels_path == str(second)


def test_startup_line_names_mode_and_versions(tmp_path):
    line = common.startup_line("vLLM", "0.33.0", parse_flags({"ATOM_USE_FLYDSL_FUSED": "1",
                                                              "ATOM_FLYDSL_KERNELS_PATH": str(tmp_path)}))
    assert "vLLM 0.33.0" in line and "ATOM_USE_FLYDSL_FUSED=1" in line and f"torch {torch.__version__}" in line
    assert str(tmp_path) in line and "\n" not in line


def test_warn_once(caplog):
    log = logging.getLogger("atom_moe.test")
    common._warned.discard("k-test")
    with caplog.at_level(logging.WARNING, logger="atom_moe.test"):
        assert common.warn_once(log, "k-test", "first")
        assert not common.warn_once(log, "k-test", "second")
    assert [r.getMessage() for r in caplog.records] == ["first"]


def test_local_experts_follow_the_map_not_shapes(seed):
    gen = torch.Generator().manual_seed(seed)
    E = 16
    mine = torch.randperm(E, generator=gen)[:5]  # an arbitrary (e.g. round-robin) placement
    table = torch.full((E,), -1, dtype=torch.int32)
    table[mine] = torch.randperm(5, generator=gen).int()
    got = common.local_experts_from_map(table, E)
    assert len(got) == 5 and all(int(table[e]) == slot for slot, e in enumerate(got))
    assert common.local_experts_from_map(None, E) == tuple(range(E))
    table[mine[0]] = 7  # a gap in the slots
    with pytest.raises(ValueError, match="without gaps"):
        common.local_experts_from_map(table, E)


def test_tokens_per_rank_takes_the_largest_batch():
    assert common.tokens_per_rank(8192, [1, 2, 512], 512) == 8192
    assert common.tokens_per_rank(256, [1, 2, 512], 512) == 512


def test_int32_limit_names_the_largest_safe_setting():
    spec = MoESpec(hidden_size=7168, intermediate_size=256, num_experts=256, top_k=8)
    with pytest.raises(LimitError) as info:
        common.check_start_limits(spec, ep_size=8, tokens=2**16, wire="bf16", transport="torch",
                                  experts_backend="torch", free_bytes=None, flag="--max-num-batched-tokens")
    msg = str(info.value)
    safe = int(msg.rsplit("is ", 1)[1].rstrip("."))
    check_limits(spec, 8, safe, transport="torch")
    with pytest.raises(BufferLimitError):
        check_limits(spec, 8, safe + 1, transport="torch")
    assert msg.startswith("--max-num-batched-tokens=65536 is too large")


def test_scaled_setting_and_memory_limit():
    """With the engine's DP gather (scale), the named setting is per DP rank; memory is checked too."""
    spec = MoESpec(hidden_size=1024, intermediate_size=256, num_experts=8, top_k=2, scheme=Scheme.BF16)
    need = sum(buffer_sizes(spec, 2, 1000, transport="torch").values())
    assert common.check_start_limits(spec, ep_size=2, tokens=1000, wire="bf16", transport="torch",
                                     experts_backend="torch", free_bytes=need, flag="--x") == need
    with pytest.raises(LimitError, match="GiB is free; the largest safe --x is") as info:
        common.check_start_limits(spec, ep_size=2, tokens=4000, wire="bf16", transport="torch",
                                  experts_backend="torch", free_bytes=need, flag="--x", scale=4)
    safe = int(str(info.value).rsplit("is ", 1)[1])
    assert sum(buffer_sizes(spec, 2, safe * 4, transport="torch").values()) <= need
    assert sum(buffer_sizes(spec, 2, (safe + 1) * 4, transport="torch").values()) > need


def test_version_gate():
    from atom_moe.plugins.vllm import version_supported

    assert all(version_supported(v) for v in ("0.30.0", "0.31.2", "0.33.0", "0.33.1rc1"))
    assert not any(version_supported(v) for v in ("0.29.9", "0.34.0", "0.11.0", "1.0.0", "dev"))


def test_register_without_flags_imports_no_engine(monkeypatch):
    """The entry point with no flag set returns before importing vLLM (this env has none)."""
    import sys

    from atom_moe.plugins import vllm as plugin

    for name in ("ATOM_USE_FLYDSL", "ATOM_USE_FLYDSL_FUSED"):
        monkeypatch.delenv(name, raising=False)
    before = "vllm" in sys.modules
    plugin.register()
    assert ("vllm" in sys.modules) == before


def test_transport_flag_and_choice():
    """ATOM_MOE_TRANSPORT picks the fused path's EP transport; 'auto' is MegaMoE's own choice."""
    assert parse_flags({}).transport == "auto"
    assert parse_flags({"ATOM_USE_FLYDSL_FUSED": "1", "ATOM_MOE_TRANSPORT": " Torch "}).transport == "torch"
    with pytest.raises(FlagError, match="ATOM_MOE_TRANSPORT='nccl'; allowed: auto, symm, torch"):
        parse_flags({"ATOM_MOE_TRANSPORT": "nccl"})
    spec = MoESpec.create(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2).for_rank(0, 2)
    auto, forced = parse_flags({}), parse_flags({"ATOM_MOE_TRANSPORT": "torch"})
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert common.fused_transport(auto, 2, cuda, "triton", spec) == "symm"  # what the op's auto picks on CUDA
    assert common.fused_transport(forced, 2, cuda, "triton", spec) == "torch"
    assert common.fused_transport(auto, 2, cuda, "torch", spec) == "torch"  # symm needs the Triton experts
    assert common.fused_transport(auto, 2, cpu, "triton", spec) == "torch"
    assert common.fused_transport(forced, 1, cuda, "triton", spec) == "local"


@pytest.mark.parametrize("value, act, scheme", [
    (None, "bf16", Scheme.A16W4),  # the default: a16w4 (docs/vllm.md: faster from T=128 on, ~20x more accurate)
    ("", "bf16", Scheme.A16W4),
    ("bf16", "bf16", Scheme.A16W4),
    (" FP8 ", "fp8", Scheme.A8W4),
])
def test_mxfp4_act_flag_picks_the_mxfp4_scheme(value, act, scheme):
    env = {"ATOM_USE_FLYDSL": "1"} | ({} if value is None else {"ATOM_MOE_MXFP4_ACT": value})
    flags = parse_flags(env)
    assert flags.mxfp4_act == act and flags.mxfp4_scheme is scheme


@pytest.mark.parametrize("value", ["fp4", "e4m3", "a8w4", "1"])
def test_bad_mxfp4_act_names_the_value_and_what_is_allowed(value):
    with pytest.raises(FlagError) as info:
        parse_flags({"ATOM_USE_FLYDSL": "1", "ATOM_MOE_MXFP4_ACT": value})
    assert str(info.value) == f"ATOM_MOE_MXFP4_ACT={value!r}; allowed: bf16 (a16w4), fp8 (a8w4)"


@pytest.mark.parametrize("value, shown", [(None, "as a16w4 (ATOM_MOE_MXFP4_ACT=bf16)"),
                                          ("fp8", "as a8w4 (ATOM_MOE_MXFP4_ACT=fp8)")])
def test_startup_line_names_the_mxfp4_scheme(value, shown):
    flags = parse_flags({"ATOM_USE_FLYDSL": "1"} | ({} if value is None else {"ATOM_MOE_MXFP4_ACT": value}))
    line = common.startup_line("SGLang", "0.5.23", flags, common.schemes_detail(flags, "gpt-oss"))
    assert line.endswith(f"; schemes: bf16, fp8 (128x128 blocks), mxfp4 (gpt-oss) {shown}"), line
    other = "a8w4" if "a16w4" in shown else "a16w4"
    assert other not in line


@pytest.mark.parametrize("value, tokens", [(None, 128), ("", 128), ("0", 0), ("64", 64), (" 8 ", 8)])
def test_decode_tokens_flag(value, tokens):
    env = {"ATOM_USE_FLYDSL_FUSED": "1"} | ({} if value is None else {"ATOM_MOE_DECODE_TOKENS": value})
    flags = parse_flags(env)
    assert flags.decode_tokens == tokens
    line = common.startup_line("vLLM", "0.33.0", flags)
    assert (f"steps of <= {tokens} tokens per rank, ATOM_MOE_DECODE_TOKENS={tokens}" if tokens
            else "one MegaMoE for every step, ATOM_MOE_DECODE_TOKENS=0") in line, line
    assert (", and one for <= 8)" in line) == (tokens > 8), line  # the small decode op below the capacity
    # the pair exists only below a larger budget: a budget of at most the decode capacity is one op
    assert common.decode_capacity(flags, 4096) == (tokens or None)
    assert common.decode_capacity(flags, tokens or 1) is None


@pytest.mark.parametrize("value", ["-1", "abc", "1.5", "128k"])
def test_bad_decode_tokens_names_the_value_and_what_is_allowed(value):
    with pytest.raises(FlagError) as info:
        parse_flags({"ATOM_USE_FLYDSL_FUSED": "1", "ATOM_MOE_DECODE_TOKENS": value})
    assert str(info.value).startswith(f"ATOM_MOE_DECODE_TOKENS={value!r} is not a token count; use an integer >= 0")


def test_layer_spec_with_fused_shared_experts():
    """Experts mode keeps the engine's map (the shared expert on every rank); MegaMoE gets a replica slot per rank."""
    kw = dict(hidden_size=256, intermediate_size=128, num_experts=9, top_k=3, scheme=Scheme.BF16,
              activation=common.Activation(), has_bias=False, ep_size=2, max_tokens_per_rank=64, shared_experts=1)
    plain = common.layer_spec(local_experts=(4, 5, 6, 7, 8), ep_rank=1, **kw)
    assert not plain.redundant and plain.local_experts == (4, 5, 6, 7, 8) and plain.shared_ids == (8,)
    fused = common.layer_spec(local_experts=(4, 5, 6, 7, 8), ep_rank=1, replicate_shared=True, **kw)
    assert fused.redundant and fused.placement.physical_experts == (0, 1, 2, 3, 8, 4, 5, 6, 7, 8)
    assert fused.kernel_spec.local_experts == (5, 6, 7, 8, 9)
    with pytest.raises(common.SpecError, match=r"not the routed experts placed linearly plus the shared ones"):
        common.layer_spec(local_experts=(0, 2, 4, 6, 8), ep_rank=0, replicate_shared=True, **kw)
