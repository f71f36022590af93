"""`POST /v1/chat/completions`: messages rendered with the chat template, `chat.completion`
objects (or `chat.completion.chunk` SSE events) out.

Streaming: one role chunk per choice first (delta `{"role": ..., "content": ""}`), then content
deltas (a chunk may carry several tokens: the request stream merges them under load), exactly one
chunk per choice with a finish_reason, then (include_usage) a usage chunk with `choices: []`.
`top_logprobs` lists the N most likely tokens at each position (by logprob), as OpenAI does.
"""

from __future__ import annotations

import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from triollm.api.log_bounds import short_repr
from triollm.api.openai_errors import bad_request
from triollm.api.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTopLogprob,
    DeltaMessage,
    UsageInfo,
)
from triollm.api.serving_common import (
    beam_search_params,
    build_sampling_params,
    check_available,
    check_logprobs,
    clamp_logprob,
    created_now,
    decode_body,
    output_kind,
    prompt_logprobs_out,
    render_chat,
    request_id_base,
    resolve_model,
    start_timer,
    stream_flags,
    structured_outputs_params,
    token_text,
)
from triollm.api.sse import GenerationResponse, Job
from triollm.api.state import ServerState
from triollm.engine.outputs import RequestOutput, SampleLogprobs
from triollm.engine.processing.tokenizer import Tokenizer

__all__ = ["create_chat_completion"]

log = logging.getLogger("triollm.api")


async def create_chat_completion(
    state: ServerState, request: Request, chat_template: str | None
) -> Response:
    check_available(state)
    req = await decode_body(request, ChatCompletionRequest)
    model = resolve_model(state, req.model)
    response_id = f"chatcmpl-{request_id_base(request, req.request_id)}"
    timer = start_timer(state, model)
    stream, include_usage, continuous = stream_flags(req)
    _check_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request(
            "top_logprobs: when using `top_logprobs`, `logprobs` must be set to true.",
            "top_logprobs",
        )
    check_logprobs(state, "top_logprobs", req.top_logprobs)
    check_logprobs(state, "prompt_logprobs", req.prompt_logprobs)
    llm = state.llm
    tokenizer = llm.get_tokenizer()
    defaults = llm.get_model_config().generation_defaults
    max_tokens = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    if max_tokens is None:
        max_tokens = defaults.get("max_tokens")  # None: the rest of the context
    params = build_sampling_params(
        req,
        defaults,
        max_tokens=max_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        kind=output_kind(stream, timer),
        structured=await structured_outputs_params(req),
    )
    text, token_ids = await render_chat(
        tokenizer,
        req.messages,
        template=chat_template,
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs,
    )
    beam = beam_search_params(req, max_tokens, llm.get_model_config().max_model_len)
    job = Job({"prompt": text, "prompt_token_ids": token_ids}, params, response_id, req.priority, beam)
    if not state.settings.disable_log_requests:
        log.info(
            "Received request %s: %d prompt tokens, params: %s",
            response_id, len(token_ids), short_repr(params),
        )
    role = state.settings.response_role if req.add_generation_prompt else req.messages[-1].role
    formatter = ChatFormatter(
        response_id=response_id,
        model=model,
        n=req.n,
        role=role,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        include_usage=include_usage,
        continuous_usage=continuous,
        tokenizer=tokenizer,
        prompt_tokens=len(token_ids),
    )
    return GenerationResponse(
        llm,
        [job],
        formatter,
        stream=stream,
        label=response_id,
        timer=timer,
        admission=state.admission,
    )


def _check_unsupported(req: ChatCompletionRequest) -> None:
    if req.tools and req.tool_choice != "none":
        raise bad_request("tools: tool calling is not supported by this server", "tools")


