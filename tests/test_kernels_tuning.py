"""Tile-config tables: lookup, nearest bucket, override dirs, heuristic logged once."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from atom_moe.kernels import tuning
from atom_moe.kernels.tuning import TileConfig

HEADER = ",".join(tuning.COLUMNS)


def _row(device, scheme, H, I, E, k, tokens, block_m, us=1.0, n1=128, split=1, split2=1, regs=0, ahead=0):
    k1 = 128 if scheme == "fp8" else 64
    return (f"{device},{scheme},{H},{I},{E},{k},{tokens},{block_m},{n1},{k1},4,3,128,{k1},4,3,8,{split},{split2},"
            f"{regs},{regs},{ahead},{us}")


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    for var in tuning.ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    tuning.clear_cache()
    yield
    tuning.clear_cache()


def _write(path, rows):
    path.write_text("\n".join([HEADER, *rows]) + "\n")


def test_nearest_bucket_and_override_precedence(tmp_path, monkeypatch):
    _write(tmp_path / "a.csv", [_row("Test GPU", "bf16", 512, 256, 16, 4, t, bm, n1=n1) for t, bm, n1 in
                                ((1, 16, 32), (4, 32, 32), (16, 128, 32), (256, 64, 32))])
    monkeypatch.setenv("ATOM_FLYDSL_KERNELS_PATH", str(tmp_path))
    look = lambda T: tuning.lookup("test gpu", "bf16", 512, 256, 16, 4, T)  # noqa: E731
    # ties go to the smaller bucket; 64 is 4x from both 16 and 256
    assert [look(T).block_m for T in (1, 2, 3, 8, 10, 64, 65, 1024)] == [16, 16, 32, 32, 128, 128, 64, 64]
    assert look(1025) == tuning.heuristic("bf16", 512, 256, 16, 4, 1025) and look(1025).block_n1 != 32  # out of reach
    # a second dir via the alias takes precedence over the shipped tables but not over the first var
    other = tmp_path / "b"
    other.mkdir()
    _write(other / "b.csv", [_row("test gpu", "bf16", 512, 256, 16, 4, 64, 64)])
    monkeypatch.setenv("ATOM_MOE_CONFIG_DIR", str(other))
    tuning.clear_cache()
    assert look(64).block_m == 128
    monkeypatch.delenv("ATOM_FLYDSL_KERNELS_PATH")
    assert look(64).block_m == 64


def test_buckets_further_than_the_reach_give_the_heuristic(tmp_path, monkeypatch, caplog):
    """A shape tuned at T = 1 only does not run its 16-row tiles at T = 8192: past BUCKET_REACH the heuristic does,
    and says so once."""
    _write(tmp_path / "a.csv", [_row("test gpu", "a8w4", 7168, 2048, 256, 8, 1, 16, n1=128)])
    monkeypatch.setenv("ATOM_MOE_CONFIG_DIR", str(tmp_path))
    look = lambda T: tuning.lookup("test gpu", "a8w4", 7168, 2048, 256, 8, T)  # noqa: E731
    with caplog.at_level(logging.WARNING, logger="atom_moe.kernels"):
        assert look(tuning.BUCKET_REACH) == look(1)
        assert look(tuning.BUCKET_REACH).block_k1 == 64  # the row's own k step, not the heuristic's 128
        for T in (tuning.BUCKET_REACH + 1, 2048, 8192):
            assert look(T) == tuning.heuristic("a8w4", 7168, 2048, 256, 8, T), T
    far = [r.getMessage() for r in caplog.records if "use the heuristic" in r.getMessage()]
    assert len(far) == 1 and "at T = 1 only" in far[0] and f"more than {tuning.BUCKET_REACH}x" in far[0], far
    assert tuning.within_reach([1, 2048], 4) and not tuning.within_reach([1, 2048], 64)


def test_heuristic_logs_once_per_shape(caplog):
    with caplog.at_level(logging.WARNING, logger="atom_moe.kernels"):
        a = tuning.lookup("nowhere", "fp8", 1000, 300, 7, 3, 5)
        tuning.lookup("nowhere", "fp8", 1000, 300, 7, 3, 500)
        tuning.lookup("nowhere", "bf16", 1000, 300, 7, 3, 5)
    msgs = [r.getMessage() for r in caplog.records if "no tuned config" in r.getMessage()]
    assert len(msgs) == 2 and "H=1000 I=300 E=7 top_k=3" in msgs[0], msgs
    assert a == tuning.heuristic("fp8", 1000, 300, 7, 3, 5)
    a.check("fp8")


def test_heuristic_configs_are_valid():
    for scheme in ("bf16", "fp8", "a16w4", "a8w4"):
        for T in (1, 8, 64, 512, 8192):
            tuning.heuristic(scheme, 7168, 2048, 256, 8, T).check(scheme)


def test_bf16_heuristic_takes_128x256_tiles_at_large_batches_of_17_to_128_rows_per_expert():
    """The H200-measured rule (kernels/tuning.py): bf16 at T >= 2048 with 17-128 rows per expert, 4 stages."""
    wide = TileConfig(128, 256, 64, 8, 4, 256, 64, 8, 4)
    # (E, top_k, T): rows per expert T * top_k / E
    for E, k, T in ((384, 6, 2048), (128, 8, 2048), (160, 8, 2048), (384, 6, 8192), (256, 8, 4096)):
        assert tuning.heuristic("bf16", 5120, 640, E, k, T) == wide, (E, k, T)
    assert tuning.heuristic("bf16", 5120, 640, 256, 8, 1024) != wide  # 32 rows, but below 2048 tokens
    assert tuning.heuristic("bf16", 5120, 640, 1024, 8, 2048).block_m == 16  # 16 rows
    assert tuning.heuristic("bf16", 5120, 640, 256, 8, 8192).stages1 == 3  # 256 rows: the 128-row default
    assert tuning.heuristic("a16w4", 5120, 640, 384, 6, 2048) != wide  # MXFP4 keeps its own tiles


def test_a8w4_heuristic_steps_gemm1_by_128_and_splits_it_at_one_token_where_programs_are_few():
    """The H100-measured rule (kernels/tuning.py, docs/perf/a8w4-tiles-sass.md, split-fill-h100.md): GEMM1's 128-k
    step at every T; at T = 1 the split doubles, up to 4, while GEMM1's programs (top_k * 2I / 128) times it stay
    within 300."""
    for T in (2, 8, 128, 512, 2048, 8192):
        for H, I, E, k in ((7168, 2048, 256, 8), (6144, 256, 257, 9), (5120, 640, 384, 6)):
            cfg = tuning.heuristic("a8w4", H, I, E, k, T)
            assert (cfg.block_k1, cfg.split_k1, cfg.block_k2) == (128, 1, 64), (H, I, T)
            cfg.check("a8w4")
    one = {name: tuning.heuristic("a8w4", H, I, E, k, 1) for name, (H, I, E, k) in {
        "glm-5.2-tp8": (6144, 256, 257, 9),  # 9 * 4 = 36 programs: 4
        "v4.1-flash-tp4": (5120, 640, 384, 6),  # 6 * 10 = 60: 4
        "glm-5.2-tp4": (6144, 512, 257, 9),  # 72: 4 (72 * 4 = 288)
        "v4.1-flash-tp2": (5120, 1152, 384, 6),  # 108: 2 (4 would be 432 in all)
        "edge": (4096, 1200, 128, 8),  # 8 * 19 = 152 (304 split in two): unsplit
        "deepseek-v3": (7168, 2048, 256, 8),  # 8 * 32 = 256
        "qwen3": (4096, 1536, 128, 8),  # 192
    }.items()}
    want = {"glm-5.2-tp8": 4, "v4.1-flash-tp4": 4, "glm-5.2-tp4": 4, "v4.1-flash-tp2": 2, "edge": 1,
            "deepseek-v3": 1, "qwen3": 1}
    for name, split in want.items():  # w13's residuals are paired: a 64-k step loads halves, so 128-k everywhere
        assert (one[name].block_k1, one[name].split_k1, one[name].split_k2) == (128, split, 1), name
    for cfg in one.values():
        cfg.check("a8w4")
    # H of one 128-k step has nothing to split: unsplit
    narrow = tuning.heuristic("a8w4", 128, 64, 8, 2, 1)
    assert (narrow.block_k1, narrow.split_k1) == (128, 1)


def test_bf16_and_fp8_heuristics_split_gemm1_where_a_decode_batch_has_few_programs():
    """kernels/tuning.py `_fill`, at T = 1: the split doubles, up to 4, while GEMM1's programs (top_k experts x
    2I / block_n1) times the split stay within 160, each slice keeping a K step."""
    cases = {  # (scheme, H, I, E, k, T): split. fp8 tiles are 256 wide, bf16 ones 128
        ("fp8", 6144, 256, 257, 9, 1): 4,  # 9 experts x 2 tiles = 18 programs
        ("fp8", 6144, 256, 257, 9, 4): 1,  # 36 experts x 2 = 72 programs, but T > 1: a T = 1 rule
        ("fp8", 5120, 1152, 384, 6, 1): 2,  # 6 x 9 = 54
        ("fp8", 4096, 1536, 128, 8, 1): 1,  # 8 x 12 = 96: the H200 split sweep found no gain here
        ("bf16", 6144, 256, 257, 9, 1): 4,  # 9 x 4 = 36
        ("bf16", 6144, 512, 257, 9, 1): 2,  # 9 x 8 = 72
        ("bf16", 5120, 1152, 384, 6, 1): 1,  # 6 x 18 = 108
        ("bf16", 7168, 2048, 256, 8, 1): 1,  # 8 x 32 = 256
        ("fp8", 128, 256, 257, 9, 1): 1,  # one K step: nothing to split
        ("fp8", 256, 256, 257, 9, 1): 2,  # 2 K steps: two slices of one, not four with two empty
        ("fp8", 512, 256, 257, 9, 1): 4,
    }
    for (scheme, H, I, E, k, T), split in cases.items():
        cfg = tuning.heuristic(scheme, H, I, E, k, T)
        assert cfg.split_k1 == split, (scheme, H, I, E, k, T, cfg)
        assert cfg.split_k2 == 1
        cfg.check(scheme)
    assert tuning.heuristic("a16w4", 6144, 256, 257, 9, 1).split_k1 == 1  # MXFP4 keeps its own tiles


def test_a8w4_heuristic_block_m_follows_its_own_row_thresholds():
    """The measured rule (kernels/tuning.py; H200: docs/perf/tune-h200-a8w4-2026-12-06.md, H100:
    a8w4-one-accumulator-h100.md section 6), T >= 2: 16-row tiles up to 8 rows per expert, 32-row ones below 32,
    64-row ones with GEMM2 128 wide on 4 warps below 160, then 128 x 128 x 128 with GEMM2 256 wide, 8 warps each."""
    # (E, top_k, T) -> BLOCK_M; rows per expert T * top_k / E in the comments
    want = {(256, 8, 2): 16, (256, 8, 128): 16,  # 0.06, 4
            (384, 6, 512): 16,  # 8: the last 16-row case
            (384, 8, 512): 32, (256, 8, 512): 32, (257, 9, 512): 32, (160, 8, 512): 32,  # 10.7, 16, 17.9, 25.6
            (128, 8, 496): 32,  # 31
            (128, 8, 512): 64, (384, 6, 2048): 64, (128, 8, 2048): 64,  # 32: the first 64-row case, 32, 128
            (256, 8, 5112): 64,  # 159.75: the last 64-row case
            (256, 8, 5120): 128, (384, 8, 8192): 128, (256, 8, 8192): 128}  # 160, 170.7, 256
    for (E, k, T), bm in want.items():
        cfg = tuning.heuristic("a8w4", 5120, 1536, E, k, T)
        assert cfg.block_m == bm, (E, k, T, cfg)
        assert (cfg.block_n1, cfg.block_k1, cfg.block_k2) == (128, 128, 64), cfg
        assert (cfg.block_n2, cfg.warps1, cfg.warps2, cfg.stages1, cfg.stages2) == {
            128: (256, 8, 8, 3, 3), 64: (128, 4, 4, 3, 3)}.get(bm, (64, 4, 4, 4, 4)), cfg
        cfg.check("a8w4")


def test_bad_tables_and_dirs_are_named(tmp_path, monkeypatch):
    (tmp_path / "bad.csv").write_text("device,scheme\nx,bf16\n")
    monkeypatch.setenv("ATOM_MOE_CONFIG_DIR", str(tmp_path))
    with pytest.raises(tuning.ConfigError, match="missing columns"):
        tuning.lookup("x", "bf16", 1, 1, 1, 1, 1)
    _write(tmp_path / "bad.csv", [_row("x", "bf16", 8, 8, 2, 1, "many", 16)])
    tuning.clear_cache()
    with pytest.raises(tuning.ConfigError, match=r"bad.csv:2"):
        tuning.lookup("x", "bf16", 8, 8, 2, 1, 1)
    monkeypatch.setenv("ATOM_MOE_CONFIG_DIR", str(tmp_path / "missing"))
    tuning.clear_cache()
    with pytest.raises(tuning.ConfigError, match="not a directory"):
        tuning.lookup("x", "bf16", 8, 8, 2, 1, 1)


def test_split_k_register_cap_and_lookahead_columns_are_optional(tmp_path, monkeypatch):
    # tables from before split-K / register caps / GEMM2's lookahead lack those columns: their rows read as
    # unsplit, uncapped, without lookahead; newer rows carry them
    values = dict(zip(tuning.COLUMNS, _row("x", "bf16", 512, 256, 16, 4, 1, 16).split(",")))
    old_cols = [c for c in tuning.COLUMNS if c not in tuning.OPTIONAL_COLUMNS]
    (tmp_path / "old.csv").write_text(",".join(old_cols) + "\n" + ",".join(values[c] for c in old_cols) + "\n")
    monkeypatch.setenv("ATOM_MOE_CONFIG_DIR", str(tmp_path))
    old = tuning.lookup("x", "bf16", 512, 256, 16, 4, 1)
    assert (old.split_k1, old.split_k2, old.maxnreg1, old.maxnreg2, old.ahead2) == (1, 1, 0, 0, 0)
    (tmp_path / "old.csv").unlink()
    _write(tmp_path / "new.csv", [_row("x", "bf16", 512, 256, 16, 4, 1, 16, split=4, split2=2, regs=96),
                                  _row("x", "bf16", 512, 256, 16, 4, 64, 16, ahead=512)])
    tuning.clear_cache()
    new = tuning.lookup("x", "bf16", 512, 256, 16, 4, 1)
    assert (new.split_k1, new.split_k2, new.maxnreg1, new.maxnreg2, new.ahead2) == (4, 2, 96, 96, 0)
    assert tuning.lookup("x", "bf16", 512, 256, 16, 4, 64).ahead2 == 512


@pytest.mark.parametrize("regs, ok", [(0, True), (64, True), (96, True), (255, True), (1, False), (63, False),
                                      (256, False), (-1, False)])
def test_register_cap_bounds(regs, ok):
    cfg = tuning.TileConfig(16, 128, 128, 4, 3, 128, 128, 4, 3, maxnreg1=regs, maxnreg2=0 if regs else 96)
    if ok:
        cfg.check("a16w4")
    else:
        with pytest.raises(tuning.ConfigError, match="maxnreg1"):
            cfg.check("a16w4")


def test_register_cap_launch_options(monkeypatch):
    from atom_moe.kernels import common
    assert common.register_cap(0) == {} and common.register_cap(96) == {"maxnreg": 96}
    monkeypatch.setattr(common.torch.version, "hip", "6.2", raising=False)
    assert common.register_cap(0) == {}
    with pytest.raises(ValueError, match="NVIDIA"):
        common.register_cap(96)


def test_tuned_row_with_invalid_tiles_is_rejected(tmp_path, monkeypatch):
    _write(tmp_path / "t.csv", [_row("x", "fp8", 256, 256, 4, 2, 8, 16, n1=128)])
    monkeypatch.setenv("ATOM_MOE_CONFIG_DIR", str(tmp_path))
    with pytest.raises(tuning.ConfigError, match="block_n1=256"):
        tuning.lookup("x", "fp8", 256, 256, 4, 2, 8)


def test_fp8_gemm2_tile_spans_two_scale_blocks_at_most():
    # GEMM2 reads two w2 block scales per K step: a 512-wide fp8 tile is refused, by the config and the launcher
    ok = tuning.TileConfig(64, 256, 128, 8, 3, 256, 128, 8, 3)
    ok.check("fp8")
    with pytest.raises(tuning.ConfigError, match="block_n2 <= 256"):
        dataclasses.replace(ok, block_n2=512).check("fp8")
    dataclasses.replace(ok, block_n2=512).check("bf16")  # one scale-free tile: any width


def test_shipped_tables_parse_and_are_valid():
    for group in tuning._load(()):
        for row in group:
            tuning.TileConfig(**{c: row[c] for c in tuning.CONFIG_COLUMNS}).check(row["scheme"])
