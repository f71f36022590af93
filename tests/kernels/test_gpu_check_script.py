"""`tests/gpu_check.py`, the script a GPU machine runs, kept working on CPU: its kernel part
runs under the Triton interpreter (`--cpu`) and must pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_the_gpu_check_script_passes_its_cpu_smoke_run() -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    script = Path(__file__).parent.parent / "gpu_check.py"
    env = {k: v for k, v in os.environ.items() if k != "TRIOLLM_KERNELS"}
    proc = subprocess.run([sys.executable, str(script), "--cpu"], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert len([line for line in lines if line.startswith("ok")]) >= 16 and not any("FAIL" in line for line in lines), proc.stdout
