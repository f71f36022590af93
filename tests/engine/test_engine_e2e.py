"""End-to-end engine tests through the real path: the tiny random model, `SyncEngine`, `EngineCore`.

Input validation with requests in flight (a bad request fails alone, the others finish with the
tokens they would have produced alone and nothing leaks), seeded sampling, stop strings, stop
token ids, min/max tokens, logprobs, aborts, output kinds, chat and the CLI. One engine serves
the whole module; every test leaves it idle (checked by `assert_idle`, restored by the fixture).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from triollm.api.cli import main as cli_main
from triollm.engine.config import EngineArgs
from triollm.engine.core import EngineCore
from triollm.engine.outputs import CompletionOutput, RequestOutput
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams
from triollm.engine.sync_engine import SyncEngine

MAX_LEN = 64
# Short prompts (under one 16-token block): requests never share prefix-cache blocks.
PROMPTS = {
    "france": "The capital of France is",
    "robot": "Once upon a time there was",
    "code": "def add(a, b):",
}
NEW_TOKENS = 12


def greedy(max_tokens: int | None = NEW_TOKENS, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def shared_engine(tiny_model_dir: Path) -> SyncEngine:
    return SyncEngine.from_engine_args(
        EngineArgs(model=str(tiny_model_dir), max_model_len=MAX_LEN, seed=0)
    )


@pytest.fixture
def engine(shared_engine: SyncEngine) -> Iterable[SyncEngine]:
    yield shared_engine
    # Leave the shared engine idle even after a failed test, so one failure does not cascade.
    shared_engine.abort(shared_engine.unfinished_request_ids())
    shared_engine.core.abort_requests(list(shared_engine.core.requests))


@pytest.fixture(scope="module")
def reference(shared_engine: SyncEngine) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, generated alone (nothing else in the batch)."""
    ref = {}
    for rid, prompt in PROMPTS.items():
        [out] = shared_engine.generate([prompt], greedy())
        ref[rid] = out.outputs[0].token_ids
        assert len(ref[rid]) == NEW_TOKENS
    assert_idle(shared_engine.core)
    return ref


def assert_idle(core: EngineCore) -> None:
    """No request left and every KV block back on the free list."""
    stats = core.statistics()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_blocks
    assert not core.requests
    assert not core.has_unfinished_requests()
    core.check_integrity()


def user_ids(core: EngineCore) -> set[str]:
    """The core's requests by the id the user gave: core ids are "<user id>#<tag>"."""
    return {cid.rsplit("#", 1)[0] for cid in core.requests}


def collect(outputs: Iterable[RequestOutput], into: dict[str, list[RequestOutput]]) -> None:
    for out in outputs:
        into.setdefault(out.request_id, []).append(out)


def drain(engine: SyncEngine, into: dict[str, list[RequestOutput]]) -> None:
    while engine.has_unfinished_requests():
        collect(engine.step(), into)


# ------------------------------------------------------------- bad inputs, engine keeps serving


def _vocab(e: SyncEngine) -> int:
    return e.config.model.vocab_size


def _params(**kw: Any) -> Callable[[SyncEngine], object]:
    """A bad request whose SamplingParams fail validation (on construction)."""
    return lambda e: e.add_request("Hello", SamplingParams(**kw))


