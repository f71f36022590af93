"""Vision-language checkpoints: the decoder inside them, read as its own config.json, and what
the image side needs to know.

A `*ForConditionalGeneration` checkpoint wraps a decoder that triollm runs natively (Gemma 3's
`Gemma3ForConditionalGeneration` wraps `Gemma3ForCausalLM`, LLaVA-1.5's
`LlavaForConditionalGeneration` a `LlamaForCausalLM`) next to a vision tower and a projector.
`split_multimodal` turns the wrapper's config.json into the decoder's (its `text_config`, with
transformers' defaults for the keys a shipped config leaves out, since google/gemma-3-4b-it's
`text_config` names only the sizes that differ) plus a `MultimodalSpec`: the wrapper, the image
placeholder token and how many positions one image fills.

What the wrapper changes in the decoder's numbers, as transformers' wrapper class computes them:
- the logits come from the wrapper's own `lm_head`: Gemma 3's has no final soft-capping (only
  `Gemma3ForCausalLM` applies `final_logit_softcapping`);
- `tie_word_embeddings`, `dtype` and the special token ids are the wrapper's (top-level) fields,
  the text config's where it has none.

Which images a wrapper takes, and how a prompt's placeholder expands:
- LLaVA-1.5: a CLIP tower, an MLP projector; `<image>` expands to one position per patch, less
  the CLS feature under the "default" strategy.
- Gemma 3: a SigLIP tower, `Gemma3MultiModalProjector` (pooled to `mm_tokens_per_image`); the
  prompt holds `<start_of_image>` (`boi_token_index`), which expands as Gemma3Processor's text
  does to "\n\n", `<start_of_image>`, `mm_tokens_per_image` x `<image_soft_token>`
  (`image_token_index`, the positions the features fill), `<end_of_image>`, "\n\n"; the
  positions of one image attend to each other both ways (`bidirectional`: kernels/attention.py).
- Qwen2-VL / Qwen2.5-VL: a ViT over dynamic-resolution patches with its patch merger
  (`spatial_merge_size`); the prompt holds `<|vision_start|><|image_pad|><|vision_end|>` per
  image and the one `<|image_pad|>` (`image_token_id`) expands to grid_t * grid_h * grid_w /
  merge**2 positions, as Qwen2VLProcessor does: the count differs per image
  (`tokens_per_image` is 0). The decoder is Qwen2's with M-RoPE: `rope_scaling.mrope_section`
  (`mrope_section`) splits the rotary half-dims into (temporal, height, width) sections, which
  the engine rotates by 3-D positions (engine/execution/mrope.py). A shipped Qwen2-VL config
  keeps the text fields at the top level (no `text_config`); transformers 5 writes both.

Rejected: reading the text config through transformers' config classes (transformers is not a
runtime dependency of text models); running the wrapper through the Transformers backend (it
pages a causal LM, not a wrapper that merges image features).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

__all__ = [
    "IMAGE_ARCHITECTURES",
    "MULTIMODAL_ARCHITECTURES",
    "MultimodalSpec",
    "decoder_tensor_name",
    "split_multimodal",
]

# transformers' LlamaConfig defaults, for the keys our parser needs.
_LLAMA_TEXT = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
}
# transformers' Gemma3TextConfig defaults (5.x and 4.5x agree), for the keys our parser needs.
_GEMMA3_TEXT = {
    "model_type": "gemma3_text",
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "pad_token_id": 0,
}

# transformers' Qwen2VLTextConfig defaults (Qwen2.5-VL's agree on these keys).
_QWEN2_VL_TEXT = {
    "model_type": "qwen2",
    "vocab_size": 152064,
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "use_sliding_window": False,
}
_QWEN_VL = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
# The text config's model_type each Qwen wrapper writes (read as Qwen2's).
_QWEN_TEXT_TYPES = {
    "Qwen2VLForConditionalGeneration": "qwen2_vl_text",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl_text",
}


@dataclass(frozen=True)
class _Wrapper:
    text_architecture: str
    text_defaults: Mapping[str, Any]
    tie_default: bool
    final_softcap: bool  # whether the wrapper's head applies the text config's final soft-capping


_WRAPPERS = {
    "Gemma3ForConditionalGeneration": _Wrapper("Gemma3ForCausalLM", _GEMMA3_TEXT, True, False),
    "LlavaForConditionalGeneration": _Wrapper("LlamaForCausalLM", _LLAMA_TEXT, False, False),
    "Qwen2VLForConditionalGeneration": _Wrapper("Qwen2ForCausalLM", _QWEN2_VL_TEXT, False, False),
    "Qwen2_5_VLForConditionalGeneration": _Wrapper("Qwen2ForCausalLM", _QWEN2_VL_TEXT, False, False),
}
# The wrappers whose images the engine computes (engine/execution/vision.py).
IMAGE_ARCHITECTURES = ("Gemma3ForConditionalGeneration", "LlavaForConditionalGeneration", *_QWEN_VL)
MULTIMODAL_ARCHITECTURES = tuple(_WRAPPERS)
# Top-level fields of the wrapper that are the decoder's too.
_SHARED = ("dtype", "torch_dtype", "eos_token_id", "bos_token_id", "pad_token_id")


@dataclass(frozen=True)
class MultimodalSpec:
    """The vision-language checkpoint a decoder config came from."""

    architecture: str  # the checkpoint's `architectures[0]`, e.g. Gemma3ForConditionalGeneration
    image_token_id: int  # the token at the positions one image's features replace
    tokens_per_image: int  # the positions one image fills (its placeholder expanded)
    takes_images: bool  # whether the engine computes this wrapper's image features
    # The token a prompt holds for one image (LLaVA: the image token; Gemma 3: <start_of_image>),
    # and the tokens around the image's positions in its expansion (-1: none).
    placeholder_id: int = -1
    begin_id: int = -1
    end_id: int = -1
    # Whether one image's positions attend to each other both ways (Gemma 3), not causally.
    bidirectional: bool = False
    # Whether the expansion puts "\n\n" before `begin_id` and after `end_id` (Gemma 3).
    blank_lines: bool = False
    # Why a wrapper that takes images serves text only here (`without_images`); "" otherwise.
    text_only_why: str = ""
    # Qwen2-VL: the vision tower's `spatial_merge_size` (an image's positions are its patch grid
    # over merge**2; 0: a fixed `tokens_per_image`), the M-RoPE sections of the rotary half-dims
    # (temporal, height, width), and the tokens a chat image part renders around the placeholder.
    spatial_merge: int = 0
    mrope_section: tuple[int, ...] = ()
    chat_begin_id: int = -1
    chat_end_id: int = -1

    def without_images(self, why: str) -> MultimodalSpec:
        """This spec serving text only, image requests refused with `why`."""
        return replace(self, takes_images=False, text_only_why=why)

    @property
    def prompt_token_id(self) -> int:
        """The token that stands for one image in a prompt."""
        return self.image_token_id if self.placeholder_id < 0 else self.placeholder_id

    def check_image_request(self) -> None:
        """A ValueError naming `multi_modal_data` when this model's images are not served."""
        if self.text_only_why:
            raise ValueError(f"multi_modal_data: {self.architecture} serves text only here: {self.text_only_why}")
        if not self.takes_images:
            raise ValueError(
                f"multi_modal_data: image inputs to {self.architecture} are not supported yet (its decoder serves "
                f"text); image models: {', '.join(IMAGE_ARCHITECTURES)}"
            )


