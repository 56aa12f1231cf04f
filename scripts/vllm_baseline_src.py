#!/usr/bin/env python3
"""Fetch the vLLM sources `atom-moe bench --vllm-src` loads, into a git-ignored folder of this repo.

    python3 scripts/vllm_baseline_src.py            # -> .cache/vllm-0.33.0 (prints the folder)

`pip download vllm==0.33.0 --no-deps` (the CPython 3.12 manylinux wheel, the GPU machine's Python)
into $ATOM_MOE_CACHE/wheels (default ~/.cache/atom_moe/wheels, reused when present), then unzips
only what the baselines read (about 1 MB; listed in the folder's SOURCE file):

  vllm/model_executor/layers/fused_moe/fused_moe.py   fused_moe_kernel, its launcher, default config
  vllm/model_executor/layers/fused_moe/utils.py       enable_swap_ab, resolve_moe_use_td
  vllm/model_executor/layers/fused_moe/configs/*device_name=NVIDIA_H{100,200}*.json   the tuned Hopper tables
  vllm/third_party/triton_kernels/**.py   the triton_kernels copy vLLM runs for MXFP4 on Hopper
                                           (scripts/tk_baseline.py: PYTHONPATH=<folder>/vllm/third_party)
  vllm-0.33.0.dist-info/licenses/LICENSE

Nothing of it is committed (.cache/ is in .gitignore). The GPU machine has no network: carry the
folder there (`carry: [".cache/vllm-0.33.0"]`) and pass it as `--vllm-src .cache/vllm-0.33.0`.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FUSED = "vllm/model_executor/layers/fused_moe/"
WANTED = (FUSED + "fused_moe.py", FUSED + "utils.py")
TRITON_KERNELS = "vllm/third_party/triton_kernels/"
TUNED_DEVICES = ("NVIDIA_H200", "NVIDIA_H100")  # vLLM's tuned tables for the GPUs the device tool lends


def wanted(name: str, version: str) -> bool:
    """Is this wheel member one the baseline reads?"""
    if name in WANTED or name == f"vllm-{version}.dist-info/licenses/LICENSE":
        return True
    if name.startswith(TRITON_KERNELS):
        return name.endswith(".py")
    return name.startswith(FUSED + "configs/") and name.endswith(".json") and any(
        f"device_name={d}" in name for d in TUNED_DEVICES)


def download(version: str, cache: Path) -> Path:
    """The cached wheel, downloaded with pip once."""
    cache.mkdir(parents=True, exist_ok=True)
    found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not found:
        # into a private folder, then renamed: a concurrent run (two test workers) never sees a partial wheel
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            cmd = [sys.executable, "-m", "pip", "download", f"vllm=={version}", "--no-deps", "--only-binary=:all:",
                   "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "-d", tmp]
            print("running:", " ".join(cmd), file=sys.stderr, flush=True)
            if subprocess.run(cmd, stdout=sys.stderr).returncode != 0:
                raise SystemExit(f"vllm_baseline_src: pip download vllm=={version} failed (is PyPI reachable?)")
            for whl in Path(tmp).glob(f"vllm-{version}-*.whl"):
                os.replace(whl, cache / whl.name)
        found = sorted(cache.glob(f"vllm-{version}-*.whl"))
    if not found:
        raise SystemExit(f"vllm_baseline_src: no vllm-{version} wheel in {cache} after pip download")
    return found[-1]


def extract(wheel: Path, version: str, dest: Path) -> list[str]:
    """Unzip the wanted members into dest (replacing what is there); returns their names. Each file is written
    beside its target and renamed onto it, so a concurrent reader sees the old or the new file, never half."""
    with zipfile.ZipFile(wheel) as z:
        names = sorted(n for n in z.namelist() if wanted(n, version))
        missing = [n for n in WANTED if n not in names]
        if missing:
            raise SystemExit(f"vllm_baseline_src: {wheel.name} lacks {missing}: not a vLLM layout this baseline knows")
        for n in names:
            target = dest / n
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
            with os.fdopen(fd, "wb") as fh:
                fh.write(z.read(n))
            os.replace(tmp, target)
    return names


def main(argv: list[str] | None = None) -> None:
    """Download (once) and unzip; print the folder."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--version", default="0.33.0", help="vLLM version (the baseline is written for 0.33.0)")
    p.add_argument("--dest", type=Path, default=None, help="folder (default: REPO/.cache/vllm-VERSION)")
    args = p.parse_args(argv)
    cache = Path(os.environ.get("ATOM_MOE_CACHE", Path.home() / ".cache" / "atom_moe")) / "wheels"
    dest = args.dest or REPO / ".cache" / f"vllm-{args.version}"
    wheel = download(args.version, cache)
    names = extract(wheel, args.version, dest)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    size = sum((dest / n).stat().st_size for n in names)
    (dest / "SOURCE").write_text(f"{wheel.name} sha256 {sha}\n{len(names)} files, {size} bytes:\n"
                                 + "".join(f"  {n}\n" for n in names))
    print(f"vllm_baseline_src: {len(names)} files ({size / 1e6:.2f} MB) from {wheel.name} in {dest}",
          file=sys.stderr)
    print(dest)


if __name__ == "__main__":
    main()
