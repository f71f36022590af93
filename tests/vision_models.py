"""Tiny random vision-language checkpoints written by transformers' own `save_pretrained`.

The weights are redrawn at tinymodel's larger scales (peaked next-token distributions: no greedy
near-ties), the tiny byte-level tokenizer sits beside them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tinymodel import build_tokenizer, tiny_text_config, write_tokenizer

IMAGE_TOKEN = "<image>"


def _redraw(model: torch.nn.Module, seed: int, *, embed: float = 0.5, decoder_norm: float = 1.0) -> None:
    """`embed`: the embedding's scale; `decoder_norm`: the decoder norms' weights' mean (Gemma's
    norms scale by 1 + w, and its embedding by sqrt(hidden): with 0.5 and 1 the last token's own
    embedding outweighs what the layers add, and the model repeats it)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif name.endswith("weight") and p.dim() == 1:  # norms
                p.copy_((decoder_norm if "language_model" in name else 1.0) + 0.1 * noise)
            else:
                p.copy_(noise * (embed if "embed_tokens" in name or "lm_head" in name else 0.2))


def write_image_tokenizer(path: Path, tokens: tuple[str, ...] = (IMAGE_TOKEN,)) -> tuple[int, list[int], int]:
    """The tiny tokenizer with `tokens` added as special tokens: (eos id, their ids, vocab size)."""
    eos_id = write_tokenizer(path)
    tok = build_tokenizer()
    tok.add_special_tokens(list(tokens))
    tok.save(str(path / "tokenizer.json"))
    return eos_id, [tok.token_to_id(t) for t in tokens], tok.get_vocab_size()


def make_llava(path: Path, *, seed: int = 0) -> Path:
    """A tiny `LlavaForConditionalGeneration` (CLIP tower 28 x 28 pixels in 7 x 7 patches: 16
    features per image, MLP projector, Llama decoder) and its CLIP image processor."""
    import transformers

    eos_id, (image_id,), vocab = write_image_tokenizer(path)
    text = transformers.LlamaConfig(**tiny_text_config(vocab, eos_id))
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


GEMMA3_IMAGE_TOKENS = ("<start_of_image>", "<end_of_image>", "<image_soft_token>")


def make_gemma3_vlm(path: Path, *, seed: int = 0, **text: object) -> Path:
    """A tiny `Gemma3ForConditionalGeneration` (SigLIP tower 28 x 28 pixels in 7 x 7 patches,
    pooled by the projector to 4 features per image; Gemma 3 text model), the tiny tokenizer
    with Gemma 3's three image tokens added, and Gemma 3's image processor at 28 x 28;
    `text` overrides the text config's arguments."""
    import transformers

    eos_id, (boi, eoi, image), vocab = write_image_tokenizer(path, GEMMA3_IMAGE_TOKENS)
    gemma = {
        "head_dim": 16, "query_pre_attn_scalar": 20, "sliding_window": 9,
        "layer_types": ["sliding_attention", "full_attention"],
    }  # fmt: skip
    text_config = tiny_text_config(vocab, eos_id, **{**gemma, **text})
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
        text_config=text_config, vision_config=vision_config, mm_tokens_per_image=4, dtype="float32",
        boi_token_index=boi, eoi_token_index=eoi, image_token_index=image,
    )  # fmt: skip
    cfg.architectures = ["Gemma3ForConditionalGeneration"]
    model = transformers.Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    _redraw(model, seed, embed=0.1, decoder_norm=2.0)
    model.save_pretrained(path)
    transformers.Gemma3ImageProcessor(size={"height": 28, "width": 28}).save_pretrained(path)
    return path


def gemma3_ids(path: Path, text: str) -> tuple[list[int], list[int]]:
    """(ids, token_type_ids) of `text` as Gemma3Processor makes them: each `<start_of_image>`
    replaced by "\n\n<start_of_image>" + 4 x "<image_soft_token>" + "<end_of_image>\n\n"
    (here at the token level: the tiny tokenizer's newlines are bytes), 1 at image tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    boi, eoi, image = (tok.token_to_id(t) for t in GEMMA3_IMAGE_TOKENS)
    blank = tok.encode("\n\n", add_special_tokens=False).ids
    ids: list[int] = []
    for t in tok.encode(text).ids:
        ids += [*blank, boi, *[image] * 4, eoi, *blank] if t == boi else [t]
    return ids, [int(t == image) for t in ids]


def gemma3_reference(path: Path, text: str, images: list[Any]) -> list[int]:
    """transformers' Gemma3ForConditionalGeneration, greedy, 16 tokens: the processor's ids and
    token_type_ids (the bidirectional mask over each image's positions), the checkpoint's pixels."""
    from triollm.engine.loading.transformers_config import import_transformers

    transformers = import_transformers()
    ids, types = gemma3_ids(path, text)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    kwargs: dict[str, Any] = {}
    if images:
        processor = transformers.AutoImageProcessor.from_pretrained(path)
        kwargs["pixel_values"] = processor(images=images, return_tensors="pt")["pixel_values"]
        kwargs["token_type_ids"] = torch.tensor([types])
    with torch.inference_mode():
        out = model.generate(
            input_ids=torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0,
            **kwargs,
        )  # fmt: skip
    return list(out[0, len(ids) :].tolist())


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


def huge_png_url() -> str:
    """A PNG whose header says 10,000 x 10,000 pixels (a few hundred bytes on the wire), as a data URL."""
    import base64
    import io
    import struct
    import zlib

    buf = io.BytesIO()
    random_image(1, (8, 8)).save(buf, format="PNG")
    data = bytearray(buf.getvalue())
    ihdr = struct.pack(">II", 10_000, 10_000) + bytes(data[24:29])
    data[16:33] = ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return "data:image/png;base64," + base64.b64encode(bytes(data)).decode()


def truncated_jpeg_url() -> str:
    """The first half of a JPEG, as a data URL."""
    import base64

    payload = base64.b64decode(data_url(random_image(2, (64, 64)), "JPEG").split(",", 1)[1])
    return "data:image/jpeg;base64," + base64.b64encode(payload[: len(payload) // 2]).decode()
