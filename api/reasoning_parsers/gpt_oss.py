"""gpt-oss's reasoning: `gpt_oss` (vLLM's `openai_gptoss`), the harmony format's channels.

    <|channel|>analysis<|message|>The user asks for a greeting.<|end|>
    <|start|>assistant<|channel|>final<|message|>Hello!

The `analysis` channel is the reasoning; the `final` channel, and `commentary` without a recipient
(a preamble the model says before a call), is the content. A tool call (a message with
` to=functions.NAME`) is left in the content verbatim, header and all, for the `openai` tool-call
parser; text that is not harmony at all is content. See api/harmony.py for how the messages are
read.

A structured output (`response_format`, a forced tool call) holds from the first token, as in
vLLM, whose parser reports the reasoning as already ended: the grammar does not wait for a
channel marker (a forced call would come in the `commentary` channel, never after `final`).
"""

from __future__ import annotations

from typing import ClassVar

from triollm.api.harmony import CallBody, CallClose, CallOpen, HarmonyReader, Plain, Thought
from triollm.api.reasoning_parsers.abstract import ReasoningParser, ReasoningStream

__all__ = ["GptOssReasoningParser"]


class GptOssReasoningParser(ReasoningParser):
    name: ClassVar[str] = "gpt_oss"
    start_token: ClassVar[str] = "<|channel|>analysis<|message|>"
    end_token: ClassVar[str] = "<|channel|>final<|message|>"
    keep_special_tokens: ClassVar[bool] = True

    def expects_reasoning(self) -> bool:
        return False

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        stream = _HarmonyStream()
        reasoning, content = stream.feed(text)
        rest = stream.finish()
        return (reasoning + rest[0]) or None, (content + rest[1]) or None

    def stream(self) -> ReasoningStream:
        return _HarmonyStream()


class _HarmonyStream(ReasoningStream):
    def __init__(self) -> None:
        self._reader = HarmonyReader()

    def feed(self, delta: str) -> tuple[str, str]:
        return self._split(delta, final=False)

    def finish(self) -> tuple[str, str]:
        return self._split("", final=True)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        for piece in self._reader.push(text, final):
            match piece:
                case Thought(text):
                    reasoning.append(text)
                case Plain(text) | CallBody(text):
                    content.append(text)
                case CallOpen(raw) | CallClose(raw):
                    content.append(raw)
        return "".join(reasoning), "".join(content)
