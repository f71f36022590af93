"""The environment variables triollm's engine reads: each one typed, read in this module only.

Every knob a user sets is an `EngineArgs` field and a CLI flag; the variables below are the few
that are not (overrides for tests and A/B runs, and other libraries' conventions). Each is read
by a function here when the engine starts (`create_engine_config`, the model's resolution, the
tensor-parallel group), never at import, so a test's `monkeypatch.setenv` before building an
engine is seen, and never per step.

| variable | read by | meaning |
| --- | --- | --- |
| `TRIOLLM_MULTIPROCESS` | `multiprocess()` | 0/1: the engine core in a child process (default 1) |
| `TRIOLLM_CACHE_DIR` | `cache_dir()` | where imported .gguf models are cached |
| `XDG_CACHE_HOME` | `cache_dir()` | its default's parent (`~/.cache`) |
| `HF_HUB_OFFLINE` | `hf_hub_offline()` | no Hub downloads (huggingface_hub's variable) |
| `GLOO_SOCKET_IFNAME` | `gloo_over_loopback()` | set, not read: gloo talks over `lo` |
| `TRIOLLM_KERNELS` | `kernels_choice()` | auto, triton or torch (kernels/envs.py) |
| `TRIOLLM_CPU_KERNELS` | `cpu_kernels_enabled()` | 0: no native CPU kernels (kernels/envs.py) |
| `TRIOLLM_CPU_ISA` | `forced_cpu_isa()` | force a quantized-kernel path (kernels/envs.py) |
| `VLLM_BATCH_INVARIANT` | `batch_invariant()` | 0/1: numbers independent of the batch (kernels/batch_invariant.py) |
| `VLLM_CPU_KVCACHE_SPACE` | `cpu_kvcache_space_bytes()` | GiB of KV cache on CPU (vLLM-CPU's; 0 or unset: measured) |
| `VLLM_TORCH_PROFILER_DIR` | `torch_profiler_dir()` | where `start_profile()` traces go (vLLM's; unset: no profiler) |
| `VLLM_IMAGE_FETCH_TIMEOUT` | `image_fetch_timeout()` | seconds to fetch one http(s) chat image (vLLM's; default 5) |

`VLLM_BATCH_INVARIANT` is vLLM's name (vLLM has no engine argument for it either); it is read
when the model runner is built (engine/execution/model_runner.py), in the engine core's process,
which inherits it. The three before it are read in `kernels/envs.py`, re-exported here: `kernels/` imports nothing above
it. A child process's environment is built where the child is started
(`engine/distributed/group.py`: the tensor-parallel workers get `OMP_NUM_THREADS`).

Not here: the frontend's own (`actors/`: the CURVE keys handed to the engine-core child,
`RAY_ADDRESS`; `api/`: the API keys) and `lora/peft.py`'s `HF_HUB_OFFLINE` (below `engine/`).
"""

from __future__ import annotations

import os
from pathlib import Path

from triollm.kernels.envs import (
    CPU_KERNELS_ENV,
    ISA_ENV,
    KERNELS_ENV,
    cpu_kernels_enabled,
    forced_cpu_isa,
    kernels_choice,
)

__all__ = [
    "BATCH_INVARIANT_ENV",
    "CACHE_DIR_ENV",
    "CPU_KVCACHE_SPACE_ENV",
    "CPU_KERNELS_ENV",
    "HF_HUB_OFFLINE_ENV",
    "IMAGE_FETCH_TIMEOUT_ENV",
    "ISA_ENV",
    "KERNELS_ENV",
    "MULTIPROCESS_ENV",
    "TORCH_PROFILER_DIR_ENV",
    "batch_invariant",
    "cache_dir",
    "cpu_kvcache_space_bytes",
    "cpu_kernels_enabled",
    "forced_cpu_isa",
    "gloo_over_loopback",
    "hf_hub_offline",
    "image_fetch_timeout",
    "kernels_choice",
    "multiprocess",
    "torch_profiler_dir",
]

