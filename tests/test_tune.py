"""`atom-moe tune`: merge over families, correctness drop, heuristic fallback, CSV round trip, resume (fake timer)."""

from __future__ import annotations

import csv
import math
from dataclasses import replace

import pytest
import torch

from atom_moe.tools import tune
from atom_moe.tools.cli import main
from atom_moe.kernels import tuning
from atom_moe.kernels.tuning import TileConfig
from atom_moe.spec import MoESpec, Scheme

KEY = tune.Key("fake gpu", "bf16", 256, 128, 8, 2, 32)
HEUR = tuning.heuristic("bf16", 256, 128, 8, 2, 32)


def cfg(bm: int, n: int = 128, k: int = 64, warps: int = 4) -> TileConfig:
    return TileConfig(bm, n, k, warps, 3, n, k, warps, 3)


class FakeBench:
    """check -> error (or raise), time -> the next of a config's scripted times (the last one repeats)."""

    tol = 2e-2

    def __init__(self, errors: dict, times: dict) -> None:
        self.errors, self.times, self.calls = errors, {c: list(t) for c, t in times.items()}, []

    def check(self, c) -> float:
        e = self.errors.get(c, 1e-3)
        if isinstance(e, Exception):
            raise e
        return e

    def time(self, c) -> float:
        self.calls.append(c)
        seq = self.times[c]
        return seq.pop(0) if len(seq) > 1 else seq[0]


def test_merge_keeps_the_fastest_correct_candidate_over_families(seed):
    g = torch.Generator().manual_seed(seed)
    a, b, wrong, broken, nan = cfg(16), cfg(32), cfg(64), cfg(16, 64, 128), cfg(32, 64, 128)
    base = float(torch.rand(1, generator=g)) * 100 + 50
    times = {a: [base + 5], b: [base], wrong: [base / 10], broken: [1.0], nan: [1.0], HEUR: [base + 20]}
    bench = FakeBench({wrong: 0.5, broken: RuntimeError("out of shared memory"), nan: math.nan}, times)
    r = tune.tune_key(KEY, {"fam1": [a, wrong, nan], "fam2": [b, broken]}, bench)
    assert (r.config, r.family, r.source, r.us, r.heuristic_us) == (b, "fam2", "tuned", base, base + 20)
    dropped = {tr.config: tr.dropped for tr in r.trials if tr.dropped}
    assert dropped[wrong].startswith("wrong: rel_err 5.000e-01") and dropped[nan].startswith("wrong: rel_err nan")
    assert dropped[broken] == "failed: RuntimeError: out of shared memory"
    assert wrong not in bench.calls and broken not in bench.calls  # wrong candidates are never timed
    row = r.row()
    assert row["source"] == "tuned" and row["block_m"] == 32 and row["us"] == round(base, 2)


@pytest.mark.parametrize("pick_us, source", [(103.0, "tuned"), (103.2, "heuristic_fallback"), (90.0, "tuned")])
def test_pick_more_than_3_percent_slower_than_heuristic_falls_back(pick_us, source):
    """The sweep says the pick is fast; the back-to-back comparison decides (3% tolerance)."""
    pick = cfg(64, 256, 64, 8)
    bench = FakeBench({}, {pick: [50.0, pick_us], HEUR: [100.0]})  # sweep: 50; confirmation: pick_us vs 100
    r = tune.tune_key(KEY, {"triton": [pick, HEUR]}, bench)
    assert r.source == source
    if source == "heuristic_fallback":
        assert (r.config, r.us, r.heuristic_us, r.family) == (HEUR, 100.0, 100.0, "heuristic")
    else:
        assert (r.config, r.us) == (pick, pick_us)


def test_no_correct_candidate_is_an_error():
    bench = FakeBench({HEUR: 1.0}, {HEUR: [1.0]})
    with pytest.raises(tune.TuneError, match="no candidate passed the correctness check"):
        tune.tune_key(KEY, {"triton": [HEUR]}, bench)


