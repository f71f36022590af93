"""A random GPT-NeoX, Phi or StableLM checkpoint of a realistic shape, for timing the native class
against the Transformers backend (`triollm bench latency --model-impl triollm|transformers`).

    python docs/bench/partial_rotary_checkpoint.py gpt_neox /tmp/neox TOKENIZER_DIR

Hidden 1024, 8 layers, 16 heads, MLP 4096, fp32, the vocabulary of the tokenizer in TOKENIZER_DIR
(its tokenizer files are copied beside the weights); weights drawn at 0.02, as transformers
initialises them.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import transformers

CONFIGS = {"gpt_neox": "GPTNeoXConfig", "phi": "PhiConfig", "stablelm": "StableLmConfig"}


def main(kind: str, out: Path, tokenizer_dir: Path) -> None:
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dir / "tokenizer.json"))
    cfg = getattr(transformers, CONFIGS[kind])(
        vocab_size=len(tokenizer), hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
        num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048, tie_word_embeddings=False,
        dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
