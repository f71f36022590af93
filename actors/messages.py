"""The wire vocabulary between the frontend and an engine core.

One tagged union per direction, decoded by one reused typed decoder, so a message sent the wrong
way fails at decode. The same Structs travel over memory object streams in one process (no
encoding) and as msgpack over ZMQ between processes.

Outputs travel as one struct-of-arrays batch per engine step (`OutputBatch`): request ids, new token
ids, finish and stop reasons side by side, and logprobs as columnar arrays (`LogprobColumns`),
because many small per-request objects encode far slower than a few flat lists (docs/benchmarks.md,
"Figures that stood in the source"). All are `array_like` (msgspec needs one encoding per union);
hot messages are also `omit_defaults` and `gc=False`.

An `OutputBatch` with no entries is a heartbeat: the step ran and had nothing for anyone (a
prompt chunk that is not the prompt's last, a wait for grammars), and the batch carries the
core's statistics. The core loop sends one message per step it runs, so the watchdogs
(actors/watchdog.py) hear a busy core however long its prompts. As in vLLM v1, where a step
without outputs still sends an `EngineCoreOutputs` carrying the scheduler's stats. Rejected: a
message type of its own: every consumer already takes an `OutputBatch` and its stats (the
output actor, the data-parallel forwarders and their load scores, the process pumps), and a
new member of the union would need a case in each, where a missed one is a silent fault.
"""

from __future__ import annotations

import enum

import msgspec

from triollm.engine.core_protocol import EngineCoreStats
from triollm.engine.request import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs

__all__ = [
    "AbortRequests",
    "AddRequest",
    "CoreInput",
    "CoreOutput",
    "EngineDead",
    "LogprobColumns",
    "OutputBatch",
    "Ready",
    "RequestError",
    "Shutdown",
    "StartupError",
    "UtilityCall",
    "UtilityOp",
    "UtilityResult",
    "input_decoder",
    "output_decoder",
]

# ------------------------------------------------------------------ frontend -> core


class AddRequest(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag=True, array_like=True, gc=False):
    request_ids: list[str]


class UtilityOp(enum.IntEnum):
    STATISTICS = 0  # -> EngineCoreStats
    RESET_PREFIX_CACHE = 1  # -> bool
    CHECK_INTEGRITY = 2  # -> True, or the call fails with the assertion text
    PAUSE = 3  # stop stepping; queued and running requests stay where they are -> True
    RESUME = 4  # step again -> True
    # The engine core's methods of the same names (engine/core_protocol.py), called with the
    # call's `payload`, cloudpickled (args, kwargs); the answer is the result, cloudpickled.
    SLEEP = 5
    WAKE_UP = 6
    IS_SLEEPING = 7
    RELOAD_WEIGHTS = 8
    COLLECTIVE_RPC = 9  # -> a list, one result per tensor-parallel rank
    START_PROFILE = 10
    STOP_PROFILE = 11


