"""Import a GGUF file into a Hugging Face-format model directory: the families in gguf_arch.ARCHS here,
any other architecture transformers' GGUF reader maps through it (`_import_with_transformers`).

A GGUF carries everything the engine needs, but under llama.cpp's names and layouts. This module
rewrites it once, into the files the rest of the engine already reads:

* `config.json` / `generation_config.json`: from the `{arch}.*`, `tokenizer.ggml.*` and
  `general.sampling.*` metadata, per the architecture's table (gguf_arch.py).
* `model.safetensors` (float32): every tensor dequantized with `gguf.quants.dequantize`, renamed to
  the family's HF names, with llama.cpp's conversions undone: Q/K rows back from the interleaved
  rotary layout (llama-derived families), Gemma's norms back from `w + 1`, the 3-D expert tensors
  (`ffn_*_exps`) split into one tensor per expert. Fused tensors stay fused where the HF
  checkpoint has them fused too (Phi-3's `qkv_proj`, `gate_up_proj`).
* `tokenizer.json` / `tokenizer_config.json`: the vocabulary rebuilt with the `tokenizers` library
  (gguf_vocab.py: byte-level BPE or SentencePiece), and the file's chat template.
* `gguf_quantized.safetensors` (QUANTIZED_FILE, for `quantization="gguf"`): the 2-D tensors in a
  block format the CPU kernels read, kept quantized (kernels/quant.py `QuantWeight.from_ggml`):
  Q4_0, Q4_1 and Q8_0 as shipped, Q5_0 and Q5_1 as 8-bit codes of the same blocks (exact),
  IQ4_NL / IQ4_XS as their 4-bit indices, the K-quants Q2_K to Q6_K mapped onto blocks of 32
  (kernels/kquants.py, with its error bounds). Only whole rows move (Q/K un-permutation, Phi-3's
  fused tensors cut into the q/k/v and gate/up pieces the model stacks), so blocks stay intact. A
  mixed file (`Q4_K_M`: Q4_K, Q6_K and more) is one model; where the parts of a projection the
  model fuses (q|k|v, gate|up) differ in code format, the 4-bit and IQ4 parts are widened to
  8-bit codes, exactly, so that each fused weight has one format. Any other type (F16, IQ2_XS, TQ1_0, ...) is
  dequantized into the float32 file only, with one log line naming the types.

GGUF lists tensor dimensions innermost first; the reader's arrays are already in numpy order
(rows = output features), so only quantized rows need reshaping after dequantization.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.torch import save_file

from triollm.engine.loading.gguf_arch import (
    ARCHS,
    CONFIG_TENSORS,
    GLOBAL_TENSORS,
    LAYER_TENSORS,
    ArchSpec,
    GGUFMeta,
    f32,
    has_table,
    hf_config,
    llama3_rope_factors,
    llama3_rope_scaling,
)
from triollm.engine.loading.gguf_vocab import build_tokenizer, tokenizer_config
from triollm.engine.loading.model_config import QUANTIZED_FILE

if TYPE_CHECKING:
    from triollm.kernels.quant import QuantWeight

__all__ = ["IMPORT_FORMAT_VERSION", "import_gguf", "llama3_rope_factors", "llama3_rope_scaling"]

logger = logging.getLogger("triollm")

# Bump whenever the files written here change, so cached imports are redone.
IMPORT_FORMAT_VERSION = 6  # 4: every family in gguf_arch.ARCHS, SentencePiece vocabularies; 5: IQ4 kept 4-bit;
# 6: deepseek2 and llama4 by their tables (before: transformers' reader, dense)
# QUANTIZED_FILE (model_config.py) holds the quantized tensors as shipped (`quantization="gguf"`):
# kernels/quant.py's QuantWeight parts per HF tensor name ("<name>.q", ".d", ".m"), with the bits
# per name in the metadata.

# The projections the model runs as one fused weight (engine/execution/models/base.py STACKED).
_FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
# Checkpoint tensors stored fused (Phi-3), by the pieces the model stacks them from.
_STORED_FUSED = {"self_attn.qkv_proj": _FUSED[0], "mlp.gate_up_proj": _FUSED[1]}
_SAMPLING_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}


def import_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Write config, float32 safetensors weights and tokenizer files for `gguf_path` into `out_dir`."""
    meta, tensors = _open(gguf_path)
    if not has_table(meta):
        _import_with_transformers(gguf_path, meta, out_dir)
        return
    shapes = {name: _shape(t) for name, t in tensors.items()}
    config, spec = hf_config(meta, shapes, lambda name: _dequantize(tensors[name]))
    tokenizer = build_tokenizer(meta)  # fail on an unsupported vocabulary before the slow part
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", _generation_config(meta))
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config(meta, config["max_position_embeddings"]))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    weights_file = out_dir / "model.safetensors"
    save_file(_convert_weights(tensors, config, spec), str(weights_file), metadata={"format": "pt"})
    weights_file.chmod(0o644)  # safetensors creates it owner-only, unlike the other files
    quantized, bits = _quantized_weights(tensors, config, spec)
    if quantized:
        save_file(quantized, str(out_dir / QUANTIZED_FILE), metadata={"format": "pt", **bits})
        (out_dir / QUANTIZED_FILE).chmod(0o644)


