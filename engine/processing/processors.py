"""The engine's frontend: prompts in → `EngineCoreRequest`s; `EngineCoreOutput`s → `RequestOutput`s.

Plain synchronous classes, so the in-process `SyncEngine` and the actor layer drive them alike.

`InputProcessor.process` tokenizes and validates a prompt, resolves the sampling params and
expands `n > 1` into n child core requests `f"{i}_{request_id}"` (vLLM's ParentRequest), each
with `n=1` and, when a seed is set, seed `seed + i`.

`OutputProcessor` keeps per-request state: incremental detokenization, stop strings, logprobs
and the output kind (CUMULATIVE, DELTA or FINAL_ONLY). One `RequestOutput` per user request and
per `process_outputs` call carries the children that advanced in that call (FINAL_ONLY: one
output with every child, once all finished). Per token the work is O(1) apart from CUMULATIVE's
inherent copy of everything so far; text is joined lazily.

Differences from vLLM, on purpose:
* max_tokens None or above the room left (max_model_len - prompt length) is clamped to the
  room, as vLLM's `LLM` does (its OpenAI server rejects instead); min_tokens is clamped too.
* A prompt must leave room for one generated token: at most max_model_len - 1 tokens.
* The sampling params are validated again at submission (`SamplingParams.validate()`: fields
  may have been changed after construction), the per-request limits (`LimitsConfig`: stop
  strings, token lists, `n`) are checked before anything is tokenized, and a request that can
  never fit the KV cache (prompt + max_tokens, when the core's block count is known) is refused:
  each a `ValueError` naming the field and the setting.
* A core output finished with `FinishReason.ERROR` becomes finish_reason "abort" with the
  error text as stop_reason (RequestOutput has no error field; nothing is raised here).
* DELTA outputs carry prompt_logprobs only when new rows arrived (None otherwise).
* `spaces_between_special_tokens` has no effect: the `tokenizers` decoder decides spacing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from triollm.engine import structured_outputs
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from triollm.engine.pooling_outputs import PoolingOutput, PoolingRequestOutput, unpack_pooled
from triollm.engine.pooling_params import PoolingParams
from triollm.engine.processing.detokenizer import IncrementalDetokenizer, StopChecker
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.request import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs
from triollm.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    check_utf8,
    check_wire_int,
)

if TYPE_CHECKING:
    from triollm.engine.config import LimitsConfig

__all__ = [
    "InputProcessor",
    "OutputProcessor",
    "ProcessedOutputs",
    "ProcessedRequest",
    "PromptType",
]

PromptType = str | Mapping[str, Any]
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
# The SamplingParams a pooling request carries where the wire and the output processor expect
# some: nothing is sampled or detokenized.
POOLING_PLACEHOLDER = SamplingParams(
    max_tokens=1, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
)
# vLLM's wording (its LLM.generate()); every generation entry point refuses a pooling model so.
GENERATE_ON_POOLING = (
    "{api} is only supported for generative models. Try passing `--runner generate` to use "
    "the model as a generative model."
)
POOLING_ON_GENERATE = (
    "{api} is only supported for pooling models. Try passing `--runner pooling` to use "
    "the model as a pooling model."
)


@dataclass
class ProcessedRequest:
    """A user request after input processing: what the OutputProcessor and the core need."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    core_requests: list[EngineCoreRequest]
    arrival_time: float = 0.0
    # A pooling request (then `params` is `POOLING_PLACEHOLDER`: no tokens are generated).
    pooling_params: PoolingParams | None = None


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Core request ids a stop string finished: the core still runs them and must abort them.
    reqs_to_abort: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# input


class InputProcessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        *,
        max_logprobs: int = 20,
        limits: LimitsConfig | None = None,
        kv_cache_tokens: int | None = None,
    ) -> None:
        """`limits`: the per-request limits (None: none); `kv_cache_tokens`: the KV cache's size
        in tokens (the core's blocks x block size; None: unknown, not checked)."""
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs  # -1: no limit
        self.limits = limits
        self.kv_cache_tokens = kv_cache_tokens
        eos = [*model_config.eos_token_ids]
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_token_ids = list(dict.fromkeys(eos))

    def process(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> ProcessedRequest:
        check_utf8("request_id", request_id)
        check_wire_int("priority", priority)
        if self.model_config.runner_type != "generate":
            raise ValueError(GENERATE_ON_POOLING.format(api="Generation (SamplingParams)"))
        if params is None:
            params = SamplingParams.with_defaults(self.model_config.generation_defaults)
        params.validate()  # fields may have changed since construction
        self.check_limits(params)  # before anything is tokenized
        if params.structured_outputs is not None:
            structured_outputs.check(params.structured_outputs)
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        params = self._resolve_params(params, len(token_ids))
        self._check_kv_fit(len(token_ids), params)
        bad_words = self._bad_words_token_ids(params.bad_words or [])
        arrival = time.time() if arrival_time is None else arrival_time
        children = _child_params(params)
        core_requests = [
            EngineCoreRequest(
                request_id=request_id if len(children) == 1 else f"{i}_{request_id}",
                prompt_token_ids=token_ids,
                sampling_params=child,
                eos_token_ids=self.eos_token_ids,
                bad_words_token_ids=bad_words,
                arrival_time=arrival,
                priority=priority,
            )
            for i, child in enumerate(children)
        ]
        return ProcessedRequest(request_id, text, token_ids, params, core_requests, arrival)

    def process_pooling(
        self,
        prompt: PromptType,
        params: PoolingParams,
        request_id: str,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
    ) -> ProcessedRequest:
        """A request to a pooling model: tokenized (truncated as `truncate_prompt_tokens` says),
        checked against max_model_len, its parameters resolved against the model's pooler."""
        check_utf8("request_id", request_id)
        check_wire_int("priority", priority)
        mc = self.model_config
        if mc.runner_type != "pooling" or mc.pooler is None:
            raise ValueError(POOLING_ON_GENERATE.format(api="Pooling (PoolingParams)"))
        params = self._resolve_pooling(params)
        limit = mc.max_model_len
        keep = params.truncate_prompt_tokens
        keep = limit if keep == -1 else keep
        if keep is not None and keep > limit:
            raise ValueError(f"truncate_prompt_tokens: {keep} exceeds max_model_len ({limit})")
        text, token_ids = self._tokenize(prompt)
        if keep is not None and len(token_ids) > keep:
            # A text is cut as the tokenizer cuts it (its special tokens kept), token ids as given.
            from_text = isinstance(prompt, str) or "prompt_token_ids" not in prompt
            token_ids = self.tokenizer.encode_truncated(text, keep) if from_text and text is not None else token_ids[:keep]
        if not token_ids:
            raise ValueError("prompt: must not be empty (0 tokens)")
        if len(token_ids) > limit:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens exceed max_model_len ({limit}); shorten it or "
                "set truncate_prompt_tokens (-1: truncate to max_model_len)"
            )
        bad = [t for t in token_ids if not 0 <= t < mc.vocab_size]
        if bad:
            raise ValueError(f"prompt_token_ids: token ids must be in [0, {mc.vocab_size}) (vocab_size), got {bad[:8]}")
        arrival = time.time() if arrival_time is None else arrival_time
        core = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=POOLING_PLACEHOLDER,
            arrival_time=arrival,
            priority=priority,
            pooling_params=params,
        )
        return ProcessedRequest(request_id, text, token_ids, POOLING_PLACEHOLDER, [core], arrival, params)

    def _resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """Checked again (fields may have changed), the task defaulted to "embed", `dimensions`
        checked against the model (Matryoshka only, at most hidden_size)."""
        params.validate()
        mc = self.model_config
        pooler = mc.pooler
        assert pooler is not None
        params = msgspec.structs.replace(params, task=params.task or "embed")
        d = params.dimensions
        if d is not None:
            if not pooler.is_matryoshka:
                raise ValueError(
                    f"dimensions: model {mc.path.name} does not support matryoshka representation; "
                    "changing output dimensions would lead to poor results (leave dimensions unset)"
                )
            allowed = pooler.matryoshka_dimensions
            if (allowed is not None and d not in allowed) or d > mc.hidden_size:
                shown = list(allowed) if allowed is not None else f"1 to {mc.hidden_size}"
                raise ValueError(f"dimensions: {d} is not supported by {mc.path.name}; allowed: {shown}")
        return params

    # ------------------------------------------------------------------ prompt

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, Mapping):
            raise ValueError(
                f"prompt: expected a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
            )
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(
                f"prompt: unsupported keys {sorted(unknown)} (supported: prompt, prompt_token_ids)"
            )
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt: 'prompt' must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            return text, _token_list(prompt["prompt_token_ids"])
        if text is None:
            raise ValueError("prompt: needs 'prompt' or 'prompt_token_ids'")
        return text, self.tokenizer.encode(text)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt: must not be empty (0 tokens)")
        limit = self.model_config.max_model_len
        if len(token_ids) > limit - 1:
            raise ValueError(
                f"prompt: {len(token_ids)} tokens exceeds max_model_len ({limit}) minus one token "
                f"to generate; at most {limit - 1} prompt tokens are allowed"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"prompt_token_ids: token ids must be in [0, {vocab}) (vocab_size), got {bad[:8]}"
            )

    # ------------------------------------------------------------------ params

    def check_limits(self, params: SamplingParams) -> None:
        """Raise `ValueError` naming the field and the setting if `params` asks for more than
        one request may (`LimitsConfig`). Cheap: lengths only, nothing is tokenized."""
        limits = self.limits
        if limits is None:
            return
        stop = [params.stop] if isinstance(params.stop, str) else params.stop or []
        if len(stop) > limits.max_stop_strings:
            raise ValueError(
                f"stop: {len(stop)} strings exceed max_stop_strings={limits.max_stop_strings}"
            )
        longest = max(map(len, stop), default=0)
        if longest > limits.max_stop_string_len:
            raise ValueError(
                f"stop: a string of {longest} characters exceeds "
                f"max_stop_string_len={limits.max_stop_string_len}"
            )
        for name in ("stop_token_ids", "allowed_token_ids", "bad_words", "logit_bias"):
            value = getattr(params, name)
            count = 0 if value is None else len(value)
            if count > limits.max_token_list_len:
                raise ValueError(
                    f"{name}: {count} entries exceed max_token_list_len={limits.max_token_list_len}"
                )
        for name in ("n", "best_of"):
            value = getattr(params, name, None)
            if value is not None and value > limits.max_n:
                raise ValueError(f"{name}: {value} exceeds max_n={limits.max_n}")

    def _resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        vocab = self.model_config.vocab_size
        params.verify_token_ids(vocab)
        for name in ("logprobs", "prompt_logprobs"):
            self._check_logprobs(name, getattr(params, name), vocab)
        room = self.model_config.max_model_len - prompt_len
        if params.max_tokens is None or params.max_tokens > room:
            params = msgspec.structs.replace(
                params, max_tokens=room, min_tokens=min(params.min_tokens, room)
            )
        if params.top_k >= vocab:  # the same as no top-k, and within what the sampler handles
            params = msgspec.structs.replace(params, top_k=0)
        return params

    def _check_kv_fit(self, prompt_len: int, params: SamplingParams) -> None:
        """A sequence that needs more KV slots than the cache has would preempt itself forever.
        The last sampled token is never fed back, so prompt + max_tokens - 1 slots suffice."""
        capacity = self.kv_cache_tokens
        assert params.max_tokens is not None  # resolved
        if capacity is None or prompt_len + params.max_tokens - 1 <= capacity:
            return
        if prompt_len >= capacity:
            raise ValueError(
                f"prompt: {prompt_len} tokens do not fit in the KV cache ({capacity} tokens)"
            )
        raise ValueError(
            f"max_tokens: {params.max_tokens} tokens after a prompt of {prompt_len} need "
            f"{prompt_len + params.max_tokens - 1} KV cache slots, more than the KV cache's "
            f"{capacity} tokens; ask for at most {capacity - prompt_len + 1}"
        )

    def _check_logprobs(self, name: str, value: int | None, vocab: int) -> None:
        if value is None or self.max_logprobs < 0:
            return
        wanted = vocab if value == -1 else value
        if wanted > self.max_logprobs:
            raise ValueError(f"{name}: {wanted} exceeds max_logprobs ({self.max_logprobs})")

    def _bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each bad word as it would start the text and as a word after a space (vLLM's rule)."""
        out: list[list[int]] = []
        for word in words:
            plain = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not plain:
                continue
            out.append(plain)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            # Keep the spaced form only if the space merged into a different first token.
            if spaced[0] != plain[0] and len(spaced) == len(plain):
                out.append(spaced)
        vocab = self.model_config.vocab_size
        bad = [t for ids in out for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"bad_words: tokenize to ids outside [0, {vocab}): {bad[:8]}")
        return out


def _token_list(value: Any) -> list[int]:
    if not isinstance(value, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError("prompt_token_ids: must be a list of ints")
    return list(value)


def _child_params(params: SamplingParams) -> list[SamplingParams]:
    if params.n == 1:
        return [params]
    seed = params.seed
    return [
        msgspec.structs.replace(params, n=1, seed=None if seed is None else seed + i)
        for i in range(params.n)
    ]


# ---------------------------------------------------------------------------------------------
# output


class _Child:
    """One sampled sequence (one core request) of a user request."""

    def __init__(self, parent: _Parent, index: int, core_id: str, prompt_ids: list[int], eos_ids: Sequence[int]) -> None:
        params = parent.params
        self.parent = parent
        self.index = index
        self.core_id = core_id
        self.delta = params.output_kind == RequestOutputKind.DELTA
        self.min_tokens = params.min_tokens
        self.include_stop = params.include_stop_str_in_output
        # The tokens whose text a "stop" finish leaves out: EOS and stop_token_ids. (A grammar
        # that completes also finishes with "stop", on a token that is part of the output.)
        eos = () if params.ignore_eos else eos_ids
        self.stop_ids = frozenset((*eos, *(params.stop_token_ids or ())))
        self.detok: IncrementalDetokenizer | None = None
        self.stops: StopChecker | None = None
        if params.detokenize:
            self.detok = IncrementalDetokenizer(
                parent.tokenizer, prompt_ids, params.skip_special_tokens
            )
            stop = [params.stop] if isinstance(params.stop, str) else params.stop or []
            if stop:
                self.stops = StopChecker(stop, params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        # CUMULATIVE/FINAL_ONLY: all the text; DELTA: the text not output yet.
        self.text_parts: list[str] = []
        self.sent_tokens = 0
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.sent_logprobs = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput) -> bool:
        """Apply one core output; True when a stop string (not the core) finished the sequence."""
        new_ids = out.new_token_ids
        self.token_ids.extend(new_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.new_logprobs is not None and self.logprobs is not None:
            self._add_logprobs(out.new_logprobs)
        if self.detok is None:
            self._finish_from_core(out)
            return False
        if out.finish_reason == FinishReason.STOP and not self.include_stop and new_ids and new_ids[-1] in self.stop_ids:
            new_ids = new_ids[:-1]  # the stop token's own text is not output (vLLM)
        piece = self.detok.step(new_ids)
        if out.finished:
            piece += self.detok.flush()
        stopped = self._add_text(piece, out.finished)
        if not stopped:
            self._finish_from_core(out)
        return stopped

    def _add_text(self, piece: str, core_finished: bool) -> bool:
        stop: str | None = None
        if self.stops is not None:
            piece, stop = self.stops.feed(piece, check=len(self.token_ids) > self.min_tokens)
            if stop is None and core_finished:
                piece += self.stops.flush()
        if piece:
            self.text_parts.append(piece)
        if stop is not None:
            self.finish_reason, self.stop_reason = str(FinishReason.STOP), stop
        return stop is not None

    def _finish_from_core(self, out: EngineCoreOutput) -> None:
        reason = out.finish_reason
        if reason is None:
            return
        self.finish_reason = str(FinishReason.ABORT if reason == FinishReason.ERROR else reason)
        self.stop_reason = out.stop_reason

    def abort(self) -> None:
        """Finish locally (user abort), releasing any held-back text."""
        if self.finished:
            return
        if self.detok is not None:
            self._add_text(self.detok.flush(), core_finished=True)
        if not self.finished:
            self.finish_reason, self.stop_reason = str(FinishReason.ABORT), None

    def _add_logprobs(self, rows: Logprobs) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        converted = self.parent.convert_logprobs(rows)
        self.logprobs.extend(converted)
        self.cumulative_logprob += sum(row[0] for row in rows.logprobs if row)

    def completion(self, delta: bool) -> CompletionOutput:
        if delta:
            text = "".join(self.text_parts)
            self.text_parts.clear()
            token_ids = self.token_ids[self.sent_tokens :]
            logprobs = None if self.logprobs is None else self.logprobs[self.sent_logprobs :]
        else:
            if len(self.text_parts) > 1:
                self.text_parts[:] = ["".join(self.text_parts)]
            text = self.text_parts[0] if self.text_parts else ""
            token_ids = list(self.token_ids)
            logprobs = None if self.logprobs is None else list(self.logprobs)
        self.sent_tokens = len(self.token_ids)
        self.sent_logprobs = 0 if self.logprobs is None else len(self.logprobs)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


class _Parent:
    """A user request: its children and its prompt logprobs."""

    def __init__(self, processed: ProcessedRequest, processor: OutputProcessor) -> None:
        self.request_id = processed.request_id
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.params = processed.params
        self.kind = processed.params.output_kind
        self.tokenizer = processor.tokenizer
        self.convert_logprobs = processor.convert_logprobs
        self.prompt_logprobs: PromptLogprobs | None = None
        if processed.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob
        self.sent_prompt_logprobs = 0
        self.prompt_logprobs_from: str | None = None  # the child whose rows are used
        self.task = None if processed.pooling_params is None else processed.pooling_params.task
        self.children = [
            _Child(self, i, req.request_id, processed.prompt_token_ids, req.eos_token_ids)
            for i, req in enumerate(processed.core_requests)
        ]
        self.num_unfinished = len(self.children)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def add_prompt_logprobs(self, child: _Child, rows: Logprobs) -> None:
        # Every child has the same prompt: take the rows of the first child that sends any.
        if self.prompt_logprobs is None or self.prompt_logprobs_from not in (None, child.core_id):
            return
        self.prompt_logprobs_from = child.core_id
        self.prompt_logprobs.extend(self.convert_logprobs(rows))

    def make_output(self, advanced: Iterable[_Child]) -> RequestOutput | None:
        if self.kind == RequestOutputKind.FINAL_ONLY:
            if not self.finished:
                return None
            advanced = self.children
        delta = self.kind == RequestOutputKind.DELTA
        children = sorted(set(advanced), key=lambda c: c.index)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self._prompt_logprobs_out(delta),
            outputs=[c.completion(delta) for c in children],
            finished=self.finished,
            num_cached_tokens=children[0].num_cached_tokens if children else None,
        )

    def _prompt_logprobs_out(self, delta: bool) -> PromptLogprobs | None:
        if self.prompt_logprobs is None:
            return None
        start = self.sent_prompt_logprobs if delta else 0
        self.sent_prompt_logprobs = len(self.prompt_logprobs)
        rows = self.prompt_logprobs[start:]
        return rows if rows or not delta else None


class OutputProcessor:
    """Turns core outputs into user-facing `RequestOutput`s."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}  # core request id -> unfinished child
        self._token_text: dict[int, str] = {}  # decoded_token cache for logprobs

    # ------------------------------------------------------------------ bookkeeping

    def add_request(self, processed: ProcessedRequest) -> None:
        if processed.request_id in self._parents:
            raise ValueError(f"request_id: {processed.request_id!r} is already running")
        parent = _Parent(processed, self)
        for child in parent.children:
            if child.core_id in self._children:
                raise ValueError(f"request_id: core request {child.core_id!r} is already running")
        self._parents[parent.request_id] = parent
        for child in parent.children:
            self._children[child.core_id] = child

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    @property
    def num_unfinished_sequences(self) -> int:
        """Unfinished core requests (an n > 1 request counts n): what the scheduler holds."""
        return len(self._children)

    def unfinished_core_ids(self, request_id: str) -> list[str]:
        """The core request ids still running for a user request (to abort them in the core)."""
        parent = self._parents.get(request_id)
        return [] if parent is None else [c.core_id for c in parent.children if not c.finished]

    def parent_id(self, core_id: str) -> str | None:
        """The user request id of an unfinished core request."""
        child = self._children.get(core_id)
        return None if child is None else child.parent.request_id

    # ------------------------------------------------------------------ the per-step path

    def process_outputs(self, outputs: Sequence[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        advanced: dict[str, tuple[_Parent, list[_Child]]] = {}
        for out in outputs:
            child = self._children.get(out.request_id)
            if child is None:
                continue  # aborted here while the core was still stepping it
            parent = child.parent
            if out.new_prompt_logprobs is not None:
                parent.add_prompt_logprobs(child, out.new_prompt_logprobs)
            if child.update(out) and not out.finished:
                result.reqs_to_abort.append(out.request_id)
            if child.finished:
                self._finish_child(child)
            advanced.setdefault(parent.request_id, (parent, []))[1].append(child)
        for parent, children in advanced.values():
            request_output = parent.make_output(children)
            if request_output is not None:
                result.request_outputs.append(request_output)
            if parent.finished:
                self._parents.pop(parent.request_id, None)
        return result

    def abort_requests(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        """Finish user requests locally with finish_reason "abort"; unknown ids are ignored.

        Call `unfinished_core_ids` first to learn which core requests to abort in the core.
        """
        outputs: list[RequestOutput] = []
        for request_id in request_ids:
            parent = self._parents.pop(request_id, None)
            if parent is None:
                continue
            aborted = [c for c in parent.children if not c.finished]
            for child in aborted:
                child.abort()
                self._finish_child(child)
            request_output = parent.make_output(aborted)
            if request_output is not None:
                outputs.append(request_output)
        return outputs

    def process_pooled(self, outputs: Sequence[EngineCoreOutput]) -> list[PoolingRequestOutput[PoolingOutput]]:
        """A pooling model's step: each output finishes its request with its embedding (`[H]`)
        or, for task "encode", one vector per prompt token (`[num_prompt_tokens, H]`)."""
        results: list[PoolingRequestOutput[PoolingOutput]] = []
        for out in outputs:
            child = self._children.get(out.request_id)
            if child is None or out.pooled is None:
                continue  # aborted here while the core was still encoding it
            parent = child.parent
            child.finish_reason = str(FinishReason.STOP)
            self._finish_child(child)
            self._parents.pop(parent.request_id, None)
            rows = len(parent.prompt_token_ids) if parent.task == "encode" else None
            data = unpack_pooled(out.pooled, rows)
            results.append(PoolingRequestOutput(parent.request_id, PoolingOutput(data), parent.prompt_token_ids, True))
        return results

    def _finish_child(self, child: _Child) -> None:
        if self._children.pop(child.core_id, None) is not None:
            child.parent.num_unfinished -= 1

    # ------------------------------------------------------------------ logprobs

    def convert_logprobs(self, rows: Logprobs) -> list[dict[int, Logprob]]:
        """Core logprob rows → one {token id: Logprob} per position (chosen token first)."""
        converted: list[dict[int, Logprob]] = []
        for ids, values, rank in zip(rows.token_ids, rows.logprobs, rows.ranks, strict=True):
            ranks = [rank, *range(1, len(ids))]
            # A chosen token that is also in the top-k keeps the top-k entry, as in vLLM.
            converted.append(
                {
                    t: Logprob(float(v), r, self._decoded(t))
                    for t, v, r in zip(ids, values, ranks, strict=True)
                }
            )
        return converted

    def _decoded(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text
