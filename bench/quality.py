"""`triollm bench quality`: what a quantization scheme costs in accuracy and memory, against the
dense model.

Each run is one way of holding the same model's weights:

* the dense reference: `--model` (default: the bundled one) with `quantization="none"`;
* each of `--schemes` (`quantization=` of that model: gguf, int8, int4);
* each of `--checkpoints`: a quantized checkpoint of the same model, a GPTQ, AWQ,
  compressed-tensors or FP8 directory (run by its own `quantization_config`) or a .gguf file
  (K-quants and the rest, `quantization="gguf"`), read with the dense model's tokenizer and
  labelled by what it holds (`checkpoint_label`: method, bits and group, or the GGUF's file
  type). docs/bench/make_quant_checkpoints.py writes one of each format.

Two accuracy figures per run, next to the dense model's:

* perplexity on a fixed text (`--text`, default tests/data/coriolanus.txt: the opening of
  Shakespeare's Coriolanus, public domain, ~4700 tokens of the bundled tokenizer), scored in
  windows of `--window` tokens through prompt logprobs;
* greedy agreement: 8 chat prompts x `--max-tokens` tokens, the share of generated tokens equal
  to the dense model's, position by position up to the first difference (after a difference the
  two continue from different texts, so later positions are not comparable), and the number of
  prompts whose whole output is identical.

And two costs: the engine's load time, and the peak resident set of the process that loaded and
ran it. So that the peak is that run's alone, each run is a fresh child process (`child_main`),
handed its `EngineConfig` resolved here (engine/config_codec.py: every configuration is checked,
and a .gguf imported once into the cache, before the first measurement), which reports its own
VmHWM; the engine runs inside it (`SyncEngine`). The KV cache is zeroed at start-up, every page
touched, so unless it is sized by hand (`--kv-cache-memory-bytes`, `--num-gpu-blocks-override`)
it holds one sequence of `max_model_len` tokens (default: a window, or a chat prompt and its
tokens), not a share of free memory: the same tokens in every run, and peaks that compare the
weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from triollm import EngineArgs

# Not public: each run's config is resolved and checked here, then sent to its child process.
from triollm.engine.config import QUANTIZATIONS, EngineConfig

__all__ = ["add_quality_parser", "checkpoint_label", "child_main"]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "What is 17 times 3?",
    "Give me a tip for learning a new language.",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
]
DEFAULT_TEXT = Path(__file__).resolve().parents[1] / "tests" / "data" / "coriolanus.txt"
CHAT_TOKENS = 256  # room for a chat prompt of CHAT_PROMPTS with its template
_MIB = 1 << 20


def add_quality_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "quality", help="perplexity, greedy agreement and peak memory of quantized weights against the dense model"
    )
    p.add_argument(
        "--schemes",
        default="gguf",
        help=(
            f"comma-separated quantization schemes of --model to compare with the dense model, from "
            f"{', '.join(q for q in QUANTIZATIONS if q != 'none')}; '' for none (default: %(default)s)"
        ),
    )
    p.add_argument(
        "--checkpoints",
        default="",
        help=(
            "comma-separated quantized checkpoints of the same model (GPTQ, AWQ, compressed-tensors or FP8 "
            "directories, .gguf files), each run by its own scheme with the dense model's tokenizer"
        ),
    )
    p.add_argument(
        "--text", default=str(DEFAULT_TEXT), help="the perplexity text (default: the bundled Coriolanus excerpt)"
    )
    p.add_argument("--window", type=int, default=1024, help="tokens per perplexity window (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per chat prompt (default: %(default)s)")
    p.add_argument("--output-json", default=None, help="write the results here")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_quality)


# ------------------------------------------------------------------------------ one run, in a child


class _Job(msgspec.Struct):
    """What a child measures (parent -> child, MessagePack on stdin)."""

    config: bytes  # config_codec.encode_config
    text: str
    window: int
    max_tokens: int
    log_level: int


class Measurement(msgspec.Struct):
    """What a child measured (child -> parent, JSON on its stdout)."""

    perplexity: float
    scored_tokens: int
    greedy: list[list[int]]
    load_s: float  # building the engine from its resolved config: weights read, repacked, KV cache allocated
    measure_s: float
    peak_rss_bytes: int  # the child's VmHWM: loading and measuring


_CHILD_MAIN = "from triollm.bench.quality import child_main; raise SystemExit(child_main())"


def child_main() -> int:
    """One run in this process: the `_Job` on stdin, its `Measurement` on stdout."""
    from triollm.engine.config_codec import decode_config  # not public: the parent resolved it

    job = msgspec.msgpack.decode(sys.stdin.buffer.read(), type=_Job)
    result = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints join stderr: stdout carries the result only
    logging.basicConfig(level=job.log_level, format="%(levelname)s %(name)s: %(message)s")
    measured = measure(decode_config(job.config), job.text, job.window, job.max_tokens)
    with result:
        result.write(msgspec.json.encode(measured))
    return 0


def measure(config: EngineConfig, text: str, window: int, max_tokens: int) -> Measurement:
    from triollm import SamplingParams

    # Not LLM: the child's load time and peak memory are the engine's, without actor threads.
    from triollm.engine.sync_engine import SyncEngine

    start = time.perf_counter()
    engine = SyncEngine(config)
    loaded = time.perf_counter()
    tok = engine.tokenizer
    ids = tok.encode(text)
    nll, count = 0.0, 0
    for s in range(0, len(ids) - 1, window):
        chunk = ids[s : s + window]
        if len(chunk) < 2:
            break
        (out,) = engine.generate(
            [{"prompt_token_ids": chunk}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        )
        assert out.prompt_logprobs is not None
        for row, token in zip(out.prompt_logprobs[1:], chunk[1:], strict=True):
            assert row is not None
            nll -= row[token].logprob
            count += 1
    prompts = [{"prompt_token_ids": tok.encode_chat([{"role": "user", "content": c}])} for c in CHAT_PROMPTS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return Measurement(
        perplexity=math.exp(nll / count),
        scored_tokens=count,
        greedy=[list(o.outputs[0].token_ids) for o in outs],
        load_s=loaded - start,
        measure_s=time.perf_counter() - loaded,
        peak_rss_bytes=peak_rss_bytes(),
    )


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (Linux: VmHWM; elsewhere getrusage's)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def _run_child(label: str, config: EngineConfig, text: str, window: int, max_tokens: int) -> Measurement:
    from triollm.engine.config_codec import encode_config  # not public: sent resolved

    job = _Job(encode_config(config), text, window, max_tokens, logging.getLogger().getEffectiveLevel())
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD_MAIN], input=msgspec.msgpack.encode(job), stdout=subprocess.PIPE, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"bench quality: the {label} run exited with status {proc.returncode} (its log is above)")
    return msgspec.json.decode(proc.stdout, type=Measurement)


# ------------------------------------------------------------------------------ the runs


@dataclasses.dataclass(frozen=True)
class _Run:
    label: str
    config: EngineConfig


def checkpoint_label(path: Path) -> str:
    """What a quantized checkpoint holds, readably: `gptq-4bit-g128-sym-act`, `awq-4bit-g64`,
    `ct-int4-group128`, `ct-float8-channel`, `fp8-block128x128`; a .gguf file its file type
    (`gguf-Q4_K_M`). A ValueError where `path` is neither a .gguf file nor a directory whose
    config.json has a `quantization_config`."""
    if path.suffix.lower() == ".gguf":
        from gguf import GGUFReader, LlamaFileType

        field = GGUFReader(str(path)).fields.get("general.file_type")
        if field is None:
            return "gguf"
        try:
            return "gguf-" + LlamaFileType(int(field.contents())).name.removeprefix("MOSTLY_")
        except ValueError:
            return f"gguf-type{field.contents()}"
    config = path / "config.json"
    raw = json.loads(config.read_text()).get("quantization_config") if config.is_file() else None
    if not isinstance(raw, dict):
        raise ValueError(
            f"checkpoints: {path} has no config.json with a quantization_config; pass quantized checkpoints "
            "(GPTQ, AWQ, compressed-tensors or FP8 directories, or .gguf files)"
        )
    method = raw.get("quant_method")
    if method == "gptq":
        act = "-act" if raw.get("desc_act") else ""
        return f"gptq-{raw.get('bits')}bit-g{raw.get('group_size')}-{'sym' if raw.get('sym', True) else 'asym'}{act}"
    if method == "awq":
        return f"awq-{raw.get('bits', raw.get('w_bit'))}bit-g{raw.get('group_size', raw.get('q_group_size'))}"
    if method == "fp8":
        block = raw.get("weight_block_size")
        return f"fp8-block{block[0]}x{block[1]}" if block else "fp8-channel"
    groups: dict[str, Any] = raw.get("config_groups") or {}
    first: dict[str, Any] = next(iter(groups.values()), {})
    w: dict[str, Any] = first.get("weights") or {}
    group = w.get("group_size") if w.get("strategy") == "group" else ""
    sym = "" if w.get("symmetric", True) else "-asym"
    return f"ct-{w.get('type', 'int')}{w.get('num_bits')}-{w.get('strategy')}{group or ''}{sym}"


def _runs(base: EngineArgs, schemes: list[str], checkpoints: list[Path]) -> list[_Run]:
    """Every run's resolved config, the dense one first: a bad scheme or checkpoint fails here,
    before any measurement (and a .gguf is imported here, not in its measured child)."""
    dense = dataclasses.replace(base, quantization="none").create_engine_config()
    runs = [_Run("dense", dense)]
    for scheme in schemes:
        if scheme not in QUANTIZATIONS or scheme == "none":
            allowed = ", ".join(q for q in QUANTIZATIONS if q != "none")
            raise ValueError(f"schemes: {scheme!r} is not a quantization scheme; allowed: {allowed}")
        runs.append(_Run(scheme, dataclasses.replace(base, quantization=scheme).create_engine_config()))
    for path in checkpoints:
        label = name = checkpoint_label(path)
        for n in range(2, len(runs) + 2):
            if label not in {r.label for r in runs}:
                break
            label = f"{name}#{n}"
        gguf = path.suffix.lower() == ".gguf"
        args = dataclasses.replace(
            base, model=str(path), tokenizer=str(dense.tokenizer), quantization="gguf" if gguf else None
        )
        config = args.create_engine_config()
        ours, theirs = dense.model, config.model
        shape = ("architecture", "num_layers", "hidden_size", "vocab_size")
        if any(getattr(ours, f) != getattr(theirs, f) for f in shape):
            raise ValueError(
                f"checkpoints: {path} is not a checkpoint of the dense model "
                f"({', '.join(f'{f} {getattr(theirs, f)}' for f in shape)}; the dense model's: "
                f"{', '.join(str(getattr(ours, f)) for f in shape)})"
            )
        runs.append(_Run(label, config))
    return runs


def _sized(base: EngineArgs, window: int, max_tokens: int) -> EngineArgs:
    """`base` with the KV cache of one sequence at max_model_len (module note), unless sized by hand."""
    if base.kv_cache_memory_bytes is not None or base.num_gpu_blocks_override is not None:
        return base
    if base.max_model_len is None:
        base = dataclasses.replace(base, max_model_len=max(window + 1, CHAT_TOKENS + max_tokens))
    length = dataclasses.replace(base, quantization="none").create_engine_config().model.max_model_len
    return dataclasses.replace(base, num_gpu_blocks_override=-(-length // base.block_size) + 1)


def _agreement(dense: list[list[int]], other: list[list[int]]) -> tuple[float, int]:
    same = total = identical = 0
    for a, b in zip(dense, other, strict=True):
        total += len(a)
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += prefix
        identical += a == b
    return same / max(total, 1), identical


def _split(value: str) -> list[str]:
    return [s.strip() for s in value.split(",") if s.strip()]


def run_quality(ns: argparse.Namespace) -> int:
    base = _sized(EngineArgs.from_cli_args(ns), ns.window, ns.max_tokens)
    text = Path(ns.text).read_text(encoding="utf-8")
    runs = _runs(base, _split(ns.schemes), [Path(p).expanduser() for p in _split(ns.checkpoints)])
    width = max(len(r.label) for r in runs)
    results: dict[str, Any] = {}
    dense: Measurement | None = None
    for run in runs:
        res = _run_child(run.label, run.config, text, ns.window, ns.max_tokens)
        entry: dict[str, Any] = {
            "model": str(run.config.model.path),
            "quantization": run.config.model.quantization,
            "perplexity": res.perplexity,
            "scored_tokens": res.scored_tokens,
            "kv_cache_blocks": run.config.cache.num_kv_blocks,  # None: sized by --kv-cache-memory-bytes
            "load_s": res.load_s,
            "peak_rss_bytes": res.peak_rss_bytes,
        }
        costs = f"load {res.load_s:.1f} s, peak RSS {res.peak_rss_bytes / _MIB:.0f} MiB"
        if dense is None:
            dense = res
            print(f"{run.label:<{width}} perplexity {res.perplexity:.3f} over {res.scored_tokens} tokens; {costs}")
        else:
            share, identical = _agreement(dense.greedy, res.greedy)
            ratio = res.perplexity / dense.perplexity
            entry |= {"perplexity_ratio": ratio, "greedy_prefix_agreement": share, "identical_outputs": identical}
            print(
                f"{run.label:<{width}} perplexity {res.perplexity:.3f} ({ratio:.4f}x dense); greedy: {share:.1%} of "
                f"tokens "
                f"before the first difference, {identical}/{len(CHAT_PROMPTS)} outputs identical ({ns.max_tokens} "
                f"tokens each); {costs}"
            )
        results[run.label] = entry
        sys.stdout.flush()
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(results, indent=2))
    return 0
