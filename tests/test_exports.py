"""The public surface of `triollm`: `__all__` is pinned, so adding or removing a name is a decision."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import triollm
from triollm.actors import async_llm, errors, llm, llm_engine, request_stream
from triollm.engine import config, core, inputs, outputs, request, sampling_params

PUBLIC = [
    "AsyncEngineArgs",
    "AsyncLLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineCore",
    "EngineCoreRequest",
    "EngineDeadError",
    "EngineGenerateError",
    "LLM",
    "LLMEngine",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "RequestStream",
    "SamplingParams",
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
        "TextPrompt": inputs,
        "TokensPrompt": inputs,
    }
    assert set(homes) | {"__version__"} == set(PUBLIC)
    for name, module in homes.items():
        assert getattr(triollm, name) is getattr(module, name), name
        assert getattr(triollm, name).__module__ == module.__name__, name


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
