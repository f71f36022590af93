"""InputProcessor validation, StopChecker, and the frontend's output half driven by hand-built core outputs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.engine.frontend import (
    Frontend,
    InputProcessor,
    Phase,
    ProcessedOutputs,
    ProcessedRequest,
)
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.outputs import RequestOutput
from triollm.engine.processing.detokenizer import StopChecker
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.request import EngineCoreOutput, FinishReason, Logprobs
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "The capital of France is"
TEXT = " Paris, a café 😀 city. The end."
CUMULATIVE, DELTA, FINAL_ONLY = (
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.DELTA,
    RequestOutputKind.FINAL_ONLY,
)


@pytest.fixture
def inp(model_config: ModelConfig, tok: Tokenizer) -> InputProcessor:
    return InputProcessor(model_config, tok)


class OutputProcessor:
    """The `Frontend` driven as the core's output side alone: core ids without a tag (as
    `InputProcessor.process` makes them without one), outputs collected per call."""

    def __init__(self, inp: InputProcessor) -> None:
        self.frontend = Frontend(inp)
        self.delivered: list[RequestOutput] = []

    def put(self, output: RequestOutput) -> None:
        self.delivered.append(output)

    def put_error(self, error: BaseException) -> None:
        raise AssertionError(f"unexpected error: {error}")

    def add_request(self, processed: ProcessedRequest) -> None:
        self.frontend.open(processed.request_id, self)
        assert self.frontend.add(processed) == processed.core_requests

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = self.frontend.on_outputs(outputs)
        assert self.take() == result.request_outputs
        return result

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        self.frontend.abort(request_ids)
        return self.take()

    def take(self) -> list[RequestOutput]:
        out, self.delivered = self.delivered, []
        self.frontend.check_integrity()
        return out

    def unfinished_core_ids(self, request_id: str) -> list[str]:
        return self.frontend.unfinished_core_ids(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.num_unfinished_requests > 0

    @property
    def num_unfinished_requests(self) -> int:
        ids = self.frontend.request_ids()
        return sum(self.frontend.get(rid).phase is not Phase.FINISHED for rid in ids)  # type: ignore[union-attr]


def _start(
    inp: InputProcessor, prompt: Any = PROMPT, rid: str = "r", **params: Any
) -> tuple[ProcessedRequest, OutputProcessor]:
    processed = inp.process(prompt, SamplingParams(**params), rid)
    outp = OutputProcessor(inp)
    outp.add_request(processed)
    return processed, outp


def _step(outp: OutputProcessor, rid: str, ids: list[int], **kw: Any) -> ProcessedOutputs:
    return outp.process_outputs([EngineCoreOutput(rid, ids, **kw)])


def _run(
    outp: OutputProcessor,
    rid: str,
    ids: list[int],
    finish: FinishReason | None = FinishReason.LENGTH,
    **last: Any,
) -> list[ProcessedOutputs]:
    """Feed `ids` one per step; the last step carries `finish` and `last`."""
    steps = []
    for i, token in enumerate(ids):
        kw = {"finish_reason": finish, **last} if i == len(ids) - 1 else {}
        steps.append(_step(outp, rid, [token], **kw))
    return steps


def _outputs(steps: list[ProcessedOutputs]) -> list[RequestOutput]:
    return [o for s in steps for o in s.request_outputs]


# ------------------------------------------------------------------------------ input processing


def test_prompt_forms(inp: InputProcessor, tok: Tokenizer) -> None:
    ids = tok.encode(PROMPT)
    for prompt in (PROMPT, {"prompt": PROMPT}):
        processed = inp.process(prompt, None, "a")
        assert processed.prompt == PROMPT and processed.prompt_token_ids == ids
    processed = inp.process({"prompt_token_ids": ids}, None, "b")
    assert processed.prompt is None and processed.prompt_token_ids == ids
    (core,) = processed.core_requests
    assert core.request_id == "b" and core.prompt_token_ids == ids
    assert core.eos_token_ids == [0]
    with pytest.raises(ValueError, match="unsupported keys"):
        inp.process({"prompt": "x", "images": []}, None, "c")


@pytest.mark.parametrize("prompt", ["", {"prompt_token_ids": []}])
def test_empty_prompt(inp: InputProcessor, prompt: Any) -> None:
    with pytest.raises(ValueError, match="prompt: must not be empty"):
        inp.process(prompt, None, "r")


def test_prompt_too_long(inp: InputProcessor) -> None:
    with pytest.raises(ValueError, match=r"prompt: 64 tokens exceeds max_model_len \(64\)") as e:
        inp.process({"prompt_token_ids": [5] * 64}, None, "r")
    assert "63" in str(e.value)
    processed = inp.process({"prompt_token_ids": [5] * 63}, SamplingParams(max_tokens=None), "r")
    assert processed.params.max_tokens == 1


@pytest.mark.parametrize("bad", [384, -1, 10_000])
def test_out_of_vocab_prompt(inp: InputProcessor, bad: int) -> None:
    with pytest.raises(ValueError, match=r"prompt_token_ids: .*\[0, 384\)"):
        inp.process({"prompt_token_ids": [5, bad]}, None, "r")


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_logprobs_limit(model_config: ModelConfig, tok: Tokenizer, field: str) -> None:
    inp = InputProcessor(model_config, tok)
    with pytest.raises(ValueError, match=rf"^{field}: 21 exceeds max_logprobs \(20\)"):
        inp.process(PROMPT, SamplingParams(**{field: 21}), "r")
    inp.process(PROMPT, SamplingParams(**{field: 20}), "r")
    with pytest.raises(ValueError, match=rf"{field}: 6 exceeds max_logprobs \(5\)"):
        InputProcessor(model_config, tok, max_logprobs=5).process(
            PROMPT, SamplingParams(**{field: 6}), "r"
        )


def test_params_token_ids_checked(inp: InputProcessor) -> None:
    with pytest.raises(ValueError, match="stop_token_ids"):
        inp.process(PROMPT, SamplingParams(stop_token_ids=[384]), "r")


def test_default_params_from_generation_config(model_config: ModelConfig, tok: Tokenizer) -> None:
    cfg = dataclasses.replace(
        model_config, generation_defaults={"temperature": 0.5, "max_tokens": 7}
    )
    params = InputProcessor(cfg, tok).process(PROMPT, None, "r").params
    assert params.temperature == 0.5 and params.max_tokens == 7


def test_max_tokens_clamped(inp: InputProcessor, tok: Tokenizer) -> None:
    room = 64 - len(tok.encode(PROMPT))
    for asked, expected in ((None, room), (1000, room), (5, 5)):
        params = SamplingParams(max_tokens=asked)
        processed = inp.process(PROMPT, params, "r")
        assert processed.params.max_tokens == expected
        assert processed.core_requests[0].sampling_params.max_tokens == expected
        assert params.max_tokens == asked  # the caller's params are not modified


def test_bad_words_tokenized(inp: InputProcessor, tok: Tokenizer) -> None:
    processed = inp.process(PROMPT, SamplingParams(bad_words=["Paris"]), "r")
    words = processed.core_requests[0].bad_words_token_ids
    assert words[0] == tok.encode("Paris", add_special_tokens=False)
    spaced = tok.encode(" Paris", add_special_tokens=False)
    if spaced[0] != words[0][0] and len(spaced) == len(words[0]):
        assert words[1] == spaced


def test_n_children(inp: InputProcessor) -> None:
    processed = inp.process(PROMPT, SamplingParams(n=3, seed=7), "r")
    cores = processed.core_requests
    assert [c.request_id for c in cores] == ["0_r", "1_r", "2_r"]
    assert [c.sampling_params.seed for c in cores] == [7, 8, 9]
    assert all(c.sampling_params.n == 1 for c in cores) and processed.params.n == 3
    unseeded = inp.process(PROMPT, SamplingParams(n=2), "s").core_requests
    assert [c.sampling_params.seed for c in unseeded] == [None, None]


# ------------------------------------------------------------------------------ StopChecker


def test_stop_checker_split_and_hold() -> None:
    checker = StopChecker(["The end"])
    assert checker.feed("Paris. Th") == ("Paris. ", None)  # "Th" may start "The end"
    assert checker.held_text == "Th"
    assert checker.feed("e e") == ("", None)
    assert checker.feed("nd!") == ("", "The end")
    include = StopChecker(["The end"], include_in_output=True)
    assert include.feed("Paris. Th") == ("Paris. Th", None)
    assert include.feed("e end!") == ("e end", "The end")


def test_stop_checker_flush_and_min_tokens() -> None:
    checker = StopChecker(["xyz"])
    assert checker.feed("abx") == ("ab", None)
    assert checker.flush() == "x"
    unchecked = StopChecker(["xyz"])
    assert unchecked.feed("xy", check=False) == ("", None)  # a prefix is still held back
    assert unchecked.feed("z", check=False) == ("xyz", None)  # but not matched
    assert unchecked.feed("xyz") == ("", "xyz")


@st.composite
def _stop_case(draw: st.DrawFn) -> tuple[str, list[int], list[str]]:
    text = draw(st.text(alphabet="ab c", max_size=40))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=12)))
    stops = draw(st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), min_size=1, max_size=3))
    return text, cuts, stops


def _reference(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    for end in range(1, len(text) + 1):
        hits = [s for s in stops if text[:end].endswith(s)]
        if hits:
            stop = max(hits, key=len)
            return text[: end if include else end - len(stop)], stop
    return text, None


@settings(max_examples=300, deadline=None)
@given(case=_stop_case(), include=st.booleans())
def test_stop_checker_matches_reference(
    case: tuple[str, list[int], list[str]], include: bool
) -> None:
    text, cuts, stops = case
    expected, expected_stop = _reference(text, stops, include)
    checker = StopChecker(stops, include)
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    emitted, fed, stop = "", "", None
    for piece in pieces:
        fed += piece
        out, stop = checker.feed(piece)
        emitted += out
        assert expected.startswith(emitted)  # never emits what a stop string later removes
        if stop is not None:
            break
        if not include:
            assert len(fed) - len(emitted) <= max(map(len, stops)) - 1
    if stop is None:
        emitted += checker.flush()
    assert (emitted, stop) == (expected, expected_stop)


# ------------------------------------------------------------------------------ output kinds


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA, FINAL_ONLY])
def test_output_kinds(inp: InputProcessor, tok: Tokenizer, kind: RequestOutputKind) -> None:
    ids = tok.encode(TEXT)
    _, outp = _start(inp, output_kind=kind, max_tokens=len(ids))
    outs = _outputs(_run(outp, "r", ids))
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    final = outs[-1].outputs[0]
    assert final.finish_reason == "length" and final.stop_reason is None
    if kind == FINAL_ONLY:
        assert len(outs) == 1
    else:
        assert len(outs) == len(ids)
    if kind == DELTA:
        assert "".join(o.outputs[0].text for o in outs) == TEXT
        assert [t for o in outs for t in o.outputs[0].token_ids] == ids
    else:
        assert final.text == TEXT and final.token_ids == ids
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert not outp.has_unfinished_requests() and outp.num_unfinished_requests == 0


def test_detokenize_off(inp: InputProcessor, tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    _, outp = _start(inp, detokenize=False, output_kind=FINAL_ONLY)
    (out,) = _outputs(_run(outp, "r", ids, num_cached_tokens=4))
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == ids
    assert out.num_cached_tokens == 4


# ------------------------------------------------------------------------------ stop strings


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_across_tokens(inp: InputProcessor, tok: Tokenizer, include: bool) -> None:
    ids = tok.encode(TEXT + " More text after.")
    assert not any("The end" in tok.decode([t]) for t in ids)  # the stop spans several tokens
    _, outp = _start(inp, stop=["The end"], include_stop_str_in_output=include, max_tokens=60)
    steps = _run(outp, "r", ids, finish=None)
    outs = _outputs(steps)
    final = outs[-1]
    assert final.finished and len(outs) < len(ids)  # nothing after the stop
    completion = final.outputs[0]
    head = TEXT[: TEXT.index("The end")]
    assert completion.text == (head + "The end" if include else head)
    assert (completion.finish_reason, completion.stop_reason) == ("stop", "The end")
    assert [s.reqs_to_abort for s in steps if s.reqs_to_abort] == [["r"]]
    assert len(completion.token_ids) == len(outs)  # token ids are kept, as in vLLM
    assert not outp.has_unfinished_requests()


def test_delta_never_streams_partial_stop(inp: InputProcessor, tok: Tokenizer) -> None:
    text = " Par Pari Paris is Paris! and more"
    ids = tok.encode(text)
    _, outp = _start(inp, stop=["Paris!"], output_kind=DELTA, max_tokens=60)
    expected = text[: text.index("Paris!")]
    streamed = ""
    for out in _outputs(_run(outp, "r", ids, finish=None)):
        streamed += out.outputs[0].text
        assert expected.startswith(streamed)
    assert streamed == expected


def test_held_text_flushed_at_finish(inp: InputProcessor, tok: Tokenizer) -> None:
    ids = tok.encode(" Paris is Pari")
    _, outp = _start(inp, stop=["Paris!"], output_kind=DELTA)
    outs = _outputs(_run(outp, "r", ids))
    assert "".join(o.outputs[0].text for o in outs) == " Paris is Pari"
    assert outs[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_text(inp: InputProcessor, tok: Tokenizer, include: bool) -> None:
    ids = tok.encode(" Paris.")
    stop_id = ids[-1]
    _, outp = _start(inp, stop_token_ids=[stop_id], include_stop_str_in_output=include)
    (out,) = _outputs(_run(outp, "r", ids, FinishReason.STOP, stop_reason=stop_id))[-1:]
    completion = out.outputs[0]
    assert completion.text == (" Paris." if include else tok.decode(ids[:-1]))
    assert completion.token_ids == ids and completion.stop_reason == stop_id


def test_eos_not_in_text(inp: InputProcessor, tok: Tokenizer) -> None:
    ids = [*tok.encode(" Paris"), 0]
    _, outp = _start(inp, skip_special_tokens=False, output_kind=FINAL_ONLY)
    (out,) = _outputs(_run(outp, "r", ids, FinishReason.STOP))
    assert out.outputs[0].text == " Paris" and out.outputs[0].finish_reason == "stop"


# ------------------------------------------------------------------------------ n > 1


def test_n_aggregation_streaming(inp: InputProcessor, tok: Tokenizer) -> None:
    _, outp = _start(inp, n=3, seed=1)
    a, b = tok.encode(" Paris"), tok.encode(" Berlin")
    step = outp.process_outputs([EngineCoreOutput("0_r", a[:1]), EngineCoreOutput("2_r", b[:1])])
    (out,) = step.request_outputs
    assert [c.index for c in out.outputs] == [0, 2] and not out.finished
    out = outp.process_outputs([EngineCoreOutput("1_r", a, finish_reason=FinishReason.LENGTH)])
    assert [c.index for c in out.request_outputs[0].outputs] == [1]
    out = outp.process_outputs(
        [
            EngineCoreOutput("2_r", b[1:], finish_reason=FinishReason.LENGTH),
            EngineCoreOutput("0_r", a[1:], finish_reason=FinishReason.LENGTH),
        ]
    )
    (final,) = out.request_outputs
    assert final.finished and [c.index for c in final.outputs] == [0, 2]
    assert [c.text for c in final.outputs] == [" Paris", " Berlin"]
    assert not outp.has_unfinished_requests()


def test_n_aggregation_final_only(inp: InputProcessor, tok: Tokenizer) -> None:
    _, outp = _start(inp, n=3, output_kind=FINAL_ONLY)
    ids = tok.encode(" Paris")
    for i in (2, 0):
        assert _step(outp, f"{i}_r", ids, finish_reason=FinishReason.LENGTH).request_outputs == []
    assert outp.has_unfinished_requests()
    (final,) = _step(outp, "1_r", ids[:1], finish_reason=FinishReason.STOP).request_outputs
    assert final.finished and [c.index for c in final.outputs] == [0, 1, 2]
    assert [c.finish_reason for c in final.outputs] == ["length", "stop", "length"]


# ------------------------------------------------------------------------------ logprobs


def test_logprobs_conversion(inp: InputProcessor, tok: Tokenizer) -> None:
    a, b, c = tok.encode(" Paris")[:1][0], 10, 11
    _, outp = _start(inp, logprobs=2, output_kind=DELTA)
    rows = Logprobs(token_ids=[[a, b, a]], logprobs=[[-0.5, -0.2, -0.5]], ranks=[2])
    (out,) = _step(outp, "r", [a], new_logprobs=rows).request_outputs
    (entry,) = out.outputs[0].logprobs or []
    assert list(entry) == [a, b]
    assert (
        entry[a].logprob == -0.5
        and entry[a].rank == 2
        and entry[a].decoded_token == tok.decode([a])
    )
    assert entry[b].rank == 1 and entry[b].decoded_token == tok.decode([b])
    rows = Logprobs(token_ids=[[c, b, c]], logprobs=[[-1.0, -0.7, -1.0]], ranks=[5])
    (out,) = _step(
        outp, "r", [c], new_logprobs=rows, finish_reason=FinishReason.LENGTH
    ).request_outputs
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 1  # DELTA: new only
    assert completion.logprobs[0][c].rank == 2  # in the top-k: the top-k entry wins (vLLM)
    assert completion.cumulative_logprob == pytest.approx(-1.5)


def test_no_logprobs_requested(inp: InputProcessor, tok: Tokenizer) -> None:
    _, outp = _start(inp)
    (out,) = _step(outp, "r", [5], finish_reason=FinishReason.LENGTH).request_outputs
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_prompt_logprobs(inp: InputProcessor, tok: Tokenizer, kind: RequestOutputKind) -> None:
    processed, outp = _start(inp, prompt_logprobs=1, output_kind=kind)
    prompt = processed.prompt_token_ids
    rows = [[t, 7] for t in prompt[1:]]

    def chunk(lo: int, hi: int) -> Logprobs:
        return Logprobs(rows[lo:hi], [[-1.0, -0.5]] * (hi - lo), [2] * (hi - lo))

    half = len(rows) // 2
    first = _step(outp, "r", [], new_prompt_logprobs=chunk(0, half)).request_outputs[0]
    second = _step(outp, "r", [5], new_prompt_logprobs=chunk(half, len(rows))).request_outputs[0]
    third = _step(outp, "r", [6], finish_reason=FinishReason.LENGTH).request_outputs[0]
    assert first.prompt_logprobs is not None and first.prompt_logprobs[0] is None
    if kind == DELTA:
        assert second.prompt_logprobs is not None
        assert len(first.prompt_logprobs) + len(second.prompt_logprobs) == len(prompt)
        assert third.prompt_logprobs is None
    else:
        assert third.prompt_logprobs is not None and len(third.prompt_logprobs) == len(prompt)
        entry = third.prompt_logprobs[1]
        assert entry is not None and entry[prompt[1]].rank == 2 and entry[7].rank == 1


# ------------------------------------------------------------------------------ aborts and errors


def test_core_error_becomes_abort(inp: InputProcessor) -> None:
    _, outp = _start(inp)
    (out,) = _step(
        outp, "r", [], finish_reason=FinishReason.ERROR, stop_reason="boom"
    ).request_outputs
    assert out.finished
    assert (out.outputs[0].finish_reason, out.outputs[0].stop_reason) == ("abort", "boom")


def test_user_abort_flushes_held_text(inp: InputProcessor, tok: Tokenizer) -> None:
    _, outp = _start(inp, stop=["Paris!"], output_kind=DELTA, n=2)
    ids = tok.encode(" Pari")
    streamed = "".join(o.outputs[0].text for o in _outputs(_run(outp, "0_r", ids, finish=None)))
    assert outp.unfinished_core_ids("r") == ["0_r", "1_r"]
    (out,) = outp.abort_requests(["r", "unknown"])
    assert out.finished and [c.index for c in out.outputs] == [0, 1]
    assert streamed + out.outputs[0].text == " Pari"
    assert {c.finish_reason for c in out.outputs} == {"abort"}
    assert _step(outp, "1_r", [5]).request_outputs == []  # late core output is ignored
    assert not outp.has_unfinished_requests() and outp.unfinished_core_ids("r") == []


def test_duplicate_request_id(inp: InputProcessor) -> None:
    processed, outp = _start(inp)
    with pytest.raises(ValueError, match="request_id"):
        outp.add_request(processed)
