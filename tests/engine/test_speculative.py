"""Speculative decoding (engine/speculative/): the config's checks, the n-gram lookup, the
sampler's draft check, and end to end on real models: greedy output identical to plain
decoding, and sampled output distributed exactly as the target's (chi-square)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from scipy.stats import chi2

from triollm.engine.config import EngineArgs
from triollm.engine.core import EngineCore
from triollm.engine.envs import BATCH_INVARIANT_ENV
from triollm.engine.execution.model_runner import ModelRunner
from triollm.engine.execution.sampler import SamplingRow, verify
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.speculative import NgramIndex
from triollm.engine.sync_engine import SyncEngine
from triollm.kernels import allocate_kv_cache
from triollm.kernels.quant import tiles_available

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}

CODE = '''def mean(values):
    """The arithmetic mean of values."""
    total = 0.0
    for value in values:
        total += value
    return total / len(values)


def variance(values):
    m = mean(values)
    return mean([(value - m) ** 2 for value in values])
'''


# ------------------------------------------------------------------ the config


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": -2}, "num_speculative_tokens"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key 'lookahead'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.quantization"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "quantization": "q2"},
            "speculative_config.quantization",
        ),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "quantization": "int4", "prompt_lookup_max": 2},
            "prompt_lookup_max",
        ),
    ],
)
def test_bad_configs_are_value_errors_naming_the_field(tiny_model_dir: Path, spec: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineArgs(model=str(tiny_model_dir), speculative_config=spec).create_engine_config()


def test_draft_with_another_vocabulary_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "other-vocab"
    shutil.copytree(tiny_model_dir, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["vocab_size"] += 16
    (other / "config.json").write_text(json.dumps(cfg))
    args = EngineArgs(model=str(tiny_model_dir), speculative_config={"model": str(other), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's vocabulary"):
        args.create_engine_config()


def test_config_defaults_follow_vllm(tiny_model_dir: Path) -> None:
    spec = (
        EngineArgs(model=str(tiny_model_dir), speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        .create_engine_config()
        .speculative
    )
    assert spec is not None and (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 5, 5)
    assert spec.disable_by_batch_size == 8  # triollm's measured default (vLLM: never)
    never = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}
    assert (
        EngineArgs(model=str(tiny_model_dir), speculative_config=never)
        .create_engine_config()
        .speculative.disable_by_batch_size
        is None
    )  # type: ignore[union-attr]
    spec = (
        EngineArgs(
            model=str(tiny_model_dir),
            speculative_config={"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
        )
        .create_engine_config()
        .speculative
    )
    assert spec is not None and (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 4, 4)
    spec = (
        EngineArgs(model=str(tiny_model_dir), speculative_config={"num_speculative_tokens": 2, "quantization": "int4"})
        .create_engine_config()
        .speculative
    )
    assert (
        spec is not None
        and spec.method == "draft_model"
        and spec.draft is not None
        and spec.draft.quantization == "int4"
    )


def test_cli_takes_json(tiny_model_dir: Path) -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["--model", str(tiny_model_dir), "--speculative-config", json.dumps(NGRAM)])
    assert EngineArgs.from_cli_args(ns).speculative_config == NGRAM


# ------------------------------------------------------------------ the n-gram lookup


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    index = NgramIndex(1, 3)
    #             0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 5, 6, 7]
    # tail (5, 6, 7) matches at 0..2 (followed by 8); the shorter (6, 7) also at 5..6 (then 9):
    # the longest match wins.
    assert index.propose(tokens, 3) == [8, 1, 6]
    tokens += [3]  # tail (7, 3): no match of 2; (3,): none
    assert index.propose(tokens, 3) == []
    tokens += [6, 7]  # tail (3, 6, 7) no; (6, 7) latest at 9..10 (then 3)
    assert index.propose(tokens, 2) == [3, 6]
    assert index.propose([1], 4) == []  # nothing before the tail


def test_ngram_index_is_incremental_and_equals_a_rebuilt_one() -> None:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 6, (300,), generator=g).tolist()
    live = NgramIndex(2, 4)
    for n in range(2, len(tokens)):
        assert live.propose(tokens[:n], 5) == NgramIndex(2, 4).propose(tokens[:n], 5)


# ------------------------------------------------------------------ the sampler's check


def _row(output: list[int] | None = None, **params: Any) -> SamplingRow:
    return SamplingRow(SamplingParams(**params), [], output or [], [], [])


def test_greedy_check_accepts_the_argmax_only() -> None:
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    tokens, accepted = verify(logits, [_row(temperature=0.0)] * 3, [1, 2, -1])
    assert tokens.tolist() == [1, 0, 2] and accepted == [True, False, False]


@pytest.mark.parametrize(
    "params", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 3}, {"temperature": 1.3, "top_p": 0.8}]
)
def test_sampled_check_keeps_the_target_distribution(params: dict[str, Any]) -> None:
    """Row by row the emitted token (draft or residual sample) is distributed as p, whatever
    the draft: chi-square goodness of fit on 20000 rows, fixed seeds."""
    torch.manual_seed(0)
    vocab, n = 6, 20000
    logits = torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.5])
    probs = _target(logits, params)
    for draft in (2, 3, 4):  # the likeliest token, an unlikely one, a middling one (or excluded)
        tokens, accepted = verify(logits.expand(n, -1).clone(), [_row(**params)] * n, [draft] * n)
        counts = torch.bincount(tokens, minlength=vocab).double()
        seen = probs > 0
        assert counts[~seen].sum() == 0, "a token outside top-k/top-p was emitted"
        expected = probs[seen] * n
        stat = float(((counts[seen] - expected) ** 2 / expected).sum())
        assert stat < chi2.ppf(0.999, int(seen.sum()) - 1), (draft, counts.tolist(), (probs * n).tolist())
        rate = sum(accepted) / n
        assert abs(rate - float(probs[draft])) < 0.02  # accepted with probability p(draft)


def _target(logits: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    scaled = logits / params["temperature"]
    if "top_k" in params:
        kth = scaled.topk(params["top_k"]).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    p = scaled.softmax(-1)
    if "top_p" in params:
        order = p.argsort(descending=True)
        before = p[order].cumsum(0) - p[order]
        drop = order[before >= params["top_p"]]
        p[drop] = 0
        p = p / p.sum()
    return p.double()


def test_seeded_check_repeats() -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    runs = [verify(logits.clone(), [_row(temperature=1.0, seed=7)] * 4, [3, 9, 11, -1]) for _ in range(2)]
    assert runs[0][0].tolist() == runs[1][0].tolist() and runs[0][1] == runs[1][1]


# ------------------------------------------------------------------ sampled, end to end


class MarkovLM(torch.nn.Module):
    """A model whose next-token distribution is a known Markov chain over tokens 0..5 (the rest of
    the vocabulary -inf): the target distribution is exact, so the emitted transitions can be
    tested against it. It runs in the real ModelRunner, sampler, core and scheduler."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        table = torch.full((vocab, vocab), float("-inf"))
        table[:6, :6] = torch.randn(6, 6, generator=g)
        for t in range(6):
            table[t, (t + 1) % 6] += 1.5  # the prompt's cycle is likely, so drafts are often right
        self.table = table
        self.vocab = vocab

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv: Any) -> torch.Tensor:
        return input_ids.float().unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.table[hidden[:, 0].long()]


