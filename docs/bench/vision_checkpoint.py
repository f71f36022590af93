"""A random Qwen2.5-VL sized like a small real one, for `triollm bench vision` (docs/benchmarks.md).

    python docs/bench/vision_checkpoint.py OUT_DIR --tokenizer-from DIR

Qwen2.5-VL-3B's vision tower (32 blocks of width 1280, 14 x 14 patches merged 2 x 2, window
attention with four full blocks) in front of Qwen2.5-0.5B's decoder shape (24 layers of width
896, 14 heads / 2 KV heads, M-RoPE), fp32, written by transformers' `save_pretrained` with its
`Qwen2VLImageProcessor`; the tokenizer is DIR's (the bundled SmolLM2's import) with Qwen's three
vision tokens added (and its video token, which the config names). A 448 x 448 image is 1,024
patches, 256 positions in the prompt.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer-from", type=Path, required=True)
    args = p.parse_args()

    import torch
    import transformers
    from tokenizers import Tokenizer

    args.out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(args.tokenizer_from / "tokenizer.json"))
    tok.add_special_tokens(list(VISION_TOKENS))
    tok.save(str(args.out / "tokenizer.json"))
    shutil.copy(args.tokenizer_from / "tokenizer_config.json", args.out / "tokenizer_config.json")
    ids = [tok.token_to_id(t) for t in VISION_TOKENS]
    assert all(i is not None for i in ids)
    start, end, pad, video = (int(i) for i in ids if i is not None)
    source = json.loads((args.tokenizer_from / "config.json").read_text())
    eos, bos = source.get("eos_token_id", 2), source.get("bos_token_id", 1)

    torch.manual_seed(0)
    text = {
        "vocab_size": tok.get_vocab_size(), "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
        "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [8, 12, 12]},
        "eos_token_id": eos, "bos_token_id": bos, "pad_token_id": eos, "tie_word_embeddings": True,
    }  # fmt: skip
    vision = {
        "depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 896,
        "patch_size": 14, "spatial_merge_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
    }  # fmt: skip
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=pad,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
    )
    model = transformers.Qwen2_5_VLForConditionalGeneration(cfg).to(torch.float32)  # type: ignore[arg-type]
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    model.save_pretrained(args.out)
    transformers.Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2).save_pretrained(args.out)


if __name__ == "__main__":
    main()
