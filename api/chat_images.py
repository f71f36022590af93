"""A chat request's `image_url` parts: http(s) URLs fetched, then decoded in a worker thread
(Pillow work stays off the event loop), each replaced in the messages by the model's image
placeholder text (engine/processing/chat_images.py). Any refusal is a 400 naming the part or
the limit.

An http(s) URL is fetched here, asynchronously (httpx on the request's own event loop), one URL
after another, each within `VLLM_IMAGE_FETCH_TIMEOUT` seconds from connection to last byte
(vLLM's variable, default 5: a server that stalls costs the request that much, never the event
loop) and `MAX_FETCH_BYTES` (a `Content-Length` above it is refused before the body, a body
that runs past it is cut off there). The bytes then travel as a data URL, decoded like any
other. Nothing is fetched for a request over the image limit: the parts are counted first.
Rejected: fetching in the worker thread with a blocking client (a stalled server would hold a
thread for the whole timeout, and the thread pool is shared).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing
from typing import Any, cast

import anyio
import httpx
import msgspec

from triollm.api.openai_errors import bad_request
from triollm.api.protocol import ChatCompletionRequest, ChatMessage
from triollm.api.state import ServerState
from triollm.engine import envs
from triollm.engine.processing.chat_images import IMAGE_PART_TYPES, chat_images
from triollm.engine.processing.images import MAX_FETCH_BYTES  # a file:// image's limit too
from triollm.engine.processing.tokenizer import Tokenizer

__all__ = ["MAX_FETCH_BYTES", "fetch_image", "take_chat_images"]



async def take_chat_images(
    state: ServerState, req: ChatCompletionRequest, tokenizer: Tokenizer
) -> tuple[ChatCompletionRequest, list[Any]]:
    """(the request with its image parts as placeholder text, the images); unchanged and [] for
    a text-only chat."""
    if not any(
        isinstance(m.content, list) and any(p.type in IMAGE_PART_TYPES for p in m.content) for m in req.messages
    ):
        return req, []
    config = state.llm.config
    messages = [m.to_dict() for m in req.messages]
    try:
        limit = None if config.limits is None else config.limits.max_images_per_prompt
        await _fetch_remote(messages, limit)
        rendered, images = await anyio.to_thread.run_sync(chat_images, messages, config.model, tokenizer, config.limits)
    except ValueError as e:
        message = str(e)
        raise bad_request(message, message.split(":", 1)[0]) from None  # e.g. messages[0].content[1].image_url
    return msgspec.structs.replace(req, messages=msgspec.convert(rendered, list[ChatMessage])), images


async def _fetch_remote(messages: list[dict[str, Any]], limit: int | None) -> None:
    """Replace, in place, each http(s) `image_url` of `messages` by a data URL of its bytes."""
    remote: list[tuple[str, dict[str, Any], str]] = []
    count = 0
    for i, m in enumerate(messages):
        content = m.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            if not isinstance(part, dict) or part.get("type") not in IMAGE_PART_TYPES:
                continue
            count += 1
            ref = part.get("image_url")
            url = ref.get("url") if isinstance(ref, Mapping) else ref
            if isinstance(url, str) and url.split(":", 1)[0].lower() in ("http", "https"):
                remote.append((f"messages[{i}].content[{j}].image_url", part, url))
    if not remote or (limit is not None and count > limit):
        return  # nothing to fetch, or refused for the count before anything is fetched
    timeout = envs.image_fetch_timeout()
    async with httpx.AsyncClient(follow_redirects=True, max_redirects=3) as client:
        for where, part, url in remote:
            try:
                with anyio.fail_after(timeout):
                    data = await fetch_image(client, url, where, MAX_FETCH_BYTES)
            except TimeoutError:
                raise ValueError(
                    f"{where}: fetching {_short(url)} took longer than {timeout:g} s ({envs.IMAGE_FETCH_TIMEOUT_ENV})"
                ) from None
            part["image_url"] = {"url": "data:image;base64," + base64.b64encode(data).decode()}


async def fetch_image(client: httpx.AsyncClient, url: str, where: str, max_bytes: int) -> bytes:
    """The body of GET `url`; a ValueError starting with `where` on a failed connection, a status
    other than 200, or more than `max_bytes` (the caller bounds the time)."""
    short = _short(url)
    try:
        async with client.stream("GET", url) as response:
            if response.status_code != 200:
                raise ValueError(f"{where}: fetching {short} gave HTTP {response.status_code}")
            length = response.headers.get("content-length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise ValueError(f"{where}: {short} is {length} bytes, over the limit of {max_bytes}")
            body = bytearray()
            # aiter_bytes is an async generator (typed as an iterator): closed here, not by the GC.
            async with aclosing(cast("AsyncGenerator[bytes, None]", response.aiter_bytes())) as chunks:
                async for chunk in chunks:
                    body += chunk
                    if len(body) > max_bytes:
                        raise ValueError(f"{where}: {short} sent more than the limit of {max_bytes} bytes")
            return bytes(body)
    except httpx.HTTPError as e:
        raise ValueError(f"{where}: could not fetch {short} ({type(e).__name__}: {e})") from None


def _short(url: str) -> str:
    return url if len(url) <= 100 else url[:97] + "..."
