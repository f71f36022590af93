"""`triollm bench latency`: batch-1 decode time per token against the memory-bandwidth floor (weight bytes /
measured copy bandwidth), on one of four prompts (`--workload`): random token ids (`ignore_eos`,
the pure decode cost), or a chat-templated request whose output copies its prompt to a degree
that speculative decoding feeds on: `code` (rename a function in a ~55-line snippet: the output
is mostly the prompt, n-gram lookup's best case), `summary` (quote a passage's key sentences:
partly copied) and `text` (a short story: nothing to copy, speculation's worst case). The text
workloads run greedy to EOS or `--output-len`, and report the tokens actually produced.

Time per token is measured per request, not per step, because a speculating step emits several
tokens: (time of the last output - time of the first) / (tokens after the first). TTFT and the
median step time are printed beside it, and, from the core's cumulative `statistics()` counters
(read before and after, so the warm-up does not count), the drafts, draft tokens, accepted
tokens and mean acceptance length (1 + accepted / drafts). `--repeat` runs the request again
after one warm-up run and takes the median (the repeats find the prompt in the prefix cache:
their TTFT is a cached one, the warm-up's the cold one; `--no-enable-prefix-caching` makes every
run a cold prefill). Prefill speed is prompt tokens / TTFT. A prompt plus `--output-len` longer
than max_model_len is refused (the engine would stop the request at max_model_len, with fewer
tokens than asked); `--max-model-len` raises it, beyond the model's own if need be.

`--baseline` then builds a second engine from the same flags without `speculative_config` (after
freeing the first: two engines would share the memory and the cores) and prints the ratio of the
times per token and whether the two greedy outputs agree token for token: speculation must not
change a greedy output. `--dump-prompts` writes the three text prompts' token ids for
docs/bench/llamacpp_lookup.py, which times llama.cpp's prompt-lookup decoding on exactly the same
tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from typing import Any

import msgspec
import torch

from triollm import EngineArgs
from triollm.engine.core_protocol import SpecDecodingStats  # Not public: the core's counters

__all__ = ["add_latency_parser", "latency_prompt_ids", "measure_bandwidth", "run_latency"]


def add_latency_parser(kinds: Any) -> None:
    lat = kinds.add_parser("latency", help="batch-1 decode latency vs the memory-bandwidth floor")
    lat.add_argument(
        "--workload",
        choices=LATENCY_WORKLOADS,
        default="random",
        help=(
            "random token ids (ignore_eos), or a chat prompt whose output copies it: code (mostly), summary (partly), "
            "text (not at all) (default: %(default)s)"
        ),
    )
    lat.add_argument(
        "--input-len", type=int, default=32, help="prompt tokens of the random workload (default: %(default)s)"
    )
    lat.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="output tokens (the text workloads: at most, they stop at EOS) (default: %(default)s)",
    )
    lat.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="timed runs after one warm-up; the median is reported (default: %(default)s)",
    )
    lat.add_argument(
        "--baseline",
        action="store_true",
        help="also run an engine built from the same flags without speculative_config, and compare",
    )
    lat.add_argument("--output-json", default=None, help="write the results here")
    lat.add_argument(
        "--dump-prompts",
        default=None,
        metavar="PATH",
        help=(
            "write {workload: token_ids} of the code, summary and text prompts as JSON and exit (for "
            "docs/bench/llamacpp_lookup.py)"
        ),
    )
    EngineArgs.add_cli_args(lat)
    lat.set_defaults(func=run_latency)


def measure_bandwidth(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """Copy bandwidth in bytes/s (read + write counted) on preallocated buffers."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * nbytes / best


# --- latency ------------------------------------------------------------------------------------

LATENCY_WORKLOADS = ("random", "code", "summary", "text")
TEXT_LATENCY_WORKLOADS = LATENCY_WORKLOADS[1:]