def _import_with_transformers(gguf_path: Path, meta: GGUFMeta, out_dir: Path) -> None:
    """An architecture without a table here: transformers' own GGUF reader (it maps bloom,
    falcon, gpt2, stablelm, starcoder2, nemotron, qwen2moe, lfm2, mamba and more, with their
    tokenizers) builds the model, every tensor dequantized, and saves it as a Hugging Face
    checkpoint, which then runs as any other: natively where triollm has the class, else through
    the Transformers modeling backend. Dense only (no blocks kept; one log line says so). Refused,
    naming both lists, where transformers does not read the architecture either."""
    from triollm.engine.loading.transformers_config import import_transformers

    arch = str(meta.require("general.architecture"))
    try:
        transformers = import_transformers()
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError as exc:
        raise ValueError(
            f"gguf: general.architecture {arch!r} of {gguf_path} is not supported: triollm maps "
            f"{', '.join(ARCHS)} itself; others go through transformers' GGUF reader (pip install transformers)"
        ) from exc
    folder, name = str(gguf_path.parent), gguf_path.name
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as exc:  # its readers raise what they meet: name the file and both lists
        raise ValueError(
            f"gguf: general.architecture {arch!r} of {gguf_path} is not supported: triollm maps "
            f"{', '.join(ARCHS)} itself and transformers' GGUF reader "
            f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))} ({type(exc).__name__}: {str(exc)[:300]})"
        ) from exc
    logger.info(
        "gguf: %s (%s) imported through transformers' GGUF reader, dequantized: its blocks are not kept",
        gguf_path.name,
        arch,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    # transformers will not save_pretrained a model it loaded from GGUF (its "gguf" quantizer is
    # not serialisable): the config without it, and the weights as they are (the output
    # projection left out only where it is the embedding itself, which the config then says).
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    # The special tokens the file names (transformers' config class defaults may not even be in
    # the vocabulary), and a context length where the family's config has none (BLOOM's ALiBi).
    gen = _generation_config(meta)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(config.get_text_config(), key, gen.get(key))
    if getattr(config.get_text_config(), "max_position_embeddings", None) is None:
        context = meta.get(f"{arch}.context_length")
        if context is not None:
            config.get_text_config().max_position_embeddings = int(context)
    weights = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = head is not None and head.weight.data_ptr() == embed.weight.data_ptr()
    config.get_text_config().tie_word_embeddings = tied
    if tied:
        shared = {n for n, t in weights.items() if t.data_ptr() == head.weight.data_ptr()}
        weights = {n: t for n, t in weights.items() if n not in shared or n.endswith(_embedding_name(model))}
    config.save_pretrained(out_dir)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "model.safetensors").chmod(0o644)
    tokenizer.save_pretrained(out_dir)
    _write_json(out_dir / "generation_config.json", gen)


