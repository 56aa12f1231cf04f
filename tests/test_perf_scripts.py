"""The perf helper scripts on the CPU: bench_tables' target marks, tk_baseline's argument and import errors."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_tables  # noqa: E402

COLUMNS = ("device", "shape", "scheme", "T", "routing", "impl", "us", "floor_us", "frac_of_floor", "tbps",
           "tflops", "bytes", "flops", "config", "note")


def _write(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        for r in rows:
            writer.writerow({c: r.get(c, "") for c in COLUMNS})


def _row(scheme: str, T: int, frac: float, impl: str = "atom_moe") -> dict:
    return dict(device="d", shape="s", scheme=scheme, T=T, impl=impl, us=10.0, floor_us=10.0 * frac,
                frac_of_floor=frac, tbps=1, tflops=1, bytes=100, flops=1000, config="cfg")


def test_fraction_table_marks_misses_and_shows_baselines(tmp_path):
    # a cell just below its target gets the cross, one at the target does not; a later CSV
    # overrides an earlier row; the baseline of the same scheme appears in parentheses
    first, second = tmp_path / "a.csv", tmp_path / "b.csv"
    _write(first, [_row("bf16", 1, 0.10), _row("fp8", 2048, 0.30)])
    _write(second, [_row("bf16", 1, 0.85), _row("bf16", 8192, 0.69), _row("bf16", 1, 0.40, impl="grouped_mm"),
                    _row("fp8", 2048, 0.7499)])
    text = bench_tables.fraction_tables(bench_tables.read([first, second]))
    bf16 = next(line for line in text.splitlines() if line.startswith("| s |") and "(0.40)" in line)
    cells = [c.strip() for c in bf16.strip("|").split("|")]
    assert cells[1] == "0.85 (0.40)" and cells[7] == "0.69 ✗" and cells[2] == "n/a"
    assert "0.75 ✗" in text and "grouped_mm in parentheses" in text
    detail = bench_tables.detail_table(bench_tables.read([second]))
    assert detail.count("| s |") == 3  # atom_moe rows only
    bad = tmp_path / "bad.csv"
    bad.write_text("shape,us\ns,1\n")
    with pytest.raises(SystemExit, match="missing columns"):
        bench_tables.read([bad])
    with pytest.raises(SystemExit, match="no such CSV"):
        bench_tables.read([tmp_path / "absent.csv"])


def test_ratio_tables_check_each_required_comparison(tmp_path):
    # vLLM's best of its two configs over ours, crossed below 1.1 and daggered where vLLM already runs above
    # 1 / 1.1 of the floor; a8w4 against our fp8 only at T <= 512 and against our a16w4 only at T >= 512
    def row(scheme, T, impl, us, frac=0.5):
        return dict(_row(scheme, T, frac, impl), us=us)
    path = tmp_path / "r.csv"
    _write(path, [row("bf16", 1, "atom_moe", 10.0), row("bf16", 1, "vllm", 12.0), row("bf16", 1, "vllm-tuned", 10.98),
                  row("bf16", 8, "atom_moe", 10.0), row("bf16", 8, "vllm", 11.5),
                  row("bf16", 32, "atom_moe", 10.0), row("bf16", 32, "vllm", 10.2, frac=0.95),
                  row("a8w4", 128, "atom_moe", 10.0), row("fp8", 128, "atom_moe", 16.0),
                  row("a8w4", 2048, "atom_moe", 10.0), row("fp8", 2048, "atom_moe", 30.0),
                  row("a16w4", 2048, "atom_moe", 9.0), row("a16w4", 128, "atom_moe", 20.0)])
    text = bench_tables.ratio_tables(bench_tables.read([path]))
    lines = text.splitlines()
    bf16 = lines[lines.index("| shape | T=1 | T=8 | T=32 |") + 2]
    assert bf16 == "| s | 1.09 ✗ | 1.15 | 1.02 ✗ † |"
    fp8_side = lines[lines.index("### a8w4: our fp8 / our a8w4, T <= 512 (>= 1.5 wanted)") + 4]
    assert fp8_side == "| s | 1.60 |"  # T = 2048 is not compared with fp8
    a16_side = lines[lines.index("### a8w4: our a16w4 / our a8w4, T >= 512 (>= 1.0 wanted)") + 4]
    assert a16_side == "| s | 0.90 ✗ |"  # T = 128 is not compared with a16w4
    assert "2 of 3 cells" not in text and "1 of 3 cells meet it." in text and "fp8: vLLM" not in text
    # --write-csv: the merged rows, later files winning, read back as they went in
    later = tmp_path / "later.csv"
    _write(later, [row("bf16", 1, "atom_moe", 9.0)])
    merged = tmp_path / "merged.csv"
    bench_tables.write_rows(bench_tables.read([path, later]), merged)
    back = {(r["scheme"], int(r["T"]), r["impl"]): float(r["us"]) for r in bench_tables.read([merged])}
    assert len(back) == 13 and back[("bf16", 1, "atom_moe")] == 9.0 and back[("bf16", 1, "vllm")] == 12.0


def test_device_tables_script_parses_and_refuses_an_unknown_part():
    script = ROOT / "scripts" / "device_tables.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    proc = subprocess.run(["bash", str(script), "prefill"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "allowed are kernels or mxfp4" in proc.stderr


def test_device_pending_script_parses_and_needs_the_old_experts_file(tmp_path):
    script = ROOT / "scripts" / "device_pending.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2 and ".cache/old/experts.py is missing" in proc.stdout


def _device_tables_functions() -> str:
    """device_tables.sh's late and merge_all, to run on the CPU without its GPU steps."""
    text = (ROOT / "scripts" / "device_tables.sh").read_text()
    return "\n".join(text[text.index(f"\n{name}() {{"):].split("\n}\n")[0] + "\n}" for name in ("late", "merge_all"))


