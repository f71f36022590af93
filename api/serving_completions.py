"""`POST /v1/completions`: prompts in, `text_completion` objects (or SSE chunks) out.

Choice index = prompt index × n + sample index; usage sums over prompts (each prompt's tokens
counted once, however large n). `logprobs` uses the legacy completions format: per token the
sampled token's logprob and a dict of up to `logprobs + 1` entries (the sampled token first,
then the top ones, as vLLM/OpenAI); `text_offset` counts characters from the start of the
returned text (the echoed prompt included). With `echo` and `logprobs`, the prompt's logprobs
are computed too (vLLM sets prompt_logprobs = logprobs) and lead the list, the first prompt
token having `null` entries.
"""

from __future__ import annotations

import functools
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from triollm.api.openai_errors import bad_request
from triollm.api.output_plan import structured_outputs_params
from triollm.api.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    PromptTokensDetails,
    UsageInfo,
)
from triollm.api.request_log import log_request
from triollm.api.serving_common import (
    beam_search_params,
    build_sampling_params,
    check_logprobs,
    clamp_logprob,
    created_now,
    maybe_in_thread,
    output_kind,
    prompt_logprobs_out,
    start_generation,
    stream_flags,
    token_text,
    truncate_prompt,
)
from triollm.api.sse import GenerationResponse, Job
from triollm.api.state import ServerState
from triollm.engine.inputs import PromptType
from triollm.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    SampleLogprobs,
)
from triollm.engine.processing.tokenizer import Tokenizer

__all__ = ["create_completion"]

_PROMPT_FORMS = (
    "prompt: must be a string, a list of strings, a list of token ids or a list of token-id lists"
)


