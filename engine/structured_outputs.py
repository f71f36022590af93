"""Structured outputs: a grammar every output of a request follows, enforced with llguidance.

`SamplingParams(structured_outputs=StructuredOutputsParams(json=... | regex=... | choice=[...] |
grammar=... | json_object=True))`, as in vLLM. The grammar engine is llguidance, not vLLM's
default xgrammar, by measurement (docs/architecture.md, "Structured outputs"): one wheel with no
dependencies (xgrammar pulls transformers, pydantic and apache-tvm-ffi), and a JSON schema
compiles fast enough to build matchers in the step that first schedules a request.

Three places, each off the event loop:
- The input processor calls `check` (in a worker thread: `AsyncLLM.add_request`), which turns
  the params into llguidance's grammar text and validates it, cached by that text: an invalid
  schema, regex or grammar is a `ValueError` naming the field before anything reaches the core.
- The engine core builds each request's matcher on its compute thread, before the step that
  first schedules it (`GrammarCompiler`): compiled grammars are cached by their text, and a new
  request takes a copy of the compiled one.
- The sampler masks the logits of the rows that have a matcher (`fill_bitmask`,
  `apply_bitmask`), before logprobs are taken, as vLLM does; the core feeds each sampled token to
  its matcher, and a matcher that reached the end of its grammar finishes the request ("stop").

Preemption needs nothing: a preempted request keeps its output tokens (only their KV is
recomputed), so its matcher stays where it was.
"""

from __future__ import annotations

import functools
import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from triollm.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import llguidance

__all__ = ["GrammarCompiler", "apply_bitmask", "check", "fill_bitmask", "grammar_text"]

# Compiled grammars kept per engine core (each a few hundred KB at most).
_CACHE_SIZE = 256
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
    """llguidance's grammar for the params (ValueError naming the field when malformed)."""
    llg = _llguidance()
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
    structured_outputs.<kind>) with llguidance's message when it is invalid."""
    text = grammar_text(so)
    error = _validation_error(text)
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


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _validation_error(text: str) -> str:
    error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(text)
    return messages[0] if error else ""


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


class GrammarCompiler:
    """An engine core's matchers: one per structured request, from compiled grammars cached by
    their text. The tokenizer table is built on first use (a quarter second for 49k tokens)."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def _table(self, eos_token_ids: Sequence[int]) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            llg = _llguidance()
            text = (self.tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8")
            eos = list(eos_token_ids) or None
            self._tokenizer = llg.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
        return self._tokenizer

    def matcher(self, so: StructuredOutputsParams, eos_token_ids: Sequence[int]) -> llguidance.LLMatcher:
        """A fresh matcher for the params; ValueError (naming the field) when the grammar does
        not compile against this vocabulary."""
        text = grammar_text(so)
        compiled = self._compiled.get(text)
        if compiled is None:
            compiled = _llguidance().LLMatcher(self._table(eos_token_ids), text, log_level=0)
            if compiled.is_error():
                raise ValueError(f"structured_outputs.{so.kind}: {compiled.get_error().strip()[:2000]}")
            self._compiled[text] = compiled
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(text)
        return compiled.deep_copy()


def fill_bitmask(matchers: Sequence[llguidance.LLMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(vocab / 32)] int32: bit t of row i is set when matcher i allows
    token t next."""
    words = (vocab_size + 31) // 32
    bitmask = torch.empty(len(matchers), words, dtype=torch.int32)
    for i, m in enumerate(matchers):
        row = bitmask[i]
        m.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
    return bitmask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """`logits` [N, V] with every token whose bit is clear in `bitmask` [N, ceil(V/32)] set to
    -inf (a new tensor)."""
    n, vocab = logits.shape
    bits = (bitmask.to(logits.device).unsqueeze(-1) >> _BITS.to(logits.device)) & 1
    allowed = bits.view(n, -1)[:, :vocab].bool()
    return logits.masked_fill(~allowed, float("-inf"))
