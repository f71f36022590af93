"""What the HTTP routes share: the engine and the server's settings, built once at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field

from triollm.actors.async_llm import AsyncLLM

__all__ = ["ServerSettings", "ServerState"]


@dataclass(frozen=True)
class ServerSettings:
    served_model_names: tuple[str, ...]
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    response_role: str = "assistant"
    chat_template: str | None = None
    max_logprobs: int = 20
    disable_log_requests: bool = False


@dataclass
class ServerState:
    llm: AsyncLLM
    settings: ServerSettings
    # False once shutdown began: new generation requests get 503, in-flight ones go on.
    accepting: bool = True
    metrics: object | None = field(default=None)  # api.metrics.Metrics, when enabled
