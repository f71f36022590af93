"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's names): a registry and the parsers.

`ReasoningParserManager` maps names to parser classes: the built-in ones below, classes that
`register_module` adds, and modules loaded with `import_reasoning_parser(path)` (vLLM's
`--reasoning-parser-plugin`), which register themselves the same way.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, TypeVar

from triollm.api.reasoning_parsers.abstract import ReasoningParser, ReasoningStream
from triollm.api.reasoning_parsers.deepseek import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
)
from triollm.api.reasoning_parsers.qwen3 import Qwen3ReasoningParser
from triollm.api.reasoning_parsers.think import ThinkTagReasoningParser

__all__ = [
    "DeepSeekR1ReasoningParser",
    "DeepSeekV3ReasoningParser",
    "Qwen3ReasoningParser",
    "ReasoningParser",
    "ReasoningParserManager",
    "ReasoningStream",
    "ThinkTagReasoningParser",
]

P = TypeVar("P", bound=type[ReasoningParser])


class ReasoningParserManager:
    """The registry of reasoning parsers by name (class-level, as vLLM's)."""

    _parsers: ClassVar[dict[str, type[ReasoningParser]]] = {}

    @classmethod
    def register_module(cls, name: str | list[str] | None = None, *, force: bool = True) -> Callable[[P], P]:
        """A class decorator registering a parser under `name` (or each of a list; by default
        the class's `name`). A name already taken is replaced unless `force` is false."""

        def register(parser: P) -> P:
            if not (isinstance(parser, type) and issubclass(parser, ReasoningParser)):
                raise TypeError(f"register_module: expected a ReasoningParser subclass, got {parser!r}")
            names = [name] if isinstance(name, str) else list(name) if name is not None else [parser.name]
            for n in names:
                if not force and n in cls._parsers:
                    raise ValueError(f"--reasoning-parser: {n!r} is already registered to {cls._parsers[n].__name__}")
                cls._parsers[n] = parser
            return parser

        return register

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        try:
            return cls._parsers[name]
        except KeyError:
            raise ValueError(
                f"--reasoning-parser: unknown parser {name!r}; known: {', '.join(cls.names())}"
            ) from None

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._parsers)

    @classmethod
    def import_reasoning_parser(cls, path: str | Path) -> None:
        """Run a plugin module (a .py file) that registers its parsers with `register_module`."""
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"--reasoning-parser-plugin: no such file: {str(path)!r}")
        module_name = f"triollm_reasoning_plugin_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--reasoning-parser-plugin: cannot load {str(path)!r} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise


for _parser in (DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser, Qwen3ReasoningParser):
    ReasoningParserManager.register_module()(_parser)
