"""`openai`: gpt-oss's tool calls, in the harmony format (see api/harmony.py).

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>

(one line, as the model writes it).

A message with a recipient is a call: the name is the recipient less `functions.`, the body its
arguments object. The `final` channel, and `commentary` without a recipient, are the content;
the `analysis` channel is dropped (with `--reasoning-parser gpt_oss` it was split off before this
parser runs, and what reaches it is the content with the calls left in it verbatim). Text that
is not harmony is content. So, unlike the other parsers, an output without calls may come back
with other content than its text: its channel markup removed.

A call message whose body is not a JSON object stays text, header and all. Streaming holds back
a header until its `<|message|>` and a call's body until its `{`; then the call is announced
and its arguments stream as they arrive. What follows the arguments up to the message's end is
dropped; a call whose arguments break after it was announced ends there (see _segments.py).
The markers are special tokens, so the server decodes with special tokens kept.
"""

from __future__ import annotations

from typing import ClassVar

from triollm.api.harmony import CallBody, CallClose, CallOpen, HarmonyReader, Plain
from triollm.api.tool_parsers._segments import ArgsStreamer, Broken, SegmentedToolParser, Segmenter, Text
from triollm.api.tool_parsers.abstract import ExtractedToolCalls

__all__ = ["OpenAIToolParser"]

# Where a call message is: waiting for its body's `{` (raw text kept), its arguments, the rest
# of its body (dropped), a body that is no call (text).
_WAIT, _ARGS, _REST, _VERBATIM = range(4)


class _HarmonySegmenter(Segmenter):
    def __init__(self) -> None:
        super().__init__()
        self._reader = HarmonyReader()
        self._state = _VERBATIM
        self._raw = ""  # the call message so far, while waiting
        self._body = ""  # its body so far, while waiting
        self._name = ""
        self._args = ArgsStreamer()

    def step(self, final: bool) -> bool:
        pieces, self.buf = self._reader.push(self.buf, final), ""
        for piece in pieces:
            match piece:
                case Plain(text):
                    self.text(text)
                case CallOpen(raw, recipient):
                    self._raw, self._body, self._state = raw, "", _WAIT
                    self._name = recipient.removeprefix("functions.")
                case CallBody(text):
                    self._call_text(text)
                case CallClose(raw):
                    if self._state == _ARGS:
                        self._args.push(self, "", final=True)
                    elif self._state in (_WAIT, _VERBATIM):
                        self.text(self._raw + raw)
                    self._raw, self._state = "", _VERBATIM
        return False

    def _call_text(self, text: str) -> None:
        if self._state == _WAIT:
            self._raw += text
            self._body += text
            body = self._body.lstrip()
            if not body:
                return
            if not (self._name and body.startswith("{")):
                self.text(self._raw)
                self._raw, self._state = "", _VERBATIM
                return
            self.start(self._name)
            self._raw, self._args, self._state, text = "", ArgsStreamer(), _ARGS, body
        if self._state == _ARGS:
            self._args.push(self, text, final=False)
            if self._args.ok is not None:
                self._state = _REST
        elif self._state == _VERBATIM:
            self.text(text)


class OpenAIToolParser(SegmentedToolParser):
    name: ClassVar[str] = "openai"
    keep_special_tokens: ClassVar[bool] = True

    def segmenter(self) -> Segmenter:
        return _HarmonySegmenter()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        found = super().extract_tool_calls(text)
        if found.tools_called:
            return found
        events = self.segmenter().push(text, final=True)
        if any(isinstance(event, Broken) for event in events):
            return found  # a call that broke: all text, as in every parser
        content = "".join(event.text for event in events if isinstance(event, Text))
        return ExtractedToolCalls(tools_called=False, tool_calls=[], content=content)
