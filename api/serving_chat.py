"""`POST /v1/chat/completions`: messages rendered with the chat template, `chat.completion`
objects (or `chat.completion.chunk` SSE events) out.

Streaming: one role chunk per choice first (delta `{"role": ..., "content": ""}`), then content
deltas (a chunk may carry several tokens: the request stream merges them under load), exactly one
chunk per choice with a finish_reason, then (include_usage) a usage chunk with `choices: []`.
`top_logprobs` lists the N most likely tokens at each position (by logprob), as OpenAI does.

Tools and reasoning (`plan_tool_output` of api/output_plan.py, as for the Responses API):
`tools` reach the template; a forced call (a named function or "required") is generated under
a grammar built from the tools' schemas; under "auto" the server's tool-call parser reads the
calls from the text, and its reasoning parser splits reasoning off first. With none of these in play the text passes
through untouched. Streamed, each choice's parsers hold back only what may still become part
of a marker, and the deltas add up to the whole answer's message.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from triollm.api.chat_images import take_chat_images
from triollm.api.openai_errors import bad_request
from triollm.api.output_parsing import OutputParsing, OutputPiece
from triollm.api.output_plan import plan_tool_output, structured_outputs_params
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
    PromptTokensDetails,
    UsageInfo,
)
from triollm.api.request_log import OutputLog, log_request
from triollm.api.serving_common import (
    Started,
    beam_search_params,
    build_sampling_params,
    check_logprobs,
    clamp_logprob,
    created_now,
    output_kind,
    prompt_logprobs_out,
    render_chat,
    start_generation,
    stream_flags,
    token_text,
    truncate_prompt,
)
from triollm.api.sse import GenerationResponse, Job
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.outputs import Logprob, RequestOutput, SampleLogprobs
from triollm.engine.processing.tokenizer import Tokenizer

__all__ = [
    "ChatFormatter",
    "chat_generation",
    "create_chat_completion",
    "render_chat_request",
    "with_default_template_kwargs",
]


async def create_chat_completion(
    state: ServerState, request: Request, chat_template: str | None
) -> Response:
    start = await start_generation(
        state, request, ChatCompletionRequest, api="Chat Completions API", id_prefix="chatcmpl-"
    )
    job, formatter = await chat_generation(state, start, chat_template)
    return GenerationResponse(
        state.llm,
        [job],
        formatter,
        stream=bool(start.req.stream),
        label=start.request_id,
        timer=start.timer,
        admission=state.admission,
        trace=start.trace,
        model=start.model,
    )


async def chat_generation(
    state: ServerState, start: Started[ChatCompletionRequest], chat_template: str | None
) -> tuple[Job, ChatFormatter]:
    """A chat request past `start_generation` as its engine job and the formatter of its
    answer: the checks of its fields (400s naming them), its tools, grammar and parsers, its
    sampling parameters and its rendered prompt. The Messages API (serving_messages.py) runs
    the chat it converts an Anthropic request into through here too."""
    req, model, lora = start.req, start.model, start.lora
    response_id, timer = start.request_id, start.timer
    stream, include_usage, continuous = stream_flags(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request(
            "top_logprobs: when using `top_logprobs`, `logprobs` must be set to true.",
            "top_logprobs",
        )
    check_logprobs(state, "top_logprobs", req.top_logprobs)
    check_logprobs(state, "prompt_logprobs", req.prompt_logprobs)
    settings = state.settings
    req = with_default_template_kwargs(req, settings)
    if req.chat_template is not None and not settings.trust_request_chat_template:
        raise bad_request(
            "chat_template: a chat template in the request needs the server started with "
            "--trust-request-chat-template",
            "chat_template",
        )
    plan = await plan_tool_output(
        state,
        req.tools,
        req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        constraint=functools.partial(structured_outputs_params, req),
        constraint_name="response_format or structured outputs",
        include_reasoning=req.include_reasoning,
        chat_template_kwargs=req.chat_template_kwargs,
    )
    llm = state.llm
    tokenizer, parsing = plan.tokenizer, plan.parsing
    if parsing.keep_special_tokens and req.skip_special_tokens:
        req = msgspec.structs.replace(req, skip_special_tokens=False)  # the parser reads them
    model_config = llm.get_model_config()
    defaults = model_config.generation_defaults
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
        structured=plan.structured,
    )
    req, images = await take_chat_images(state, req, tokenizer)
    text, token_ids = await render_chat_request(
        tokenizer, req, chat_template, content_format=settings.chat_template_content_format
    )
    prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": token_ids}
    if req.truncate_prompt_tokens is not None:
        token_ids = truncate_prompt(token_ids, req.truncate_prompt_tokens, model_config.max_model_len)
        prompt = {"prompt_token_ids": token_ids}
    if images:
        prompt["multi_modal_data"] = {"image": images}
    beam = beam_search_params(req, max_tokens, model_config.max_model_len)
    if beam is not None and params.structured_outputs is not None:  # a forced tool call's grammar, guided_*: dropped
        raise bad_request(
            "use_beam_search: cannot be combined with structured outputs or a forced tool call (tool_choice "
            '"required" or a named function): beam search runs without a grammar',
            "use_beam_search",
        )
    job = Job(prompt, params, response_id, req.priority, beam, lora)
    log_request(settings, response_id, params, prompt=text, prompt_token_ids=token_ids)
    role = settings.response_role if req.add_generation_prompt else req.messages[-1].role
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
        parsing=parsing,
        echo=_echo_text(req, role),
        tokens_as_ids=bool(req.return_tokens_as_token_ids),
        output_log=OutputLog(settings, response_id),
        prompt_tokens_details=settings.enable_prompt_tokens_details,
    )
    return job, formatter


async def render_chat_request(
    tokenizer: Tokenizer, req: ChatCompletionRequest, chat_template: str | None, *, content_format: str = "auto"
) -> tuple[str, list[int]]:
    """The prompt of a chat request, as its generation sees it (text and token ids);
    `content_format`: the server's `--chat-template-content-format`."""
    return await render_chat(
        tokenizer,
        req.messages,
        template=chat_template,
        request_template=req.chat_template,  # its text, never a path (GHSA-6fvq-23cw-5628)
        add_generation_prompt=req.add_generation_prompt,
        continue_final_message=req.continue_final_message,
        template_kwargs=req.chat_template_kwargs,
        add_special_tokens=req.add_special_tokens,
        tools=req.tools,
        documents=req.documents,
        content_format=content_format,
    )


