"""A GGUF's vocabulary rebuilt as a `tokenizers.Tokenizer`, written as tokenizer.json.

Two kinds, by `tokenizer.ggml.model`:

* `gpt2` (byte-level BPE: Llama 3, Qwen, SmolLM, Phi-4): the vocabulary and merges as stored,
  with the pre-tokenizer `tokenizer.ggml.pre` names.
* `llama` (SentencePiece: Llama 2, Mistral v0.1, Gemma, Phi-3): tokens, scores and types only.
  SentencePiece's BPE merges, at each step, the adjacent pair whose concatenation is the piece with
  the highest score; as `tokenizers` merges, those are every split of every piece into two pieces,
  ranked by the whole piece's score (transformers' `generate_merges`, which built the source
  tokenizer.json from the same scores). `<0xNN>` byte tokens are the byte fallback. The `▁` word
  prefix is added at the start of every stretch of text between special tokens where
  `tokenizer.ggml.add_space_prefix` is true (llama.cpp's rule, and transformers' `legacy=True`:
  Metaspace with `prepend_scheme="always"`); Gemma's files say false.

Control tokens (type 3) become special added tokens, user-defined ones (type 4: `<think>`) plain
added tokens; BOS/EOS are added around each sequence as `tokenizer.ggml.add_bos_token` /
`add_eos_token` say (SentencePiece vocabularies add BOS unless the file says not, as llama.cpp does).
"""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from triollm.engine.loading.gguf_arch import GGUFMeta

__all__ = ["build_tokenizer", "tokenizer_config"]

_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4
_SPM_SPACE = "▁"

# Pre-tokenizers by llama.cpp's `tokenizer.ggml.pre` name (llama-vocab.cpp maps each name to one
# of its pre-tokenizer types): the split regexes of the models' own tokenizer.json, applied in turn
# (each splits the pieces the one before left, as `tokenizers` and llama.cpp both run a sequence),
# then the pieces byte-level encoded. llama.cpp respells some for its regex engine (case-insensitive
# groups written out, GPT-4o's letter classes as lookaheads); these are the originals, which
# `tokenizers` runs. tests/engine/test_gguf_pretokenizers.py holds every name here to llama.cpp's
# own tokens on one vocabulary.
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA3_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")  # every digit on its own
_QWEN35_SPLIT = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# OpenAI's o200k (GPT-4o, gpt-oss, Llama 4): a word is an optional capitalised run then lower case
# (or an all-capitals run), a contraction kept with it; digits in threes.
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (  # Mistral's Tekken: o200k's words without contractions, every digit on its own
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DEEPSEEK3_SPLITS = (  # DeepSeek V3 / R1: digits in threes, CJK runs, then words and punctuation
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!" + '"' + r"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEEPSEEK_CODER_SPLITS = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
# llama.cpp's own default (a file that names no pre-tokenizer, or "default"): punctuation runs
# first, then GPT-2's split, then digit runs, cut into threes. Not GPT-2's alone.
_DEFAULT_SPLITS = (
    r"[\p{P}\$\+<=>\^~\|]+",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
    r"\p{N}+",
    r"[0-9][0-9][0-9]",
)
# name -> the splits before byte-level encoding; () is GPT-2's own regex (ByteLevel's), DIGITS the
# same after every digit is split off (StarCoder's, SmolLM's).
_DIGITS = ("digits",)
_PRE_SPLITS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT_SPLITS,
    **dict.fromkeys(("gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion",
                     "granite-docling", "gigachat", "a.x-4.0", "mellum", "jina-es", "jina-de", "jina-v2-es",
                     "jina-v2-de", "modern-bert"), ()),
    **dict.fromkeys(("smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"), _DIGITS),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe", "chatglm-bpe", "glm4", "glm5"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan"),
                    (_QWEN2_SPLIT,)),
    "qwen35": (_QWEN35_SPLIT,),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), (_GPT4O_SPLIT,)),
    "tekken": (_TEKKEN_SPLIT,),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3_SPLITS),
    "deepseek-coder": _DEEPSEEK_CODER_SPLITS,
}  # fmt: skip
# Where llama.cpp (and the source tokenizer.json) take a whole piece that is in the vocabulary as
# one token before merging (`ignore_merges`): a piece no chain of merges builds still is one token.
_IGNORE_MERGES = frozenset(
    ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano",
     "glm4", "glm5", "tekken")
)

_SPECIAL_TOKEN_KEYS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}
_KINDS = ("gpt2", "llama")


