"""Prepare the folder the GPU machine's check needs beside the checkout (`make gpu-bundle`).

    .venv/bin/python docs/bench/gpu_bundle.py [--out build/gpu-bundle] [--model-dir DIR] [--dry-run]

The GPU machine (docs/benchmarks.md, "GPU: expected") has its own Python 3.12 with a CUDA torch,
Triton, transformers, numpy, tokenizers and safetensors, no package registry, and room for 64
MiB of files. What the engine needs beyond that comes here as wheels for cp312 manylinux x86_64
(`pip download --only-binary=:all: --python-version 3.12 ...`), each at the version this
project's venv runs, and installs there with `pip install --no-index --no-deps --target`. Beside
them: the bundled model's config and tokenizer (3.5 MB; the check builds seeded random weights
of that shape on the device, the 98 MB GGUF stays here), and MANIFEST.json (every file, its
size and sha256, the pins, the install and run commands). The folder must stay under 16 MB.

Before writing anything the wheels' tags are checked (cp312 or py3 / abi3, manylinux, x86_64)
and pip is asked to resolve an install of them for cp312 from the folder alone (`--dry-run
--no-index`). `--dry-run` prints the plan (pins, the download command, the model files) as JSON
and touches neither the network nor the disk.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "build" / "gpu-bundle"
LIMIT_BYTES = 16 << 20
# What the engine imports that the GPU image lacks (KINDS.md's package list): the transports
# (pyzmq, trio and its outcome, sniffio), the wire format (msgspec), anyio at this project's
# version, and gguf (engine/config.py reaches engine/loading/gguf_import.py on every start).
PACKAGES = ("msgspec", "pyzmq", "trio", "outcome", "sniffio", "anyio", "gguf")
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
)
# pip matches each manylinux_2_N exactly: the glibc versions wheels are built for.
PLATFORMS = ["manylinux1_x86_64", "manylinux2014_x86_64"] + [f"manylinux_2_{n}_x86_64" for n in range(17, 40)]
INSTALL = "python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site {bundle}/wheels/*.whl"
RUN = "bash docs/bench/gpu_check_run.sh {bundle}"
_WHEEL = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<python>[^-]+)-(?P<abi>[^-]+)-(?P<platform>[^-]+)\.whl$"
)


def pins() -> dict[str, str]:
    """Each bundled package at the version installed here."""
    return {name: importlib.metadata.version(name) for name in PACKAGES}


def download_command(pinned: dict[str, str], dest: Path) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
    ]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    return cmd + ["-d", str(dest)] + [f"{name}=={version}" for name, version in pinned.items()]


def wheel_problem(filename: str) -> str | None:
    """Why a wheel would not install on CPython 3.12, manylinux x86_64 (None: it would)."""
    m = _WHEEL.match(filename)
    if m is None:
        return f"{filename}: not a wheel file name"
    pythons, abis, platforms = (set(m.group(g).split(".")) for g in ("python", "abi", "platform"))
    if not pythons & {"cp312", "py3", "py312"} and not (
        "abi3" in abis and any(_cp3(p) <= 12 for p in pythons if p.startswith("cp3"))
    ):
        return f"{filename}: built for {m.group('python')}, not CPython 3.12"
    if "any" not in platforms and not any(p.startswith("manylinux") and p.endswith("_x86_64") for p in platforms):
        return f"{filename}: platform {m.group('platform')}, not manylinux x86_64"
    return None


def _cp3(tag: str) -> int:
    try:
        return int(tag[3:])
    except ValueError:
        return 99


def model_source(model_dir: Path | None) -> Path:
    """`--model-dir`, else the bundled SmolLM2-135M-Instruct's import (done once, cached)."""
    if model_dir is not None:
        return model_dir
    from triollm.engine.loading.model_files import resolve_model

    return resolve_model(None, None)


def manifest(
    bundle: Path, pinned: dict[str, str], final: Path | None = None, limit: int = LIMIT_BYTES
) -> dict[str, Any]:
    """Every file of `bundle` with its size and sha256, and the commands for it at `final` (its
    place once complete; default `bundle`); refuses a folder over `limit` bytes."""
    files: dict[str, dict[str, Any]] = {}
    total = 0
    for path in sorted(p for p in bundle.rglob("*") if p.is_file() and p.name != "MANIFEST.json"):
        data = path.read_bytes()
        files[str(path.relative_to(bundle))] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        total += len(data)
    if total > limit:
        raise ValueError(f"bundle: {total} bytes, over the {limit} byte limit")
    rel = _shown(final or bundle)
    return {
        "python": "cp312 manylinux x86_64",
        "pins": pinned,
        "files": files,
        "total_bytes": total,
        "install": INSTALL.format(bundle=rel),
        "run": RUN.format(bundle=rel),
    }


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def check_installable(wheels: Path) -> None:
    """pip resolves an install of every wheel for cp312 from the folder alone."""
    with tempfile.TemporaryDirectory() as target:
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", "--target", target,
               "--find-links", str(wheels)]  # fmt: skip
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
        subprocess.run(cmd + [str(w) for w in sorted(wheels.glob("*.whl"))], check=True, capture_output=True, text=True)


def build(out: Path, model_dir: Path | None) -> dict[str, Any]:
    pinned = pins()
    tmp = Path(tempfile.mkdtemp(prefix=".gpu-bundle-", dir=out.parent))
    try:
        (tmp / "wheels").mkdir()
        subprocess.run(download_command(pinned, tmp / "wheels"), check=True)
        wheels = sorted(p.name for p in (tmp / "wheels").glob("*.whl"))
        problems = [p for p in map(wheel_problem, wheels) if p]
        if problems or len(wheels) != len(pinned):
            raise ValueError(f"wheels: {problems or wheels} (expected one cp312 manylinux wheel per {sorted(pinned)})")
        check_installable(tmp / "wheels")
        source = model_source(model_dir)
        (tmp / "model").mkdir()
        for name in MODEL_FILES:
            if (source / name).exists():
                shutil.copy(source / name, tmp / "model" / name)
        if not (tmp / "model" / "config.json").exists():
            raise ValueError(f"--model-dir: {source} has no config.json")
        info = manifest(tmp, pinned, final=out)
        (tmp / "MANIFEST.json").write_text(json.dumps(info, indent=1))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"the bundle folder (default {_shown(DEFAULT_OUT)})"
    )
    parser.add_argument(
        "--model-dir", type=Path, help="config + tokenizer to bundle (default: the bundled SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the plan as JSON; download and write nothing")
    args = parser.parse_args(argv)
    if args.dry_run:
        pinned = pins()
        plan = {
            "out": _shown(args.out),
            "pins": pinned,
            "download": download_command(pinned, args.out / "wheels"),
            "model_files": [n for n in MODEL_FILES if args.model_dir is None or (args.model_dir / n).exists()],
            "install": INSTALL.format(bundle=_shown(args.out)),
            "run": RUN.format(bundle=_shown(args.out)),
        }
        print(json.dumps(plan, indent=1))
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    info = build(args.out, args.model_dir)
    for name, f in info["files"].items():
        print(f"{f['bytes']:>10}  {name}")
    print(f"{info['total_bytes']:>10}  in {_shown(args.out)} (limit {LIMIT_BYTES})")
    print(f"on the GPU machine: {info['run']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
