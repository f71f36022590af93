"""PEFT LoRA checkpoints: `adapter_config.json` + `adapter_model.safetensors`, read and checked.

What is honoured: `r`, `lora_alpha`, `use_rslora` (scale alpha / sqrt(r), else alpha / r),
`target_modules` (a list of module names, as PEFT writes them: q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj, down_proj; a regex string or "all-linear" resolves against those names) and
`bias: "none"`. Everything else that would change the numbers is refused at load, naming the
field: DoRA (`use_dora`), `modules_to_save`, LoRA on embeddings or the head, `lora_bias`, per-module
ranks or alphas (`rank_pattern`, `alpha_pattern`), `layers_to_transform`, `fan_in_fan_out`
(GPT-2's Conv1D layout), `layer_replication`, `target_parameters` (LoRA on raw parameters, such
as MoE experts), activated LoRA (`alora_invocation_tokens`), `arrow_config`. Fields that only
matter for training or initialisation (`lora_dropout`, `init_lora_weights`, `loftq_config`,
`eva_config`, `task_type`) are ignored; `exclude_modules` needs nothing: the file holds the
tensors of the modules that have them.

`read_adapter_config` reads the config (one small JSON file, at most 1 MiB); `read_adapter_weights`
the tensors, keyed by (layer index, module name), each A `[r, in]` and B `[out, r]` as PEFT stores
them, every one checked from the file's header before its data is read (a LoRA A/B of a target
module, of rank r, of the base model's shape when `projections` is given: lora/shapes.py) and
then read whole (a float type, finite). `check_adapter_weights` runs the same checks keeping one
tensor at a time. Both sides use them: the frontend when an adapter is loaded or first used
(engine/frontend/lora.py: a 400 naming the file, before anything reaches the engine core), and
the engine core when it reads the adapter into a slot (lora/manager.py: the file may have changed).
Errors are `ValueError`s that name the adapter's path, the file and the field or tensor.

A path that is not an adapter gets one answer, whatever the reason: missing, not a directory,
unreadable, or a directory without `adapter_config.json` (`not_an_adapter`). The runtime load
route takes paths from clients, and distinct answers would tell them which server paths exist.
A relative path that is a directory is read as one; anything else that looks like a Hub repo id
is looked up on the Hub (as vLLM does), whether or not a file of that name exists.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "CONFIG_FILE",
    "LORA_MODULES",
    "WEIGHTS_FILE",
    "AdapterConfig",
    "check_adapter_weights",
    "not_an_adapter",
    "read_adapter_config",
    "read_adapter_weights",
    "resolve_adapter_path",
]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: the attention's and the gated MLP's.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MAX_CONFIG_BYTES = 1 << 20  # adapter_config.json: PEFT writes about 1 KB
# Fields whose non-default values change what the adapter computes and are not implemented.
_REFUSED: dict[str, tuple[object, ...]] = {
    "use_dora": (False, None),
    "modules_to_save": (None, []),
    "lora_bias": (False, None),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "layers_to_transform": (None, []),
    "layers_pattern": (None, [], ""),
    "fan_in_fan_out": (False, None),
    "trainable_token_indices": (None, {}, []),
    "use_qalora": (False, None),
    "layer_replication": (None, []),
    "target_parameters": (None, []),
    "use_bdlora": (False, None),
    "alora_invocation_tokens": (None, []),
    "arrow_config": (None,),
}
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    path: Path  # the adapter's directory
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]  # of LORA_MODULES
    base_model_name: str | None

    @property
    def scaling(self) -> float:
        """What PEFT multiplies `x A^T B^T` by."""
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def not_an_adapter(path: str | Path, field: str = "lora_path") -> ValueError:
    """The one answer for a path that is not an adapter, whatever the reason (module note)."""
    return ValueError(
        f"{field}: {str(path)!r} is not a LoRA adapter directory (it needs {CONFIG_FILE} and {WEIGHTS_FILE})"
    )


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # EACCES on a parent: Path.is_dir lets it out
        return False


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:
        return False


def resolve_adapter_path(path: str, field: str = "lora_path") -> Path:
    """A local directory as given, or a Hub repo id's snapshot (the cache first, then a download
    unless HF_HUB_OFFLINE is set)."""
    local = Path(path).expanduser()
    if _is_dir(local):
        return local
    import huggingface_hub
    from huggingface_hub import constants, errors
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        raise not_an_adapter(path, field) from None

    patterns = [CONFIG_FILE, WEIGHTS_FILE]
    try:
        return Path(huggingface_hub.snapshot_download(path, allow_patterns=patterns, local_files_only=True))
    except errors.LocalEntryNotFoundError:
        if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in constants.ENV_VARS_TRUE_VALUES:
            raise ValueError(
                f"{field}: {path!r} is not a local directory nor in the Hugging Face cache, and HF_HUB_OFFLINE is set"
            ) from None
    try:
        return Path(huggingface_hub.snapshot_download(path, allow_patterns=patterns))
    except OSError as exc:
        raise ValueError(f"{field}: {path!r} is not a local directory and its download failed: {exc}") from None


def read_adapter_config(
    path: str | Path, *, max_lora_rank: int | None = None, field: str = "lora_path"
) -> AdapterConfig:
    """The adapter's checked config; `ValueError` naming the path and the field otherwise."""
    root = resolve_adapter_path(str(path), field)
    where = f"{field}: {str(path)!r}"
    cfg_file = root / CONFIG_FILE
    if not _is_file(cfg_file):
        raise not_an_adapter(path, field)
    try:
        with cfg_file.open("rb") as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
    except OSError:
        raise not_an_adapter(path, field) from None
    if len(data) > _MAX_CONFIG_BYTES:
        raise ValueError(f"{where}: {CONFIG_FILE} is over {_MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, a 5,000-digit int
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    where = f"{where}: {CONFIG_FILE}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must hold a JSON object")
    if not _is_file(root / WEIGHTS_FILE):
        extra = (
            " (a pickled adapter_model.bin is not loaded: save it with safe_serialization=True)"
            if (root / "adapter_model.bin").exists()
            else ""
        )
        raise ValueError(f"{field}: {str(path)!r} has no {WEIGHTS_FILE}{extra}")
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type {peft_type!r} is not supported; allowed: 'LORA'")
    rank = raw.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if max_lora_rank is not None and rank > max_lora_rank:
        raise ValueError(f"{where}: r={rank} is above max_lora_rank={max_lora_rank} (raise --max-lora-rank)")
    alpha = raw.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    rslora = raw.get("use_rslora", False)
    if not isinstance(rslora, bool):
        raise ValueError(f"{where}: use_rslora must be true or false, got {rslora!r}")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise ValueError(f"{where}: bias {bias!r} is not supported; allowed: 'none'")
    for name, defaults in _REFUSED.items():
        value = raw.get(name)
        if value is not None and value not in defaults:
            raise ValueError(f"{where}: {name}={value!r} is not supported (it changes what the adapter computes)")
    base = raw.get("base_model_name_or_path")
    return AdapterConfig(
        root,
        rank,
        float(alpha),
        rslora,
        _targets(raw.get("target_modules"), where),
        base if isinstance(base, str) else None,
    )


