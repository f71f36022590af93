"""A chat request's `image_url` parts: decoded in a worker thread (Pillow work stays off the event
loop), each replaced in the messages by the model's image placeholder text
(engine/processing/chat_images.py). Any refusal is a 400 naming the part or the limit."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec

from triollm.api.openai_errors import bad_request
from triollm.api.protocol import ChatCompletionRequest, ChatMessage
from triollm.api.state import ServerState
from triollm.engine.processing.chat_images import IMAGE_PART_TYPES, chat_images
from triollm.engine.processing.tokenizer import Tokenizer

__all__ = ["take_chat_images"]


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
        rendered, images = await anyio.to_thread.run_sync(chat_images, messages, config.model, tokenizer, config.limits)
    except ValueError as e:
        message = str(e)
        raise bad_request(message, message.split(":", 1)[0]) from None  # e.g. messages[0].content[1].image_url
    return msgspec.structs.replace(req, messages=msgspec.convert(rendered, list[ChatMessage])), images
