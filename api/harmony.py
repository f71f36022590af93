"""gpt-oss's harmony format, read as text while it arrives: what the `gpt_oss` reasoning parser
and the `openai` tool-call parser share.

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>
    {"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

An output is a run of messages: a header (from `<|start|>`, or from `<|channel|>` where the chat
template already wrote `<|start|>assistant` into the prompt, up to `<|message|>`), then a body up
to `<|end|>`, `<|call|>`, `<|return|>` or the next `<|start|>`. The last two are stop tokens, so
the final body usually just ends with the output. A header names a channel (`analysis`,
`commentary`, `final`) and, for a tool call, a recipient (` to=functions.NAME`, before or after
the channel; `<|constrain|>json` may follow). The markers are special tokens: the parsers ask the
server to decode them (`keep_special_tokens`).

`HarmonyReader` cuts the text into pieces, as vLLM's harmony parser reads the messages:

- `Plain`: text outside any message, and the bodies of `final` messages and of `commentary`
  messages without a recipient (the model's preambles) — the content;
- `Thought`: the bodies of `analysis` messages — the reasoning;
- `CallOpen` / `CallBody` / `CallClose`: a message with a recipient (a tool call), its header,
  body and terminator verbatim ("" when the output ended first);
- other messages (another channel, no recipient) are dropped, as vLLM drops them.

Consecutive messages of one kind are joined with a newline (vLLM's "\\n".join). A header that has
no `<|message|>` within `MAX_HEADER` characters, or when the output ends, is no header: its
opening marker is plain text and reading goes on after it. The reader holds back only a possible
beginning of a marker and an unfinished header, so the same text cut anywhere gives the same
pieces (merged), and a piece is never taken back.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from triollm.api.text_markers import earliest, held

__all__ = [
    "CALL_END",
    "CallBody",
    "CallClose",
    "CallOpen",
    "HarmonyReader",
    "MAX_HEADER",
    "MESSAGE",
    "Piece",
    "Plain",
    "Thought",
]

START: Final = "<|start|>"
CHANNEL: Final = "<|channel|>"
MESSAGE: Final = "<|message|>"
CALL_END: Final = "<|call|>"
_OPENERS: Final = (START, CHANNEL)
_ENDS: Final = ("<|end|>", CALL_END, "<|return|>")
_BODY_STOPS: Final = (*_ENDS, START)  # START ends a body without being consumed
MAX_HEADER: Final = 512
_CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")


@dataclass(slots=True)
class Plain:
    text: str


@dataclass(slots=True)
class Thought:
    text: str


@dataclass(slots=True)
class CallOpen:
    raw: str  # the header, verbatim
    recipient: str  # e.g. "functions.get_weather"


@dataclass(slots=True)
class CallBody:
    text: str


@dataclass(slots=True)
class CallClose:
    raw: str  # the terminator, verbatim; "" when the output ended in the body


Piece = Plain | Thought | CallOpen | CallBody | CallClose


# What a message's body is.
_PLAIN, _THOUGHT, _CALL, _DROPPED = range(4)
# Where the reader is.
_OUTSIDE, _HEADER, _BODY = range(3)


class HarmonyReader:
    """One output's pieces, as its text arrives (see the module docstring)."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = _OUTSIDE
        self._header = ""  # the header read so far, opening marker included
        self._kind = _PLAIN  # of the current body
        self._sent = {_PLAIN: False, _THOUGHT: False}  # text of that kind was sent
        self._joined = False  # the current body's newline separator was decided

    def push(self, text: str, final: bool) -> list[Piece]:
        """The next piece of output (`final`: the output ended); the pieces it completes."""
        self._buf += text
        out: list[Piece] = []
        while self._step(out, final):
            pass
        return out

    def _step(self, out: list[Piece], final: bool) -> bool:
        buf = self._buf
        if self._state == _OUTSIDE:
            found = earliest(buf, _OPENERS)
            end = found[0] if found else len(buf) - (0 if final else held(buf, _OPENERS))
            self._plain(out, buf[:end])
            if found is None:
                self._buf = buf[end:]
                return False
            self._header, self._buf, self._state = found[1], buf[end + len(found[1]) :], _HEADER
            return True
        if self._state == _HEADER:
            limit = MAX_HEADER - len(self._header)  # where `<|message|>` may start, at the latest
            i = buf.find(MESSAGE, 0, limit + len(MESSAGE))
            if i < 0 and not final and len(buf) - held(buf, (MESSAGE,)) <= limit:
                return False  # it may still come
            if i < 0:  # no header: its opener is text
                self._plain(out, self._header)
                self._state = _OUTSIDE
                return True
            self._open(out, self._header + buf[: i + len(MESSAGE)])
            self._buf, self._state = buf[i + len(MESSAGE) :], _BODY
            return True
        found = earliest(buf, _BODY_STOPS)
        end = found[0] if found else len(buf) - (0 if final else held(buf, _BODY_STOPS))
        self._body(out, buf[:end])
        if found is None and not final:
            self._buf = buf[end:]
            return False
        marker = found[1] if found and found[1] != START else ""
        if self._kind == _CALL:
            out.append(CallClose(marker))
        self._buf, self._state = buf[end + len(marker) :], _OUTSIDE
        return True

    def _open(self, out: list[Piece], header: str) -> None:
        channel = _CHANNEL_NAME.search(header)
        recipient = _RECIPIENT.search(header)
        name = channel.group(1) if channel else ""
        self._joined = False
        if recipient is not None:
            self._kind = _CALL
            out.append(CallOpen(header, recipient.group(1)))
        elif name == "analysis":
            self._kind = _THOUGHT
        elif name in ("final", "commentary"):
            self._kind = _PLAIN
        else:
            self._kind = _DROPPED

    def _body(self, out: list[Piece], text: str) -> None:
        if not text or self._kind == _DROPPED:
            return
        if self._kind == _CALL:
            out.append(CallBody(text))
            return
        if not self._joined:
            self._joined = True
            if self._sent[self._kind]:
                text = "\n" + text
        self._sent[self._kind] = True
        out.append(Plain(text) if self._kind == _PLAIN else Thought(text))

    def _plain(self, out: list[Piece], text: str) -> None:
        if text:
            self._sent[_PLAIN] = True
            out.append(Plain(text))
