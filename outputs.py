"""`vllm.outputs`, for scripts that import from there: what `generate`, `encode`, `embed`,
`classify` and `score` return.

A re-export only; the definitions live in `triollm.engine.outputs` (text generation) and
`triollm.engine.pooling_outputs` (pooling models).
"""

from __future__ import annotations

from triollm.engine.outputs import CompletionOutput, RequestOutput
from triollm.engine.pooling_outputs import (
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = [
    "ClassificationOutput",
    "ClassificationRequestOutput",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "RequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