BAD_REQUESTS: dict[str, tuple[Callable[[SyncEngine], object], str]] = {
    "empty_text": (lambda e: e.add_request("", greedy()), r"^prompt: must not be empty"),
    "empty_ids": (
        lambda e: e.add_request({"prompt_token_ids": []}, greedy()),
        r"^prompt: must not be empty",
    ),
    "too_long": (
        lambda e: e.add_request({"prompt_token_ids": [5] * MAX_LEN}, greedy()),
        rf"^prompt: {MAX_LEN} tokens exceeds max_model_len \({MAX_LEN}\).*at most {MAX_LEN - 1}",
    ),
    "out_of_vocab": (
        lambda e: e.add_request({"prompt_token_ids": [1, _vocab(e), 2]}, greedy()),
        r"^prompt_token_ids: token ids must be in \[0, \d+\)",
    ),
    "negative_id": (
        lambda e: e.add_request({"prompt_token_ids": [1, -1]}, greedy()),
        r"^prompt_token_ids: .*\[-1\]",
    ),
    "prompt_type": (lambda e: e.add_request(123, greedy()), r"^prompt: expected a string"),  # type: ignore[arg-type]
    "prompt_keys": (
        lambda e: e.add_request({"text": "hi"}, greedy()),
        r"^prompt: unsupported keys \['text'\]",
    ),
    "top_p_0": (_params(top_p=0), r"^top_p must be in \(0, 1\]"),
    "temperature_neg": (_params(temperature=-1), r"^temperature must be"),
    "n_0": (_params(n=0), r"^n must be >= 1"),
    "max_tokens_0": (_params(max_tokens=0), r"^max_tokens must be"),
    "decoded_top_p_0": (
        lambda e: e.add_request(
            "Hello", msgspec.json.decode(b'{"top_p": 0}', type=SamplingParams)
        ),
        r"top_p must be in \(0, 1\]",
    ),
    "logprobs_21": (
        lambda e: e.add_request("Hello", greedy(logprobs=21)),
        r"^logprobs: 21 exceeds max_logprobs \(20\)",
    ),
    "logprobs_whole_vocab": (
        lambda e: e.add_request("Hello", greedy(logprobs=-1)),
        r"^logprobs: \d+ exceeds max_logprobs \(20\)",
    ),
    "prompt_logprobs_21": (
        lambda e: e.add_request("Hello", greedy(prompt_logprobs=21)),
        r"^prompt_logprobs: 21 exceeds max_logprobs \(20\)",
    ),
    "stop_token_out_of_vocab": (
        lambda e: e.add_request("Hello", greedy(stop_token_ids=[_vocab(e)])),
        r"^stop_token_ids token ids must be in \[0, \d+\)",
    ),
    "logit_bias_out_of_vocab": (
        lambda e: e.add_request("Hello", greedy(logit_bias={_vocab(e) + 1: 1.0})),
        r"^logit_bias token ids must be in",
    ),
    "duplicate_id": (
        lambda e: e.add_request("Hello", greedy(), request_id="robot"),
        r"^request_id: 'robot' is already running",
    ),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request_fails_alone(
    engine: SyncEngine, reference: dict[str, list[int]], case: str
) -> None:
    submit_bad, message = BAD_REQUESTS[case]
    outs: dict[str, list[RequestOutput]] = {}
    for rid, prompt in PROMPTS.items():
        engine.add_request(prompt, greedy(), request_id=rid)
    for _ in range(3):
        collect(engine.step(), outs)
    assert all(not o[-1].finished and o[-1].outputs[0].token_ids for o in outs.values())
    assert len(outs) == len(PROMPTS)

    with pytest.raises(ValueError, match=message):
        submit_bad(engine)

    drain(engine, outs)
    assert {rid: o[-1].outputs[0].token_ids for rid, o in outs.items()} == reference
    assert all(o[-1].finished and o[-1].outputs[0].finish_reason == "length" for o in outs.values())
    assert_idle(engine.core)


def _core_request(engine: SyncEngine, rid: str, ids: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(rid, ids, greedy(), eos_token_ids=engine.input.eos_token_ids)


CORE_BAD: dict[str, tuple[Callable[[SyncEngine], EngineCoreRequest], str]] = {
    "duplicate_id": (lambda e: _core_request(e, "code", [1, 2, 3]), r"^request_id: 'code'"),
    "empty": (lambda e: _core_request(e, "x", []), r"^prompt: must not be empty"),
    "too_long": (
        lambda e: _core_request(e, "x", [3] * MAX_LEN),
        rf"^prompt: {MAX_LEN} tokens .*max_model_len \({MAX_LEN}\)",
    ),
    "out_of_vocab": (
        lambda e: _core_request(e, "x", [3, _vocab(e)]),
        r"^prompt_token_ids: token ids must be in \[0, \d+\)",
    ),
}


@pytest.mark.parametrize("case", list(CORE_BAD))
def test_core_rejects_bad_request_alone(
    engine: SyncEngine, reference: dict[str, list[int]], case: str
) -> None:
    """The core re-checks what it must never trust, without disturbing running requests."""
    core = engine.core
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    for rid, prompt in PROMPTS.items():
        core.add_request(_core_request(engine, rid, engine.tokenizer.encode(prompt)))

    def step() -> None:
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids

    for _ in range(3):
        step()
    make_bad, message = CORE_BAD[case]
    with pytest.raises(ValueError, match=message):
        core.add_request(make_bad(engine))
    assert sorted(core.requests) == sorted(PROMPTS)
    while core.has_unfinished_requests():
        step()
    assert tokens == reference
    assert_idle(core)


def test_duplicate_user_id_with_other_n_leaves_nothing_in_core(engine: SyncEngine) -> None:
    # "a" with n=2 runs as core requests "0_a" and "1_a"; a second "a" with n=1 would be core
    # request "a", which the core does not know: only the output processor sees the duplicate.
    engine.add_request("Hello", SamplingParams(n=2, max_tokens=8, temperature=0), request_id="a")
    engine.step()
    with pytest.raises(ValueError, match="^request_id: 'a' is already running"):
        engine.add_request("Hello", greedy(), request_id="a")
    assert sorted(user_ids(engine.core)) == ["0_a", "1_a"]


# -------------------------------------------------------------------------- seeded sampling


def test_seeded_sampling_reproduces_across_batches(
    engine: SyncEngine, reference: dict[str, list[int]]
) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    [alone] = engine.generate(["Hello, my name is"], seeded)
    batched = engine.generate(
        [PROMPTS["france"], "Hello, my name is", PROMPTS["code"], "Hello, my name is"],
        [
            SamplingParams(temperature=0.9, max_tokens=20, ignore_eos=True),  # unseeded
            seeded,
            greedy(),
            SamplingParams(temperature=1.0, seed=4321, max_tokens=16, ignore_eos=True),
        ],
    )
    a, b = alone.outputs[0], batched[1].outputs[0]
    assert len(a.token_ids) == 16
    assert (b.token_ids, b.text) == (a.token_ids, a.text)
    assert batched[3].outputs[0].token_ids != a.token_ids  # another seed, other tokens
    [greedy_out] = engine.generate(["Hello, my name is"], greedy(16))
    assert greedy_out.outputs[0].token_ids != a.token_ids  # temperature 1 really samples
    assert batched[2].outputs[0].token_ids == reference["code"]
    assert_idle(engine.core)


def test_n_with_seed(engine: SyncEngine) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    [first] = engine.generate(["Hello"], params)
    [again] = engine.generate(["Hello", "Once"], [params, greedy()])[:1]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 12 and c.finish_reason == "length" for c in first.outputs)
    assert len({tuple(c.token_ids) for c in first.outputs}) == 3
    assert [(c.token_ids, c.text) for c in again.outputs] == [
        (c.token_ids, c.text) for c in first.outputs
    ]
    # Child i samples with seed + i (vLLM's fan-out): the same as a single request with that seed.
    singles = engine.generate(
        ["Hello"] * 3,
        [SamplingParams(temperature=1.0, seed=7 + i, max_tokens=12, ignore_eos=True) for i in range(3)],
    )
    assert [s.outputs[0].token_ids for s in singles] == [c.token_ids for c in first.outputs]
    assert_idle(engine.core)


# --------------------------------------------------------------------------- stop conditions


def _stop_candidate(engine: SyncEngine, ids: list[int], text: str) -> tuple[str, int, int]:
    """A stop string spanning the boundary between two tokens in the middle of the output.

    Returns (stop, its index in text, the number of tokens generated when it completes).
    """
    decode = engine.tokenizer.decode
    for width in (2, 1):
        for i in range(3, len(ids) - 3):
            before, after = decode(ids[: i + 1]), decode(ids[: i + 2])
            b = len(before)
            if not text.startswith(after) or len(after) - b < width or b < width:
                continue  # the decoded prefix is not stable yet (a split UTF-8 character)
            stop = text[b - width : b + width]
            if "\ufffd" not in stop and text.find(stop) == b - width:
                return stop, b - width, i + 2
    raise AssertionError(f"no stop-string candidate in {text!r}")


@pytest.mark.parametrize("include", [False, True], ids=["excluded", "included"])
def test_stop_string(engine: SyncEngine, reference: dict[str, list[int]], include: bool) -> None:
    [learn] = engine.generate([PROMPTS["robot"]], greedy(24))
    ids, text = learn.outputs[0].token_ids, learn.outputs[0].text
    stop, index, num_tokens = _stop_candidate(engine, ids, text)

    engine.add_request(PROMPTS["code"], greedy(), request_id="other")
    params = greedy(24, stop=[stop], include_stop_str_in_output=include)
    params.output_kind = RequestOutputKind.DELTA
    engine.add_request(PROMPTS["robot"], params, request_id="stopped")
    outs: dict[str, list[RequestOutput]] = {}
    while "stopped" not in outs or not outs["stopped"][-1].finished:
        collect(engine.step(), outs)
    # The stop-string abort reached the core at once, not at max_tokens.
    assert "stopped" not in user_ids(engine.core)
    deltas = [c for o in outs["stopped"] for c in o.outputs]
    final = deltas[-1]
    assert "".join(c.text for c in deltas) == text[: index + len(stop) if include else index]
    assert [t for c in deltas for t in c.token_ids] == ids[:num_tokens]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    drain(engine, outs)
    assert outs["other"][-1].outputs[0].token_ids == reference["code"]
    assert_idle(engine.core)


def test_stop_token_ids(engine: SyncEngine) -> None:
    [learn] = engine.generate([PROMPTS["france"]], greedy(24))
    ids = learn.outputs[0].token_ids
    stop_id = ids[6]
    k = ids.index(stop_id)
    [out] = engine.generate([PROMPTS["france"]], greedy(24, stop_token_ids=[stop_id]))
    c = out.outputs[0]
    assert c.token_ids == ids[: k + 1]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop_id)
    assert c.text == engine.tokenizer.decode(ids[:k])  # the stop token's text is not output
    assert_idle(engine.core)


