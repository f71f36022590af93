"""The handlers of the server's API routes, one method each, over one app's `ServerState`.

Each takes the request and returns the response; errors are raised (`APIError` and the
exceptions `openai_errors.from_exception` maps), and the app's guard turns them into OpenAI
error bodies. Which paths reach which handler, and what /openapi.json says about them, is the
route table (routes.py); the generation handlers themselves live in the `serving_*` modules.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

import triollm
from triollm.actors.async_llm import AsyncLLM
from triollm.api.log_bounds import shorten
from triollm.api.openai_errors import APIError, bad_request, from_exception
from triollm.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
    decode_json,
    decode_request,
)
from triollm.api.serving_chat import create_chat_completion
from triollm.api.serving_common import (
    SMALL_BODY_BYTES,
    maybe_in_thread,
    read_body,
    render_chat,
    resolve_chat_template,
    resolve_model,
)
from triollm.api.serving_completions import create_completion
from triollm.api.serving_invocations import invoke
from triollm.api.serving_messages import count_message_tokens, create_message
from triollm.api.serving_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from triollm.api.serving_pooling import create_embedding, create_score
from triollm.api.serving_rerank import create_classify, create_cohere_embed, create_pooling, create_rerank
from triollm.api.serving_responses import ResponsesAPI
from triollm.api.state import ServerState
from triollm.engine.config import ModelConfig

__all__ = ["Endpoints"]


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


class Endpoints:
    """One app's handlers. `openapi_json` builds the /openapi.json body (once, at the first
    request): the app knows which routes it serves, the handlers do not."""

    def __init__(self, state: ServerState, openapi_json: Callable[[], bytes]) -> None:
        self.state = state
        self.llm: AsyncLLM = state.llm
        self.created = int(time.time())
        self.chat_template = resolve_chat_template(state.settings.chat_template)
        self.responses = ResponsesAPI(state, self.chat_template)  # serving_responses.py, its store
        self._openapi_json = openapi_json
        self._openapi: bytes | None = None

    def _model_config(self) -> ModelConfig:
        config = self.llm.config
        return config.model if config is not None else self.llm.get_model_config()

    # ------------------------------------------------------------------ generation and pooling

    async def completions(self, request: Request) -> Response:
        return await create_completion(self.state, request)

    async def chat(self, request: Request) -> Response:
        return await create_chat_completion(self.state, request, self.chat_template)

    async def create_response(self, request: Request) -> Response:
        return await self.responses.create(request)

    async def retrieve_response(self, request: Request) -> Response:
        return await self.responses.retrieve(request)

    async def delete_response(self, request: Request) -> Response:
        return await self.responses.delete(request)

    async def create_message(self, request: Request) -> Response:
        return await create_message(self.state, request, self.chat_template)

    async def count_message_tokens(self, request: Request) -> Response:
        return await count_message_tokens(self.state, request, self.chat_template)

    async def embeddings(self, request: Request) -> Response:
        return await create_embedding(self.state, request)

    async def score(self, request: Request) -> Response:
        return await create_score(self.state, request)

    async def rerank(self, request: Request) -> Response:
        return await create_rerank(self.state, request)

    async def classify(self, request: Request) -> Response:
        return await create_classify(self.state, request)

    async def pooling(self, request: Request) -> Response:
        return await create_pooling(self.state, request)

    async def cohere_embed(self, request: Request) -> Response:
        return await create_cohere_embed(self.state, request)

    async def invocations(self, request: Request) -> Response:
        """SageMaker's route: any body, answered by the route it belongs to."""
        pooler = self._model_config().pooler
        handlers = {
            "/v1/chat/completions": self.chat, "/v1/completions": self.completions, "/rerank": self.rerank,
            "/score": self.score, "/v1/embeddings": self.embeddings, "/classify": self.classify,
            "/pooling": self.pooling,
        }
        return await invoke(request, pooler.tasks if pooler is not None else (), handlers)

    # ------------------------------------------------------------------ models and adapters

    async def models(self, request: Request) -> Response:
        """The base model's names, then each LoRA adapter (`root` its path, `parent` the base
        model's served name), as vLLM lists them."""
        config = self._model_config()
        cards = [
            ModelCard(
                id=name,
                created=self.created,
                root=str(config.path),
                max_model_len=config.max_model_len,
            )
            for name in self.state.settings.served_model_names
        ]
        models = self.state.models
        cards += [
            ModelCard(
                id=lora.lora_name,
                created=self.created,
                root=lora.lora_path,
                parent=models.parent(lora),
                max_model_len=config.max_model_len,
            )
            for lora in models.adapters()
        ]
        return _json(ModelList(data=cards))

    async def load_lora_adapter(self, request: Request) -> Response:
        body = await read_body(request, SMALL_BODY_BYTES)
        lora = await self.state.models.load(self.llm, decode_request(body, LoadLoRAAdapterRequest))
        name = shorten(lora.lora_name, 100)
        text = f"Success: LoRA adapter '{name}' added successfully."
        return Response(text, media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = await read_body(request, SMALL_BODY_BYTES)
        lora = self.state.models.unload(decode_request(body, UnloadLoRAAdapterRequest))
        await self.llm.remove_lora(lora.lora_int_id)  # the engine's copy too, as vLLM's route does
        name = shorten(lora.lora_name, 100)
        text = f"Success: LoRA adapter '{name}' removed successfully."
        return Response(text, media_type="text/plain")

    # ------------------------------------------------------------------ service

    async def health(self, request: Request) -> Response:
        if self.llm.errored:
            raise from_exception(self.llm.dead_error or RuntimeError("engine dead"))
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return _json(VersionResponse(triollm.__version__))

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:
            self._openapi = self._openapi_json()
        return Response(self._openapi, media_type="application/json")

    async def metrics(self, request: Request) -> Response:
        """The route exists only with metrics on (routes.py), so `state.metrics` is set."""
        metrics = self.state.metrics
        if metrics is None:
            raise APIError(404, "Not Found")
        return await metrics.endpoint(request)

    # ------------------------------------------------------------------ tokenizer

    async def tokenize(self, request: Request) -> Response:
        body = await read_body(request, SMALL_BODY_BYTES)
        keys = decode_json(body, dict[str, msgspec.Raw])
        tokenizer = self.llm.get_tokenizer()
        req: TokenizeChatRequest | TokenizeCompletionRequest
        if "messages" in keys:
            req = decode_request(body, TokenizeChatRequest)
            resolve_model(self.state, req.model)
            settings = self.state.settings  # the prompt exactly as the chat route renders it
            _, ids = await render_chat(
                tokenizer,
                req.messages,
                template=self.chat_template,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                template_kwargs={**(settings.default_chat_template_kwargs or {}), **(req.chat_template_kwargs or {})},
                add_special_tokens=req.add_special_tokens,
                content_format=settings.chat_template_content_format,
            )
        else:
            req = decode_request(body, TokenizeCompletionRequest)
            resolve_model(self.state, req.model)
            text, special = req.prompt, req.add_special_tokens
            ids = await maybe_in_thread(lambda: tokenizer.encode(text, special), len(text))
        strs = None
        if req.return_token_strs:
            token_ids = ids
            strs = await maybe_in_thread(
                lambda: tokenizer.convert_ids_to_tokens(token_ids), len(ids)
            )
        max_model_len = self._model_config().max_model_len
        return _json(TokenizeResponse(len(ids), max_model_len, ids, strs))

    async def detokenize(self, request: Request) -> Response:
        req = decode_request(await read_body(request, SMALL_BODY_BYTES), DetokenizeRequest)
        resolve_model(self.state, req.model)
        tokenizer = self.llm.get_tokenizer()
        vocab = self._model_config().vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens: token ids must be in [0, {vocab}), got {bad[:8]}", "tokens")
        ids = req.tokens
        text = await maybe_in_thread(
            lambda: tokenizer.decode(ids, skip_special_tokens=False), len(ids)
        )
        return _json(DetokenizeResponse(text))
