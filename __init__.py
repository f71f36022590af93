"""triollm: an LLM inference engine on structured concurrency.

The names below are the public surface; everything else is reached through its submodule.
The modules vLLM scripts import from exist under the same names (`triollm.sampling_params`,
`triollm.outputs`, `triollm.inputs`, `triollm.pooling_params`, `triollm.logprobs`): each
re-exports these names from where they are defined, so `vllm.` -> `triollm.` is the whole port.
Importing `triollm` loads torch but never transformers; the names are resolved on first use
(PEP 562 `__getattr__`), so `import triollm.kernels` (a GPU image's check, issue 28) needs only
torch and Triton, not the engine's transports (pyzmq, trio, msgspec).
"""

from __future__ import annotations

import importlib
import importlib.metadata as _metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
        ClassificationOutput,
        ClassificationRequestOutput,
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

# Each public name and the module it is defined in (or re-exported from), imported on first use.
_HOMES = {
    "AsyncEngineArgs": "triollm.actors.async_llm",
    "AsyncLLM": "triollm.actors.async_llm",
    "BeamSearchParams": "triollm.sampling_params",
    "ClassificationOutput": "triollm.outputs",
    "ClassificationRequestOutput": "triollm.outputs",
    "CompletionOutput": "triollm.outputs",
    "EmbeddingOutput": "triollm.outputs",
    "EmbeddingRequestOutput": "triollm.outputs",
    "EngineArgs": "triollm.engine.config",
    "EngineBusyError": "triollm.actors.errors",
    "EngineCore": "triollm.engine.core",
    "EngineCoreRequest": "triollm.engine.request",
    "EngineDeadError": "triollm.actors.errors",
    "EngineGenerateError": "triollm.actors.errors",
    "GuidedDecodingParams": "triollm.sampling_params",
    "LLM": "triollm.actors.llm",
    "LLMEngine": "triollm.actors.llm_engine",
    "Logprob": "triollm.logprobs",
    "PoolingOutput": "triollm.outputs",
    "PoolingParams": "triollm.pooling_params",
    "PoolingRequestOutput": "triollm.outputs",
    "PromptType": "triollm.inputs",
    "RequestOutput": "triollm.outputs",
    "RequestOutputKind": "triollm.sampling_params",
    "RequestStream": "triollm.actors.request_stream",
    "SamplingParams": "triollm.sampling_params",
    "ScoringOutput": "triollm.outputs",
    "ScoringRequestOutput": "triollm.outputs",
    "StructuredOutputsParams": "triollm.sampling_params",
    "TextPrompt": "triollm.inputs",
    "TokensPrompt": "triollm.inputs",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'triollm' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value  # once resolved, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


try:
    __version__: str = _metadata.version("triollm")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "AsyncEngineArgs",
    "AsyncLLM",
    "BeamSearchParams",
    "ClassificationOutput",
    "ClassificationRequestOutput",
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
