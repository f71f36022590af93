"""Tool calling, the request side and the constrained outputs: which `tool_choice` a request
makes, the JSON schema that forces a call, and the calls read back from that output.

    tool_choice         output                                  read back as
    "none"              free text (the tools still reach the template)
    "auto"              free text; the server's --tool-call-parser finds the calls in it
    "required"          constrained: [{"name": ..., "parameters": {...}}, ...]   one call per item
    {"type": "function", "function": {"name": N}}
                        constrained: N's parameters object             one call to N

As in vLLM: with `tools` and no `tool_choice` the choice is "auto", and "auto" needs the server
started with `--enable-auto-tool-choice --tool-call-parser NAME`; a forced call (named or
"required") needs no parser: the grammar is built from the tools' schemas. The constrained
choices answer with `content` ""; calls found by the
parser under "auto", and the calls of "required", make the finish reason "tool_calls" (vLLM's
choices; a named call keeps the output's own, "stop" or "length"). `parallel_tool_calls:
false` allows one item under "required" and keeps the first call under "auto".

`ConstrainedCallStream` streams a forced call as it is generated: the call's id and name in its
first delta, then its arguments as they arrive (the raw text of the JSON value, so the pieces
concatenate to the arguments of the whole output).

A tool's `parameters` is checked for the shapes the code and the grammar converter rely on
(`properties`, `$defs` and `definitions` are objects of schemas, `anyOf` an array of them,
`required` an array of strings, ...): a 400 naming the keyword's place
(`tools[0].function.parameters.$defs: must be an object`). A forced call's output is read back
only when its arguments nest at most `MAX_JSON_DEPTH` levels (a recursive schema allows any
depth); deeper, or not JSON, it is text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from triollm.api.openai_errors import bad_request
from triollm.api.protocol import (
    MAX_JSON_DEPTH,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from triollm.api.tool_parsers._json_scan import dumps_args, loads
from triollm.api.tool_parsers.abstract import make_tool_call_id

__all__ = [
    "ConstrainedCallStream",
    "ToolChoice",
    "constrained_tool_calls",
    "make_tool_call_id",
    "resolve_tool_choice",
]

Mode = Literal["none", "auto", "required", "named"]
_CHOICES = ("none", "auto", "required")
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolChoice:
    """A request's resolved tool choice. `tools` are the request's (OpenAI chat shape)."""

    mode: Mode
    tools: tuple[Mapping[str, Any], ...] = ()
    name: str | None = None  # the named function
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """The output is constrained to a call (named or "required")."""
        return self.mode in ("named", "required")

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema of a forced call's output (None for "none" and "auto")."""
        if self.mode == "named":
            return dict(_parameters(_by_name(self.tools)[self.name or ""]))
        if self.mode != "required":
            return None
        defs: dict[str, Any] = {}
        items = []
        for tool in self.tools:
            fn = tool["function"]
            parameters = dict(_parameters(fn))
            defs.update(parameters.pop("$defs", None) or {})
            items.append(
                {
                    "type": "object",
                    "properties": {"name": {"type": "string", "enum": [fn["name"]]}, "parameters": parameters},
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not self.parallel:
            schema["maxItems"] = 1
        if defs:
            schema["$defs"] = defs
        return schema


def resolve_tool_choice(
    tools: Sequence[Any] | None,
    tool_choice: Any,
    *,
    parallel_tool_calls: bool | None = None,
    auto_enabled: bool = False,
) -> ToolChoice:
    """Check `tools` and `tool_choice` (a 400 naming the field when they are wrong) and resolve
    the choice. `auto_enabled`: the server has a tool-call parser (--enable-auto-tool-choice)."""
    if tools is not None:
        _check_tools(tools)
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolChoice("none", tuple(tools or ()), parallel=parallel)
    if not tools:
        raise bad_request("tool_choice: when using `tool_choice`, `tools` must be set", "tool_choice")
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise bad_request(
                f"tool_choice: must be one of {', '.join(map(repr, _CHOICES))} or a named function "
                f'{{"type": "function", "function": {{"name": ...}}}}; got {tool_choice!r:.80}',
                "tool_choice",
            )
        if tool_choice == "auto" and not auto_enabled:
            raise bad_request(
                'tool_choice: "auto" tool choice requires the server to be started with '
                "--enable-auto-tool-choice and --tool-call-parser",
                "tool_choice",
            )
        return ToolChoice(tool_choice, tuple(tools), parallel=parallel)  # type: ignore[arg-type]
    name = _named_function(tool_choice)
    known = _by_name(tools)
    if name not in known:
        listed = ", ".join(repr(n) for n in list(known)[:16])
        raise bad_request(f"tool_choice: function {name!r:.80} is not in tools (tools: {listed})", "tool_choice")
    return ToolChoice("named", tuple(tools), name=name, parallel=parallel)


def constrained_tool_calls(choice: ToolChoice, text: str) -> list[ToolCall] | None:
    """The calls in a forced call's whole output. A named call is the call whatever its text,
    complete or cut short (max_tokens, a stop string): its arguments are the text as generated,
    as vLLM returns them, so the client sees what was attempted. Under "required", None when the
    text is not the complete JSON the grammar allows, or its arguments nest deeper than
    `MAX_JSON_DEPTH` levels."""
    if choice.mode == "named":
        return [ToolCall(id=make_tool_call_id(), function=FunctionCall(choice.name or "", text))]
    items = loads(text, MAX_JSON_DEPTH + 2)  # [{"name": ..., "parameters": {...}}]: two levels more
    if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i for i in items):
        return None
    calls = []
    for item in items:
        arguments = dumps_args(item.get("parameters", {}))
        if arguments is None:
            return None
        calls.append(ToolCall(id=make_tool_call_id(), function=FunctionCall(str(item["name"]), arguments)))
    return calls


class ConstrainedCallStream:
    """A forced call's output as `DeltaToolCall`s, delta by delta (see the module doc)."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self._named_started = False
        self._scan = _CallArrayScanner() if choice.mode == "required" else None

    def feed(self, delta: str) -> list[DeltaToolCall]:
        if self._scan is not None:
            return self._scan.feed(delta)
        if not delta:
            return []
        if self._named_started:
            return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))]
        self._named_started = True
        return [
            DeltaToolCall(
                index=0, id=make_tool_call_id(), type="function",
                function=DeltaFunctionCall(name=self.choice.name, arguments=delta),
            )
        ]  # fmt: skip


class _CallArrayScanner:
    """Reads `[{"name": "f", "parameters": {...}}, ...]` one character at a time (the grammar
    guarantees its shape; the name comes first, as the schema lists it): announces each call
    when its name is complete and passes its parameters' text on as it arrives."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.string = ""  # a string at the item's level (a key or the name), being read
        self.key: str | None = None
        self.after_colon = False
        self.index = -1  # the item being read
        self.announced = -1  # the last item whose name was sent
        self.name: str | None = None
        self.in_parameters = False
        self.pending = ""  # parameters text not sent yet

    def feed(self, delta: str) -> list[DeltaToolCall]:
        out: list[DeltaToolCall] = []
        for c in delta:
            self._char(c, out)
        self._flush(out)
        return out

    def _char(self, c: str, out: list[DeltaToolCall]) -> None:
        if self.in_parameters:
            self.pending += c
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_string = False
                if self.depth == 2 and not self.in_parameters:
                    value = loads(self.string + '"')
                    self._string_done(value if isinstance(value, str) else self.string[1:], out)
                return
            if self.depth == 2 and not self.in_parameters:
                self.string += c
            return
        if c == '"':
            self.in_string = True
            if self.depth == 2 and not self.in_parameters:
                self.string = '"'
        elif c in "{[":
            self.depth += 1
            if self.depth == 2:  # a new item
                self.index += 1
                self.key, self.after_colon, self.name = None, False, None
            elif self.depth == 3 and self.key == "parameters" and not self.in_parameters:
                self.in_parameters = True
                self.pending += c
        elif c in "}]":
            self.depth -= 1
            if self.in_parameters and self.depth == 2:
                self.in_parameters = False
                self._flush(out)
        elif self.depth == 2 and not self.in_parameters:
            if c == ":":
                self.after_colon = True
            elif c == ",":
                self.key, self.after_colon = None, False

    def _string_done(self, value: str, out: list[DeltaToolCall]) -> None:
        if not self.after_colon:
            self.key = value
        elif self.key == "name" and self.announced < self.index:
            self.name = value
            self.announced = self.index
            out.append(
                DeltaToolCall(
                    index=self.index, id=make_tool_call_id(), type="function",
                    function=DeltaFunctionCall(name=value, arguments=""),
                )
            )  # fmt: skip

    def _flush(self, out: list[DeltaToolCall]) -> None:
        if self.pending and self.announced == self.index:
            out.append(DeltaToolCall(index=self.index, function=DeltaFunctionCall(arguments=self.pending)))
            self.pending = ""


# ------------------------------------------------------------------------------ checks


def _check_tools(tools: Sequence[Any]) -> None:
    if not tools:
        raise bad_request("tools: must not be an empty array; give at least one tool or omit the field", "tools")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request(f"{where}.type: must be 'function'", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function: must be an object with a name", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise bad_request(f"{where}.function.name: must be a non-empty string of at most 256 characters", "tools")
        parameters = fn.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise bad_request(f"{where}.function.parameters: must be a JSON schema object", "tools")
        if parameters is not None:
            _check_schema(parameters, f"{where}.function.parameters")


# Where a JSON schema holds schemas: an object of them, one (an object or a boolean), an array.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = (
    "additionalProperties", "additionalItems", "unevaluatedProperties", "unevaluatedItems", "items", "contains",
    "propertyNames", "not", "if", "then", "else",
)  # fmt: skip
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_PLAIN_KEY = re.compile(r"[\w$@-]{1,64}")


def _check_schema(schema: dict[str, Any], where: str) -> None:
    """The shapes of a tool's `parameters` schema and the schemas it holds (see the module
    docstring), walked without recursion to `MAX_JSON_DEPTH` levels; a 400 naming the place."""
    stack: list[tuple[Any, str, int]] = [(schema, where, 1)]
    while stack:
        node, at, depth = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise bad_request(f"{at}: must be a schema (an object or a boolean)", "tools")
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"{at}: nested deeper than {MAX_JSON_DEPTH} levels", "tools")
        below: list[tuple[Any, str]] = []
        for key in _SCHEMA_MAPS:
            if key in node:
                value = node[key]
                if not isinstance(value, dict):
                    raise bad_request(f"{at}.{key}: must be an object", "tools")
                below += [(child, f"{at}.{key}{_key_step(name)}") for name, child in value.items()]
        for key in _SCHEMA_ONE:
            if key in node:
                value = node[key]
                if key == "items" and isinstance(value, list):  # the tuple form of older drafts
                    below += [(child, f"{at}.items[{i}]") for i, child in enumerate(value)]
                else:
                    below.append((value, f"{at}.{key}"))
        for key in _SCHEMA_LISTS:
            if key in node:
                value = node[key]
                if not isinstance(value, list):
                    raise bad_request(f"{at}.{key}: must be an array of schemas", "tools")
                below += [(child, f"{at}.{key}[{i}]") for i, child in enumerate(value)]
        _check_keywords(node, at)
        stack.extend((child, path, depth + 1) for child, path in reversed(below))


