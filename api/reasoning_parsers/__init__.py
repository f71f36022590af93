"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's names): a registry and the parsers.

`ReasoningParserManager` maps names to parser classes: the built-in ones below, classes that
`register_module` adds, and modules loaded with `import_reasoning_parser(path)` (vLLM's
`--reasoning-parser-plugin`), which register themselves the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from triollm.api.parser_registry import ParserRegistry
from triollm.api.reasoning_parsers.abstract import ReasoningParser, ReasoningStream
from triollm.api.reasoning_parsers.deepseek import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
)
from triollm.api.reasoning_parsers.gpt_oss import GptOssReasoningParser
from triollm.api.reasoning_parsers.granite import GraniteReasoningParser
from triollm.api.reasoning_parsers.mistral import MistralReasoningParser
from triollm.api.reasoning_parsers.olmo3 import Olmo3ReasoningParser
from triollm.api.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from triollm.api.reasoning_parsers.think import ThinkTagReasoningParser

__all__ = [
    "DeepSeekR1ReasoningParser",
    "DeepSeekV3ReasoningParser",
    "GptOssReasoningParser",
    "GraniteReasoningParser",
    "MistralReasoningParser",
    "Olmo3ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningParserManager",
    "ReasoningStream",
    "ThinkTagReasoningParser",
]

C = TypeVar("C", bound=type[Any])


class ReasoningParserManager:
    """The registry of reasoning parsers by name (vLLM's API on api/parser_registry.py)."""

    registry: ClassVar[ParserRegistry[ReasoningParser]] = ParserRegistry(
        ReasoningParser, "--reasoning-parser", "--reasoning-parser-plugin"
    )

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, *, force: bool = True) -> Callable[[C], C]:
        """A class decorator registering a parser under `name` (or each of a list; by default
        the class's `name`). A name already taken is replaced unless `force` is false."""
        return cls.registry.decorator(name, force=force)

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        return cls.registry.get(name)

    @classmethod
    def names(cls) -> list[str]:
        return cls.registry.names()

    @classmethod
    def import_reasoning_parser(cls, path: str | Path) -> None:
        """Run a plugin module (a .py file) that registers its parsers with `register_module`."""
        cls.registry.import_plugin(path)


for _parser in (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    GraniteReasoningParser,
    MistralReasoningParser,
    Olmo3ReasoningParser,
    Qwen3ReasoningParser,
):
    ReasoningParserManager.register_module()(_parser)
ReasoningParserManager.register_module(["gpt_oss", "openai_gptoss"])(GptOssReasoningParser)