def _markov_engine(
    tiny_model_dir: Path, spec: dict[str, Any] | None, blocks: int = 512, max_num_seqs: int = 64
) -> tuple[SyncEngine, MarkovLM]:
    args = EngineArgs(
        model=str(tiny_model_dir),
        speculative_config=spec,
        num_gpu_blocks_override=blocks,
        max_num_seqs=max_num_seqs,
        max_model_len=128,
    )
    config = args.create_engine_config()
    lm = MarkovLM(config.model.vocab_size)
    kv = allocate_kv_cache(1, blocks, config.cache.block_size, 1, 8, torch.float32, "cpu")
    core = EngineCore(config, runner=ModelRunner(lm, kv, "cpu"))  # type: ignore[arg-type]
    return SyncEngine(config, core=core), lm


def test_sampled_output_follows_the_target_chain(tiny_model_dir: Path) -> None:
    """Every transition the engine emits with n-gram speculation (accepted drafts, corrections
    and bonus tokens alike) against the chain's probabilities: chi-square, fixed seeds."""
    engine, lm = _markov_engine(tiny_model_dir, {**NGRAM, "disable_by_batch_size": None})  # 64 at once
    prompt = {"prompt_token_ids": [0, 1, 2, 3, 4, 5] * 3}
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=24, ignore_eos=True) for s in range(160)]
    outs = engine.generate([prompt] * len(params), params)
    stats = engine.core.statistics()
    assert stats.spec.num_drafts > 100 and 0 < stats.spec.num_accepted_tokens < stats.spec.num_draft_tokens
    counts = torch.zeros(6, 6, dtype=torch.float64)
    for out in outs:
        seq = [5, *out.outputs[0].token_ids]
        assert len(seq) == 25 and max(seq) < 6
        for a, b in zip(seq, seq[1:]):
            counts[a, b] += 1
    probs = lm.table[:6, :6].softmax(-1).double()
    expected = probs * counts.sum(1, keepdim=True)
    stat = float(((counts - expected) ** 2 / expected).sum())
    assert stat < chi2.ppf(0.999, 6 * 5), (stat, counts)
    # Seeded: the same seeds give the same tokens again, in a smaller batch (more drafts each,
    # other budgets) and without speculation at all.
    again = engine.generate([prompt] * 8, params[:8])
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:8]]
    plain, _ = _markov_engine(tiny_model_dir, None)
    without = plain.generate([prompt] * 40, params[:40])
    assert [o.outputs[0].token_ids for o in without] == [o.outputs[0].token_ids for o in outs[:40]]


