"""The tool-call parser interface: one `ToolParser` per model family turns generated text into
OpenAI `tool_calls`, for a whole output at once (`extract_tool_calls`) or piece by piece while
it streams (`stream()` gives a fresh `ToolCallStream` per choice).

Contract of a stream: `feed` returns at once the text that can no longer be part of a call as
`content` (a parser holds back only what may still turn out to be call syntax, e.g. a trailing
"<tool_" or a whole call region it cannot stream); the first `DeltaToolCall` of call `i`
carries `index=i`, `id`, `type="function"` and `function.name`, later ones pieces of
`function.arguments`. The pieces of call `i`, from `feed` through `finish`, concatenate to a
JSON object. `finish` flushes whatever was held back.
"""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from triollm.api.protocol import DeltaToolCall, ToolCall

if TYPE_CHECKING:
    from triollm.engine.processing.tokenizer import Tokenizer

__all__ = [
    "ExtractedToolCalls",
    "StreamDelta",
    "ToolCallStream",
    "ToolParser",
    "make_tool_call_id",
]


def make_tool_call_id() -> str:
    """vLLM's tool-call id: `chatcmpl-tool-` and 32 hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ExtractedToolCalls:
    """The calls found in a whole output, and the text around them."""

    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None  # the text around the calls (None when there is none)


@dataclass
class StreamDelta:
    """What one piece of streamed output adds: plain text and tool-call pieces."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)


class ToolCallStream(ABC):
    """The streaming state of one choice."""

    @abstractmethod
    def feed(self, delta: str) -> StreamDelta:
        """The next piece of output text."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The output ended: flush what was held back."""


class ToolParser(ABC):
    """Parses one model family's tool-call syntax.

    `tools` is the request's OpenAI `tools` list
    (`[{"type": "function", "function": {"name", "description", "parameters"}}]`).
    """

    name: ClassVar[str]  # vLLM's --tool-call-parser name
    # True when the call markers are special tokens (mistral's [TOOL_CALLS]): the server then
    # decodes with skip_special_tokens=False so that the parser sees them.
    keep_special_tokens: ClassVar[bool] = False

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools: list[Mapping[str, Any]] = list(tools or [])

    def new_call_id(self) -> str:
        """The id of a new call (some model families have their own shape)."""
        return make_tool_call_id()

    @abstractmethod
    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls in a whole output. Never raises: output that is not a well-formed call
        stays content."""

    @abstractmethod
    def stream(self) -> ToolCallStream:
        """Fresh streaming state for one choice."""