def _targets(value: object, where: str) -> tuple[str, ...]:
    if value == "all-linear":
        return LORA_MODULES
    if isinstance(value, str):  # PEFT: a regex matched against the full module name
        try:
            pattern = re.compile(value)
        except re.error as exc:
            raise ValueError(f"{where}: target_modules {value!r} is not a valid regex ({exc})") from None
        found = tuple(
            m
            for m in LORA_MODULES
            if pattern.fullmatch(f"model.layers.0.self_attn.{m}") or pattern.fullmatch(f"model.layers.0.mlp.{m}")
        )
        if not found:
            raise ValueError(f"{where}: target_modules {value!r} matches none of {', '.join(LORA_MODULES)}")
        return found
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{where}: target_modules must be a list of module names, got {value!r}")
    names = tuple(dict.fromkeys(v.rsplit(".", 1)[-1] for v in value))
    bad = [n for n in names if n not in LORA_MODULES]
    if bad:
        raise ValueError(
            f"{where}: target_modules {', '.join(bad)} not supported (embeddings, the head and other layers are not); "
            f"allowed: {', '.join(LORA_MODULES)}"
        )
    return names


def read_adapter_weights(
    config: AdapterConfig, num_layers: int, projections: Mapping[str, tuple[int, int]] | None = None
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A `[r, in]`, B `[out, r]`) in float32, checked against the config:
    every tensor a LoRA A/B of a target module in a layer below `num_layers`, of rank r, in
    pairs, of a float type and finite; and, with `projections` (module -> the base model's
    (inputs, outputs), unsharded: lora/shapes.py), of the model's shape."""
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for layer, module, ab, t in _tensors(config, num_layers, projections):
        pieces.setdefault((layer, module), {})[ab] = t
    _check_pairs(config, pieces)
    return {key: (ab["A"], ab["B"]) for key, ab in sorted(pieces.items())}


