"""The frontend's input half: a prompt and its params in, a checked `ProcessedRequest` out.

`InputProcessor.process` tokenizes and validates a prompt, resolves the sampling params against
the model, and expands `n > 1` into n child core requests (vLLM's ParentRequest), each with
`n=1` and, when a seed is set, seed `seed + i`. Core request ids are made by
`core_request_ids`, and only there: `"{request_id}#{tag}"`, or `"{i}_{request_id}#{tag}"` for
the children of an n > 1 request; the frontend's table passes a tag that it never reuses, so
outputs still in flight for an aborted request can never be credited to a new request that
reuses its id. (Called without a tag, as the unit tests do, the `#tag` part is left out.)

The params pass twice: checked before anything is tokenized (`_check_params`: validated again,
since fields may have changed after construction; the per-request limits; the grammar), and
resolved against the prompt after (`_resolve_params`: token ids in the vocabulary, logprobs,
max_tokens clamped to the room left, the KV-fit rule).

Differences from vLLM, on purpose:
* max_tokens None or above the room left (max_model_len - prompt length) is clamped to the
  room, as vLLM's `LLM` does (its OpenAI server rejects instead); min_tokens is clamped too.
* A prompt must leave room for one generated token: at most max_model_len - 1 tokens.
* The per-request limits (`LimitsConfig`: stop strings, token lists, `n`) are checked before
  anything is tokenized, and a request that can never fit the KV cache (prompt + max_tokens,
  when the core's block count is known) is refused: each a `ValueError` naming the field and
  the setting.

A LoRA request's adapter (`lora_request`) was checked by the shell (`LoRAChecker`, lora.py): it
is copied into every core request of the user request, so the children of `n > 1` (and the
beams of a search, each a request of its own) run under the same adapter.

Plain code, no I/O: the frontend may run `process` in a worker thread for a large input.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from triollm.engine import request_rules, structured_outputs
from triollm.engine.config.limits import DEFAULT_IMAGES_PER_PROMPT
from triollm.engine.inputs import PromptType
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.pooling_params import DEPRECATED_TASKS, PoolingParams
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.request import EngineCoreRequest, ImageFeature
from triollm.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    check_utf8,
    check_wire_int,
)
from triollm.lora.request import LoRARequest

if TYPE_CHECKING:
    from triollm.engine.config import LimitsConfig
    from triollm.engine.processing.image_inputs import ImageInputs

__all__ = [
    "GENERATE_ON_POOLING",
    "LARGE_INPUT",
    "MAX_REQUEST_ID_LEN",
    "POOLING_ON_GENERATE",
    "POOLING_PLACEHOLDER",
    "InputProcessor",
    "ProcessedRequest",
    "core_request_ids",
    "input_size",
]

_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "multi_modal_data", "mm_processor_kwargs"})
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
# The longest request id, in characters. An id is copied into every core request id, output
# batch and log line of its request, so it is bounded like any other field; the server caps the
# ids clients send lower (its own prefixes and suffixes must fit).
MAX_REQUEST_ID_LEN = 512
# Inputs larger than this (`input_size`) are processed in a worker thread by the async shell,
# so that they do not stall the event loop.
LARGE_INPUT = 8192
# What one tokenizer call costs beyond its text, counted in characters (a fixed cost per call,
# so that thousands of one-letter bad words count as much as they cost).
_TOKENIZER_CALL_CHARS = 16


@dataclass
class ProcessedRequest:
    """A user request after input processing: what the output half and the core need."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    core_requests: list[EngineCoreRequest]
    arrival_time: float = 0.0
    # A pooling request (then `params` is `POOLING_PLACEHOLDER`: no tokens are generated).
    pooling_params: PoolingParams | None = None

    @property
    def num_prompt_tokens(self) -> int:
        """Prompt tokens over every core request (an n > 1 request counts n times)."""
        return len(self.prompt_token_ids) * len(self.core_requests)


def core_request_ids(request_id: str, n: int, tag: str | None = None) -> list[str]:
    """The core request ids of a user request with `n` children: the one place they are made."""
    suffix = "" if tag is None else f"#{tag}"
    if n == 1:
        return [f"{request_id}{suffix}"]
    return [f"{i}_{request_id}{suffix}" for i in range(n)]


