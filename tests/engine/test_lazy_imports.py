"""An engine over a safetensors model never imports gguf (a GPU image may lack it; issue 28)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_safetensors_model_starts_without_gguf(tiny_model_dir: Path) -> None:
    code = (
        "import sys\n"
        "from triollm.engine.config import EngineArgs\n"
        "from triollm.engine.core import EngineCore\n"
        f"core = EngineCore(EngineArgs(model={str(tiny_model_dir)!r}, max_model_len=64, "
        f"num_threads=1).create_engine_config())\n"
        "core.close()\n"
        "print(sorted(m for m in sys.modules if m == 'gguf' or m.startswith('gguf.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