# ------------------------------------------------------------------ greedy, end to end (the bundled model)


def _prompts(engine: SyncEngine) -> list[dict[str, list[int]]]:
    tok = engine.tokenizer
    asks = [
        "Rewrite this code with the function `mean` renamed to `average`. Output only the code.\n\n" + CODE,
        "Repeat the following code exactly.\n\n" + CODE,
        "Write a short poem about the sea.",
        "Add a docstring to `variance` and output the whole code.\n\n" + CODE,
    ]
    return [{"prompt_token_ids": tok.render_chat([{"role": "user", "content": a}]).token_ids} for a in asks]


def _generate(
    model: Path, spec: dict[str, Any] | None, n: int, max_tokens: int = 40, **kw: Any
) -> tuple[list[list[int]], Any]:
    engine = SyncEngine.from_engine_args(
        EngineArgs(model=str(model), max_model_len=1024, seed=0, speculative_config=spec, **kw)
    )
    prompts = (_prompts(engine) * 2)[:n]
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.outputs[0].token_ids for o in outs], engine.core.statistics()


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_ngram_identical_on_the_bundled_model(bundled_model_dir: Path, batch: int) -> None:
    plain, _ = _generate(bundled_model_dir, None, batch, quantization="gguf")
    spec, stats = _generate(bundled_model_dir, NGRAM, batch, quantization="gguf")
    assert spec == plain
    assert stats.spec.num_accepted_tokens > 0 and stats.spec.accepted_per_pos[0] > 0