@pytest.mark.parametrize("scheme", ["bf16", "fp8", "a16w4", "a8w4"])
@pytest.mark.parametrize("tokens", [1, 512, 8192])
def test_candidates_are_valid_and_include_the_heuristic(scheme, tokens):
    key = tune.Key("x", scheme, 7168, 2048, 32, 8, tokens)
    h = tuning.heuristic(scheme, 7168, 2048, 32, 8, tokens)
    tied, full = tune.triton_candidates(key, "tied"), tune.triton_candidates(key, "full")
    assert tied[0] == h and set(tied) <= set(full) and len(full) > len(tied) > 4
    # every GEMM2 tile the kernels take is swept, also where fp8 activations fix GEMM1's tile
    assert {(c.block_n2, c.block_k2) for c in tied} == {(c.block_n2, c.block_k2) for c in full}
    for c in full:
        c.check(scheme)  # raises for a config the kernels refuse
    assert {c.block_m for c in tied} <= {h.block_m // 2, h.block_m, h.block_m * 2}


def test_register_caps_only_on_their_schemes_unsplit_128k_tiles():
    for scheme in ("bf16", "fp8", "a16w4", "a8w4"):
        tied = tune.triton_candidates(tune.Key("x", scheme, 7168, 2048, 32, 8, 8), "tied")
        capped = [c for c in tied if c.maxnreg1 or c.maxnreg2]
        if scheme not in tune.REG_CAPS:
            assert not capped
            continue
        # each capped config is an uncapped candidate plus the cap
        assert capped and {replace(c, maxnreg1=0, maxnreg2=0) for c in capped} <= set(tied)
        for c in capped:
            assert (c.block_k1, c.block_k2, c.warps1, c.split_k1) == (128, 128, 4, 1) and c.block_m <= 32
            assert c.maxnreg1 == c.maxnreg2 in tune.REG_CAPS[scheme]
            c.check(scheme)


def test_split_space_sweeps_the_table_row_and_the_heuristic_over_k_splits():
    """--space split: the H200 table's DeepSeek-V3 decode row and the heuristic, each at every (GEMM1, GEMM2) split."""
    key = tune.Key("NVIDIA H200", "fp8", 7168, 2048, 256, 8, 1)
    table = tuning.lookup(*key.__dict__.values())
    heur = tuning.heuristic("fp8", 7168, 2048, 256, 8, 1)
    assert table != heur  # the table has its own row here: both bases must be swept
    got = tune.triton_candidates(key, "split")
    splits = (1,) + tune.SPLITS
    want = {replace(c, split_k1=s1, split_k2=s2) for c in (table, heur) for s1 in splits for s2 in splits}
    assert set(got) == want and len(got) == len(want)
    for c in got:
        c.check("fp8")
    mx = tune.triton_candidates(replace(key, scheme="a8w4"), "split")  # MXFP4 splits too
    assert {(c.split_k1, c.split_k2) for c in mx} == {(s1, s2) for s1 in splits for s2 in splits}
    for c in mx:
        c.check("a8w4")
    with pytest.raises(tune.TuneError, match="--space split"):  # 256 pairs > SPLIT_MAX_PAIRS
        tune.triton_candidates(replace(key, tokens=32), "split")


def test_ahead_space_sweeps_the_table_row_and_the_heuristic_over_lookahead_distances():
    """--space ahead: the H200 table's DeepSeek-V3 decode row and the heuristic as they are, then each with GEMM2
    unsplit at every lookahead distance; at any T (the prefetch is not a decode-only setting)."""
    for tokens in (1, 8, 2048):
        key = tune.Key("NVIDIA H200", "fp8", 7168, 2048, 256, 8, tokens)
        table = tuning.lookup(*key.__dict__.values())
        heur = tuning.heuristic("fp8", 7168, 2048, 256, 8, tokens)
        got = tune.triton_candidates(key, "ahead")
        want = [table, heur] + [replace(c, split_k2=1, ahead2=a) for c in (table, heur) for a in tune.AHEADS]
        assert got == list(dict.fromkeys(want)) and got[0] == table
        assert {c.ahead2 for c in got} == {0, *tune.AHEADS}
        for c in got:
            c.check("fp8")


def test_given_configs_run_beside_the_config_of_today_and_the_heuristic(tmp_path, monkeypatch):
    """--configs: the key's table row (what the op runs today), the heuristic and the given configs, nothing else;
    a config the scheme refuses is an error naming it before any timing."""
    key = tune.Key("NVIDIA H200", "bf16", 7168, 2048, 256, 8, 2048)
    today = tuning.lookup(*key.__dict__.values())
    heur = tuning.heuristic("bf16", 7168, 2048, 256, 8, 2048)
    given = [tune.parse_tile_config("128,128,64,8,3,128,64,8,3"), tune.parse_tile_config("128,256,64,8,4,256,64,8,4")]
    assert given[0] == TileConfig(128, 128, 64, 8, 3, 128, 64, 8, 3)
    got = tune.given_candidates(key, given + [today])
    assert got == list(dict.fromkeys([today, heur, *given])) and len(got) >= 3
    with pytest.raises(tune.TuneError, match=r"--configs 64,128,64,4,3,128,64,4,3,8,1,1,0,0,0: fp8 needs block_n1=256"):
        tune.given_candidates(replace(key, scheme="fp8"), [cfg(64, 128, 64)])
    # the optional trailing fields in table-column order: group_m, split_k1, split_k2, maxnreg1, maxnreg2
    assert tune.parse_tile_config("16,256,128,4,4,128,64,4,4,8,4,2") == \
        TileConfig(16, 256, 128, 4, 4, 128, 64, 4, 4, group_m=8, split_k1=4, split_k2=2)
    assert tune.parse_tile_config("16,128,128,4,4,128,128,4,4,8,1,1,96,96").maxnreg2 == 96
    assert tune.parse_tile_config("16,128,128,4,4,128,128,4,4,8,1,1,0,0,512").ahead2 == 512
    for bad in ("128,128,64", "128,128,64,8,3,128,64,8,x", "1,2,3,4,5,6,7,8,9,8,1,1,0,0,0,0",
                "16,128,64,4,4,128,64,4,-4"):
        with pytest.raises(tune.argparse.ArgumentTypeError, match="allowed are 9 to 15 integers"):
            tune.parse_tile_config(bad)
    with pytest.raises(tune.TuneError, match=r"--configs 16,128,64,4,4,128,64,4,4,8,99,1,0,0,0: split_k1=99"):
        tune.given_candidates(key, [tune.parse_tile_config("16,128,64,4,4,128,64,4,4,8,99")])
    # run_tuning times exactly those candidates, and refuses a bad one for any of its schemes before timing
    spec = MoESpec.create(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2)
    import atom_moe.experts as experts
    monkeypatch.setattr(experts, "device_name", lambda device: "Fake GPU")
    want = tune.given_candidates(tune.Key("Fake GPU", "bf16", 256, 128, 8, 2, 64), given)
    times = {c: [float(20 - i)] for i, c in enumerate(want)}
    benches = []
    (r,) = tune.run_tuning(spec, schemes=[Scheme.BF16], ep=1, tokens=[64], out=tmp_path / "t.csv", timer=None,
                           device=torch.device("cpu"), log=lambda *a: None, configs=given,
                           bench_factory=lambda s, T: benches.append(FakeBench({}, times)) or benches[-1])
    assert [tr.config for tr in r.trials] == want and r.config == want[-1]
    with pytest.raises(tune.TuneError, match="fp8 needs block_n1=256"):
        tune.run_tuning(spec, schemes=[Scheme.BF16, Scheme.FP8], ep=1, tokens=[64], out=tmp_path / "u.csv",
                        timer=None, device=torch.device("cpu"), log=lambda *a: None, configs=given,
                        bench_factory=lambda s, T: pytest.fail("timed before the configs were checked"))


def test_appending_to_a_table_from_before_split_k2_upgrades_its_header(tmp_path):
    """A resumed table written without split_k2 gets the column (as 1) before a new row is appended."""
    first, second = (tune.Result(replace(KEY, tokens=t), cfg(64, 256, 64, 8), 10.0 + t, 20.0, "tuned", "triton")
                     for t in (8, 16))
    path = tmp_path / "old.csv"
    old_cols = [c for c in tune.columns() if c != "split_k2"]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=old_cols, extrasaction="ignore")
        writer.writeheader()
        writer.writerow(first.row())
    tune.append_row(path, replace(second, config=replace(second.config, split_k2=4)).row())
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == tune.columns() and None not in rows[1]
    assert [(r["tokens"], r["split_k2"], r["us"]) for r in rows] == [("8", "1", "18.0"), ("16", "4", "26.0")]
    bad = tmp_path / "bad.csv"
    bad.write_text("device,scheme,H,odd\n")
    with pytest.raises(tune.TuneError, match="do not match"):
        tune.append_row(bad, first.row())


