"""Tiny random vision-language checkpoints written by transformers' own `save_pretrained`.

The weights are redrawn at tinymodel's larger scales (peaked next-token distributions: no greedy
near-ties), the tiny byte-level tokenizer sits beside them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tinymodel import build_tokenizer, write_tokenizer

IMAGE_TOKEN = "<image>"


def _redraw(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif name.endswith("weight") and p.dim() == 1:  # norms
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(noise * (0.5 if "embed_tokens" in name or "lm_head" in name else 0.2))


def write_image_tokenizer(path: Path) -> tuple[int, int, int]:
    """The tiny tokenizer with `<image>` added as a special token: (eos id, image id, vocab size)."""
    eos_id = write_tokenizer(path)
    tok = build_tokenizer()
    tok.add_special_tokens([IMAGE_TOKEN])
    tok.save(str(path / "tokenizer.json"))
    return eos_id, tok.token_to_id(IMAGE_TOKEN), tok.get_vocab_size()


def make_llava(path: Path, *, seed: int = 0) -> Path:
    """A tiny `LlavaForConditionalGeneration` (CLIP tower 28 x 28 pixels in 7 x 7 patches: 16
    features per image, MLP projector, Llama decoder) and its CLIP image processor."""
    import transformers

    eos_id, image_id, vocab = write_image_tokenizer(path)
    text = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=None,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=28, patch_size=7
    )
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=image_id)
    cfg.architectures = ["LlavaForConditionalGeneration"]
    model = transformers.LlavaForConditionalGeneration(cfg).to(torch.float32)
    _redraw(model, seed)
    model.save_pretrained(path)
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
    processor.save_pretrained(path)
    return path


def make_gemma3_vlm(path: Path, *, seed: int = 0, **text: object) -> Path:
    """A tiny `Gemma3ForConditionalGeneration` (SigLIP tower, projector, Gemma 3 text model);
    `text` overrides the text config's arguments."""
    import transformers

    eos_id = write_tokenizer(path)
    text_config = {
        "vocab_size": build_tokenizer().get_vocab_size(),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "query_pre_attn_scalar": 20,
        "sliding_window": 9,
        "layer_types": ["sliding_attention", "full_attention"],
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        **text,
    }
    vision_config = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "image_size": 28,
        "patch_size": 7,
        "vision_use_head": False,
    }
    cfg = transformers.Gemma3Config(
        text_config=text_config, vision_config=vision_config, mm_tokens_per_image=4, dtype="float32"
    )
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    model = transformers.Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    _redraw(model, seed)
    model.save_pretrained(path)
    return path


def random_image(seed: int, size: tuple[int, int]) -> Any:
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 255, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def llava_reference(path: Path, text: str, images: list[Any], **processor_kwargs: Any) -> list[int]:
    """transformers' LlavaForConditionalGeneration: the prompt's `<image>` expanded to 16
    positions (what LlavaProcessor does), pixels from the checkpoint's image processor."""
    import torch
    from tokenizers import Tokenizer

    from triollm.engine.loading.transformers_config import import_transformers

    transformers = import_transformers()
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    image_id = tok.token_to_id(IMAGE_TOKEN)
    ids: list[int] = []
    for t in tok.encode(text).ids:
        ids += [t] * 16 if t == image_id else [t]
    model = transformers.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    kwargs: dict[str, Any] = {}
    if images:
        processor = transformers.AutoImageProcessor.from_pretrained(path)
        kwargs["pixel_values"] = processor(images=images, return_tensors="pt", **processor_kwargs)["pixel_values"]
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
            **kwargs,
        )  # fmt: skip
    return list(out[0, len(ids) :].tolist())


def data_url(image: Any, fmt: str = "PNG") -> str:
    import base64
    import io

    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64,{base64.b64encode(buf.getvalue()).decode()}"


def chatml(user: str) -> str:
    """The tiny tokenizer's ChatML template, rendered for one user message."""
    return f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
