"""`triollm bench lora`: what serving LoRA adapters costs against the base model alone.

In one sitting, two engines on the same model, one after the other: the base model alone
(`enable_lora` off), then `enable_lora` with `--num-adapters` adapters in `max_loras` slots.
Reported: output tok/s of the offline random workload (`bench throughput`'s: 64 prompts, lengths
uniform 32-256 in and out, `ignore_eos`) on the base engine and, on the LoRA engine, with the
prompts spread round-robin over the adapters (so every step mixes them); and batch-1 decode ms
per token (median step) without and with an adapter. The two ratios are issue 26's targets.

Adapters: `--adapters DIR ...` (PEFT checkpoints for this model), else random ones of rank
`--rank` on all seven projections, written into a temporary directory in PEFT's layout
(`adapter_config.json` + `adapter_model.safetensors`; no peft needed).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from triollm import EngineArgs
from triollm.bench.throughput import add_workload_args, random_workload

__all__ = ["add_lora_parser", "write_random_adapter"]


def add_lora_parser(kinds: Any) -> None:
    p = kinds.add_parser(
        "lora", help="LoRA adapters: throughput over several adapters and batch-1 decode, against the base model"
    )
    add_workload_args(p)
    p.add_argument(
        "--num-adapters", type=int, default=4, help="adapters the prompts are spread over (default: %(default)s)"
    )
    p.add_argument("--rank", type=int, default=16, help="the random adapters' rank r (default: %(default)s)")
    p.add_argument(
        "--adapters",
        nargs="+",
        default=None,
        metavar="DIR",
        help="PEFT adapter directories to use instead of random ones",
    )
    p.add_argument(
        "--decode-tokens", type=int, default=128, help="batch-1: tokens decoded per run (default: %(default)s)"
    )
    p.add_argument("--output-json", default=None, help="write the results here")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_lora)


def write_random_adapter(out: Path, model: Any, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter (all seven projections) for a model of config `model`."""
    from safetensors.torch import save_file

    hd, h, kvh = model.head_dim, model.num_heads, model.num_kv_heads
    hidden, inter = model.hidden_size, model.intermediate_size
    shapes = {
        "self_attn.q_proj": (hidden, h * hd), "self_attn.k_proj": (hidden, kvh * hd),
        "self_attn.v_proj": (hidden, kvh * hd), "self_attn.o_proj": (h * hd, hidden),
        "mlp.gate_proj": (hidden, inter), "mlp.up_proj": (hidden, inter), "mlp.down_proj": (inter, hidden),
    }  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model.num_layers):
        for name, (fan_in, fan_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * fan_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.01
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "use_rslora": False,
        "target_modules": [n.split(".")[1] for n in shapes], "base_model_name_or_path": str(model.path),
    }  # fmt: skip
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def _throughput(engine: Any, work: list[tuple[list[int], int]], loras: list[Any]) -> float:
    from triollm import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in work]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for _, n in work]
    warm = min(4, len(work))
    engine.generate(prompts[:warm], params[:warm], lora_request=loras[:warm])
    start = time.perf_counter()
    outs = engine.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert gen == sum(n for _, n in work), "ignore_eos run produced the wrong token count"
    return gen / elapsed


def _batch1(engine: Any, vocab: int, tokens: int, lora: Any) -> float:
    """Median seconds per decode step of one request (its first step, the prompt, excluded)."""
    from triollm import SamplingParams

    rng = random.Random(1)
    prompt = {"prompt_token_ids": [rng.randrange(min(1000, vocab)) for _ in range(32)]}
    engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0), lora_request=[lora])
    engine.add_request(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0), lora_request=lora)
    times = []
    t = time.perf_counter()
    for _ in engine.run():
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return statistics.median(times[1:])


def run_lora(ns: argparse.Namespace) -> int:
    # Not LLM: batch-1 times each engine step, and the throughput run is bench throughput's.
    from triollm.engine.sync_engine import SyncEngine
    from triollm.lora.request import LoRARequest

    args = EngineArgs.from_cli_args(ns)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    base_args = EngineArgs.from_cli_args(ns)
    base_args.enable_lora = False
    engine = SyncEngine.from_engine_args(base_args)
    model = engine.config.model
    vocab = model.vocab_size
    work = random_workload(ns, vocab)
    none: list[Any] = [None] * len(work)
    print(f"model {model.path} dtype {model.dtype} quantization {model.quantization} threads {torch.get_num_threads()}")
    res: dict[str, float] = {}
    res["base/output_tokens_per_s"] = _throughput(engine, work, none)
    res["base/batch1_ms_per_token"] = 1e3 * _batch1(engine, vocab, ns.decode_tokens, None)
    del engine
    with tempfile.TemporaryDirectory(prefix="triollm-bench-lora-") as tmp:
        paths = ns.adapters or [
            str(write_random_adapter(Path(tmp) / f"a{i}", model, ns.rank, i)) for i in range(ns.num_adapters)
        ]
        adapters = [LoRARequest(f"adapter{i}", i + 1, p) for i, p in enumerate(paths)]
        args.enable_lora = True
        args.max_loras = max(args.max_loras, len(adapters))
        args.max_cpu_loras = max(args.max_cpu_loras or 0, len(adapters))
        args.max_lora_rank = max(args.max_lora_rank, ns.rank)
        engine = SyncEngine.from_engine_args(args)
        spread = [adapters[i % len(adapters)] for i in range(len(work))]
        res["lora/output_tokens_per_s"] = _throughput(engine, work, spread)
        res["lora/batch1_ms_per_token"] = 1e3 * _batch1(engine, vocab, ns.decode_tokens, adapters[0])
        res["lora_engine_base/batch1_ms_per_token"] = 1e3 * _batch1(engine, vocab, ns.decode_tokens, None)
    res["ratio/throughput"] = res["lora/output_tokens_per_s"] / res["base/output_tokens_per_s"]
    res["ratio/batch1"] = res["lora/batch1_ms_per_token"] / res["base/batch1_ms_per_token"]
    n = len(adapters)
    print(
        f"{'base alone':<34} {res['base/output_tokens_per_s']:8.1f} output tok/s   batch-1 "
        f"{res['base/batch1_ms_per_token']:6.2f} ms/token"
    )
    print(
        f"{f'{n} adapters (prompts round-robin)':<34} {res['lora/output_tokens_per_s']:8.1f} output tok/s   batch-1 "
        f"{res['lora/batch1_ms_per_token']:6.2f} ms/token (one adapter)"
    )
    print(
        f"{'LoRA engine, base request':<34} {'':>8}                batch-1 "
        f"{res['lora_engine_base/batch1_ms_per_token']:6.2f} ms/token"
    )
    print(
        f"ratios: throughput {res['ratio/throughput']:.2f}x (adapters / base), batch-1 {res['ratio/batch1']:.2f}x "
        f"(adapter / base)"
    )
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(res, indent=2))
    return 0