def test_device_tables_merges_what_each_shape_wrote_and_stops_at_the_deadline(tmp_path):
    # a call cut short must still return the shapes it finished: merge_all folds every per-shape CSV of one output
    # (bench rows, then triton_kernels' rows) into $out, skips an output with none yet, and late() stops new shapes
    work, out = tmp_path / "work", tmp_path / "out"
    for tag, impl, us in (("mx-uniform", "atom_moe", 10.0), ("tk-uniform", "triton_kernels", 12.0)):
        (work / tag).mkdir(parents=True)
        _write(work / tag / "s.csv", [dict(_row("a16w4", 8, 0.5, impl), us=us)])
    _write(work / "mx-uniform" / "t.csv", [dict(_row("a8w4", 8, 0.5), shape="t")])
    out.mkdir()
    script = _device_tables_functions() + f"""
work={work}; out={out}; deadline_s=100000
merge_all mxfp4-uniform; merge_all mxfp4-skewed
late "x s" || echo "on time"
deadline_s=0; late "x s" && echo "after"
"""
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "on time" and lines[2] == "after", proc.stdout
    assert lines[1].startswith("  x s: skipped, ") and lines[1].endswith(" s >= DEADLINE_S 0"), proc.stdout
    assert sorted(f.name for f in out.iterdir()) == ["mxfp4-uniform.csv"]
    rows = {(r["shape"], r["scheme"], r["impl"]): float(r["us"]) for r in bench_tables.read([out / "mxfp4-uniform.csv"])}
    assert rows == {("s", "a16w4", "atom_moe"): 10.0, ("s", "a16w4", "triton_kernels"): 12.0,
                    ("t", "a8w4", "atom_moe"): 10.0}


def test_tk_baseline_errors_are_clear():
    script = str(ROOT / "scripts" / "tk_baseline.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0 and "--diagnose" in proc.stdout
    proc = subprocess.run([sys.executable, script, "--tokens", "0"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2 and "--tokens" in proc.stderr
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2 and "PYTHONPATH=.cache/vllm-0.33.0/vllm/third_party" in proc.stderr


# ---------------------------------------------------------------- kernel_sass
@pytest.mark.parametrize("kernel,scheme,bm,bn,bk", [("gemm1", "a16w4", 16, 64, 128), ("gemm2", "bf16", 64, 128, 64),
                                                   ("gemm1", "a8w4", 16, 128, 64), ("gemm2", "a8w4", 16, 64, 64),
                                                   ("gemm2", "a16w4", 16, 128, 128)])
def test_kernel_sass_counts_the_k_loop(kernel, scheme, bm, bn, bk, tmp_path):
    # compiles for sm_90a with triton's bundled ptxas / nvdisasm (no GPU; a subprocess without
    # TRITON_INTERPRET): the K loop is found with its wgmma (fp8 QGMMA for a8w4), its weight
    # loads are cp.async-pipelined, no decoded tile is restaged through shared memory, and the
    # MX decode stays far below the plain layout's 12.6 instructions per weight
    import json
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "k.sass"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), kernel, "--scheme", scheme,
                          "--block-m", str(bm), "--block-n", str(bn), "--block-k", str(bk), "--sass", str(out),
                          "--json"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    mma = "QGMMA" if scheme == "a8w4" else "HGMMA"
    assert report["wgmma"] == [mma] and report["registers"] > 0 and report["stack_bytes"] == 0
    assert report["pipelined_loads"] > 0 and report["shared_stores"] == 0
    # ptxas runs the wgmmas asynchronously (a16w4 at 128 x 128 tiles was serialized until the K loop always
    # ran at least once: the accumulator zeroed on the skip path sat inside the wgmma pipeline)
    assert not report["wgmma_serialized"], report
    # a8w4 GEMM2's plain loads are its activation scales (at most BLOCK_M floats per step, one step ahead);
    # GEMM1's one scale per token is loaded before the loop (atom_moe.spec.Scheme.x_per_token)
    if scheme == "a8w4" and kernel == "gemm2":
        assert 0 < report["plain_loads"] <= bm, report
    else:
        assert report["plain_loads"] == 0, report
    limit = {"a16w4": 6.0, "a8w4": 6.0}.get(scheme, 3.0)
    assert 0.5 < report["per_weight"] < limit, report
    if scheme == "a16w4":  # the decoded bf16 pairs feed the mma as they are: only the scale pairs are
        # permuted (kernels/mxfp4.py `_halves`; a half-swap pair per word of codes before it, 3 PRMT / word)
        assert report["byte_permutes"] <= report["weight_words"], report
    assert mma in out.read_text()


def test_kernel_sass_row_scale_gives_gemm2_one_accumulator():
    # a8w4 with ATOM_MOE_A8W4_INTER=token (--row-scale): GEMM2's K loop loads no activation scales and keeps
    # one accumulator, at the 64-row tile of the large-T rows (sm_90a, 2026-12-06: 307 -> 186 instructions,
    # 231 -> 153 registers; docs/perf/a8w4-one-accumulator-h100.md section 4)
    import json
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    reports = []
    for extra in ([], ["--row-scale"]):
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), "gemm2", "--scheme", "a8w4",
                              "--block-m", "64", "--block-n", "128", "--block-k", "64", "--warps", "4", "--stages", "3",
                              "--json", *extra], capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr
        reports.append(json.loads(run.stdout))
    group, token = reports
    assert group["plain_loads"] > 0 and token["plain_loads"] == 0, (group, token)
    assert token["wgmma"] == ["QGMMA"] and not token["wgmma_serialized"] and token["spill_stores"] == 0
    assert token["loop_instructions"] < 0.75 * group["loop_instructions"], (group, token)
    assert token["registers"] < group["registers"], (group, token)
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), "gemm2", "--scheme", "fp8",
                          "--row-scale"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode != 0 and "--row-scale: a8w4 only" in run.stderr


