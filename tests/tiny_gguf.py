"""Tiny GGUF files written from a tiny HF checkpoint (tinymodel.py), as llama.cpp's converter
would: its names, its Q/K row permutation, its tokenizer metadata, and any tensor stored in a
GGML block type (`types`: Q8_0 and the like through gguf's quantizer, K-quants through
kquant_ref.py). `requantize_gguf` rewrites any GGUF's tensors in other block types, its
metadata and tokenizer kept."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from kquant_ref import KQUANTS, LOW_BIT, quantize_kquant, quantize_low_bit
from safetensors.torch import load_file
from tinymodel import CHATML, SPECIALS

GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py Q/K row permutation (HF half-split -> interleaved)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_tiny_gguf(
    hf_dir: Path,
    out: Path,
    *,
    arch: str = "llama",
    tokenizer_model: str = "gpt2",
    types: Mapping[str, gguf.GGMLQuantizationType] | None = None,
) -> None:
    """`types`: GGUF tensor name -> its block type (the others stay float32)."""
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    weights = {k: v.numpy() for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])
    writer.add_token_merges([f"{a} {b}" for a, b in tok["model"]["merges"]])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    types = types or {}
    for name, array in gguf_tensors(weights, cfg).items():
        kind = types.get(name)
        if kind is None:
            writer.add_tensor(name, array)
        else:
            raw = quantize_block(array, kind)
            writer.add_tensor(name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_tensors(weights: dict[str, np.ndarray], cfg: dict[str, Any]) -> dict[str, np.ndarray]:
    """The HF checkpoint's tensors under llama.cpp's names and Q/K row order (float32)."""
    out = {
        "token_embd.weight": weights["model.embed_tokens.weight"],
        "output_norm.weight": weights["model.norm.weight"],
    }
    if "lm_head.weight" in weights:
        out["output.weight"] = weights["lm_head.weight"]
    for i in range(cfg["num_hidden_layers"]):
        for hf, name in GGUF_NAMES.items():
            array = weights[f"model.layers.{i}.{hf}"]
            if name == "attn_q.weight":
                array = llama_cpp_permute(array, cfg["num_attention_heads"])
            elif name == "attn_k.weight":
                array = llama_cpp_permute(array, cfg["num_key_value_heads"])
            out[f"blk.{i}.{name}"] = array
    return out


def requantize_gguf(
    src: Path,
    out: Path,
    types: Callable[[str, tuple[int, ...]], gguf.GGMLQuantizationType],
    file_type: gguf.LlamaFileType | None = None,
) -> dict[str, gguf.GGMLQuantizationType]:
    """`src` with each tensor dequantized and stored as `types(name, numpy shape)` (F32: as
    floats; K-quants through kquant_ref.py, the rest through gguf's quantizer), its metadata
    copied (`general.file_type` set to `file_type` when given); returns the types written."""
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(out), str(reader.fields["general.architecture"].contents()))
    skip = {"general.architecture", "general.alignment"} | ({"general.file_type"} if file_type is not None else set())
    for field in reader.fields.values():
        if field.name in skip or field.name.startswith("GGUF."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    if file_type is not None:
        writer.add_file_type(int(file_type))
    written: dict[str, gguf.GGMLQuantizationType] = {}
    for tensor in reader.tensors:
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the innermost dim first
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape).astype(np.float32)
        kind = written[tensor.name] = types(tensor.name, shape)
        if kind == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, array)
        else:
            raw = quantize_block(array, kind)
            writer.add_tensor(tensor.name, raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


def quantize_block(array: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """A float32 `[N, K]` as GGUF block bytes: K-quants and the low-bit types through kquant_ref.py,
    the rest through gguf's quantizer."""
    if kind in KQUANTS:
        return quantize_kquant(array, kind)[0]
    if kind in LOW_BIT:
        return quantize_low_bit(array, kind)
    return gguf.quants.quantize(array, kind)
