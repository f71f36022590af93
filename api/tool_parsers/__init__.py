"""Tool-call parsers: `--tool-call-parser NAME` picks how generated text becomes `tool_calls`.

The registry has vLLM's names and API: `ToolParserManager.get_tool_parser(name)`, the class
decorator `ToolParserManager.register_module(name)`, and `import_tool_parser(path)` for
`--tool-parser-plugin` (a Python file whose decorated classes register on import; they
subclass `ToolParser` from here, whose interface is this package's, not vLLM's).

Built in: `hermes`, `llama3_json` (`llama4_json`), `mistral`, `pythonic` (`llama4_pythonic`),
`qwen3_coder` (`qwen3_xml`). Each module's docstring shows its format.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar, TypeVar

from triollm.api.tool_parsers.abstract import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCallStream,
    ToolParser,
    make_tool_call_id,
)
from triollm.api.tool_parsers.hermes import HermesToolParser
from triollm.api.tool_parsers.llama3_json import Llama3JsonToolParser
from triollm.api.tool_parsers.mistral import MistralToolParser
from triollm.api.tool_parsers.pythonic import PythonicToolParser
from triollm.api.tool_parsers.qwen3_xml import Qwen3XmlToolParser

__all__ = [
    "ExtractedToolCalls",
    "StreamDelta",
    "ToolCallStream",
    "ToolParser",
    "ToolParserManager",
    "make_tool_call_id",
]

_P = TypeVar("_P", bound=type[ToolParser])


class ToolParserManager:
    """The registry of tool-call parsers, by name."""

    _parsers: ClassVar[dict[str, type[ToolParser]]] = {}

    @classmethod
    def register_module(cls, name: str | list[str]) -> Callable[[_P], _P]:
        """Class decorator: register the parser under `name` (or each of several names); a
        later registration of a name replaces the earlier one."""
        names = [name] if isinstance(name, str) else list(name)
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"register_module: name must be a non-empty string, got {name!r}")

        def register(parser: _P) -> _P:
            if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
                raise ValueError(f"register_module: {parser!r} is not a ToolParser subclass")
            for n in names:
                cls._parsers[n] = parser
            return parser

        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        try:
            return cls._parsers[name]
        except KeyError:
            known = ", ".join(cls.names())
            raise ValueError(
                f"--tool-call-parser: unknown parser {name!r}; known parsers: {known}"
            ) from None

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls._parsers)

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Import the Python file at `plugin_path` (`--tool-parser-plugin`) so that the parsers
        it decorates with `register_module` register."""
        path = Path(plugin_path)
        if not path.is_file():
            raise ValueError(f"--tool-parser-plugin: {plugin_path} is not a file")
        module_name = f"triollm_tool_parser_plugin_{path.stem}"
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--tool-parser-plugin: {plugin_path} is not a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise ValueError(
                f"--tool-parser-plugin: importing {plugin_path} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


for _names, _parser in (
    (["hermes"], HermesToolParser),
    (["llama3_json", "llama4_json"], Llama3JsonToolParser),
    (["mistral"], MistralToolParser),
    (["pythonic", "llama4_pythonic"], PythonicToolParser),
    (["qwen3_coder", "qwen3_xml"], Qwen3XmlToolParser),
):
    ToolParserManager.register_module(_names)(_parser)
