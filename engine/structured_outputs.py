"""Structured outputs: a grammar every output of a request follows, enforced with llguidance.

`SamplingParams(structured_outputs=StructuredOutputsParams(json=... | regex=... | choice=[...] |
grammar=... | json_object=True))`, as in vLLM. The grammar engine is llguidance, not vLLM's
default xgrammar, by measurement (docs/architecture.md, "Structured outputs"): one wheel with no
dependencies (xgrammar pulls transformers, pydantic and apache-tvm-ffi).

Three places, none of them the engine step or the event loop:
- The input processor calls `check` (in a worker thread: `AsyncLLM.add_request`), which turns
  the params into llguidance's grammar text (at most `MAX_GRAMMAR_CHARS`) and validates it in a
  thread of its own, cached by that text: an invalid schema, regex or grammar is a `ValueError`
  naming the field before anything reaches the core.
- The engine core hands each structured request to its `GrammarCompiler` (`submit`) and adds
  it to the scheduler only once its matcher is ready, so a slow compile delays that request
  alone. The compiler has two threads: one turns the params into text and copies a cached
  compiled grammar (milliseconds), the other compiles what is not cached (llguidance releases
  the GIL while it compiles). An abort drops a request still compiling.
- The sampler masks the logits of the rows that have a matcher (`fill_bitmask`,
  `apply_bitmask`), before logprobs are taken, as vLLM does; the core feeds each sampled token to
  its matcher, and a matcher that reached the end of its grammar finishes the request ("stop").

What one grammar may cost is bounded. Its text is at most `MAX_GRAMMAR_CHARS`, and llguidance
runs with `PARSER_LIMITS` (lexer fuel and Earley items per mask, lexer states, grammar size), so
one mask takes milliseconds at most. llguidance recurses once per level of a grammar's rules
(a chain of a few thousand rules, or of `$ref`s, overflows a default 8 MiB thread stack: a
segfault, the whole server), so it only runs in threads with a `_STACK_BYTES` stack, which
holds the deepest grammar of `MAX_GRAMMAR_CHARS`. A JSON schema nests at most
`MAX_SCHEMA_DEPTH` levels, counted without recursion before anything here recurses into it
(`json.loads` of a schema string, `_no_additional_properties`, `json.dumps`). The caches are
bounded in entries and in estimated bytes (`VALIDATION_CACHE_BYTES`, `COMPILED_CACHE_BYTES`).
Whatever llguidance does wrong at run time (an exception of any type, an error state) is kept
in the request's `Grammar` and ends that request alone, with finish reason "error".

Preemption needs nothing: a preempted request keeps its output tokens (only their KV is
recomputed), so its matcher stays where it was.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from triollm.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

__all__ = [
    "COMPILED_CACHE_BYTES",
    "MAX_GRAMMAR_CHARS",
    "MAX_SCHEMA_DEPTH",
    "PARSER_LIMITS",
    "VALIDATION_CACHE_BYTES",
    "Grammar",
    "GrammarCompiler",
    "SizedCache",
    "apply_bitmask",
    "check",
    "fill_bitmask",
    "grammar_text",
]

log = logging.getLogger("triollm")

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

# The longest grammar text llguidance is given (a JSON schema's grammar is about its JSON text).
# It bounds the compile (about a second for the slowest grammars this long) and, with
# `_STACK_BYTES`, llguidance's recursion.
MAX_GRAMMAR_CHARS = 512 << 10
# Levels of JSON a schema nests (the server holds a request's JSON to as many:
# api/protocol.py, MAX_JSON_DEPTH); real schemas nest a handful.
MAX_SCHEMA_DEPTH = 64
# The stack of every thread llguidance validates or compiles in: the deepest grammar of
# MAX_GRAMMAR_CHARS (some 40,000 chained rules) needs less than a quarter of it. Only the pages
# a deep grammar touches are ever allocated.
_STACK_BYTES = 256 << 20
# llguidance's resource limits (`LLParserLimits`), the same for validation and compiling. The
# per-mask ones (llguidance's defaults: about 15 ms of lexer work and 2.5 ms of Earley items
# at most) bound what a grammar adds to a step; the lexer-state limit bounds a matcher's memory
# (a state costs 1-2 kB: at most ~100 MB, a fifth of llguidance's default); a grammar over one
# is an error for its request alone.
PARSER_LIMITS: dict[str, int] = {
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "initial_lexer_fuel": 1_000_000,
    "max_lexer_states": 50_000,
    "max_grammar_size": 500_000,
}
# The caches, bounded in entries and in estimated bytes. A validation entry holds its key text
# and its error; a compiled grammar is estimated at `_COMPILED_BYTES_PER_CHAR` bytes per
# character of its text (measured from a fraction of a byte for a large enum to ~90 for a
# schema of many string patterns) plus `_ENTRY_BYTES`.
VALIDATION_CACHE_BYTES = 16 << 20
COMPILED_CACHE_BYTES = 64 << 20
_CACHE_ENTRIES = 256
_COMPILED_BYTES_PER_CHAR = 64
_ENTRY_BYTES = 16 << 10
_JOIN_S = 5.0  # closing: a running compile ends within about a second (MAX_GRAMMAR_CHARS)
_BITS = torch.arange(32, dtype=torch.int32)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise ValueError(
            "structured_outputs: needs the llguidance package (pip install llguidance)"
        ) from None
    return llguidance


def grammar_text(so: StructuredOutputsParams) -> str:
    """llguidance's grammar for the params, at most `MAX_GRAMMAR_CHARS` long (ValueError naming
    the field when malformed or too long)."""
    field = f"structured_outputs.{so.kind}"
    for source in (so.json, so.regex, so.grammar):  # refused before any work on it
        if isinstance(source, str) and len(source) > MAX_GRAMMAR_CHARS:
            raise ValueError(f"{field}: {len(source)} characters, more than the {MAX_GRAMMAR_CHARS} allowed")
    if so.json is not None and _schema_depth(so.json) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{field}: nested deeper than {MAX_SCHEMA_DEPTH} levels")
    try:
        text = _grammar_text(so, _llguidance())
    except RecursionError:
        raise ValueError(f"{field}: nested too deeply") from None
    except ValueError:
        raise
    except Exception as exc:  # noqa: BLE001 - the converters' own errors are this request's
        raise ValueError(f"{field}: does not convert to a grammar: {type(exc).__name__}: {exc}"[:2000]) from None
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ValueError(f"{field}: its grammar is {len(text)} characters, more than the {MAX_GRAMMAR_CHARS} allowed")
    return text


def _grammar_text(so: StructuredOutputsParams, llg: Any) -> str:
    kind = so.kind
    options: dict[str, Any] = {"whitespace_flexible": not so.disable_any_whitespace}
    if so.whitespace_pattern is not None:
        options["whitespace_pattern"] = so.whitespace_pattern
    if kind == "json":
        schema = so.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise ValueError(f"structured_outputs.json: not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise ValueError(f"structured_outputs.json: a JSON schema is an object, got {type(schema).__name__}")
        if so.disable_additional_properties:
            schema = _no_additional_properties(schema)
        return str(llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=options))
    if kind == "json_object":
        return str(llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=options))
    if kind == "regex":
        assert so.regex is not None
        return str(llg.LLMatcher.grammar_from_regex(so.regex))
    if kind == "choice":
        assert so.choice is not None
        return str(llg.grammar_from("choice", so.choice))
    assert so.grammar is not None
    try:
        return str(llg.grammar_from("grammar", so.grammar))
    except ValueError as exc:  # GBNF that does not convert
        raise ValueError(f"structured_outputs.grammar: {exc}") from None


def check(so: StructuredOutputsParams, field: str | None = None) -> str:
    """Validate the params' grammar and return its text; `ValueError` naming `field` (default:
    structured_outputs.<kind>) with llguidance's message when it is invalid. Blocks while
    llguidance validates (in a thread of its own): call it off the event loop."""
    text = grammar_text(so)
    error = _VALIDATED.get(text)
    if error is None:
        error = _in_grammar_thread(_validation_error, text)
        _VALIDATED.put(text, error, len(text) + len(error) + _ENTRY_BYTES)
    if error:
        name = field or f"structured_outputs.{so.kind}"
        raise ValueError(f"{name}: invalid {_KIND_NAMES[so.kind]}: {error.strip()[:2000]}")
    return text


_KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "grammar",
}


def _validation_error(text: str) -> str:
    """llguidance's first error for the grammar text ("" when it is valid)."""
    try:
        error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(text, limits=_limits())
    except Exception as exc:  # noqa: BLE001 - whatever llguidance raises, the grammar is refused
        return f"{type(exc).__name__}: {exc}"
    return str(messages[0]) if error else ""


