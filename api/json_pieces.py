"""Decoding a large JSON request body in short pieces, so the event loop keeps running.

msgspec decodes without releasing the GIL, so a worker thread alone does not free the loop: a
20 MB chat of thousands of small messages, or a Responses `input` list, is one call that holds
the GIL for a second or more (most of it the garbage collector, which runs inside the decode),
and the loop's thread cannot run a line of Python meanwhile (/health stalled 1.1-3.4 s on two
60 MB bodies). `decode_in_pieces`, run in a worker thread, cuts that call into many short ones;
between two calls the interpreter hands the GIL to the loop's thread (after at most
`sys.getswitchinterval()`):

1. the body as an object of raw fields (`dict[str, msgspec.Raw]`): one scan that checks the
   JSON and builds nothing for the values (~2 ms a MB);
2. each field decoded alone into its own type, and a field that is a list of objects (chat
   `messages`, Responses `input`, `tools`) larger than `PIECE_BYTES`, element by element
   (`list[msgspec.Raw]`, then each element into the element type; its `max_length` is checked
   before any element is decoded);
3. the struct built from the decoded fields by `msgspec.convert`, which checks every field's
   constraints again but takes a decoded struct, or an `Any` value, as it is (one step per
   element), and runs `__post_init__`.

Errors read as a whole-body decode's do: a field's path is `$.name`, an element's
`$.name[i]`. Unknown top-level fields are ignored and logged once, as `decode_request` does.

Rejected: a process pool (the decoded objects would be rebuilt in this process, at the same
cost); a streaming JSON parser (msgspec has none, and a pure-Python one is far slower);
disabling the garbage collector around the decode (the largest part of the cost, but a
process-wide switch is not a body decoder's to flip, and the rest still holds the GIL).

Left: one element is one call (a single message with a 20 MB tool call of small objects holds
the GIL for its whole decode), and a list field is split with one `Raw` per element before its
length is checked: 60 MB of `[{}, {}, ...]` costs 1.6 s and 1.7 GB in that one call. Decoded
whole, a list of dicts cost as much; a list of structs stopped at its first bad element."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from types import UnionType
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin

import msgspec

from triollm.api.protocol import decode_json, decode_request

__all__ = ["PIECE_BYTES", "decode_elements", "decode_in_pieces"]

log = logging.getLogger("triollm.api")

T = TypeVar("T")
# A list field larger than this is decoded element by element.
PIECE_BYTES = 64 * 1024


def decode_in_pieces(body: bytes, type_: type[T]) -> T:
    """`decode_request(body, type_)` for a struct type, as a series of short msgspec calls
    (the module's header): the same result, the same errors."""
    if not (isinstance(type_, type) and issubclass(type_, msgspec.Struct)):
        return decode_request(body, type_)
    raw_fields = decode_json(body, dict[str, msgspec.Raw])
    fields = {f.encode_name: f for f in msgspec.structs.fields(type_)}
    unknown = sorted(k for k in raw_fields if k not in fields)
    if unknown:  # client-chosen names: bounded, so a request cannot flood the log
        more = f" (and {len(unknown) - 16} more)" if len(unknown) > 16 else ""
        log.warning(
            "The following fields were present in the request but ignored: %s%s",
            [name[:64] for name in unknown[:16]],
            more,
        )
    values: dict[str, Any] = {}
    for name, raw in raw_fields.items():
        field = fields.get(name)
        if field is not None:
            values[name] = _decode_field(raw, field.type, f"$.{name}")
    return msgspec.convert(values, type_)


def decode_elements(raw: bytes | msgspec.Raw, element_type: Any, path: str = "$") -> list[Any]:
    """A JSON array decoded element by element into `element_type` (each element one msgspec
    call); errors name `path[i]`."""
    items = decode_json(raw, list[msgspec.Raw])
    return [_decode(item, element_type, f"{path}[{i}]") for i, item in enumerate(items)]


def _decode_field(raw: msgspec.Raw, annotation: Any, path: str) -> Any:
    if len(raw) > PIECE_BYTES and bytes(memoryview(raw)[:1]) == b"[":
        shape = _object_list(annotation)
        if shape is not None:
            element_type, max_length = shape
            items = decode_json(raw, list[msgspec.Raw])
            if max_length is not None and len(items) > max_length:
                raise msgspec.ValidationError(f"Expected `array` of length <= {max_length} - at `{path}`")
            return [_decode(item, element_type, f"{path}[{i}]") for i, item in enumerate(items)]
    return _decode(raw, annotation, path)


def _decode(raw: msgspec.Raw | bytes, type_: Any, path: str) -> Any:
    try:
        return decode_json(raw, type_)
    except msgspec.ValidationError as exc:
        message = str(exc)
        if " - at `$" in message:
            message = message.replace(" - at `$", f" - at `{path}", 1)
        else:
            message += f" - at `{path}`"
        raise msgspec.ValidationError(message) from None


def _object_list(annotation: Any) -> tuple[Any, int | None] | None:
    """(element type, max_length) when the field's only list type is a list of objects (structs
    or dicts), else None."""
    lists = [member for member in _members(annotation) if get_origin(_bare(member)) is list]
    if len(lists) != 1:
        return None
    [member] = lists
    [element] = get_args(_bare(member))
    element_origin = get_origin(_bare(element)) or _bare(element)
    if not (element_origin is dict or isinstance(element_origin, type) and issubclass(element_origin, msgspec.Struct)):
        return None
    metas = get_args(member)[1:] if get_origin(member) is Annotated else ()
    limits = [m.max_length for m in metas if isinstance(m, msgspec.Meta) and m.max_length is not None]
    return element, min(limits, default=None)


def _members(annotation: Any) -> Iterator[Any]:
    if get_origin(annotation) in (Union, UnionType):
        yield from get_args(annotation)
    else:
        yield annotation


def _bare(annotation: Any) -> Any:
    return get_args(annotation)[0] if get_origin(annotation) is Annotated else annotation
