"""The vision side of a vision-language model: pixels in, one feature row per placeholder out.

LLaVA-1.5 (`LlavaForConditionalGeneration`): transformers' own CLIP vision tower, built from the
checkpoint's `vision_config`, and its `LlavaMultiModalProjector`, with the checkpoint's weights;
the features are the hidden states of `vision_feature_layer`, less the CLS position under the
"default" strategy, through the projector (transformers' `LlavaModel.get_image_features`).

Gemma 3 (`Gemma3ForConditionalGeneration`): transformers' SigLIP vision model, built from the
checkpoint's `vision_config`, its last hidden state through `Gemma3MultiModalProjector` (average
pooling to `mm_tokens_per_image` rows, a soft-embedding norm, a projection), as
`Gemma3Model.get_image_features`. Its features are not multiplied by the text embedding's
sqrt(hidden) scale (transformers scatters them over the scaled embeddings).

Qwen2-VL / Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`):
transformers' `Qwen2VisionTransformerPretrainedModel` / `Qwen2_5_VisionTransformerPretrainedModel`
(Qwen2.5-VL's windowed attention included), built from the checkpoint's `vision_config`, with its
patch merger; it takes the processor's flattened patches of every image of the call in one
tensor and their `image_grid_thw`, and its merged rows split per image by grid (each image's
attention stays within it), as `Qwen2VLModel.get_image_features`.

The decoder stays triollm's: the model runner scatters these rows over the token embeddings at the
image's placeholder positions (engine/execution/model_runner.py).

Rejected: a native CLIP port (the tower runs once per image, off the per-token hot path, so
transformers' modules cost little, and they are the reference the tests compare with).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.transformers_config import import_transformers
from triollm.engine.request import ImageFeature

__all__ = ["ENCODER_CACHE_BYTES", "EncoderCache", "GridVisionEncoder", "VisionEncoder", "load_vision_encoder"]

# The feature rows kept for images encoded lately (EncoderCache): a few hundred images of a 2-4B
# model's 256-1,280 rows, far less than the KV blocks of the same prompts.
ENCODER_CACHE_BYTES = 256 << 20


class EncoderCache:
    """Feature rows of recently encoded images by their content digest (pixels and grid: the
    prefix cache's key for an image's positions), least recently used first out, bounded in
    bytes. A prefix-cache hit that covers an image only in part (the prompt's cached blocks end
    inside it) still feeds the rest of its positions: without these rows the tower ran again for
    the whole image (measured: a 448 x 448 image again in a 264-token prompt cost 0.77x of the
    cold request, tower included). As in vLLM's encoder cache; the rows never leave the engine,
    and an image's rows depend only on its pixels and the model."""

    def __init__(self, max_bytes: int = ENCODER_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._rows: dict[bytes, torch.Tensor] = {}  # insertion order = recency

    def get(self, digest: bytes) -> torch.Tensor | None:
        rows = self._rows.pop(digest, None)
        if rows is not None:
            self._rows[digest] = rows
        return rows

    def put(self, digest: bytes, rows: torch.Tensor) -> None:
        size = rows.numel() * rows.element_size()
        if size > self.max_bytes or digest in self._rows:
            return
        while self.bytes + size > self.max_bytes:
            old = self._rows.pop(next(iter(self._rows)))
            self.bytes -= old.numel() * old.element_size()
        self._rows[digest] = rows
        self.bytes += size


class VisionEncoder(nn.Module):
    """A tower and its projector; `num_runs` counts the images encoded (tests read it).
    `layer`: the hidden state taken (None: the last hidden state); `drop_cls`: LLaVA's "default"
    strategy."""

    def __init__(self, tower: nn.Module, projector: nn.Module, layer: int | None, drop_cls: bool) -> None:
        super().__init__()
        self.tower, self.projector = tower, projector
        self.layer, self.drop_cls = layer, drop_cls
        self.num_runs = 0

    @torch.inference_mode()
    def encode(self, images: list[ImageFeature]) -> list[torch.Tensor]:
        """Each image's feature rows `[length, hidden]`, in the order given."""
        param = next(self.tower.parameters())
        pixels = torch.stack(
            [torch.frombuffer(bytearray(f.pixels), dtype=torch.float32).view(f.shape) for f in images]
        ).to(param.device, param.dtype)
        if self.layer is None:
            hidden = self.tower(pixel_values=pixels, return_dict=True).last_hidden_state
        else:
            hidden = self.tower(pixels, output_hidden_states=True, return_dict=True).hidden_states[self.layer]
        if self.drop_cls:
            hidden = hidden[:, 1:]
        features = self.projector(hidden)
        self.num_runs += len(images)
        for f, rows in zip(images, features):
            if rows.shape[0] != f.length:
                raise ValueError(f"multi_modal_data: the image gives {rows.shape[0]} features for {f.length} positions")
        return list(features)


class GridVisionEncoder(VisionEncoder):
    """Qwen2-VL's tower (its merger inside): images of any patch grid (module note)."""

    def __init__(self, tower: nn.Module, merge: int) -> None:
        super().__init__(tower, nn.Identity(), None, False)
        self.merge = merge

    @torch.inference_mode()
    def encode(self, images: list[ImageFeature]) -> list[torch.Tensor]:
        param = next(self.tower.parameters())
        pixels = torch.cat(
            [torch.frombuffer(bytearray(f.pixels), dtype=torch.float32).view(f.shape) for f in images]
        ).to(param.device, param.dtype)
        grid = torch.tensor([f.grid for f in images], dtype=torch.long, device=param.device)
        merged = self.tower(pixels, grid_thw=grid, return_dict=True).pooler_output
        sizes = [t * h * w // self.merge**2 for t, h, w in (f.grid for f in images)]
        self.num_runs += len(images)
        if merged.shape[0] != sum(sizes):
            raise ValueError(f"multi_modal_data: the tower gave {merged.shape[0]} features for {sum(sizes)} positions")
        for f, n in zip(images, sizes):
            if n != f.length:
                raise ValueError(f"multi_modal_data: the image gives {n} features for {f.length} positions")
        return list(torch.split(merged, sizes))


def load_vision_encoder(cfg: ModelConfig, device: str | torch.device) -> VisionEncoder:
    hf = json.loads((cfg.path / "config.json").read_text())
    arch = None if cfg.multimodal is None else cfg.multimodal.architecture
    if arch == "Gemma3ForConditionalGeneration":
        encoder = _gemma3_encoder(cfg, hf)
    elif arch in ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"):
        encoder = _qwen_vl_encoder(cfg, hf, arch)
    else:
        encoder = _llava_encoder(cfg, hf)
    return encoder.to(device=device, dtype=cfg.dtype).eval().requires_grad_(False)


def _gemma3_encoder(cfg: ModelConfig, hf: dict[str, Any]) -> VisionEncoder:
    transformers = import_transformers()
    from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

    config = transformers.Gemma3Config.from_dict(hf)
    vision = config.vision_config
    patches, side = vision.image_size // vision.patch_size, math.isqrt(config.mm_tokens_per_image)
    if side * side != config.mm_tokens_per_image or not 0 < side <= patches or patches % side:
        raise ValueError(
            f"mm_tokens_per_image: {config.mm_tokens_per_image} must be the square of a divisor of the "
            f"{patches} patches per side of vision_config (image_size {vision.image_size}, patch_size "
            f"{vision.patch_size})"
        )
    tower = transformers.AutoModel.from_config(vision)
    projector = Gemma3MultiModalProjector(config)
    _load(tower, cfg.path, ("vision_tower.", "model.vision_tower."))
    _load(projector, cfg.path, ("multi_modal_projector.", "model.multi_modal_projector."))
    return VisionEncoder(tower, projector, None, False)


def _qwen_vl_encoder(cfg: ModelConfig, hf: dict[str, Any], arch: str) -> VisionEncoder:
    transformers = import_transformers()
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel

    tower: nn.Module
    if arch == "Qwen2VLForConditionalGeneration":
        vision = transformers.Qwen2VLConfig.from_dict(hf).vision_config
        tower = Qwen2VisionTransformerPretrainedModel._from_config(vision)
    else:
        vision = transformers.Qwen2_5_VLConfig.from_dict(hf).vision_config
        tower = Qwen2_5_VisionTransformerPretrainedModel._from_config(vision)
    # The checkpoint keeps the tower under `visual.` (transformers 4.5x in memory: `model.visual.`).
    _load(tower, cfg.path, ("visual.", "model.visual."))
    return GridVisionEncoder(tower, vision.spatial_merge_size)


def _llava_encoder(cfg: ModelConfig, hf: dict[str, Any]) -> VisionEncoder:
    transformers = import_transformers()
    from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

    config = transformers.LlavaConfig.from_dict(hf)
    tower = transformers.AutoModel.from_config(config.vision_config)
    projector = LlavaMultiModalProjector(config)
    _load(tower, cfg.path, ("vision_tower.", "model.vision_tower."))
    _load(projector, cfg.path, ("multi_modal_projector.", "model.multi_modal_projector."))
    return VisionEncoder(
        tower, projector, config.vision_feature_layer, config.vision_feature_select_strategy == "default"
    )


def _load(module: nn.Module, path: Path, prefixes: tuple[str, ...]) -> None:
    """The module's tensors from the checkpoint's safetensors files, under one of `prefixes`;
    a `vision_model.` level (CLIPVisionModel in transformers 4.x) is matched either way."""
    wanted = module.state_dict()
    state: dict[str, Any] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no dict)
                prefix = next((p for p in prefixes if name.startswith(p)), None)
                if prefix is None:
                    continue
                key = name.removeprefix(prefix)
                if key not in wanted:
                    key = (
                        key.removeprefix("vision_model.") if key.startswith("vision_model.") else f"vision_model.{key}"
                    )
                state[key] = f.get_tensor(name)
    missing = sorted(set(wanted) - set(state))
    unexpected = sorted(set(state) - set(wanted))
    if missing or unexpected:
        raise ValueError(
            f"model: the checkpoint in {path} does not match its vision config (missing {missing[:3]}, "
            f"unexpected {unexpected[:3]})"
        )
    module.load_state_dict(state)
