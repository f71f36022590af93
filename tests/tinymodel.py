"""Tiny random Hugging Face-format checkpoints built on the fly for fast tests.

`make_tiny_model(path, ...)` writes config.json, model.safetensors, tokenizer.json,
tokenizer_config.json (with a ChatML template) and generation_config.json. The tokenizer is a
byte-level BPE trained in milliseconds on a small corpus, so it round-trips any text.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "Once upon a time there was a little robot who liked to count: one, two, three, four.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "Héllo wörld! Ça va? Naïve café, résumé. 日本語 テキスト 😀🎉",
    "The quick brown fox jumps over the lazy dog. " * 3,
]


def build_tokenizer(vocab_size: int = 384) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def make_tiny_model(
    path: Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    attention_bias: bool = False,
    architecture: str = "LlamaForCausalLM",
    max_position_embeddings: int = 512,
    rope_scaling: dict | None = None,
    generation_config: dict | None = None,
) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id("<|endoftext|>")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "add_bos_token": False,
                "chat_template": CHATML,
                "model_max_length": max_position_embeddings,
            }
        )
    )
    head_dim = hidden_size // num_heads
    config = {
        "architectures": [architecture],
        "model_type": {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}[
            architecture
        ],
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": attention_bias,
        "hidden_act": "silu",
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }
    if architecture == "Qwen2ForCausalLM":
        config.pop("attention_bias")  # qwen2 always has qkv bias
    (path / "config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, **(generation_config or {})})
    )
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * scale).contiguous()

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab, hidden_size, scale=0.5)}
    q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
    for i in range(num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + rnd(hidden_size, scale=0.1)
        w[p + "post_attention_layernorm.weight"] = 1 + rnd(hidden_size, scale=0.1)
        w[p + "self_attn.q_proj.weight"] = rnd(q_out, hidden_size, scale=0.2)
        w[p + "self_attn.k_proj.weight"] = rnd(kv_out, hidden_size, scale=0.2)
        w[p + "self_attn.v_proj.weight"] = rnd(kv_out, hidden_size, scale=0.2)
        w[p + "self_attn.o_proj.weight"] = rnd(hidden_size, q_out, scale=0.2)
        if attention_bias or architecture == "Qwen2ForCausalLM":
            w[p + "self_attn.q_proj.bias"] = rnd(q_out, scale=0.1)
            w[p + "self_attn.k_proj.bias"] = rnd(kv_out, scale=0.1)
            w[p + "self_attn.v_proj.bias"] = rnd(kv_out, scale=0.1)
        w[p + "mlp.gate_proj.weight"] = rnd(intermediate_size, hidden_size, scale=0.2)
        w[p + "mlp.up_proj.weight"] = rnd(intermediate_size, hidden_size, scale=0.2)
        w[p + "mlp.down_proj.weight"] = rnd(hidden_size, intermediate_size, scale=0.2)
    w["model.norm.weight"] = 1 + rnd(hidden_size, scale=0.1)
    if not tie_word_embeddings:
        w["lm_head.weight"] = rnd(vocab, hidden_size, scale=0.5)
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def write_tokenizer(path: Path, model_max_length: int = 512) -> int:
    """The tiny byte-level BPE tokenizer files (as `make_tiny_model` writes them); returns the EOS id."""
    path.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "add_bos_token": False,
                "chat_template": CHATML,
                "model_max_length": model_max_length,
            }
        )
    )
    return tok.token_to_id("<|endoftext|>")


def tiny_text_config(vocab: int, eos_id: int, **overrides: object) -> dict[str, object]:
    """The tiny decoder the test models share (2 layers, hidden 64, 4 heads over 2 kv heads), as
    config keyword arguments; `overrides` adds or replaces fields."""
    return {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": None,
        **overrides,
    }


def make_transformers_model(path: Path, architecture: str, *, seed: int = 0, **config: object) -> Path:
    """A tiny random model written by the installed transformers' `save_pretrained` (its own
    config.json generation: 5.x writes `rope_parameters` and `dtype`), plus the tiny tokenizer.

    `config` overrides the architecture's config class arguments (`Qwen3Config`, ...: hidden 64,
    2 layers, 4 heads / 2 KV heads, fp32 by default). Weights are redrawn at tinymodel's larger
    scales so the next-token distributions are peaked and greedy ties do not happen."""
    import transformers

    eos_id = write_tokenizer(path)
    text_configs = {"Gemma3ForCausalLM": "Gemma3TextConfig", "Llama4ForCausalLM": "Llama4TextConfig"}
    name = text_configs.get(architecture, architecture.replace("ForCausalLM", "Config"))
    config_class = getattr(transformers, name)
    args = tiny_text_config(
        build_tokenizer().get_vocab_size(), eos_id, **{"tie_word_embeddings": False, "dtype": "float32", **config}
    )
    cfg = config_class(**args)
    cfg.architectures = [architecture]
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise * (0.5 if "embed_tokens" in name or "lm_head" in name else 0.2))
    model.save_pretrained(path)
    return path


def memorize(path: Path, text: str, *, steps: int = 120, seed: int = 0) -> list[int]:
    """Retrain the checkpoint at `path` (make_transformers_model's) from a standard initialisation
    until it has learnt `text` by heart, and save it in place; returns the text's token ids.

    A random model's greedy choices sit within quantization noise of each other (its logits are
    a random draw: their top two are often a few hundredths apart), so two engines reading the
    same 4-bit blocks with different activation rounding part ways within a few tokens. Recalling
    a memorized text takes every layer (the text repeats words, so attention must find the place)
    and its greedy choices lead by several nats, which quantization noise does not overturn."""
    import transformers

    ids = transformers.AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # embeddings small, projections at 1/sqrt(fan-in); norms, biases kept
                p.normal_(0.0, 0.02 if "embed" in name or "lm_head" in name else p.shape[-1] ** -0.5)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    batch = torch.tensor([ids])
    for _ in range(steps):
        loss = model(batch, labels=batch).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(path)
    return ids


# A SentencePiece vocabulary (Llama 2 / Mistral v0.1 / Gemma style) for the GGUF tests.
SP_USER_SYMBOLS = ["<|im_start|>", "<|im_end|>"]
SP_SPECIAL = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
EXTRA_TEXT = [
    "Le renard brun rapide saute par-dessus le chien paresseux.",
    "def main():\n    for i in range(10):\n        print(i)  # count\n",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
]

def train_sentencepiece(path: Path) -> int:
    """A SentencePiece BPE model with byte fallback; returns its vocabulary size."""
    import sentencepiece

    lines = "\n".join(CORPUS * 3 + EXTRA_TEXT).split("\n")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines),
        model_writer=model,
        vocab_size=420,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        split_digits=True,
        allow_whitespace_only_pieces=True,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=SP_USER_SYMBOLS,
        minloglevel=2,
    )
    path.write_bytes(model.getvalue())
    return 420


def use_sentencepiece(src: Path, spm: Path, tokenizer_class: str) -> None:
    """Replace the checkpoint's byte-level BPE files by the SentencePiece model, saved as
    transformers saves it (tokenizer.json, and tokenizer_config.json with the added tokens)."""
    import transformers

    (src / "tokenizer.json").unlink()
    (src / "tokenizer.model").write_bytes(spm.read_bytes())
    config: dict[str, Any] = {**SP_SPECIAL, "add_bos_token": True}
    if tokenizer_class == "LlamaTokenizer":
        config["legacy"] = True
    else:
        config["pad_token"] = "<unk>"
    (src / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": tokenizer_class, **config}))
    tok = getattr(transformers, tokenizer_class).from_pretrained(src, **config)
    tok.chat_template = CHATML
    tok.save_pretrained(src)
    # What transformers 4.x wrote (and the hub's Llama 2 / Gemma files hold), which 5.x leaves out:
    # the added tokens (llama.cpp's converter types them from this list) and `legacy`.
    saved = json.loads((src / "tokenizer_config.json").read_text())
    added = {
        str(i): {"content": t, "special": t not in SP_USER_SYMBOLS, "normalized": False, "lstrip": False,
                 "rstrip": False, "single_word": False}
        for i, t in enumerate(["<unk>", "<s>", "</s>", *SP_USER_SYMBOLS])
    }
    (src / "tokenizer_config.json").write_text(json.dumps({**saved, **config, "added_tokens_decoder": added}))


def make_tiny_bert(
    path: Path,
    tokenizer_dir: Path,
    *,
    pooling: str = "mean_tokens",
    normalize: bool = True,
    matryoshka: bool = False,
    hidden_act: str = "gelu",
    seed: int = 0,
) -> Path:
    """A tiny random `BertModel` (transformers' own init and save_pretrained, so the tensor names
    are the real ones) with the WordPiece tokenizer files of `tokenizer_dir` and the
    sentence-transformers files choosing `pooling` ("mean_tokens", "cls_token" or "lasttoken":
    the `pooling_mode_*` key of 1_Pooling/config.json)."""
    import shutil

    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, hidden_act=hidden_act,
    )
    model = BertModel(config, add_pooling_layer=True).eval()
    model.save_pretrained(path, safe_serialization=True)
    if matryoshka:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "matryoshka_dimensions": [8, 16, 32]}))
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps({"word_embedding_dimension": 32, f"pooling_mode_{pooling}": True})
    )
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    return path


def write_roberta_tokenizer(path: Path, model_max_length: int = 512) -> int:
    """The tiny byte-level BPE with RoBERTa's special tokens (<s> 0, <pad> 1, </s> 2, <unk> 3) and
    its pair template (`<s> a </s></s> b </s>`, token types all 0), as XLM-R checkpoints ship
    theirs; returns the vocabulary size."""
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384,
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), trim_offsets=False)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>", "eos_token": "</s>", "cls_token": "<s>", "sep_token": "</s>",
                "pad_token": "<pad>", "unk_token": "<unk>",
                "model_max_length": model_max_length,
                "model_input_names": ["input_ids", "attention_mask"],
            }
        )
    )  # fmt: skip
    return int(tok.get_vocab_size())


def make_tiny_encoder(
    path: Path,
    architecture: str,
    *,
    tokenizer_dir: Path | None = None,
    num_labels: int = 1,
    seed: int = 0,
    config_json: dict | None = None,
) -> Path:
    """A tiny random BERT, XLM-R or ModernBERT encoder or sequence classifier (`architecture`,
    e.g. "XLMRobertaForSequenceClassification") written by transformers' `save_pretrained`. BERT
    and ModernBERT take the WordPiece tokenizer files of `tokenizer_dir`; XLM-R gets
    `write_roberta_tokenizer`'s.
    `config_json` is merged into config.json."""
    import shutil

    import transformers

    roberta, modern = architecture.startswith("XLMRoberta"), architecture.startswith("ModernBert")
    if roberta:
        vocab = write_roberta_tokenizer(path)
    else:
        assert tokenizer_dir is not None, "a BERT or ModernBERT needs the WordPiece tokenizer's directory"
        path.mkdir(parents=True, exist_ok=True)
        for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
            shutil.copy(tokenizer_dir / name, path / name)
        vocab = 30522
    if modern:  # no token types; 3 layers: a global one, then local ones with a window of 4 each side
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        tok_config["model_input_names"] = ["input_ids", "attention_mask"]
        (path / "tokenizer_config.json").write_text(json.dumps(tok_config))
        config_class = transformers.ModernBertConfig
        extra: dict = {"num_hidden_layers": 3, "local_attention": 8, "max_position_embeddings": 128,
                       "pad_token_id": 0, "bos_token_id": 101, "eos_token_id": 102, "cls_token_id": 101,
                       "sep_token_id": 102, "classifier_pooling": "mean"}  # fmt: skip
    elif roberta:
        config_class = transformers.XLMRobertaConfig
        extra = {"num_hidden_layers": 2, "type_vocab_size": 1, "max_position_embeddings": 130}
    else:
        config_class = transformers.BertConfig
        extra = {"num_hidden_layers": 2, "max_position_embeddings": 128}
    config = config_class(
        vocab_size=vocab, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_labels=num_labels, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # transformers' init (std 0.02) scores every text alike: spread them out
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "LayerNorm" in name or "norm" in name.split(".")[-2]:
                p.copy_((1 if name.endswith("weight") else 0) + 0.1 * noise)
            else:
                p.copy_(noise * (0.5 if "embeddings" in name or "classifier" in name else 0.2))
    model.save_pretrained(path, safe_serialization=True)
    if config_json:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, **config_json}))
    return path


def make_tiny_decoder_pooler(path: Path, architecture: str, *, num_labels: int = 1, seed: int = 0) -> Path:
    """A tiny random decoder classifier (`architecture`: "Qwen3ForSequenceClassification", ...)
    or causal LM for `--runner pooling` ("Qwen3ForCausalLM", ...) written by transformers'
    `save_pretrained`, with the tiny tokenizer (its EOS doubling as the pad token, which
    transformers' classifiers need to find each row's last token)."""
    import transformers

    eos_id = write_tokenizer(path)
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**tok_config, "pad_token": "<|endoftext|>"}))
    family = architecture.replace("ForSequenceClassification", "ForCausalLM")
    config = getattr(transformers, family.replace("ForCausalLM", "Config"))(
        vocab_size=build_tokenizer().get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=eos_id, tie_word_embeddings=False,
        num_labels=num_labels,
    )  # fmt: skip
    model = getattr(transformers, architecture)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            else:
                p.copy_(noise * (0.5 if "embed_tokens" in name or "score" in name or "lm_head" in name else 0.2))
    model.save_pretrained(path)
    return path