def split_multimodal(hf: Mapping[str, Any]) -> tuple[dict[str, Any], MultimodalSpec | None]:
    """(the decoder's config.json, the wrapper) for a vision-language checkpoint; (hf, None) otherwise."""
    archs = hf.get("architectures")
    arch = archs[0] if isinstance(archs, list) and archs else None
    if not isinstance(arch, str) or arch not in _WRAPPERS:
        return dict(hf), None
    wrapper = _WRAPPERS[arch]
    text = hf.get("text_config", {})
    if not isinstance(text, Mapping):
        raise ValueError(f"text_config: expected a JSON object, got {text!r}")
    expected = wrapper.text_defaults["model_type"]
    mrope: tuple[int, ...] = ()
    if arch in _QWEN_VL:
        text, mrope = _qwen_text(arch, hf, text)
        expected = _QWEN_TEXT_TYPES[arch]
    if text.get("model_type", expected) != expected:
        raise ValueError(f"text_config.model_type: {arch} needs {expected!r}, got {text.get('model_type')!r}")
    merged: dict[str, Any] = {**wrapper.text_defaults, **text}
    if arch in _QWEN_VL:
        merged["model_type"] = "qwen2"
    merged |= {key: hf[key] for key in _SHARED if key in hf}
    merged["architectures"] = [wrapper.text_architecture]
    merged["tie_word_embeddings"] = hf.get("tie_word_embeddings", wrapper.tie_default)
    if not wrapper.final_softcap:
        merged["final_logit_softcapping"] = None
    spec = _spec(arch, hf, merged)
    return merged, replace(spec, mrope_section=mrope) if mrope else spec