def test_csv_round_trip_through_the_kernels_lookup(tmp_path, monkeypatch):
    """Written rows read back with tuning's own reader and win the lookup; extra columns are ignored."""
    pick = cfg(64, 256, 64, 8)
    results = [tune.Result(KEY, pick, 12.345, 20.0, "tuned", "triton"),
               tune.Result(tune.Key("fake gpu", "bf16", 256, 128, 8, 2, 512), HEUR, 40.0, 40.0,
                           "heuristic_fallback", "heuristic")]
    path = tmp_path / "t.csv"
    for r in results:
        tune.append_row(path, r.row())
    assert tune.read_done(path) == {r.key.normalized() for r in results}
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert tuple(rows[0]) == tuning.COLUMNS + ("heuristic_us", "source")
    assert [r["source"] for r in rows] == ["tuned", "heuristic_fallback"] and rows[0]["us"] == "12.35"
    monkeypatch.setenv("ATOM_MOE_CONFIG_DIR", str(tmp_path))
    tuning.clear_cache()
    try:
        assert tuning.lookup("FAKE GPU", "bf16", 256, 128, 8, 2, 40) == pick
        assert tuning.lookup("fake gpu", "bf16", 256, 128, 8, 2, 600) == HEUR
    finally:
        tuning.clear_cache()
    path.write_text(path.read_text().replace("12.35", "fast"))
    with pytest.raises(tune.TuneError, match="bad value"):
        tune.read_done(path)