async def create_completion(state: ServerState, request: Request) -> Response:
    start = await start_generation(
        state, request, CompletionRequest, api="Completions API", id_prefix="cmpl-"
    )
    req, model, lora = start.req, start.model, start.lora
    response_id, timer = start.request_id, start.timer
    stream, include_usage, continuous = stream_flags(req)
    if req.suffix:
        raise bad_request("suffix: is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request("best_of: only best_of == n is supported", "best_of")
    check_logprobs(state, "logprobs", req.logprobs)
    check_logprobs(state, "prompt_logprobs", req.prompt_logprobs)
    if isinstance(req.prompt, list) and req.prompt and not isinstance(req.prompt[0], int):
        check_num_prompts(state, len(req.prompt))  # a list of prompts: counted before any walk
    prompt = req.prompt
    prompts = await maybe_in_thread(
        lambda: normalize_prompts(prompt), len(prompt) if isinstance(prompt, list) else 0
    )
    check_num_prompts(state, len(prompts))
    check_num_sequences(state, len(prompts), req.n)
    llm = state.llm
    if req.truncate_prompt_tokens is not None:
        prompts = await _truncated(llm, prompts, req.truncate_prompt_tokens)
    defaults = llm.get_model_config().generation_defaults
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs
    params = build_sampling_params(
        req,
        defaults,
        max_tokens=req.max_tokens,
        logprobs=req.logprobs,
        prompt_logprobs=prompt_logprobs,
        kind=output_kind(stream, timer),
        structured=await structured_outputs_params(req),
    )
    beam = beam_search_params(req, req.max_tokens, llm.get_model_config().max_model_len)
    if beam is not None and params.structured_outputs is not None:  # a guided_* field's grammar would be dropped
        raise bad_request(
            "use_beam_search: cannot be combined with structured outputs (structured_outputs, response_format or a "
            "guided_* field): beam search runs without a grammar",
            "use_beam_search",
        )
    jobs = [
        Job(p, params if i == 0 else params.clone(), f"{response_id}-{i}", req.priority, beam, lora)
        for i, p in enumerate(prompts)
    ]
    first = prompts[0]
    log_request(
        state.settings, response_id, params,
        prompt=first if isinstance(first, str) else None,
        prompt_token_ids=None if isinstance(first, str) else first.get("prompt_token_ids"),  # type: ignore[union-attr]
    )  # fmt: skip
    formatter = CompletionFormatter(
        response_id=response_id,
        model=model,
        n=req.n,
        num_prompts=len(prompts),
        echo=bool(req.echo),
        logprobs=req.logprobs,
        include_usage=include_usage,
        continuous_usage=continuous,
        tokenizer=llm.get_tokenizer(),
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        prompt_tokens_details=state.settings.enable_prompt_tokens_details,
    )
    return GenerationResponse(
        llm, jobs, formatter,
        stream=stream,
        label=response_id,
        timer=timer,
        admission=state.admission,
        trace=start.trace,
        model=model,
    )


async def _truncated(llm: Any, prompts: list[PromptType], keep: int) -> list[PromptType]:
    """`truncate_prompt_tokens`: each prompt's last `keep` tokens (texts tokenized here)."""
    tokenizer = llm.get_tokenizer()
    max_model_len = llm.get_model_config().max_model_len
    out: list[PromptType] = []
    for p in prompts:
        if isinstance(p, str):
            ids = await maybe_in_thread(functools.partial(tokenizer.encode, p), len(p))
        else:
            ids = list(p["prompt_token_ids"])  # type: ignore[index]
        out.append({"prompt_token_ids": truncate_prompt(ids, keep, max_model_len)})
    return out


def check_num_prompts(state: ServerState, count: int) -> None:
    """400 for more prompts than `max_prompts_per_request`, before any is tokenized."""
    config = state.llm.config
    limit = config.limits.max_prompts_per_request if config is not None else None
    if limit is not None and count > limit:
        raise bad_request(
            f"prompt: {count} prompts exceed max_prompts_per_request ({limit})", "prompt"
        )


def check_num_sequences(state: ServerState, num_prompts: int, n: int | None) -> None:
    """400 for a body whose prompts x `n` sequences exceed what the engine ever holds at once
    (`max_num_seqs` running + `max_num_queued_reqs` queued): it could only end in 429s, after
    every sequence was built. Checked before any prompt is tokenized."""
    config = state.llm.config
    if config is None or config.limits.max_num_queued_reqs is None or not isinstance(n, int):
        return
    room = config.scheduler.max_num_seqs + config.limits.max_num_queued_reqs
    if num_prompts * n > room:
        raise bad_request(
            f"n: {num_prompts} prompt(s) x n={n} = {num_prompts * n} sequences exceed what the "
            f"engine holds at once (max_num_seqs + max_num_queued_reqs = {room})",
            "n",
        )


def normalize_prompts(prompt: str | list[Any]) -> list[PromptType]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt: must not be empty", "prompt")
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": prompt}]
    if all(isinstance(p, list) for p in prompt):
        return [{"prompt_token_ids": p} for p in prompt]
    raise bad_request(_PROMPT_FORMS + ", not a mix", "prompt")


class CompletionFormatter:
    def __init__(
        self,
        *,
        response_id: str,
        model: str,
        n: int,
        num_prompts: int,
        echo: bool,
        logprobs: int | None,
        include_usage: bool,
        continuous_usage: bool,
        tokenizer: Tokenizer,
        tokens_as_ids: bool = False,
        prompt_tokens_details: bool = False,
    ) -> None:
        """`prompt_tokens_details` (`--enable-prompt-tokens-details`): usage reports the prompt
        tokens the prefix cache held, summed over the prompts as the prompt tokens are."""
        self.id = response_id
        self.details = prompt_tokens_details
        self.tokens_as_ids = tokens_as_ids  # vLLM's return_tokens_as_token_ids: "token_id:N"
        self.created = created_now()
        self.model = model
        self.n = n
        self.echo = echo
        self.logprobs = logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.tokenizer = tokenizer
        choices = num_prompts * n
        self.prompt_tokens = [0] * num_prompts
        self.cached_tokens = [0] * num_prompts
        self.prompt_rows: list[PromptLogprobs] = [[] for _ in range(num_prompts)]
        self.completion_tokens = [0] * choices
        self.offsets = [0] * choices  # text_offset of the choice's next token
        self.started = [False] * choices  # the echoed prompt went out
        self.finished = [False] * choices

    # ------------------------------------------------------------------ streaming

    def stream_start(self) -> list[Any]:
        return []

    def stream_output(self, index: int, output: RequestOutput) -> list[Any]:
        self.prompt_tokens[index] = len(output.prompt_token_ids)
        self.cached_tokens[index] = output.num_cached_tokens or 0
        if output.prompt_logprobs:
            self.prompt_rows[index].extend(output.prompt_logprobs)
        chunks: list[Any] = []
        for c in output.outputs:
            i = index * self.n + c.index
            if self.finished[i]:
                continue
            self.completion_tokens[i] += len(c.token_ids)
            if not (c.text or c.token_ids or c.finish_reason is not None):
                continue  # prefill progress, nothing to say yet
            first = not self.started[i]
            self.started[i] = True
            text, logprobs = self._choice_text(i, index, output, c, self.prompt_rows[index], first)
            self.finished[i] = c.finish_reason is not None
            usage = self._usage_of(index, i) if self.continuous_usage else None
            choice = CompletionStreamChoice(i, text, logprobs, c.finish_reason, c.stop_reason)
            chunks.append(self._chunk([choice], usage))
        return chunks

    def stream_end(self) -> list[Any]:
        if not self.include_usage:
            return []
        return [self._chunk([], self._total_usage())]

    def _chunk(self, choices: list[CompletionStreamChoice], usage: UsageInfo | None) -> Any:
        return CompletionStreamResponse(
            self.id, "text_completion", self.created, self.model, choices, usage
        )

    def _usage_of(self, prompt: int, choice: int) -> UsageInfo:
        p, c = self.prompt_tokens[prompt], self.completion_tokens[choice]
        return UsageInfo(p, c, p + c, self._details(self.cached_tokens[prompt]))

    def _total_usage(self) -> UsageInfo:
        p, c = sum(self.prompt_tokens), sum(self.completion_tokens)
        return UsageInfo(p, c, p + c, self._details(sum(self.cached_tokens)))

    def _details(self, cached: int) -> PromptTokensDetails | None:
        return PromptTokensDetails(cached) if self.details else None

    # ------------------------------------------------------------------ non-streaming

    def final(self, outputs: list[RequestOutput]) -> CompletionResponse:
        choices: list[CompletionChoice] = []
        for index, output in enumerate(outputs):
            self.prompt_tokens[index] = len(output.prompt_token_ids)
            self.cached_tokens[index] = output.num_cached_tokens or 0
            rows = output.prompt_logprobs or []
            prompt_lps = prompt_logprobs_out(output.prompt_logprobs)
            for c in sorted(output.outputs, key=lambda c: c.index):
                i = index * self.n + c.index
                self.completion_tokens[i] = len(c.token_ids)
                text, logprobs = self._choice_text(i, index, output, c, rows, True)
                choices.append(
                    CompletionChoice(i, text, logprobs, c.finish_reason, c.stop_reason, prompt_lps)
                )
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._total_usage(),
        )

    # ------------------------------------------------------------------ text and logprobs

    def _choice_text(
        self,
        i: int,
        index: int,
        output: RequestOutput,
        c: CompletionOutput,
        prompt_rows: PromptLogprobs,
        first: bool,
    ) -> tuple[str, CompletionLogProbs | None]:
        text = c.text
        logprobs = None if self.logprobs is None else CompletionLogProbs([], [], [], [])
        if first and self.echo:
            prompt_ids = output.prompt_token_ids
            prompt_text = output.prompt
            if prompt_text is None:
                prompt_text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
            text = prompt_text + text
            if logprobs is not None:
                self._add_logprobs(logprobs, i, prompt_ids, prompt_rows)
        if logprobs is not None:
            self._add_logprobs(logprobs, i, c.token_ids, c.logprobs)
        return text, logprobs

    def _token(self, row: dict[int, Logprob] | None, token_id: int) -> str:
        return f"token_id:{token_id}" if self.tokens_as_ids else token_text(row, token_id, self.tokenizer)

    def _add_logprobs(
        self,
        into: CompletionLogProbs,
        i: int,
        token_ids: list[int],
        rows: SampleLogprobs | PromptLogprobs | None,
    ) -> None:
        assert self.logprobs is not None
        top_n = self.logprobs
        for k, token_id in enumerate(token_ids):
            row = rows[k] if rows is not None and k < len(rows) else None
            token = self._token(row, token_id)
            entry = None if row is None else row.get(token_id)
            into.tokens.append(token)
            into.text_offset.append(self.offsets[i])
            self.offsets[i] += len(token)
            if row is None or entry is None:
                into.token_logprobs.append(None)
                into.top_logprobs.append(None)
                continue
            into.token_logprobs.append(clamp_logprob(entry.logprob))
            into.top_logprobs.append(
                {
                    self._token(row, t): clamp_logprob(lp.logprob)
                    for rank, (t, lp) in enumerate(row.items())
                    if rank <= top_n
                }
            )
