"""`ModelShapes`: what an adapter must fit, the base model's layers and the size of each
projection it may target; `check` and `read` hold an adapter against them.

One computation serves both checks, so they cannot disagree: the frontend's, when an adapter is
loaded or first used (engine/frontend/lora.py `LoRAChecker`: a refused adapter is a 400 naming
the file, and nothing is loaded), and the engine core's, when it reads the adapter into a slot
(lora/manager.py, which checks again because the file may have changed since). The sizes are
unsharded, as the checkpoint holds them: each rank's manager takes its own share afterwards.

The modules an adapter may target are the attention's and the gated MLP's (`LORA_MODULES`),
those that every layer has: in a mixture-of-experts model whose layers route to experts, the
MLP is the experts, and LoRA on them is refused. The core passes the modules its model really
has (`lora_able`), the frontend takes them from the config; for every decoder family here the
two are the same.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from triollm.lora.peft import LORA_MODULES, AdapterConfig, check_adapter_weights, read_adapter_weights

__all__ = ["ATTENTION_MODULES", "BaseModelConfig", "ModelShapes", "lora_able_modules"]

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


class BaseModelConfig(Protocol):
    """The `ModelConfig` fields the shapes come from (engine/loading/model_config.py; named by
    a Protocol because lora/ sits below engine/)."""

    @property
    def num_layers(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def num_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def moe(self) -> Any: ...  # None, or routed experts in the layers its `sparse_layers` marks


@dataclass(frozen=True)
class ModelShapes:
    num_layers: int
    # module -> (inputs, outputs), unsharded: the modules every layer has, an adapter may target.
    projections: Mapping[str, tuple[int, int]]
    experts: bool  # some layers' MLP is routed experts (why an MLP module is missing)

    @classmethod
    def of(cls, cfg: BaseModelConfig, lora_able: Collection[str] | None = None) -> ModelShapes:
        """The shapes of the model `cfg` describes; `lora_able`: the modules every layer of the
        built model has (None: as the config says)."""
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        h, i = cfg.hidden_size, cfg.intermediate_size
        every = {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }  # fmt: skip
        experts = cfg.moe is not None and any(cfg.moe.sparse_layers)
        if lora_able is None:
            lora_able = ATTENTION_MODULES if experts else LORA_MODULES
        return cls(cfg.num_layers, {m: every[m] for m in LORA_MODULES if m in lora_able}, experts)

    def check_targets(self, config: AdapterConfig) -> None:
        """Every target module of the adapter is one the model has; `ValueError` otherwise."""
        missing = [m for m in config.target_modules if m not in self.projections]
        if missing:
            moe = self.experts and any(m not in ATTENTION_MODULES for m in missing)
            why = (
                "LoRA on a mixture-of-experts MLP's experts is not supported"
                if moe
                else "this model has no such LoRA-able projection"
            )
            raise ValueError(f"lora_path: {str(config.path)!r}: target_modules {', '.join(missing)}: {why}")

    def check(self, config: AdapterConfig) -> None:
        """The adapter's targets and every tensor (readable, of the model's shapes), one tensor
        held at a time; `ValueError` naming the path, the file and the tensor otherwise."""
        self.check_targets(config)
        check_adapter_weights(config, self.num_layers, self.projections)

    def read(self, config: AdapterConfig) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
        """`check`, keeping the tensors: (layer, module) -> (A `[r, in]`, B `[out, r]`), float32."""
        self.check_targets(config)
        return read_adapter_weights(config, self.num_layers, self.projections)


def lora_able_modules(targets: Iterable[tuple[int, str]], num_layers: int) -> tuple[str, ...]:
    """The modules present in every one of `num_layers` layers, given (layer, module) pairs."""
    have = set(targets)
    return tuple(m for m in LORA_MODULES if all((i, m) in have for i in range(num_layers)))