def test_greedy_identical_under_chunked_prefill_and_aborts(
    bundled_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts cut into small chunks beside decodes with drafts, and an abort mid-run (of a
    request still waiting for a place among max_num_seqs).

    Drafts take the budget the prompts leave (scheduler.py), so every prompt is cut into the
    same chunks as without speculation: the chunks' attention is computed over the same keys in
    the same calls, and the bits are the same. Prefix caching is off and the budget is `off` for
    the same reason: a prefix hit, or a budget measured on the clock, would cut a prompt
    differently in the two runs, and SDPA over a chunk with cached context differs from one over
    the whole prompt in the last bits (in plain decoding too). Where the CPU has AMX bf16 tiles,
    a step's linears change kernel with its row count (kernels/quant.py `TILE_MIN_ROWS`), and
    drafts change the row counts: there identity is batch invariance's (docs/speculative.md)."""
    if tiles_available():
        monkeypatch.setenv(BATCH_INVARIANT_ENV, "1")
    kw = dict(
        quantization="gguf", max_num_batched_tokens=64, long_prefill_token_threshold=48, max_num_seqs=4,
        scheduler_prefill_budget="off", enable_prefix_caching=False,
    )  # fmt: skip
    runs = []
    for spec in (None, NGRAM):
        engine = SyncEngine.from_engine_args(
            EngineArgs(model=str(bundled_model_dir), max_model_len=1024, seed=0, speculative_config=spec, **kw)
        )
        prompts = _prompts(engine)
        ids = [engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=48)) for p in prompts]
        victim = engine.add_request(prompts[0], SamplingParams(temperature=0.0, max_tokens=48))
        done: dict[str, list[int]] = {}
        for step, out in enumerate(_run(engine)):
            if step == 6:
                engine.abort([victim])
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        engine.core.check_integrity()
        runs.append(([done[i] for i in ids], engine.core.statistics()))
    (plain, _), (spec, spec_stats) = runs
    assert spec_stats.spec.num_accepted_tokens > 0
    assert spec == plain


def test_preemption_and_aborts_with_drafts(tiny_model_dir: Path) -> None:
    """A KV cache small enough to preempt, aborts mid-run, on the exact-arithmetic chain model:
    greedy and seeded outputs equal plain decoding's, and the block bookkeeping holds every step.
    (On a real model a preempted request's recomputed K/V comes from the prefill kernels, not the
    decode ones, so plain decoding itself changes in the last bits there: docs/speculative.md.)"""
    outputs = []
    for spec in (None, NGRAM):
        engine, _ = _markov_engine(tiny_model_dir, spec, blocks=14, max_num_seqs=6)
        prompt = {"prompt_token_ids": [0, 1, 2, 3, 4, 5] * 3}
        ids = [
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for _ in range(3)
        ] + [
            engine.add_request(prompt, SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True))
            for s in range(2)
        ]
        victims = [
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
            for _ in range(2)
        ]
        done: dict[str, list[int]] = {}
        for step, out in enumerate(_run(engine)):
            engine.core.check_integrity()
            if step == 5:
                engine.abort(victims)
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        stats = engine.core.statistics()
        assert stats.num_preemptions > 0
        outputs.append(([done[i] for i in ids], stats))
    (plain, _), (spec_out, stats) = outputs
    assert spec_out == plain and stats.spec.num_accepted_tokens > 0


def _run(engine: SyncEngine) -> Any:
    while engine.has_unfinished_requests():
        yield from engine.step()


def test_greedy_self_draft_identical(bundled_model_dir: Path) -> None:
    """The int8 model drafted by its own GGUF blocks (no second checkpoint)."""
    self_draft = {"method": "draft_model", "quantization": "gguf", "num_speculative_tokens": 3}
    plain, _ = _generate(bundled_model_dir, None, 2, quantization="int8")
    spec, stats = _generate(bundled_model_dir, self_draft, 2, quantization="int8")
    assert spec == plain
    assert stats.spec.num_drafts > 0 and stats.spec.num_accepted_tokens > stats.spec.num_draft_tokens // 2


