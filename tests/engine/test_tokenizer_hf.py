"""`get_tokenizer()` answers what vLLM scripts ask of a transformers tokenizer, compared with
transformers' `AutoTokenizer` on the tiny model and on the bundled SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers

from triollm.engine.processing.tokenizer import Tokenizer

TEXTS = ["Hello world", "  spaces  and\ttabs\n", "Héllo wörld! 日本語 😀", "<|im_start|>user", ""]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module", params=["tiny", "bundled"])
def pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, transformers.PreTrainedTokenizerBase]:
    path: Path = request.getfixturevalue(
        f"{request.param}_model_dir" if request.param == "tiny" else "bundled_model_dir"
    )
    return Tokenizer.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)


def test_encode_call_len_and_vocab(pair: tuple[Tokenizer, transformers.PreTrainedTokenizerBase]) -> None:
    ours, hf = pair
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(text, add_special_tokens=special)
        assert ours(text)["input_ids"] == hf(text)["input_ids"]
        assert ours(text)["attention_mask"] == hf(text)["attention_mask"]
        assert ours.tokenize(text) == hf.tokenize(text)
    assert ours(TEXTS)["input_ids"] == hf(TEXTS)["input_ids"]
    assert len(ours) == len(hf)
    assert ours.vocab_size == hf.vocab_size
    assert ours.get_vocab() == hf.get_vocab()
    assert ours.max_token_id == max(hf.get_vocab().values())


def test_special_tokens(pair: tuple[Tokenizer, transformers.PreTrainedTokenizerBase]) -> None:
    ours, hf = pair
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        assert getattr(ours, name) == getattr(hf, name), name
        assert getattr(ours, f"{name}_id") == getattr(hf, f"{name}_id"), name
    # transformers lists the named special tokens; ours also every special added token (the
    # ones decode(skip_special_tokens=True) drops).
    assert set(hf.all_special_ids) <= set(ours.all_special_ids)
    assert set(hf.all_special_tokens) <= set(ours.all_special_tokens)


def test_decode_and_token_conversion(pair: tuple[Tokenizer, transformers.PreTrainedTokenizerBase]) -> None:
    ours, hf = pair
    batch = [hf.encode(t) for t in TEXTS] + [[ours.eos_token_id, *hf.encode("after eos")]]
    for ids in batch:
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        tokens = hf.convert_ids_to_tokens(ids)
        assert ours.convert_ids_to_tokens(ids) == tokens
        assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
        assert ours.convert_tokens_to_string(tokens) == hf.convert_tokens_to_string(tokens)
    assert ours.batch_decode(batch) == hf.batch_decode(batch)
    assert ours.batch_decode(batch, skip_special_tokens=True) == hf.batch_decode(batch, skip_special_tokens=True)
    eos = hf.eos_token
    assert ours.convert_tokens_to_ids(eos) == hf.convert_tokens_to_ids(eos)
    assert ours.convert_tokens_to_ids("no-such-token-xyz") == hf.convert_tokens_to_ids("no-such-token-xyz")


def test_apply_chat_template(pair: tuple[Tokenizer, transformers.PreTrainedTokenizerBase]) -> None:
    ours, hf = pair
    for gen in (True, False):
        text = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        assert text == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        ids = ours.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=gen, return_dict=False)
        assert ids == hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=gen, return_dict=False)
        as_dict = ours.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=gen, return_dict=True)
        expected = hf.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=gen, return_dict=True)
        assert isinstance(as_dict, dict)
        assert as_dict["input_ids"] == expected["input_ids"]
        assert as_dict["attention_mask"] == expected["attention_mask"]
    last = [*CHAT, {"role": "assistant", "content": "Paris"}]
    assert ours.apply_chat_template(last, tokenize=False, continue_final_message=True) == hf.apply_chat_template(
        last, tokenize=False, continue_final_message=True
    )


def test_defaults_are_transformers(pair: tuple[Tokenizer, transformers.PreTrainedTokenizerBase]) -> None:
    """A script that leaves the arguments out gets what transformers gives it."""
    ours, hf = pair
    expected = hf.apply_chat_template(CHAT)
    got = ours.apply_chat_template(CHAT)
    assert isinstance(got, dict)
    assert got["input_ids"] == expected["input_ids"]
    ids = [*hf.encode("a b"), ours.eos_token_id]
    assert ours.decode(ids) == hf.decode(ids)
    assert ours.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])
