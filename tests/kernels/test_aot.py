"""The ahead-of-time compile tool (`python -m triollm.kernels.aot`): every kernel compiles for
sm_90 without a GPU, and a kernel the compiler rejects, or a module that does not import, makes
it exit non-zero.

The tool runs in a subprocess without TRITON_INTERPRET: this process has it set (conftest.py),
so the kernels imported here are interpreter objects that cannot be compiled.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

from triollm.kernels.aot import collect_specs, compile_spec  # noqa: E402


def run_aot(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "triollm.kernels.aot", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )


def test_every_kernel_compiles_for_sm90() -> None:
    collected = collect_specs()
    assert not collected.errors
    names = [spec.name for spec in collected.specs]
    assert len(names) == len(set(names)), "kernel names must be unique"

    result = run_aot("--arch", "sm_90")
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    for name in names:
        matching = [line for line in lines if line.startswith(name + " ")]
        assert len(matching) == 1, f"{name}: {matching}"
        assert " regs " in matching[0] and " B shared " in matching[0]
    assert lines[-1] == f"{len(names)} kernels compiled for sm_90"


BROKEN_MODULE = """
import triton
import triton.language as tl

from triollm.kernels.triton import AotSpec


@triton.jit
def copy(x_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1)


@triton.jit
def tiny_dot(x_ptr, BLOCK: tl.constexpr):
    # tl.dot needs every dimension >= 16: the compiler rejects 8 x 8.
    offs = tl.arange(0, BLOCK)
    tile = tl.load(x_ptr + offs[:, None] * BLOCK + offs[None, :])
    tl.store(x_ptr + offs[:, None] * BLOCK + offs[None, :], tl.dot(tile, tile))


SIGNATURE = {"x_ptr": "*fp16", "BLOCK": "constexpr"}
AOT_SPECS = [
    AotSpec("copy[BLOCK=64]", copy, SIGNATURE, {"BLOCK": 64}),
    AotSpec("tiny_dot[BLOCK=8]", tiny_dot, SIGNATURE, {"BLOCK": 8}),
]
"""


def test_a_kernel_the_compiler_rejects_fails_the_run(tmp_path: Path) -> None:
    (tmp_path / "aot_broken_kernels.py").write_text(textwrap.dedent(BROKEN_MODULE))
    result = run_aot("--module", "aot_broken_kernels", pythonpath=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("copy[BLOCK=64] ") and " regs " in line for line in lines)
    failed = [line for line in lines if line.startswith("tiny_dot[BLOCK=8]  FAILED")]
    assert len(failed) == 1, result.stdout
    assert lines[-1] == "1 kernels compiled for sm_90, 1 failed"


def test_a_module_that_fails_to_import_fails_the_run(tmp_path: Path) -> None:
    (tmp_path / "aot_unimportable.py").write_text("raise RuntimeError('broken on purpose')\n")
    result = run_aot("--module", "aot_unimportable", "--arch", "sm_80", pythonpath=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "aot_unimportable: import failed: RuntimeError: broken on purpose" in result.stdout
    assert result.stdout.splitlines()[-1] == (
        "0 kernels compiled for sm_80, 1 modules failed to import"
    )


def test_interpreter_kernels_are_refused() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest.py
    spec = collect_specs(["triollm.kernels.triton.norm"]).specs[0]
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        compile_spec(spec)