def test_kernel_sass_register_cap_reaches_ptxas():
    # a tile config's maxnreg is Triton's option: the PTX carries it, and ptxas keeps the kernel under it
    import json
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tile = ["gemm1", "--scheme", "a16w4", "--block-m", "16", "--block-n", "128", "--block-k", "128", "--json"]
    reports = {}
    for cap in (0, 96):
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), *tile, "--maxnreg", str(cap)],
                             capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr
        reports[cap] = json.loads(run.stdout)
    assert reports[0]["registers"] > 96 >= reports[96]["registers"], reports


def test_kernel_sass_tma_and_the_fp8_scale_fold():
    # sm_90a facts of two K-loop designs: fp8's weight block scales enter as two scalars per step, so the loop
    # has one FFMA per accumulator element and an FMUL only per row's factor (a load per column took one per
    # element); with --tma (ATOM_MOE_TMA=1) the weight and activation
    # tiles are TMA loads (no cp.async left in GEMM2's loop) and fewer registers are live
    import json
    import triton
    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this triton wheel ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tile = ["gemm2", "--scheme", "fp8", "--block-m", "64", "--block-n", "128", "--block-k", "128", "--warps", "4",
            "--json", "--top", "64"]
    reports = {}
    for extra in ([], ["--tma"]):
        run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), *tile, *extra],
                             capture_output=True, text=True, env=env, timeout=600)
        assert run.returncode == 0, run.stderr
        reports[bool(extra)] = json.loads(run.stdout)
    for report in reports.values():
        mix = dict(report["mix"])
        # 64 x 128 fp32 accumulator over 128 threads: 64 elements each, one FFMA apiece
        assert report["wgmma"] == ["QGMMA"] and mix.get("FFMA") == 64 and mix.get("FMUL", 0) <= 4, report
    assert reports[False]["tma_loads"] == 0 < reports[False]["pipelined_loads"]
    assert reports[True]["tma_loads"] == 2 and reports[True]["pipelined_loads"] == 0, reports[True]
    assert reports[True]["registers"] < reports[False]["registers"], reports


def test_kernel_sass_refuses_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "kernel_sass.py"), "gemm1"], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode != 0 and "without TRITON_INTERPRET=1" in run.stderr


# ---------------------------------------------------------------- hip_compile
def test_every_table_variant_builds_for_amd():
    # every GEMM variant the tile tables or the heuristic can pick compiles to an hsaco for gfx942
    # and gfx950 through Triton's HIP target (no GPU), with a8w4's portable e4m3 decode
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "hip_compile.py")], capture_output=True, text=True,
                         env=env, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    built = [line for line in run.stdout.splitlines() if ": hsaco " in line]
    assert {line.split()[0] for line in built} == {"gfx942", "gfx950"}
    assert {line.split()[2] for line in built} == {"bf16", "fp8", "a16w4", "a8w4"}
    assert all(int(line.split()[-2]) > 0 for line in built)
    assert "FAILED" not in run.stdout
    # a8w4 at 128-k steps on gfx950 runs tl.dot_scaled, and the build checked it became the scaled MFMA
    scaled = [line.split() for line in built if " scaled: " in line]
    assert scaled and all(f[0] == "gfx950" and f[2] == "a8w4" and int(f[5]) >= 128 for f in scaled)
    # fields before the colon: arch kernel scheme bm bn bk warps stages top_k separate pairs_hidden [split S phase P]
    fields = [line.split(":")[0].split() for line in built]
    # the served presets' GEMM2 as their heuristic picks launch it: top-k 9 (GLM-5.2) and 6 (V4.1), both combines
    served = {(f[0], f[8], f[9]) for f in fields if f[1] == "gemm2"}
    assert {(a, k, sep) for a in ("gfx942", "gfx950") for k in ("9", "6") for sep in ("True", "False")} <= served
    # split-K launches: GEMM1's two phases (a8w4 rows split it, e.g. GLM-5.2-TP4 at T = 8) and GEMM2's counter-combine
    # launch (gpt-oss's a16w4 row at T = 1 splits it), and a8w4's T = 1 heuristic pick for GLM-5.2-TP8 (36 GEMM1
    # programs: split 2) with pair blocks
    splits = {(f[0], f[1], f[2], f[10], f[12], f[14]) for f in fields if "split" in f}
    for arch in ("gfx942", "gfx950"):
        assert {(arch, "gemm1", "a8w4", "0", "2", "1"), (arch, "gemm1", "a8w4", "0", "2", "2")} <= splits
        assert any(s[:3] == (arch, "gemm2", "a16w4") for s in splits)
        assert {(arch, "gemm1", "a8w4", "6144", "2", "1"), (arch, "gemm1", "a8w4", "6144", "2", "2")} <= splits
    # T = 1's pair blocks (field 10: H) for every scheme, both GEMMs, at each served top-k and gpt-oss's H 2880
    pairs = {(f[0], f[1], f[2], f[8], f[10]) for f in fields if f[10] != "0"}
    assert {(a, g, s, "9", "6144") for a in ("gfx942", "gfx950") for g in ("gemm1", "gemm2")
            for s in ("bf16", "fp8", "a16w4", "a8w4")} <= pairs
    assert {(a, g, s, "4", "2880") for a in ("gfx942", "gfx950") for g in ("gemm1", "gemm2")
            for s in ("bf16", "fp8", "a16w4", "a8w4")} <= pairs


