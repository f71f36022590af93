"""config.json of a model served through the Transformers modeling backend, read by transformers.

With `model_impl="transformers"` (or `"auto"` and an architecture triollm has no native class
for), transformers' own config class reads config.json: its defaults and attribute names
(`n_layer`, `n_head`, ...) are the ones its modeling code computes with. `parse_transformers_config`
takes from it only what the engine itself sizes or checks: the KV cache's layers, KV heads and
head size, the vocabulary, the context length, the dtype. Everything else (norms, biases,
activations, RoPE scaling, soft-capping) stays transformers' business
(engine/execution/models/transformers_backend.py).

Refused here, naming the field: an architecture the installed transformers does not ship as a
causal LM, encoder-decoder models, `layer_types` other than full, sliding and chunked attention
(linear attention, Mamba, short convolutions: what a paged KV cache alone cannot hold), chunked
layers without a positive `attention_chunk_size`,
RoPE settings rope_config.py does not know or that transformers recomputes per forward call
(dynamic NTK past max_position_embeddings, rope_config's module note). What only the built model
shows (a recurrent mixer, cross-attention, a model whose attention bypasses
transformers' attention interface) is refused when the model is built, naming the layer's class.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from triollm.engine.loading.rope_config import RopeConfig, parse_rope

__all__ = ["PAGED_LAYER_TYPES", "hf_text_config", "import_transformers", "parse_transformers_config"]

PAGED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


_ROOT = Path(__file__).resolve().parents[2]  # triollm's package root: a checkout's root


def import_transformers() -> Any:
    """transformers, its hub-kernels integration imported with the `kernels` package installed
    beside it (Hugging Face's, a dependency since transformers 5.25). Run from a triollm checkout
    (tests, scripts), the current directory is the checkout's root, which is the triollm package
    itself (`package-dir = {"triollm" = "."}`), so a bare `import kernels` would find triollm's own
    kernels/ and a model class's import fail ("cannot import name 'CUDAProperties' from
    'kernels'"). Once the hub's `kernels` is in sys.modules, later imports take it from there;
    triollm's own is always imported as `triollm.kernels`."""
    import transformers

    if "kernels" not in sys.modules:
        saved = sys.path[:]
        sys.path[:] = [p for p in saved if Path(p or ".").resolve() != _ROOT]
        try:
            import transformers.integrations.hub_kernels  # noqa: F401  (imports the hub's `kernels`)
        finally:
            sys.path[:] = saved
    return transformers


def hf_text_config(hf: Mapping[str, Any], arch: str | None = None) -> Any:
    """transformers' config object for config.json `hf` (its text config, for a multimodal one);
    without `model_type`, that of `arch`'s config class."""
    transformers = import_transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = hf.get("model_type")
    if model_type is None and arch is not None and hasattr(transformers, arch):
        model_type = getattr(transformers, arch).config_class.model_type
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"model_type: {model_type!r} is not a model type the installed transformers "
            f"({transformers.__version__}) knows; the Transformers backend needs one"
        )
    cfg = CONFIG_MAPPING[model_type].from_dict(dict(hf))
    return cfg.get_text_config()


def parse_transformers_config(hf: Mapping[str, Any], arch: str) -> dict[str, Any]:
    """The `HfConfig` fields (hf_config.py) of a backend model; a ValueError naming what it cannot page."""
    transformers = import_transformers()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    if arch not in causal or not hasattr(transformers, arch):
        raise ValueError(
            f"architectures: {arch!r} is not a causal language model the installed transformers "
            f"({transformers.__version__}) ships; the Transformers backend runs *ForCausalLM / *LMHeadModel classes"
        )
    expected = getattr(transformers, arch).config_class.model_type
    if hf.get("model_type", expected) != expected:
        raise ValueError(
            f"architectures: {arch!r} needs model_type {expected!r}, config.json says {hf.get('model_type')!r}"
        )
    cfg = hf_text_config(hf, arch)
    if getattr(cfg, "is_encoder_decoder", False):
        raise ValueError(
            f"is_encoder_decoder: {arch} is an encoder-decoder model; the Transformers backend pages decoder-only "
            f"self-attention (allowed: false)"
        )
    num_layers = _positive_int(cfg, "num_hidden_layers")
    layer_types = getattr(cfg, "layer_types", None) or []
    unpaged = sorted({str(t) for t in layer_types if t not in PAGED_LAYER_TYPES})
    if unpaged:
        raise ValueError(
            f"layer_types: {', '.join(map(repr, unpaged))} layers cannot be paged by the Transformers backend "
            f"(recurrent state or convolutions); allowed: {', '.join(PAGED_LAYER_TYPES)}"
        )
    if "chunked_attention" in layer_types:
        chunk = getattr(cfg, "attention_chunk_size", None)
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(
                f"attention_chunk_size: {chunk!r} for 'chunked_attention' layers; allowed: an integer >= 1"
            )
    hidden = _positive_int(cfg, "hidden_size")
    num_heads = _positive_int(cfg, "num_attention_heads")
    num_kv_heads = getattr(cfg, "num_key_value_heads", None) or num_heads
    if not isinstance(num_kv_heads, int) or num_heads % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads: {num_kv_heads!r} does not divide num_attention_heads {num_heads}; allowed: a "
            f"divisor of {num_heads}"
        )
    head_dim = getattr(cfg, "head_dim", None)
    if getattr(cfg, "kv_lora_rank", None) and getattr(cfg, "qk_nope_head_dim", None) is not None:
        # Multi-head latent attention (DeepSeek V2/V3) as transformers computes it: k and v
        # expanded to every head, k of qk_nope + qk_rope, v of v_head_dim (the narrower padded).
        num_kv_heads = num_heads
        head_dim = max(int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim), int(cfg.v_head_dim))
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(
                f"num_attention_heads: {num_heads} does not divide hidden_size {hidden} (and the config gives no "
                f"head_dim); allowed: a divisor of {hidden}"
            )
        head_dim = hidden // num_heads
    max_pos = getattr(cfg, "max_position_embeddings", None)
    if not isinstance(max_pos, int) or max_pos < 1:
        raise ValueError(f"max_position_embeddings: expected an integer >= 1, got {max_pos!r}")
    vocab = _positive_int(cfg, "vocab_size")
    return {
        "hidden_size": hidden,
        "intermediate_size": getattr(cfg, "intermediate_size", None) or 4 * hidden,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": int(head_dim),
        "vocab_size": vocab,
        "rms_norm_eps": 1e-6,  # unused: transformers' norms run
        "rope": _rope(hf, max_pos),
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": bool(getattr(cfg, "tie_word_embeddings", False)),
        "qkv_bias": False,
        "o_proj_bias": False,
        "mlp_bias": False,
        # Windows are applied by the attention kernels from what the HF module passes
        # (`sliding_window`); the KV blocks of every layer stay, as for full attention.
        "sliding_window": None,
        "encoder": None,
    }


def _rope(hf: Mapping[str, Any], max_pos: int) -> RopeConfig:
    """The RoPE settings, checked as for a native model (the module note); those of the full
    attention layers where the config has one dict per layer type."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping) and params and all(isinstance(v, Mapping) for v in params.values()):
        ropes = {t: parse_rope(hf, max_pos, allow_partial=True, layer_type=t) for t in params}
        return ropes.get("full_attention") or next(iter(ropes.values()))
    return parse_rope(hf, max_pos, allow_partial=True)


def _positive_int(cfg: Any, key: str) -> int:
    value = getattr(cfg, key, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}: expected an integer >= 1, got {value!r}")
    return value
