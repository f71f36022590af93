"""M-RoPE positions (Qwen2-VL, Qwen2.5-VL): three position components per token, as
transformers' `get_rope_index` computes them.

A text token's three components are equal and count up by one; an image's positions (grid
t x h x w patches, merged `merge` x `merge`: t x h/merge x w/merge positions, row-major) are
(start + t index, start + row, start + column), where `start` is where the text before it left
off; the text after an image continues at start + max(h, w) / merge (the image's largest
component + 1 for a still image, whose t is 1). Positions past the prompt (the outputs) are the
token's index plus the request's `delta` (transformers' `rope_deltas`: the prompt's largest
position + 1 - its length) in all three components, so decode needs no table.

The rotary embedding (layers/rotary.py) rotates each section of the head's half-dims
(`mrope_section`: temporal, height, width) by its own component; a sequence without images has
three equal components, which is plain RoPE.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from triollm.engine.request import ImageFeature

__all__ = ["mrope_positions", "mrope_rows"]


def mrope_positions(num_tokens: int, images: Sequence[ImageFeature], merge: int) -> tuple[torch.Tensor, int]:
    """(the prompt's positions `[3, num_tokens]` int64, delta) for a prompt of `num_tokens` whose
    images (`ImageFeature.grid`, offset, length) are `images`."""
    out = torch.empty(3, num_tokens, dtype=torch.long)
    cur = i = 0
    for f in sorted(images, key=lambda f: f.offset):
        if len(f.grid) != 3:
            raise ValueError(f"multi_modal_data: an image without a patch grid (got {f.grid!r}) on an M-RoPE model")
        t, h, w = f.grid[0], f.grid[1] // merge, f.grid[2] // merge
        if f.offset < i or t * h * w != f.length or f.offset + f.length > num_tokens:
            raise ValueError(
                f"multi_modal_data: an image at {f.offset} with grid {f.grid} does not fit its {f.length} positions"
            )
        out[:, i : f.offset] = torch.arange(cur, cur + f.offset - i)
        cur += f.offset - i
        block = out[:, f.offset : f.offset + f.length].view(3, t, h, w)
        block[0] = torch.arange(t).view(t, 1, 1) + cur
        block[1] = torch.arange(h).view(1, h, 1) + cur
        block[2] = torch.arange(w).view(1, 1, w) + cur
        cur += max(h, w)
        i = f.offset + f.length
    out[:, i:] = torch.arange(cur, cur + num_tokens - i)
    delta = int(out.max()) + 1 - num_tokens if num_tokens else 0
    return out, delta


def mrope_rows(table: torch.Tensor, delta: int, start: int, count: int) -> torch.Tensor:
    """Positions `[3, count]` of tokens start.. of a sequence whose prompt positions are `table`
    (the outputs past it: index + delta)."""
    prompt = table.shape[1]
    if start + count <= prompt:
        return table[:, start : start + count]
    tail = torch.arange(max(start, prompt), start + count) + delta
    return torch.cat([table[:, start:prompt], tail.expand(3, -1)], dim=1)
