"""Sleep mode, weight reload and `collective_rpc`: the pieces the executor's methods share.

vLLM's sleep mode frees an engine's device memory between uses (RL loops that train and generate
in turns, servers that swap models): `sleep(level=1)` frees the KV cache and keeps the weights,
`sleep(level=2)` frees both, and `wake_up(tags)` brings back the parts named ("weights",
"kv_cache"; all by default). vLLM keeps level 1's weights in pinned host memory; this engine's
weights already live on the host when it runs on CPU, so level 1 keeps them where they are, and
level 2 drops them and reads the checkpoint again at wake-up, as vLLM's level 2 discards them.

Freeing is dropping every reference (the executor's runner holds the KV cache and the CUDA
graphs over it, the model holds its parameters and packed copies) and then asking the allocators
to give the memory back: the cycle collector for objects in reference cycles, CUDA's caching
allocator, and glibc's `malloc_trim`, which returns the freed heap pages that glibc would
otherwise keep for later (large tensors are mmap'd and go back at once).

`reload_weights(weights_path)` reads the running checkpoint again, or another checkpoint of the
same architecture: its config.json is checked against the running model's before anything is
dropped (`same_architecture`), and a field that differs is a ValueError naming it.

Rejected: zeroing the parameters in place (`p.data = torch.empty(0)`): packed and quantized
copies, LoRA wrappers and captured graphs keep their own references; rebuilding the model and
the runner from the config is the path start-up already takes.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch

from triollm.engine.loading.hf_config import HfConfig, parse_hf_config
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.multimodal_config import split_multimodal
from triollm.kernels import cpu_native

__all__ = ["SLEEP_LEVELS", "WAKE_TAGS", "check_level", "check_tags", "release_memory", "run_rpc", "same_architecture"]

SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")

# Checkpoints of one architecture may be saved in different dtypes; the engine casts either way.
_MAY_DIFFER = frozenset({"checkpoint_dtype"})


def check_level(level: object) -> int:
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise ValueError(f"level: {level!r} is not a sleep level; allowed: 1 (KV cache), 2 (KV cache and weights)")
    return int(level)  # type: ignore[call-overload]


def check_tags(tags: Iterable[str] | None) -> frozenset[str]:
    """The parts `wake_up(tags)` restores: all of them for None."""
    if tags is None:
        return frozenset(WAKE_TAGS)
    if isinstance(tags, str):
        raise ValueError(f"tags: a list of tags, got the string {tags!r}; allowed tags: {', '.join(WAKE_TAGS)}")
    chosen = frozenset(tags)
    unknown = sorted(chosen - set(WAKE_TAGS))
    if unknown:
        raise ValueError(f"tags: {', '.join(map(repr, unknown))} not known; allowed: {', '.join(WAKE_TAGS)}")
    return chosen


def same_architecture(running: ModelConfig, path: str | Path) -> ModelConfig:
    """The running model's config pointed at `path`, whose config.json must describe the same
    model (every field of `HfConfig` but the checkpoint's dtype); ValueError naming the first
    field that differs, or the missing file."""
    folder = Path(path).expanduser()
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"weights_path: {folder} has no config.json (expected a Hugging Face-format directory)")
    hf, _ = split_multimodal(json.loads(cfg_file.read_text()))
    other = parse_hf_config(hf, running.model_impl)
    for f in fields(HfConfig):
        if f.name in _MAY_DIFFER:
            continue
        mine, theirs = getattr(running, f.name), getattr(other, f.name)
        if mine != theirs:
            raise ValueError(
                f"weights_path: {folder} is not the running model's architecture: "
                f"{f.name} is {theirs!r} there and {mine!r} in the running model"
            )
    return replace(running, path=folder)


def release_memory(device: str | torch.device) -> None:
    """Give freed memory back: collect reference cycles, empty CUDA's cache, trim glibc's heap."""
    gc.collect()
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    _malloc_trim()


def _malloc_trim() -> None:
    trim = cpu_native.libc_function("malloc_trim")  # glibc only (not musl, not macOS)
    if trim is not None:
        trim(0)


def run_rpc(target: object, method: str | Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
    """One rank's part of `collective_rpc`: `target.method(*args, **kwargs)` for a name, or
    `method(target, *args, **kwargs)` for a callable (vLLM's convention: the worker first)."""
    if isinstance(method, str):
        fn = getattr(target, method, None)
        if method.startswith("_") or not callable(fn):
            public = sorted(n for n in dir(target) if not n.startswith("_") and callable(getattr(target, n)))
            raise ValueError(f"method: {method!r} is not a method of the worker; allowed: {', '.join(public)}")
        return fn(*args, **kwargs)
    if not callable(method):
        raise ValueError(f"method: a method name or a callable, got {type(method).__name__}")
    return method(target, *args, **kwargs)
