"""The scheduler: which requests advance this step, and by how many tokens.

One rule covers prefill and decode (as in vLLM v1): a request has `num_tokens` (prompt plus
output) and `num_computed_tokens` with KV in the cache; a step schedules up to
`num_tokens - num_computed_tokens` of them within the step's token budget. A request whose
computed tokens reach its length samples one new token at the end of the step.

Each step:
1. Running requests get their tokens: first the decodes (1 token each), in order, then those
   still prefilling (the rest of the prompt, cut to the prefill budget), in order. When KV blocks
   run out, the lowest-priority running request (the latest, under FCFS) is preempted: its blocks
   are freed, its computed tokens forgotten, and it goes back to the front of the waiting queue
   to be recomputed later (its generated tokens are kept, so under greedy decoding it completes
   with the same tokens).
2. If nothing was preempted, waiting requests are admitted in order (FCFS, or by `priority`
   then arrival) while the prefill budget, `max_num_seqs` and the free blocks allow; a new
   request first takes its longest cached prefix from the prefix cache. Under LoRA at most
   `max_loras` distinct adapters run at once (the slots of the adapter buffers, lora/): a
   request whose adapter would be one more waits where it is, and later requests (the base
   model, adapters already running) are admitted past it, as in vLLM; at most `max_num_seqs`
   are passed over per step, so a long queue of such requests costs a bounded scan.
   A prompt chunk never cuts an image whose positions attend to each other both ways (Gemma 3,
   `ImageFeature.bidirectional`): it ends before the image, or takes the rest of it whole if
   max_num_batched_tokens allows (past the prefill budget if need be), or the request waits a
   step (max_num_batched_tokens holds one image: checked at load).

The prefill budget (`prefill_budget="auto"`, with chunked prefill). A step's time grows with the
tokens it carries, and every running request waits for the whole step: on a 2-core CPU, prompt
chunks of up to `max_num_batched_tokens` beside 16 decodes put those decodes' p99 inter-token
latency at several times its median (issue 25). So while requests decode, the prompt tokens of a
step are limited to those that keep it within `TARGET_STEP_RATIO` of a decode-only step, by the step
cost measured so far (`step_cost.py`: `seconds = a + b * tokens`, fitted to the forward passes the
engine core times and reports through `record_step`): the time the ratio leaves beside the
decodes' own step, divided by what a prompt token costs at the context the latest chunk reached
(`StepCost.prompt_token_seconds`: the line's slope does not follow the context, and at 8k a prompt
token costs a 0.5B model six times what it did at the start), never more than the budget left
and never fewer than a floor: `MIN_PREFILL_CHUNK` tokens, or as many as cost `MIN_PREFILL_STEP_S`
where those are fewer, and at least one (prompts always progress). The decode-only step is the
line's figure or, lower, the latest one measured (`StepCost.decode_seconds`: through a long
prompt's chunks the line's intercept drifts up). Before a first fit the line is drawn through
the latest decode-only and prompt steps (`StepCost.line`): an engine's first prompt step (the
whole budget) is followed by steps whose decodes would otherwise wait behind another whole
budget. With nothing decoding, before any prompt step, or where a
decode-only step takes under `_MIN_STEP_S` (no one sees that stall, and the timing is mostly
noise), no ratio applies (the time bound below still does).
`long_prefill_token_threshold` (vLLM's per-request cap) applies on top.

Fair admission (issue 41). A fixed ratio starves new requests under load: with 64 clients each
sending a 200-token prompt for 128 tokens, keeping all 64 decoding takes ~100 prompt tokens a step,
more than 1.5x a decode step buys on a CPU, so a third of the clients waited in the queue and the
slowest first token took 38 s (the running ones decoded at a cadence nobody asked to protect at
that price). Two changes:
- The decode-only step the ratio is taken of is that of the load, not of the decodes alone: of
  as many rows as requests run and wait (up to `max_num_seqs`). When 64 clients send at once,
  the first few to get a token would otherwise set the cadence: a decode-only step of 5 rows is
  short, 1.5x of it admits a few prompt tokens a step, and the other 59 prompts trickle in over
  tens of seconds. Against the step the whole load will decode at, the few decoders see steps
  no longer than they will once everyone runs (what their median inter-token latency is made
  of) while the burst is admitted at a pace that keeps up. With nothing waiting or prefilling
  it is the plain ratio.
- The ratio grows with the wait of the request at the head of the waiting queue: from
  `TARGET_STEP_RATIO` at no wait to `MAX_STEP_RATIO` once it has waited `FAIR_WAIT_STEPS` such
  steps there, linearly. Under a steady load the wait settles where the prompt tokens per step
  match what arrives (more waiting, more budget), so time to first token stays bounded as
  concurrency grows. A running request's prefill counts too, by its time since it was queued:
  at 1.5x a lone 8k-token prompt beside one stream took three times its time alone on a 2-core
  Zen 4 (simulated with the measured costs, tests/engine/test_scheduler.py), at 2x under twice,
  while the stream's steps stay as even (every one a mixed step of one size; issue 40's bound is
  its p99 inter-token latency within 2x the median). The wait is measured in steps, not seconds, so the
  loop behaves alike on a CPU (~0.1 s a step) and a GPU (~10 ms); the clock is the scheduler's
  own (`clock`, monotonic; a test passes a fake), not the request's `arrival_time`, which a
  client may set and another process stamps. A preempted request waits again from its
  preemption.
The cap, 1.8x, is what keeps p99 inter-token latency within 2x its median (issue 41's bound) when
the steps between bursts are decode-only (the median then is a decode-only step of the load),
with room for the steps that run over their prediction: served, the steps beside decodes ran
10-20% past it (a prompt token's cost read one chunk old), and at a 2x cap p99 / median was
2.25-2.54x at 16 and 64 clients against 1.99-2.11x and 1.63-2.16x at 1.8x, with first tokens no
later (docs/benchmarks-history.md, "Bursts, and a decode-only step measured before a ratio is
taken of it"). 3x admitted a burst a little sooner and broke that bound in the simulated
64-client run (tests/engine/test_scheduler.py, `_closed_loop`). Rejected: an uncapped credit at
all times (vLLM's choice: the whole budget to prompts; its p99 inter-token latency is 10x its
median at 64 clients); admission by a time-to-first-token deadline (a setting users would have to
choose per machine and model).

Three more rules (issue 41, measured on the served start-ups of 16 and 64 clients):
- A wave's first tokens come before its streams' next tokens (`_wave`). A wave begins where
  some request waits for its first token (queued or prefilling) and no decoding stream has a
  cadence yet (`_joins`): each has its first token only (at most `WAVE_JOIN_TOKENS` in a burst)
  and no earlier wave held it; they only went first. Then no ratio applies
  (only the time bound) and the decodes are held: each step's budget goes to the prompts, until
  no request waits for a first token, or no prompt can progress (no seat, adapter slot or
  blocks: the decodes then run, so a wave never stalls), or `MAX_WAVE_HOLD_S` has passed (four
  of the longest steps the engine lets a prompt take: a stream's one gap is no longer). So
  each stream of a wave breaks once, from its first token to the wave's end, and its gaps after
  that are decode steps; the last first token comes as soon as the prompts' work allows. The
  bound is what a burst of chat clients needs whole: 64 prompts of 200 tokens took 8-10 s to
  prefill on 2 Zen 4 cores. Cut short at 8 s (two such steps, the bound before), a wave's last
  prompts trickled in at the ratio's pace beside decoders that then ended at different times, so
  their clients' next requests came one by one into a queue the ratio drains slowly: served to
  64 clients from a fresh server (three runs each, alternating), the p99 first token took 17.9,
  9.2 and 22.1 s and p99 inter-token latency was 2.04x, 2.08x and 1.71x the median; with the
  whole wave held, 8.3, 8.5 and 9.2 s and 1.48x, 1.55x and 1.54x (vLLM-CPU's p99 first token in
  that sitting: 8.3 s; docs/benchmarks.md [wave16]). The streams then decode together and end
  together, and their clients' next requests are the next wave: one gap of each stream's
  `max_tokens`. In a burst (more requests wait for a first token than streams are past their
  first, or the wave is under way) streams of a few tokens join (the rule first held streams of
  one token only; one long prompt beside a young stream is no burst: holding the stream would
  stall it for the whole wave bound):
  served, a burst's first request reaches the core alone (the front end passes 64 requests on
  over ~0.1 s, and a prompt the prefix cache holds is a step of 8 tokens), and in 7 of 12 runs
  of the standard sitting's c64 it had two tokens when the other 63 came: no wave formed, the
  burst was admitted at the ratio's pace, its streams ended apart and every later round
  trickled in the same way; p99 inter-token latency was 2.00-2.43x the median in those runs
  against 1.31-1.50x where the wave formed, and 1.32-1.89x in all nine runs since
  (docs/benchmarks-history.md, "A wave that waits for nobody's second token"). Eight tokens are
  a reply's first line: under a second of decoding on a CPU, on a GPU about what a front end
  takes to pass a burst on. Once held, a stream is not held by a later wave (a stream breaks
  once). Served
  on a 2-core AMX Xeon beside `vllm bench serve`, the p99 first token of 16 clients fell from
  1.81 s to 1.19 s (vLLM-CPU 0.80 s), with p99 inter-token latency 1.86x the median against
  2.61x (docs/benchmarks.md, "A wave's first tokens first"). The rule it replaced let the
  decoders ride in the wave's first full step (a second token) and then applied the ratio to
  the rest of the wave: the prompts trickled in at a ratio's pace for seconds. Letting the
  decoders ride in every step of the wave would break each stream once per step, not once. A
  stream that was decoding before the prompts arrived keeps its ratio however many arrive, and
  streams with a cadence are never held (the first rule of this kind queued decoders with the
  prompts however many tokens they had: 8 clients sending 2,000-token prompts saw each
  stream's cadence broken every round, p99 inter-token latency 12.4x the median simulated,
  tests/engine/test_scheduler.py).
- Only streams have a cadence (`_streams`): a request whose client takes its final output only
  (`FINAL_ONLY`: `LLM.generate`, a completion not streamed) sees no inter-token latency. Beside
  decodes of such requests alone no ratio applies (the time bound does), and a wave holds none
  of them: their decodes ride in its steps. Offline (the peers' 64 x 128 batch) holding them
  cost 3% of throughput against the rule before; riding, level with it.
- A ratio is taken of a measured step: beside decodes, where no decode-only step of at least
  half as many rows has been measured (after a wave, or at a first decode), the step carries no
  prompt tokens, once (`_measuring`; the decodes' drafts still come: only prompts are held
  back), and the ratio then starts from that step. Steps too fast for a ratio
  (`_MIN_STEP_S`) are not held back. After a wave
  the line, pulled by its 2,048-token step, priced the 16-row decode-only step at 47 ms where it
  took 25: the steps beside the last five prompts ran at 2.8x a decode-only one.

Rejected for the ratio itself: a fixed per-step prompt cap (right on one machine and model
only: the cost per token differs by orders of magnitude between a CPU and a GPU); a budget in
seconds from the user (the ratio to the decode step is what inter-token latency percentiles see,
whatever the machine).

A step is bounded by time as well (issue 40), decodes or not: its prompt tokens are cut so that,
at the pace of the latest step that carried a prompt chunk (`StepCost.tokens_within`: that step's
tokens per second, which follows the growing cost per token of a long prompt's later chunks where
the fitted line lags, step_cost.py), the step lasts at most `MAX_PREFILL_STEP_S`, never fewer
than `MIN_PREFILL_CHUNK` tokens. Without it a step carries `max_num_batched_tokens` of a prompt
whatever they cost: on a slow machine and a large model that is minutes, during which no input
is applied and no message leaves the core, and the watchdog (actors/watchdog.py: the core is
heard after every step) cannot tell that step from a hang. With it, no step grows with the
prompt or with the model; a long prompt is more steps, each heard. The first prompt step of an
engine has no pace to go by and takes the whole budget. Rejected: a bound derived from
`engine_output_timeout_s` (the frontend's setting, which the core does not see, and the bound
serves the inputs' latency too); a setting of its own (the steps' length is the engine's
business; `prefill_budget="off"` is the way out).

`prefill_budget="off"` (`--scheduler-prefill-budget off`) gives the whole budget to prompts, with
neither limit, as before; without chunked prefill a prompt is one step whatever it costs.

Finishing (EOS, stop token, length) and aborts free blocks at once. Under a sliding window on
every layer (the block manager's `window`), a request gives back the blocks that fell out of it
as soon as its computed tokens move past them: after each step (`advance`) and after a
prefix-cache hit, before its new blocks are allocated.

Speculative decoding (engine/speculative/): before each schedule the speculator sets how many
draft tokens each running request would have verified (`Request.spec_wanted`). Once the decodes,
the prompt chunks and the admitted requests have their tokens, each scheduled decode gets its
drafts from the budget left, with the KV slots for them (`ScheduledRequest.num_draft`): fewer if
the budget is short, none if the blocks are not free (drafts never preempt), and a prompt is cut
into the same chunks as without speculation.

After the forward pass, `update_from_output` does every request's bookkeeping (vLLM v1's
name): the computed tokens counted (`advance`), the new tokens appended through the stop checks
(`check_stop`) and the grammar, the rejected drafts' slots counted out again (a rollback is a
count: the blocks stay), the logprobs cut to the tokens kept, finished requests freed.

The waiting queue (`waiting_queue.py`) keeps that order with O(1) pops and removals, so a burst
of aborts over a long queue costs O(n), not O(n^2). The running list stays a list: it holds at
most `max_num_seqs` requests. Per-request token-id sets (EOS, stop token ids) are prepared once
when the request is created (`Request.sampling_plan`), not rebuilt each step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from triollm.engine.config import SchedulerConfig
from triollm.engine.request import EngineCoreOutput, FinishReason, Logprobs, RunnerOutput
from triollm.engine.sampling_params import RequestOutputKind
from triollm.engine.scheduling.block_manager import BlockManager
from triollm.engine.scheduling.request_state import Request, RequestStatus
from triollm.engine.scheduling.step_cost import StepCost
from triollm.engine.scheduling.waiting_queue import WaitingQueue

__all__ = [
    "FAIR_WAIT_STEPS",
    "MAX_PREFILL_STEP_S",
    "MAX_STEP_RATIO",
    "MAX_WAVE_HOLD_S",
    "MIN_PREFILL_CHUNK",
    "MIN_PREFILL_STEP_S",
    "TARGET_STEP_RATIO",
    "WAVE_JOIN_TOKENS",
    "ScheduledRequest",
    "Scheduler",
    "SchedulerOutput",
    "SchedulerStats",
]

TARGET_STEP_RATIO = 1.5  # a step beside decodes: at most this many decode-only steps' time
MAX_STEP_RATIO = 1.8  # ... rising to this many while a request waits in the queue
FAIR_WAIT_STEPS = 16  # decode-only steps of waiting that raise the ratio to MAX_STEP_RATIO
MIN_PREFILL_CHUNK = 32  # prompt tokens a step may always take, whatever the cost model says...
# ... but beside decodes no more of them than cost this much (predicted), and at least one: 32
# prompt tokens at 8k of context cost a 0.5B model on 2 cores 0.3 s, eight decode-only steps
# (docs/reliability.md), which a stream beside them sees as its inter-token latency.
MIN_PREFILL_STEP_S = 0.02
# The longest a step carrying prompt tokens should take (seconds, predicted). A step is the unit in
# which the core applies inputs (a new request, an abort, a pause, a utility call) and in which it
# is heard (one message per step; the watchdog's `engine_output_timeout_s` defaults to 60 s), so
# it must stay well inside both what a client waits for an abort or an admission and that
# timeout, with room for a misprediction. Shorter chunks cost one more fixed per-step cost each
# (the weights are read once per step, about a decode-only step's time): at 4 s that is a small
# part of a prompt's time unless a decode-only step takes a large part of a second. On a GPU a
# step of `max_num_batched_tokens` takes far less, and the bound never binds.
MAX_PREFILL_STEP_S = 4.0
MAX_WAVE_HOLD_S = 4 * MAX_PREFILL_STEP_S  # the longest a wave lasts (module note)
WAVE_JOIN_TOKENS = 8  # a stream with at most this many tokens has no cadence yet: a wave may hold it
_MIN_STEP_S = 1e-3  # decode-only steps faster than this: no prefill limit


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    # Tokens [num_computed, num_computed + num_new_tokens) are fed this step: the request's own,
    # then its `num_draft` draft tokens (speculative decoding), which are not its tokens yet.
    num_computed_tokens: int
    num_draft: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # filled by the speculator

    @property
    def samples(self) -> bool:
        """Whether this step ends with a new token sampled for the request (with drafts: with
        the drafts checked and one to several tokens accepted)."""
        return self.num_computed_tokens + self.num_new_tokens - self.num_draft == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_prompt_tokens(self) -> int:
        """The tokens of prompt chunks (and of preempted requests' recomputes): every request's
        own tokens but a decode's one (a decode: one token of its own, drafts aside, sampled)."""
        return sum(
            n for s in self.scheduled if (n := s.num_new_tokens - s.num_draft) > 1 or (n == 1 and not s.samples)
        )

    @property
    def carries_prompt(self) -> bool:
        return self.num_prompt_tokens > 0


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock  # for the waits of fair admission
        self.blocks = block_manager
        self.max_model_len = max_model_len
        self.waiting = WaitingQueue()  # in _order, ties in push order
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.step_cost = StepCost()
        self._measuring = False  # this step was scheduled decode-only to be measured (`_prefill_budget`)
        self._wave_since: float | None = None  # when the wave now under way began (`_wave`)

    # ---------------------------------------------------------------- queue management

    @staticmethod
    def _order(req: Request) -> tuple[int, float]:
        return (req.priority, req.arrival_time)

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        request.waiting_since = self.clock()
        if not request.queued_ts:
            request.queued_ts = request.waiting_since
        self.waiting.push(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a running or waiting request now and free its blocks."""
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.status.finished:
            self.waiting.remove(request)
        request.status = status
        self.blocks.free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def live_requests(self) -> Iterable[Request]:
        return [*self.running, *self.waiting]

    def statistics(self) -> SchedulerStats:
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions)

    # ---------------------------------------------------------------- the step

    def schedule(self) -> SchedulerOutput:
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        # Decodes first: a decode never waits for a prompt chunk. (Copies: preemption removes
        # from self.running while we walk them.)
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens != 1]
        now = self.clock()
        # In a wave the decodes wait while its prompts progress (module note).
        streaming = [r for r in decodes if _streams(r)]
        wave = self._wave(streaming, prefills, now)
        held = streaming if wave else []
        if held:
            decodes = [r for r in decodes if not _streams(r)]
        budget = self._schedule_running(decodes, self.config.max_num_batched_tokens, scheduled, preempted)
        decoded = {id(s.request) for s in scheduled}
        # Without a stream among the decodes no cadence is there to keep: no ratio.
        cadence = any(_streams(s.request) for s in scheduled)
        num_decodes = sum(s.request.status == RequestStatus.RUNNING for s in scheduled)
        load = max(num_decodes, min(self.config.max_num_seqs, len(self.running) + len(self.waiting)))
        wait = max([self._queue_wait(), *(now - r.waiting_since for r in prefills)])
        prefill_budget = self._prefill_budget(num_decodes, budget, wait, load, wave or not cadence)
        # A step held decode-only to be measured keeps its drafts: only prompts are held back.
        draft_room = budget if self._measuring else 0
        budget = self._schedule_running(prefills, prefill_budget, scheduled, preempted)
        # Drop entries of requests preempted after they were scheduled this step.
        scheduled = [s for s in scheduled if s.request.status == RequestStatus.RUNNING]
        if not preempted:
            budget = self._admit_waiting(budget, scheduled)
        if held and all(id(s.request) in decoded for s in scheduled):
            # No prompt could progress (no seat, adapter slot or blocks): the held decode too.
            self._wave_since = None
            budget = self._schedule_running(held, budget, scheduled, preempted)
            # A held decode's blocks may have preempted another scheduled in this step.
            scheduled = [s for s in scheduled if s.request.status == RequestStatus.RUNNING]
        for req in held if self._wave_since is not None else ():
            req.wave_held = self._wave_since  # held by this wave: by no later one
        self._add_drafts(scheduled, budget + draft_room)
        return SchedulerOutput(scheduled, preempted)

    def _add_drafts(self, scheduled: list[ScheduledRequest], budget: int) -> None:
        """Give the scheduled decodes their drafts from the budget the prompts left: drafts are
        optional work, so a prompt's chunks are the same with speculation as without."""
        for item in scheduled:
            req = item.request
            if budget <= 0:
                return
            if not req.spec_wanted or item.num_new_tokens != 1 or req.num_tokens - item.num_computed_tokens != 1:
                continue
            drafts = min(req.spec_wanted, budget)
            if self.blocks.allocate(req, self.blocks.blocks_needed(req, 1 + drafts)):  # never preempts
                item.num_new_tokens += drafts
                item.num_draft = drafts
                budget -= drafts

    def record_step(self, output: SchedulerOutput, seconds: float) -> None:
        """The forward pass of `output` took `seconds` (the engine core times every step): the
        measurements the prefill budget is derived from."""
        prompt = output.num_prompt_tokens
        self.step_cost.observe(output.num_tokens, seconds, prefill=prompt > 0, prompt_tokens=prompt)

    def _wave(self, decodes: list[Request], prefills: list[Request], now: float) -> bool:
        """Whether this step is in a wave (module note): some request waits for its first token
        (queued or prefilling) and no decoding stream (`decodes`: those whose tokens a client
        sees as they come) has a cadence yet (`_joins`), for `MAX_WAVE_HOLD_S` at most from the
        wave's first step."""
        # Requests waiting for a first token (queued or prefilling). A burst, where they outnumber
        # the streams past their first token (or the wave it began is under way), holds streams
        # of a few tokens too (`_joins`); one long prompt beside a young stream does not.
        firsts = sum(not r.output_token_ids for r in prefills) + sum(not r.output_token_ids for r in self.waiting)
        burst = self._wave_since is not None or firsts > sum(len(r.output_token_ids) > 1 for r in decodes)
        if not self._budget_auto or not decodes or not all(self._joins(r, burst) for r in decodes):
            self._wave_since = None
            return False
        if self._wave_since is None and firsts:
            self._wave_since = now
        if self._wave_since is not None and (not firsts or now - self._wave_since >= MAX_WAVE_HOLD_S):
            self._wave_since = None
        return self._wave_since is not None

    def _joins(self, req: Request, burst: bool) -> bool:
        """Whether a wave may hold decoding stream `req`: it has no cadence yet (its first token
        only, or in a `burst` at most `WAVE_JOIN_TOKENS` tokens) and no earlier wave held it
        (once a stream at most)."""
        most = WAVE_JOIN_TOKENS if burst else 1
        return len(req.output_token_ids) <= most and req.wave_held in (None, self._wave_since)

    @property
    def _budget_auto(self) -> bool:
        """Whether the prefill budget's limits and waves apply (`prefill_budget="auto"` with
        chunked prefill; without either a prompt takes what the step's budget allows)."""
        return self.config.prefill_budget == "auto" and self.config.enable_chunked_prefill

    def _queue_wait(self) -> float:
        """Seconds the head of the waiting queue has waited there (since its preemption, for
        one preempted); 0 with none waiting."""
        return self.clock() - self.waiting.peek().waiting_since if self.waiting else 0.0

    def _prefill_budget(self, num_decodes: int, budget: int, wait: float, load: int, wave: bool = False) -> int:
        """The prompt tokens this step may take beside `num_decodes` decodes, of `budget` left:
        what keeps the step within `MAX_PREFILL_STEP_S` and, beside decodes, within a ratio of
        the decode-only step of `load` rows (the requests running and waiting, up to
        `max_num_seqs`: the batch the load will decode at), `TARGET_STEP_RATIO` rising to
        `MAX_STEP_RATIO` as the queue's head's `wait` grows to `FAIR_WAIT_STEPS` such steps; at
        least `MIN_PREFILL_CHUNK`. In a `wave` no ratio applies; beside decodes whose size no
        decode-only step measured (at least half as many rows), none this once (module note)."""
        if not self._budget_auto:
            return budget
        limits: list[int] = []
        floor = MIN_PREFILL_CHUNK
        by_time = self.step_cost.tokens_within(MAX_PREFILL_STEP_S)
        if by_time is not None:
            limits.append(by_time - num_decodes)
        fit = self.step_cost.line()
        cost = self.step_cost
        decode_step = 0.0 if wave or not num_decodes or fit is None else cost.decode_seconds(load, fit)
        unmeasured = cost.latest_decode is None or 2 * cost.latest_decode[0] < num_decodes
        self._measuring = decode_step >= _MIN_STEP_S and unmeasured and not self._measuring
        if self._measuring:
            return 0  # a decode-only step of this size, measured before a ratio is taken of one
        if decode_step >= _MIN_STEP_S:
            assert fit is not None
            ratio = TARGET_STEP_RATIO + (MAX_STEP_RATIO - TARGET_STEP_RATIO) * min(
                1.0, wait / (FAIR_WAIT_STEPS * decode_step)
            )
            step = ratio * decode_step  # = the decodes' step + the prompt tokens' cost
            per_token = cost.prompt_token_seconds(fit)
            limits.append(int((step - cost.decode_seconds(num_decodes, fit)) / per_token))
            floor = max(1, min(MIN_PREFILL_CHUNK, int(MIN_PREFILL_STEP_S / per_token)))
        if not limits:
            return budget
        return min(budget, max(floor, min(limits)))

    def _schedule_running(
        self, reqs: list[Request], budget: int, scheduled: list[ScheduledRequest], preempted: list[Request]
    ) -> int:
        """Schedule running `reqs` in order within `budget`, preempting for KV blocks; returns
        the budget left."""
        for req in reqs:
            if req.status != RequestStatus.RUNNING or budget == 0:
                continue
            n = _whole_images(req, min(self._chunk(req), budget), self._hard_left(scheduled))
            if n == 0:
                continue
            while not self.blocks.allocate(req, self.blocks.blocks_needed(req, n)):
                victim = self._pick_victim()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
            budget = max(0, budget - n)  # a whole image may pass the (prefill) budget
        return budget

    def _hard_left(self, scheduled: list[ScheduledRequest]) -> int:
        """The step's tokens not yet scheduled, of max_num_batched_tokens."""
        return self.config.max_num_batched_tokens - sum(s.num_new_tokens for s in scheduled)

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledRequest]) -> int:
        loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        skipped: list[Request] = []  # waiting for an adapter slot: back in the queue after
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.peek()
            lora = req.lora_request
            if lora is not None and lora.lora_int_id not in loras and len(loras) >= self.config.max_loras:
                skipped.append(self.waiting.pop())
                if len(skipped) < self.config.max_num_seqs:
                    continue
                break
            fresh = not req.block_ids
            if fresh:
                cached = self.blocks.match_prefix(req)
                req.num_computed_tokens = cached
                self.blocks.release_out_of_window(req)
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = cached
            n = self._chunk(req)
            if n > budget and not self.config.enable_chunked_prefill:
                self._undo_admission(req, fresh)
                break
            n = _whole_images(req, min(n, budget), self._hard_left(scheduled))
            if n == 0 or not self.blocks.allocate(req, self.blocks.blocks_needed(req, n)):
                self._undo_admission(req, fresh)
                break
            self.waiting.pop()
            req.status = RequestStatus.RUNNING
            if not req.scheduled_ts:  # a preempted request keeps its first
                req.scheduled_ts = self.clock()
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, n, req.num_computed_tokens))
            budget = max(0, budget - n)
            if lora is not None:
                loras.add(lora.lora_int_id)
        for req in reversed(skipped):
            self.waiting.push(req)
        return budget

    def _chunk(self, req: Request) -> int:
        """Tokens the request would take this step before the budget: all it has left, or at
        most `long_prefill_token_threshold` of a prompt (vLLM's rule; decodes take 1)."""
        n = req.num_tokens - req.num_computed_tokens
        limit = self.config.long_prefill_token_threshold
        return limit if 0 < limit < n and self.config.enable_chunked_prefill else n

    def _undo_admission(self, req: Request, fresh: bool) -> None:
        if fresh:
            self.blocks.free(req)
            req.num_computed_tokens = 0

    def _pick_victim(self) -> Request:
        # The running request that would be admitted last: lowest priority, latest arrival.
        return max(self.running, key=self._order)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req)
        req.num_computed_tokens = 0
        req.draft_computed = 0  # the draft model's K/V lived in those blocks too
        req.num_preemptions += 1
        req.preemptions_unsent += 1
        self.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        req.waiting_since = self.clock()
        # Front of its priority class: it arrived before anything still waiting there.
        self.waiting.push(req)

    # ---------------------------------------------------------------- after the forward pass

    def update_from_output(
        self, output: SchedulerOutput, result: RunnerOutput
    ) -> list[EngineCoreOutput]:
        """After the forward pass of `output`: each scheduled request's tokens are counted
        computed, its new tokens appended through the stop checks (with drafts: the accepted
        ones and the model's own token one by one, a stop dropping those after it), its grammar
        advanced, its rejected drafts rolled back and its logprobs cut to the tokens it keeps.
        A request that finished leaves with its blocks freed. Returns the outputs of the
        requests that advanced (a prompt chunk yields one only with prompt logprobs)."""
        outputs = []
        for item in output.scheduled:
            out = self._update(item, result)
            if out is not None:
                req = item.request
                if not req.times_sent:  # the first output carries the queue stamps
                    out.queued_ts, out.scheduled_ts, req.times_sent = req.queued_ts, req.scheduled_ts, True
                if req.preemptions_unsent:
                    out.num_preemptions, req.preemptions_unsent = req.preemptions_unsent, 0
                outputs.append(out)
        return outputs

    def _update(self, item: ScheduledRequest, result: RunnerOutput) -> EngineCoreOutput | None:
        req = item.request
        rid = req.request_id
        # With drafts, the accepted ones and the target's own token are appended before
        # `advance` (the accepted drafts' K/V is computed); a plain step advances first.
        drafted = result.spec_tokens.get(rid) if item.num_draft else None
        if drafted is None:
            self.advance(item)
        prompt_lps = result.prompt_logprobs.get(rid)
        if not item.samples:
            if prompt_lps is None:
                return None
            return EngineCoreOutput(rid, [], new_prompt_logprobs=prompt_lps)
        tokens = [result.sampled[rid]] if drafted is None else list(drafted)
        grammar = req.grammar
        if grammar is not None and not grammar.consume_token(tokens[0]):
            # The grammar failed (llguidance raised, or it allows no token the other
            # constraints do): this request alone ends, without the token.
            self.finish(req, RequestStatus.FINISHED_ABORTED)
            reason = f"structured_outputs: {grammar.error}"[:2000]
            return EngineCoreOutput(
                rid, [], finish_reason=FinishReason.ERROR, stop_reason=reason,
                new_prompt_logprobs=prompt_lps,
            )
        status = None
        for n, token in enumerate(tokens, 1):  # a stop among them drops the tokens after it
            req.append_output_token(token)
            status = self.check_stop(req, token)
            if status is None and grammar is not None and grammar.is_stopped():
                status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
            if status is not None:
                del tokens[n:]
                break
        if drafted is not None:  # computed: every token kept but the last; the rest roll back
            self.advance(item, num_rejected=item.num_new_tokens - len(tokens))
            req.draft_computed = min(req.draft_computed, req.num_computed_tokens)
        if status is not None:
            self.finish(req, status)
        lps = result.logprobs.get(rid)
        if lps is not None and len(lps.token_ids) > len(tokens):
            n = len(tokens)
            lps = Logprobs(lps.token_ids[:n], lps.logprobs[:n], lps.ranks[:n])
        return EngineCoreOutput(
            rid,
            tokens,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            new_logprobs=lps,
            new_prompt_logprobs=prompt_lps,
            num_cached_tokens=max(req.num_cached_tokens, 0),
        )

    def advance(self, item: ScheduledRequest, num_rejected: int = 0) -> None:
        """Mark the scheduled tokens computed (call for every scheduled request after the
        forward pass, before appending the sampled tokens). Of a step with drafts, the last
        `num_rejected` drafts were rejected: their K/V slots hold no token of the request and are
        overwritten by the next step's (a rollback is this count: the blocks stay)."""
        req = item.request
        req.num_computed_tokens = item.num_computed_tokens + item.num_new_tokens - num_rejected
        self.blocks.cache_full_blocks(req)  # first: a block hashed before release stays reusable
        self.blocks.release_out_of_window(req)

    def check_stop(self, req: Request, token_id: int) -> RequestStatus | None:
        """After token_id was appended to req: the finished status, or None to go on."""
        params, plan = req.sampling_params, req.sampling_plan
        if req.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in plan.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in plan.stop_token_ids:
                req.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _streams(req: Request) -> bool:
    """Whether a client sees the request's tokens as they come (a cadence to keep): not where
    it asked for its final output only (`LLM.generate`, a non-streamed completion)."""
    return req.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY


def _whole_images(req: Request, n: int, budget: int) -> int:
    """`n` tokens from the request's next one, or another count so that no image whose positions
    attend to each other both ways (Gemma 3) is cut across prefill chunks: a chunk that would end
    inside one ends before it, or takes the rest of it (more than `n`: past the prefill budget,
    which would otherwise hold it back for as long as decodes keep that budget small) if the
    chunk starts in or at it and `budget`, the step's tokens left, allows (0: not this step)."""
    c = req.num_computed_tokens
    for f in req.images:
        first, end = f.offset, f.offset + f.length
        if f.bidirectional and first < c + n < end:
            if first > c:
                return first - c
            return end - c if end - c <= budget else 0
    return n
