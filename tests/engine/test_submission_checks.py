"""What the input processor refuses at submission, each with a `ValueError` naming the field and
the setting: sampling params changed after construction, values the wire cannot carry, the
per-request limits (`LimitsConfig`, checked before anything is tokenized) and requests that can
never fit the KV cache. The engine core's own KV check too."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgspec
import pytest

from triollm.actors.messages import AddRequest
from triollm.engine.config import EngineArgs, LimitsConfig
from triollm.engine.core import EngineCore
from triollm.engine.execution.scripted_runner import ScriptedRunner
from triollm.engine.frontend import InputProcessor
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams, StructuredOutputsParams

PROMPT = "Hello world"
LIMITS = LimitsConfig(
    max_num_queued_reqs=None,
    max_num_queued_tokens=None,
    max_request_tokens=1000,
    max_stop_strings=4,
    max_stop_string_len=10,
    max_token_list_len=5,
    max_prompts_per_request=8,
    max_n=3,
)


@pytest.fixture
def inp(model_config: ModelConfig, tok: Tokenizer) -> InputProcessor:
    return InputProcessor(model_config, tok, limits=LIMITS, scheduling_policy="priority")


def _mutated(**changes: Any) -> SamplingParams:
    sp = SamplingParams(max_tokens=4)
    for name, value in changes.items():
        setattr(sp, name, value)
    return sp


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"top_p": 2}, "top_p"),
        ({"n": 0}, "n must be >= 1"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_params_changed_after_construction_are_validated_again(
    inp: InputProcessor, changes: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        inp.process(PROMPT, _mutated(**changes), "r")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": 2**64 - 2, "n": 3}, "seed"),  # the children's seeds seed + i
        ({"seed": -(2**63) - 1}, "seed"),
        ({"top_k": 2**64}, "top_k"),
        ({"logprobs": 2**70}, "logprobs"),
        ({"stop": ["ok", "\udc80"]}, "stop"),
        ({"bad_words": ["\ud800x"]}, "bad_words"),
    ],
)
def test_values_the_wire_cannot_carry_are_value_errors(
    inp: InputProcessor, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(max_tokens=4, **kwargs)
    sp = SamplingParams(max_tokens=4)
    for name, value in kwargs.items():
        setattr(sp, name, value)
    with pytest.raises(ValueError, match=match):
        inp.process(PROMPT, sp, "r")


def test_request_id_and_priority_must_fit_the_wire(inp: InputProcessor) -> None:
    with pytest.raises(ValueError, match="request_id"):
        inp.process(PROMPT, SamplingParams(max_tokens=4), "r\udc80")
    with pytest.raises(ValueError, match="priority"):
        inp.process(PROMPT, SamplingParams(max_tokens=4), "r", priority=2**64)


def test_what_passes_the_checks_encodes_for_the_wire(inp: InputProcessor) -> None:
    """The largest accepted values really cross the wire (the multiprocess transport's encoder);
    a huge top_k (a no-op) is dropped rather than handed to the sampler."""
    sp = SamplingParams(max_tokens=4, seed=2**64 - 3, n=3, top_k=2**64 - 1, stop=["é"])
    processed = inp.process(PROMPT, sp, "r", priority=-(2**63))
    for req in processed.core_requests:
        msgspec.msgpack.encode(AddRequest(req))
        assert req.sampling_params.top_k == 0


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stop": ["a", "b", "c", "d", "e"]}, r"stop: 5 strings exceed max_stop_strings=4"),
        ({"stop": "x" * 11}, r"max_stop_string_len=10"),
        ({"stop_token_ids": list(range(6))}, r"stop_token_ids: 6 entries exceed max_token_list_len=5"),
        ({"allowed_token_ids": list(range(6))}, r"allowed_token_ids: .*max_token_list_len=5"),
        ({"bad_words": ["w"] * 6}, r"bad_words: .*max_token_list_len=5"),
        ({"logit_bias": {i: 1.0 for i in range(6)}}, r"logit_bias: .*max_token_list_len=5"),
        ({"n": 4}, r"n: 4 exceeds max_n=3"),
    ],
)
def test_per_request_limits_are_checked_before_tokenizing(
    inp: InputProcessor, monkeypatch: pytest.MonkeyPatch, kwargs: dict[str, Any], match: str
) -> None:
    def no_tokenizing(*args: Any, **kw: Any) -> list[int]:
        raise AssertionError("tokenized before the limits were checked")

    monkeypatch.setattr(inp.tokenizer, "encode", no_tokenizing)
    with pytest.raises(ValueError, match=match):
        inp.process(PROMPT, SamplingParams(max_tokens=4, **kwargs), "r")


def test_at_the_limits_is_fine(inp: InputProcessor) -> None:
    sp = SamplingParams(
        max_tokens=4, stop=["x" * 10] * 4, stop_token_ids=list(range(5)), n=3,
        logit_bias={i: 1.0 for i in range(5)}, allowed_token_ids=list(range(5)),
    )
    assert len(inp.process(PROMPT, sp, "r").core_requests) == 3


def test_no_limits_without_a_limits_config(model_config: ModelConfig, tok: Tokenizer) -> None:
    sp = SamplingParams(max_tokens=4, stop=["x"] * 100, n=200)
    assert len(InputProcessor(model_config, tok).process(PROMPT, sp, "r").core_requests) == 200


def test_a_request_that_can_never_fit_the_kv_cache_is_refused(
    model_config: ModelConfig, tok: Tokenizer
) -> None:
    inp = InputProcessor(model_config, tok, kv_cache_tokens=32)
    ids = list(range(5, 25))  # 20 prompt tokens
    # 20 + 13 - 1 = 32 slots: fits exactly; one more token does not.
    inp.process({"prompt_token_ids": ids}, SamplingParams(max_tokens=13), "ok")
    with pytest.raises(ValueError, match=r"max_tokens: 14 .*KV cache.*32 tokens"):
        inp.process({"prompt_token_ids": ids}, SamplingParams(max_tokens=14), "too-long")
    with pytest.raises(ValueError, match=r"max_tokens: .*KV cache"):  # None: up to max_model_len
        inp.process({"prompt_token_ids": ids}, SamplingParams(max_tokens=None), "unbounded")
    with pytest.raises(ValueError, match=r"prompt: 40 tokens do not fit in the KV cache"):
        inp.process({"prompt_token_ids": list(range(5, 45))}, SamplingParams(max_tokens=1), "p")


def test_the_core_refuses_what_can_never_fit_its_kv_cache(tiny_model_dir: Path) -> None:
    config = EngineArgs(
        model=str(tiny_model_dir), max_model_len=128, block_size=16, num_gpu_blocks_override=2
    ).create_engine_config()
    core = EngineCore(config, runner=ScriptedRunner(config.model.vocab_size))

    def request(rid: str, max_tokens: int) -> EngineCoreRequest:
        return EngineCoreRequest(rid, list(range(5, 25)), SamplingParams(max_tokens=max_tokens))

    with pytest.raises(ValueError, match="max_tokens: 14 .* KV cache"):
        core.add_request(request("big", 14))
    assert not core.has_unfinished_requests()
    core.add_request(request("fits", 13))  # exactly 32 slots: runs to the end
    outs = []
    while core.has_unfinished_requests():
        outs.extend(core.step())
    assert sum(len(o.new_token_ids) for o in outs) == 13
    assert core.statistics().num_preemptions == 0


def test_max_logprobs_minus_one_is_clamped_to_the_vocabulary(model_config: ModelConfig, tok: Tokenizer) -> None:
    """`max_logprobs=-1` means "up to the vocabulary", never past it (the sampler's top-k over
    more than the vocabulary would fail the whole step); -1 asks for all of it."""
    inp = InputProcessor(model_config, tok, max_logprobs=-1)
    vocab = model_config.vocab_size
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"{name}: {vocab + 1} exceeds the vocabulary \({vocab} tokens\)"):
            inp.process(PROMPT, SamplingParams(max_tokens=2, **{name: vocab + 1}), "r")
        assert inp.process(PROMPT, SamplingParams(max_tokens=2, **{name: -1}), "r").params is not None
        assert inp.process(PROMPT, SamplingParams(max_tokens=2, **{name: vocab}), "r").params is not None


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "integer", "maximum": 2**64 + 5}, "maximum"),
        ({"default": 10**30}, "default"),
        ({"enum": [1, 2, -(2**63) - 1]}, r"enum\[2\]"),
        ({"properties": {"a": {"const": 2**70}}}, r"properties\.a\.const"),
    ],
)
def test_json_schemas_with_integers_the_wire_cannot_carry_are_refused(schema: dict[str, object], where: str) -> None:
    with pytest.raises(
        ValueError, match=rf"structured_outputs\.json\.{where}: integers must be in \[-2\*\*63, 2\*\*64\)"
    ):
        StructuredOutputsParams(json=schema)
    edge = StructuredOutputsParams(json={"type": "integer", "maximum": 2**64 - 1, "minimum": -(2**63)})
    msgspec.msgpack.encode(SamplingParams(structured_outputs=edge))


def test_json_schemas_too_deep_or_not_json_are_refused() -> None:
    deep: dict[str, object] = {}
    node = deep
    for _ in range(70):
        node["items"] = node = {}
    with pytest.raises(ValueError, match="structured_outputs.json: nested more than 64 levels deep"):
        StructuredOutputsParams(json=deep)
    with pytest.raises(ValueError, match="must be JSON data, got a set"):
        StructuredOutputsParams(json={"enum": {1, 2}})
    with pytest.raises(ValueError, match="object keys must be strings"):
        StructuredOutputsParams(json={"properties": {1: {}}})


def test_request_ids_are_bounded(inp: InputProcessor) -> None:
    assert inp.process(PROMPT, SamplingParams(max_tokens=2), "r" * 512).request_id == "r" * 512
    with pytest.raises(ValueError, match="request_id: 513 characters exceed the limit of 512"):
        inp.process(PROMPT, SamplingParams(max_tokens=2), "r" * 513)


def test_a_non_zero_priority_needs_the_priority_policy(model_config: ModelConfig, tok: Tokenizer) -> None:
    fcfs = InputProcessor(model_config, tok)
    assert fcfs.process(PROMPT, SamplingParams(max_tokens=2), "r", priority=0).core_requests[0].priority == 0
    with pytest.raises(ValueError, match=r"priority: got -5, but priority scheduling is not enabled"):
        fcfs.process(PROMPT, SamplingParams(max_tokens=2), "r", priority=-5)
    prio = InputProcessor(model_config, tok, scheduling_policy="priority")
    assert prio.process(PROMPT, SamplingParams(max_tokens=2), "r", priority=-5).core_requests[0].priority == -5


def test_what_one_request_holds_is_budgeted(inp: InputProcessor) -> None:
    """n sequences, each with its own prompt and token lists: `max_request_tokens` (1000 here;
    max_n is 3 and max_model_len 64, so the lists make the difference)."""
    many = InputProcessor(inp.model_config, inp.tokenizer, limits=_limits_with(max_request_tokens=100))
    prompt = {"prompt_token_ids": [5] * 30}
    assert len(many.process(prompt, SamplingParams(max_tokens=2, n=3), "r").core_requests) == 3  # 90
    with pytest.raises(
        ValueError,
        match=(
            r"n: 3 sequences x \(30 prompt tokens \+ 4 token-list entries\) = 102 tokens exceed "
            r"max_request_tokens=100"
        ),
    ):
        many.process(prompt, SamplingParams(max_tokens=2, n=3, stop_token_ids=[1] * 4), "r")
    assert len(many.process(prompt, SamplingParams(max_tokens=2, n=1, stop_token_ids=[1] * 4), "r").core_requests) == 1


def _limits_with(**kw: Any) -> LimitsConfig:
    return dataclasses.replace(LIMITS, **kw)


def test_a_token_id_prompt_too_long_is_refused_before_its_ids_are_walked(inp: InputProcessor) -> None:
    """The length is known without walking the list: a 5M-entry prompt is refused at once (the
    entries here are not even ints; walking them would say so instead)."""
    with pytest.raises(ValueError, match="prompt: 5000000 tokens exceeds max_model_len"):
        inp.process({"prompt_token_ids": [None] * 5_000_000}, SamplingParams(max_tokens=2), "r")
