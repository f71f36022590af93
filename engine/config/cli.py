"""The CLI side of `EngineArgs`: a field declared with `arg()` carries its help and choices, and
`add_flags` turns each field into a flag (`--max-model-len` for `max_model_len`), so the CLI and
the Python keywords share one schema."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["HUMAN_INT_FIELDS", "add_flags", "arg", "human_readable_int"]

# Token and byte counts whose flags take vLLM's human-readable sizes (`human_readable_int`): vLLM
# applies it to these three; the last two are triollm's own token counts.
HUMAN_INT_FIELDS = (
    "max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes",
    "max_num_queued_tokens", "max_request_tokens",
)  # fmt: skip
SHORT_FLAGS = {  # vLLM's
    "tensor_parallel_size": "-tp",
    "data_parallel_size": "-dp",
    "data_parallel_rank": "-dpn",
    "data_parallel_backend": "-dpb",
    "data_parallel_address": "-dpa",
    "data_parallel_rpc_port": "-dpp",
    "pipeline_parallel_size": "-pp",
    "compilation_config": "-O",  # -O3 is --compilation-config 3
}
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def arg(
    default: Any, help: str, *, choices: Sequence[Any] | None = None, nargs: str | None = None
) -> Any:
    """A field with its CLI help (and choices): `add_flags` turns each field into a flag."""
    return dataclasses.field(
        default=default, metadata={"help": help, "choices": choices, "nargs": nargs}
    )


def add_flags(
    fields: Sequence[dataclasses.Field[Any]],
    group: argparse.ArgumentParser | argparse._ArgumentGroup,
    skip: Sequence[str] = (),
) -> None:
    """One flag per field, typed from its annotation (a bool is `--x/--no-x`; a dict, or an
    int-or-dict field, takes JSON)."""
    for f in fields:
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        meta = f.metadata
        help = f"{meta.get('help', '')} (default: %(default)s)".lstrip()
        type_name = str(f.type).split("|")[0].strip()
        if type_name == "bool":
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help
            )
            continue
        kind: Any = _CLI_TYPES.get(type_name, _json_value)
        if f.name in HUMAN_INT_FIELDS:
            kind = human_readable_int
        if f.name == "max_model_len":
            kind = _human_int_or_auto
        options: dict[str, Any] = {"type": kind, "default": f.default, "help": help}
        if meta.get("choices") is not None:
            options["choices"] = meta["choices"]
        if meta.get("nargs") is not None:
            options["nargs"] = meta["nargs"]
        short = SHORT_FLAGS.get(f.name)
        group.add_argument(flag, *([short] if short else []), **options)


def human_readable_int(text: str) -> int:
    """vLLM's sizes: `4096`, `4k` (4000), `4K` (4096), `1.5k` (1500), `1M` (1048576); lowercase
    suffixes k/m/g/t are decimal and may carry a fraction, uppercase K/M/G/T are binary (whole
    numbers only)."""
    value = text.strip()
    match = _HUMAN_INT.fullmatch(value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an integer or a size such as 4096, 4k (4000), 1.5k or 4K (4096)"
            ) from None
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: decimals are not allowed with the binary suffix {suffix} "
            f"(did you mean {number}{suffix.lower()}?)"
        )
    return int(number) * _BINARY_SUFFIXES[suffix]


def _human_int_or_auto(text: str) -> int:
    """`--max-model-len`: a size, or -1 / auto (the model's own length), as vLLM."""
    return -1 if text.strip().lower() in ("auto", "-1") else human_readable_int(text)


def _json_value(text: str) -> object:
    """A flag holding a structured value: an int, or a JSON object (e.g. compilation config)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"expected an int or a JSON object, got {text!r}"
        ) from exc


_CLI_TYPES: dict[str, Any] = {"int": int, "float": float, "str": str}