def test_trials_csv_holds_every_candidate(tmp_path, monkeypatch):
    """--trials: one row per candidate with its sweep time, error and drop reason, beside the table's one row."""
    spec = MoESpec.create(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2)
    key = tune.Key("Fake GPU", "bf16", 256, 128, 8, 2, 4)
    cands = tune.triton_candidates(key, "split")
    times = {c: [float(10 + i)] for i, c in enumerate(cands)}
    wrong, failing = cands[1], cands[2]
    import atom_moe.experts as experts
    monkeypatch.setattr(experts, "device_name", lambda device: "Fake GPU")
    table, trials = tmp_path / "t.csv", tmp_path / "trials.csv"
    tune.run_tuning(spec, schemes=[Scheme.BF16], ep=1, tokens=[4], out=table, timer=None, device=torch.device("cpu"),
                    space="split", log=lambda *a: None, trials_out=trials,
                    bench_factory=lambda s, T: FakeBench({wrong: 0.5, failing: RuntimeError("boom")}, times))
    with open(trials, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == len(cands) and {int(r["split_k1"]) for r in rows} == {int(r["split_k2"]) for r in rows} \
        == {1, 2, 4, 8}
    by_cfg = {TileConfig(**{c: int(r[c]) for c in tuning.CONFIG_COLUMNS}): r for r in rows}
    assert by_cfg[wrong]["dropped"].startswith("wrong: rel_err 5.000e-01") and by_cfg[wrong]["us"] == ""
    assert by_cfg[failing]["dropped"] == "failed: RuntimeError: boom" and by_cfg[failing]["us"] == ""
    assert by_cfg[cands[0]]["dropped"] == "" and float(by_cfg[cands[0]]["us"]) == 10.0
    assert len(list(csv.DictReader(open(table)))) == 1


def test_resume_skips_done_rows_and_retune_redoes_them(tmp_path, monkeypatch):
    spec = MoESpec.create(hidden_size=256, intermediate_size=128, num_experts=16, top_k=2)
    made = []

    def factory(s, T):
        made.append(T)
        return FakeBench({}, {c: [float(c.block_m)] for c in tune.triton_candidates(
            tune.Key("Fake GPU", "bf16", 256, 128, 8, 2, 2 * T), "tied")})

    import atom_moe.experts as experts
    monkeypatch.setattr(experts, "device_name", lambda device: "Fake GPU")  # GPU names are mixed case
    monkeypatch.setitem(tune.FAMILIES, "other", lambda key, space: [tuning.heuristic(
        key.scheme, key.H, key.I, key.E, key.top_k, key.tokens)])
    path = tmp_path / "t.csv"
    kw = dict(schemes=[Scheme.BF16], ep=2, out=path, timer=None, device=torch.device("cpu"), bench_factory=factory,
              log=lambda *a: None)
    first = tune.run_tuning(spec, tokens=[1, 64], **kw)
    assert made == [1, 64] and [r.key.tokens for r in first] == [2, 128]  # buckets: EP x tokens rows
    assert all(r.key.E == 8 for r in first)  # 16 experts over EP 2
    assert all(r.config.block_m == 16 for r in first)  # the fake times favour the smallest BLOCK_M
    tune.run_tuning(spec, tokens=[1, 64, 8], **kw)
    assert made == [1, 64, 8]
    tune.run_tuning(spec, tokens=[1, 64, 8], retune=True, **kw)
    assert made == [1, 64, 8, 1, 64, 8]
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert sorted(int(r["tokens"]) for r in rows) == [2, 16, 128]  # no duplicates
    assert {r["device"] for r in rows} == {"Fake GPU"}  # written as the device names itself
    keys = {k for k, _, _ in tune.plan_keys(spec, [Scheme.BF16], 2, [1, 8], "Fake GPU")}
    summary = tune.format_summary([], tune.table_rows(path, keys))
    assert summary.count("(earlier run)") == 2 and "0 of 2 rows fell back" in summary
    with pytest.raises(tune.TuneError, match="unknown kernel family; allowed: triton, other"):
        tune.run_tuning(spec, tokens=[1], families=["cutlass"], **kw)


def test_transport_rows_are_what_rank0_receives(seed):
    spec = MoESpec.create(hidden_size=64, intermediate_size=64, num_experts=8, top_k=2)
    x, w, ids = tune.transport_rows(spec, 4, 16, torch.Generator().manual_seed(seed), torch.device("cpu"), None)
    assert x.shape == (64, 64) and ids.shape == (64, 2)
    local = {0, 1}  # rank 0 of 4 owns experts 0 and 1
    for block in ids.view(4, 16, 2):
        hits = [any(int(e) in local for e in row) for row in block.tolist()]
        n = sum(hits)
        assert hits == [True] * n + [False] * (16 - n)  # received tokens first, then unused rows
        assert (block[n:] == -1).all()
    assert ((ids == -1).all(1) == (x == 0).all(1)).all()


def test_op_bench_forces_the_config_into_the_op(monkeypatch, seed):
    """The real bench (interpreter): valid configs match the reference; a refused config fails inside the op."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = MoESpec.create(hidden_size=64, intermediate_size=64, num_experts=4, top_k=2)
    timed = []
    cpu = torch.device("cpu")
    bench = tune.OpBench(tune.LayerData.build(spec, 1, cpu, seed), 1, 5, cpu, lambda fn: timed.append(fn()) or 7.0,
                         seed, 2e-2)
    try:
        h = tuning.heuristic("bf16", 64, 64, 4, 2, 5)
        assert bench.check(h) < 1e-2 and bench.check(cfg(32, 64, 32)) < 1e-2
        with pytest.raises(tuning.ConfigError, match="block_n2=16"):
            bench.check(TileConfig(16, 64, 64, 4, 2, 16, 64, 4, 2))
        assert bench.time(h) == 7.0 and timed[0].shape == (5, 64)
    finally:
        bench.close()
    layer = tune.LayerData.build(spec, 2, cpu, seed)
    assert layer.weights.local_experts == (0, 1)
    ep_bench = tune.OpBench(layer, 2, 3, cpu, lambda fn: 1.0, seed, 2e-2)
    assert ep_bench.x.shape == (6, 64) and 0 < ep_bench.check(h) < 1e-2 and ep_bench.ref.norm() > 0


def test_cli_errors(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # restored afterwards, also after --interpret sets it
    if not torch.cuda.is_available():
        assert main(["tune", "deepseek-v3", "--out", str(tmp_path / "t.csv")]) == 1  # runtime: no GPU here
        assert "no CUDA GPU here" in capsys.readouterr().err
        assert main(["tune", "deepseek-v3", "--timer", "wall", "--out", str(tmp_path / "t.csv")]) == 2
        assert "add --interpret" in capsys.readouterr().err
    assert main(["tune", "deepseek-v3", "--interpret", "--timer", "wall", "--only", "cutlass", "--tokens", "1",
                 "--out", str(tmp_path / "t.csv")]) == 2
    assert "unknown kernel family; allowed: triton" in capsys.readouterr().err
    assert main(["tune", "deepseek-v3", "--interpret", "--timer", "wall", "--ep", "3",
                 "--out", str(tmp_path / "t.csv")]) == 2
    assert "num_experts divisible by the EP world size" in capsys.readouterr().err
    assert main(["tune", "deepseek-v3", "--interpret", "--timer", "wall", "--space", "full",
                 "--configs", "128,128,64,8,3,128,64,8,3", "--out", str(tmp_path / "t.csv")]) == 2
    assert "--configs names the candidates itself" in capsys.readouterr().err
    assert main(["tune", "deepseek-v3", "--configs", "128,128,64", "--out", str(tmp_path / "t.csv")]) == 2
    assert "allowed are 9 to 15 integers" in capsys.readouterr().err


def test_run_tuning_end_to_end_in_the_interpreter(tmp_path, monkeypatch, seed):
    """The default bench (one random layer per scheme, the real op) through merge and the table; fake timer."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = MoESpec.create(hidden_size=64, intermediate_size=64, num_experts=4, top_k=2)
    monkeypatch.setattr(tune, "FAMILIES", {"triton": lambda key, space: [
        tuning.heuristic(key.scheme, key.H, key.I, key.E, key.top_k, key.tokens), cfg(32, 64, 64)]})
    built = []
    real_build = tune.LayerData.build
    monkeypatch.setattr(tune.LayerData, "build", staticmethod(lambda *a: built.append(a) or real_build(*a)))
    calls = []

    def timer(fn):  # runs the op like the GPU timer would, and says BLOCK_M 32 is faster
        out = fn()
        calls.append(out.shape)
        return 5.0

    out = tmp_path / "t.csv"
    results = tune.run_tuning(spec, schemes=[Scheme.FP8], ep=1, tokens=[2, 3], out=out, timer=timer,
                              device=torch.device("cpu"), seed=seed, log=lambda *a: None)
    assert [(r.key.scheme, r.key.tokens, r.source) for r in results] == [("fp8", 2, "tuned"), ("fp8", 3, "tuned")]
    assert len(built) == 1  # one layer per scheme, shared by its buckets
    assert all(tr.error < 1e-2 for r in results for tr in r.trials if not tr.dropped)
    assert all(r.trials[1].dropped.startswith("failed: ConfigError") for r in results)  # fp8 needs block_n1=256
    assert calls[0] == (2, 64) and len(tune.read_done(out)) == 2