def test_hip_compile_reports_a_failing_variant(tmp_path):
    # the a8w4 PRMT decode is PTX: forced on for a HIP build it must fail, and the script must say so
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; sys.argv = ['hip_compile.py', '--arch', 'gfx950', '--schemes', 'a8w4']\n"
            f"sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
            "import hip_compile, triton.language as tl\n"
            "hip_compile.mxfp4.PRMT_OK = tl.constexpr(True)\n"
            # a variant that decodes: not a split's slice sum (phase 2), not gfx950's scaled MFMA (128-k steps)
            "v = next(v for v in sorted(hip_compile.variants(('a8w4',)))\n"
            "         if v[11] != 2 and not hip_compile.mxfp4.scaled_by_default('gfx950', v[4]))\n"
            "try:\n    hip_compile.compile_hip(*v, 'gfx950')\nexcept Exception as e:\n    print('FAILED', type(e).__name__)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert "FAILED" in run.stdout, run.stdout + run.stderr[-2000:]


# ---------------------------------------------------------------- compile_all
def test_every_launch_of_the_ops_builds_for_sm_90a():
    # every kernel the ops launch (routing, GEMM1, GEMM2, the separate combine, the symm transport's
    # dispatch / barrier / combine), with the arguments the launchers pass, for every scheme and
    # tile variant, compiles to a cubin for sm_90a (no GPU; under each triton CI installs)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_all.py")], capture_output=True, text=True,
                         env=env, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    built = [line for line in run.stdout.splitlines() if line.startswith("sm_90a ") and line.endswith(" B")]
    assert {line.split()[1] for line in built} == {"_routing_kernel", "_gemm1_kernel", "_gemm2_kernel",
                                                   "_combine_kernel", "_dispatch_kernel", "_barrier_kernel",
                                                   "_inter_quant_kernel", "_finish_kernel"}
    for flag in ("FP8=True W4=True", "FP8=True W4=False", "FP8=False W4=True", "FP8=False W4=False"):
        assert any(flag in line for line in built if "_gemm1_kernel" in line), flag  # all four schemes
    assert all(int(line.split()[-2]) > 0 for line in built) and "FAILED" not in run.stdout
    assert f"{len(built)} of {len(built)} builds passed" in run.stdout
    # the served presets' geometry (atom_moe.presets.SERVED): E 257 and 384 sort into 512 bins, in one launch
    # and in the split two; top-k 9 (GLM-5.2, the fused shared slot) and 6 (V4.1) in GEMM2's two combines,
    # the separate combine and the symm transport
    def has(kernel: str, *flags: str) -> bool:
        return any(line.split()[1] == kernel and set(flags) <= {t.rstrip(":") for t in line.split()} for line in built)
    for k, kp2 in (("9", "16"), ("6", "8")):
        for step in ("0", "1", "2"):
            assert has("_routing_kernel", "NB=512", f"TOPK={k}", f"STEP={step}"), (k, step)
        for sep in ("True", "False"):
            assert has("_gemm2_kernel", f"TOPK={k}", f"KP2={kp2}", f"SEPARATE={sep}"), (k, sep)
        assert has("_combine_kernel", f"TOPK={k}") and has("_dispatch_kernel", f"TOPK={k}"), k
        assert has("_gemm1_kernel", "PAIRS=True", f"KP2={kp2}") and has("_gemm2_kernel", "PAIRS=True", f"TOPK={k}"), k
    # programmatic dependent launch (ATOM_MOE_PDL): routing and GEMM1 release the next launch, GEMM1 and GEMM2
    # wait on the one before (GEMM1 with pair blocks only releases: its predecessor is not ours)
    assert has("_routing_kernel", "PDL_RELEASE=True") and has("_gemm2_kernel", "PDL=True")
    assert has("_gemm1_kernel", "PDL_WAIT=True", "PDL_RELEASE=True", "PHASE=0")
    assert has("_gemm1_kernel", "PDL_WAIT=True", "PDL_RELEASE=True", "PHASE=2")
    assert has("_gemm1_kernel", "PAIRS=True", "PDL_WAIT=False", "PDL_RELEASE=True")
    # T = 1's pair blocks (no routing launch) in every scheme, split-K's two GEMM1 launches too
    for flag in ("FP8=True W4=True", "FP8=True W4=False", "FP8=False W4=True", "FP8=False W4=False"):
        for phase in ("PHASE=0", "PHASE=1", "PHASE=2"):
            assert has("_gemm1_kernel", "PAIRS=True", phase, *flag.split()), (flag, phase)
    # TMA tile descriptors (ATOM_MOE_TMA) for bf16 and fp8: GEMM1's weights (split-K's first launch too), GEMM2's
    # weights and rows in both combines, weights only with pair blocks; never for MXFP4
    for flag in ("FP8=True W4=False", "FP8=False W4=False"):
        assert has("_gemm1_kernel", "TMA_W=True", "PHASE=0", *flag.split()), flag
        assert has("_gemm1_kernel", "TMA_W=True", "PHASE=1", *flag.split()), flag
        for sep in ("True", "False"):
            assert has("_gemm2_kernel", "TMA_A=True", "TMA_W=True", f"SEPARATE={sep}", *flag.split()), (flag, sep)
        assert has("_gemm2_kernel", "TMA_A=False", "TMA_W=True", "PAIRS=True", *flag.split()), flag
        assert has("_gemm2_kernel", "TMA_A=True", "TMA_W=True", "REMOTE=True", *flag.split()), flag  # symm transport
    assert not any("TMA_W=True" in line and "W4=True" in line for line in built)
    # a8w4 (one scale per token on GEMM2's input): GEMM1 stores bf16 (sorted rows, pair blocks) or, split, its K
    # slices alone (no second launch: the finish launch adds them and quantizes), the quant and finish launches in
    # both row modes, GEMM2 with one accumulator; and with ATOM_MOE_A8W4_INTER=group
    for phase in ("PHASE=0", "PHASE=1"):
        assert has("_gemm1_kernel", "FP8=True", "W4=True", "QOUT=False", phase), phase
    assert not has("_gemm1_kernel", "FP8=True", "W4=True", "QOUT=False", "PHASE=2")
    assert has("_gemm1_kernel", "FP8=True", "W4=True", "QOUT=False", "PAIRS=True")
    assert has("_inter_quant_kernel", "PAIRS=True") and has("_inter_quant_kernel", "PAIRS=False")
    assert has("_finish_kernel", "PAIRS=True") and has("_finish_kernel", "PAIRS=False")
    assert has("_gemm2_kernel", "FP8=True", "W4=True", "ROW_SCALE=True") and has("_gemm2_kernel", "ROW_SCALE=True",
                                                                                  "PAIRS=True")
    assert not has("_gemm2_kernel", "W4=False", "ROW_SCALE=True")
    for phase in ("PHASE=0", "PHASE=2"):
        assert has("_gemm1_kernel", "FP8=True", "W4=True", "QOUT=True", phase), phase
    assert has("_gemm1_kernel", "FP8=True", "W4=True", "QOUT=True", "PAIRS=True")
    assert has("_gemm2_kernel", "FP8=True", "W4=True", "ROW_SCALE=False", "PAIRS=True")
    # GEMM2's lookahead prefetch (ahead2) in every scheme, both combines and pair blocks; never built for HIP
    for flag in ("FP8=True W4=True", "FP8=True W4=False", "FP8=False W4=True", "FP8=False W4=False"):
        for mode in ("SEPARATE=True", "SEPARATE=False", "PAIRS=True"):
            assert has("_gemm2_kernel", "AHEAD=512", mode, *flag.split()), (flag, mode)


