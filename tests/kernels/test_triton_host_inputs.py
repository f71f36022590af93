"""The host's work per step on the Triton (CUDA) path (issue 28): a step's inputs go to the
device in one copy, whatever the batch, with no tensor built per block-table row, for decode
graph replays (`DecodeGraphs.run`), the decode plan (`plan_decode`) and the prefill plan
(`plan_prefill`).

The device is `meta`, standing in for CUDA: a copy from the host to it is an op the dispatch
mode sees (`copy_` or `_to_copy` from a CPU tensor to a meta one), and `torch.tensor(...)` calls
are counted too (building a tensor from a Python list is the per-row cost being removed). The
numbers the graphs read are checked on CPU, where `fill_tables` and the packing are plain numpy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from triollm.engine.execution.cuda_graphs import DecodeGraphs
from triollm.kernels.attention import allocate_kv_cache, fill_tables, plan_decode, plan_prefill


class HostToDevice(TorchDispatchMode):
    """Counts copies from CPU tensors into meta tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in ("copy_", "_to_copy"):
            src = args[1] if name == "copy_" else args[0]
            dst = args[0] if name == "copy_" else out
            if src.device.type == "cpu" and dst.device.type == "meta":
                self.copies += 1
        return out


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> tuple[HostToDevice, list[int]]:
    """The dispatch counter, and a list `torch.tensor` calls append to."""
    monkeypatch.setenv("TRIOLLM_KERNELS", "triton")
    calls: list[int] = []
    original = torch.tensor

    def tensor(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", tensor)
    return HostToDevice(), calls


@dataclass
class _Cfg:
    hidden_size: int = 8
    dtype: torch.dtype = torch.float32


class _Model:
    """Stands in for a CausalLM: what the graphs call, on whatever device the inputs are."""

    cfg = _Cfg()

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:
        return torch.zeros(ids.shape[0], self.cfg.hidden_size, device=ids.device)


def _graphs(device: str, sizes: tuple[int, ...] = (1, 4, 8), width: int = 6) -> DecodeGraphs:
    kv = allocate_kv_cache(1, 40, 16, 1, 16, torch.float32, device)

    def capture(fn: Any) -> Any:
        fn()
        return fn

    return DecodeGraphs(_Model(), kv, torch.device(device), sizes, width, 39, capture)  # type: ignore[arg-type]


STEPS = {
    1: ([5], [17], [3 * 16 + 1], [[2, 3]], [18]),
    3: ([5, 6, 7], [17, 40, 2], [33, 3 * 16 + 8, 4 * 16 + 2], [[1, 2], [3, 4, 5], [6]], [18, 41, 3]),
}


@pytest.mark.parametrize("batch", [1, 3])
def test_a_graph_replay_sends_its_inputs_in_one_copy(counted: tuple[HostToDevice, list[int]], batch: int) -> None:
    mode, tensor_calls = counted
    graphs = _graphs("meta")
    with mode:
        graphs.run(*STEPS[batch])  # type: ignore[arg-type]
    assert mode.copies == 1 and tensor_calls == []


def test_the_packed_inputs_are_what_the_graph_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRIOLLM_KERNELS", "triton")
    graphs = _graphs("cpu")
    seen: dict[str, torch.Tensor] = {}

    def model(ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:
        tables, lens = meta.decode_plan.triton
        seen.update(
            ids=ids.clone(),
            pos=positions.clone(),
            slots=meta.slot_mapping.clone(),
            tables=tables.clone(),
            lens=lens.clone(),
        )
        return torch.zeros(ids.shape[0], 8)

    graphs.model = model  # type: ignore[assignment]
    graphs._replays = {s: graphs._forward(s) for s in graphs.sizes}  # "recaptured" with the spy
    ids, pos, slots, tables, lens = STEPS[3]
    graphs.run(ids, pos, slots, tables, lens)
    pad_slot = 39 * 16
    assert seen["ids"].tolist() == [5, 6, 7, 0] and seen["ids"].dtype == torch.long
    assert seen["pos"].tolist() == [17, 40, 2, 0] and seen["slots"].tolist() == slots + [pad_slot]
    assert seen["lens"].tolist() == [18, 41, 3, 1]
    assert seen["tables"].tolist() == [[1, 2, 39, 39, 39, 39], [3, 4, 5, 39, 39, 39], [6, 39, 39, 39, 39, 39], [39] * 6]
    graphs.run(*STEPS[1])  # a smaller batch later: the padding is rewritten, not left over
    assert (
        seen["ids"].tolist() == [5]
        and seen["lens"].tolist() == [18]
        and seen["tables"].tolist() == [[2, 3, 39, 39, 39, 39]]
    )


def test_plans_send_their_tables_in_one_copy(counted: tuple[HostToDevice, list[int]]) -> None:
    mode, tensor_calls = counted
    tables = [[7, 8, 9], [1], [4, 5]]
    with mode:
        decode = plan_decode(tables, [40, 3, 20], 16, "meta")
    assert mode.copies == 1 and tensor_calls == []
    assert decode.triton is not None and decode.triton[0].shape == (3, 3) and decode.triton[1].shape == (3,)
    mode.copies = 0
    with mode:
        prefill = plan_prefill([(5, 0, [7]), (9, 20, [1, 2]), (1, 40, [4, 5, 6])], "meta")
    assert mode.copies == 1 and tensor_calls == []
    assert prefill.triton is not None and [t.shape for t in prefill.triton] == [(4,), (3,), (3, 3)]


def test_fill_tables_pads_each_row() -> None:
    out = np.full((4, 3), -7, dtype=np.int32)
    fill_tables(out, [[1, 2, 3], [], [4]], pad=9)
    assert out.tolist() == [[1, 2, 3], [9, 9, 9], [4, 9, 9], [9, 9, 9]]
    fill_tables(out[:0], [], pad=0)  # no rows