def _embedding_name(model: Any) -> str:
    """The state-dict name suffix of the model's input embedding weight."""
    embed = model.get_input_embeddings()
    for name, module in model.named_modules():
        if module is embed:
            return f"{name}.weight"
    raise ValueError("gguf: the model built by transformers has no input embedding")


def _open(gguf_path: Path) -> tuple[GGUFMeta, dict[str, ReaderTensor]]:
    try:
        reader = GGUFReader(gguf_path)
    except (ValueError, OSError, IndexError, KeyError) as exc:
        raise ValueError(f"gguf: cannot read {gguf_path} as a GGUF file: {exc}") from exc
    return GGUFMeta(reader, gguf_path), {t.name: t for t in reader.tensors}


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _generation_config(meta: GGUFMeta) -> dict[str, Any]:
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
            gen[name] = f32(value) if isinstance(value, float) else value
    return gen


# ---------------------------------------------------------------------------------------------
# weights


def _convert_weights(
    tensors: Mapping[str, ReaderTensor], config: Mapping[str, Any], spec: ArchSpec
) -> dict[str, torch.Tensor]:
    heads = _rotary_heads(config, spec)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in CONFIG_TENSORS or _dropped_layer(name, config, spec):
            continue
        hf_name, kind = _hf_name(name, config["num_hidden_layers"], spec)
        array = _dequantize(tensor)
        if kind in heads:
            array = unpermute_rope_rows(array, heads[kind])
        if spec.norm_plus_one and name.endswith("norm.weight"):
            array = array - np.float32(1.0)
        if hf_name.endswith("shared_expert_gate.weight") and array.ndim == 1:
            array = array[None, :]  # llama.cpp's quantizer writes the one-row gate as a vector
        for part_name, part in _experts(hf_name, array):
            out[part_name] = torch.from_numpy(np.require(part, np.float32, ["C", "W"]))
    join = _JOINS.get(spec.model_type)
    if join is not None:
        join(out, config["num_hidden_layers"])
    return out


def _granite_moe_experts(out: dict[str, torch.Tensor], num_layers: int) -> None:
    """Granite MoE's gate and up as transformers stores them: the experts' `input_linear`
    [E, 2I, H] and the shared MLP's [2S, H], gate rows first."""
    for layer in range(num_layers):
        p = f"model.layers.{layer}"
        gate, up = out.pop(f"{p}.block_sparse_moe.gate_exps"), out.pop(f"{p}.block_sparse_moe.up_exps")
        out[f"{p}.block_sparse_moe.input_linear.weight"] = torch.cat((gate, up), dim=1)
        if f"{p}.shared_mlp.gate" in out:
            gate, up = out.pop(f"{p}.shared_mlp.gate"), out.pop(f"{p}.shared_mlp.up")
            out[f"{p}.shared_mlp.input_linear.weight"] = torch.cat((gate, up), dim=0)


def _gpt_oss_experts(out: dict[str, torch.Tensor], num_layers: int) -> None:
    """gpt-oss's experts as transformers stores them: gate and up ([E, I, H] each here) interleaved
    into `gate_up_proj` [E, H, 2I] (gate in the even columns) with its bias [E, 2I], and down
    transposed to [E, I, H]."""
    for layer in range(num_layers):
        p = f"model.layers.{layer}.mlp.experts"
        gate, up = out.pop(f"{p}.gate_proj"), out.pop(f"{p}.up_proj")
        out[f"{p}.gate_up_proj"] = torch.stack((gate.mT, up.mT), dim=-1).flatten(-2).contiguous()
        gate_b, up_b = out.pop(f"{p}.gate_proj_bias"), out.pop(f"{p}.up_proj_bias")
        out[f"{p}.gate_up_proj_bias"] = torch.stack((gate_b, up_b), dim=-1).flatten(-2).contiguous()
        out[f"{p}.down_proj"] = out[f"{p}.down_proj"].mT.contiguous()


