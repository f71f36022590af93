"""How a pooling model turns hidden states into one vector: read once from the model directory.

sentence-transformers checkpoints say it in files next to config.json: `modules.json` lists the
pipeline (Transformer, Pooling, optionally Normalize), the Pooling module's `config.json`
(`1_Pooling/config.json`) picks the pooling (`pooling_mode_mean_tokens`, `_cls_token`,
`_lasttoken`), and `sentence_bert_config.json` gives `max_seq_length`, the length the model was
trained to embed (it becomes the default `max_model_len`). Without these files a BERT checkpoint
is pooled as vLLM pools it by default: the [CLS] token (a decoder: the last token), normalised.

A sequence classifier (`*ForSequenceClassification`: a cross-encoder reranker, a classifier)
has `num_labels` outputs (`id2label`'s length, or one per `classifier_from_token` token: vLLM's
convention for a causal LM read as a classifier, where two tokens make one label) and an
activation applied to its logits, found as sentence-transformers' CrossEncoder finds it:
`activation_fn` in config_sentence_transformers.json or under config.json's
`sentence_transformers`, else the legacy `sbert_ce_default_activation_function`; without any,
sigmoid for one label and softmax for several (vLLM's classify default; CrossEncoder.predict
leaves several labels' logits as they are).

vLLM's `convert` serves a generative `*ForCausalLM` checkpoint as a pooling model
(`resolve_convert`, called as the runner is chosen): "embed" pools its last hidden states (the
last token, normalised, unless sentence-transformers files say otherwise), "classify" reads a
`score.weight` head at the last token (or makes one from the LM head: `classifier_from_token`
with vLLM's `method`, "from_2_way_softmax" - one label, the second token's logit minus the
first's - or "no_post_processing" - one label per token), "reward" returns every token's hidden
state as its reward (vLLM's `as_reward_model`, pooling task "token_classify"), through softmax
over the last dimension unless a request sets `use_activation=False` (vLLM's default classifier
activation on a head-less reward model). "auto" picks "embed" for `--runner pooling` on a causal
LM, as vLLM does.

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

__all__ = [
    "CONVERTS",
    "POOLING_TYPES",
    "SEQ_CLS_METHODS",
    "PoolerConfig",
    "PoolingType",
    "read_pooler_config",
    "resolve_convert",
]

PoolingType = Literal["MEAN", "CLS", "LAST"]
POOLING_TYPES: tuple[PoolingType, ...] = ("MEAN", "CLS", "LAST")
CONVERTS = ("auto", "none", "embed", "classify", "reward")  # vLLM's --convert
# vLLM's `method` for a classifier made from a causal LM's head (`classifier_from_token`).
SEQ_CLS_METHODS = ("from_2_way_softmax", "no_post_processing")
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
# A classifier's activations, by the torch module class sentence-transformers names.
ACTIVATIONS = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.Softmax": "softmax",
    "torch.nn.modules.activation.Tanh": "tanh",
    "torch.nn.modules.linear.Identity": "identity",
}
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
    # A sequence classifier's labels (None: an embedding model) and its activation: one of
    # "sigmoid", "softmax", "tanh", "identity".
    num_labels: int | None = None
    id2label: tuple[str, ...] = ()
    activation: str = "identity"
    # vLLM's `classifier_from_token`: a decoder classifier whose head is made from these tokens'
    # rows of the LM head; `two_way` (vLLM's method "from_2_way_softmax"): two tokens make one
    # label, the second's logit minus the first's.
    classifier_from_token: tuple[str, ...] = ()
    two_way: bool = False
    # A causal LM served as a reward model (`convert="reward"`): every token's hidden state,
    # through `activation`.
    reward: bool = False

    @property
    def tasks(self) -> tuple[str, ...]:
        """The pooling tasks this model serves (vLLM's names)."""
        if self.reward:
            return ("token_classify",)
        if self.num_labels is None:
            return ("embed", "token_embed")
        return ("classify", "score") if self.num_labels == 1 else ("classify",)


def resolve_convert(architecture: str, native: str | None, runner: str, convert: str) -> tuple[str, str]:
    """vLLM's `--runner` with `--convert`: (the runner type, the conversion: "none", "embed",
    "classify" or "reward"). `native`: what the architecture is without conversion ("embed" or
    "classify" for a pooling model, None for a generative one). A conversion needs the pooling
    runner ("auto" becomes it); a pooling model is not converted (its own kind, "auto" and "none"
    are accepted); a generative model on the pooling runner is converted ("auto": "embed")."""
    if convert not in CONVERTS:
        raise ValueError(f"convert: {convert!r} is not one of {', '.join(CONVERTS)}")
    converts = convert not in ("auto", "none")
    if runner == "auto":
        runner = "pooling" if native is not None or converts else "generate"
    if runner == "generate" and converts:
        raise ValueError(
            f"convert: {convert!r} makes {architecture} a pooling model, which runner 'generate' does not "
            "serve; use runner 'pooling' (or 'auto'), or convert 'none'"
        )
    if runner != "pooling" or native is not None:
        if converts and convert != native:
            raise ValueError(
                f"convert: {architecture} is already a pooling model ({native}); allowed: auto, none, {native}"
            )
        return runner, "none"
    if convert == "none":
        raise ValueError(
            f"convert: 'none' leaves {architecture} a generative model, which runner 'pooling' does not serve; "
            "allowed: auto, embed, classify, reward"
        )
    return runner, "embed" if convert == "auto" else convert


def read_pooler_config(
    path: Path,
    hf: Mapping[str, Any],
    *,
    classifier: bool = False,
    reward: bool = False,
    default_pooling: PoolingType = "CLS",
) -> PoolerConfig:
    """The pooling of the model in directory `path` (`hf`: its config.json); `classifier`: the
    checkpoint is a sequence classifier (its labels and activation are read too); `reward`: a
    causal LM read as a reward model (per-token outputs, softmax); `default_pooling`: without
    sentence-transformers files ("LAST" for decoders, as vLLM)."""
    modules = _read_json(path / "modules.json")
    pooling_type: PoolingType = default_pooling
    normalize = True
    if isinstance(modules, list):
        types = [m.get("type") for m in modules if isinstance(m, dict)]
        normalize = _NORMALIZE_MODULE in types
        for module in modules:
            if isinstance(module, dict) and module.get("type") == _POOLING_MODULE:
                pooling_type = _pooling_type(path / str(module.get("path", "")) / "config.json", default_pooling)
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
    from_token, method = _from_token(hf) if classifier else ((), None)
    labels = _labels(hf, from_token, method) if classifier else None
    return PoolerConfig(
        pooling_type=pooling_type,
        normalize=normalize and not (classifier or reward),
        max_seq_length=max_seq_length,
        is_matryoshka=bool(hf.get("is_matryoshka")) or dims is not None,
        matryoshka_dimensions=None if dims is None else tuple(dims),
        num_labels=None if labels is None else len(labels),
        id2label=labels or (),
        activation=_activation(path, hf, len(labels)) if labels else ("softmax" if reward else "identity"),
        classifier_from_token=from_token,
        two_way=method == "from_2_way_softmax",
        reward=reward,
    )


def _from_token(hf: Mapping[str, Any]) -> tuple[tuple[str, ...], str | None]:
    """`classifier_from_token` and vLLM's `method` (None: not given; two tokens are then read
    as "from_2_way_softmax", other counts as "no_post_processing")."""
    tokens, method = hf.get("classifier_from_token"), hf.get("method")
    if method is not None and method not in SEQ_CLS_METHODS:
        raise ValueError(f"method: {method!r} is not one of {', '.join(SEQ_CLS_METHODS)}")
    if tokens is None:
        if method is not None:
            raise ValueError(f"method: {method!r} makes the score head from classifier_from_token, which is not set")
        return (), None
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ValueError(f"classifier_from_token: expected a non-empty list of token strings, got {tokens!r:.80}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ValueError(f"classifier_from_token: method 'from_2_way_softmax' needs two tokens, got {len(tokens)}")
    if method is None:
        method = "from_2_way_softmax" if len(tokens) == 2 else "no_post_processing"
    return tuple(tokens), method


def _labels(hf: Mapping[str, Any], from_token: tuple[str, ...], method: str | None) -> tuple[str, ...]:
    """The label names in index order: one per `classifier_from_token` token (one for a pair
    under "from_2_way_softmax", the second's score), else `id2label`, else `num_labels`
    (transformers' default: 2)."""
    if from_token:
        return (from_token[1],) if method == "from_2_way_softmax" else from_token
    id2label = hf.get("id2label")
    if id2label is None:
        n = hf.get("num_labels", 2)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_labels: expected a positive integer, got {n!r}")
        return tuple(f"LABEL_{i}" for i in range(n))
    if not isinstance(id2label, dict) or not id2label:
        raise ValueError(f"id2label: expected an object of label names by index, got {id2label!r:.80}")
    by_index = {str(k): str(v) for k, v in id2label.items()}
    if set(by_index) != {str(i) for i in range(len(by_index))}:
        raise ValueError(f"id2label: expected the indices 0 to {len(by_index) - 1}, got {sorted(by_index)!r:.80}")
    return tuple(by_index[str(i)] for i in range(len(by_index)))


def _activation(path: Path, hf: Mapping[str, Any], num_labels: int) -> str:
    st = _read_json(path / "config_sentence_transformers.json")
    embedded = hf.get("sentence_transformers")
    name, field = None, "activation_fn"
    if isinstance(st, dict) and st.get("activation_fn") is not None:
        name = st["activation_fn"]
    elif isinstance(embedded, dict) and embedded.get("activation_fn") is not None:
        name = embedded["activation_fn"]
    elif hf.get("sbert_ce_default_activation_function") is not None:
        name, field = hf["sbert_ce_default_activation_function"], "sbert_ce_default_activation_function"
    if name is None:
        return "sigmoid" if num_labels == 1 else "softmax"
    if name not in ACTIVATIONS:
        raise ValueError(f"{field}: {name!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _pooling_type(config_file: Path, default: PoolingType) -> PoolingType:
    cfg = _read_json(config_file)
    if not isinstance(cfg, dict):
        return default
    for key in _UNSUPPORTED_MODES:
        if cfg.get(key):
            raise ValueError(f"{key}: this pooling is not supported; supported: mean, cls and last-token pooling")
    chosen = [kind for key, kind in _ST_MODES.items() if cfg.get(key)]
    if len(chosen) > 1:
        raise ValueError(
            f"{config_file.parent.name}/config.json: several pooling modes at once ({', '.join(chosen)}) are not "
            f"supported"
        )
    return chosen[0] if chosen else default


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path.name}: not valid JSON ({exc})") from None
