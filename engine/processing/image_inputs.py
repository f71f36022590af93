"""A vision-language model's image inputs: pixels from the checkpoint's image processor, and the
placeholder positions their features fill.

`ImageInputs.expand(token_ids, images)` runs transformers' image processor saved with the
checkpoint (`preprocessor_config.json`: resize, crop, rescale, normalise) over each image, checks
that the prompt holds one placeholder token per image, and expands each placeholder to the
`tokens_per_image` positions the model's features fill (LLaVA's processor does the same to the
text); Gemma 3's `<start_of_image>` becomes "\n\n", `<start_of_image>`, the image positions,
`<end_of_image>`, "\n\n" (Gemma3Processor's `full_image_sequence`, here in token ids: the
blank lines are the tokenizer's ids for "\n\n"). Qwen2-VL's processor (Qwen2VLImageProcessor:
dynamic resolution between its min and max pixels, `mm_processor_kwargs` may set them) gives
each image its own patch grid: its rows of flattened patches and `image_grid_thw` go on the
feature, and its `<|image_pad|>` expands to grid_t * grid_h * grid_w / merge**2 positions (the
`<|vision_start|>` / `<|vision_end|>` around it are the prompt's, as Qwen2VLProcessor leaves
them). Each image becomes an `ImageFeature`
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
        pixels, grids = self._pixels(images, kwargs or {})
        out: list[int] = []
        features: list[ImageFeature] = []
        start = 0
        for place, one, grid in zip(places, pixels, grids):
            out.extend(token_ids[start:place])
            out.extend(self.before)
            data = one.contiguous().numpy().tobytes()
            shape = list(one.shape)
            # The grid too: equal patch rows on another grid are another image.
            digest = hashlib.sha256(repr((shape, grid)).encode() + data).digest()
            length = grid[0] * grid[1] * grid[2] // spec.spatial_merge**2 if grid else spec.tokens_per_image
            features.append(ImageFeature(len(out), length, digest, data, shape, spec.bidirectional, grid))
            out.extend([spec.image_token_id] * length)
            out.extend(self.after)
            start = place + 1
        out.extend(token_ids[start:])
        return out, features

    def _pixels(
        self, images: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> tuple[Sequence[torch.Tensor], list[list[int]]]:
        """(each image's pixels, each image's patch grid: [] but for Qwen2-VL)."""
        if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
            raise ValueError(f"mm_processor_kwargs: expected a JSON object of processor options, got {kwargs!r:.80}")
        if self.spec.spatial_merge:
            kwargs = self._qwen_size(kwargs)
        try:
            batch = self.processor(images=list(images), return_tensors="pt", **kwargs)
        except (TypeError, ValueError) as e:
            raise ValueError(f"mm_processor_kwargs: the image processor refused them ({e})") from None
        pixels = batch["pixel_values"]
        if self.spec.spatial_merge:
            return self._split_patches(pixels, batch.get("image_grid_thw"), len(images))
        if not isinstance(pixels, torch.Tensor) or pixels.shape[0] != len(images):
            raise ValueError(f"mm_processor_kwargs: the image processor gave no pixel batch for {len(images)} images")
        return list(pixels.float()), [[] for _ in images]

    def _qwen_size(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """`min_pixels` / `max_pixels` (vLLM's and Qwen's names) as the processor's `size` bounds."""
        out = dict(kwargs)
        bounds = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge"}
        if any(key in out for key in bounds):
            size = dict(out.pop("size", None) or self.processor.size)
            for key, edge in bounds.items():
                if key in out:
                    value = out.pop(key)
                    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                        raise ValueError(f"mm_processor_kwargs.{key}: expected a positive integer, got {value!r}")
                    size[edge] = value
            out["size"] = size
        return out

    def _split_patches(self, pixels: Any, grid: Any, count: int) -> tuple[Sequence[torch.Tensor], list[list[int]]]:
        """Qwen2-VL's batch (every image's patch rows in one tensor) cut per image by its grid."""
        if not isinstance(pixels, torch.Tensor) or not isinstance(grid, torch.Tensor) or grid.shape != (count, 3):
            raise ValueError(f"mm_processor_kwargs: the image processor gave no patch grids for {count} images")
        grids = [[int(v) for v in row] for row in grid.tolist()]
        sizes = [t * h * w for t, h, w in grids]
        merge = self.spec.spatial_merge
        if sum(sizes) != pixels.shape[0] or any(h % merge or w % merge for _, h, w in grids):
            raise ValueError(
                f"mm_processor_kwargs: the image processor's patch grids {grids} do not fit its "
                f"{pixels.shape[0]} patches in merges of {merge} x {merge}"
            )
        return torch.split(pixels.float(), sizes), grids