def test_the_quant_launches_build_for_amd():
    # hip_compile.py builds the GEMMs for gfx942 / gfx950; the launches between them (a8w4's quant, and its finish
    # after a split GEMM1) build here, recorded from the ops as compile_all records every launch
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_all.py"), "--target", "gfx942", "gfx950",
                          "--kernels", "_inter_quant_kernel", "_finish_kernel"], capture_output=True, text=True,
                         env=env, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    built = [line for line in run.stdout.splitlines() if line.endswith(" B")]
    for arch in ("gfx942", "gfx950"):
        for kernel in ("_inter_quant_kernel", "_finish_kernel"):
            assert any(line.startswith(f"{arch} {kernel} ") for line in built), (arch, kernel)
    assert f"{len(built)} of {len(built)} builds passed" in run.stdout


def test_compile_all_reports_a_failing_build():
    # a build that raises is reported by name and fails the run (exit 1), the others still build;
    # --kernels keeps only the named kernels, and names one that is never launched as an error
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = (f"import sys; sys.path.insert(0, {str(ROOT / 'scripts')!r})\n"
            "import compile_all\n"
            "real = compile_all.compile_one\n"
            "def planted(kernel, *a):\n"
            "    if kernel.__name__ == '_barrier_kernel':\n"
            "        raise RuntimeError('planted')\n"
            "    return real(kernel, *a)\n"
            "compile_all.compile_one = planted\n"
            "sys.exit(compile_all.main(['--kernels', '_barrier_kernel', '_gemm1_kernel']))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    failed = [line for line in run.stdout.splitlines() if "FAILED RuntimeError: planted" in line]
    assert failed and all("_barrier_kernel" in line for line in failed)
    assert any(line.startswith("sm_90a _gemm1_kernel") and line.endswith(" B") for line in run.stdout.splitlines())
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_all.py"), "--kernels", "_nope"],
                         capture_output=True, text=True, env=env, timeout=1800)
    assert run.returncode == 2 and "_nope not launched" in run.stderr


# ---------------------------------------------------------------- eplb_bench
def _eplb_bench(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / "eplb.csv"
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "eplb_bench.py"), "--csv", str(out), *args],
                         capture_output=True, text=True, env=dict(os.environ, TRITON_INTERPRET="1"), timeout=900)
    return run, out