def input_size(prompt: object, params: SamplingParams | PoolingParams) -> int:
    """The work `InputProcessor.process` will do for this request, in characters or token ids:
    the prompt (text to tokenize, ids to check) plus every `bad_words` entry (tokenized twice,
    each call with its fixed cost); images count as a large input. Cheap: lengths only. Values
    of the wrong type count 0: `process` rejects them."""
    size = 0
    if isinstance(prompt, str):
        size += len(prompt)
    elif isinstance(prompt, Mapping):
        for key in ("prompt", "prompt_token_ids"):
            value = prompt.get(key)
            if isinstance(value, str | list | tuple):
                size += len(value)
        if prompt.get("multi_modal_data") is not None:  # images to process: always off the loop
            size += LARGE_INPUT + 1
    bad_words = params.bad_words if isinstance(params, SamplingParams) else None
    if isinstance(bad_words, list):
        size += sum(
            2 * (len(word) + _TOKENIZER_CALL_CHARS) for word in bad_words if isinstance(word, str)
        )
    return size


class InputProcessor:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Tokenizer,
        *,
        max_logprobs: int = 20,
        limits: LimitsConfig | None = None,
        kv_cache_tokens: int | None = None,
        scheduling_policy: str = "fcfs",
    ) -> None:
        """`limits`: the per-request limits (None: none); `kv_cache_tokens`: the KV cache's size
        in tokens (the core's blocks x block size; None: unknown, not checked);
        `scheduling_policy`: "fcfs" refuses a non-zero `priority`, as vLLM does."""
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_logprobs = max_logprobs  # -1: no limit
        self.limits = limits
        self.kv_cache_tokens = kv_cache_tokens
        self.scheduling_policy = scheduling_policy
        eos = [*model_config.eos_token_ids]
        if tokenizer.eos_token_id is not None:
            eos.append(tokenizer.eos_token_id)
        self.eos_token_ids = list(dict.fromkeys(eos))
        mm = model_config.multimodal
        # A vision-language model's image processor, loaded now (engine/processing/image_inputs.py).
        self.images: ImageInputs | None = None
        if mm is not None and mm.takes_images:
            from triollm.engine.processing.image_inputs import ImageInputs

            image_limit = DEFAULT_IMAGES_PER_PROMPT if limits is None else limits.max_images_per_prompt
            blank = tokenizer.encode("\n\n", add_special_tokens=False) if mm.blank_lines else []
            self.images = ImageInputs(model_config.path, mm, image_limit, blank)

    def process(
        self,
        prompt: PromptType,
        params: SamplingParams | None,
        request_id: str,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        tag: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Check and tokenize one generation request; `tag` goes into its core ids,
        `lora_request` (checked by `LoRAChecker`) into every core request."""
        self._check_request(request_id, priority)
        if lora_request is not None and not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest or None, got {type(lora_request).__name__}")
        mc = self.model_config
        if mc.runner_type != "generate":
            raise ValueError(GENERATE_ON_POOLING.format(api="Generation (SamplingParams)"))
        if params is None:
            params = SamplingParams.with_defaults(self.model_config.generation_defaults)
        self._check_params(params)  # before anything is tokenized
        if isinstance(prompt, Mapping) and isinstance(prompt.get("prompt_token_ids"), list | tuple):
            # Before the ids are walked:
            request_rules.check_prompt_len(len(prompt["prompt_token_ids"]), mc.max_model_len)
        text, token_ids = self._tokenize(prompt)
        images: list[ImageFeature] = []
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None:
            token_ids, images = self._expand_images(prompt, token_ids)
        elif self.images is not None and self.images.spec.prompt_token_id in token_ids:
            raise ValueError(
                f"multi_modal_data: the prompt holds image placeholders (token {self.images.spec.prompt_token_id}) "
                "but no images; pass them in multi_modal_data"
            )
        request_rules.check_prompt_tokens(token_ids, mc.max_model_len, mc.vocab_size)
        params = self._resolve_params(params, len(token_ids))
        bad_words = self._bad_words_token_ids(params.bad_words or [])
        self._check_request_tokens(params, len(token_ids), bad_words)
        arrival = time.time() if arrival_time is None else arrival_time
        children = _child_params(params)
        core_requests = [
            EngineCoreRequest(
                request_id=core_id,
                prompt_token_ids=token_ids,
                sampling_params=child,
                eos_token_ids=self.eos_token_ids,
                bad_words_token_ids=bad_words,
                arrival_time=arrival,
                priority=priority,
                lora_request=lora_request,
                images=images,
            )
            for core_id, child in zip(core_request_ids(request_id, len(children), tag), children)
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
        tag: str | None = None,
    ) -> ProcessedRequest:
        """A request to a pooling model: tokenized (truncated as `truncate_prompt_tokens` says),
        checked against max_model_len, its parameters resolved against the model's pooler."""
        self._check_request(request_id, priority)
        mc = self.model_config
        if mc.runner_type != "pooling" or mc.pooler is None:
            raise ValueError(POOLING_ON_GENERATE.format(api="Pooling (PoolingParams)"))
        params = self._resolve_pooling(params)
        limit = mc.max_model_len
        keep = params.truncate_prompt_tokens
        keep = limit if keep == -1 else keep
        if keep is not None and keep > limit:
            raise ValueError(f"truncate_prompt_tokens: {keep} exceeds max_model_len ({limit})")
        prompt, token_types = _split_token_types(prompt)
        text, token_ids = self._tokenize(prompt)
        if token_types is not None and len(token_types) != len(token_ids):
            raise ValueError(
                f"token_type_ids: {len(token_types)} values for {len(token_ids)} prompt_token_ids; give one per token"
            )
        if keep is not None and len(token_ids) > keep:
            # A text is cut as the tokenizer cuts it (its special tokens kept), token ids as given.
            from_text = isinstance(prompt, str) or "prompt_token_ids" not in prompt
            token_ids = (
                self.tokenizer.encode_truncated(text, keep) if from_text and text is not None else token_ids[:keep]
            )
            token_types = None if token_types is None else token_types[:keep]
        request_rules.check_prompt_tokens(token_ids, limit, mc.vocab_size, generate=False)
        if token_types is not None and mc.encoder is not None and mc.encoder.modernbert is None:
            top = mc.encoder.type_vocab_size  # BERT / XLM-R embed them (others ignore them)
            if any(not 0 <= t < top for t in token_types):
                raise ValueError(f"token_type_ids: every value must be in [0, {top}) for {mc.architecture}")
        arrival = time.time() if arrival_time is None else arrival_time
        [core_id] = core_request_ids(request_id, 1, tag)
        core = EngineCoreRequest(
            request_id=core_id,
            prompt_token_ids=token_ids,
            sampling_params=POOLING_PLACEHOLDER,
            arrival_time=arrival,
            priority=priority,
            pooling_params=params,
            token_type_ids=token_types,
        )
        return ProcessedRequest(request_id, text, token_ids, POOLING_PLACEHOLDER, [core], arrival, params)

    def _resolve_pooling(self, params: PoolingParams) -> PoolingParams:
        """Checked again (fields may have changed), the task defaulted to "embed", `dimensions`
        checked against the model (Matryoshka only, at most hidden_size)."""
        params.validate()
        mc = self.model_config
        pooler = mc.pooler
        assert pooler is not None
        task = params.task or pooler.tasks[0]
        if task in DEPRECATED_TASKS:
            warnings.warn(
                f"pooling task {task!r} is deprecated; use {DEPRECATED_TASKS[task]!r}", DeprecationWarning, stacklevel=2
            )
            task = DEPRECATED_TASKS[task]
        if task not in pooler.tasks:
            raise ValueError(
                f"task: {task!r} is not supported by {mc.path.name} ({mc.architecture}); supported: "
                f"{', '.join(pooler.tasks)}"
            )
        params = msgspec.structs.replace(params, task=task)
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

    def _check_request(self, request_id: str, priority: int) -> None:
        if not isinstance(request_id, str):
            raise ValueError(f"request_id: must be a string, got {type(request_id).__name__}")
        if len(request_id) > MAX_REQUEST_ID_LEN:
            raise ValueError(
                f"request_id: {len(request_id)} characters exceed the limit of {MAX_REQUEST_ID_LEN}"
            )
        check_utf8("request_id", request_id)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority: must be an int, got {priority!r:.40}")
        check_wire_int("priority", priority)
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"priority: got {priority}, but priority scheduling is not enabled: only 0 is "
                f"allowed with scheduling_policy={self.scheduling_policy!r} (start the engine with "
                "scheduling_policy='priority', --scheduling-policy priority)"
            )

    def _check_request_tokens(self, params: SamplingParams, prompt_len: int, bad_words: list[list[int]]) -> None:
        """What the request holds in the engine: each of its `n` sequences has its own copy of
        the prompt and of every token list (`max_request_tokens`)."""
        limits = self.limits
        if limits is None:
            return
        lists = sum(len(getattr(params, name) or ()) for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"))
        lists += sum(map(len, bad_words))
        cost = params.n * (prompt_len + lists)
        if cost > limits.max_request_tokens:
            raise ValueError(
                f"n: {params.n} sequences x ({prompt_len} prompt tokens + {lists} token-list entries) "
                f"= {cost} tokens exceed max_request_tokens={limits.max_request_tokens}"
            )

    # ------------------------------------------------------------------ prompt

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, Mapping):
            raise ValueError(
                f"prompt: expected a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, got "
                f"{type(prompt).__name__}"
            )
        unknown = set(prompt) - _PROMPT_KEYS
        if unknown:
            raise ValueError(
                f"prompt: unsupported keys {sorted(unknown)} (supported: prompt, prompt_token_ids, "
                "multi_modal_data, mm_processor_kwargs)"
            )
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"prompt: 'prompt' must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            return text, _token_list(prompt["prompt_token_ids"])
        if text is None:
            raise ValueError("prompt: needs 'prompt' or 'prompt_token_ids'")
        return text, self.tokenizer.encode(text)

    def _expand_images(
        self, prompt: Mapping[str, Any], token_ids: list[int]
    ) -> tuple[list[int], list[ImageFeature]]:
        """`multi_modal_data` ({"image": a PIL image or a list of them}) through the model's image
        processor: the placeholders expanded, one `ImageFeature` per image."""
        data = prompt["multi_modal_data"]
        if not isinstance(data, Mapping) or set(data) - {"image"}:
            keys = sorted(map(str, data)) if isinstance(data, Mapping) else type(data).__name__
            raise ValueError(f"multi_modal_data: expected {{'image': PIL.Image or a list of them}}, got {keys}")
        mm = self.model_config.multimodal
        if mm is None:
            arch = self.model_config.architecture
            raise ValueError(f"multi_modal_data: {arch} is a text-only model; it takes no images")
        mm.check_image_request()
        assert self.images is not None
        image = data.get("image")
        images = list(image) if isinstance(image, list | tuple) else [] if image is None else [image]
        return self.images.expand(token_ids, images, prompt.get("mm_processor_kwargs"))

    # ------------------------------------------------------------------ params

    def _check_params(self, params: SamplingParams) -> None:
        """The first pass, before tokenizing: the params validated again (fields may have
        changed since construction), the per-request limits, the grammar (compiled to check)."""
        params.validate()
        self.check_limits(params)
        if params.structured_outputs is not None:
            structured_outputs.check(params.structured_outputs)

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
        assert params.max_tokens is not None  # resolved
        if self.kv_cache_tokens is not None:
            request_rules.check_kv_fit(prompt_len, params.max_tokens, self.kv_cache_tokens)
        return params

    def _check_logprobs(self, name: str, value: int | None, vocab: int) -> None:
        """At most `max_logprobs`, and never more than the vocabulary (`max_logprobs=-1`: the
        vocabulary is the limit; -1 asks for all of it)."""
        if value is None:
            return
        wanted = vocab if value == -1 else value
        if self.max_logprobs >= 0 and wanted > self.max_logprobs:
            raise ValueError(f"{name}: {wanted} exceeds max_logprobs ({self.max_logprobs})")
        if wanted > vocab:
            raise ValueError(
                f"{name}: {wanted} exceeds the vocabulary ({vocab} tokens); ask for at most {vocab}, or -1 for all"
            )

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


def _split_token_types(prompt: PromptType) -> tuple[PromptType, list[int] | None]:
    """A pooling prompt's `token_type_ids` (vLLM's TokensPrompt field: the segments of a text
    pair), apart from the rest of it; they need the pair's `prompt_token_ids`."""
    if not isinstance(prompt, Mapping) or "token_type_ids" not in prompt:
        return prompt, None
    if "prompt_token_ids" not in prompt:
        raise ValueError("token_type_ids: given without prompt_token_ids (one segment id per token)")
    types = prompt["token_type_ids"]
    if not isinstance(types, list | tuple) or not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise ValueError("token_type_ids: must be a list of ints")
    return {k: v for k, v in prompt.items() if k != "token_type_ids"}, list(types)


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


