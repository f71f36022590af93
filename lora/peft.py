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

`read_adapter_config` is cheap (one small JSON file): the frontend calls it to refuse a bad
adapter at `add_request` / HTTP 400 time, before anything reaches the engine core.
`read_adapter_weights` reads the tensors (in the engine core, when the adapter is first used),
keyed by (layer index, module name), each A `[r, in]` and B `[out, r]` as PEFT stores them.
Errors are `ValueError`s that name the adapter's path and the field or tensor.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["LORA_MODULES", "AdapterConfig", "read_adapter_config", "read_adapter_weights", "resolve_adapter_path"]

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections an adapter may target: the attention's and the gated MLP's.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
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


def resolve_adapter_path(path: str, field: str = "lora_path") -> Path:
    """A local directory as given, or a Hub repo id's snapshot (the cache first, then a download
    unless HF_HUB_OFFLINE is set)."""
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    import huggingface_hub
    from huggingface_hub import constants, errors
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
        repo_id = not local.exists()
    except HFValidationError:
        repo_id = False
    if not repo_id:
        raise ValueError(
            f"{field}: {path!r} is not a LoRA adapter directory (it needs {CONFIG_FILE} and {WEIGHTS_FILE})"
        )

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
    if not cfg_file.is_file():
        raise ValueError(f"{where} has no {CONFIG_FILE}")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    if not (root / WEIGHTS_FILE).is_file():
        extra = (
            " (a pickled adapter_model.bin is not loaded: save it with safe_serialization=True)"
            if (root / "adapter_model.bin").exists()
            else ""
        )
        raise ValueError(f"{where} has no {WEIGHTS_FILE}{extra}")
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
    config: AdapterConfig, num_layers: int
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, module) -> (A `[r, in]`, B `[out, r]`) in float32, checked against the config:
    every tensor a LoRA A/B of a target module in a layer below `num_layers`, of rank r, in
    pairs. Shapes against the model are the loader's to check (it knows this rank's shard)."""
    from safetensors import SafetensorError, safe_open

    where = f"lora_path: {str(config.path)!r}"
    pieces: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
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
                t = f.get_tensor(key)
                if t.dim() != 2 or (t.shape[0] if ab == "A" else t.shape[1]) != config.rank:
                    raise ValueError(f"{where}: tensor {key!r} has shape {tuple(t.shape)}, not rank r={config.rank}")
                pieces.setdefault((layer, module), {})[ab] = t.to(torch.float32)
    except (OSError, RuntimeError, SafetensorError) as exc:  # a truncated or foreign file
        raise ValueError(f"{where}: {WEIGHTS_FILE} could not be read ({exc})") from None
    if not pieces:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA tensors")
    out = {}
    for (layer, module), ab in sorted(pieces.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        out[(layer, module)] = (ab["A"], ab["B"])
    return out