def check_adapter_weights(
    config: AdapterConfig, num_layers: int, projections: Mapping[str, tuple[int, int]] | None = None
) -> None:
    """`read_adapter_weights`' checks, holding one tensor at a time (the frontend's check)."""
    seen: dict[tuple[int, str], set[str]] = {}
    for layer, module, ab, _ in _tensors(config, num_layers, projections):
        seen.setdefault((layer, module), set()).add(ab)
    _check_pairs(config, seen)


def _tensors(
    config: AdapterConfig, num_layers: int, projections: Mapping[str, tuple[int, int]] | None
) -> Iterator[tuple[int, str, str, torch.Tensor]]:
    """Each tensor of the file, checked (the header's name and shape first, then its data), as
    (layer, module, "A" or "B", float32 tensor)."""
    from safetensors import SafetensorError, safe_open

    where = f"lora_path: {str(config.path)!r}: {WEIGHTS_FILE}"
    try:
        with safe_open(str(config.path / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                m = _KEY.match(key)
                if m is None:
                    raise ValueError(
                        f"{where}: tensor {key!r} is not a LoRA A/B of a decoder layer's projection (embedding and "
                        f"head LoRA are not supported)"
                    )
                layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
                if module not in config.target_modules:
                    raise ValueError(f"{where}: tensor {key!r} is for {module}, which is not in target_modules")
                if layer >= num_layers:
                    raise ValueError(f"{where}: tensor {key!r} is for layer {layer}; the model has {num_layers}")
                shape = tuple(f.get_slice(key).get_shape())
                if len(shape) != 2 or (shape[0] if ab == "A" else shape[1]) != config.rank:
                    raise ValueError(f"{where}: tensor {key!r} has shape {shape}, not rank r={config.rank}")
                if projections is not None and module in projections:
                    _check_shape(where, layer, module, ab, shape, projections[module])
                t = f.get_tensor(key)
                if not t.is_floating_point():
                    raise ValueError(f"{where}: tensor {key!r} is {t.dtype}, not a floating-point type")
                t = t.to(torch.float32)
                if not bool(torch.isfinite(t).all()):
                    raise ValueError(f"{where}: tensor {key!r} holds NaN or infinite values")
                yield layer, module, ab, t
    except (OSError, RuntimeError, SafetensorError) as exc:  # a truncated or foreign file
        raise ValueError(f"lora_path: {str(config.path)!r}: {WEIGHTS_FILE} could not be read ({exc})") from None


def _check_shape(where: str, layer: int, module: str, ab: str, shape: tuple[int, ...], io: tuple[int, int]) -> None:
    n_in, n_out = io
    name = f"tensor layers.{layer}.{module}.lora_{ab} has shape {shape}; the model's {module}"
    if ab == "A" and shape[1] != n_in:
        raise ValueError(f"{where}: {name} takes {n_in} inputs")
    if ab == "B" and shape[0] != n_out:
        raise ValueError(f"{where}: {name} has {n_out} outputs")


def _check_pairs(config: AdapterConfig, pieces: Mapping[tuple[int, str], Collection[str]]) -> None:
    where = f"lora_path: {str(config.path)!r}: {WEIGHTS_FILE}"
    if not pieces:
        raise ValueError(f"{where} holds no LoRA tensors")
    for (layer, module), ab in sorted(pieces.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(sorted(ab))} without its pair")
