"""Resolve a Hugging Face Hub repo id (`Qwen/Qwen3-0.6B`) to a snapshot directory in the HF cache.

A `model` (or `tokenizer`) that is not an existing path and passes huggingface_hub's own
`validate_repo_id` is a repo id. It resolves through `huggingface_hub.snapshot_download`, in two
steps:

1. The local cache, with `local_files_only=True`: a branch or tag `revision` is looked up in the
   repo's `refs/`, a commit hash names its snapshot directly. A cached model never touches the
   network, online or not, and the snapshot is used as is (its files are symlinks into `blobs/`).
2. Only if that misses (no snapshot, or one without the files the engine needs) and the machine is
   not offline (`HF_HUB_OFFLINE`), a download, as vLLM does it: the same call without
   `local_files_only`, into `download_dir` (vLLM's meaning: the hub cache directory; default
   huggingface_hub's own, which honours `HF_HOME` / `HF_HUB_CACHE`), with `hf_token`.

Only the files a model needs are fetched (`MODEL_PATTERNS`: configs, safetensors weights, tokenizer
files, chat templates), never `*.bin` / `*.pt` / `*.msgpack` / `*.h5` / ONNX copies of the weights.

A miss is a `ValueError` naming the field that says what was tried (not a local path; not in the
cache at <dir> for <revision>; offline, or why the download failed) and how to get the files
(`hf download ...`). Download errors are reduced to that one line (`from None`): a gated repo or a
401 is a user's mistake, not a traceback.

`HF_HUB_OFFLINE` is huggingface_hub's variable: it reads it once at import into
`constants.HF_HUB_OFFLINE`; it is also re-read here at resolution (engine start-up), so that a
process that set it after importing the hub is still offline. huggingface_hub is imported lazily:
the engine's start imports this module, and most models are local directories.

Rejected: our own cache walk (refs/ and snapshots/ by hand) — huggingface_hub owns its layout and
its incomplete-snapshot checks; and downloading first like vLLM (one `snapshot_download` online)
— that costs a round trip to the Hub per start and fails on a flaky network with the files at hand.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Literal

from triollm.engine import envs

__all__ = ["MODEL_PATTERNS", "TOKENIZER_PATTERNS", "hub_offline", "is_hub_id", "resolve_hub"]

logger = logging.getLogger("triollm")

TOKENIZER_PATTERNS = ("*.json", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt", "vocab.*")
MODEL_PATTERNS = (*TOKENIZER_PATTERNS, "*.safetensors")
_LOGIN = "log in with `hf auth login` (or `huggingface-cli login`) or pass hf_token"


def is_hub_id(name: str | None) -> bool:
    """`name` is not an existing path and is a valid Hub repo id (`owner/name` or `name`)."""
    if not name or not name.strip() or name.lower().endswith(".gguf"):
        return False
    if Path(name).expanduser().exists():
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def hub_offline() -> bool:
    """`HF_HUB_OFFLINE` is set truthy (as huggingface_hub read it at import, or now)."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE) or envs.hf_hub_offline()


def resolve_hub(
    repo_id: str,
    field: str,
    *,
    revision: str | None = None,
    download_dir: str | None = None,
    token: str | bool | None = None,
    files: Literal["model", "tokenizer"] = "model",
) -> Path:
    """The snapshot directory of `repo_id` at `revision`: the cache first, then a download.

    `field` ("model" or "tokenizer") names the argument in errors; `files` says what the snapshot
    must hold (a model's config.json and weights, or a tokenizer's tokenizer.json).
    """
    import huggingface_hub
    from huggingface_hub import constants, errors

    cache = Path(download_dir).expanduser() if download_dir else Path(constants.HF_HUB_CACHE)
    rev = revision or constants.DEFAULT_REVISION
    patterns = list(MODEL_PATTERNS if files == "model" else TOKENIZER_PATTERNS)

    def snapshot(local_files_only: bool) -> Path:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id, revision=revision, cache_dir=download_dir, token=token,
                allow_patterns=patterns, local_files_only=local_files_only,
            )  # type: ignore[arg-type]  # a str unless dry_run
        )

    head = f"{field}: {repo_id!r} is not a local path"
    try:
        path = snapshot(local_files_only=True)
    except errors.LocalEntryNotFoundError as exc:
        incomplete = isinstance(exc, getattr(errors, "IncompleteSnapshotError", ()))
        miss = (
            f"its cached snapshot in {cache} is incomplete"
            if incomplete
            else f"not in the Hugging Face cache at {cache}"
        )
    else:
        missing = _missing(path, files)
        if not missing:
            return path
        miss = f"its cached snapshot {path} lacks {', '.join(missing)}"
    miss = f"{miss} (revision {rev!r})"
    how = _how_to_get(repo_id, revision, download_dir)
    if hub_offline():
        raise ValueError(f"{head}, and {miss}; HF_HUB_OFFLINE is set, so nothing was downloaded. {how}")
    logger.info("downloading %s (revision %s) from the Hugging Face Hub into %s", repo_id, rev, cache)
    try:
        path = snapshot(local_files_only=False)
    except OSError as exc:  # huggingface_hub's HTTP and cache errors are all OSErrors
        raise ValueError(f"{head}, {miss}, and the download failed: {_why(exc, repo_id, rev)}. {how}") from None
    missing = _missing(path, files)
    if missing:
        what = (
            "safetensors weights (a GGUF file: download it and pass its path)"
            if files == "model"
            else "a fast tokenizer"
        )
        raise ValueError(
            f"{field}: {repo_id!r} (revision {rev!r}) was downloaded to {path} but lacks {', '.join(missing)}; "
            f"triollm needs {what}"
        )
    return path


def _missing(path: Path, files: str) -> list[str]:
    """The files the engine needs that the snapshot lacks (a broken blob symlink counts as absent)."""
    if files == "tokenizer":
        return [] if (path / "tokenizer.json").is_file() else ["tokenizer.json"]
    missing = [] if (path / "config.json").is_file() else ["config.json"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
        missing += [s for s in shards if not (path / s).is_file()]
    elif not any(p.is_file() for p in path.glob("*.safetensors")):
        missing.append("model.safetensors")
    return missing


def _how_to_get(repo_id: str, revision: str | None, download_dir: str | None) -> str:
    extra = (f" --revision {revision}" if revision else "") + (f" --cache-dir {download_dir}" if download_dir else "")
    return (
        f"Get the files with `hf download {repo_id}{extra}` (or `huggingface-cli download {repo_id}{extra}`) "
        "on a machine with network access"
    )


def _why(exc: OSError, repo_id: str, revision: str) -> str:
    """One line for a failed download (the hub's own messages run to several)."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return f"the repository is gated: accept its conditions at https://huggingface.co/{repo_id}, then {_LOGIN}"
    if isinstance(exc, errors.RepositoryNotFoundError):
        return f"no such repository on the Hub, or it is gated/private: {_LOGIN}"
    if isinstance(exc, errors.RevisionNotFoundError):
        return f"the repository has no revision {revision!r} (a branch, tag or commit hash)"
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return f"the Hub refused access (HTTP {status}): {_LOGIN}"
        return f"the Hub answered with an error: {_first_line(exc)}"
    if isinstance(exc, (errors.LocalEntryNotFoundError, ConnectionError)):
        return f"the Hub could not be reached (a network error: {_first_line(exc)})"
    return f"{type(exc).__name__}: {_first_line(exc)}"


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= 200 else text[:197] + "..."