def _qwen_text(arch: str, hf: Mapping[str, Any], text: Mapping[str, Any]) -> tuple[dict[str, Any], tuple[int, ...]]:
    """(Qwen2-VL's text config with its RoPE dict read as a plain one, its `mrope_section`). A
    shipped config keeps the text fields at the top level; 4.x's `{"type": "mrope"}` is the
    default RoPE with sections (transformers reads it so)."""
    out = dict(text) if text else {k: v for k, v in hf.items() if k not in ("vision_config", "text_config")}
    out.pop("architectures", None)
    if not text:
        out["model_type"] = _QWEN_TEXT_TYPES[arch]
    field = "rope_scaling" if isinstance(out.get("rope_scaling"), Mapping) else "rope_parameters"
    rope = dict(out.get(field) or {})
    section = rope.pop("mrope_section", None)
    if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
        rope.pop("type", None)
        rope["rope_type"] = "default"
    if rope or field in out:
        out[field] = rope
    if section is None:
        return out, ()
    if not (
        isinstance(section, list) and len(section) == 3
        and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in section)
    ):  # fmt: skip
        raise ValueError(
            f"{field}.mrope_section: expected 3 positive integers (temporal, height, width), got {section!r}"
        )
    return out, tuple(section)


def _spec(arch: str, hf: Mapping[str, Any], text: Mapping[str, Any]) -> MultimodalSpec:
    vision = hf.get("vision_config", {})
    if not isinstance(vision, Mapping):
        raise ValueError(f"vision_config: expected a JSON object, got {vision!r}")
    if arch in _QWEN_VL:
        token = _index(hf, "image_token_id", 151655)
        start, end = _index(hf, "vision_start_token_id", 151652), _index(hf, "vision_end_token_id", 151653)
        merge = _index(vision, "spatial_merge_size", 2)
        if merge == 0:
            raise ValueError("vision_config.spatial_merge_size: must be positive, got 0")
        _in_vocab(text, image_token_id=token, vision_start_token_id=start, vision_end_token_id=end)
        return MultimodalSpec(
            architecture=arch, image_token_id=token, tokens_per_image=0, takes_images=True, spatial_merge=merge,
            chat_begin_id=start, chat_end_id=end,
        )  # fmt: skip
    if arch == "Gemma3ForConditionalGeneration":
        token, per_image = _index(hf, "image_token_index", 262144), _index(hf, "mm_tokens_per_image", 256)
        boi, eoi = _index(hf, "boi_token_index", 255999), _index(hf, "eoi_token_index", 256000)
        _in_vocab(text, image_token_index=token, boi_token_index=boi, eoi_token_index=eoi)
        return MultimodalSpec(
            architecture=arch, image_token_id=token, tokens_per_image=per_image, takes_images=True,
            placeholder_id=boi, begin_id=boi, end_id=eoi, bidirectional=True, blank_lines=True,
        )  # fmt: skip
    else:  # LLaVA: one position per patch, plus CLS under the "full" strategy
        token = _index(hf, "image_token_index", 32000)
        strategy = hf.get("vision_feature_select_strategy", "default")
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy: {strategy!r} is not one of default, full")
        layer = hf.get("vision_feature_layer", -2)
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise ValueError(f"vision_feature_layer: expected one layer index (an integer), got {layer!r}")
        # CLIPVisionConfig's defaults; LlavaConfig's own (336 / 14) when vision_config is absent.
        size = _index(vision, "image_size", 224 if vision else 336)
        patch = _index(vision, "patch_size", 32 if vision else 14)
        if size % patch:
            raise ValueError(f"vision_config.patch_size: {patch} does not divide image_size {size}")
        per_image = (size // patch) ** 2 + (strategy == "full")
        _in_vocab(text, image_token_index=token)
    return MultimodalSpec(
        architecture=arch, image_token_id=token, tokens_per_image=per_image, takes_images=arch in IMAGE_ARCHITECTURES
    )


def _in_vocab(text: Mapping[str, Any], **tokens: int) -> None:
    vocab = text["vocab_size"]
    if isinstance(vocab, int) and not isinstance(vocab, bool):
        for key, token in tokens.items():
            if token >= vocab:
                raise ValueError(f"{key}: {token} lies outside the vocabulary (vocab_size {vocab})")


def _index(hf: Mapping[str, Any], key: str, default: int) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key}: expected a non-negative integer, got {value!r}")
    return value


# Where a wrapper keeps its decoder's tensors: the original checkpoints (and transformers 5.x's
# `save_pretrained`, which writes them back that way) and transformers 4.5x's in-memory layout;
# and its vision side's.
_DECODER_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}
_VISION_PREFIXES = (
    "vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.",
    "visual.", "model.visual.",  # Qwen2-VL's tower and merger
)  # fmt: skip


def decoder_tensor_name(name: str) -> str | None:
    """The decoder checkpoint's name for the wrapper's tensor `name`; None for the vision tower's
    and the projector's. Any other name is returned as it is (the weight loader refuses what the
    decoder has no place for)."""
    for prefix, ours in _DECODER_PREFIXES.items():
        if name.startswith(prefix):
            return ours + name.removeprefix(prefix)
    return None if name.startswith(_VISION_PREFIXES) else name