def with_default_template_kwargs(req: ChatCompletionRequest, settings: ServerSettings) -> ChatCompletionRequest:
    """`req` with the server's `--default-chat-template-kwargs` merged under its own (its keys win)."""
    if not settings.default_chat_template_kwargs:
        return req
    merged = {**settings.default_chat_template_kwargs, **(req.chat_template_kwargs or {})}
    return msgspec.structs.replace(req, chat_template_kwargs=merged)


def _echo_text(req: ChatCompletionRequest, role: str) -> str:
    """vLLM's `echo` on chat: the last message's content, when that message has the role the
    answer continues (a continue_final_message request)."""
    if not req.echo:
        return ""
    last = req.messages[-1]
    if last.role != role or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "\n".join(p.text or "" for p in last.content)


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
        parsing: OutputParsing | None = None,
        echo: str = "",
        tokens_as_ids: bool = False,
        output_log: OutputLog | None = None,
        prompt_tokens_details: bool = False,
    ) -> None:
        """`prompt_tokens_details` (`--enable-prompt-tokens-details`): usage reports the prompt
        tokens the prefix cache held (`prompt_tokens_details.cached_tokens`)."""
        self.id = response_id
        self.cached_tokens: int | None = 0 if prompt_tokens_details else None
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
        self.parsing = parsing if parsing is not None and _parses(parsing) else None
        self.streams = [self.parsing.stream() for _ in range(n)] if self.parsing is not None else []
        self.echo = echo
        self.tokens_as_ids = tokens_as_ids
        self.output_log = output_log

    # ------------------------------------------------------------------ streaming

    def stream_start(self) -> list[Any]:
        chunks = [
            self._chunk(
                ChatStreamChoice(i, DeltaMessage(role=self.role, content=""), None, None),
                self._usage(i) if self.continuous_usage else None,
            )
            for i in range(self.n)
        ]
        if self.echo:
            chunks += [
                self._chunk(ChatStreamChoice(i, DeltaMessage(content=self.echo), None, None), None)
                for i in range(self.n)
            ]
        return chunks

    def stream_output(self, index: int, output: RequestOutput) -> list[Any]:
        self.prompt_tokens = len(output.prompt_token_ids)
        self._note_cached(output)
        chunks: list[Any] = []
        for c in output.outputs:
            i = c.index
            if self.finished[i]:
                continue
            self.completion_tokens[i] += len(c.token_ids)
            if not (c.text or c.token_ids or c.finish_reason is not None):
                continue
            self.finished[i] = c.finish_reason is not None
            if self.output_log is not None:
                self.output_log.add(i, c.text)
                if c.finish_reason is not None:
                    self.output_log.done(i, c.finish_reason)
            delta, finish_reason = self._delta(i, c.text, c.finish_reason)
            if delta is None and c.finish_reason is None and not c.token_ids:
                continue
            choice = ChatStreamChoice(
                i,
                delta or DeltaMessage(),
                self._logprobs(c.token_ids, c.logprobs),
                finish_reason,
                c.stop_reason,
            )
            chunks.append(self._chunk(choice, self._usage(i) if self.continuous_usage else None))
        return chunks

    def _delta(self, i: int, text: str, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        """The delta of choice `i` (None: everything was held back by the parsers)."""
        if self.parsing is None:
            return DeltaMessage(content=text), finish_reason
        stream = self.streams[i]
        piece = stream.feed(text)
        if finish_reason is not None:
            end = stream.finish()
            piece = OutputPiece(
                piece.content + end.content, piece.reasoning + end.reasoning, piece.tool_calls + end.tool_calls
            )
            if stream.tool_called:
                finish_reason = "tool_calls"
        if not piece:
            return (DeltaMessage(content="") if finish_reason is not None else None), finish_reason
        return (
            DeltaMessage(
                content=piece.content or None,
                reasoning=piece.reasoning or None,
                reasoning_content=piece.reasoning or None,
                tool_calls=piece.tool_calls or None,
            ),
            finish_reason,
        )

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
        return UsageInfo(p, c, p + c, self._details())

    def _total_usage(self) -> UsageInfo:
        p, c = self.prompt_tokens, sum(self.completion_tokens)
        return UsageInfo(p, c, p + c, self._details())

    def _note_cached(self, output: RequestOutput) -> None:
        if self.cached_tokens is not None and output.num_cached_tokens is not None:
            self.cached_tokens = output.num_cached_tokens

    def _details(self) -> PromptTokensDetails | None:
        return None if self.cached_tokens is None else PromptTokensDetails(self.cached_tokens)

    # ------------------------------------------------------------------ non-streaming

    def final(self, outputs: list[RequestOutput]) -> ChatCompletionResponse:
        [output] = outputs
        self.prompt_tokens = len(output.prompt_token_ids)
        self._note_cached(output)
        choices: list[ChatChoice] = []
        for c in sorted(output.outputs, key=lambda c: c.index):
            self.completion_tokens[c.index] = len(c.token_ids)
            finish_reason = c.finish_reason
            if self.output_log is not None:
                self.output_log.add(c.index, c.text)
                self.output_log.done(c.index, finish_reason)
            if self.parsing is None:
                message = ChatResponseMessage(role=self.role, content=self.echo + c.text)
            else:
                parsed = self.parsing.whole(c.text)
                content = parsed.content
                if self.echo and not parsed.tool_calls:
                    content = self.echo + (content or "")
                message = ChatResponseMessage(
                    role=self.role,
                    content=content,
                    reasoning=parsed.reasoning,
                    reasoning_content=parsed.reasoning,
                    tool_calls=parsed.tool_calls,
                )
                if parsed.tool_called:
                    finish_reason = "tool_calls"
            choices.append(
                ChatChoice(
                    c.index,
                    message,
                    self._logprobs(c.token_ids, c.logprobs),
                    finish_reason,
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
            token = self._token(row, token_id)
            entry = None if row is None else row.get(token_id)
            top = sorted((row or {}).items(), key=lambda kv: -kv[1].logprob)[: self.top_logprobs]
            content.append(
                ChatLogprob(
                    token,
                    clamp_logprob(entry.logprob) if entry is not None else -9999.0,
                    _bytes(token),
                    [
                        ChatTopLogprob(
                            text := self._token(row, t),
                            clamp_logprob(lp.logprob),
                            _bytes(text),
                        )
                        for t, lp in top
                    ],
                )
            )
        return ChatLogprobs(content)

    def _token(self, row: dict[int, Logprob] | None, token_id: int) -> str:
        """A token as logprobs show it: its text, or (`return_tokens_as_token_ids`) vLLM's
        `token_id:N`, which stays exact where text cannot (a piece of a UTF-8 character)."""
        return f"token_id:{token_id}" if self.tokens_as_ids else token_text(row, token_id, self.tokenizer)


def _parses(parsing: OutputParsing) -> bool:
    """Whether a request's outputs go through the parsers at all (a plain chat does not)."""
    return parsing.choice.forced or parsing.tool_parser is not None or parsing.reasoning_parser is not None


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))