def _limits() -> llguidance.LLParserLimits:
    return _llguidance().LLParserLimits(**PARSER_LIMITS)


_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def _schema_depth(schema: Any) -> int:
    """How deeply a schema (decoded, or its JSON text) nests, without recursion: the text's
    brackets outside strings, or the decoded value level by level (up to one past the limit)."""
    if isinstance(schema, str):
        brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", schema))
        return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)
    level = [schema] if isinstance(schema, dict | list) else []
    depth = 0
    while level and depth <= MAX_SCHEMA_DEPTH:
        depth += 1
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item)
            if isinstance(child, dict | list)
        ]
    return depth


def _no_additional_properties(schema: Any) -> Any:
    """The schema with `additionalProperties: false` on every object that does not set it."""
    if isinstance(schema, list):
        return [_no_additional_properties(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _no_additional_properties(v) for k, v in schema.items()}
    if out.get("type") == "object" or "properties" in out:
        out.setdefault("additionalProperties", False)
    return out


class SizedCache(Generic[K, V]):
    """A least-recently-used map bounded in entries and in bytes (each entry's estimate, given
    by `put`); thread-safe. An entry larger than the whole bound is not kept."""

    def __init__(self, max_bytes: int, max_entries: int) -> None:
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.num_bytes = 0
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: K) -> bool:
        return key in self._entries

    def get(self, key: K) -> V | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: K, value: V, nbytes: int) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.num_bytes -= old[1]
            if nbytes <= self.max_bytes:
                self._entries[key] = (value, nbytes)
                self.num_bytes += nbytes
            while self.num_bytes > self.max_bytes or len(self._entries) > self.max_entries:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.num_bytes -= evicted


