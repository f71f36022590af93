"""SentencePiece vocabularies from GGUF files made by llama.cpp's converter, and the Gemma families.

A tiny SentencePiece BPE model (byte fallback, two user-defined symbols, as Llama 2 / Mistral v0.1
/ Gemma vocabularies are made) is trained on the fly and put in checkpoints read by transformers
as Llama 2 reads it (`LlamaTokenizer`, `legacy=True`: "▁" before every stretch of text, BOS
added) and as Gemma reads it (`GemmaTokenizer`: no "▁" prefix). llama.cpp's converter stores only
tokens, scores and types; the tokenizer rebuilt from them (engine/loading/gguf_vocab.py) must
encode 500 mixed strings (code, CJK, emoji, characters outside the vocabulary, special tokens,
whitespace runs) exactly as transformers does on the source, and decode them back the same. Then
Gemma, Gemma 2 and Gemma 3 (which llama.cpp converts only with a SentencePiece vocabulary) and a
SentencePiece Llama run from their GGUFs with transformers' greedy tokens.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from llama_cpp_convert import convert
from tinymodel import CORPUS, EXTRA_TEXT, make_transformers_model, train_sentencepiece, use_sentencepiece
from tokenizers import Tokenizer

from triollm import LLM, SamplingParams
from triollm.engine.loading.gguf_import import import_gguf

GEMMA = {"head_dim": 16, "query_pre_attn_scalar": 16, "tie_word_embeddings": True}  # llama.cpp: 1/sqrt(head_dim)
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaForCausalLM", "LlamaTokenizer", {}),
    "gemma": ("GemmaForCausalLM", "GemmaTokenizer", {"head_dim": 16, "tie_word_embeddings": True}),
    "gemma2": (
        "Gemma2ForCausalLM",
        "GemmaTokenizer",
        {**GEMMA, "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0, "sliding_window": 10},
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        "GemmaTokenizer",
        {
            **GEMMA,
            "num_hidden_layers": 6,  # llama.cpp's Gemma 3 pattern: layers 0-4 windowed, 5 global
            "sliding_window": 9,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 200000.0},
            },
        },
    ),
}
PROMPTS = ["The capital of France is", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "def main():\n    for"]
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    pytest.importorskip("sentencepiece", reason="pip install -e '.[dev]' (sentencepiece)")
    root = tmp_path_factory.mktemp("gguf-spm")
    spm = root / "tokenizer.model"
    vocab = train_sentencepiece(spm)
    out: dict[str, tuple[Path, Path]] = {}
    for i, (case, (arch, tok_class, overrides)) in enumerate(CASES.items()):
        config = {"vocab_size": vocab, "bos_token_id": 1, "eos_token_id": 2, **overrides}
        src = make_transformers_model(root / case, arch, seed=80 + i, **config)
        use_sentencepiece(src, spm, tok_class)
        out[case] = (src, root / f"{case}.gguf")
    convert([(src, gguf_file, "f32") for src, gguf_file in out.values()])
    return out


def mixed_strings(n: int = 500) -> list[str]:
    """Code, prose, CJK, emoji, characters the vocabulary lacks (byte fallback), special and
    user-defined tokens, whitespace runs, in random mixtures."""
    rng = random.Random(43)
    pieces = [
        *CORPUS, *EXTRA_TEXT, "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }", "ʬ ɮ ꙮ 𝔘𝔫𝔦", "\t\ttabs\t",
        "😀🎉👍🏽 🇫🇷", "  two leading", " one", "trailing  ", "\n\n", "\r\n", "ümlaut naïve café", "12345.678",
        "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>", "<|im_start|>user\nhi<|im_end|>", "▁", "a▁b",
        "\u200d", "x" * 40, "日本語", "한국어", "😶\u200d🌫️", "\x07bell",
    ]
    out = ["", " ", "a", "Hello", " Hello", "<s>Hello</s>"]
    while len(out) < n:
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 4))))
    return out


@pytest.mark.parametrize("case", ["llama", "gemma"])
def test_sentencepiece_vocab_encodes_and_decodes_as_transformers(
    converted: dict[str, tuple[Path, Path]], case: str, tmp_path: Path
) -> None:
    import transformers

    src, gguf_file = converted[case]
    import_gguf(gguf_file, tmp_path)
    ours = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    ref = transformers.AutoTokenizer.from_pretrained(src)
    assert type(ref).__name__ == CASES[case][1]
    bad = []
    for text in mixed_strings():
        ids = ours.encode(text).ids
        ref_ids = ref(text)["input_ids"]
        if ids != ref_ids or ours.decode(ids, skip_special_tokens=False) != ref.decode(ref_ids):
            bad.append((text, ids, ref_ids))
    assert bad[:3] == []
    assert ours.decode(ours.encode("ʬ 😀 日本").ids, skip_special_tokens=True) == "ʬ 😀 日本"
    tok_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"], tok_config["add_bos_token"]) == ("<s>", "</s>", True)


def _transformers_greedy(src: Path) -> list[tuple[list[int], list[int]]]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(src)
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    out = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = tok(prompt)["input_ids"]
            gen = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
            out.append((ids, gen[0, len(ids) :].tolist()))
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_sentencepiece_family_greedy_matches_transformers(
    converted: dict[str, tuple[Path, Path]], case: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, gguf_file = converted[case]
    monkeypatch.setenv("TRIOLLM_CACHE_DIR", str(tmp_path))
    llm = LLM(model=str(gguf_file), max_model_len=128)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    finally:
        llm.shutdown()
    ours = [(list(o.prompt_token_ids or []), list(o.outputs[0].token_ids)) for o in outs]
    assert ours == _transformers_greedy(src)
    (imported,) = tmp_path.iterdir()
    assert json.loads((imported / "config.json").read_text())["architectures"] == [CASES[case][0]]