def _latent_kv_b(out: dict[str, torch.Tensor], num_layers: int) -> None:
    """DeepSeek's `kv_b_proj` [H * (nope + v), kv_lora] from the converter's `attn_k_b`
    [H, kv_lora, nope] (transposed for llama.cpp's absorbed form) and `attn_v_b` [H, v, kv_lora];
    files from before that split carry `attn_kv_b` whole."""
    for layer in range(num_layers):
        p = f"model.layers.{layer}.self_attn"
        if f"{p}.k_b" in out:
            k_b, v_b = out.pop(f"{p}.k_b"), out.pop(f"{p}.v_b")
            out[f"{p}.kv_b_proj.weight"] = torch.cat((k_b.mT, v_b), dim=1).flatten(0, 1).contiguous()


def _llama4_experts(out: dict[str, torch.Tensor], num_layers: int) -> None:
    """Llama 4's experts as transformers stores them: gate and up ([E, I, H] each here) joined into
    `gate_up_proj` [E, H, 2I] (gate in the first half of the columns), down transposed to [E, I, H]."""
    for layer in range(num_layers):
        p = f"model.layers.{layer}.feed_forward.experts"
        if f"{p}.gate_exps" in out:
            gate, up = out.pop(f"{p}.gate_exps"), out.pop(f"{p}.up_exps")
            out[f"{p}.gate_up_proj"] = torch.cat((gate.mT, up.mT), dim=-1).contiguous()
            out[f"{p}.down_proj"] = out[f"{p}.down_proj"].mT.contiguous()


# Families whose converter split a tensor transformers stores whole (gate and up, DeepSeek's
# kv_b): joined back once every tensor is read, by the table's model_type.
_JOINS = {
    "gpt_oss": _gpt_oss_experts,
    "granitemoe": _granite_moe_experts,
    "deepseek_v3": _latent_kv_b,
    "llama4_text": _llama4_experts,
}


