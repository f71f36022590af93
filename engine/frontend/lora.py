"""`LoRAChecker`: a request's adapter checked before anything reaches the engine core.

Every request's `lora_request` passes here in the shell that adds it (`AsyncLLM`, `SyncEngine`),
and so does every adapter the server loads (`AsyncLLM.add_lora`: `--lora-modules` at start-up,
`/v1/load_lora_adapter`): LoRA must be on (`enable_lora`), the adapter's `adapter_config.json`
must pass `read_adapter_config` (the PEFT fields honoured, `r <= max_lora_rank`), and, given the
base model (`model`), every tensor of `adapter_model.safetensors` must be readable and fit it
(lora/shapes.py: the same check the engine core makes when it fills a slot). Each failure is a
`ValueError` naming the field and the adapter's file, so a corrupt or mis-shaped adapter is a
400 when it is loaded or first used, not a request that ends empty later. A checked adapter is
remembered by `(lora_int_id, lora_path)`, so a request under an adapter seen before costs a dict
lookup; `needs_io` tells the shell when a check would read files (or look a Hub id up in the
cache), so that one check runs in a worker thread, off the event loop.

An id names one adapter: the engine core keys its adapter slots, its CPU cache and its
prefix-cache blocks by `lora_int_id`, so a second path under an id already checked is refused
(vLLM would serve the first adapter's weights under the second's name, without a word).

The table is an LRU of `max_checked` ids (at least `MIN_CHECKED`, and at least `max_cpu_loras`,
the adapters the core keeps read): a server that loads and unloads adapters for weeks gives each
load a new id, and the table must not grow with them. An id pushed out is checked again when it
comes back, and the rule above holds for the ids in the table; the server never reuses an id, so
it loses nothing, and an `LLM` script that reuses ids after thousands of others is no worse off
than under vLLM. Checks may run in worker threads while the event loop checks others: the table
is behind a lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from triollm.lora.peft import AdapterConfig, read_adapter_config
from triollm.lora.request import LoRARequest
from triollm.lora.shapes import BaseModelConfig, ModelShapes

if TYPE_CHECKING:
    from triollm.engine.config import LoRAConfig

__all__ = ["LORA_NOT_ENABLED", "MIN_CHECKED", "LoRAChecker"]

LORA_NOT_ENABLED = (
    "lora_request: LoRA adapters are not enabled on this engine; start it with enable_lora=True "
    "(the server: --enable-lora)"
)
MIN_CHECKED = 1024  # ids the table keeps at least (a few hundred bytes each)


class LoRAChecker:
    def __init__(self, config: LoRAConfig | None, model: BaseModelConfig | None = None) -> None:
        """`config`: the engine's LoRA settings (None: LoRA off, every adapter is refused).
        `model`: the base model's config, whose shapes every adapter's tensors are checked
        against (None: the adapter's config alone is checked; the engine core still checks the
        tensors when it reads them)."""
        self.config = config
        self.shapes = ModelShapes.of(model) if model is not None and config is not None else None
        self.max_checked = max(MIN_CHECKED, config.max_cpu_loras) if config is not None else 0
        self._lock = threading.Lock()
        # lora_int_id -> (path, config), least recently used first
        self._checked: OrderedDict[int, tuple[str, AdapterConfig]] = OrderedDict()
        self._pinned: set[int] = set()  # never forgotten by the LRU (`pin`)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def __len__(self) -> int:
        """The ids remembered now (at most `max_checked`)."""
        return len(self._checked)

    def ids(self) -> set[int]:
        """The adapter ids checked and remembered (vLLM's `list_loras`)."""
        with self._lock:
            return set(self._checked)

    def forget(self, lora_id: int) -> bool:
        """Forget `lora_id` and its pin (vLLM's `remove_lora`); False if it was not known."""
        with self._lock:
            self._pinned.discard(lora_id)
            return self._checked.pop(lora_id, None) is not None

    def pin(self, lora_id: int) -> None:
        """Keep `lora_id` known whatever the LRU does; a ValueError naming it if it is unknown."""
        with self._lock:
            if lora_id not in self._checked:
                raise ValueError(f"lora_id: {lora_id} is not a known adapter; add it first (add_lora)")
            self._pinned.add(lora_id)

    def needs_io(self, request: object) -> bool:
        """Whether `check(request)` would read the adapter's files (not checked before)."""
        if not isinstance(request, LoRARequest) or self.config is None:
            return False
        with self._lock:
            seen = self._checked.get(request.lora_int_id)
        return seen is None or seen[0] != request.lora_path

    def check(self, request: object) -> LoRARequest | None:
        """`request` itself once checked (None: the base model); `ValueError` naming the field."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest or None, got {type(request).__name__}")
        if self.config is None:
            raise ValueError(LORA_NOT_ENABLED)
        self.adapter_config(request)
        return request

    def adapter_config(self, request: LoRARequest) -> AdapterConfig:
        """The adapter's checked config (its files read once per id while the id is remembered)."""
        assert self.config is not None
        rid, path = request.lora_int_id, request.lora_path
        with self._lock:
            seen = self._checked.get(rid)
            if seen is not None:
                self._checked.move_to_end(rid)
        if seen is not None:
            if seen[0] != path:
                raise ValueError(
                    f"lora_int_id: {rid} is already the id of the adapter at {seen[0]!r}, not {path!r}; "
                    "each adapter needs an id of its own"
                )
            return seen[1]
        config = read_adapter_config(path, max_lora_rank=self.config.max_lora_rank)
        if self.shapes is not None:
            self.shapes.check(config)
        with self._lock:
            seen = self._checked.setdefault(rid, (path, config))  # a racing check of the same id
            evictable = (lid for lid in list(self._checked) if lid not in self._pinned)
            while len(self._checked) > self.max_checked and (lid := next(evictable, None)) is not None:
                del self._checked[lid]
        if seen[0] != path:
            return self.adapter_config(request)  # raises, naming the id
        return seen[1]