# The code workload's snippet: realistic, self-contained, and naming the function to rename in
# its definition, its callers and a docstring, so a faithful rewrite copies all but a few tokens.
CODE_SNIPPET = '''\
import time
from collections import deque


def parse_rate(spec):
    """Parse a rate such as "10/s", "300/min" or "5000/h" into (count, seconds)."""
    count, _, unit = spec.partition("/")
    seconds = {"s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}.get(unit.strip())
    if seconds is None:
        raise ValueError(f"unknown rate unit in {spec!r}")
    if int(count) <= 0:
        raise ValueError(f"the count in {spec!r} must be positive")
    return int(count), seconds


class SlidingWindowLimiter:
    """At most `count` events per window and key; parse_rate reads the spec."""

    def __init__(self, spec, clock=time.monotonic):
        self.count, self.window = parse_rate(spec)
        self.clock = clock
        self.events = {}

    def _prune(self, key, now):
        q = self.events.setdefault(key, deque())
        while q and now - q[0] >= self.window:
            q.popleft()
        return q

    def allow(self, key):
        now = self.clock()
        q = self._prune(key, now)
        if len(q) >= self.count:
            return False
        q.append(now)
        return True

    def retry_after(self, key):
        now = self.clock()
        q = self._prune(key, now)
        if len(q) < self.count:
            return 0.0
        return self.window - (now - q[0])

    def reset(self, key=None):
        if key is None:
            self.events.clear()
        else:
            self.events.pop(key, None)


def limiters_from_config(config):
    """One limiter per route from {"route": "10/s", ...}; "off" disables a route."""
    limiters = {}
    for route, spec in config.items():
        if spec in (None, "", "off"):
            continue
        parse_rate(spec)  # fail early, naming the bad spec
        limiters[route] = SlidingWindowLimiter(spec)
    return limiters
'''

SUMMARY_PASSAGE = (
    "For most of the eighteenth century, a ship out of sight of land knew its latitude but not its "
    "longitude. Latitude could be read from the height of the sun at noon; longitude needed the time "
    "at a home port, because every hour of difference between local noon and home noon meant fifteen "
    "degrees east or west. Pendulum clocks lost their rhythm on a rolling deck, and the best marine "
    "timekeepers drifted by minutes a day, an error of more than a hundred miles after a few weeks at "
    "sea. Wrecks such as the loss of four warships off the Scilly Isles in 1707 made the problem a "
    "matter of state. In 1714 the British Parliament offered a prize of twenty thousand pounds for a "
    "method that found longitude to within half a degree. The astronomers favoured the lunar distance "
    "method, which read the time from the moon's position among the stars but demanded hours of "
    "calculation. John Harrison, a carpenter from Lincolnshire with no formal training, bet instead on "
    "a clock. His first three machines were large, brass and ingenious: they used counter-swinging "
    "balances, grasshopper escapements that needed no oil, and bimetallic strips that cancelled the "
    "effect of heat. Each took years and none quite met the terms. His fourth, finished in 1759, looked "
    "like an oversized pocket watch. On a voyage to Jamaica in 1761 it lost only five seconds in more "
    "than two months, well within the prize's limit. The Board of Longitude, dominated by astronomers, "
    "doubted the result, demanded further trials and asked Harrison to surrender his designs. Only in "
    "1773, after the king himself intervened, did Parliament pay him most of the money. Within a few "
    "decades the chronometer, cheaper and made by many workshops, became standard equipment, and "
    "navigators could at last fix their position at sea with a glance at a dial."
)

_LATENCY_CHATS = {
    "code": (
        f"```python\n{CODE_SNIPPET}```\n\n"
        "Rewrite this code with the function `parse_rate` renamed to `parse_rate_spec`; output only the code."
    ),
    "summary": f"{SUMMARY_PASSAGE}\n\nSummarise this passage, quoting its key sentences.",
    "text": "Write a short story about a lighthouse keeper.",
}


def latency_prompt_ids(workload: str, tokenizer: Any) -> list[int]:
    """A text workload's chat-templated prompt, rendered as the engine renders chats."""
    return list(tokenizer.render_chat([{"role": "user", "content": _LATENCY_CHATS[workload]}]).token_ids)


def _latency_request(ns: argparse.Namespace, engine: Any) -> tuple[list[int], Any]:
    from triollm import SamplingParams

    if ns.workload == "random":
        rng = random.Random(0)
        top = min(1000, engine.config.model.vocab_size)  # a tiny test model has a few hundred ids
        ids = [rng.randrange(top) for _ in range(ns.input_len)]
        return ids, SamplingParams(max_tokens=ns.output_len, ignore_eos=True, temperature=0.0)
    ids = latency_prompt_ids(ns.workload, engine.tokenizer)
    return ids, SamplingParams(max_tokens=ns.output_len, temperature=0.0)


def _spec_counters(engine: Any) -> SpecDecodingStats:
    """The core's cumulative speculation counters (zeros without speculation)."""
    return engine.core.statistics().spec or SpecDecodingStats()


