"""Every `tokenizer.ggml.pre` name the GGUF import knows gives llama.cpp's own tokens.

A byte-level BPE vocabulary is split into pieces before merging by a pre-tokenizer that the file
names only (`tokenizer.ggml.pre`: "llama-bpe", "qwen2", "gpt-4o", "deepseek-v3", ...);
engine/loading/gguf_vocab.py rebuilds each as the source tokenizer.json's split regexes. Here the
bundled SmolLM2 vocabulary (49,152 tokens and its merges), plus tokens for 2- and 3-digit numbers
(the vocabulary has digits only) and two that no chain of merges builds, is written into a
vocabulary-only GGUF once per distinct pre-tokenizer (the names that share one are aliases:
llama.cpp maps them to one type), and llama.cpp (the test build of
tests/llama_cpp_convert.py, `llama_tokenize` on the file) and `build_tokenizer` tokenize the same
texts: contractions in both cases, capitalised and all-capital words, digit runs, code and its
indentation, blank lines, accents (also as combining marks), CJK, Cyrillic, Arabic, emoji. Same
vocabulary, same merges: any difference is the pre-tokenizer's (or `ignore_merges`: a piece in the
vocabulary taken whole).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFWriter
from llama_cpp_convert import llama_cpp_tokenize

from triollm.engine.loading.gguf_arch import GGUFMeta
from triollm.engine.loading.gguf_vocab import _IGNORE_MERGES, _PRE_SPLITS, build_tokenizer
from triollm.engine.loading.model_files import bundled_gguf_path

TEXTS = [
    "Hello world! I'm here, you're there; we'll see. They'd've SAID it's OK'S.",
    "HELLO World McDonald's iPhone XMLHttpRequest getHTTPResponseCode camelCase snake_case",
    "Pi is 3.14159265358979 and 1234567890 or 12,345,678.90 — 2024-12-06 at 07:45:00.",
    "def add(a, b):\n    return a + b\n\n\n\tif x == 1:\n        print('x')  # comment\n",
    "   leading spaces, trailing spaces   \n\n\r\n  \n mixed\twhitespace\t\t end ",
    "Ñandú über café naïve résumé Ægir ÉCOLE Straße ǅungla cafe\u0301 man\u0303ana",
    "你好世界，这是一个测试。日本語のテキストとカタカナ。한국어 텍스트",
    "Привет, мир! Это ТЕСТ. مرحبا بالعالم ١٢٣ 🙂👍🏽 ∑x² ≤ ∞ ...!!?? <|tag|> </s>",
    "path/to/file.py https://example.com/a?b=c&d=e {\"key\": [1, 2, 3]} a--b ++c !!d //e",
    " qwertyzxcv Qwertyzxcv qwertyzxcvs",
]
# Tokens appended to the vocabulary with no merges that build them: under `ignore_merges` the whole
# piece is one token, else it is merged from its bytes.
UNMERGEABLE = ["Ġqwertyzxcv", "Qwertyzxcv"]
# The first test may wait for llama.cpp's build (tests/llama_cpp_convert.py: two minutes on two idle
# cores, more beside the other test worker, which may be the one building it).
pytestmark = pytest.mark.timeout(1200)


def _write_vocab(path: Path, pre: str, tokens: list[str], types: list[int], merges: list[str]) -> None:
    writer = GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_block_count(1)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-pre")
    meta = GGUFMeta(GGUFReader(bundled_gguf_path()), bundled_gguf_path())
    # SmolLM2's vocabulary spells numbers digit by digit: the 2- and 3-digit tokens (and merges)
    # added here make a pre-tokenizer's digit grouping show in the ids.
    digits = [f"{a}{b}" for a in range(10) for b in range(10)] + [f"{a}{b}{c}" for a in range(10) for b in range(10)
                                                                   for c in range(10)]
    tokens = [str(t) for t in meta.require("tokenizer.ggml.tokens")] + digits + UNMERGEABLE
    types = [int(t) for t in meta.require("tokenizer.ggml.token_type")] + [1] * (len(digits) + len(UNMERGEABLE))
    merges = [str(m) for m in meta.require("tokenizer.ggml.merges")] + [f"{d[:-1]} {d[-1]}" for d in digits]
    files = {}
    for pre in REPRESENTATIVES:
        files[pre] = root / f"vocab-{pre}.gguf"
        _write_vocab(files[pre], pre, tokens, types, merges)
    return files


def _representatives() -> list[str]:
    """One name per distinct pre-tokenizer (its splits and whether merges are ignored): the other
    names are aliases of the same table entry (llama.cpp maps them to the same type)."""
    seen: dict[tuple[tuple[str, ...], bool], str] = {}
    for name, splits in _PRE_SPLITS.items():
        seen.setdefault((splits, name in _IGNORE_MERGES), name)
    return list(seen.values())


REPRESENTATIVES = _representatives()


def test_every_pretokenizer_gives_llama_cpps_tokens(vocab_files: dict[str, Path], tmp_path: Path) -> None:
    names = list(vocab_files)
    theirs = llama_cpp_tokenize([{"gguf": str(vocab_files[n]), "texts": TEXTS} for n in names], tmp_path)
    differ = []
    for name, their_ids in zip(names, theirs, strict=True):
        path = vocab_files[name]
        tok = build_tokenizer(GGUFMeta(GGUFReader(path), path))
        for text, expected in zip(TEXTS, their_ids, strict=True):
            ours = tok.encode(text, add_special_tokens=False).ids
            if ours != expected:
                differ.append((name, text[:40], [tok.id_to_token(i) for i in ours][:30],
                               [tok.id_to_token(i) for i in expected][:30]))
    assert not differ, "\n".join(map(str, differ))
    assert len(names) >= 10 and {"default", "gpt-2", "llama3", "qwen2", "gpt-4o", "deepseek-v3"} <= set(names)


def test_the_pretokenizers_differ_where_their_families_do(vocab_files: dict[str, Path]) -> None:
    """The test above can fail: the distinct pre-tokenizers split the texts into different pieces,
    and on this vocabulary into different ids for all but two pairs (digits alone or in threes,
    o200k's case-split words, llama.cpp's default cutting punctuation first; DeepSeek V3's CJK runs
    against Llama 3's and Qwen 3.5's combining marks against Qwen 2's change no ids here: the
    vocabulary merges the same bytes either way). `ignore_merges` takes a whole unmergeable piece as
    one token only where llama.cpp sets it."""
    from triollm.engine.loading.gguf_vocab import _pre_tokenizer

    def ids(name: str) -> tuple[tuple[str, ...], ...]:
        tok = build_tokenizer(GGUFMeta(GGUFReader(vocab_files[name]), vocab_files[name]))
        return tuple(tuple(tok.id_to_token(i) for i in tok.encode(t, add_special_tokens=False).ids) for t in TEXTS)

    def pieces(name: str) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(p for p, _ in _pre_tokenizer(name).pre_tokenize_str(t)) for t in TEXTS)

    split_by = {name: pieces(name) for name in vocab_files if _PRE_SPLITS[name] != _PRE_SPLITS["llama3"]}
    assert len(set(split_by.values())) == len(split_by)
    seen = {name: ids(name) for name in vocab_files}
    assert len(set(seen.values())) >= len(seen) - 2
    assert "Ġqwertyzxcv" in seen["llama3"][-1] and "Ġqwertyzxcv" not in seen["dbrx"][-1]
    assert "llama3" in _IGNORE_MERGES and "dbrx" not in _IGNORE_MERGES and _PRE_SPLITS["llama3"] == _PRE_SPLITS["dbrx"]
    assert max(len(p.strip("Ġ")) for p in seen["llama3"][2] if p.strip("Ġ").isdigit()) == 3
    assert max(len(p.strip("Ġ")) for p in seen["qwen2"][2] if p.strip("Ġ").isdigit()) == 1
