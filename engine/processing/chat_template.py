"""Chat templates: the jinja2 environment transformers renders them in, an LRU of compiled
templates, and the two ways a template renders.

Two kinds of template reach `Tokenizer.render_chat`. The tokenizer's own (the checkpoint's, or
`--chat-template`: chosen by whoever started the engine) renders as transformers renders it
(`render_own`): jinja2's `ImmutableSandboxedEnvironment` with `trim_blocks`, `lstrip_blocks`,
`loopcontrols`, a `tojson` that does not escape HTML, `raise_exception`, `strftime_now` and a
pass-through `{% generation %}` tag. A template passed with the call (a request's
`chat_template` behind `--trust-request-chat-template`, `LLM.chat(chat_template=...)`) is the
caller's code: it renders in the same environment with every hook counted, under a
`RenderBudget` scaled to the chat (`render_budgeted`, template_budget.py), and every way it can
fail, the budget's included, is a ValueError naming `chat_template`. A caller's template is
always its own text: nothing here reads a file (`--chat-template` may name one; the tokenizer
reads it once, at load).

Compiled templates of both kinds live in one `TemplateCache` per tokenizer, an LRU (64
templates, 4 MiB of source by default); before it, every distinct request template was kept for
good.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from collections.abc import Mapping
from datetime import datetime
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from triollm.engine.processing.template_budget import (
    BudgetedEnvironment,
    RenderBudget,
    TemplateBudgetError,
    counting,
)

__all__ = ["TemplateCache", "TemplateCacheStatistics", "render_budgeted", "render_own"]

_MAX_QUOTED = 300  # characters of a failing template's own error message quoted back


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        body: list[nodes.Node] = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return body


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's built-in tojson HTML-escapes; chat templates expect plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_OPTIONS: dict[str, Any] = {
    "trim_blocks": True,
    "lstrip_blocks": True,
    "extensions": [_GenerationTag, jinja2.ext.loopcontrols],
}
_GLOBALS: dict[str, Any] = {"raise_exception": _raise_exception, "strftime_now": _strftime_now}
_FILTERS: dict[str, Any] = {"tojson": _tojson}


@functools.cache
def _own_env() -> jinja2.Environment:
    env = ImmutableSandboxedEnvironment(**_OPTIONS)
    env.globals.update(_GLOBALS)
    env.filters.update(_FILTERS)
    return env


@functools.cache
def _budgeted_env() -> BudgetedEnvironment:
    return BudgetedEnvironment(globals=_GLOBALS, filters=_FILTERS, **_OPTIONS)


class TemplateCacheStatistics(NamedTuple):
    templates: int
    source_chars: int
    hits: int
    misses: int


class TemplateCache:
    """An LRU of compiled chat templates: at most `max_templates`, holding `max_chars` of source
    in all (a larger one is compiled and not kept). Safe across threads: renders run in worker
    threads."""

    def __init__(self, max_templates: int = 64, max_chars: int = 4 << 20) -> None:
        if max_templates < 1 or max_chars < 1:
            raise ValueError(f"max_templates, max_chars: must be positive, got {max_templates}, {max_chars}")
        self.max_templates, self.max_chars = max_templates, max_chars
        self._entries: OrderedDict[tuple[bool, str], jinja2.Template] = OrderedDict()
        self._chars = self._hits = self._misses = 0
        self._lock = threading.Lock()

    def get(self, source: str, *, budgeted: bool) -> jinja2.Template:
        """`source` compiled for `render_budgeted` (inside its `counting()` block: compiling
        folds constants through the counted hooks) or for `render_own`."""
        key = (budgeted, source)
        with self._lock:
            template = self._entries.get(key)
            if template is not None:
                self._entries.move_to_end(key)
                self._hits += 1
                return template
            self._misses += 1
        template = (_budgeted_env() if budgeted else _own_env()).from_string(source)  # not under the lock
        if len(source) <= self.max_chars:
            with self._lock:
                if key not in self._entries:
                    self._entries[key] = template
                    self._chars += len(source)
                while len(self._entries) > self.max_templates or self._chars > self.max_chars:
                    (_, old), _ = self._entries.popitem(last=False)
                    self._chars -= len(old)
        return template

    def statistics(self) -> TemplateCacheStatistics:
        with self._lock:
            return TemplateCacheStatistics(len(self._entries), self._chars, self._hits, self._misses)


def render_own(cache: TemplateCache, source: str, context: Mapping[str, Any]) -> str:
    """The model's own template (the checkpoint's, `--chat-template`), rendered as transformers
    renders it."""
    return cache.get(source, budgeted=False).render(**context)


def render_budgeted(cache: TemplateCache, source: str, context: Mapping[str, Any], budget: RenderBudget) -> str:
    """A caller's template: `source` (its text, always) rendered with `context` under `budget`
    scaled to what `context` holds. Every failure, the budget's included, is a ValueError whose
    message starts with `chat_template:` (the API's 400 names that field)."""
    if len(source) > budget.max_source:
        raise ValueError(f"chat_template: at most {budget.max_source} characters, got {len(source)}")
    try:
        with counting(budget.scaled_to(context)) as counters:
            parts = []
            for part in cache.get(source, budgeted=True).generate(**context):
                counters.emit(len(part))
                parts.append(part)
            return "".join(parts)
    except TemplateBudgetError as e:
        raise ValueError(f"chat_template: over the render budget: {e}") from None
    except jinja2.TemplateError as e:
        raise ValueError(f"chat_template: rendering failed: {_quoted(e)}") from None
    except Exception as e:  # the caller's code failed (TypeError, RecursionError...): a 400, not a 500
        raise ValueError(f"chat_template: rendering failed: {type(e).__name__}: {_quoted(e)}") from None


def _quoted(error: Exception) -> str:
    text = str(error)
    return text if len(text) <= _MAX_QUOTED else text[: _MAX_QUOTED - 3] + "..."
