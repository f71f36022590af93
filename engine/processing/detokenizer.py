"""Incremental detokenization and stop-string matching for streamed generation.

`IncrementalDetokenizer` turns output token ids into text pieces whose concatenation equals
decoding all the output ids at once. It uses the prefix/window algorithm of tokenizers'
`DecodeStream` (and vLLM's `detokenize_incrementally`), written out here so that it can be
flushed: the window holds the tokens of the last emitted piece plus the pending ones; each step
decodes the window and emits what extends the previous piece's text, unless the text ends in
U+FFFD (an incomplete UTF-8 character that later tokens may complete). At finish, `flush()`
emits what is still pending (with its U+FFFD, exactly as a full decode would). The window is
seeded with a short suffix of the prompt, so decoders that strip a leading space at the start
(sentencepiece's Metaspace) still give the first output token its space. Each step costs two
decodes of a few tokens: no re-decoding of the whole output.

Pathological case: if more than `MAX_PENDING` tokens in a row leave the text ending in U+FFFD
(a model emitting stray bytes), the pending text is emitted anyway to keep the cost bounded; if
later bytes then complete that character, the streamed text holds one extra U+FFFD.

`StopChecker` finds stop strings across token boundaries (the one that completes first, the
longest on a tie, so the result does not depend on how the text was split). When the stop string is excluded
from the output it holds back the longest suffix of the text that is a proper prefix of some
stop string, so a partial stop string is never emitted (the lag is at most the longest stop
string minus one character). With `include_stop_str_in_output` nothing needs holding back
(everything up to and including the stop string is output anyway), as in vLLM; a tail of the
text is still kept as search context for stop strings split across pieces.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Protocol

__all__ = ["MAX_PENDING", "IncrementalDetokenizer", "StopChecker"]

REPLACEMENT = "\ufffd"
MAX_PENDING = 32  # pending tokens after which text ending in U+FFFD is emitted anyway
_MIN_CONTEXT, _MAX_CONTEXT = 4, 24  # prompt-suffix sizes tried as decoding context


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Text deltas for one sequence of output tokens."""

    def __init__(
        self,
        tokenizer: _Decoder,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._window = _prompt_context(tokenizer, prompt_token_ids, skip_special_tokens)
        self._emitted = len(self._window)  # window[:_emitted] produced _prefix_text
        self._prefix_text = self._decode(self._window)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    @property
    def num_pending(self) -> int:
        """Tokens whose text has not been emitted yet (an incomplete character)."""
        return len(self._window) - self._emitted

    def step(self, token_ids: Sequence[int]) -> str:
        """Add output tokens; return the text they complete ("" while a character is incomplete)."""
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT):
            if self.num_pending <= MAX_PENDING:
                return ""
        return self._advance(text)

    def flush(self) -> str:
        """Emit whatever is pending (at finish); the stream then continues cleanly."""
        if self.num_pending == 0:
            return ""
        return self._advance(self._decode(self._window))

    def _advance(self, text: str) -> str:
        new_text = _extension(self._prefix_text, text)
        self._window = self._window[self._emitted :]
        self._emitted = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text


def _extension(prefix: str, text: str) -> str:
    """What `text` adds after `prefix`; when the decoder rewrote the prefix, after their common part."""
    if text.startswith(prefix):
        return text[len(prefix) :]
    return text[len(os.path.commonprefix([prefix, text])) :]


def _prompt_context(tokenizer: _Decoder, prompt: Sequence[int], skip: bool) -> list[int]:
    """The shortest prompt suffix (4..24 tokens) that decodes without a broken character."""
    if len(prompt) <= _MIN_CONTEXT:
        return list(prompt)
    for n in range(_MIN_CONTEXT, min(len(prompt), _MAX_CONTEXT) + 1):
        suffix = list(prompt[-n:])
        if REPLACEMENT not in tokenizer.decode(suffix, skip_special_tokens=skip):
            return suffix
    return list(prompt[-_MIN_CONTEXT:])


class StopChecker:
    """Stop-string matching over text that arrives in pieces."""

    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        self.stop = [s for s in stop if s]
        self.include_in_output = include_in_output
        self._context_len = max((len(s) for s in self.stop), default=1) - 1
        self._prefixes = frozenset(s[:i] for s in self.stop for i in range(1, len(s)))
        self._hold_back = bool(self._prefixes) and not include_in_output
        self._tail = ""  # the last _context_len characters seen
        self._held = 0  # characters at the end of _tail not emitted yet
        self.stopped: str | None = None

    @property
    def held_text(self) -> str:
        return self._tail[len(self._tail) - self._held :]

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Add `text`; return (text to emit now, the stop string that ended it or None).

        With `check=False` (fewer than min_tokens generated) no stop string is matched, but
        possible stop-string prefixes are still held back.
        """
        if self.stopped is not None:
            return "", self.stopped
        if not self.stop:
            return text, None
        buf = self._tail + text
        start = len(self._tail) - self._held  # first character not emitted yet
        match = self._find(buf, len(self._tail)) if check else None
        if match is not None:
            index, stop = match
            end = index + len(stop) if self.include_in_output else index
            self.stopped, self._held, self._tail = stop, 0, ""
            return buf[start : max(start, end)], stop
        held = self._held_suffix(buf) if self._hold_back else 0
        self._held = held
        self._tail = buf[max(0, len(buf) - self._context_len) :]
        return buf[start : len(buf) - held], None

    def flush(self) -> str:
        """Release the held-back text (the request finished without completing a stop string)."""
        text = self.held_text
        self._held = 0
        return text

    def _find(self, buf: str, new_from: int) -> tuple[int, str] | None:
        """The stop string in `buf` that ends first after `new_from` (the longest on a tie).

        Ending first is what matching character by character would find, so the result does
        not depend on how the text was split into pieces.
        """
        best: tuple[int, int, str] | None = None  # (end, index, stop)
        for stop in self.stop:
            index = buf.find(stop, max(0, new_from - len(stop) + 1))
            if index >= 0 and (best is None or (index + len(stop), index) < best[:2]):
                best = (index + len(stop), index, stop)
        return None if best is None else (best[1], best[2])

    def _held_suffix(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        for n in range(min(len(buf), self._context_len), 0, -1):
            if buf[-n:] in self._prefixes:
                return n
        return 0
