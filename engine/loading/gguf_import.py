"""Import a llama-architecture GGUF file into a Hugging Face-format model directory.

A GGUF carries everything the engine needs, but under llama.cpp's names and layouts. This module
rewrites it once, into the files the rest of the engine already reads:

* `config.json` / `generation_config.json`: from the `llama.*`, `tokenizer.ggml.*` and
  `general.sampling.*` metadata.
* `model.safetensors` (float32): every tensor dequantized with `gguf.quants.dequantize`, renamed to
  the HF Llama names. llama.cpp's converter permutes the rows of Q and K so each head's rotary pairs
  are interleaved (GPT-J style); we permute them back to HF's half-split layout.
* `tokenizer.json` / `tokenizer_config.json`: a byte-level BPE rebuilt from the vocabulary and merges
  with the `tokenizers` library, with the pre-tokenizer llama.cpp's `tokenizer.ggml.pre` names.
* `gguf_quantized.safetensors` (QUANTIZED_FILE, for `quantization="gguf"`): the 2-D tensors in a
  block format the CPU kernels read, kept quantized (kernels/quant.py `QuantWeight.from_ggml`):
  Q4_0, Q4_1 and Q8_0 as shipped, the K-quants Q4_K, Q5_K and Q6_K mapped onto blocks of 32
  (kernels/kquants.py, with its error bounds). A mixed file (`Q4_K_M`: Q4_K, Q6_K and more) is one
  model; where the parts of a projection the model fuses (q|k|v, gate|up) differ in width, the
  4-bit parts are widened to 8-bit codes, exactly, so that each fused weight has one format.

GGUF lists tensor dimensions innermost first; the reader's arrays are already in numpy order
(rows = output features), so only quantized rows need reshaping after dequantization. Sentencepiece
(`tokenizer.ggml.model == "llama"`) vocabularies are not supported yet.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from triollm.engine.loading.model_config import QUANTIZED_FILE

if TYPE_CHECKING:
    from triollm.kernels.quant import QuantWeight

__all__ = ["IMPORT_FORMAT_VERSION", "import_gguf"]

# Bump whenever the files written here change, so cached imports are redone.
IMPORT_FORMAT_VERSION = 3  # 3: K-quants kept in QUANTIZED_FILE
# QUANTIZED_FILE (model_config.py) holds the quantized tensors as shipped (`quantization="gguf"`):
# kernels/quant.py's QuantWeight parts per HF tensor name ("<name>.q", ".d", ".m"), with the bits
# per name in the metadata.

_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ROPE_FREQS = "rope_freqs.weight"
# The projections the model runs as one fused weight (engine/execution/models/base.py STACKED).
_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))

# Pre-tokenizer split regexes, keyed by llama.cpp's `tokenizer.ggml.pre`.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_PRE = frozenset({"default", "gpt-2", "gpt2"})
_DIGIT_PRE = frozenset({"smollm", "starcoder", "refact", "codeshell"})
_LLAMA3_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3"})

_SPECIAL_TOKEN_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


class _Meta:
    """Typed access to a GGUF's key/value metadata."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._reader = reader
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"gguf: {self.path} lacks the metadata key {key!r}")
        return value


