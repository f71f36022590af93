"""What the HTTP routes share: the engine and the server's settings, built once at start-up,
and the admission of generation requests that the drain closes without a gap."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

from triollm.actors.async_llm import AsyncLLM
from triollm.api.metrics import Metrics
from triollm.api.serving_models import LoRAModulePath, ServedModels

if TYPE_CHECKING:
    from triollm.api.tracing import RequestTracer

__all__ = ["CONTENT_FORMATS", "ServerSettings", "ServerState"]

DEFAULT_LIMIT_CONCURRENCY = 2048  # as many as the default listen backlog queues
DEFAULT_MAX_HEADER_COUNT = 256  # vLLM's default
DEFAULT_BODY_TIMEOUT_S = 60.0  # a 64 MiB body at about 1 MiB/s
CONTENT_FORMATS = ("auto", "string", "openai")  # vLLM's --chat-template-content-format


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    # One key, or several (vLLM's `--api-key a b`): any of them is accepted (`api_keys`).
    api_key: str | Sequence[str] | None = None
    # `--api-key-all-routes`: every route needs the key (by default /health, /version,
    # /openapi.json, /tokenize, /detokenize and /metrics are open).
    api_key_all_routes: bool = False
    allowed_origins: tuple[str, ...] = ()  # CORS: none, no CORS at all
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    # The ASGI root_path (`--root-path`): the prefix a path-routing proxy serves the app under.
    root_path: str = ""
    # `--disable-fastapi-docs`: no /openapi.json (the only docs route here).
    disable_docs: bool = False
    response_role: str = "assistant"
    chat_template: str | None = None
    max_logprobs: int = 20
    disable_log_requests: bool = False
    # With request logging: log each request's output text too (`--enable-log-outputs`), and
    # `--max-log-len`: the most prompt characters / token ids a request line shows (None: the
    # prompt is not shown, only its length; log lines stay bounded either way).
    enable_log_outputs: bool = False
    max_log_len: int | None = None
    # What one request may hold (api/limits.py): concurrent requests (None: no cap), headers,
    # and the seconds its body may take to arrive.
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY
    h11_max_header_count: int = DEFAULT_MAX_HEADER_COUNT
    request_body_timeout: float = DEFAULT_BODY_TIMEOUT_S
    # Tool calling and reasoning output (vLLM's flags): `tool_choice="auto"` needs both of the
    # first two; the names are checked against the parser registries at start-up.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # `--trust-request-chat-template` (vLLM's): a request may bring its own `chat_template`.
    trust_request_chat_template: bool = False
    # LoRA adapters served from start-up (`--lora-modules`, serving_models.py), and the load /
    # unload routes (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`, read once by serve_args.py).
    lora_modules: tuple[LoRAModulePath, ...] = ()
    allow_runtime_lora_updating: bool = False
    # `--default-chat-template-kwargs` (vLLM's): merged under each request's chat_template_kwargs
    # (the request's keys win), e.g. {"enable_thinking": False} for Qwen3.
    default_chat_template_kwargs: Mapping[str, Any] | None = None
    # `--chat-template-content-format` (vLLM's): how a message's content reaches the template:
    # "string" (content parts joined into one text), "openai" (a list of {"type", "text"} parts,
    # a plain string wrapped into one), "auto" (lists kept when the template loops over a
    # message's content, else joined: serving_common.content_format_of).
    chat_template_content_format: str = "auto"
    # `--enable-prompt-tokens-details` (vLLM's): usage.prompt_tokens_details.cached_tokens, the
    # prompt tokens the prefix cache held, on chat and completions.
    enable_prompt_tokens_details: bool = False
    # `--otlp-traces-endpoint` (vLLM's): an OpenTelemetry span per request sent there (tracing.py).
    otlp_traces_endpoint: str | None = None

    @property
    def api_keys(self) -> tuple[str, ...]:
        if self.api_key is None:
            return ()
        return (self.api_key,) if isinstance(self.api_key, str) else tuple(self.api_key)

    def __post_init__(self) -> None:
        if any(not isinstance(k, str) or not k for k in self.api_keys):
            raise ValueError("api_key: every key must be a non-empty string (an empty one would accept `Bearer `)")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"root_path: must start with '/' and not end with one (e.g. /api), got {self.root_path!r}")
        if self.max_log_len is not None and self.max_log_len < 0:
            raise ValueError(f"max_log_len: must be a non-negative integer or None, got {self.max_log_len}")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency: must be at least 1 (or None: no cap), got {self.limit_concurrency}")
        if self.h11_max_header_count < 1:
            raise ValueError(f"h11_max_header_count: must be at least 1, got {self.h11_max_header_count}")
        if self.chat_template_content_format not in CONTENT_FORMATS:
            raise ValueError(
                f"chat_template_content_format: {self.chat_template_content_format!r} is not one of "
                f"{', '.join(CONTENT_FORMATS)}"
            )
        if not 0 < self.request_body_timeout < float("inf"):
            raise ValueError(
                f"request_body_timeout: must be a positive number of seconds, got {self.request_body_timeout}"
            )


@dataclass
class ServerState:
    llm: AsyncLLM
    settings: ServerSettings
    # False once shutdown began: new generation requests get 503, in-flight ones go on.
    accepting: bool = True
    metrics: Metrics | None = None  # the /metrics route and request timers, when enabled
    tracer: RequestTracer | None = None  # a span per request (api/tracing.py), when enabled
    models: ServedModels = field(init=False)  # the base model's names and the LoRA adapters
    _entering: int = field(default=0, repr=False)  # requests inside `admission()`
    _entered: anyio.Event | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self.models = ServedModels(self.settings.served_model_names, self.settings.lora_modules)

    @contextmanager
    def admission(self) -> Iterator[None]:
        """Around `llm.add_request`: refused once the drain began (`ServiceUnavailable`, a 503),
        checked and counted with no await in between, so a request that was tokenizing when the
        drain started is either refused here or known to the drain (`wait_admitted`)."""
        if not self.accepting:
            from triollm.api.openai_errors import service_unavailable

            raise service_unavailable("The server is shutting down and accepts no new requests")
        self._entering += 1
        try:
            yield
        finally:
            self._entering -= 1
            if self._entering == 0 and self._entered is not None:
                self._entered.set()

    async def wait_admitted(self) -> None:
        """Until no request is inside `admission()` (those entering are in the engine after)."""
        while self._entering:
            if self._entered is None or self._entered.is_set():
                self._entered = anyio.Event()
            await self._entered.wait()
