"""A model directory without weights, for engines whose core is a `FakeCore`.

The engine still resolves a configuration and loads a tokenizer at start-up, so it needs a
directory with `config.json` and the tokenizer files; a scripted core reads no weights.
`write_model_dir(path)` writes a tiny Llama config and a byte-level tokenizer with no merges:
one token per UTF-8 byte, then `<|endoftext|>` (256, the EOS), `<|im_start|>` and `<|im_end|>`,
with a ChatML chat template. Token id k is byte `(k + 32) % 256`, so the low ids a scripted core
emits (token i of a request is `prompt_len + i`) are printable: after a prompt of 16 bytes it
writes "0123456789:;<=>?@AB...". Built from `tokenizers` alone
(no training, no transformers), identical on every run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["EOS_TOKEN_ID", "VOCAB_SIZE", "fake_engine_args", "write_model_dir"]

CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN_ID = 256
VOCAB_SIZE = 256 + len(SPECIALS)


def _byte_alphabet() -> list[str]:
    """The byte-level pre-tokenizer's character for each byte (GPT-2's mapping): printable
    bytes stand for themselves, the others are shifted above U+0100."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars: dict[int, str] = {b: chr(b) for b in keep}
    shifted = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


def write_model_dir(path: Path | str, *, max_model_len: int = 512) -> Path:
    """Write the config and tokenizer files (no weights) into `path`; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    alphabet = _byte_alphabet()
    vocab = {alphabet[(k + 32) % 256]: k for k in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(path / "tokenizer.json"))
    _write(
        path / "tokenizer_config.json",
        {
            "bos_token": None,
            "eos_token": SPECIALS[0],
            "add_bos_token": False,
            "chat_template": CHATML,
            "model_max_length": max_model_len,
        },
    )
    _write(
        path / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": VOCAB_SIZE,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": max_model_len,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "bos_token_id": None,
            "eos_token_id": EOS_TOKEN_ID,
            "torch_dtype": "float32",
        },
    )
    _write(path / "generation_config.json", {"eos_token_id": EOS_TOKEN_ID})
    return path


def fake_engine_args(model_dir: Path | str, **overrides: Any) -> Any:
    """`AsyncEngineArgs` for `model_dir` with the in-process transport (`multiprocess=False`)
    and `seed=0`; `overrides` are any `AsyncEngineArgs` fields."""
    from triollm import AsyncEngineArgs

    kwargs: dict[str, Any] = {"model": str(model_dir), "multiprocess": False, "seed": 0}
    kwargs.update(overrides)
    return AsyncEngineArgs(**kwargs)


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1))