def _latency_once(engine: Any, ids: list[int], params: Any) -> dict[str, Any]:
    """One request alone, stepped by hand: the time of each step, and of each step whose output
    brought new tokens (with the running count, since a speculating step brings several)."""
    engine.add_request({"prompt_token_ids": ids}, params)
    steps: list[float] = []
    stamps: list[tuple[float, int, int]] = []  # (time, tokens so far, step index)
    token_ids: list[int] = []
    start = last = time.perf_counter()
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        steps.append(now - last)
        last = now
        for out in outs:  # cumulative outputs: the latest holds every token so far
            token_ids = list(out.outputs[0].token_ids)
            if len(token_ids) > (stamps[-1][1] if stamps else 0):
                stamps.append((now, len(token_ids), len(steps) - 1))
    if not stamps:
        raise RuntimeError("bench latency: the request finished without producing a token")
    (t0, n0, i0), (t1, n1, i1) = stamps[0], stamps[-1]
    decode_steps = steps[i0 + 1 : i1 + 1]  # the steps after the first token up to the last
    return {
        "ttft_ms": (t0 - start) * 1e3,
        "prefill_tok_per_s": len(ids) / (t0 - start),
        "ms_per_token": (t1 - t0) / (n1 - n0) * 1e3 if n1 > n0 else None,
        "step_ms_median": statistics.median(decode_steps) * 1e3 if decode_steps else None,
        "decode_steps": len(decode_steps),
        "output_tokens": n1,
        "token_ids": token_ids,
    }


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _measure_latency(engine: Any, ids: list[int], params: Any, repeat: int) -> dict[str, Any]:
    """One warm-up run (reported apart), then `repeat` timed runs: their medians, the
    speculation counters over the timed runs, and the last run's tokens."""
    warmup = _latency_once(engine, ids, params)
    before = _spec_counters(engine)
    runs = [_latency_once(engine, ids, params) for _ in range(repeat)]
    spec = _spec_counters(engine).since(before)
    return {
        "ttft_ms": _median([r["ttft_ms"] for r in runs]),
        "prefill_tok_per_s": _median([r["prefill_tok_per_s"] for r in runs]),
        "ms_per_token": _median([r["ms_per_token"] for r in runs]),
        "step_ms_median": _median([r["step_ms_median"] for r in runs]),
        "output_tokens": runs[-1]["output_tokens"],
        "token_ids": runs[-1]["token_ids"],
        # Greedy: every run, the warm-up included, must give the same tokens.
        "repeats_identical": all(r["token_ids"] == warmup["token_ids"] for r in runs),
        "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in runs],
        "warmup": {k: v for k, v in warmup.items() if k != "token_ids"},
        "spec": {
            **msgspec.structs.asdict(spec), "accepted_per_pos": list(spec.accepted_per_pos),
            "acceptance_rate": spec.acceptance_rate,
            "mean_acceptance_length": spec.mean_acceptance_length,
        },
    }  # fmt: skip


def _weight_bytes(engine: Any) -> int:
    """The bytes a decode step must read: every parameter once (a tied embedding, read as the
    lm_head, counted once; the rows looked up are negligible), and quantized weights' blocks
    (buffers: codes, scales, offsets)."""
    model = engine.core.model
    assert model is not None  # built from EngineArgs: always a real model
    tensors = [*model.parameters(), *model.buffers()]
    return sum(int(p.numel()) * p.element_size() for p in tensors)


def _ms(value: float | None, unit: str = "ms") -> str:
    return "n/a" if value is None else f"{value:.1f} {unit}"


def _print_latency(name: str, res: dict[str, Any], floor_ms: float | None, speculates: bool) -> None:
    w, per = res["warmup"], res["ms_per_token"]
    rate = f" ({1e3 / per:.1f} tok/s)" if per else ""
    vs_floor = f", {per / floor_ms:.2f}x the floor" if per and floor_ms else ""
    print(f"{name}: warm-up TTFT {_ms(w['ttft_ms'])} (prefill {w['prefill_tok_per_s']:.0f} tok/s), "
          f"{_ms(w['ms_per_token'], 'ms/token')}")  # fmt: skip
    same = "" if res["repeats_identical"] else "; the runs gave DIFFERENT tokens"
    print(f"{name}: TTFT {_ms(res['ttft_ms'])} (prefill {res['prefill_tok_per_s']:.0f} tok/s), "
          f"decode {_ms(per, 'ms/token')}{rate}{vs_floor}, "
          f"median step {_ms(res['step_ms_median'])}, {res['output_tokens']} output tokens "
          f"(median of {len(res['runs'])}{same})")  # fmt: skip
    sp = res["spec"]
    if speculates or sp["num_drafts"]:
        length = sp["mean_acceptance_length"]
        rate_s = "n/a" if sp["acceptance_rate"] is None else f"{sp['acceptance_rate']:.0%}"
        length_s = "n/a" if length is None else f"{length:.2f}"
        print(f"{name}: speculation: {sp['num_drafts']} drafts, {sp['num_draft_tokens']} draft tokens, "
              f"{sp['num_accepted_tokens']} accepted ({rate_s}), mean acceptance length "
              f"{length_s}, accepted by position {sp['accepted_per_pos']}")  # fmt: skip