def test_eplb_bench_runs_tiny_on_the_cpu(tmp_path, seed):
    # the skewed-routing measurement at a tiny size under the interpreter: every placement's outputs were
    # checked against the reference by the script, every (token, slot) pair reached exactly one rank,
    # and the slowest rank is the one with the largest time
    run, out = _eplb_bench(tmp_path, "--tiny", "--seed", str(seed))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    with open(out) as fh:
        rows = list(csv.DictReader(fh))
    assert [r["placement"] for r in rows] == ["linear", "rearranged", "redundant+2"]
    assert [int(r["slots"]) for r in rows] == [6, 6, 8]
    W, T, k = 2, 6, 2
    for r in rows:
        pairs = [int(p) for p in r["rank_pairs"].split(";")]
        us = [float(u) for u in r["rank_us"].split(";")]
        assert len(pairs) == len(us) == W and sum(pairs) == W * T * k, r
        slowest = max(range(W), key=lambda i: us[i])
        assert abs(float(r["slowest_us"]) - us[slowest]) <= 0.1 and int(r["slowest_pairs"]) == pairs[slowest], r
        assert float(r["rel_err"]) <= 1e-2 and 1 / W <= float(r["expected_max_share"]) <= 1, r
        assert abs(float(r["speedup_vs_linear"]) - float(rows[0]["slowest_us"]) / float(r["slowest_us"])) < 2e-3


def test_eplb_bench_rejects_bad_sizes(tmp_path):
    run, _ = _eplb_bench(tmp_path, "--ep", "8", "--experts", "128", "--redundant", "3")
    assert run.returncode == 2
    assert "--redundant [3]: allowed: R >= 1 with experts + R a multiple of --ep 8" in run.stderr


INSTANCES_ARGS = ["--device", "cpu", "--ep", "2", "--schemes", "bf16", "--tokens", "1", "2", "--decode-capacity", "2",
                  "--prefill-capacity", "4", "--small-capacity", "1"]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the symm kernels run on the CPU only under "
                    "TRITON_INTERPRET=1 (scripts/test.sh sets it)")
def test_ep_instances_bench_runs_on_the_cpu(tmp_path):
    """scripts/ep_instances_bench.py at a tiny shape: three ops per T (the decode op the instances pick for T),
    outputs checked before any row."""
    out = tmp_path / "inst.csv"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "ep_instances_bench.py"), *INSTANCES_ARGS,
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = list(csv.DictReader(open(out)))
    assert [(r["tokens_per_rank"], r["impl"], r["capacity"]) for r in rows] == [
        ("1", "exact", "1"), ("1", "decode", "1"), ("1", "prefill", "4"),
        ("2", "exact", "2"), ("2", "decode", "2"), ("2", "prefill", "4")]
    assert all(float(r["max_diff_vs_exact"]) == 0.0 for r in rows)  # same kernels, same rows: bit-equal here
    assert all(float(r["vs_exact"]) == 1.0 for r in rows if r["impl"] == "exact")


def test_ep_instances_bench_rejects_a_negative_small_capacity(capsys):
    import ep_instances_bench
    with pytest.raises(SystemExit) as info:
        ep_instances_bench.parse([*INSTANCES_ARGS[:-1], "-1"])
    assert info.value.code == 2
    assert "--small-capacity -1: allowed an int >= 0" in capsys.readouterr().err


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (scripts/test.sh)")
def test_ep_instances_bench_reports_no_time_for_a_wrong_op(tmp_path, monkeypatch):
    """A planted wrong output of the prefill-sized op: no row for it, exit 1."""
    import ep_instances_bench
    from atom_moe.ep.simulate import SimulatedSymmGroup

    forward = SimulatedSymmGroup.forward

    def wrong(self, weights, xs, *args, **kwargs):
        outs = forward(self, weights, xs, *args, **kwargs)
        if self.capacity == 4:
            outs[0].mul_(1.5)
        return outs
    monkeypatch.setattr(SimulatedSymmGroup, "forward", wrong)
    out = tmp_path / "inst.csv"
    assert ep_instances_bench.main([*INSTANCES_ARGS[:7], "1", *INSTANCES_ARGS[9:], "--out", str(out)]) == 1
    assert list(csv.DictReader(open(out))) == []


# ---------------------------------------------------------------- ncu_summary
def test_ncu_summary_names_each_launch_by_its_nvtx_case():
    # ncu_layer.py names a case SHAPE/SCHEME/T<T>; tk_baseline.py --profile adds /<impl>, which must survive
    # (triton_kernels' and our launches of the same case are told apart by it)
    import ncu_summary
    rows = [{"Kernel Name": "_matmul_ogs_NNT_bf16xbf16xmxfp4_16x256x128x1(int)", "gpu__time_duration.sum": "2000",
             "dram__bytes_read.sum": "6000000", "smsp__inst_executed.sum": "1000", "launch__registers_per_thread": "128",
             "NVTX": "deepseek-v3/a16w4/T8/triton_kernels"},
            {"Kernel Name": "_gemm1_kernel(int)", "gpu__time_duration.sum": "1000", "NVTX": "glm-4.5/a8w4/T128"},
            # ncu_layer.py --vllm-src: vLLM's launches of the case, with its tuned table
            {"Kernel Name": "fused_moe_kernel(int)", "gpu__time_duration.sum": "1000", "NVTX": "kimi-k2/fp8/T8/vllm-tuned"},
            {"Kernel Name": ""}]
    out = ncu_summary.summarise(rows)
    assert [r["case"] for r in out] == ["deepseek-v3/a16w4/T8/triton_kernels", "glm-4.5/a8w4/T128",
                                        "kimi-k2/fp8/T8/vllm-tuned"]
    assert [r["kernel"] for r in out] == ["matmul_ogs_NNT_bf16xbf16xmxfp4_16x256x128x1", "gemm1", "fused_moe"]
    assert out[0]["us"] == 2.0 and out[0]["read_TBps"] == 3.0 and out[0]["regs"] == 128
    assert out[0]["inst_per_byte"] == round(1000 * 32 / 6e6, 2) and out[1]["read_TBps"] == 0


