"""Tokenizer (encode/decode, chat templates, BOS handling) and the incremental detokenizer."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tinymodel import CHATML
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from triollm.engine.processing.detokenizer import IncrementalDetokenizer
from triollm.engine.processing.tokenizer import Tokenizer

TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces and trailing  ",
    "Héllo wörld! Ça va? Naïve café",
    "日本語 テキスト",
    "emoji 😀🎉 mixed 👩‍💻 text",
    "",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
]


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tiny_model_dir)


def _variant(
    src: Path, dst: Path, *, post_bos: bool = False, jinja: str | None = None, **config: Any
) -> Path:
    """A copy of the tiny tokenizer with tokenizer_config.json fields replaced."""
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", dst / "tokenizer.json")
    base = json.loads((src / "tokenizer_config.json").read_text())
    base.update(config)
    (dst / "tokenizer_config.json").write_text(json.dumps(base))
    if post_bos:
        backend = HFTokenizer.from_file(str(dst / "tokenizer.json"))
        backend.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
        )
        backend.save(str(dst / "tokenizer.json"))
    if jinja is not None:
        (dst / "chat_template.jinja").write_text(jinja)
    return dst


# ------------------------------------------------------------------------------ basics


def test_properties(tok: Tokenizer) -> None:
    assert tok.vocab_size == 384
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.bos_token is None and tok.bos_token_id is None
    assert tok.all_special_ids == [0, 1, 2]
    assert tok.convert_ids_to_tokens([1, 2]) == ["<|im_start|>", "<|im_end|>"]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_decode(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


# ------------------------------------------------------------------------------ chat templates


def test_chatml_with_generation_prompt(tok: Tokenizer) -> None:
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    bare = tok.apply_chat_template(MESSAGES, tokenize=False)
    assert bare + "<|im_start|>assistant\n" == text


def test_continue_final_message(tok: Tokenizer) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "The answer is"}]
    text = tok.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe answer is")
    ids = tok.encode_chat(messages, continue_final_message=True)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_text_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    text = tok.apply_chat_template([{"role": "user", "content": parts}], tokenize=False)
    assert text == "<|im_start|>user\nHi\nthere<|im_end|>\n"
    with pytest.raises(ValueError, match="image_url"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}], tokenize=False)


def test_template_helpers(tok: Tokenizer) -> None:
    template = (
        "{% generation %}{{ messages | tojson }}{% endgeneration %}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}!{% endfor %}"
        "{{ strftime_now('%Y')|length }}{{ eos_token }}"
    )
    text = tok.apply_chat_template([{"role": "user", "content": "<a> é"}], tokenize=False, chat_template=template)
    assert text == '[{"role": "user", "content": "<a> é"}]!4<|endoftext|>'
    failing = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.apply_chat_template(MESSAGES, tokenize=False, chat_template=failing)


def test_missing_template(tiny_model_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer.from_pretrained(_variant(tiny_model_dir, tmp_path, chat_template=None))
    with pytest.raises(ValueError, match="chat_template"):
        tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)


def test_template_sources(tiny_model_dir: Path, tmp_path: Path) -> None:
    listed = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 }}"}]
    tok = Tokenizer.from_pretrained(_variant(tiny_model_dir, tmp_path / "a", chat_template=listed))
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == "D1"
    tok = Tokenizer.from_pretrained(_variant(tiny_model_dir, tmp_path / "b", jinja="J{{ 2 }}"))
    assert (
        tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == "J2"
    )  # chat_template.jinja wins over the config
    (tmp_path / "t.jinja").write_text("F{{ 3 }}")
    tok = Tokenizer.from_pretrained(tiny_model_dir, chat_template=str(tmp_path / "t.jinja"))
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == "F3"
    tok = Tokenizer.from_pretrained(tiny_model_dir, chat_template="S{{ 4 }}")
    assert tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == "S4"


# ------------------------------------------------------------------------------ BOS


def test_encode_chat_exactly_one_bos(tiny_model_dir: Path, tmp_path: Path) -> None:
    bos_template = "{{ bos_token }}" + CHATML
    tok = Tokenizer.from_pretrained(
        _variant(
            tiny_model_dir,
            tmp_path / "a",
            bos_token={"content": "<|endoftext|>"},
            add_bos_token=True,
            chat_template=bos_template,
        )
    )
    assert tok.bos_token_id == 0 and tok.adds_bos_token
    assert tok.encode("hi")[0] == 0 and tok.encode("hi")[1] != 0
    assert tok.encode("hi", add_special_tokens=False)[0] != 0
    ids = tok.encode_chat(MESSAGES)
    assert ids[0] == 0 and ids[1] != 0
    # A template that does not emit BOS gets exactly one prepended.
    ids = tok.encode_chat(MESSAGES, chat_template=CHATML)
    assert ids[0] == 0 and ids[1] == 1


def test_post_processor_bos_not_doubled(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = _variant(
        tiny_model_dir, tmp_path, post_bos=True, bos_token="<|endoftext|>", add_bos_token=True
    )
    tok = Tokenizer.from_pretrained(path)
    ids = tok.encode("hi")
    assert ids[0] == 0 and ids[1] != 0
    chat = tok.encode_chat(MESSAGES)
    assert chat[:2] == [0, 1]


def test_no_bos_tokenizer(tok: Tokenizer) -> None:
    assert not tok.adds_bos_token
    assert tok.encode_chat(MESSAGES)[0] == 1  # <|im_start|>


# ------------------------------------------------------------------------------ detokenizer


def _stream(
    tok: Tokenizer, prompt: list[int], ids: list[int], skip: bool = True, chunk: int = 1
) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, skip)
    pieces = [detok.step(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return [*pieces, detok.flush()]


@pytest.mark.parametrize("text", ["😀🎉 日本語 テキスト", " leading space", "👩‍💻 Naïve café"])
def test_detokenizer_multibyte(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # some characters span several tokens
    pieces = _stream(tok, tok.encode("The capital"), ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)  # an incomplete character is never emitted


def test_detokenizer_incomplete_tail_flushed(tok: Tokenizer) -> None:
    ids = tok.encode("ok 😀")[:-1]  # the emoji's last byte never arrives
    pieces = _stream(tok, [], ids)
    assert pieces[-1].endswith("\ufffd")
    assert "".join(pieces) == tok.decode(ids)


_PLAIN_IDS = st.lists(st.integers(3, 383), max_size=30)
_ANY_IDS = st.lists(st.integers(0, 383), max_size=30)


@settings(max_examples=150, deadline=None)
@given(ids=_PLAIN_IDS, chunk=st.integers(1, 3))
def test_detokenizer_matches_full_decode(tok: Tokenizer, ids: list[int], chunk: int) -> None:
    prompt = tok.encode("The capital of France is")
    assert "".join(_stream(tok, prompt, ids, chunk=chunk)) == tok.decode(ids)


@settings(max_examples=100, deadline=None)
@given(ids=_ANY_IDS, skip=st.booleans())
def test_detokenizer_special_tokens(tok: Tokenizer, ids: list[int], skip: bool) -> None:
    prompt = tok.encode("<|im_start|>assistant\n")
    assert "".join(_stream(tok, prompt, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


def test_detokenizer_metaspace_leading_space() -> None:
    """Sentencepiece-style decoders drop the first token's space; prompt context restores it."""
    backend = HFTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    corpus = ["The capital of France is Paris. Paris is nice."] * 3
    trainer = trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"], show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    tok = Tokenizer(backend)
    prompt, output = tok.encode("The capital"), tok.encode("Paris is nice")
    assert tok.decode(output) == "Paris is nice"
    assert "".join(_stream(tok, prompt, output)) == " Paris is nice"
