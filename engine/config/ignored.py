"""vLLM arguments that change nothing in this engine: accepted so that scripts run, and logged
once per process, with the reason, when set to something other than their default."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from triollm.engine.loading.hub import is_hub_id

__all__ = ["IGNORED_ARGS", "ignored_args", "warn_ignored"]

log = logging.getLogger("triollm")

# Each is ignored whatever its value (`_SOMETIMES_IGNORED` join them in some cases).
IGNORED_ARGS: dict[str, str] = {
    "trust_remote_code": "no code from a checkpoint is ever run (Llama-family models are built in)",
    "skip_tokenizer_init": "the tokenizer is always loaded (outputs carry text)",
    "distributed_executor_backend": "tensor-parallel ranks are always processes the engine core "
    "starts (docs/scaling.md)",
    "disable_custom_all_reduce": "tensor-parallel all-reduces always go through gloo",
    "max_seq_len_to_capture": "CUDA graphs are captured per batch size and serve every context "
    "length",
    "cpu_offload_gb": "weights are not offloaded",
    "data_parallel_rpc_port": "dense models need no data parallel coordinator (ranks never "
    "synchronise)",
    "renderer_num_workers": "prompts are tokenized in the request's own task (large ones in a "
    "worker thread); there is no renderer pool",
    "async_scheduling": "the engine core has one scheduler, which plans each step as the previous "
    "one ends",
    "disable_cascade_attn": "there is no cascade attention to disable",
    "enable_expert_parallel": "there is no expert-parallel mode (MoE weights follow "
    "tensor_parallel_size)",
}
_SOMETIMES_IGNORED = {
    "gpu_memory_utilization": "it sizes the KV cache on CUDA only",
    "tokenizer_mode": "only fast tokenizers exist here: 'slow' loads the fast one (tokenizer.json)",
    # Hub options apply to a Hugging Face Hub repo id only (engine/loading/hub.py).
    "revision": "the model is a local directory or .gguf file, not a Hub repo id",
    "tokenizer_revision": "the tokenizer is not a Hub repo id (nor the model's, with tokenizer "
    "unset)",
    "download_dir": "neither model nor tokenizer is a Hub repo id (imported GGUF files are cached "
    "in cache_dir)",
    "hf_token": "neither model nor tokenizer is a Hub repo id",
}
_warned: set[str] = set()  # the names warned about in this process


class IgnoredArgs(Protocol):
    """The `EngineArgs` fields that decide whether a Hub option or a CUDA knob applies (the
    others are read by name)."""

    @property
    def model(self) -> str | None: ...
    @property
    def tokenizer(self) -> str | None: ...
    @property
    def tokenizer_mode(self) -> str: ...
    @property
    def gpu_memory_utilization(self) -> float: ...


def ignored_args(
    args: IgnoredArgs, defaults: Mapping[str, object], device: str
) -> tuple[str, ...]:
    """The fields set to a non-default value (`defaults`: `EngineArgs`'s, by field name) that
    have no effect on `device`."""
    names = [name for name in IGNORED_ARGS if getattr(args, name) != defaults[name]]
    if device != "cuda" and args.gpu_memory_utilization != defaults["gpu_memory_utilization"]:
        names.append("gpu_memory_utilization")
    if args.tokenizer_mode == "slow":
        names.append("tokenizer_mode")
    hub_model, hub_tokenizer = is_hub_id(args.model), is_hub_id(args.tokenizer)
    hub_used = {
        "revision": hub_model,
        "tokenizer_revision": hub_tokenizer or (hub_model and not args.tokenizer),
        "download_dir": hub_model or hub_tokenizer,
        "hf_token": hub_model or hub_tokenizer,
    }
    names += [
        name for name, used in hub_used.items() if not used and getattr(args, name) is not None
    ]
    return tuple(names)


def warn_ignored(args: object, names: Sequence[str]) -> None:
    """One warning per name per process, with the reason and the value `args` holds."""
    for name in names:
        if name in _warned:
            continue
        _warned.add(name)
        reason = IGNORED_ARGS.get(name) or _SOMETIMES_IGNORED[name]
        value = getattr(args, name)
        log.warning("%s=%r has no effect in triollm and is ignored: %s", name, value, reason)