class UtilityCall(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    op: UtilityOp
    payload: bytes = b""  # the ops that take arguments: cloudpickle of (args, kwargs)


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


CoreInput = AddRequest | AbortRequests | UtilityCall | Shutdown

# ------------------------------------------------------------------ core -> frontend


class Ready(msgspec.Struct, tag=True, array_like=True):
    """Start-up handshake: what the engine measured."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int


class StartupError(msgspec.Struct, tag=True, array_like=True):
    message: str
    traceback: str


class LogprobColumns(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs of several batch entries, flattened. Entry `index[j]` owns `num_rows[j]` rows of
    `width[j]` values each, stored row-major in `token_ids` / `logprobs`, and one rank per row."""

    index: list[int] = []
    num_rows: list[int] = []
    width: list[int] = []
    token_ids: list[int] = []
    logprobs: list[float] = []
    ranks: list[int] = []

    @classmethod
    def pack(cls, entries: list[Logprobs | None]) -> LogprobColumns | None:
        cols = cls([], [], [], [], [], [])
        for i, lp in enumerate(entries):
            if lp is None:
                continue
            cols.index.append(i)
            cols.num_rows.append(len(lp.ranks))
            cols.width.append(len(lp.token_ids[0]) if lp.token_ids else 0)
            for ids in lp.token_ids:
                cols.token_ids.extend(ids)
            for vals in lp.logprobs:
                cols.logprobs.extend(vals)
            cols.ranks.extend(lp.ranks)
        return cols if cols.index else None

    def unpack(self, n: int) -> list[Logprobs | None]:
        out: list[Logprobs | None] = [None] * n
        pos = row = 0
        for i, rows, width in zip(self.index, self.num_rows, self.width):
            ids = [self.token_ids[pos + r * width : pos + (r + 1) * width] for r in range(rows)]
            vals = [self.logprobs[pos + r * width : pos + (r + 1) * width] for r in range(rows)]
            out[i] = Logprobs(ids, vals, self.ranks[row : row + rows])
            pos += rows * width
            row += rows
        return out


_NOT_FINISHED = -1
_NO_TIMES = [0.0, 0.0]


class OutputBatch(msgspec.Struct, tag=True, array_like=True, omit_defaults=True, gc=False):
    """Everything one engine step produced, as parallel arrays (one entry per request); no
    entries: a heartbeat (the module docstring)."""

    request_ids: list[str]
    new_token_ids: list[list[int]]
    finish_reasons: list[int]  # FinishReason value, or -1 while running
    stop_reasons: list[int | str | None]
    num_cached_tokens: list[int]
    logprobs: LogprobColumns | None = None
    prompt_logprobs: LogprobColumns | None = None
    stats: EngineCoreStats | None = None
    # A pooling model's step: every entry's embedding (float32 bytes); None for a generative one.
    pooled: list[bytes | None] | None = None
    # When the core made these outputs (time.monotonic(); RequestOutput.metrics' token stamps).
    timestamp: float = 0.0
    # [queued_ts, scheduled_ts] per entry, only in a batch where some request sent its first
    # output (engine/request.py); None in the steady state of decoding.
    queue_times: list[list[float]] | None = None
    # Per entry, the preemptions since the request's previous output; None when none happened.
    preemptions: list[int] | None = None

    @property
    def is_heartbeat(self) -> bool:
        """No entries: the step ran and produced nothing for anyone; only `stats` is news."""
        return not self.request_ids

    @classmethod
    def from_outputs(
        cls, outputs: list[EngineCoreOutput], stats: EngineCoreStats | None = None, timestamp: float = 0.0
    ) -> OutputBatch:
        # One core is either generative or pooling, so its first output tells which (O(1) here).
        if outputs and outputs[0].pooled is not None:
            return cls(
                request_ids=[o.request_id for o in outputs],
                new_token_ids=[[] for _ in outputs],
                finish_reasons=[_NOT_FINISHED if o.finish_reason is None else int(o.finish_reason) for o in outputs],
                stop_reasons=[o.stop_reason for o in outputs],
                num_cached_tokens=[0 for _ in outputs],
                stats=stats,
                pooled=[o.pooled for o in outputs],
            )
        return cls(
            request_ids=[o.request_id for o in outputs],
            new_token_ids=[o.new_token_ids for o in outputs],
            finish_reasons=[_NOT_FINISHED if o.finish_reason is None else int(o.finish_reason) for o in outputs],
            stop_reasons=[o.stop_reason for o in outputs],
            num_cached_tokens=[o.num_cached_tokens for o in outputs],
            logprobs=LogprobColumns.pack([o.new_logprobs for o in outputs]),
            prompt_logprobs=LogprobColumns.pack([o.new_prompt_logprobs for o in outputs]),
            stats=stats,
            timestamp=timestamp,
            queue_times=[[o.queued_ts, o.scheduled_ts] for o in outputs]
            if any(o.scheduled_ts for o in outputs)
            else None,
            preemptions=[o.num_preemptions for o in outputs] if any(o.num_preemptions for o in outputs) else None,
        )

    def to_outputs(self) -> list[EngineCoreOutput]:
        if self.pooled is not None:
            return [
                EngineCoreOutput(
                    rid, [], finish_reason=None if fr == _NOT_FINISHED else FinishReason(fr), stop_reason=sr, pooled=p
                )
                for rid, fr, sr, p in zip(self.request_ids, self.finish_reasons, self.stop_reasons, self.pooled)
            ]
        n = len(self.request_ids)
        lps = self.logprobs.unpack(n) if self.logprobs else [None] * n
        plps = self.prompt_logprobs.unpack(n) if self.prompt_logprobs else [None] * n
        times = self.queue_times or [_NO_TIMES] * n
        preemptions = self.preemptions or [0] * n
        return [
            EngineCoreOutput(
                rid,
                toks,
                finish_reason=None if fr == _NOT_FINISHED else FinishReason(fr),
                stop_reason=sr,
                new_logprobs=lp,
                new_prompt_logprobs=plp,
                num_cached_tokens=nc,
                queued_ts=qs[0],
                scheduled_ts=qs[1],
                num_preemptions=np,
            )
            for rid, toks, fr, sr, nc, lp, plp, qs, np in zip(
                self.request_ids,
                self.new_token_ids,
                self.finish_reasons,
                self.stop_reasons,
                self.num_cached_tokens,
                lps,
                plps,
                times,
                preemptions,
            )
        ]


class RequestError(msgspec.Struct, tag=True, array_like=True):
    """One request was rejected or failed alone; the engine goes on."""

    request_id: str
    message: str
    kind: str = "ValueError"  # "ValueError": bad input; otherwise an unexpected failure


class UtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    # bytes: a core method's result, cloudpickled (the ops from SLEEP on)
    result: EngineCoreStats | bool | bytes | None = None
    error: str | None = None


class EngineDead(msgspec.Struct, tag=True, array_like=True):
    """The engine core failed and is exiting; nothing more will come."""

    message: str
    traceback: str = ""


CoreOutput = Ready | StartupError | OutputBatch | RequestError | UtilityResult | EngineDead

input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_decoder = msgspec.msgpack.Decoder(CoreOutput)
