"""`POST /invocations`, the SageMaker / Vertex container contract vLLM serves: one route that
takes any of the API's request bodies and answers as the route that body belongs to would.

vLLM tries its request types in order and takes the first that validates; the same order here
reads the body's top-level keys (a body is never parsed twice into a full request):

    messages                     -> /v1/chat/completions
    prompt                       -> /v1/completions
    query and documents          -> /rerank
    text_1 / data_1 / queries    -> /score
    input                        -> /v1/embeddings on an embedding model, /classify on a
                                    classifier, /pooling otherwise

Anything else is a 400 naming `body` and the shapes it may take. The chosen handler reads the
body again from a replay of it (then the connection's own messages, so a stream still sees the
client leave) and applies all of its own checks.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from triollm.api.openai_errors import bad_request
from triollm.api.serving_common import read_body

__all__ = ["INVOCATION_SHAPES", "invocation_route", "invoke"]

Handler = Callable[[Request], Awaitable[Response]]

INVOCATION_SHAPES = (
    "a chat (messages), a completion (prompt), a rerank (query, documents), a score (text_1, text_2) "
    "or an embedding / classification / pooling request (input)"
)


def invocation_route(body: bytes, pooling_tasks: tuple[str, ...]) -> str:
    """The route whose request `body` is (see the module docstring); a 400 naming `body`
    otherwise. `pooling_tasks`: the served model's pooling tasks (empty for a generative one)."""
    try:
        keys = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        raise bad_request("body: /invocations takes a JSON object", "body") from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"body: not valid JSON ({exc})", "body") from None
    if "messages" in keys:
        return "/v1/chat/completions"
    if "prompt" in keys:
        return "/v1/completions"
    if "query" in keys and "documents" in keys:
        return "/rerank"
    if any(k in keys for k in ("text_1", "data_1", "queries")):
        return "/score"
    if "input" in keys:
        if "embed" in pooling_tasks:
            return "/v1/embeddings"
        if "classify" in pooling_tasks:
            return "/classify"
        return "/pooling"
    raise bad_request(f"body: /invocations takes {INVOCATION_SHAPES}; none was recognised", "body")


async def invoke(request: Request, pooling_tasks: tuple[str, ...], handlers: Mapping[str, Handler]) -> Response:
    """Read the body, pick its route (`invocation_route`), and run that route's handler on a
    request that reads the same body."""
    body = await read_body(request)
    route = invocation_route(body, pooling_tasks)
    replayed = False
    receive = request.receive

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return await handlers[route](Request(request.scope, replay))