MULTIPROCESS_ENV = "TRIOLLM_MULTIPROCESS"
CACHE_DIR_ENV = "TRIOLLM_CACHE_DIR"
HF_HUB_OFFLINE_ENV = "HF_HUB_OFFLINE"
BATCH_INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
CPU_KVCACHE_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
TORCH_PROFILER_DIR_ENV = "VLLM_TORCH_PROFILER_DIR"
IMAGE_FETCH_TIMEOUT_ENV = "VLLM_IMAGE_FETCH_TIMEOUT"


def multiprocess() -> bool | None:
    """$TRIOLLM_MULTIPROCESS: True for "1", False for "0", None when unset or empty (the
    `multiprocess` field decides, else True); anything else is a ValueError naming it."""
    env = os.environ.get(MULTIPROCESS_ENV, "")
    if env == "":
        return None
    if env not in ("0", "1"):
        raise ValueError(f"{MULTIPROCESS_ENV}: {env!r} is not 0 or 1")
    return env == "1"


def batch_invariant() -> bool:
    """$VLLM_BATCH_INVARIANT: True for "1", False for "0" or unset/empty; anything else is a
    ValueError naming it (vLLM reads only "1" as on; a typo here should not silently mean off)."""
    env = os.environ.get(BATCH_INVARIANT_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{BATCH_INVARIANT_ENV}: {env!r} is not 0 or 1")
    return env == "1"


def cpu_kvcache_space_bytes() -> int | None:
    """$VLLM_CPU_KVCACHE_SPACE, vLLM-CPU's KV cache size in GiB, in bytes; None when unset, empty
    or 0 (vLLM-CPU's "choose for me": the budget is measured). Anything but a non-negative number
    is a ValueError naming it."""
    env = os.environ.get(CPU_KVCACHE_SPACE_ENV, "").strip()
    try:
        gib = float(env) if env else 0.0
    except ValueError:
        gib = -1.0
    if not 0 <= gib < float("inf"):
        raise ValueError(f"{CPU_KVCACHE_SPACE_ENV}: {env!r} is not a number of GiB (0 or more; 0: measured)")
    return int(gib * 2**30) or None


def image_fetch_timeout() -> float:
    """$VLLM_IMAGE_FETCH_TIMEOUT: the seconds the API server gives one http(s) image URL of a chat
    message, connection to last byte (api/chat_images.py, read when a request has such a URL);
    5 when unset or empty. Anything but a finite number > 0 is a ValueError naming it."""
    env = os.environ.get(IMAGE_FETCH_TIMEOUT_ENV, "").strip()
    try:
        seconds = float(env) if env else 5.0
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise ValueError(f"{IMAGE_FETCH_TIMEOUT_ENV}: {env!r} is not a number of seconds (> 0)")
    return seconds


def torch_profiler_dir() -> Path | None:
    """$VLLM_TORCH_PROFILER_DIR: the folder `start_profile()`'s traces are written to (read when
    the engine core is built); None when unset or empty."""
    env = os.environ.get(TORCH_PROFILER_DIR_ENV, "").strip()
    return Path(env).expanduser() if env else None


def cache_dir() -> Path:
    """Where imported models are cached: `$TRIOLLM_CACHE_DIR`, else `$XDG_CACHE_HOME/triollm`,
    else `~/.cache/triollm`."""
    env = os.environ.get(CACHE_DIR_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "triollm"


def hf_hub_offline() -> bool:
    """`HF_HUB_OFFLINE` is set truthy now (huggingface_hub's spelling: 1, ON, YES, TRUE).
    huggingface_hub reads it once at its import; `engine/loading/hub.py` honours both."""
    from huggingface_hub import constants

    return os.environ.get(HF_HUB_OFFLINE_ENV, "").upper() in constants.ENV_VARS_TRUE_VALUES


def gloo_over_loopback() -> None:
    """Make gloo in this process use the loopback interface: the tensor-parallel ranks are
    processes of one machine, and the default (the hostname's interface) may not reach them."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
