"""What constrains and reads a generation request's output: its structured-outputs grammar
(`structured_outputs_params`, from whichever request field set it), a forced tool call's
grammar (`forced_call_params`), and for chat and Responses the three together with the output
parsers (`plan_tool_output`). Every grammar is compiled here, in a worker thread, so an
invalid one is a 400 naming its field before the request reaches the engine."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec

from triollm.api.openai_errors import bad_request
from triollm.api.output_parsing import OutputParsing, make_output_parsing
from triollm.api.protocol import SamplingFields
from triollm.api.state import ServerState
from triollm.api.tool_calls import ToolChoice, resolve_tool_choice
from triollm.engine import structured_outputs
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.sampling_params import StructuredOutputsParams

__all__ = ["ToolOutput", "forced_call_params", "plan_tool_output", "structured_outputs_params"]

# vLLM's older request fields, each one kind of constraint.
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")


async def structured_outputs_params(req: SamplingFields) -> StructuredOutputsParams | None:
    """The request's grammar constraint, from whichever field set it (`response_format`,
    `structured_outputs` or a `guided_*` field; more than one is a 400), checked by compiling
    it in a worker thread: an invalid schema, regex or grammar is a 400 naming the field."""
    found: list[tuple[str, dict[str, Any]]] = []
    if req.response_format is not None:
        spec = _response_format(req.response_format)
        if spec is not None:
            found.append(("response_format", spec))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", dict(req.structured_outputs)))
    for name, kind in _GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, {kind: value}))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        second = found[1][0]
        raise bad_request(
            f"{second}: only one kind of structured outputs constraint may be set; got {names}",
            second,
        )
    field, spec = found[0]
    if req.guided_whitespace_pattern is not None and field != "structured_outputs":
        spec["whitespace_pattern"] = req.guided_whitespace_pattern
    try:
        params = msgspec.convert(spec, StructuredOutputsParams)
    except (ValueError, TypeError, msgspec.ValidationError) as exc:
        message = str(exc)
        if field != "structured_outputs":
            message = message.replace("structured_outputs", field)
        if not message.startswith(field):
            message = f"{field}: {message}"
        raise bad_request(message, field) from None
    own = f"structured_outputs.{params.kind}"
    name = own if field == "structured_outputs" else field
    try:
        await anyio.to_thread.run_sync(structured_outputs.check, params, name)
    except ValueError as exc:  # the converter's errors name the params' field: say the request's
        message = str(exc)
        raise bad_request(name + message[len(own) :] if message.startswith(own) else message, name) from None
    return params


async def forced_call_params(choice: ToolChoice) -> StructuredOutputsParams:
    """The grammar of a forced tool call (a named function or "required"), built from the
    tools' schemas and compiled in a worker thread: a schema llguidance rejects is a 400
    naming `tools`. Compact JSON: whitespace between tokens is never worth generating in a
    call's arguments (and a weak model left free to emit it may emit little else)."""
    params = StructuredOutputsParams(json=choice.schema(), disable_any_whitespace=True)
    try:
        await anyio.to_thread.run_sync(structured_outputs.check, params, "tools")
    except ValueError as exc:
        message = str(exc)
        if not message.startswith("tools"):
            message = f"tools: {message}"
        raise bad_request(message, "tools") from None
    return params


@dataclass(frozen=True)
class ToolOutput:
    """How a chat-like request's output is constrained and read."""

    tokenizer: Tokenizer
    parsing: OutputParsing  # its tool-call and reasoning parsers
    structured: StructuredOutputsParams | None  # its grammar, started after any reasoning


async def plan_tool_output(
    state: ServerState,
    tools: Sequence[Any] | None,
    tool_choice: Any,
    *,
    parallel_tool_calls: bool | None,
    constraint: Callable[[], Awaitable[StructuredOutputsParams | None]],
    constraint_name: str,
    include_reasoning: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> ToolOutput:
    """The tool choice, the output parsers and the grammar of a chat or Responses request, in
    this order (each a 400 naming its field): the tools and the choice (`resolve_tool_choice`;
    "auto" needs the server's tool-call parser), the request's own constraint (`constraint()`,
    which `constraint_name` names), then a forced call's grammar, which cannot be combined
    with that constraint."""
    settings = state.settings
    choice = resolve_tool_choice(
        tools,
        tool_choice,
        parallel_tool_calls=parallel_tool_calls,
        auto_enabled=settings.enable_auto_tool_choice and settings.tool_call_parser is not None,
    )
    tokenizer = state.llm.get_tokenizer()
    parsing = make_output_parsing(
        choice,
        tokenizer=tokenizer,
        tool_call_parser=settings.tool_call_parser,
        reasoning_parser=settings.reasoning_parser,
        include_reasoning=include_reasoning,
        chat_template_kwargs=chat_template_kwargs,
    )
    structured = await constraint()
    if choice.forced:
        if structured is not None:
            raise bad_request(
                'tool_choice: a forced tool call (a named function or "required") cannot be '
                f"combined with {constraint_name}",
                "tool_choice",
            )
        structured = await forced_call_params(choice)
    return ToolOutput(tokenizer, parsing, parsing.gate(structured))


def _response_format(value: dict[str, Any]) -> dict[str, Any] | None:
    """OpenAI's `response_format` as StructuredOutputsParams fields (None for "text")."""
    kind = value.get("type", "text")
    if kind not in _RESPONSE_FORMATS:
        raise bad_request(
            f"response_format: type must be one of {', '.join(_RESPONSE_FORMATS)}; "
            f"got {kind!r:.80}",
            "response_format",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    spec = value.get("json_schema")
    schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise bad_request(
            "response_format: type 'json_schema' needs json_schema.schema, a JSON schema object",
            "response_format",
        )
    return {"json": schema}