def import_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config, float32 safetensors weights and tokenizer files for `gguf_path` into `out_dir`."""
    meta, tensors = _open(gguf_path)
    arch = meta.require("general.architecture")
    if arch != "llama":
        raise ValueError(f"gguf: architecture {arch!r} of {gguf_path} is not supported (only 'llama')")
    config = _llama_config(meta, tensors)
    tokenizer = build_tokenizer(meta)  # fail on an unsupported vocabulary before the slow part
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(meta))
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(meta))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    weights_file = out_dir / "model.safetensors"
    save_file(_convert_weights(tensors, config), str(weights_file), metadata={"format": "pt"})
    weights_file.chmod(0o644)  # safetensors creates it owner-only, unlike the other files
    quantized, bits = _quantized_weights(tensors, config)
    if quantized:
        save_file(quantized, str(out_dir / QUANTIZED_FILE), metadata={"format": "pt", **bits})
        (out_dir / QUANTIZED_FILE).chmod(0o644)


def _open(gguf_path: Path) -> tuple[_Meta, dict[str, ReaderTensor]]:
    try:
        reader = GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ValueError(f"gguf: cannot read {gguf_path} as a GGUF file: {exc}") from exc
    return _Meta(reader, gguf_path), {t.name: t for t in reader.tensors}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------
# config


def _llama_config(meta: _Meta, tensors: Mapping[str, ReaderTensor]) -> dict[str, Any]:
    hidden = int(meta.require("llama.embedding_length"))
    num_heads = int(meta.require("llama.attention.head_count"))
    head_dim = int(meta.get("llama.attention.key_length", hidden // num_heads))
    rope_dims = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"gguf: partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    if "token_embd.weight" not in tensors:
        raise ValueError(f"gguf: {meta.path} has no token_embd.weight tensor")
    rope_theta = _f32(meta.get("llama.rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta.require("llama.feed_forward_length")),
        "num_hidden_layers": int(meta.require("llama.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    rope_scaling = _rope_scaling(meta, tensors, head_dim, rope_theta)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    return config


def _f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (9.999999747378752e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _rope_scaling(
    meta: _Meta, tensors: Mapping[str, ReaderTensor], head_dim: int, theta: float
) -> dict[str, Any] | None:
    if _ROPE_FREQS in tensors:
        factors = _dequantize(tensors[_ROPE_FREQS]).astype(np.float64)
        return llama3_rope_scaling(factors, head_dim, theta)
    kind = meta.get("llama.rope.scaling.type")
    factor = meta.get("llama.rope.scaling.factor")
    if kind in (None, "none") or factor in (None, 0.0, 1.0):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(factor)}
        orig = meta.get("llama.rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    raise ValueError(f"gguf: rope scaling type {kind!r} is not supported (linear, yarn)")


def llama3_rope_factors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as `rope_freqs.weight` for Llama 3.1-style rope."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
        high_freq_factor - low_freq_factor
    )
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, medium))


def llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Recover HF's `llama3` rope_scaling from a `rope_freqs.weight` tensor (standard Llama 3 knobs)."""
    factor = float(factors.max())
    if factor == 1.0 and float(factors.min()) == 1.0:
        return None
    expected = llama3_rope_factors(head_dim, theta, factor)
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-4):
        raise ValueError("gguf: rope_freqs.weight does not match Llama 3 rope scaling; not supported")
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _generation_config(meta: _Meta) -> dict[str, Any]:
    eos: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tok = meta.get(f"tokenizer.ggml.{key}")
        if tok is not None and int(tok) not in eos:
            eos.append(int(tok))
    gen: dict[str, Any] = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id")}
    gen["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        gen["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    for key, name in _SAMPLING_KEYS.items():
        value = meta.get(key)
        if value is not None:
            gen[name] = _f32(value) if isinstance(value, float) else value
    return gen


# ---------------------------------------------------------------------------------------------
# weights


def _convert_weights(
    tensors: Mapping[str, ReaderTensor], config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS:
            continue
        hf_name, kind = _hf_name(name, config["num_hidden_layers"])
        array = _dequantize(tensor)
        if kind in heads:
            array = unpermute_rope_rows(array, heads[kind])
        out[hf_name] = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
    return out


def _quantized_weights(
    tensors: Mapping[str, ReaderTensor], config: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The 2-D tensors stored in a block format the CPU kernels read (kernels/quant.py
    QUANT_GGML_TYPES: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K), kept quantized: only Q and K rows are
    reordered (whole rows, so blocks stay intact), and fused parts brought to one width."""
    from triollm.kernels.quant import QUANT_GGML_TYPES, QuantWeight

    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    weights: dict[str, QuantWeight] = {}
    for name, tensor in tensors.items():
        if name == _ROPE_FREQS or len(tensor.shape) != 2 or int(tensor.tensor_type) not in QUANT_GGML_TYPES:
            continue
        hf_name, kind = _hf_name(name, config["num_hidden_layers"])
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists the innermost dim first
        weight = QuantWeight.from_ggml(np.asarray(tensor.data), int(tensor.tensor_type), shape)
        if kind in heads:
            order = unpermute_rope_rows(np.arange(shape[0]), heads[kind])
            weight = weight.rows(torch.from_numpy(order.copy()))
        weights[hf_name] = weight
    _one_width_per_fused_weight(weights, config["num_hidden_layers"])
    out: dict[str, torch.Tensor] = {}
    for hf_name, weight in weights.items():
        out.update({f"{hf_name}.q": weight.q, f"{hf_name}.d": weight.d, f"{hf_name}.m": weight.m})
    return out, {hf_name: str(weight.bits) for hf_name, weight in weights.items()}


def _one_width_per_fused_weight(weights: dict[str, QuantWeight], num_layers: int) -> None:
    """A `Q4_K_M` file mixes types inside a fused projection (Q4_K q and k with a Q6_K v, both
    kept: 4- and 8-bit codes); its 4-bit parts become 8-bit codes, the same codes, scales and
    offsets (exact, twice the bytes for those parts), so the parts concatenate."""
    from triollm.kernels.quant import QuantWeight

    for layer in range(num_layers):
        for group in _FUSED:
            names = [f"model.layers.{layer}.{part}.weight" for part in group]
            present = [n for n in names if n in weights]
            if len({weights[n].bits for n in present}) > 1:
                for n in present:
                    w = weights[n]
                    if w.bits == 4:
                        weights[n] = QuantWeight(w.codes().to(torch.uint8), w.d, w.m, 8)


def _hf_name(name: str, num_layers: int) -> tuple[str, str]:
    """(HF tensor name, GGUF tensor kind such as `attn_q`) for a GGUF tensor name."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name], name.split(".")[0]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        layer = int(parts[1])
        if layer < num_layers:
            return f"model.layers.{layer}.{_LAYER_TENSORS[parts[2]]}", parts[2].split(".")[0]
    raise ValueError(f"gguf: tensor {name!r} is not part of a supported llama model")


def _dequantize(tensor: ReaderTensor) -> np.ndarray:
    shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the innermost dim first
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"gguf: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}") from exc
    return array.reshape(shape)


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary pairs -> HF's half-split halves).

    Within each head llama.cpp stores row pairs (i, i + d/2) next to each other; viewed as
    (heads, d/2, 2, ...) swapping the middle axes restores the (heads, 2, d/2, ...) HF order.
    Works for weights (rows, cols) and biases (rows,).
    """
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"gguf: {rows} rows cannot be split into {num_heads} rotary heads")
    pairs = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return pairs.swapaxes(1, 2).reshape(weight.shape)


# ---------------------------------------------------------------------------------------------
# tokenizer


def build_tokenizer(meta: _Meta) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's byte-level BPE vocabulary."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        raise ValueError("gguf: sentencepiece vocabularies (tokenizer.ggml.model 'llama') are not supported yet")
    if kind != "gpt2":
        raise ValueError(f"gguf: tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2')")
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [_split_merge(m) for m in meta.require("tokenizer.ggml.merges")]
    vocab = _byte_level_vocab(tokens, types)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre"))
    tok.decoder = decoders.ByteLevel()
    _add_special_tokens(tok, tokens, types)
    tok.post_processor = _post_processor(meta, tokens)
    return tok


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right or " " in right:
        raise ValueError(f"gguf: malformed BPE merge {merge!r}")
    return left, right


def _byte_level_vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """token -> id; ordinary tokens not already in byte-level spelling are respelled into it."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre is None or pre in _GPT2_PRE:
        return byte_level
    if pre in _DIGIT_PRE:  # GPT-2 split with every digit on its own (SmolLM, StarCoder)
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ValueError(f"gguf: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported")


def _add_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control tokens become special added tokens; user-defined ones (`<think>`) plain added ones."""
    control = [t for t, k in zip(tokens, types, strict=True) if k == _TOKEN_CONTROL]
    user = [t for t, k in zip(tokens, types, strict=True) if k == _TOKEN_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _post_processor(meta: _Meta, tokens: list[str]) -> processors.PostProcessor:
    byte_level = processors.ByteLevel(trim_offsets=False)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if not (add_bos or add_eos):
        return byte_level
    prefix, suffix, specials = [], [], []
    if add_bos:
        bos_id = int(meta.require("tokenizer.ggml.bos_token_id"))
        prefix, specials = [tokens[bos_id]], [(tokens[bos_id], bos_id)]
    if add_eos:
        eos_id = int(meta.require("tokenizer.ggml.eos_token_id"))
        suffix = [tokens[eos_id]]
        specials.append((tokens[eos_id], eos_id))
    single = [*prefix, "$A", *suffix]
    pair = [*single, *(f"{t}:1" for t in prefix), "$B:1", *(f"{t}:1" for t in suffix)]
    template = processors.TemplateProcessing(
        single=" ".join(single), pair=" ".join(pair), special_tokens=list(dict.fromkeys(specials))
    )
    return processors.Sequence([byte_level, template])


def _tokenizer_config(meta: _Meta) -> dict[str, Any]:
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        index = meta.get(f"tokenizer.ggml.{key}")
        if index is not None or name in ("bos_token", "eos_token"):
            config[name] = tokens[int(index)] if index is not None else None
    config["add_bos_token"] = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    config["chat_template"] = meta.get("tokenizer.chat_template")
    config["model_max_length"] = int(meta.get("llama.context_length", 2048))
    config["clean_up_tokenization_spaces"] = False
    return config