def test_min_tokens_suppresses_eos(engine: SyncEngine, reference: dict[str, list[int]]) -> None:
    eos = engine.input.eos_token_ids[0]
    forced = {eos: 100.0}  # EOS wins whenever it is allowed
    [now] = engine.generate(
        [PROMPTS["france"]], SamplingParams(temperature=0, max_tokens=16, logit_bias=forced)
    )
    assert now.outputs[0].token_ids == [eos]
    [later] = engine.generate(
        [PROMPTS["france"]],
        SamplingParams(temperature=0, max_tokens=16, logit_bias=forced, min_tokens=5),
    )
    c = later.outputs[0]
    assert c.token_ids == [*reference["france"][:5], eos]
    assert (c.finish_reason, c.stop_reason) == ("stop", None)
    assert c.text == engine.tokenizer.decode(reference["france"][:5])
    # stop_token_ids are banned below min_tokens too.
    stop_id = reference["robot"][0]
    [out] = engine.generate(
        [PROMPTS["france"]],
        greedy(16, stop_token_ids=[stop_id], logit_bias={stop_id: 100.0}, min_tokens=3),
    )
    assert out.outputs[0].token_ids[3] == stop_id and len(out.outputs[0].token_ids) == 4
    assert stop_id not in out.outputs[0].token_ids[:3]
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("stop", stop_id)
    assert_idle(engine.core)


