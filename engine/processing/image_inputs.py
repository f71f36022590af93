"""A vision-language model's image inputs: pixels from the checkpoint's image processor, and the
placeholder positions their features fill.

`ImageInputs.expand(token_ids, images)` runs transformers' image processor saved with the
checkpoint (`preprocessor_config.json`: resize, crop, rescale, normalise) over each image, checks
that the prompt holds one placeholder token per image, and expands each placeholder to the
`tokens_per_image` positions the model's features fill (LLaVA's processor does the same to the
text); Gemma 3's `<start_of_image>` becomes "\n\n", `<start_of_image>`, the image positions,
`<end_of_image>`, "\n\n" (Gemma3Processor's `full_image_sequence`, here in token ids: the
blank lines are the tokenizer's ids for "\n\n"). Each image becomes an `ImageFeature`
(engine/request.py): its positions, its pixels as float32 bytes and their sha256, which keys
both the vision encoder's work and the prefix cache (engine/scheduling/block_manager.py), so
equal pixels mean equal features.

Runs in the frontend, in a worker thread for the API: the processor is CPU work.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from triollm.engine.loading.multimodal_config import MultimodalSpec
from triollm.engine.request import ImageFeature

__all__ = ["DEFAULT_IMAGE_LIMIT", "ImageInputs"]

DEFAULT_IMAGE_LIMIT = 8  # images per prompt unless `limit_mm_per_prompt` says otherwise


class ImageInputs:
    def __init__(
        self, path: Path, spec: MultimodalSpec, limit: int = DEFAULT_IMAGE_LIMIT, blank_lines: Sequence[int] = ()
    ) -> None:
        """The checkpoint's image processor (its preprocessor_config.json, which
        ModelConfig.from_pretrained found), loaded now; `blank_lines`: the ids of "\n\n" (used
        where `spec.blank_lines`)."""
        from triollm.engine.loading.transformers_config import import_transformers

        transformers = import_transformers()
        self.processor = transformers.AutoImageProcessor.from_pretrained(path)
        self.spec = spec
        self.limit = limit
        blank = list(blank_lines) if spec.blank_lines else []
        self.before = [*blank, *([spec.begin_id] if spec.begin_id >= 0 else [])]
        self.after = [*([spec.end_id] if spec.end_id >= 0 else []), *blank]

    def expand(
        self, token_ids: Sequence[int], images: Sequence[Any], kwargs: Mapping[str, Any] | None = None
    ) -> tuple[list[int], list[ImageFeature]]:
        """(the prompt with each placeholder expanded, one feature per image, in prompt order)."""
        from PIL import Image

        spec = self.spec
        if len(images) > self.limit:
            raise ValueError(
                f"limit_mm_per_prompt: {len(images)} images exceed the limit of {self.limit} per prompt "
                f"(--limit-mm-per-prompt '{{\"image\": N}}')"
            )
        for i, image in enumerate(images):
            if not isinstance(image, Image.Image):
                raise ValueError(f"multi_modal_data.image[{i}]: expected a PIL.Image.Image, got {type(image).__name__}")
        places = [i for i, t in enumerate(token_ids) if t == spec.prompt_token_id]
        if len(places) != len(images):
            raise ValueError(
                f"multi_modal_data: {len(images)} images but the prompt has {len(places)} image placeholders "
                f"(token {spec.prompt_token_id}); give one placeholder per image"
            )
        if not images:
            return list(token_ids), []
        pixels = self._pixels(images, kwargs or {})
        out: list[int] = []
        features: list[ImageFeature] = []
        start = 0
        for place, one in zip(places, pixels):
            out.extend(token_ids[start:place])
            out.extend(self.before)
            data = one.contiguous().numpy().tobytes()
            shape = list(one.shape)
            digest = hashlib.sha256(repr(shape).encode() + data).digest()
            features.append(ImageFeature(len(out), spec.tokens_per_image, digest, data, shape, spec.bidirectional))
            out.extend([spec.image_token_id] * spec.tokens_per_image)
            out.extend(self.after)
            start = place + 1
        out.extend(token_ids[start:])
        return out, features

    def _pixels(self, images: Sequence[Any], kwargs: Mapping[str, Any]) -> torch.Tensor:
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(f"mm_processor_kwargs: expected a JSON object of processor options, got {kwargs!r:.80}")
        try:
            batch = self.processor(images=list(images), return_tensors="pt", **kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"mm_processor_kwargs: the image processor refused them ({e})") from None
        pixels = batch["pixel_values"]
        if not isinstance(pixels, torch.Tensor) or pixels.shape[0] != len(images):
            raise ValueError(f"mm_processor_kwargs: the image processor gave no pixel batch for {len(images)} images")
        return pixels.float()
