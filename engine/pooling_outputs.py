"""What a pooling model returns, with vLLM's names: `PoolingRequestOutput` and its typed views.

`PoolingRequestOutput.outputs` is a `PoolingOutput` whose `data` is a float32 tensor: `[hidden]`
for an embedding (task "embed"), `[num_prompt_tokens, hidden]` for task "token_embed",
`[num_labels]` for "classify". `LLM.embed` returns `EmbeddingRequestOutput`s
(`outputs.embedding`: a list of floats), `LLM.classify` `ClassificationRequestOutput`s
(`outputs.probs`: one float per label), `LLM.score` `ScoringRequestOutput`s (`outputs.score`: a
float), each built by `from_base` as in vLLM.

On the wire from the engine core an embedding travels as little-endian float32 bytes
(`pack_pooled` / `unpack_pooled`): one msgpack bin per request instead of a list of floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
    "pack_pooled",
    "unpack_pooled",
]

_O = TypeVar("_O")


@dataclass
class PoolingOutput:
    data: torch.Tensor


class PoolingRequestOutput(Generic[_O]):
    """One prompt's pooled result (`outputs`), its prompt token ids, and `finished` (always
    True: a pooling request has a single output)."""

    def __init__(
        self,
        request_id: str,
        outputs: _O,
        prompt_token_ids: list[int],
        finished: bool,
        num_cached_tokens: int = 0,
    ) -> None:
        self.request_id = request_id
        self.outputs = outputs
        self.prompt_token_ids = prompt_token_ids
        self.finished = finished
        self.num_cached_tokens = num_cached_tokens

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(request_id={self.request_id!r}, outputs={self.outputs!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, finished={self.finished})"
        )


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> EmbeddingOutput:
        data = output.data
        if data.ndim != 1:
            raise ValueError("pooled data should be a 1-D embedding vector (task 'embed')")
        return EmbeddingOutput(data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @staticmethod
    def from_base(output: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(
            output.request_id,
            EmbeddingOutput.from_base(output.outputs),
            output.prompt_token_ids,
            output.finished,
            output.num_cached_tokens,
        )


@dataclass
class ClassificationOutput:
    probs: list[float]  # the activated logits, one per label (raw logits with use_activation=False)

    @staticmethod
    def from_base(output: PoolingOutput) -> ClassificationOutput:
        data = output.data
        if data.ndim != 1:
            raise ValueError("pooled data should be a 1-D vector of class probabilities (task 'classify')")
        return ClassificationOutput(data.tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)

    def __repr__(self) -> str:
        return f"ClassificationOutput(num_classes={self.num_classes})"


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @staticmethod
    def from_base(output: PoolingRequestOutput[PoolingOutput]) -> ClassificationRequestOutput:
        return ClassificationRequestOutput(
            output.request_id,
            ClassificationOutput.from_base(output.outputs),
            output.prompt_token_ids,
            output.finished,
            output.num_cached_tokens,
        )


@dataclass
class ScoringOutput:
    score: float

    @staticmethod
    def from_base(output: PoolingOutput) -> ScoringOutput:
        data = output.data.squeeze()
        if data.ndim != 0:
            raise ValueError("pooled data should be a scalar score")
        return ScoringOutput(float(data.item()))


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @staticmethod
    def from_base(output: PoolingRequestOutput[PoolingOutput]) -> ScoringRequestOutput:
        return ScoringRequestOutput(
            output.request_id,
            ScoringOutput.from_base(output.outputs),
            output.prompt_token_ids,
            output.finished,
            output.num_cached_tokens,
        )


def pack_pooled(data: torch.Tensor) -> bytes:
    """A float tensor as little-endian float32 bytes (row-major)."""
    array = data.detach().to("cpu", torch.float32).contiguous().numpy()
    return array.astype("<f4", copy=False).tobytes()


def unpack_pooled(blob: bytes, rows: int | None = None) -> torch.Tensor:
    """`pack_pooled`'s bytes back as a float32 tensor: 1-D, or `[rows, -1]` when rows is given."""
    data = torch.from_numpy(np.frombuffer(blob, dtype="<f4").astype(np.float32))
    return data if rows is None else data.view(rows, -1)