def test_max_tokens(engine: SyncEngine, reference: dict[str, list[int]]) -> None:
    seven, unlimited = engine.generate(
        [PROMPTS["france"], PROMPTS["code"]], [greedy(7), greedy(None)]
    )
    assert seven.outputs[0].token_ids == reference["france"][:7]
    assert seven.outputs[0].finish_reason == "length"
    # No limit: clamped to the room left in max_model_len.
    room = MAX_LEN - len(unlimited.prompt_token_ids)
    assert len(unlimited.outputs[0].token_ids) == room
    assert unlimited.outputs[0].token_ids[:NEW_TOKENS] == reference["code"]
    assert unlimited.outputs[0].finish_reason == "length"
    assert_idle(engine.core)


# --------------------------------------------------------------------------------- logprobs


def _check_row(row: dict, chosen: int, k: int, decode: Callable[..., str]) -> None:
    assert chosen in row
    assert row[chosen].rank is not None and row[chosen].rank >= 1
    top = sorted((lp for lp in row.values() if lp.rank is not None and lp.rank <= k), key=lambda lp: lp.rank)
    assert [lp.rank for lp in top] == list(range(1, k + 1))
    values = [lp.logprob for lp in top]
    assert values == sorted(values, reverse=True)
    assert all(lp.logprob <= 0.0 for lp in row.values())
    assert len(row) == k + (row[chosen].rank > k)
    assert row[chosen].logprob <= values[0]
    for t, lp in row.items():
        assert lp.decoded_token == decode([t], skip_special_tokens=False)


