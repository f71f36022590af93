"""`LoRAManager`: the engine core's adapters, read on demand, cached on the CPU, placed in slots.

The manager attaches a `LoRALayer` (lora/layers.py) to every LoRA-able projection of the model
(q|k|v, o, gate|up, down: those an MoE layer has outside its experts) and owns the step's
`LoRABatch`. Before each forward pass the core calls `prepare` with the adapters of the
scheduled requests: each one missing from the slots is taken from the CPU cache or read from
disk (lora/peft.py, then checked against the model by lora/shapes.py, as the frontend checked it
when it was loaded: every tensor's shape, and no target the model lacks, such as the MLP of a
mixture-of-experts layer; the file may have changed since), and copied into a slot. An adapter
that fails to load is reported by id with the reason, and the core fails the requests that
asked for it alone. The CPU cache keeps the `max_cpu_loras` most recently used adapters, read
in float32 and whole; a slot holds its own copy, in the LoRA dtype and sharded as its layer.

A slot is taken for a new adapter only if it is empty or holds an adapter that no running
request uses (the scheduler never runs more than `max_loras` distinct adapters, so one always
is), the least recently used first. A slot is filled whole: every LoRA-able projection gets the
adapter's pieces (zeros where it targets nothing), scaled, in this rank's share.

Tensor parallel: the other ranks never read adapter files. Rank 0's manager (`keep_loads`)
keeps each slot it filled since the last step, and the model runner sends them with the step
(`take_loads`: the adapter's float32 tensors, pickled; a few MB, only when a slot changes);
a worker's runner builds its manager from the first such message (`from_loads`) and fills the
same slots with its own shares. A file deleted or changed after rank 0 read it cannot make the
ranks disagree.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from triollm.lora.config import LoRAConfig
from triollm.lora.layers import LoRABatch, LoRALayer
from triollm.lora.peft import LORA_MODULES, read_adapter_config
from triollm.lora.shapes import ATTENTION_MODULES, ModelShapes, lora_able_modules

if TYPE_CHECKING:
    from triollm.lora.request import LoRARequest

__all__ = ["Adapter", "LoRAManager", "LoRAModel"]


@dataclass(frozen=True)
class Adapter:
    """An adapter read and checked: float32 A `[r, in]` and B `[out, r]` by (layer, module)."""

    lora_int_id: int
    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class _Target:
    layer: LoRALayer
    piece: int
    rows: tuple[int, int]  # this rank's (start, count) of the checkpoint piece's output rows
    offset: int  # where those rows sit in the projection's output
    cols: tuple[int, int] | None  # a row-parallel projection's (start, count) of the input columns


class LoRAModel(Protocol):
    """What the manager needs of a model: engine/execution/models/base.py's `CausalLM` (named
    by this Protocol because lora/ sits below engine/)."""

    lora_batch: LoRABatch | None  # set to the manager's batch: which rows use which slot

    @property
    def cfg(self) -> Any: ...  # its ModelConfig: layer count, MoE, projection sizes

    @property
    def layers(self) -> Iterable[nn.Module]: ...

    @property
    def stacked(self) -> Mapping[str, tuple[str, int]]: ...  # checkpoint name -> (ours, piece)


class LoRAManager:
    def __init__(
        self, model: LoRAModel, config: LoRAConfig, device: torch.device | str, *, keep_loads: bool = False
    ) -> None:
        self.config, self.device = config, torch.device(device)
        self.num_layers = model.cfg.num_layers
        self.batch = LoRABatch(config.max_loras)
        dtype = getattr(torch, config.dtype)
        self.targets: dict[tuple[int, str], _Target] = {}
        for i, layer in enumerate(model.layers):
            built: dict[str, LoRALayer] = {}
            for module in LORA_MODULES:
                ours, piece = model.stacked.get(module, (module, 0))
                proj = _find(layer, f"{'self_attn' if module in ATTENTION_MODULES else 'mlp'}.{ours}")
                if proj is None:
                    continue
                rows: list[tuple[int, int]] = proj.rows
                if ours not in built:
                    built[ours] = LoRALayer(
                        self.batch,
                        [n for _, n in rows],
                        proj.in_features,
                        proj.out_features,
                        config.max_lora_rank,
                        dtype,
                        self.device,
                    )
                    proj.lora = built[ours]
                offset = sum(n for _, n in rows[:piece])
                self.targets[(i, module)] = _Target(built[ours], piece, rows[piece], offset, proj.cols)
        self.layers = list({id(t.layer): t.layer for t in self.targets.values()}.values())
        self.shapes = ModelShapes.of(model.cfg, lora_able_modules(self.targets, self.num_layers))
        model.lora_batch = self.batch
        self.cpu: OrderedDict[int, Adapter] = OrderedDict()
        self.slots: list[int | None] = [None] * config.max_loras  # the adapter id in each slot
        self.slot_of: dict[int, int] = {}  # adapter id -> its slot
        self._used = [0] * config.max_loras  # when each slot last served a step
        self._clock = 0
        self.keep_loads = keep_loads
        self._loads: list[tuple[int, Adapter]] = []
        self.pinned: set[int] = set()  # never evicted from `cpu`, their slots never reused (`pin`)

    # ------------------------------------------------------------------ vLLM's remove / pin

    def remove(self, lora_id: int, in_use: Collection[int]) -> bool:
        """Forget adapter `lora_id` (vLLM's `remove_lora`): its host copy, its pin, and its slot
        unless `in_use` (the adapters of unfinished requests) holds it; it is read again when a
        request next names it. False if it was not held."""
        held = self.cpu.pop(lora_id, None) is not None or lora_id in self.pinned
        self.pinned.discard(lora_id)
        slot = self.slot_of.get(lora_id)
        if slot is not None and lora_id not in in_use:
            del self.slot_of[lora_id]
            self.slots[slot] = None  # refilled (cleared first) when a slot is next needed
        return held or slot is not None

    def pin(self, lora_id: int) -> None:
        """Keep adapter `lora_id` in host memory and in its slot once loaded (vLLM's
        `pin_lora`); a ValueError when every slot but one would be pinned."""
        if lora_id not in self.pinned and len(self.pinned) + 1 >= len(self.slots):
            raise ValueError(
                f"lora_id: {lora_id} cannot be pinned: {len(self.pinned)} of max_loras={len(self.slots)} "
                "slots are pinned, and one must stay free for the other adapters"
            )
        self.pinned.add(lora_id)

    # ------------------------------------------------------------------ the core's side

    def prepare(self, wanted: Sequence[LoRARequest], running: Collection[int]) -> dict[int, str]:
        """Put every adapter in `wanted` (this step's) into a slot; the ones that could not be
        loaded, by id, with the reason. `running`: the adapter ids of every running request,
        whose slots are not reused."""
        self._clock += 1
        failed: dict[int, str] = {}
        needed = {r.lora_int_id: r for r in wanted}
        for lid, req in needed.items():
            slot = self.slot_of.get(lid)
            if slot is None:
                try:
                    adapter = self._adapter(req)
                except Exception as exc:  # noqa: BLE001 - whatever reading it raised: this adapter's requests fail
                    failed[lid] = (
                        str(exc)
                        if isinstance(exc, ValueError)
                        else f"lora_path: {req.lora_path!r}: {type(exc).__name__}: {exc}"
                    )
                    continue
                slot = self._free_slot(set(needed) | set(running) | self.pinned)
                self.load_slot(slot, adapter)
            self._used[slot] = self._clock
        return failed

    def _adapter(self, req: LoRARequest) -> Adapter:
        adapter = self.cpu.get(req.lora_int_id)
        if adapter is not None:
            self.cpu.move_to_end(req.lora_int_id)
            return adapter
        adapter = self.read(req)
        self.cpu[req.lora_int_id] = adapter
        evictable = (lid for lid in list(self.cpu) if lid not in self.pinned)
        while len(self.cpu) > self.config.max_cpu_loras and (lid := next(evictable, None)) is not None:
            del self.cpu[lid]
        return adapter

    def read(self, req: LoRARequest) -> Adapter:
        """The adapter's tensors, checked against the model (lora/shapes.py): `ValueError`
        naming the path and the module or tensor otherwise."""
        config = read_adapter_config(req.lora_path, max_lora_rank=self.config.max_lora_rank)
        weights = self.shapes.read(config)
        return Adapter(req.lora_int_id, req.lora_path, config.rank, config.scaling, weights)

    def _free_slot(self, keep: set[int]) -> int:
        free = [s for s, lid in enumerate(self.slots) if lid is None or lid not in keep]
        if not free:
            raise RuntimeError(
                f"max_loras: {len(self.slots)} slots all hold adapters of running requests; the scheduler "
                "must not run more distinct adapters at once"
            )
        return min(free, key=lambda s: (self.slots[s] is not None, self._used[s]))

    # ------------------------------------------------------------------ slots (every rank)

    def load_slot(self, slot: int, adapter: Adapter) -> None:
        """Fill `slot` with `adapter`: its pieces, scaled, in this rank's share; zeros elsewhere."""
        old = self.slots[slot]
        if old is not None:
            self.slot_of.pop(old, None)
        for layer in self.layers:
            layer.clear(slot)
        r, scale = adapter.rank, adapter.scaling
        for key, (a, b) in adapter.weights.items():
            t = self.targets[key]
            if t.cols is not None:
                a = a[:, t.cols[0] : t.cols[0] + t.cols[1]]
            b = b[t.rows[0] : t.rows[0] + t.rows[1]] * scale
            t.layer.fill(slot, r, t.piece, a, b, (t.offset, t.rows[1]))
        self.slots[slot] = adapter.lora_int_id
        self.slot_of[adapter.lora_int_id] = slot
        self.batch.ranks[slot] = r
        self.batch.version += 1
        if self.keep_loads:
            self._loads.append((slot, adapter))

    def set_batch(self, segments: Sequence[tuple[int, int, int]]) -> None:
        self.batch.set(segments, self.device)

    def take_loads(self) -> bytes:
        """The slots filled since the last call, for the other ranks (module note); b"" if none."""
        if not self._loads:
            return b""
        loads, self._loads = self._loads, []
        return pickle.dumps((self.config, loads))

    @classmethod
    def from_loads(cls, model: LoRAModel, payload: bytes, device: torch.device | str) -> LoRAManager:
        """A worker's manager, built from the first slots rank 0 sent, and those slots filled."""
        config, loads = _unpickle(payload)
        manager = cls(model, config, device)
        for slot, adapter in loads:
            manager.load_slot(slot, adapter)
        return manager

    def apply_loads(self, payload: bytes) -> None:
        """Fill the slots rank 0 filled (`take_loads`)."""
        for slot, adapter in _unpickle(payload)[1]:
            self.load_slot(slot, adapter)


def _find(layer: torch.nn.Module, path: str) -> Any:
    """The projection at `path` in a decoder layer, or None (an MoE block has no gate_up_proj)."""
    try:
        proj = layer.get_submodule(path)
    except AttributeError:
        return None
    return proj if hasattr(proj, "rows") and hasattr(proj, "in_features") else None


def _unpickle(payload: bytes) -> tuple[LoRAConfig, list[tuple[int, Adapter]]]:
    return pickle.loads(payload)  # noqa: S301 (from rank 0, our own parent process)