# ---------------------------------------------------------------- ncu_source_summary
def test_ncu_source_summary_charges_stalls_and_excess_wavefronts(tmp_path):
    # two launches as ncu's source page writes them: stall samples and shared wavefronts per SASS line
    import ncu_source_summary
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_long_sb",
              "stall_short_sb", "stall_long_sb (Not Issued)", "L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal",
              "L2 Theoretical Sectors Global", "L2 Theoretical Sectors Global Ideal"]
    lines = ['"Kernel Name","_gemm2_kernel",', ",".join(f'"{h}"' for h in header),
             '"0x10","  LDGSTS.E desc[UR4][R2.64], P0, [R9]","2","100","0","2","7","1,600","100","400","400"',
             '"0x20","  UIADD3 UR8, UR8, 0x1, URZ","30","100","27","3","9","0","0","0","0"',
             '"Kernel Name","_gemm1_kernel",', ",".join(f'"{h}"' for h in header),
             '"0x10","  LDGSTS.E.BYPASS.128 desc[UR4][R2.64], P0, [R9]","4","50","4","0","0","200","200","800","400"']
    src = tmp_path / "source.csv"
    src.write_text("\n".join(lines) + "\n")
    (name0, rows0), (name1, rows1) = ncu_source_summary.launches(src)
    assert (name0, len(rows0), name1, len(rows1)) == ("_gemm2_kernel", 2, "_gemm1_kernel", 1)
    printed, table = ncu_source_summary.summarize(name0, rows0, top=1)
    assert printed[1] == "  stalls: long_sb 84.4%, short_sb 15.6%"  # 27 and 5 of 32 samples; not-issued ones apart
    assert "UIADD3" in printed[2] and "x16.0" in printed[-1]
    assert [(t["shared_excess"], t["l2_excess"]) for t in table] == [(16.0, 1.0)]
    out = tmp_path / "loads.csv"
    assert ncu_source_summary.main([str(src), "--csv", str(out)]) == 0
    got = list(csv.DictReader(out.open()))
    assert [(r["launch"], r["shared_excess"], r["l2_excess"]) for r in got] == [("0", "16.0", "1.0"),
                                                                                 ("1", "1.0", "2.0")]
    with pytest.raises(SystemExit):  # argparse: --top must be >= 1, the file must exist
        ncu_source_summary.main([str(src), "--top", "0"])
    with pytest.raises(SystemExit):
        ncu_source_summary.main([str(tmp_path / "missing.csv")])
    (tmp_path / "empty.csv").write_text("a,b\n")
    with pytest.raises(SystemExit, match="no 'Kernel Name' block"):
        ncu_source_summary.launches(tmp_path / "empty.csv")


