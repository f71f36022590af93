"""Tool-call parsers: `--tool-call-parser NAME` picks how generated text becomes `tool_calls`.

The registry has vLLM's names and API: `ToolParserManager.get_tool_parser(name)`, the class
decorator `ToolParserManager.register_module(name)`, and `import_tool_parser(path)` for
`--tool-parser-plugin` (a Python file whose decorated classes register on import; they
subclass `ToolParser` from here, whose interface is this package's, not vLLM's).

Built in: `deepseek_v31`, `glm45` (`glm47`), `granite`, `hermes`, `kimi_k2`, `llama3_json`
(`llama4_json`), `mistral`, `openai` (gpt-oss), `phi4_mini_json`, `pythonic` (`llama4_pythonic`),
`qwen3_coder` (`qwen3_xml`). Each module's docstring shows its format.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, TypeVar

from triollm.api.parser_registry import ParserRegistry
from triollm.api.tool_parsers.abstract import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCallStream,
    ToolParser,
    make_tool_call_id,
)
from triollm.api.tool_parsers.deepseek_v31 import DeepSeekV31ToolParser
from triollm.api.tool_parsers.glm45 import Glm45ToolParser
from triollm.api.tool_parsers.granite import GraniteToolParser
from triollm.api.tool_parsers.hermes import HermesToolParser
from triollm.api.tool_parsers.kimi_k2 import KimiK2ToolParser
from triollm.api.tool_parsers.llama3_json import Llama3JsonToolParser
from triollm.api.tool_parsers.mistral import MistralToolParser
from triollm.api.tool_parsers.openai_harmony import OpenAIToolParser
from triollm.api.tool_parsers.phi4_mini import Phi4MiniJsonToolParser
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

C = TypeVar("C", bound=type[Any])


class ToolParserManager:
    """The registry of tool-call parsers, by name (vLLM's API on api/parser_registry.py)."""

    registry: ClassVar[ParserRegistry[ToolParser]] = ParserRegistry(
        ToolParser, "--tool-call-parser", "--tool-parser-plugin"
    )

    @classmethod
    def register_module(cls, name: str | list[str]) -> Callable[[C], C]:
        """Class decorator: register the parser under `name` (or each of several names); a
        later registration of a name replaces the earlier one."""
        return cls.registry.decorator(name)

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        return cls.registry.get(name)

    @classmethod
    def names(cls) -> list[str]:
        return cls.registry.names()

    @classmethod
    def import_tool_parser(cls, plugin_path: str) -> None:
        """Import the Python file at `plugin_path` (`--tool-parser-plugin`) so that the parsers
        it decorates with `register_module` register."""
        cls.registry.import_plugin(plugin_path)


for _names, _parser in (
    (["deepseek_v31"], DeepSeekV31ToolParser),
    (["glm45", "glm47"], Glm45ToolParser),
    (["granite"], GraniteToolParser),
    (["hermes"], HermesToolParser),
    (["kimi_k2"], KimiK2ToolParser),
    (["llama3_json", "llama4_json"], Llama3JsonToolParser),
    (["mistral"], MistralToolParser),
    (["openai"], OpenAIToolParser),
    (["phi4_mini_json"], Phi4MiniJsonToolParser),
    (["pythonic", "llama4_pythonic"], PythonicToolParser),
    (["qwen3_coder", "qwen3_xml"], Qwen3XmlToolParser),
):
    ToolParserManager.register_module(_names)(_parser)
