"""The request log (vLLM's `--enable-log-requests`, `--enable-log-outputs`, `--max-log-len`):
one bounded line when a generation request is admitted and, with outputs logged, one when it
finishes. Off unless `ServerSettings.disable_log_requests` is False.

Without `max_log_len` a request line shows the prompt's length only (a prompt is a client's
text, and may be megabytes); with it, the first `max_log_len` characters and token ids. Output
text is cut to `max_log_len` characters, or to `LOG_VALUE_CHARS` without one: a line never
grows with what a client sent or the model wrote. The request id is the client's too (body
`request_id`, `X-Request-Id`): it passes through `log_safe` (engine/log_safe.py), so a newline
in it cannot start a forged line; the prompt and the output are written with `%r`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from triollm.api.log_bounds import LOG_VALUE_CHARS, short_repr, shorten
from triollm.api.state import ServerSettings
from triollm.engine.log_safe import log_safe

__all__ = ["log_output", "log_request"]

log = logging.getLogger("triollm.api")


def log_request(
    settings: ServerSettings,
    request_id: str,
    params: object,
    *,
    prompt: str | None = None,
    prompt_token_ids: Sequence[int] | None = None,
) -> None:
    if settings.disable_log_requests:
        return
    limit = settings.max_log_len
    size = len(prompt_token_ids) if prompt_token_ids is not None else len(prompt or "")
    unit = "prompt tokens" if prompt_token_ids is not None else "prompt chars"
    if limit is None:
        log.info("Received request %s: %d %s, params: %s", log_safe(request_id), size, unit, short_repr(params))
        return
    ids = None if prompt_token_ids is None else short_repr(list(prompt_token_ids[:limit]), LOG_VALUE_CHARS + 8 * limit)
    log.info(
        "Received request %s: prompt: %r, %d %s, prompt_token_ids: %s, params: %s",
        log_safe(request_id), shorten(prompt or "", limit), size, unit, ids, short_repr(params),
    )


def log_output(settings: ServerSettings, request_id: str, text: str, finish_reason: str | None) -> None:
    if settings.disable_log_requests or not settings.enable_log_outputs:
        return
    limit = settings.max_log_len if settings.max_log_len is not None else LOG_VALUE_CHARS
    shown = log_safe(request_id), shorten(text, limit), finish_reason
    log.info("Generated response %s: output: %r, finish_reason: %s", *shown)


class OutputLog:
    """`log_output` for a response's choices as their text arrives (streamed or whole): holds
    each choice's text only while outputs are logged, and at most the characters the line shows."""

    def __init__(self, settings: ServerSettings, request_id: str) -> None:
        self.settings = settings
        self.request_id = request_id
        self.active = not settings.disable_log_requests and settings.enable_log_outputs
        self._limit = settings.max_log_len if settings.max_log_len is not None else LOG_VALUE_CHARS
        self._texts: dict[int, str] = {}

    def add(self, index: int, text: str) -> None:
        if self.active and text:
            held = self._texts.get(index, "")
            if len(held) <= self._limit:
                self._texts[index] = (held + text)[: self._limit + 1]

    def done(self, index: int, finish_reason: str | None) -> None:
        if self.active:
            suffix = f"-{index}" if index else ""
            log_output(self.settings, self.request_id + suffix, self._texts.pop(index, ""), finish_reason)
