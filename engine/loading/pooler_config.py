"""How a pooling model turns hidden states into one vector: read once from the model directory.

sentence-transformers checkpoints say it in files next to config.json: `modules.json` lists the
pipeline (Transformer, Pooling, optionally Normalize), the Pooling module's `config.json`
(`1_Pooling/config.json`) picks the pooling (`pooling_mode_mean_tokens`, `_cls_token`,
`_lasttoken`), and `sentence_bert_config.json` gives `max_seq_length`, the length the model was
trained to embed (it becomes the default `max_model_len`). Without these files a BERT checkpoint
is pooled as vLLM pools it by default: the [CLS] token, normalised.

Matryoshka models (trained so that a prefix of the vector is an embedding too) say so in
config.json with `is_matryoshka` or `matryoshka_dimensions`, as vLLM reads them; only they accept
`dimensions`. Pooling modes this engine does not compute (max, mean-sqrt-len, weighted mean) are
a `ValueError` naming the field, never approximated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = ["POOLING_TYPES", "PoolerConfig", "PoolingType", "read_pooler_config"]

PoolingType = Literal["MEAN", "CLS", "LAST"]
POOLING_TYPES: tuple[PoolingType, ...] = ("MEAN", "CLS", "LAST")
_ST_MODES: dict[str, PoolingType] = {
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_lasttoken": "LAST",
}
_UNSUPPORTED_MODES = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)
_NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
_POOLING_MODULE = "sentence_transformers.models.Pooling"


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: PoolingType
    normalize: bool  # L2-normalise embeddings unless a request says otherwise
    # sentence_bert_config.json's max_seq_length: the default max_model_len (None: not given).
    max_seq_length: int | None = None
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None  # None: any prefix length


def read_pooler_config(path: Path, hf: Mapping[str, Any]) -> PoolerConfig:
    """The pooling of the model in directory `path` (`hf`: its config.json)."""
    modules = _read_json(path / "modules.json")
    pooling_type: PoolingType = "CLS"
    normalize = True
    if isinstance(modules, list):
        types = [m.get("type") for m in modules if isinstance(m, dict)]
        normalize = _NORMALIZE_MODULE in types
        for module in modules:
            if isinstance(module, dict) and module.get("type") == _POOLING_MODULE:
                pooling_type = _pooling_type(path / str(module.get("path", "")) / "config.json")
    elif modules is not None:
        raise ValueError("modules.json: expected a list of modules")
    sbert = _read_json(path / "sentence_bert_config.json")
    max_seq_length = sbert.get("max_seq_length") if isinstance(sbert, dict) else None
    if max_seq_length is not None and (
        isinstance(max_seq_length, bool) or not isinstance(max_seq_length, int) or max_seq_length <= 0
    ):
        raise ValueError(
            f"max_seq_length: expected a positive integer in sentence_bert_config.json, got {max_seq_length!r}"
        )
    dims = hf.get("matryoshka_dimensions")
    if dims is not None and (not isinstance(dims, list) or not all(isinstance(d, int) and d > 0 for d in dims)):
        raise ValueError(f"matryoshka_dimensions: expected a list of positive integers, got {dims!r}")
    return PoolerConfig(
        pooling_type=pooling_type,
        normalize=normalize,
        max_seq_length=max_seq_length,
        is_matryoshka=bool(hf.get("is_matryoshka")) or dims is not None,
        matryoshka_dimensions=None if dims is None else tuple(dims),
    )


def _pooling_type(config_file: Path) -> PoolingType:
    cfg = _read_json(config_file)
    if not isinstance(cfg, dict):
        return "CLS"
    for key in _UNSUPPORTED_MODES:
        if cfg.get(key):
            raise ValueError(f"{key}: this pooling is not supported; supported: mean, cls and last-token pooling")
    chosen = [kind for key, kind in _ST_MODES.items() if cfg.get(key)]
    if len(chosen) > 1:
        raise ValueError(
            f"{config_file.parent.name}/config.json: several pooling modes at once ({', '.join(chosen)}) are not "
            f"supported"
        )
    return chosen[0] if chosen else "CLS"


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.name}: not valid JSON ({exc})") from None