def _experts(hf_name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """A 3-D expert tensor (experts, rows, cols) as one tensor per expert; others as they are."""
    if "{e}" not in hf_name:
        yield hf_name, array
        return
    if array.ndim != 3:
        raise ValueError(f"gguf: expert tensor for {hf_name!r} has shape {array.shape}, expected 3 dimensions")
    for expert in range(array.shape[0]):
        yield hf_name.format(e=expert), array[expert]


def _rotary_heads(config: Mapping[str, Any], spec: ArchSpec, *, kept: bool = False) -> dict[str, int]:
    """The tensor kinds whose rows llama.cpp's converter permuted, with their head counts; `kept`
    (kept blocks only): also the q/k rows a model reorders from rotary pairs to halves as it
    loads dense weights (ArchSpec.paired_qk), the same reorder as undoing that permutation."""
    if not (spec.permuted_qk or (kept and spec.paired_qk)):
        return {}
    return {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}


def _quantized_weights(
    tensors: Mapping[str, ReaderTensor], config: Mapping[str, Any], spec: ArchSpec
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The 2-D tensors stored in a block format the CPU kernels read (kernels/quant.py
    QUANT_GGML_TYPES: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K-Q6_K, IQ4_NL, IQ4_XS), kept quantized: only rows are
    reordered or cut (whole rows, so blocks stay intact), and fused parts brought to one width."""
    from triollm.kernels.quant import QUANT_GGML_TYPES, QuantWeight

    heads = _rotary_heads(config, spec, kept=True)
    weights: dict[str, QuantWeight] = {}
    dequantized: set[str] = set()
    for name, tensor in tensors.items():
        if name in CONFIG_TENSORS or len(tensor.shape) != 2 or ".ffn_gate_inp." in name:
            continue  # 3-D experts and routers stay dense (weights.quantize_model)
        if _dropped_layer(name, config, spec):
            continue
        if spec.model_type == "granitemoe" and "_shexp." in name:
            continue  # its shared MLP's gate and up are joined when imported: dense
        if int(tensor.tensor_type) not in QUANT_GGML_TYPES:
            if tensor.tensor_type.name not in ("F32", "F16", "BF16"):
                dequantized.add(tensor.tensor_type.name)
            continue
        hf_name, kind = _hf_name(name, config["num_hidden_layers"], spec)
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists the innermost dim first
        weight = QuantWeight.from_ggml(np.asarray(tensor.data), int(tensor.tensor_type), shape)
        if kind in heads:
            order = unpermute_rope_rows(np.arange(shape[0]), heads[kind])
            weight = weight.rows(torch.from_numpy(order.copy()))
        weights.update(_unfused(hf_name, weight, config))
    if dequantized:
        logger.info(
            "gguf: tensors of type %s are dequantized to float32 (no CPU kernel reads them as blocks)",
            ", ".join(sorted(dequantized)),
        )
    _one_width_per_fused_weight(weights)
    out: dict[str, torch.Tensor] = {}
    for hf_name, weight in weights.items():
        out.update({f"{hf_name}.q": weight.q, f"{hf_name}.d": weight.d, f"{hf_name}.m": weight.m})
    return out, {hf_name: str(weight.bits) for hf_name, weight in weights.items()}


def _unfused(hf_name: str, weight: QuantWeight, config: Mapping[str, Any]) -> dict[str, QuantWeight]:
    """A tensor stored fused (Phi-3's qkv_proj, gate_up_proj) as the pieces the model stacks."""
    prefix, _, module = hf_name.removesuffix(".weight").rpartition(".layers.")
    layer, _, path = module.partition(".")
    pieces = _STORED_FUSED.get(path)
    if pieces is None:
        return {hf_name: weight}
    head_dim = config["head_dim"]
    if len(pieces) == 3:
        sizes = [config["num_attention_heads"] * head_dim] + [config["num_key_value_heads"] * head_dim] * 2
    else:
        sizes = [config["intermediate_size"]] * 2
    out: dict[str, QuantWeight] = {}
    start = 0
    for piece, size in zip(pieces, sizes, strict=True):
        out[f"{prefix}.layers.{layer}.{piece}.weight"] = weight.rows(torch.arange(start, start + size))
        start += size
    return out


def _one_width_per_fused_weight(weights: dict[str, QuantWeight]) -> None:
    """A `Q4_K_M` file mixes types inside a fused projection (Q4_K q and k with a Q6_K v, both
    kept: 4- and 8-bit codes; an IQ4_XS file's Q4_K or Q5_K parts beside IQ4 ones); where the
    parts' code formats differ, those not 8-bit become 8-bit codes, the same codes, scales and
    offsets (exact, twice the bytes for those parts), so the parts concatenate. The parts are
    those of one module (`...self_attn.`, `...mlp.shared_expert.`) named as in `_FUSED`."""
    groups: dict[str, list[str]] = {}
    for name in weights:
        module, _, leaf = name.removesuffix(".weight").rpartition(".")
        for group in _FUSED:
            if leaf in (part.rpartition(".")[2] for part in group):
                groups.setdefault(f"{module}/{group[0]}", []).append(name)
    for present in groups.values():
        if len({weights[n].bits for n in present}) > 1:
            for n in present:
                weights[n] = weights[n].widened()


def _dropped_layer(name: str, config: Mapping[str, Any], spec: ArchSpec) -> bool:
    """A tensor of a layer after the model's own that the import leaves out: GLM-4.5's
    multi-token-prediction layers (hf_config took them off num_hidden_layers)."""
    parts = name.split(".", 2)
    return (spec.model_type == "glm4_moe" and len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit()
            and int(parts[1]) >= config["num_hidden_layers"])


def _hf_name(name: str, num_layers: int, spec: ArchSpec) -> tuple[str, str]:
    """(HF tensor name, GGUF tensor kind such as `attn_q`) for a GGUF tensor name."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name], name.split(".")[0]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and int(parts[1]) < num_layers:
        hf = spec.tensors.get(parts[2]) or LAYER_TENSORS.get(parts[2])
        if hf is not None:
            return f"model.layers.{int(parts[1])}.{hf}", parts[2].split(".")[0]
    raise ValueError(f"gguf: tensor {name!r} is not part of a supported {spec.architecture} model")


def _shape(tensor: ReaderTensor) -> tuple[int, ...]:
    return tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists the innermost dim first


def _dequantize(tensor: ReaderTensor) -> np.ndarray:
    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ValueError(f"gguf: tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}") from exc
    return array.reshape(_shape(tensor))


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