def test_logprobs_and_prompt_logprobs(engine: SyncEngine) -> None:
    decode = engine.tokenizer.decode
    [out] = engine.generate([PROMPTS["france"]], greedy(8, logprobs=3, prompt_logprobs=2))
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 8
    for token, row in zip(c.token_ids, c.logprobs):
        _check_row(row, token, 3, decode)
        assert row[token].rank == 1  # greedy picks the top token
    assert c.cumulative_logprob == pytest.approx(
        sum(row[t].logprob for t, row in zip(c.token_ids, c.logprobs)), abs=1e-4
    )
    prompt_ids = out.prompt_token_ids
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt_ids) and pl[0] is None
    for token, row in zip(prompt_ids[1:], pl[1:]):
        assert row is not None
        _check_row(row, token, 2, decode)

    # The same positions scored as a prompt: the prompt logprobs of prompt + output agree with
    # the sample logprobs of the output (both are log_softmax of the same logits).
    extended = prompt_ids + c.token_ids
    [scored] = engine.generate([{"prompt_token_ids": extended}], greedy(1, prompt_logprobs=2))
    rows = scored.prompt_logprobs
    assert rows is not None and len(rows) == len(extended)
    for j, token in enumerate(c.token_ids):
        row = rows[len(prompt_ids) + j]
        assert row is not None and row[token].rank == 1
        assert row[token].logprob == pytest.approx(c.logprobs[j][token].logprob, abs=1e-4)
    assert_idle(engine.core)


def test_sampled_logprobs_rank(engine: SyncEngine) -> None:
    params = SamplingParams(temperature=1.5, seed=3, max_tokens=16, ignore_eos=True, logprobs=3)
    [out] = engine.generate(["Hello"], params)
    c = out.outputs[0]
    assert c.logprobs is not None and len(c.logprobs) == 16
    for token, row in zip(c.token_ids, c.logprobs):
        _check_row(row, token, 3, engine.tokenizer.decode)
    assert any(row[t].rank > 1 for t, row in zip(c.token_ids, c.logprobs))  # really sampled
    assert_idle(engine.core)


# ------------------------------------------------------------------------ abort, output kinds


def test_abort_frees_blocks_at_once(engine: SyncEngine, reference: dict[str, list[int]]) -> None:
    core = engine.core
    engine.add_request(PROMPTS["france"], greedy(), request_id="france")
    engine.add_request(PROMPTS["robot"], greedy(40), request_id="victim")
    engine.add_request(PROMPTS["code"], greedy(), request_id="code")
    outs: dict[str, list[RequestOutput]] = {}
    for _ in range(4):
        collect(engine.step(), outs)
    [victim] = engine.frontend.unfinished_core_ids("victim")
    held = len(core.requests[victim].block_ids)
    before = core.statistics()
    assert held > 0 and before.num_running == 3

    [aborted] = engine.abort(["victim"])
    after = core.statistics()
    assert "victim" not in user_ids(core)
    assert after.num_free_blocks == before.num_free_blocks + held
    assert after.num_running == 2
    core.check_integrity()
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert aborted.outputs[0].token_ids == outs["victim"][-1].outputs[0].token_ids
    assert len(aborted.outputs[0].token_ids) == 4

    drain(engine, outs)
    assert len(outs["victim"]) == 4  # nothing more after the abort
    assert outs["france"][-1].outputs[0].token_ids == reference["france"]
    assert outs["code"][-1].outputs[0].token_ids == reference["code"]
    assert engine.abort(["victim", "france", "unknown"]) == []  # finished or unknown: no-op
    assert_idle(core)