def build_tokenizer(meta: GGUFMeta) -> Tokenizer:
    """A `tokenizers.Tokenizer` equivalent to the GGUF's vocabulary (module note)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _KINDS:
        raise ValueError(f"gguf: tokenizer.ggml.model {kind!r} is not supported; supported: {', '.join(_KINDS)}")
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise ValueError(f"gguf: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    tok = _byte_level_bpe(meta, tokens, types) if kind == "gpt2" else _sentencepiece(meta, tokens, types)
    _add_special_tokens(tok, tokens, types)
    tok.post_processor = _post_processor(meta, tokens, byte_level=kind == "gpt2")
    return tok


def add_bos(meta: GGUFMeta) -> bool:
    """Whether a BOS starts each sequence: the file's flag, else llama.cpp's default per kind."""
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


# ---------------------------------------------------------------------------------------------
# byte-level BPE


def _byte_level_bpe(meta: GGUFMeta, tokens: list[str], types: list[int]) -> Tokenizer:
    merges = [_split_merge(m) for m in meta.require("tokenizer.ggml.merges")]
    vocab = _byte_level_vocab(tokens, types)
    pre = meta.get("tokenizer.ggml.pre")
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre in _IGNORE_MERGES)
    )
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")
    if not sep or not left or not right or " " in right:
        raise ValueError(f"gguf: malformed BPE merge {merge!r}")
    return left, right


def _byte_level_vocab(tokens: list[str], types: list[int]) -> dict[str, int]:
    """token -> id; ordinary tokens not already in byte-level spelling are respelled into it."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spelling = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind not in (_TOKEN_CONTROL, _TOKEN_USER_DEFINED) and not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab.setdefault(token, index)
    return vocab


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def _pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer `tokenizer.ggml.pre` names (None: llama.cpp's `default`)."""
    splits = _PRE_SPLITS.get("default" if pre is None else pre)
    if splits is None:
        raise ValueError(
            f"gguf: tokenizer.ggml.pre {pre!r} is not supported; supported: {', '.join(sorted(_PRE_SPLITS))}"
        )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if splits == ():
        return byte_level
    if splits == _DIGITS:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# ---------------------------------------------------------------------------------------------
# SentencePiece


def _sentencepiece(meta: GGUFMeta, tokens: list[str], types: list[int]) -> Tokenizer:
    scores: list[float] = list(meta.require("tokenizer.ggml.scores"))
    if len(scores) != len(tokens):
        raise ValueError(f"gguf: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    unk = next((tokens[i] for i, k in enumerate(types) if k == _TOKEN_UNKNOWN), None)
    merges = _score_merges(vocab, {t: scores[i] for t, i in vocab.items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    steps: list[decoders.Decoder] = [decoders.Replace(_SPM_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if bool(meta.get("tokenizer.ggml.add_space_prefix", True)):
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=_SPM_SPACE, prepend_scheme="always", split=False)
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tok.normalizer = normalizers.Replace(" ", _SPM_SPACE)
    tok.decoder = decoders.Sequence(steps)
    return tok


def _score_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a piece into two pieces, best-scored whole piece first (ties: longer left,
    then longer right; within a piece by the halves' ids), as transformers' `generate_merges`."""
    ranked: list[tuple[str, str, float]] = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score)
            for i in range(1, len(piece))
            if piece[:i] in vocab and piece[i:] in vocab
        ]
        ranked.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    ranked.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in ranked]


# ---------------------------------------------------------------------------------------------
# shared


def _add_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int]) -> None:
    """Control and unknown tokens become special added tokens; user-defined ones plain added ones."""
    special = [t for t, k in zip(tokens, types, strict=True) if k in (_TOKEN_CONTROL, _TOKEN_UNKNOWN)]
    user = [t for t, k in zip(tokens, types, strict=True) if k == _TOKEN_USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])


def _post_processor(meta: GGUFMeta, tokens: list[str], *, byte_level: bool) -> processors.PostProcessor | None:
    steps: list[processors.PostProcessor] = [processors.ByteLevel(trim_offsets=False)] if byte_level else []
    bos = add_bos(meta)
    eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if bos or eos:
        prefix, suffix, specials = [], [], []
        if bos:
            bos_id = int(meta.require("tokenizer.ggml.bos_token_id"))
            prefix, specials = [tokens[bos_id]], [(tokens[bos_id], bos_id)]
        if eos:
            eos_id = int(meta.require("tokenizer.ggml.eos_token_id"))
            suffix = [tokens[eos_id]]
            specials.append((tokens[eos_id], eos_id))
        single = [*prefix, "$A", *suffix]
        pair = [*single, *(f"{t}:1" for t in prefix), "$B:1", *(f"{t}:1" for t in suffix)]
        steps.append(
            processors.TemplateProcessing(
                single=" ".join(single), pair=" ".join(pair), special_tokens=list(dict.fromkeys(specials))
            )
        )
    if not steps:
        return None
    return steps[0] if len(steps) == 1 else processors.Sequence(steps)


def tokenizer_config(meta: GGUFMeta, context_length: int) -> dict[str, Any]:
    """tokenizer_config.json: special-token names, BOS/EOS flags and the file's chat template."""
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for name, key in _SPECIAL_TOKEN_KEYS.items():
        index = meta.get(f"tokenizer.ggml.{key}")
        if index is not None or name in ("bos_token", "eos_token"):
            config[name] = tokens[int(index)] if index is not None else None
    config["add_bos_token"] = add_bos(meta)
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    config["chat_template"] = meta.get("tokenizer.chat_template")
    config["model_max_length"] = context_length
    config["clean_up_tokenization_spaces"] = False
    return config
