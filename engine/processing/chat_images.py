"""Image parts of chat messages: taken out of the messages, decoded, and replaced by the model's
image placeholder text.

`take_images(messages, ...)` walks every message's content parts in order. An image part
(OpenAI's `{"type": "image_url", "image_url": {"url": ...}}`, or vLLM's `{"type": "image_pil",
"image_pil": PIL.Image}` for `LLM.chat`) becomes a text part holding the placeholder (LLaVA's
`<image>`, Gemma 3's `<start_of_image>`, Qwen2-VL's `<|vision_start|><|image_pad|><|vision_end|>`
as its own template renders an image part), so the chat template, which sees text, renders it
where the image was; the images come back in the same order, ready for the prompt's
`multi_modal_data`. Parts are counted against the per-prompt limit before any is decoded, so
fifty images cost fifty dictionary lookups, not fifty decodes.

Every refusal is a ValueError naming the part (`messages[0].content[1].image_url`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from triollm.engine.config.limits import DEFAULT_IMAGES_PER_PROMPT, LimitsConfig
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.processing.images import load_image_url
from triollm.engine.processing.tokenizer import Tokenizer

__all__ = ["IMAGE_PART_TYPES", "chat_images", "image_placeholder", "take_images"]

IMAGE_PART_TYPES = ("image_url", "image_pil")


def chat_images(
    messages: Sequence[Any], model_config: ModelConfig, tokenizer: Tokenizer, limits: LimitsConfig | None
) -> tuple[Sequence[Any], list[Any]]:
    """(the messages the template renders, their images); unchanged and [] without image parts."""
    first = next(_image_parts(messages), None)
    if first is None:
        return messages, []
    i, j, part = first
    return take_images(
        messages,
        image_placeholder(model_config, tokenizer, f"messages[{i}].content[{j}]: {part['type']} parts"),
        max_images=DEFAULT_IMAGES_PER_PROMPT if limits is None else limits.max_images_per_prompt,
        allowed_local_media_path=None if limits is None else limits.allowed_local_media_path,
    )


def image_placeholder(model_config: ModelConfig, tokenizer: Tokenizer, what: str = "messages: image parts") -> str:
    """The text of the model's image placeholder token; a ValueError starting with `what` (the
    field and what it holds) when the model takes no images."""
    mm = model_config.multimodal
    if mm is None:
        raise ValueError(f"{what} need a vision-language model; {model_config.architecture} is text-only")
    try:
        mm.check_image_request()
    except ValueError as e:
        raise ValueError(f"{what}: {str(e).split(': ', 1)[1]}") from None
    ids = [mm.prompt_token_id]
    if mm.chat_begin_id >= 0 and mm.chat_end_id >= 0:  # Qwen2-VL: <|vision_start|>, <|vision_end|>
        ids = [mm.chat_begin_id, mm.prompt_token_id, mm.chat_end_id]
    tokens = [tokenizer.convert_ids_to_tokens(i) for i in ids]
    for i, token in zip(ids, tokens):
        if token is None:
            raise ValueError(f"{what}: the tokenizer has no token for the image placeholder id {i}")
    return "".join(t for t in tokens if t is not None)


def take_images(
    messages: Sequence[Any],
    placeholder: str,
    *,
    max_images: int,
    allowed_local_media_path: str | None = None,
) -> tuple[list[dict[str, Any]], list[Any]]:
    """(the messages with each image part a text part holding `placeholder`, the images in order)."""
    found = list(_image_parts(messages))
    if len(found) > max_images:
        raise ValueError(
            f"limit_mm_per_prompt: {len(found)} images exceed the limit of {max_images} per prompt "
            f"(--limit-mm-per-prompt '{{\"image\": N}}')"
        )
    images: list[Any] = []
    for i, j, part in found:
        images.append(_image(part, f"messages[{i}].content[{j}]", allowed_local_media_path))
    out: list[dict[str, Any]] = []
    for m in messages:
        message = dict(m)
        content = message.get("content")
        if isinstance(content, list):
            message["content"] = [
                {"type": "text", "text": placeholder} if _part_type(p) in IMAGE_PART_TYPES else p for p in content
            ]
        out.append(message)
    return out, images


def _image_parts(messages: Sequence[Any]) -> Iterator[tuple[int, int, Mapping[str, Any]]]:
    """(message index, part index, part) of every image part, in order."""
    for i, m in enumerate(messages):
        for j, part in enumerate(_parts(m)):
            if _part_type(part) in IMAGE_PART_TYPES:
                yield i, j, part


def _parts(message: Any) -> list[Any]:
    content = message.get("content") if isinstance(message, Mapping) else None
    return content if isinstance(content, list) else []


def _part_type(part: Any) -> Any:
    return part.get("type") if isinstance(part, Mapping) else None


def _image(part: Mapping[str, Any], where: str, allowed: str | None) -> Any:
    if part["type"] == "image_pil":
        from PIL import Image

        image = part.get("image_pil")
        if not isinstance(image, Image.Image):
            raise ValueError(f"{where}.image_pil: expected a PIL.Image.Image, got {type(image).__name__}")
        return image.convert("RGB") if image.mode != "RGB" else image
    ref = part.get("image_url")
    url = ref.get("url") if isinstance(ref, Mapping) else ref
    if not isinstance(url, str):
        raise ValueError(f"{where}.image_url: expected {{'url': 'data:image/...;base64,...'}}, got {ref!r:.60}")
    return load_image_url(url, f"{where}.image_url", allowed)
