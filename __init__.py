"""triollm: an LLM inference engine on structured concurrency.

The names below are the public surface; everything else is reached through its submodule.
The modules vLLM scripts import from exist under the same names (`triollm.sampling_params`,
`triollm.outputs`, `triollm.inputs`, `triollm.pooling_params`, `triollm.logprobs`): each
re-exports these names from where they are defined, so `vllm.` -> `triollm.` is the whole port.
Importing `triollm` loads torch but never transformers.
"""

from __future__ import annotations

import importlib.metadata as _metadata

from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.actors.errors import EngineBusyError, EngineDeadError, EngineGenerateError
from triollm.actors.llm import LLM
from triollm.actors.llm_engine import LLMEngine
from triollm.actors.request_stream import RequestStream
from triollm.engine.config import EngineArgs
from triollm.engine.core import EngineCore
from triollm.engine.request import EngineCoreRequest
from triollm.inputs import PromptType, TextPrompt, TokensPrompt
from triollm.logprobs import Logprob
from triollm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from triollm.pooling_params import PoolingParams
from triollm.sampling_params import (
    BeamSearchParams,
    GuidedDecodingParams,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

try:
    __version__: str = _metadata.version("triollm")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "AsyncEngineArgs",
    "AsyncLLM",
    "BeamSearchParams",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineBusyError",
    "EngineCore",
    "EngineCoreRequest",
    "EngineDeadError",
    "EngineGenerateError",
    "GuidedDecodingParams",
    "LLM",
    "LLMEngine",
    "Logprob",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "PromptType",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStream",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]