def _first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists differ (the shorter's length if one is a
    prefix of the other), None if they are equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _dump_prompts(args: EngineArgs, path: str) -> int:
    # Not public: the engine's chat rendering, without loading the model (LLM.get_tokenizer).
    from triollm.engine.processing.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(args.create_engine_config().tokenizer)
    prompts = {w: latency_prompt_ids(w, tokenizer) for w in TEXT_LATENCY_WORKLOADS}
    with open(path, "w") as f:
        json.dump(prompts, f)
    print(f"wrote {path}: " + ", ".join(f"{w} {len(ids)} tokens" for w, ids in prompts.items()))
    return 0


def _check_fits(prompt_len: int, ns: argparse.Namespace, max_model_len: int) -> None:
    """Refuse a request the engine would cut short at max_model_len (it would finish with fewer
    output tokens than asked and time another decode length than the one printed)."""
    if prompt_len + ns.output_len > max_model_len:
        what = "--input-len" if ns.workload == "random" else f"the {ns.workload} prompt ({prompt_len} tokens)"
        raise ValueError(
            f"{what} + --output-len: {prompt_len} + {ns.output_len} tokens exceed max_model_len "
            f"({max_model_len}); pass --max-model-len {prompt_len + ns.output_len} or shorten them"
        )


def run_latency(ns: argparse.Namespace) -> int:
    # Not LLM: it times each engine step and reads the core's counters and weights.
    from triollm.engine.sync_engine import SyncEngine

    for flag, value in (("--repeat", ns.repeat), ("--input-len", ns.input_len), ("--output-len", ns.output_len)):
        if value < 1:
            raise ValueError(f"{flag}: must be at least 1, got {value}")
    args = EngineArgs.from_cli_args(ns)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    if ns.dump_prompts:
        return _dump_prompts(args, ns.dump_prompts)
    speculates = args.speculative_config is not None
    engine = SyncEngine.from_engine_args(args)
    ids, params = _latency_request(ns, engine)
    _check_fits(len(ids), ns, engine.config.model.max_model_len)
    weight_bytes = _weight_bytes(engine)
    bw = measure_bandwidth()
    floor_ms = weight_bytes / bw * 1e3
    print(f"model {engine.config.model.path}, workload {ns.workload}: prompt {len(ids)} tokens, "
          f"output {'' if ns.workload == 'random' else 'at most '}{ns.output_len} tokens, greedy")  # fmt: skip
    print(
        f"threads {torch.get_num_threads()}, weights {weight_bytes / 1e6:.0f} MB, copy bandwidth {bw / 1e9:.1f} GB/s, "
        f"floor {floor_ms:.1f} ms/token"
    )
    res: dict[str, Any] = {
        "workload": ns.workload, "prompt_tokens": len(ids), "max_tokens": ns.output_len,
        "threads": torch.get_num_threads(), "weight_bytes": weight_bytes, "bandwidth_bytes_per_s": bw,
        "floor_ms_per_token": floor_ms, "speculative_config": args.speculative_config,
    }  # fmt: skip
    res["triollm"] = _measure_latency(engine, ids, params, ns.repeat)
    _print_latency("triollm", res["triollm"], floor_ms, speculates)
    if ns.baseline:
        # Free the first engine before building the second: both would hold weights and KV.
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        plain = EngineArgs.from_cli_args(argparse.Namespace(**{**vars(ns), "speculative_config": None}))
        engine = SyncEngine.from_engine_args(plain)
        res["baseline"] = base = _measure_latency(engine, ids, params, ns.repeat)
        _print_latency("baseline", base, floor_ms, False)
        ours, theirs = res["triollm"]["ms_per_token"], base["ms_per_token"]
        res["ratio_ms_per_token"] = ours / theirs if ours and theirs else None
        diff = _first_difference(res["triollm"]["token_ids"], base["token_ids"])
        res["outputs_identical"] = diff is None
        note = "" if speculates else " (no speculative_config: the same engine twice)"
        ratio = "n/a" if res["ratio_ms_per_token"] is None else f"{res['ratio_ms_per_token']:.2f}x"
        same = "yes" if diff is None else f"NO, they differ from output token {diff}"
        print(
            f"ratio {ratio} time per token (with / without speculation){note}; outputs identical token for token: "
            f"{same}"
        )
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return 0
