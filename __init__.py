"""triollm: an LLM inference engine on structured concurrency.

The names below are the public surface; everything else is reached through its submodule.
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
from triollm.engine.inputs import TextPrompt, TokensPrompt
from triollm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from triollm.engine.pooling_outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from triollm.engine.pooling_params import PoolingParams
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams

try:
    __version__: str = _metadata.version("triollm")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "AsyncEngineArgs",
    "AsyncLLM",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineBusyError",
    "EngineCore",
    "EngineCoreRequest",
    "EngineDeadError",
    "EngineGenerateError",
    "LLM",
    "LLMEngine",
    "Logprob",
    "PoolingOutput",
    "PoolingParams",
    "PoolingRequestOutput",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStream",
    "SamplingParams",
    "ScoringOutput",
    "ScoringRequestOutput",
    "TextPrompt",
    "TokensPrompt",
    "__version__",
]