class ChatFormatter:
    def __init__(
        self,
        *,
        response_id: str,
        model: str,
        n: int,
        role: str,
        top_logprobs: int | None,
        include_usage: bool,
        continuous_usage: bool,
        tokenizer: Tokenizer,
        prompt_tokens: int,
    ) -> None:
        self.id = response_id
        self.created = created_now()
        self.model = model
        self.n = n
        self.role = role
        self.top_logprobs = top_logprobs
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = [0] * n
        self.finished = [False] * n

    # ------------------------------------------------------------------ streaming

    def stream_start(self) -> list[Any]:
        return [
            self._chunk(
                ChatStreamChoice(i, DeltaMessage(role=self.role, content=""), None, None),
                self._usage(i) if self.continuous_usage else None,
            )
            for i in range(self.n)
        ]

    def stream_output(self, index: int, output: RequestOutput) -> list[Any]:
        self.prompt_tokens = len(output.prompt_token_ids)
        chunks: list[Any] = []
        for c in output.outputs:
            i = c.index
            if self.finished[i]:
                continue
            self.completion_tokens[i] += len(c.token_ids)
            if not (c.text or c.token_ids or c.finish_reason is not None):
                continue
            self.finished[i] = c.finish_reason is not None
            choice = ChatStreamChoice(
                i,
                DeltaMessage(content=c.text),
                self._logprobs(c.token_ids, c.logprobs),
                c.finish_reason,
                c.stop_reason,
            )
            chunks.append(self._chunk(choice, self._usage(i) if self.continuous_usage else None))
        return chunks

    def stream_end(self) -> list[Any]:
        if not self.include_usage:
            return []
        return [
            ChatCompletionChunk(
                self.id, "chat.completion.chunk", self.created, self.model, [], self._total_usage()
            )
        ]

    def _chunk(self, choice: ChatStreamChoice, usage: UsageInfo | None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            self.id, "chat.completion.chunk", self.created, self.model, [choice], usage
        )

    def _usage(self, i: int) -> UsageInfo:
        p, c = self.prompt_tokens, self.completion_tokens[i]
        return UsageInfo(p, c, p + c)

    def _total_usage(self) -> UsageInfo:
        p, c = self.prompt_tokens, sum(self.completion_tokens)
        return UsageInfo(p, c, p + c)

    # ------------------------------------------------------------------ non-streaming

    def final(self, outputs: list[RequestOutput]) -> ChatCompletionResponse:
        [output] = outputs
        self.prompt_tokens = len(output.prompt_token_ids)
        choices: list[ChatChoice] = []
        for c in sorted(output.outputs, key=lambda c: c.index):
            self.completion_tokens[c.index] = len(c.token_ids)
            choices.append(
                ChatChoice(
                    c.index,
                    ChatResponseMessage(self.role, c.text),
                    self._logprobs(c.token_ids, c.logprobs),
                    c.finish_reason,
                    c.stop_reason,
                )
            )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self._total_usage(),
            prompt_logprobs=prompt_logprobs_out(output.prompt_logprobs),
        )

    # ------------------------------------------------------------------ logprobs

    def _logprobs(self, token_ids: list[int], rows: SampleLogprobs | None) -> ChatLogprobs | None:
        if self.top_logprobs is None:
            return None
        content: list[ChatLogprob] = []
        for k, token_id in enumerate(token_ids):
            row = rows[k] if rows is not None and k < len(rows) else None
            token = token_text(row, token_id, self.tokenizer)
            entry = None if row is None else row.get(token_id)
            top = sorted((row or {}).items(), key=lambda kv: -kv[1].logprob)[: self.top_logprobs]
            content.append(
                ChatLogprob(
                    token,
                    clamp_logprob(entry.logprob) if entry is not None else -9999.0,
                    _bytes(token),
                    [
                        ChatTopLogprob(
                            text := token_text(row, t, self.tokenizer),
                            clamp_logprob(lp.logprob),
                            _bytes(text),
                        )
                        for t, lp in top
                    ],
                )
            )
        return ChatLogprobs(content)


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))
