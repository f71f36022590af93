"""`LoRAChecker`: a request's adapter checked before anything reaches the engine core.

Every request's `lora_request` passes here in the shell that adds it (`AsyncLLM`, `SyncEngine`):
LoRA must be on (`enable_lora`), and the adapter's `adapter_config.json` must pass
`read_adapter_config` (the PEFT fields honoured, `r <= max_lora_rank`), each failure a
`ValueError` naming the field (and the adapter's path). A checked adapter is remembered by
`(lora_int_id, lora_path)`, so a request under an adapter seen before costs a dict lookup;
`needs_io` tells the shell when a check would read files (or look a Hub id up in the cache), so
that one check runs in a worker thread, off the event loop.

An id names one adapter: the engine core keys its adapter slots, its CPU cache and its
prefix-cache blocks by `lora_int_id`, so a second path under an id already checked is refused
(vLLM would serve the first adapter's weights under the second's name, without a word).
Checks may run in worker threads while the event loop checks others: the table is behind a lock.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from triollm.lora.peft import AdapterConfig, read_adapter_config
from triollm.lora.request import LoRARequest

if TYPE_CHECKING:
    from triollm.engine.config import LoRAConfig

__all__ = ["LORA_NOT_ENABLED", "LoRAChecker"]

LORA_NOT_ENABLED = (
    "lora_request: LoRA adapters are not enabled on this engine; start it with enable_lora=True "
    "(the server: --enable-lora)"
)


class LoRAChecker:
    def __init__(self, config: LoRAConfig | None) -> None:
        """`config`: the engine's LoRA settings (None: LoRA off, every adapter is refused)."""
        self.config = config
        self._lock = threading.Lock()
        self._checked: dict[int, tuple[str, AdapterConfig]] = {}  # lora_int_id -> (path, config)

    @property
    def enabled(self) -> bool:
        return self.config is not None

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
        """The adapter's checked config (read once per id)."""
        assert self.config is not None
        rid, path = request.lora_int_id, request.lora_path
        with self._lock:
            seen = self._checked.get(rid)
        if seen is not None:
            if seen[0] != path:
                raise ValueError(
                    f"lora_int_id: {rid} is already the id of the adapter at {seen[0]!r}, not {path!r}; "
                    "each adapter needs an id of its own"
                )
            return seen[1]
        config = read_adapter_config(path, max_lora_rank=self.config.max_lora_rank)
        with self._lock:
            seen = self._checked.setdefault(rid, (path, config))  # a racing check of the same id
        if seen[0] != path:
            return self.adapter_config(request)  # raises, naming the id
        return seen[1]
