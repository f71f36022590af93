"""Structured outputs (engine/structured_outputs.py): the params, the grammar checks, the bitmask,
the core's matchers (preemption included), and real generations that follow JSON schemas,
choices, regexes and grammars on the bundled model and, under hypothesis, on the tiny one."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import msgspec
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from triollm import LLM, SamplingParams
from triollm.engine.config import EngineArgs
from triollm.engine.core import EngineCore
from triollm.engine.execution.sampler import Sampler, SamplingRow
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from triollm.engine.structured_outputs import GrammarCompiler, apply_bitmask, check, fill_bitmask

S = StructuredOutputsParams
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Berlin", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}

# ------------------------------------------------------------------------------------ params


def test_exactly_one_constraint_and_vllm_names() -> None:
    with pytest.raises(ValueError, match="structured_outputs: set exactly one of .*none is set"):
        S()
    with pytest.raises(ValueError, match=r"2 are \(json, regex\)"):
        S(json={}, regex="a")
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        S(choice=[])
    params = SamplingParams(guided_decoding=GuidedDecodingParams(choice=["a", "b"]))
    assert params.structured_outputs == S(choice=["a", "b"]) and params.guided_decoding is None
    wire = msgspec.msgpack.decode(
        msgspec.msgpack.encode(SamplingParams(structured_outputs=S(json=PERSON))), type=SamplingParams
    )
    assert wire.structured_outputs == S(json=PERSON)


@pytest.mark.parametrize(
    ("so", "field", "fragment"),
    [
        (S(json={"type": "bogus"}), "structured_outputs.json", "Invalid type"),
        (S(json="{not json"), "structured_outputs.json", "not valid JSON"),
        (S(regex="(unclosed"), "structured_outputs.regex", "regex"),
        (S(grammar="start: undefined_rule"), "structured_outputs.grammar", "undefined_rule"),
    ],
)
def test_invalid_grammars_name_the_field(so: StructuredOutputsParams, field: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)) as info:
        check(so)
    assert fragment in str(info.value)
    with pytest.raises(ValueError, match="^response_format: "):
        check(so if so.kind != "json" or isinstance(so.json, dict) else S(json={"type": "bogus"}), "response_format")


def test_valid_grammars_of_every_kind() -> None:
    for so in (S(json=PERSON), S(json=json.dumps(PERSON)), S(json_object=True), S(regex=r"\d+"), S(choice=["a", "b"]),
               S(grammar='root ::= "x" | "y"'), S(grammar='start: "x" | "y"')):
        assert check(so)


# ------------------------------------------------------------------------------------ bitmask


def test_apply_bitmask_masks_exactly_the_clear_bits() -> None:
    vocab = 40  # two 32-bit words, the second partly used
    allowed = [{0, 5, 31, 32, 39}, {7}]
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    for row, ids in enumerate(allowed):
        for t in ids:
            word = int(bitmask[row, t // 32]) | (1 << (t % 32))
            bitmask[row, t // 32] = word - (1 << 32) if word >= 1 << 31 else word  # int32 wrap
    logits = torch.randn(2, vocab)
    out = apply_bitmask(logits, bitmask)
    for row, ids in enumerate(allowed):
        for t in range(vocab):
            assert (out[row, t] == logits[row, t]) if t in ids else out[row, t] == float("-inf")


def test_fill_bitmask_follows_the_matcher_on_a_tiny_vocabulary(tiny_model_dir: Path) -> None:
    """The matcher's mask over the tiny model's 384-token byte-level vocabulary allows exactly
    the tokens that keep the text a prefix of one of the choices."""
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    compiler = GrammarCompiler(tiny_model_dir, tok.vocab_size)
    matcher = compiler.matcher(S(choice=["cat", "car"]), [tok.eos_token_id])
    bitmask = fill_bitmask([matcher], tok.vocab_size)
    logits = apply_bitmask(torch.zeros(1, tok.vocab_size), bitmask)
    allowed = {t for t in range(tok.vocab_size) if logits[0, t] == 0}
    expected = {
        t for t in range(tok.vocab_size) if (s := tok.decode([t])) and any(c.startswith(s) for c in ("cat", "car"))
    }
    assert allowed == expected and allowed
    # The sampler masks only the rows that have a grammar.
    rows = [_row(None), _row(matcher)]
    out = Sampler()(torch.randn(2, tok.vocab_size), rows)
    assert out.token_ids[1] in expected


def _row(grammar: Any) -> SamplingRow:
    return SamplingRow(SamplingParams(temperature=0.0), [1], [], [], [], grammar=grammar)


def test_compiled_grammars_are_cached_and_each_request_gets_its_own_matcher(tiny_model_dir: Path) -> None:
    compiler = GrammarCompiler(tiny_model_dir, 384)
    a = compiler.matcher(S(regex="ab+"), [0])
    b = compiler.matcher(S(regex="ab+"), [0])
    assert len(compiler._compiled) == 1 and a is not b
    assert a.consume_token(Tokenizer.from_pretrained(tiny_model_dir).encode("a", add_special_tokens=False)[0])
    assert not b.is_stopped() and b.matcher.rollback(0)  # b did not move with a


# ------------------------------------------------------------------------------------ the core


def test_preempted_requests_keep_their_matcher_state(tiny_model_dir: Path) -> None:
    """Few KV blocks: requests are preempted and recomputed mid-document; each output still
    follows its grammar (a preempted request keeps its tokens, so its matcher stays valid)."""
    args = EngineArgs(
        model=str(tiny_model_dir), seed=0, max_model_len=160, num_gpu_blocks_override=12, enforce_eager=True
    )
    core = EngineCore(args.create_engine_config())
    tok = Tokenizer.from_pretrained(tiny_model_dir)
    schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 999},
        "minItems": 12,
        "maxItems": 12,
    }
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=120, structured_outputs=S(json=schema, disable_any_whitespace=True)
    )
    out: dict[str, list[int]] = {}
    for i in range(6):
        core.add_request(EngineCoreRequest(str(i), [5 + i] * 30, params.clone(), eos_token_ids=[tok.eos_token_id]))
        out[str(i)] = []
    reasons = {}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            out[o.request_id] += o.new_token_ids
            if o.finish_reason is not None:
                reasons[o.request_id] = str(o.finish_reason)
    assert core.statistics().num_preemptions > 0
    for rid, ids in out.items():
        assert reasons[rid] == "stop", (rid, tok.decode(ids))
        doc = json.loads(tok.decode(ids))
        jsonschema.validate(doc, schema)


def test_a_grammar_that_does_not_compile_in_the_core_ends_only_its_request(tiny_model_dir: Path) -> None:
    args = EngineArgs(model=str(tiny_model_dir), seed=0, max_model_len=64, enforce_eager=True)
    core = EngineCore(args.create_engine_config())
    core.add_request(EngineCoreRequest("bad", [5, 6], SamplingParams(max_tokens=4, structured_outputs=S(regex="(x"))))
    core.add_request(EngineCoreRequest("good", [5, 6], SamplingParams(max_tokens=4)))
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert [(o.request_id, str(o.finish_reason)) for o in outs if o.request_id == "bad"] == [("bad", "error")]
    assert "regex" in next(str(o.stop_reason) for o in outs if o.request_id == "bad")
    assert sum(len(o.new_token_ids) for o in outs if o.request_id == "good") == 4
    assert "bad" not in core.requests and core.statistics().num_free_blocks == core.statistics().num_blocks
    core.close()


# ------------------------------------------------------------------------------------ the bundled model


@pytest.fixture(scope="module")
def bundled_llm(bundled_model_dir: Path) -> Any:
    with LLM(str(bundled_model_dir), max_model_len=512, num_threads=2, seed=0) as llm:
        yield llm


def _chat(llm: Any, text: str) -> str:
    return str(
        llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    )


def test_json_schema_outputs_parse_and_validate_for_20_prompts(bundled_llm: Any) -> None:
    people = ["a baker", "a pilot", "a child", "a teacher", "a poet"]
    prompts = [
        _chat(bundled_llm, f"Invent {p} number {i} as JSON with name, age and city.") for i, p in enumerate(people * 4)
    ]
    params = SamplingParams(temperature=0.7, seed=7, max_tokens=64, structured_outputs=S(json=PERSON))
    outs = bundled_llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 20
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)


def test_choice_regex_grammar_and_n_on_the_bundled_model(bundled_llm: Any) -> None:
    prompts = [_chat(bundled_llm, q) for q in ("Is the sky blue?", "Is fire cold?", "What is 2+2?")]
    choice = SamplingParams(
        temperature=1.0, n=3, seed=1, max_tokens=8, structured_outputs=S(choice=["yes", "no", "unsure"])
    )
    for o in bundled_llm.generate(prompts, choice, use_tqdm=False):
        assert len(o.outputs) == 3
        assert all(c.text in ("yes", "no", "unsure") and c.finish_reason == "stop" for c in o.outputs)
    phone = SamplingParams(  # \d is any Unicode digit: a byte-level one takes several tokens
        temperature=0.8, seed=2, max_tokens=64, structured_outputs=S(regex=r"\(\d{3}\) \d{3}-\d{4}")
    )
    for o in bundled_llm.generate(prompts, phone, use_tqdm=False):
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", o.outputs[0].text)
    gbnf = SamplingParams(
        temperature=0.0,
        max_tokens=16,
        structured_outputs=S(grammar='root ::= ("red" | "green") " " ("apple" | "pear")'),
    )
    for o in bundled_llm.generate(prompts, gbnf, use_tqdm=False):
        assert re.fullmatch(r"(red|green) (apple|pear)", o.outputs[0].text)
    obj = SamplingParams(
        temperature=0.0, max_tokens=48, structured_outputs=S(json_object=True, disable_any_whitespace=True)
    )
    (o,) = bundled_llm.generate(prompts[:1], obj, use_tqdm=False)
    if o.outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(o.outputs[0].text), dict)
    else:  # a long object cut by max_tokens: still a prefix of one
        assert o.outputs[0].text.startswith("{")


def test_invalid_schema_is_refused_before_the_engine(bundled_llm: Any) -> None:
    with pytest.raises(ValueError, match="structured_outputs.json"):
        bundled_llm.generate(
            ["x"],
            SamplingParams(structured_outputs=S(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}})),
            use_tqdm=False,
        )
    (o,) = bundled_llm.generate(["Hello"], SamplingParams(max_tokens=2), use_tqdm=False)  # the engine goes on
    assert len(o.outputs[0].token_ids) == 2


# ------------------------------------------------------------------------------------ hypothesis


def _schemas(depth: int = 2) -> st.SearchStrategy[dict[str, Any]]:
    leaves = st.one_of(
        st.just({"type": "boolean"}),
        st.just({"type": "null"}),
        st.integers(-50, 50).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 100}),
        st.integers(1, 6).map(lambda n: {"type": "string", "maxLength": n}),
        st.lists(st.sampled_from(["a", "b", "xy", "z z"]), min_size=1, max_size=3, unique=True).map(
            lambda e: {"enum": e}
        ),
    )
    if depth == 0:
        return leaves
    inner = _schemas(depth - 1)
    objects = st.dictionaries(st.sampled_from(["k", "name", "v1", "list"]), inner, min_size=1, max_size=3).map(
        lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
    )
    arrays = inner.map(lambda items: {"type": "array", "items": items, "maxItems": 3})
    return st.one_of(leaves, objects, arrays)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model_dir: Path) -> Any:
    with LLM(str(tiny_model_dir), max_model_len=512, num_threads=1, seed=0) as llm:
        yield llm


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=_schemas(), seed=st.integers(0, 2**16))
def test_random_schemas_always_yield_valid_documents(tiny_llm: Any, schema: dict[str, Any], seed: int) -> None:
    """The tiny random model picks arbitrary allowed tokens; bounded schemas (and no free
    whitespace) bound the document, so every output completes within max_tokens and validates."""
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema)) == ""
    params = SamplingParams(
        n=2, temperature=1.0, seed=seed, max_tokens=400, structured_outputs=S(json=schema, disable_any_whitespace=True)
    )
    (out,) = tiny_llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)
    for c in out.outputs:
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_a_grammar_starts_after_its_start_tokens(tiny_llm: Any) -> None:
    """`start_after_token_ids` (a reasoning model's end-of-thinking marker): the output is free,
    token for token the unconstrained one, until it ends with those ids; then the grammar holds.
    Ids that never come leave the whole output free."""
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    free = tiny_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[
        0
    ].outputs[0]
    marker = list(free.token_ids[1:3])
    gated = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=S(choice=["yes", "no"], start_after_token_ids=marker)
    )
    out = tiny_llm.generate(prompt, gated, use_tqdm=False)[0].outputs[0]
    assert list(out.token_ids[:3]) == list(free.token_ids[:3]) and out.finish_reason == "stop"
    head = tiny_llm.get_tokenizer().decode(list(free.token_ids[:3]))
    assert out.text.startswith(head) and out.text[len(head) :] in ("yes", "no")
    never = SamplingParams(
        temperature=0,
        max_tokens=6,
        ignore_eos=True,
        structured_outputs=S(choice=["yes"], start_after_token_ids=[999_999]),
    )
    assert list(tiny_llm.generate(prompt, never, use_tqdm=False)[0].outputs[0].token_ids) == list(free.token_ids)
    with pytest.raises(ValueError, match="start_after_token_ids"):
        S(choice=["yes"], start_after_token_ids=[])
