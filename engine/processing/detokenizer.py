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
longest on a tie, so the result does not depend on how the text was split). When the stop string
is excluded from the output it holds back the longest suffix of the text that is a proper prefix
of some stop string, so a partial stop string is never emitted (the lag is at most the longest
stop string minus one character). With `include_stop_str_in_output` nothing needs holding back
(everything up to and including the stop string is output anyway), as in vLLM.

Stop matching is linear, whatever the client sends. For each stop string the checker keeps one
number, its Knuth-Morris-Pratt state: the length of the longest suffix of the text so far that
is a prefix of that stop string. Each new character moves the state forward, or back along the
stop string's failure function (the longest proper border of each prefix) on a mismatch; a state
that reaches the full length is a match ending at that character, so the first match found is
the one that completes first, and a match that spans pieces needs no saved text. The held-back
suffix is the largest state, and it is the prefix of that stop string: held text is kept as a
slice of the stop string, never copied per step. While a state is 0 the checker jumps to the
next occurrence of the stop string's first character with `str.find`, so ordinary text costs
one C-level search per piece and stop string. The failure function is built lazily, only as far
as a state has reached: setting up a checker costs nothing per character of its stop strings,
and a 100,000-character stop string costs memory and time only for the part the text matched.
Cost: amortised O(1) per character and stop string; one piece at worst O(its length plus the
longest stop string) (a long partial match falling back).

Rejected: the earlier design stored every prefix of every stop string in a set (memory and time
quadratic in the stop string's length, per `n` child; one 100,000-character stop string took
gigabytes), and kept the last `max_stop_len - 1` characters as search context, copied per step.
Searching only that tail window with `str.find` is linear for the match itself, but finding the
held-back suffix by testing suffixes is quadratic on inputs like "abab...ac". Aho-Corasick (one
automaton over all stop strings) costs a dict per character of stop string (some hundred bytes
each), for requests that carry a handful of stop strings.
"""

from __future__ import annotations

import os
from array import array
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
    """Stop-string matching over text that arrives in pieces (see the module docstring)."""

    def __init__(self, stop: Sequence[str], include_in_output: bool = False) -> None:
        self.stop = list(dict.fromkeys(s for s in stop if s))
        self.include_in_output = include_in_output
        self._matchers = [_StopMatcher(s) for s in self.stop]
        # The held-back text, always a slice of one stop string: (stop, start, end).
        self._held: tuple[str, int, int] = ("", 0, 0)
        self.stopped: str | None = None

    @property
    def held_text(self) -> str:
        stop, start, end = self._held
        return stop[start:end]

    def feed(self, text: str, check: bool = True) -> tuple[str, str | None]:
        """Add `text`; return (text to emit now, the stop string that ended it or None).

        With `check=False` (fewer than min_tokens generated) no stop string is matched, but
        possible stop-string prefixes are still held back.
        """
        if self.stopped is not None:
            return "", self.stopped
        if not self._matchers:
            return text, None
        _, start, end = self._held
        num_unemitted = end - start + len(text)
        match = self._advance(text, check)
        if match is not None:
            match_end, stop = match  # where in `text` the match ends
            cut = end - start + match_end  # where in (held text + text) it ends
            out = self._unemitted_prefix(
                text, cut if self.include_in_output else max(0, cut - len(stop))
            )
            self.stopped, self._held = stop, ("", 0, 0)
            return out, stop
        if self.include_in_output:
            return text, None  # nothing is ever held back
        top = max(self._matchers, key=_state)
        hold = min(top.state, num_unemitted)  # less only after a flush
        out = self._unemitted_prefix(text, num_unemitted - hold)
        self._held = (top.stop, top.state - hold, top.state)
        return out, None

    def flush(self) -> str:
        """Release the held-back text (the request finished without completing a stop string)."""
        text = self.held_text
        self._held = ("", 0, 0)
        return text

    def _advance(self, text: str, check: bool) -> tuple[int, str] | None:
        """Feed `text` to every matcher; with `check`, the stop string whose match ends first
        (the longest on a tie) and where in `text` it ends. The matchers after the first match
        only look as far as it: their states no longer matter once the checker stops."""
        best: tuple[int, int, str] | None = None  # (end, -len(stop), stop)
        limit = len(text)
        for matcher in self._matchers:
            end = matcher.advance(text, limit, check)
            if end is not None:
                candidate = (end, -len(matcher.stop), matcher.stop)
                if best is None or candidate < best:
                    best, limit = candidate, end
        return None if best is None else (best[0], best[2])

    def _unemitted_prefix(self, text: str, n: int) -> str:
        """The first n characters of (held text + text), copying no more than that."""
        stop, start, end = self._held
        if n <= end - start:
            return stop[start : start + n]
        return stop[start:end] + text[: n - (end - start)]


def _state(matcher: _StopMatcher) -> int:
    return matcher.state


class _StopMatcher:
    """One stop string and its Knuth-Morris-Pratt state over the text fed so far."""

    __slots__ = ("_fail", "state", "stop")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.state = 0  # the longest suffix of the text so far that is a prefix of `stop`
        # _fail[i]: the longest proper border of stop[: i + 1], computed as far as needed.
        self._fail = array("l")

    def advance(self, text: str, end: int, check: bool) -> int | None:
        """Feed text[:end]; with `check`, stop at the first match and return where it ends
        (exclusive). Without, a match is passed over: the state goes on from its border."""
        stop, k, length = self.stop, self.state, len(self.stop)
        first = stop[0]
        i = 0
        while i < end:
            if k == 0:  # skip ahead in C to where a match could start
                i = text.find(first, i, end)
                if i < 0:
                    break
                k, i = 1, i + 1
            else:
                c = text[i]
                while k and stop[k] != c:
                    k = self._border(k)
                if stop[k] == c:
                    k += 1
                i += 1
            if k == length:
                if check:
                    self.state = k
                    return i
                k = self._border(k)
        self.state = k
        return None

    def _border(self, k: int) -> int:
        """The longest proper border of stop[:k] (0 < k <= len(stop))."""
        fail, stop = self._fail, self.stop
        for i in range(len(fail), k):
            if i == 0:
                fail.append(0)
                continue
            j = fail[i - 1]
            while j and stop[i] != stop[j]:
                j = fail[j - 1]
            fail.append(j + 1 if stop[i] == stop[j] else j)
        return fail[k - 1]
