"""`triollm bench embed`: offline embedding (or reranking) throughput beside sentence-transformers.

The workload: `--num-texts` texts of English words whose token counts (the model's tokenizer,
special tokens included) are uniform in [`--min-tokens`, `--max-tokens`], seed 0. `LLM.embed`
encodes them in one call (the engine batches them, engine/pooling_core.py); then, in the same
process, sentence-transformers' `SentenceTransformer.encode` (`--st-batch-size`) encodes the same
texts with the same number of torch threads. Each side is warmed up on a few texts first, then
timed `--repeats` times, the two sides' runs interleaved so that both see the same load on a
shared machine; the best run of each counts. The two results' agreement (the smallest cosine
between a text's two embeddings) is printed beside the texts/s, so a fast wrong answer does not
pass.

A cross-encoder (a one-label `*ForSequenceClassification` checkpoint: a reranker) is timed as a
reranker instead: `LLM.score(query, texts)` (one query against every text, as `/rerank` is
called) beside sentence-transformers' `CrossEncoder.predict` on the same pairs, and the agreement
is the largest absolute difference between the two scores of a pair.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from triollm import LLM, EngineArgs

__all__ = ["add_embed_parser", "text_workload"]

_QUERY = "where do people buy fresh bread near the old market square"
_WORDS = (
    "the quick brown fox jumps over a lazy dog while river stones shine under bright summer light and "
    "people walk along quiet streets to buy fresh bread from small shops near the old market square where "
    "children play games with friends after school before dinner is ready at home"
).split()


def add_embed_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "embed", help="offline embedding (LLM.embed) or reranking (LLM.score) throughput beside sentence-transformers"
    )
    p.add_argument("--num-texts", type=int, default=1000, help="(default: %(default)s)")
    p.add_argument("--min-tokens", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch (default: %(default)s)")
    p.add_argument("--no-compare", action="store_true", help="skip sentence-transformers")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed runs of each side, interleaved; the best counts (default: %(default)s)",
    )
    p.add_argument("--output-json", default=None, help="write the results here")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_embed)


def text_workload(tokenizer: Any, num: int, low: int, high: int, seed: int = 0) -> list[str]:
    """`num` texts whose token counts (`tokenizer.encode`, special tokens included) are uniform
    in [low, high]."""
    rng = random.Random(seed)
    texts = []
    for _ in range(num):
        target = rng.randint(low, high)
        words: list[str] = []
        count = 0
        while count < target:
            word = rng.choice(_WORDS)
            longer = len(tokenizer.encode(" ".join([*words, word])))
            if longer <= high:  # a word of several tokens may not fit the last place
                words.append(word)
                count = longer
        texts.append(" ".join(words))
    return texts


def run_embed(ns: argparse.Namespace) -> int:
    args = EngineArgs.from_cli_args(ns)
    st: Any = None
    ours_s: list[float] = []
    theirs_s: list[float] = []
    agreement = None
    with LLM.from_engine_args(args) as llm:
        tokenizer = llm.get_tokenizer()
        texts = text_workload(tokenizer, ns.num_texts, ns.min_tokens, ns.max_tokens)
        tokens = sum(len(tokenizer.encode(t)) for t in texts)
        pooler = llm.llm_engine.model_config.pooler
        rerank = pooler is not None and pooler.num_labels == 1
        path = str(llm.llm_engine.model_config.path)

        def ours(batch: list[str]) -> torch.Tensor:
            if rerank:
                return torch.tensor([o.outputs.score for o in llm.score(_QUERY, batch, use_tqdm=False)])
            return torch.tensor([o.outputs.embedding for o in llm.embed(batch, use_tqdm=False)])

        def theirs(batch: list[str]) -> torch.Tensor:
            if rerank:
                pairs = [(_QUERY, t) for t in batch]
                return torch.tensor(st.predict(pairs, batch_size=ns.st_batch_size, show_progress_bar=False))
            return torch.tensor(st.encode(batch, batch_size=ns.st_batch_size, normalize_embeddings=True))

        ours(texts[:16])  # warm-up
        if not ns.no_compare:
            from sentence_transformers import CrossEncoder, SentenceTransformer

            st = CrossEncoder(path, device="cpu") if rerank else SentenceTransformer(path, device="cpu")
            theirs(texts[:16])  # warm-up
        for _ in range(ns.repeats):  # interleaved: on a shared machine both sides see the same load
            start = time.perf_counter()
            mine = ours(texts)
            ours_s.append(time.perf_counter() - start)
            if st is not None:
                start = time.perf_counter()
                other = theirs(texts)
                theirs_s.append(time.perf_counter() - start)
                if rerank:
                    agreement = (mine - other).abs().max().item()
                else:
                    agreement = torch.nn.functional.cosine_similarity(mine, other, dim=-1).min().item()
    best = min(ours_s)
    result: dict[str, Any] = {
        "texts": len(texts),
        "tokens": tokens,
        "threads": torch.get_num_threads(),
        "triollm_s": ours_s,
        "triollm_texts_per_s": len(texts) / best,
        "task": "rerank" if rerank else "embed",
    }
    print(
        f"triollm {'LLM.score' if rerank else 'LLM.embed'}: "
        f"{len(texts)} texts ({tokens} tokens), best of {len(ours_s)}: {best:.2f} s, "
        f"{len(texts) / best:.1f} texts/s (runs: {', '.join(f'{t:.1f}' for t in ours_s)} s)"
    )
    if theirs_s:
        their_best = min(theirs_s)
        result |= {
            "st_s": theirs_s,
            "st_texts_per_s": len(texts) / their_best,
            "speedup": their_best / best,
            ("max_abs_diff" if rerank else "min_cosine"): agreement,
        }
        print(
            f"sentence-transformers {'CrossEncoder.predict' if rerank else 'encode'}(batch_size={ns.st_batch_size}), "
            f"best of {len(theirs_s)}: {their_best:.2f} s, {len(texts) / their_best:.1f} texts/s (runs: "
            f"{', '.join(f'{t:.1f}' for t in theirs_s)} s); triollm {their_best / best:.2f}x; "
            + (
                f"largest score difference {agreement:.2e}"
                if rerank
                else f"smallest cosine between the two {agreement:.6f}"
            )
        )
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
