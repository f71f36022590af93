"""SamplingParams validation, normalisation, msgspec round trips and constructors."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from triollm.engine.sampling_params import SamplingParams, SamplingType

INVALID: list[tuple[str, Any]] = [
    ("n", 0),
    ("n", -1),
    ("n", 1.5),
    ("presence_penalty", -2.01),
    ("presence_penalty", 2.01),
    ("presence_penalty", float("nan")),
    ("frequency_penalty", -3.0),
    ("frequency_penalty", 2.5),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")),
    ("temperature", -0.1),
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", "hot"),
    ("top_p", 0.0),
    ("top_p", 1.01),
    ("top_p", -0.5),
    ("top_k", -2),
    ("top_k", 2.5),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("min_tokens", -1),
    ("logprobs", -2),
    ("prompt_logprobs", -2),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", [1]),
    ("stop_token_ids", [1, "2"]),
    ("stop_token_ids", 3),
    ("logit_bias", {"x": 1.0}),
    ("logit_bias", {1.5: 1.0}),
    ("logit_bias", {1: "big"}),
    ("logit_bias", {1: float("nan")}),
    ("allowed_token_ids", []),
    ("allowed_token_ids", [1, None]),
    ("seed", 1.5),
    ("seed", "7"),
    ("bad_words", [3]),
]


@pytest.mark.parametrize(("field", "value"), INVALID)
def test_invalid_values_raise_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n": 1},
        {"n": 4, "temperature": 0.0},  # n > 1 with greedy is allowed
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"presence_penalty": 2, "frequency_penalty": -2},
        {"repetition_penalty": 1e-3},
        {"repetition_penalty": 10.0},
        {"temperature": 0.0},
        {"temperature": 100.0},
        {"top_p": 1e-6},
        {"top_p": 1.0},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"max_tokens": None},
        {"max_tokens": 1},
        {"min_tokens": 5, "max_tokens": 5},
        {"min_tokens": 1000, "max_tokens": None},
        {"logprobs": 0, "prompt_logprobs": 0},
        {"logprobs": -1, "prompt_logprobs": -1},
        {"seed": 0},
        {"seed": -3},
        {"allowed_token_ids": [0]},
        {"bad_words": []},
    ],
)
def test_valid_edge_values_accepted(kwargs: dict[str, Any]) -> None:
    p = SamplingParams(**kwargs)
    for key, value in kwargs.items():
        assert getattr(p, key) == value


def test_min_tokens_above_max_tokens_names_both() -> None:
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens=4"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_stop_strings_need_detokenize() -> None:
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=["x"], detokenize=False)
    SamplingParams(detokenize=False)


def test_normalisation() -> None:
    p = SamplingParams(top_k=-1, stop="END", logit_bias={"5": 250.0, 7: -1e9, 3: 0.5})
    assert p.top_k == 0
    assert p.stop == ["END"]
    assert p.stop_token_ids == []
    assert p.logit_bias == {5: 100.0, 7: -100.0, 3: 0.5}
    assert SamplingParams().stop == []
    assert SamplingParams(temperature=1).temperature == 1.0
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_greedy_detection_and_truncation_reset() -> None:
    g = SamplingParams(temperature=1e-6, top_k=5, top_p=0.5, min_p=0.3)
    assert g.is_greedy and g.sampling_type is SamplingType.GREEDY
    assert (g.top_k, g.top_p, g.min_p) == (0, 1.0, 0.0)
    assert SamplingParams(temperature=1e-5).sampling_type is SamplingType.RANDOM
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(temperature=0.0, seed=3).sampling_type is SamplingType.GREEDY


@pytest.mark.parametrize("codec", [msgspec.json, msgspec.msgpack])
def test_msgspec_round_trip(codec: Any) -> None:
    p = SamplingParams(
        n=3,
        temperature=0.7,
        top_k=-1,
        top_p=0.9,
        seed=11,
        stop="stop",
        stop_token_ids=[2, 3],
        max_tokens=None,
        logprobs=-1,
        logit_bias={"4": 500.0},
        allowed_token_ids=[1, 2, 4],
        bad_words=["bad"],
    )
    decoded = codec.decode(codec.encode(p), type=SamplingParams)
    assert decoded == p
    assert decoded.logit_bias == {4: 100.0}
    assert codec.decode(codec.encode(SamplingParams()), type=SamplingParams) == SamplingParams()


@pytest.mark.parametrize(
    "payload",
    [
        b'{"temperature": -1}',
        b'{"top_p": 0}',
        b'{"n": 0}',
        b'{"top_k": -5}',
        b'{"min_tokens": 9, "max_tokens": 3}',
        b'{"stop": [""]}',
        b'{"allowed_token_ids": []}',
    ],
)
def test_decode_of_invalid_values_raises(payload: bytes) -> None:
    with pytest.raises(ValueError):  # msgspec.ValidationError subclasses ValueError
        msgspec.json.decode(payload, type=SamplingParams)


def test_json_logit_bias_string_keys() -> None:
    p = msgspec.json.decode(b'{"logit_bias": {"12": -101}}', type=SamplingParams)
    assert p.logit_bias == {12: -100.0}


def test_verify_token_ids() -> None:
    SamplingParams(
        stop_token_ids=[0, 9], allowed_token_ids=[9], logit_bias={0: 1}
    ).verify_token_ids(10)
    for field, kwargs in [
        ("stop_token_ids", {"stop_token_ids": [10]}),
        ("allowed_token_ids", {"allowed_token_ids": [-1]}),
        ("logit_bias", {"logit_bias": {"10": 1.0}}),
    ]:
        with pytest.raises(ValueError, match=rf"{field}.*\[0, 10\)"):
            SamplingParams(**kwargs).verify_token_ids(10)


def test_clone_is_deep() -> None:
    p = SamplingParams(stop=["a"], logit_bias={1: 1.0})
    c = p.clone()
    assert c == p
    assert isinstance(c.stop, list)
    c.stop.append("b")
    assert p.stop == ["a"]


def test_from_optional() -> None:
    p = SamplingParams.from_optional(temperature=None, top_p=0.5, seed=None, n=None)
    assert p == SamplingParams(top_p=0.5)
    assert SamplingParams.from_optional(max_tokens=None).max_tokens is None
    assert SamplingParams.from_optional().max_tokens == 16


def test_with_defaults() -> None:
    gen_config = {
        "temperature": 0.6,
        "top_p": 0.9,
        "max_new_tokens": 64,
        "bos_token_id": 1,
        "top_k": None,
    }
    p = SamplingParams.with_defaults(gen_config, top_p=0.5)
    assert (p.temperature, p.top_p, p.max_tokens, p.top_k) == (0.6, 0.5, 64, 0)
    assert SamplingParams.with_defaults(gen_config, max_tokens=None).max_tokens is None
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams.with_defaults({}, temperature=-1)