def _check_keywords(node: dict[str, Any], at: str) -> None:
    required = node.get("required", [])
    if not (isinstance(required, list) and all(isinstance(name, str) for name in required)):
        raise bad_request(f"{at}.required: must be an array of strings", "tools")
    kind = node.get("type", "object")
    kinds = kind if isinstance(kind, list) else [kind]
    if not all(isinstance(k, str) for k in kinds):
        raise bad_request(f"{at}.type: must be a string or an array of strings", "tools")
    if not isinstance(node.get("enum", []), list):
        raise bad_request(f"{at}.enum: must be an array", "tools")
    if not isinstance(node.get("$ref", ""), str):
        raise bad_request(f"{at}.$ref: must be a string", "tools")


def _key_step(name: str) -> str:
    return f".{name}" if _PLAIN_KEY.fullmatch(name) else f"[{name!r:.40}]"


def _named_function(tool_choice: Any) -> str:
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if (
        not isinstance(tool_choice, dict)
        or tool_choice.get("type", "function") != "function"
        or not isinstance(name, str)
    ):
        raise bad_request(
            'tool_choice: a named function is {"type": "function", "function": {"name": "NAME"}}', "tool_choice"
        )
    return name


def _by_name(tools: Sequence[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    return {tool["function"]["name"]: tool["function"] for tool in tools}


def _parameters(fn: Mapping[str, Any]) -> Mapping[str, Any]:
    return fn.get("parameters") or _EMPTY_PARAMETERS
