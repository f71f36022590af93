"""Rank 0 → worker messages, over each worker's stdin pipe.

A message is a 16-byte header (kind, payload length) and a payload. Setup messages are pickled
(they travel between processes of one installation, never over a network); a step is the
`StepInputs` flattened into int64s, then the bytes of any LoRA slots rank 0 filled. End of
file is the same as STOP: rank 0 is gone.

Why the pipe and not a gloo broadcast: a worker waits for the next step for as long as the
engine is idle, and a gloo wait is bounded by the group's timeout; a pipe read is not, and its
end of file tells the worker at once that rank 0 has exited or died.
"""

from __future__ import annotations

import pickle
import struct
from array import array
from dataclasses import dataclass, field
from typing import IO, Any

from triollm.engine.loading.model_config import ModelConfig

__all__ = [
    "CACHE",
    "RPC",
    "RpcFailure",
    "SETUP",
    "STEP",
    "STOP",
    "StepInputs",
    "WorkerSetup",
    "decode_step",
    "encode_step",
    "joined_key",
    "read_message",
    "write_message",
]

SETUP, CACHE, STEP, STOP = 1, 2, 3, 4
# collective_rpc (engine/execution/sleep_mode.py): a cloudpickled (method, args, kwargs); every
# rank runs it and rank 0 gathers the results over gloo (`TensorParallelGroup.call`).
RPC = 5
_HEADER = struct.Struct("<qq")


@dataclass
class StepInputs:
    """One step's forward-pass inputs as plain ints: what rank 0 sends to the other ranks
    (engine/execution/model_runner.py gathers it, `ModelRunner.follow` replays it)."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    decode_tables: list[list[int]] = field(default_factory=list)  # per decode: its blocks
    decode_lens: list[int] = field(default_factory=list)  # per decode: context incl. the new token
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # PrefillChunk fields
    logit_rows: list[list[int]] = field(default_factory=list)  # rows of each compute_logits call
    # LoRA (lora/layers.py): per request fed under an adapter, (slot, first row, rows); and the
    # slots rank 0 filled since the last step, opaque to this module (lora/manager.py `take_loads`).
    lora_segments: list[tuple[int, int, int]] = field(default_factory=list)
    lora_loads: bytes = b""


@dataclass(frozen=True)
class WorkerSetup:
    rank: int
    size: int
    port: int  # rank 0's rendezvous port on 127.0.0.1
    num_threads: int
    model: ModelConfig
    device: str
    block_size: int
    timeout_s: float  # init and collectives


@dataclass(frozen=True)
class RpcFailure:
    """A worker's `collective_rpc` part raised: what rank 0 raises in its place."""

    rank: int
    kind: str  # the exception's class name
    message: str


def write_message(pipe: IO[bytes], kind: int, payload: bytes = b"") -> None:
    pipe.write(_HEADER.pack(kind, len(payload)) + payload)
    pipe.flush()


def read_message(pipe: IO[bytes]) -> tuple[int, bytes]:
    """The next message; (STOP, b"") at end of file."""
    header = _read_exactly(pipe, _HEADER.size)
    if header is None:
        return STOP, b""
    kind, n = _HEADER.unpack(header)
    payload = _read_exactly(pipe, n)
    return (STOP, b"") if payload is None else (kind, payload)


def pickled(value: Any) -> bytes:
    return pickle.dumps(value)


def unpickled(payload: bytes) -> Any:
    return pickle.loads(payload)  # noqa: S301 (from rank 0, our own parent process)


def encode_step(s: StepInputs) -> bytes:
    out = array(
        "q",
        [
            len(s.token_ids),
            len(s.decode_lens),
            len(s.prefills),
            len(s.logit_rows),
            len(s.lora_segments),
            len(s.lora_loads),
        ],
    )
    out.extend(s.token_ids)
    out.extend(s.positions)
    out.extend(s.slots)
    out.extend(s.decode_lens)
    for table in s.decode_tables:
        out.append(len(table))
        out.extend(table)
    for start, n, c, blocks in s.prefills:
        out.extend((start, n, c, len(blocks)))
        out.extend(blocks)
    for rows in s.logit_rows:
        out.append(len(rows))
        out.extend(rows)
    for segment in s.lora_segments:
        out.extend(segment)
    return out.tobytes() + s.lora_loads


def decode_step(payload: bytes) -> StepInputs:
    nl = array("q", payload[40:48])[0]  # the header's sixth int: the LoRA bytes at the end
    ints, blob = (payload[: len(payload) - nl], payload[len(payload) - nl :]) if nl else (payload, b"")
    v = array("q")
    v.frombytes(ints)
    data = v.tolist()
    t, nd, np_, ng, ns = data[:5]
    i = 6

    def take(n: int) -> list[int]:
        nonlocal i
        i += n
        return data[i - n : i]

    s = StepInputs(take(t), take(t), take(t), decode_lens=take(nd))
    for _ in range(nd):
        s.decode_tables.append(take(take(1)[0]))
    for _ in range(np_):
        start, n, c, nb = take(4)
        s.prefills.append((start, n, c, take(nb)))
    for _ in range(ng):
        s.logit_rows.append(take(take(1)[0]))
    for _ in range(ns):
        slot, start, n = take(3)
        s.lora_segments.append((slot, start, n))
    s.lora_loads = blob
    return s


def _read_exactly(pipe: IO[bytes], n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = pipe.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def joined_key(rank: int) -> str:
    """The store key a worker sets once it has connected to rank 0's store."""
    return f"triollm/joined/{rank}"