def test_output_kinds_agree(engine: SyncEngine) -> None:
    params = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    for kind in RequestOutputKind:
        p = params.clone()
        p.output_kind = kind
        engine.add_request("Hello, my name is", p, request_id=kind.name)
    outs: dict[str, list[RequestOutput]] = {}
    drain(engine, outs)

    [final] = outs["FINAL_ONLY"]
    assert final.finished and [c.index for c in final.outputs] == [0, 1]
    expected = {c.index: (c.token_ids, c.text) for c in final.outputs}
    assert all(len(ids) == 10 for ids, _ in expected.values())

    cumulative = outs["CUMULATIVE"]
    assert len(cumulative) == 10 and [o.finished for o in cumulative] == [False] * 9 + [True]
    for step, o in enumerate(cumulative, 1):
        for c in o.outputs:
            ids, text = expected[c.index]
            assert c.token_ids == ids[:step] and text.startswith(c.text)
    assert {c.index: (c.token_ids, c.text) for c in cumulative[-1].outputs} == expected

    delta = outs["DELTA"]
    assert [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    joined: dict[int, tuple[list[int], str]] = {0: ([], ""), 1: ([], "")}
    for o in delta:
        for c in o.outputs:
            ids, text = joined[c.index]
            joined[c.index] = (ids + c.token_ids, text + c.text)
    assert joined == expected
    assert_idle(engine.core)


# ------------------------------------------------------------------------------- chat, CLI


def test_chat_prompt(engine: SyncEngine) -> None:
    tok = engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids[0] == tok.encode("<|im_start|>", add_special_tokens=False)[0]
    [out] = engine.generate([{"prompt_token_ids": ids}], greedy(4))
    assert out.prompt_token_ids == ids and out.prompt is None
    c = out.outputs[0]
    assert len(c.token_ids) == 4 and c.text == tok.decode(c.token_ids)
    assert_idle(engine.core)


def test_cli_generate_and_chat(
    engine: SyncEngine, tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ["--model", str(tiny_model_dir), "--max-tokens", "4", "--max-model-len", "128"]
    assert cli_main(["generate", "Hello", *model]) == 0
    [hello] = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4))
    assert capsys.readouterr().out == f"'Hello' -> {hello.outputs[0].text!r}\n"

    assert cli_main(["chat", "hi", *model]) == 0
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "hi"}])
    [chat] = engine.generate(
        [{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4)
    )
    assert capsys.readouterr().out == chat.outputs[0].text + "\n"


def test_cli_bad_flag_value(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["generate", "Hello", "--model", str(tiny_model_dir), "--max-model-len", "0"]) == 2
    err = capsys.readouterr().err
    assert re.match(r"triollm: error: max_model_len: ", err), err


def test_cli_flag_outside_its_choices(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli_main(["generate", "Hello", "--model", str(tiny_model_dir), "--block-size", "7"])
    assert info.value.code == 2
    assert "--block-size: invalid choice: 7 (choose from 8, 16, 32, 64, 128)" in capsys.readouterr().err


# ---------------------------------------------------------------------------- bundled model


@pytest.mark.slow
def test_bundled_model_knows_paris(bundled_model_dir: Path) -> None:
    engine = SyncEngine.from_engine_args(
        EngineArgs(model=str(bundled_model_dir), max_model_len=128, max_num_seqs=4)
    )
    [out] = engine.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    c: CompletionOutput = out.outputs[0]
    assert c.text.startswith(" Paris"), c.text
    assert len(c.token_ids) == 8 or c.finish_reason == "stop"
    assert_idle(engine.core)
