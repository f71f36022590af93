"""The public surface of `triollm`: `__all__` is pinned, so adding or removing a name is a decision."""

from __future__ import annotations

import importlib
import importlib.metadata
import subprocess
import sys

import triollm
from triollm.actors import async_llm, errors, llm, llm_engine, request_stream
from triollm.engine import (
    beam_search,
    config,
    core,
    inputs,
    outputs,
    pooling_outputs,
    pooling_params,
    request,
    sampling_params,
)

PUBLIC = [
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


def test_all_is_pinned() -> None:
    assert triollm.__all__ == PUBLIC
    assert sorted(set(triollm.__all__)) == triollm.__all__  # sorted, no duplicates


def test_every_name_resolves_to_its_definition() -> None:
    homes = {
        "LLM": llm,
        "AsyncEngineArgs": async_llm,
        "AsyncLLM": async_llm,
        "EngineBusyError": errors,
        "EngineDeadError": errors,
        "EngineGenerateError": errors,
        "LLMEngine": llm_engine,
        "CompletionOutput": outputs,
        "EngineArgs": config,
        "EngineCore": core,
        "EngineCoreRequest": request,
        "Logprob": outputs,
        "RequestOutput": outputs,
        "RequestOutputKind": sampling_params,
        "RequestStream": request_stream,
        "SamplingParams": sampling_params,
        "StructuredOutputsParams": sampling_params,
        "GuidedDecodingParams": sampling_params,  # vLLM's older name of the same class
        "BeamSearchParams": sampling_params,
        "TextPrompt": inputs,
        "TokensPrompt": inputs,
        "ClassificationOutput": pooling_outputs,
        "ClassificationRequestOutput": pooling_outputs,
        "EmbeddingOutput": pooling_outputs,
        "EmbeddingRequestOutput": pooling_outputs,
        "PoolingOutput": pooling_outputs,
        "PoolingRequestOutput": pooling_outputs,
        "ScoringOutput": pooling_outputs,
        "ScoringRequestOutput": pooling_outputs,
        "PoolingParams": pooling_params,
    }
    aliases = {"PromptType": inputs}  # a type alias: no __module__ of its own
    assert set(homes) | set(aliases) | {"__version__"} == set(PUBLIC)
    for name, module in homes.items():
        assert getattr(triollm, name) is getattr(module, name), name
        assert getattr(triollm, name).__module__ == module.__name__, name
    for name, module in aliases.items():
        assert getattr(triollm, name) is getattr(module, name), name
    assert triollm.GuidedDecodingParams is triollm.StructuredOutputsParams


# vLLM's modules that scripts import from, each with the names it re-exports here (vLLM's names
# that this engine has).
VLLM_MODULES = {
    "inputs": ["PromptType", "TextPrompt", "TokensPrompt"],
    "logprobs": ["Logprob", "PromptLogprobs", "SampleLogprobs"],
    "outputs": [
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
    ],
    "pooling_params": ["PoolingParams"],
    "sampling_params": [
        "BeamSearchParams",
        "GuidedDecodingParams",
        "RequestOutputKind",
        "SamplingParams",
        "SamplingType",
        "StructuredOutputsParams",
    ],
}
# The engine modules that define those names.
ENGINE_HOMES = (inputs, outputs, pooling_outputs, pooling_params, sampling_params, beam_search)


def _definition(name: str) -> object:
    """The one object the engine modules export under `name` (some re-export each other's)."""
    (obj,) = {id(getattr(m, name)): getattr(m, name) for m in ENGINE_HOMES if name in m.__all__}.values()
    return obj


def test_vllm_module_paths() -> None:
    for module_name, names in VLLM_MODULES.items():
        module = importlib.import_module(f"triollm.{module_name}")
        assert module.__all__ == names, module_name
        for name in names:
            obj = getattr(module, name)
            assert obj is _definition(name), (module_name, name)
            if name in triollm.__all__:
                assert obj is getattr(triollm, name), (module_name, name)
        namespace: dict[str, object] = {}
        exec(f"from triollm.{module_name} import *", namespace)
        assert set(namespace) - {"__builtins__"} == set(names), module_name


# Import lines as vLLM scripts and examples write them; `vllm` -> `triollm` is the whole port.
VLLM_SCRIPT_IMPORTS = [
    "from vllm import LLM, SamplingParams",
    "from vllm import PromptType, TextPrompt, TokensPrompt",
    "from vllm import EmbeddingRequestOutput, PoolingParams, RequestOutput, ScoringRequestOutput",
    "from vllm.sampling_params import BeamSearchParams, GuidedDecodingParams, RequestOutputKind",
    "from vllm.sampling_params import SamplingParams, StructuredOutputsParams",
    "from vllm.outputs import CompletionOutput, PoolingRequestOutput, RequestOutput",
    "from vllm.inputs import PromptType, TextPrompt, TokensPrompt",
    "from vllm.pooling_params import PoolingParams",
    "from vllm.logprobs import Logprob",
]


def test_vllm_script_imports() -> None:
    """In a fresh interpreter, as a ported script would run them."""
    code = "; ".join(line.replace("vllm", "triollm") for line in VLLM_SCRIPT_IMPORTS)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_star_import() -> None:
    namespace: dict[str, object] = {}
    exec("from triollm import *", namespace)
    assert set(namespace) - {"__builtins__"} == set(PUBLIC)


def test_version() -> None:
    assert isinstance(triollm.__version__, str)
    assert triollm.__version__ == importlib.metadata.version("triollm")


def test_import_is_light() -> None:
    code = (
        "import sys, triollm; "
        "heavy = sorted(m for m in ('transformers', 'triton') if m in sys.modules); "
        "print(','.join(heavy))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == ""


# The methods vLLM scripts call, and whether each is awaited there (vLLM's AsyncLLM, LLM and
# LLMEngine): a coroutine where vLLM's is one, a plain call or a property where vLLM's is.
ASYNC_LLM_COROUTINES = [
    "abort", "add_request", "check_health", "do_log_stats", "generate",
    "encode", "get_supported_tasks", "is_paused", "pause_generation", "reset_prefix_cache", "resume_generation",
]
ASYNC_LLM_PLAIN = ["from_engine_args", "get_tokenizer", "shutdown"]
ASYNC_LLM_PROPERTIES = ["dead_error", "errored", "is_running", "is_stopped", "model_config"]
LLM_METHODS = [
    "chat", "embed", "encode", "enqueue", "enqueue_chat", "from_engine_args", "generate", "get_default_sampling_params",
    "get_metrics", "get_tokenizer", "reset_prefix_cache", "score", "shutdown", "wait_for_completion",
]
LLM_ENGINE_METHODS = [
    "abort_request", "add_request", "do_log_stats", "from_engine_args", "get_metrics",
    "get_num_unfinished_requests", "get_tokenizer", "has_unfinished_requests", "reset_prefix_cache",
    "step",
]


def test_vllm_method_surface() -> None:
    import inspect

    for name in ASYNC_LLM_COROUTINES:
        fn = getattr(triollm.AsyncLLM, name)
        assert inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn), name
    for name in ASYNC_LLM_PLAIN:
        fn = getattr(triollm.AsyncLLM, name)
        assert callable(fn) and not inspect.iscoroutinefunction(fn), name
    for name in ASYNC_LLM_PROPERTIES:
        assert isinstance(inspect.getattr_static(triollm.AsyncLLM, name), property), name
    for cls, names in ((triollm.LLM, LLM_METHODS), (triollm.LLMEngine, LLM_ENGINE_METHODS)):
        for name in names:
            fn = getattr(cls, name)
            assert callable(fn) and not inspect.iscoroutinefunction(fn), (cls.__name__, name)