def test_draft_model_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A draft given as another checkpoint: the target's own weights (every draft accepted) and a
    different random model (few accepted); the greedy output is the target's either way."""
    from tinymodel import make_tiny_model

    same = tmp_path / "same"
    shutil.copytree(tiny_model_dir, same)
    other = make_tiny_model(tmp_path / "other", seed=5)
    prompt = {"prompt_token_ids": list(range(10, 40))}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for name, spec in (
        ("plain", None),
        ("same", {"model": str(same), "num_speculative_tokens": 3}),
        ("other", {"model": str(other), "num_speculative_tokens": 3}),
    ):
        engine = SyncEngine.from_engine_args(
            EngineArgs(model=str(tiny_model_dir), max_model_len=128, speculative_config=spec)
        )
        results[name] = (engine.generate([prompt, prompt], params)[0].outputs[0].token_ids, engine.core.statistics())
    assert results["same"][0] == results["plain"][0] == results["other"][0]
    same_stats, other_stats = results["same"][1], results["other"][1]
    assert same_stats.spec.num_accepted_tokens == same_stats.spec.num_draft_tokens > 0
    assert other_stats.spec.num_accepted_tokens < other_stats.spec.num_draft_tokens


def test_disable_by_batch_size_and_limits(tiny_model_dir: Path) -> None:
    """No drafts once that many requests decode; max_tokens is never overshot by drafts (the
    chain model drafts on nearly every step, so both would show)."""
    engine, _ = _markov_engine(tiny_model_dir, {**NGRAM, "disable_by_batch_size": 2})
    cycle = {"prompt_token_ids": [0, 1, 2, 3, 4, 5] * 4}
    greedy = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * 2
    sampled = SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    many = engine.generate([cycle] * 3, [*greedy, sampled])
    assert engine.core.statistics().spec.num_drafts == 0
    assert all(len(o.outputs[0].token_ids) == 12 for o in many)
    for max_tokens in (1, 2, 5, 9):
        out = engine.generate([cycle], SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == max_tokens
    assert engine.core.statistics().spec.num_accepted_tokens > 0

def test_stop_strings_logprobs_and_structured_outputs_with_drafts(
    bundled_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop string inside a multi-token step cuts the text, tokens and logprobs where plain
    decoding does; logprobs are the target's; a structured request (no drafts) is unchanged.
    Batch invariance on: the structured request joins when its grammar is compiled, and its
    prompt's chunks (sized by measured step times) share steps with the others' rows, whose
    numbers are otherwise not bit-stable against such neighbours (docs/architecture.md)."""
    from triollm.engine.sampling_params import StructuredOutputsParams

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")

    results = []
    for spec in (None, NGRAM):
        engine = SyncEngine.from_engine_args(
            EngineArgs(model=str(bundled_model_dir), max_model_len=1024, quantization="gguf", speculative_config=spec)
        )
        code = _prompts(engine)[1]
        stops = [
            SamplingParams(temperature=0.0, max_tokens=60, stop=["len(values)"], logprobs=2),
            SamplingParams(temperature=0.0, max_tokens=60, stop=["sum("], include_stop_str_in_output=True),
            SamplingParams(
                temperature=0.0,
                max_tokens=60,
                structured_outputs=StructuredOutputsParams(
                    json={
                        "type": "object",
                        "properties": {"name": {"type": "string", "maxLength": 12}},
                        "required": ["name"],
                    }
                ),
            ),
        ]
        outs = engine.generate([code, code, {"prompt_token_ids": code["prompt_token_ids"][:40]}], stops)
        results.append(
            (
                [
                    (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].stop_reason)
                    for o in outs
                ],
                outs[0].outputs[0].logprobs,
                engine.core.statistics(),
            )
        )
    (plain, plain_lps, _), (spec, spec_lps, stats) = results
    assert stats.spec.num_accepted_tokens > 0
    assert spec == plain
    assert plain[0][2] == "stop" and plain[0][3] == "len(values)" and plain[1][0].endswith("sum("), plain
    assert plain_lps is not None and spec_lps is not None and len(spec_lps) == len(plain[0][1])
    for a, b in zip(plain_lps, spec_lps):
        assert a.keys() == b.keys() and all(a[t].logprob == pytest.approx(b[t].logprob, abs=1e-5) for t in a)
    assert plain[2][0].lstrip().startswith("{")  # held to the schema (the small model may run out of tokens in it)