_VALIDATED: SizedCache[str, str] = SizedCache(VALIDATION_CACHE_BYTES, _CACHE_ENTRIES)
_STACK_LOCK = threading.Lock()  # threading.stack_size is process-wide: set and reset under it


def _start_thread(target: Callable[[], None], name: str) -> threading.Thread:
    """A started daemon thread with a `_STACK_BYTES` stack (nobody waits for it at exit: a
    compile still running then ends with the process). Where no such stack can be had (an
    address-space limit, say) it gets the default one, with a warning."""
    with _STACK_LOCK:
        old = threading.stack_size()
        try:
            threading.stack_size(_STACK_BYTES)
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            return thread
        except (ValueError, RuntimeError) as exc:
            log.warning(
                "%s: the default stack (%s): a grammar thousands of rules deep may crash the process", name, exc
            )
        finally:
            threading.stack_size(old)
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        return thread


def _in_grammar_thread(fn: Callable[[str], str], text: str) -> str:
    """`fn(text)` in a new thread with a `_STACK_BYTES` stack; blocks until it returns."""
    out: list[str] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            out.append(fn(text))
        except BaseException as exc:  # delivered to the caller
            error.append(exc)

    _start_thread(run, "triollm-grammar-check").join()
    if error:
        raise error[0]
    return out[0]


