"""`vllm.sampling_params`, for scripts that import from there: the request parameter types.

A re-export only; the definitions live in `triollm.engine.sampling_params` (and
`triollm.engine.beam_search` for `BeamSearchParams`).
"""

from __future__ import annotations

from triollm.engine.beam_search import BeamSearchParams
from triollm.engine.sampling_params import (
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    StructuredOutputsParams,
)

__all__ = [
    "BeamSearchParams",
    "GuidedDecodingParams",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
]
