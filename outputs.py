"""`vllm.outputs`, for scripts that import from there: what `generate`, `encode`, `embed` and
`score` return.

A re-export only; the definitions live in `triollm.engine.outputs` (text generation) and
`triollm.engine.pooling_outputs` (pooling models). There is no classification head, so vLLM's
`ClassificationOutput` has no counterpart here.
"""

from __future__ import annotations

from triollm.engine.outputs import CompletionOutput, RequestOutput
from triollm.engine.pooling_outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "RequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