class _Lane:
    """One thread that runs the jobs put to it in order; `close` drops those not started."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = _start_thread(self._work, name)

    def put(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)
        self._thread.join(_JOIN_S)
        if self._thread.is_alive():
            log.warning("%s still running at close: abandoned", self._thread.name)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self._closed:
                continue
            try:
                job()
            except Exception:  # a job settles its own future: this is a bug, and the lane goes on
                log.exception("%s: a job failed", threading.current_thread().name)


class Grammar:
    """One request's matcher. Every llguidance call is contained: an exception of any type, or
    the matcher's error state, leaves `error` set (and the matcher unused from then on); the
    core then ends the request with an error and outputs nothing sampled against it."""

    __slots__ = ("_seen", "error", "matcher", "start_after")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher
        self.error: str | None = None
        # `StructuredOutputsParams.start_after_token_ids`: the matcher waits (every token
        # allowed, none consumed) until the output ends with these ids; `_seen` holds the last
        # few output tokens meanwhile.
        self.start_after: tuple[int, ...] = ()
        self._seen: list[int] = []

    def fill_mask(self, row: torch.Tensor) -> None:
        """Write the allowed-token bits into `row` (int32, contiguous); on an error, every bit
        (the token sampled from that row is dropped)."""
        if self.start_after:
            row.fill_(-1)
            return
        if self.error is None:
            try:
                self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
                if self.matcher.is_error():
                    self.error = f"computing the token mask: {self.matcher.get_error()}"
            except Exception as exc:  # noqa: BLE001 - contained to this request
                self.error = f"computing the token mask: {type(exc).__name__}: {exc}"
        if self.error is not None:
            row.fill_(-1)

    def consume_token(self, token: int) -> bool:
        """Advance by the sampled token; False (and `error` set) when that fails."""
        if self.start_after:
            self._seen = (self._seen + [token])[-len(self.start_after) :]
            if tuple(self._seen) == self.start_after:
                self.start_after, self._seen = (), []
            return True
        if self.error is not None:
            return False
        try:
            if not self.matcher.consume_token(token):
                self.error = f"the grammar does not allow token {token}: {self.matcher.get_error()}"
        except Exception as exc:  # noqa: BLE001 - contained to this request
            self.error = f"consuming token {token}: {type(exc).__name__}: {exc}"
        return self.error is None

    def is_stopped(self) -> bool:
        """Whether the grammar is complete (False on an error: `error` says it, and while it
        waits for `start_after`)."""
        if self.error is not None or self.start_after:
            return False
        try:
            return bool(self.matcher.is_stopped())
        except Exception as exc:  # noqa: BLE001 - contained to this request
            self.error = f"is_stopped: {type(exc).__name__}: {exc}"
            return False


class GrammarCompiler:
    """An engine core's matchers: one per structured request, from compiled grammars cached by
    their text. `submit` builds one in the compiler's threads (started on first use: one copies
    cached grammars, one compiles); `matcher` builds one in the calling thread. The tokenizer
    table is built on first use (a quarter second for 49k tokens). `close` ends the threads."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._table_lock = threading.Lock()
        self._compiled: SizedCache[str, llguidance.LLMatcher] = SizedCache(COMPILED_CACHE_BYTES, _CACHE_ENTRIES)
        self._lanes: tuple[_Lane, _Lane] | None = None  # (copies, compiles)

    def _table(self, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
        with self._table_lock:
            if self._tokenizer is None:
                llg = _llguidance()
                text = (self.tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")
                eos = list(eos_token_ids) or None
                self._tokenizer = llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
            return self._tokenizer

    def matcher(self, so: StructuredOutputsParams, eos_token_ids: Sequence[int]) -> Grammar:
        """A fresh matcher for the params, now; ValueError (naming the field) when the grammar
        does not compile against this vocabulary."""
        text = grammar_text(so)
        return self._cached(text) or self._compile(so.kind, text, eos_token_ids)

    def submit(self, so: StructuredOutputsParams, eos_token_ids: Sequence[int]) -> Future[Grammar]:
        """`matcher(so, eos_token_ids)` built in the compiler's threads: a future, done when
        the matcher is ready or failed (its exception: ValueError for a bad grammar, whatever
        else llguidance raised otherwise). Cancelling it before its compile starts skips the
        compile; a compile already running cannot be stopped, and its result goes unused."""
        future: Future[Grammar] = Future()
        if self._lanes is None:
            self._lanes = (_Lane("triollm-grammar-copy"), _Lane("triollm-grammar-compile"))
        copies, compiles = self._lanes
        copies.put(lambda: self._copy_or_queue(future, so, eos_token_ids, compiles))
        return future

    def close(self) -> None:
        """End the threads (idempotent); jobs not started are dropped."""
        lanes, self._lanes = self._lanes, None
        for lane in lanes or ():
            lane.close()

    def _copy_or_queue(
        self, future: Future[Grammar], so: StructuredOutputsParams, eos: Sequence[int], compiles: _Lane
    ) -> None:
        if future.cancelled():
            return
        try:
            text = grammar_text(so)
            grammar = self._cached(text)
        except Exception as exc:  # noqa: BLE001 - the request's error
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)
            return
        if grammar is None:
            compiles.put(lambda: self._compile_into(future, so.kind, text, eos))
        elif future.set_running_or_notify_cancel():
            future.set_result(grammar)

    def _compile_into(self, future: Future[Grammar], kind: str, text: str, eos: Sequence[int]) -> None:
        if not future.set_running_or_notify_cancel():
            return  # aborted while it waited
        try:
            # Queued behind a request with the same grammar: it is cached by now.
            future.set_result(self._cached(text) or self._compile(kind, text, eos))
        except Exception as exc:  # noqa: BLE001 - the request's error
            future.set_exception(exc)

    def _cached(self, text: str) -> Grammar | None:
        compiled = self._compiled.get(text)
        return None if compiled is None else Grammar(compiled.deep_copy())

    def _compile(self, kind: str, text: str, eos_token_ids: Sequence[int]) -> Grammar:
        compiled = _llguidance().LLMatcher(self._table(eos_token_ids), text, log_level=0, limits=_limits())
        if compiled.is_error():
            raise ValueError(f"structured_outputs.{kind}: {compiled.get_error().strip()[:2000]}")
        self._compiled.put(text, compiled, len(text) * _COMPILED_BYTES_PER_CHAR + _ENTRY_BYTES)
        return Grammar(compiled.deep_copy())


def fill_bitmask(grammars: Sequence[Grammar], vocab_size: int) -> torch.Tensor:
    """[len(grammars), ceil(vocab / 32)] int32: bit t of row i is set when grammar i allows
    token t next (every bit for a grammar that failed: see `Grammar.fill_mask`)."""
    words = (vocab_size + 31) // 32
    bitmask = torch.empty(len(grammars), words, dtype=torch.int32)
    for i, g in enumerate(grammars):
        g.fill_mask(bitmask[i])
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [N, V] with every token whose bit is clear in `bitmask` [N, ceil(V/32)] set to
    -inf (a new tensor)."""
    n, vocab = logits.shape
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> _BITS.to(logits.device)) & 1
    allowed = bits.view(n, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))
