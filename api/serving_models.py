"""The models the server answers to: the base model's names and its LoRA adapters (vLLM's
`OpenAIServingModels`).

`--lora-modules name=path ...` (or the JSON form `{"name", "path", "base_model_name"}`) are
served from start-up, each with a stable `lora_int_id` (1, 2, ... in the order given), after
`check_lora_modules` refused what vLLM would refuse there, before the model loads: the flag
without `--enable-lora`, a name given twice or taken by the base model, an adapter whose config
does not pass (each error naming the flag and the module); once the engine is built,
`ServedModels.check_adapters` reads each one whole against the base model (a corrupt or
mis-shaped tensor stops the server, naming the flag, the module and the file). A request names
an adapter in `model` (completions, chat, the Responses API); `GET /v1/models` lists every
adapter with `root` its path and `parent` its base model's served name.

With `VLLM_ALLOW_RUNTIME_LORA_UPDATING` true (read once at start-up, `runtime_lora_updating`),
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` adds an adapter, checked first (LoRA
enabled, the adapter's config, every tensor readable and of the base model's shape: a 400
naming the field and the file otherwise, and nothing is loaded; a name already served is a
400, unless `load_inplace`), and `POST /v1/unload_lora_adapter {"lora_name"}` removes one (an
unknown name is a 404). Without it the routes do not exist (404), as in vLLM. The route reads
server paths a client names: a path that is not an adapter gets one answer, whether it is
missing, a file, unreadable or a directory without `adapter_config.json` (lora/peft.py
`not_an_adapter`), so it does not tell which paths exist beyond what vLLM tells.

A request's adapter is resolved once, when it arrives: one already admitted under an adapter that
is unloaded meanwhile finishes under it (its `LoRARequest` travels with it). Ids are never
reused, so an adapter loaded again under a name gets a new id (the engine keys its slots, caches
and prefix-cache blocks by id).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from triollm.api.log_bounds import shorten
from triollm.api.openai_errors import APIError, bad_request
from triollm.engine.log_safe import log_safe
from triollm.lora.peft import read_adapter_config
from triollm.lora.request import LoRARequest

if TYPE_CHECKING:
    from triollm.actors.async_llm import AsyncLLM
    from triollm.engine.config import EngineArgs

__all__ = [
    "RUNTIME_LORA_ENV",
    "LoRAModulePath",
    "LoadLoRAAdapterRequest",
    "ServedModels",
    "UnloadLoRAAdapterRequest",
    "check_lora_modules",
    "parse_lora_module",
    "runtime_lora_updating",
]

log = logging.getLogger("triollm")

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"  # vLLM's name
_LORA_MODULE_FORMS = (
    'name=path, or a JSON object such as \'{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}\''
)


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry (vLLM's `LoRAModulePath`)."""

    name: str
    path: str
    base_model_name: str | None = None  # listed as the adapter's parent when it is a served name


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # vLLM's: replace an adapter of this name (with a new id)


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str = ""
    lora_int_id: int | None = None


def parse_lora_module(text: str) -> LoRAModulePath:
    """A `--lora-modules` word: `name=path`, or the JSON object (ValueError naming the form)."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules: invalid JSON {text!r} ({exc}); expected {_LORA_MODULE_FORMS}") from None
        allowed = {"name", "path", "base_model_name"}
        if not isinstance(value, dict) or not {"name", "path"} <= value.keys() or value.keys() - allowed:
            raise ValueError(
                f"--lora-modules: {text!r} needs the keys name and path (and optionally base_model_name), no others"
            )
        if not all(isinstance(value[k], str) and value[k] for k in ("name", "path")):
            raise ValueError(f"--lora-modules: {text!r}: name and path must be non-empty strings")
        base = value.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError(f"--lora-modules: {text!r}: base_model_name must be a string")
        return LoRAModulePath(value["name"], value["path"], base)
    name, eq, path = text.partition("=")
    if not eq or not name or not path:
        raise ValueError(f"--lora-modules: {text!r} is not {_LORA_MODULE_FORMS}")
    return LoRAModulePath(name, path)


def check_lora_modules(modules: Sequence[LoRAModulePath], served_model_names: Sequence[str], args: EngineArgs) -> None:
    """vLLM's start-up refusals, before the model loads: ValueError naming the flag."""
    if not modules:
        return
    if not args.enable_lora:
        raise ValueError("--lora-modules: LoRA is not enabled; add --enable-lora to serve adapters")
    seen: set[str] = set()
    for m in modules:
        if m.name in served_model_names:
            raise ValueError(
                f"--lora-modules {m.name}: the name is the base model's (--served-model-name); give the adapter its own"
            )
        if m.name in seen:
            raise ValueError(f"--lora-modules {m.name}: the name is given twice")
        seen.add(m.name)
        read_adapter_config(m.path, max_lora_rank=args.max_lora_rank, field=f"--lora-modules {m.name}")