# ---------------------------------------------------------------- tk_baseline routing at any top-k
@pytest.mark.parametrize("T,E,k", [(5, 384, 6), (7, 257, 9), (3, 16, 9)])
def test_tk_routing_any_topk_matches_the_ids(vllm_src, monkeypatch, T, E, k):
    # GLM-5.2's 9 and V4.1's 6 are not powers of two: 3.5.1's routing kernels refuse them, so tk_baseline
    # builds the metadata in torch; it must route exactly the ids, with topk's gates, and tile every expert
    monkeypatch.syspath_prepend(str(vllm_src / "vllm" / "third_party"))
    import tk_baseline
    tk_baseline.import_tk()
    assert tk_baseline.API["version"] == "3.5.1" and not tk_baseline.kernel_routing(k)
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)]).sort(1).values
    w = torch.rand(T, k, generator=gen) + 0.1
    w = w / w.sum(1, keepdim=True)
    logits = tk_baseline.router_logits(w, ids, E)
    rdata, gather, scatter, sparse = tk_baseline.tk_routing(logits, ids.int(), k, E)
    slots = tk_baseline.routed_slots(rdata, gather, sparse, T, k, E)
    assert tk_baseline.routing_error(slots, ids, E) is None
    torch.testing.assert_close(slots.vals.float(), w, atol=1e-2, rtol=1e-2)  # bf16 logits of log(w)
    assert torch.equal(scatter.src_indx, gather.dst_indx) and torch.equal(scatter.dst_indx, gather.src_indx)
    hist = torch.bincount(ids.reshape(-1), minlength=E)
    assert torch.equal(rdata.expt_data.token_offs_raw.long(), torch.cat([torch.zeros(1), hist.cumsum(0)]).long())
    for block_m, pid_map in rdata.expt_data.block_pid_map.items():  # tile (b << 16) + e for each block b of e
        want = sorted((b << 16) + e for e in range(E) for b in range(-(-int(hist[e]) // block_m)))
        assert sorted(int(v) for v in pid_map if v >= 0) == want
    with pytest.raises(ValueError, match="cannot select experts"):
        tk_baseline.tk_routing(logits, None, k, E)


def test_a8w4_error_probe_needs_a_gpu():
    # the probe runs the kernels: without a GPU it says so instead of timing or comparing anything
    script = str(ROOT / "scripts" / "a8w4_error_probe.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0 and "--splits" in proc.stdout
    proc = subprocess.run([sys.executable, script, "--splits", "16"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2 and "allowed are 1..8" in proc.stderr
    proc = subprocess.run([sys.executable, script, "--seeds", "0"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2 and "--seeds" in proc.stderr and ">= 1" in proc.stderr
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, cwd=ROOT)
        assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr


def test_launch_ab_needs_a_gpu():
    # the launch-chaining A/B (routing launch or pair blocks, with or without PDL) is a GPU timing script:
    # without one it says so; pair-block arms run at T = 1 only, TMA arms for every scheme; each arm sets both
    # flags for its call and restores them
    script = str(ROOT / "scripts" / "launch_ab.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0 and "--rounds" in proc.stdout and "pairs+pdl" in proc.stdout
    if not torch.cuda.is_available():
        proc = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, cwd=ROOT)
        assert proc.returncode == 1 and "needs a CUDA GPU" in proc.stderr
    sys.path.insert(0, str(ROOT / "scripts"))
    import launch_ab
    assert launch_ab.arms_at(list(launch_ab.ARMS), 1, "fp8") == list(launch_ab.ARMS)
    assert launch_ab.arms_at(list(launch_ab.ARMS), 8, "bf16") == ["sorted", "sorted+pdl", "sorted+tma", "sorted+pdl+tma"]
    assert launch_ab.arms_at(list(launch_ab.ARMS), 8, "a8w4") == ["sorted", "sorted+pdl", "sorted+tma",
                                                                  "sorted+pdl+tma", "sorted+rowscales"]
    assert "sorted+rowscales" not in launch_ab.arms_at(list(launch_ab.ARMS), 512, "a16w4")
    # a --tiles arm: the config it names (and no flag), a malformed one refused before any GPU work
    assert launch_ab.tile_config("tiles=128,128,64,8,3,128,64,8,3") == \
        launch_ab.TileConfig(128, 128, 64, 8, 3, 128, 64, 8, 3)
    assert launch_ab.tile_config("sorted+tma") is None
    assert launch_ab.run_arm("tiles=64,128,64,4,3,256,64,8,3", lambda: os.environ["ATOM_MOE_TMA"]) == "0"
    proc = subprocess.run([sys.executable, script, "--tiles", "128,128,64"], capture_output=True, text=True,
                          env=env, cwd=ROOT)
    assert proc.returncode == 1 and "allowed are 9 to 15 integers" in proc.stderr
    before = {f: os.environ.get(f) for f in ("ATOM_MOE_PDL", "ATOM_MOE_TMA")}
    seen = launch_ab.run_arm("sorted+pdl+tma", lambda: (os.environ["ATOM_MOE_PDL"], os.environ["ATOM_MOE_TMA"]))
    assert seen == ("1", "1") and launch_ab.run_arm("sorted", lambda: os.environ["ATOM_MOE_TMA"]) == "0"
    assert {f: os.environ.get(f) for f in before} == before


# ---------------------------------------------------------------- inter_quant_probe
@pytest.mark.parametrize("name", ["glm-5.2-tp8", "gpt-oss-120b"])  # plain SwiGLU; gpt-oss's variant with biases
def test_inter_quant_probe_group64_is_the_references_a8w4(name, tmp_path, seed):
    # the probe's own expert loop must be the scheme's layer: its group64 column (today's GEMM2 input) equals
    # reference_moe with a8w4's activation quant on the same MXFP4 weights and tokens
    import inter_quant_probe as probe

    from atom_moe import formats
    from atom_moe.presets import preset, scaled_down
    from atom_moe.reference import ReferenceWeights, reference_moe
    from atom_moe.spec import Scheme
    from atom_moe.tools.synthetic import random_layer, random_tokens

    out = tmp_path / "probe.csv"
    assert probe.main(["--shapes", name, "--experts", "3", "--tokens", "6", "--seed", str(seed), "--csv", str(out)]) == 0
    with open(out) as fh:
        (row,) = list(csv.DictReader(fh))
    base = preset(name, scheme="a8w4")
    spec = scaled_down(base, hidden_size=base.hidden_size, intermediate_size=base.intermediate_size, num_experts=3,
                       top_k=min(base.top_k, 3))
    gen = torch.Generator().manual_seed(seed)
    raw = random_layer(spec, generator=gen)
    w13 = formats.dequantize_mxfp4(*formats.quantize_mxfp4(raw.w13.float()))
    w2 = formats.dequantize_mxfp4(*formats.quantize_mxfp4(raw.w2.float()))
    ref_w = ReferenceWeights.from_separated(w13, w2, raw.w13_bias, raw.w2_bias)
    x, w, ids = random_tokens(spec, 6, generator=gen)
    truth = reference_moe(x, w, ids, ref_w, spec.activation)
    quant = reference_moe(x, w, ids, ref_w, spec.activation, act_quant=Scheme.A8W4)
    want = float((quant - truth).norm() / truth.norm())
    assert abs(float(row["group64"]) - want) <= 1e-4 * want, (row, want)
    assert all(0 < float(row[v]) < 0.2 for v in probe.VARIANTS), row


def test_inter_quant_probe_refuses_an_unknown_shape(capsys):
    import inter_quant_probe as probe

    with pytest.raises(SystemExit):
        probe.main(["--shapes", "no-such-model"])
    assert "unknown preset 'no-such-model'" in capsys.readouterr().err