def runtime_lora_updating(environ: Mapping[str, str] = os.environ) -> bool:
    """vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`: "1" or "true" (any case) turns it on."""
    return environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


class ServedModels:
    """The base model's served names and the adapters, by name. Touched only on the event loop."""

    def __init__(self, served_model_names: Sequence[str], lora_modules: Sequence[LoRAModulePath] = ()) -> None:
        self.base_names = tuple(served_model_names)
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        for m in lora_modules:
            self._adapters[m.name] = self._request(m.name, m.path, m.base_model_name)

    def _request(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        base = base_model_name if base_model_name in self.base_names else None
        return LoRARequest(name, next(self._ids), path, base_model_name=base)

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter served as `model`, or None (a base model's name, or unknown)."""
        return None if model is None else self._adapters.get(model)

    def is_served(self, model: str) -> bool:
        return model in self.base_names or model in self._adapters

    def adapters(self) -> list[LoRARequest]:
        return list(self._adapters.values())

    def parent(self, lora: LoRARequest) -> str:
        """The base model's served name an adapter is listed under (vLLM's `parent`)."""
        return lora.base_model_name or self.base_names[0]

    async def check_adapters(self, llm: AsyncLLM) -> None:
        """The start-up adapters (`--lora-modules`) checked whole now that the base model is
        known (`AsyncLLM.add_lora`): `ValueError` naming the flag, the module and the file."""
        for name, lora in self._adapters.items():
            try:
                await llm.add_lora(lora)
            except ValueError as exc:
                raise ValueError(f"--lora-modules {name}: {exc}") from None

    async def load(self, llm: AsyncLLM, req: LoadLoRAAdapterRequest) -> LoRARequest:
        """Check and add an adapter (`APIError` 400 naming the field otherwise)."""
        name, path = req.lora_name, req.lora_path
        if not name or not path:
            field = "lora_name" if not name else "lora_path"
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", field)
        if name in self.base_names:
            raise bad_request(
                f"lora_name: {shorten(name, 100)!r} is a base model's name; give the adapter its own", "lora_name"
            )
        self._check_new(name, req.load_inplace)
        lora = self._request(name, path)
        await llm.add_lora(lora)  # ValueError naming the field (lora_path, lora_request) -> 400
        self._check_new(name, req.load_inplace)  # a load of the same name that finished meanwhile
        self._adapters[name] = lora
        shown = log_safe(name), log_safe(path), lora.lora_int_id
        log.info("Loaded new LoRA adapter: name %s, path %s (lora_int_id %d)", *shown)
        return lora

    def _check_new(self, name: str, inplace: bool) -> None:
        if name in self._adapters and not inplace:
            raise bad_request(f"The lora adapter '{shorten(name, 100)}' has already been loaded.", "lora_name")

    def unload(self, req: UnloadLoRAAdapterRequest) -> LoRARequest:
        """Remove an adapter by name (`APIError` 404 for an unknown one). Requests under it that
        were admitted already finish under it."""
        name = req.lora_name
        if not name:
            raise bad_request("lora_name: must be provided", "lora_name")
        lora = self._adapters.pop(name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter '{shorten(name, 100)}' cannot be found.", "lora_name")
        log.info("Removed LoRA adapter: name %s", log_safe(name))
        return lora
