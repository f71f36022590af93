"""`triollm bench step`: where the time of one batch-N decode step goes (issue 41).

The workload: N requests (`--batch`) of random token-id prompts (`--input-len`, seed 0), greedy,
`ignore_eos`, with room to decode past the run. The engine steps until every prompt is done,
then `--warmup` steps, then `--steps` timed steps, each one an all-decode step of exactly N rows
(one that is not, after a preemption say, is an error: it would time another batch).

The phases of a step are timed by wrapping the engine's own methods on their instances for the
run (restored after), so nothing in the engine knows it is measured: `Scheduler.schedule`, the
runner's input building (`_gather` + `_tensors`), the model's forward (a quantized model's
all-decode step is one native `quant_decoder_stack` call), the logits (`_logits`), the sampler,
`update_from_output`, and the frontend's `on_outputs` (detokenization, RequestOutput assembly;
as `LLM.generate` runs it, outputs FINAL_ONLY). The phases are disjoint; what is left of
`SyncEngine.step()` is "other Python" (ordering rows, building sampling rows, the core's
bookkeeping). Figures are means over the timed steps, so the parts add up to the mean step.

No timer can split a native call, so the forward is split by estimate: every layer's
projections run alone, in the forward's order (each weight then comes from memory, as in a step,
not from the cache a projection timed in a loop would leave it in), on random `[N, in]` inputs in
the activations' dtype, as the step calls them (a quantized model's: the native kernel the stack
calls, without `QuantLinear.forward`'s Python); each call's time goes to its kind (name in the
layer, shape, format: a GGUF may mix formats across layers); the median of 5 such passes after a
warm-up. Attention and the rest of the forward (norms, rotary, embedding, KV write) is the forward
minus these: an estimate, which timing noise can push below zero where the linears are most of
the forward.

Floors: a linear's max(2·N·in·out / peak, weight bytes as stored / bandwidth); the logits' the
same for the head (the lm_head, or the tied embedding that `compute_logits` uses); attention's
the K and V bytes the step reads (each row's positions, every layer, window-capped) / bandwidth.
Bandwidth is bench latency's copy bandwidth. Peak is measured, not a datasheet's: a large square
`torch.mm` in the linears' compute dtype (fp32 for quantized and fp32 models; for bf16 the
faster of bf16 and fp32, as a CPU without bf16 instructions widens to fp32) at the engine's thread
count, a practical ceiling (the quantized kernels' int8 dot products may beat fp32's). CPU only,
one rank, no speculation, no LoRA: each would change what a step is.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from triollm import EngineArgs, SamplingParams
from triollm.bench.latency import measure_bandwidth

__all__ = ["add_step_parser", "run_step"]

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "avx512_vnni", "avx_vnni")
# Phases timed inside the step, in the table's order: (key, label).
PHASES = (
    ("forward", "forward"),
    ("logits", "logits"),
    ("sampling", "sampling"),
    ("schedule", "scheduler.schedule"),
    ("inputs", "input building (_gather + _tensors)"),
    ("update", "update_from_output"),
    ("frontend", "frontend outputs (on_outputs)"),
)


def add_step_parser(kinds: Any) -> None:
    st = kinds.add_parser("step", help="where a batch-N decode step's time goes, against its floors")
    st.add_argument("--batch", type=int, default=64, help="requests decoding together (default: %(default)s)")
    st.add_argument("--input-len", type=int, default=200, help="prompt tokens per request (default: %(default)s)")
    st.add_argument("--warmup", type=int, default=5, help="decode steps before timing (default: %(default)s)")
    st.add_argument("--steps", type=int, default=20, help="timed decode steps (default: %(default)s)")
    st.add_argument("--json", "--output-json", dest="json", default=None, metavar="PATH", help="write the results here")
    EngineArgs.add_cli_args(st)
    st.set_defaults(func=run_step)


# --- timing the phases --------------------------------------------------------------------------


class _Phases:
    """Seconds per phase of the current step, from wrappers set on the engine's instances."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.last: dict[str, Any] = {}  # each phase's last return value
        self._undo: list[tuple[object, str, Any]] = []

    def wrap(self, obj: object, attr: str, phase: str) -> None:
        original = getattr(obj, attr)
        # An instance attribute (the runner's sampler) is put back; a method's wrapper is deleted.
        self._undo.append((obj, attr, vars(obj).get(attr, _MISSING)))

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                self.last[phase] = result = original(*args, **kwargs)
                return result
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

        setattr(obj, attr, timed)

    def restore(self) -> None:
        for obj, attr, before in reversed(self._undo):
            if before is _MISSING:
                delattr(obj, attr)
            else:
                setattr(obj, attr, before)
        self._undo.clear()


_MISSING = object()


def _wrap_engine(engine: Any, runner: Any, phases: _Phases) -> None:
    phases.wrap(engine.core.scheduler, "schedule", "schedule")
    phases.wrap(engine.core.scheduler, "update_from_output", "update")
    phases.wrap(runner, "_gather", "inputs")
    phases.wrap(runner, "_tensors", "inputs")
    phases.wrap(runner.model, "forward", "forward")  # nn.Module.__call__ looks forward up on the instance
    phases.wrap(runner, "_logits", "logits")
    phases.wrap(runner, "sampler", "sampling")
    phases.wrap(engine.frontend, "on_outputs", "frontend")


def _all_decode(sched: Any, batch: int) -> bool:
    return len(sched.scheduled) == batch and all(s.num_new_tokens == 1 for s in sched.scheduled)


def _kv_bytes(sched: Any, cfg: Any, per_token_layer: int) -> int:
    """K and V bytes a decode step reads: each row's positions 0..p in every layer (window-capped)."""
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    total = 0
    for s in sched.scheduled:
        ctx = s.num_computed_tokens + 1
        total += sum(ctx if w is None else min(ctx, w) for w in windows)
    return total * per_token_layer


# --- the linears alone --------------------------------------------------------------------------


@dataclass
class _Kind:
    """The projections of one name, shape and format across the layers."""

    name: str  # its path in the layer: self_attn.qkv_proj
    fmt: str  # q4, q8, or the dense weight's dtype
    in_features: int
    out_features: int
    nbytes: int  # one layer's
    count: int = 0


def _nbytes(module: nn.Module) -> int:
    """The bytes of a module's own tensors as stored (packed codes, scales, offsets; an opaque
    oneDNN weight) and its bias."""
    tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    return sum(int(t.numel()) * t.element_size() for t in tensors)


def _linears(model: nn.Module) -> list[tuple[_Kind, Callable[[torch.Tensor], Any]]]:
    """Every layer's projections in the order a forward runs them, each with its kind and what
    the step calls for it."""
    # Not public: the layer classes, to find the projections a layer holds.
    from triollm.engine.execution.layers.linear import Linear
    from triollm.engine.execution.layers.quantized import QuantLinear

    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError("bench step: the model has no decoder layers to split (--model-impl transformers?)")
    kinds: dict[tuple[str, str, int, int, int], _Kind] = {}
    out = []
    for layer in layers:
        for name, m in layer.named_modules():
            if isinstance(m, QuantLinear):
                fmt = f"q{m.bits}"
            elif isinstance(m, Linear):
                fmt = _name(m.weight.dtype)
            else:
                continue
            size = _nbytes(m)
            key = (name, fmt, m.in_features, m.out_features, size)
            kind = kinds.setdefault(key, _Kind(name, fmt, m.in_features, m.out_features, size))
            kind.count += 1
            out.append((kind, _alone(m)))
    return out


def _alone(module: nn.Module) -> Callable[[torch.Tensor], Any]:
    """What a step runs for this projection: the native stack calls the quantized kernel itself
    (the int8 one, or the bf16 tiles where the layer takes them for as many rows), without
    `QuantLinear.forward`'s Python (much of a small batch's call); elsewhere the layer's forward."""
    # Not public: the kernels the native decoder stack calls, to time them as the stack does.
    from triollm.engine.execution.layers.quantized import QuantLinear
    from triollm.kernels import cpu_native
    from triollm.kernels.quant import TILE_MIN_ROWS

    m = module
    if isinstance(m, QuantLinear) and m.bias is None and m.perm is None and cpu_native.available():
        ops = torch.ops.triollm_cpu

        def run(x: torch.Tensor) -> Any:
            if m.tiles and x.shape[0] >= TILE_MIN_ROWS:
                return ops.quant_linear_bf16(x.float(), m.qp, m.dp, m.mp, m.bits, m.n)
            return ops.quant_linear_packed(x.float(), m.qp, m.dp, m.mp, m.bits, m.n, "auto")

        return run
    return module.forward


def _time_linears(
    linears: list[tuple[_Kind, Callable[[torch.Tensor], Any]]], rows: int, dtype: torch.dtype, passes: int = 5
) -> dict[int, float]:
    """Seconds per kind (by id) of one pass over every projection in forward order: the median
    of `passes` after one warm-up pass. In order, each weight comes from memory as in a step,
    not from the cache a projection timed in a loop would leave it in."""
    inputs = {k.in_features: torch.randn(rows, k.in_features, dtype=dtype) for k, _ in linears}
    totals: dict[int, list[float]] = {id(k): [] for k, _ in linears}
    with torch.inference_mode():
        for i in range(passes + 1):
            spent = dict.fromkeys(totals, 0.0)
            for kind, fn in linears:
                x = inputs[kind.in_features]
                start = time.perf_counter()
                fn(x)
                spent[id(kind)] += time.perf_counter() - start
            if i:
                for key, seconds in spent.items():
                    totals[key].append(seconds)
    return {key: statistics.median(values) for key, values in totals.items()}


def _time_alone(fn: Callable[[torch.Tensor], Any], x: torch.Tensor, reps: int = 5) -> float:
    with torch.inference_mode():
        for _ in range(2):
            fn(x)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def _head_bytes(model: Any) -> int:
    """The weight `compute_logits` reads: the lm_head, else the tied embedding (its packed copy
    where there is one)."""
    if model.lm_head is not None:
        return _nbytes(model.lm_head)
    if model.packed_tied_head is not None:
        t = model.packed_tied_head
        return int(t.numel()) * t.element_size()
    return _nbytes(model.embed_tokens)


def measure_gemm_peak(dtype: torch.dtype, n: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of an n-square `torch.mm` in `dtype` at torch's thread count (best of `repeats`,
    after one warm-up)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * n**3 / best


def _floor(flops: float, nbytes: float, peak: float, bw: float) -> float:
    return max(flops / peak, nbytes / bw)


# --- the run ------------------------------------------------------------------------------------


def _check(ns: argparse.Namespace, args: EngineArgs) -> None:
    for flag, value, least in (
        ("--batch", ns.batch, 1), ("--input-len", ns.input_len, 1), ("--steps", ns.steps, 1),
        ("--warmup", ns.warmup, 0),
    ):  # fmt: skip
        if value < least:
            raise ValueError(f"{flag}: must be at least {least}, got {value}")
    why = {
        "speculative_config": "a speculating step feeds drafts, not one row per request",
        "enable_lora": "adapter rows take other paths",
    }
    for field, reason in why.items():
        if getattr(args, field, None):
            raise ValueError(f"{field}: bench step times a plain decode step ({reason}); leave it unset")
    if (args.tensor_parallel_size or 1) > 1:
        raise ValueError("tensor_parallel_size: bench step times one rank's model alone; leave it at 1")


def _check_room(ns: argparse.Namespace, engine: Any) -> int:
    """max_tokens for each request; refuses a run whose batch would not stay at N."""
    need = ns.input_len + ns.warmup + ns.steps + 1
    max_len = engine.config.model.max_model_len
    if need > max_len:
        raise ValueError(
            f"--input-len + --warmup + --steps: {need} tokens exceed max_model_len ({max_len}); pass "
            f"--max-model-len {need} or shorten them"
        )
    if engine.config.scheduler.max_num_seqs < ns.batch:
        raise ValueError(
            f"--batch: {ns.batch} requests exceed max_num_seqs ({engine.config.scheduler.max_num_seqs}); pass "
            f"--max-num-seqs {ns.batch}"
        )
    capacity = engine.core.num_blocks * engine.config.cache.block_size
    if ns.batch * need > capacity:
        raise ValueError(
            f"--batch: {ns.batch} requests of {need} tokens need {ns.batch * need} KV slots, more than the cache's "
            f"{capacity}; pass --kv-cache-memory-bytes or a smaller --batch"
        )
    return min(max_len - ns.input_len, capacity - ns.input_len + 1)


def _cpu() -> dict[str, Any]:
    name, flags = "unknown", set[str]()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and name == "unknown":
            name = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"model_name": name, "flags": [f for f in CPU_FLAGS if f in flags]}


def run_step(ns: argparse.Namespace) -> int:
    # Not LLM: the engine alone (SyncEngine), its phases wrapped and each step timed.
    from triollm.engine.execution.model_runner import ModelRunner
    from triollm.engine.sync_engine import SyncEngine

    args = EngineArgs.from_cli_args(ns)
    _check(ns, args)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    engine = SyncEngine.from_engine_args(args)
    runner, cfg = engine.core.runner, engine.config.model
    if not isinstance(runner, ModelRunner) or runner.device.type != "cpu":
        raise ValueError("device: bench step times the CPU model runner; pass --device cpu")
    params = SamplingParams(max_tokens=_check_room(ns, engine), ignore_eos=True, temperature=0.0)
    rng = random.Random(0)
    top = min(cfg.vocab_size, 10000)
    for _ in range(ns.batch):
        engine.add_request({"prompt_token_ids": [rng.randrange(top) for _ in range(ns.input_len)]}, params)
    phases = _Phases()
    _wrap_engine(engine, runner, phases)
    try:
        steps = _run_steps(engine, phases, ns)
    finally:
        phases.restore()
    res = _results(ns, engine, runner.model, steps)
    print(_table(res))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def _run_steps(engine: Any, phases: _Phases, ns: argparse.Namespace) -> list[dict[str, Any]]:
    """Step to the first all-decode step, warm up, then time `ns.steps` steps."""
    sched = None
    while sched is None or not _all_decode(sched, ns.batch):
        if not engine.has_unfinished_requests():
            raise RuntimeError("bench step: the requests finished before every prompt was done")
        engine.step()
        sched = phases.last.get("schedule")
    for _ in range(ns.warmup):
        engine.step()
    steps = []
    for i in range(ns.steps):
        phases.seconds.clear()
        start = time.perf_counter()
        engine.step()
        whole = time.perf_counter() - start
        sched = phases.last["schedule"]
        if not _all_decode(sched, ns.batch):
            raise RuntimeError(
                f"bench step: timed step {i} ran {len(sched.scheduled)} requests, {sched.num_tokens} tokens, not "
                f"{ns.batch} decodes (preempted? give the KV cache more room)"
            )
        steps.append({"whole": whole, "phases": dict(phases.seconds), "sched": sched})
    return steps


def _results(ns: argparse.Namespace, engine: Any, model: Any, steps: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the steps in ms (the phases, the forward's split, what is left), and floors."""
    from triollm.kernels import KVCache  # Not public: the KV bytes per token, for attention's floor

    cfg, n = engine.config.model, ns.batch
    order = _linears(model)
    kinds = list({id(k): k for k, _ in order}.values())
    gemm_dtype = torch.float32 if any(k.fmt.startswith("q") for k in kinds) else cfg.dtype
    # A CPU without the dtype's instructions (bf16 on AVX2) widens to fp32: fp32's peak is then
    # the ceiling (a bf16 `torch.mm` there runs at ~1 GFLOP/s, a floor no layer could meet).
    bw, peak = measure_bandwidth(), measure_gemm_peak(torch.float32)
    if gemm_dtype != torch.float32:
        native = measure_gemm_peak(gemm_dtype, n=1024)
        peak, gemm_dtype = (native, gemm_dtype) if native > peak else (peak, torch.float32)
    seconds = _time_linears(order, n, cfg.dtype)
    linears = {}
    for k in kinds:
        flops, nbytes = 2.0 * n * k.in_features * k.out_features * k.count, k.nbytes * k.count
        label = k.name.rsplit(".", 1)[-1]
        if sum(j.name.rsplit(".", 1)[-1] == label for j in kinds) > 1:
            label += f" ({k.fmt}, {k.in_features}x{k.out_features})"
        linears[label] = {
            "layers": k.count, "in": k.in_features, "out": k.out_features, "format": k.fmt,
            "ms": seconds[id(k)] * 1e3, "ms_per_layer": seconds[id(k)] / k.count * 1e3, "bytes": nbytes,
            "flops": flops, "floor_ms": _floor(flops, nbytes, peak, bw) * 1e3,
        }  # fmt: skip
    hidden, vocab = model.cfg.hidden_size, model.cfg.vocab_size
    head_alone = _time_alone(model.compute_logits, torch.randn(n, hidden, dtype=cfg.dtype))
    head_flops, head_bytes = 2.0 * n * hidden * vocab, _head_bytes(model)
    per_token = KVCache.bytes_per_block(1, model.cfg.num_kv_heads, model.cfg.head_dim, 1, cfg.cache_dtype)
    kv_bytes = statistics.mean(_kv_bytes(s["sched"], model.cfg, per_token) for s in steps)

    ms = {key: statistics.mean(s["phases"].get(key, 0.0) for s in steps) * 1e3 for key, _ in PHASES}
    whole = statistics.mean(s["whole"] for s in steps) * 1e3
    floors = {
        "linears": sum(v["floor_ms"] for v in linears.values()),
        "attention_and_rest": kv_bytes / bw * 1e3,
        "logits": _floor(head_flops, head_bytes, peak, bw) * 1e3,
    }
    floors["forward"] = floors["linears"] + floors["attention_and_rest"]
    floors["step"] = floors["forward"] + floors["logits"]
    linear_ms = sum(v["ms"] for v in linears.values())
    parts: dict[str, dict[str, Any]] = {
        "linears": {"ms": linear_ms},
        "attention_and_rest": {"ms": ms["forward"] - linear_ms, "kv_bytes": kv_bytes},
        **{key: {"ms": ms[key]} for key, _ in PHASES},
        "other_python": {"ms": whole - sum(ms.values())},
        "python_around_step": {"ms": whole - ms["forward"] - ms["logits"] - ms["sampling"]},
        "step": {"ms": whole, "median_ms": statistics.median(s["whole"] for s in steps) * 1e3},
    }
    for key, floor in floors.items():
        parts[key]["floor_ms"] = floor
    parts["logits"].update(lm_head_alone_ms=head_alone * 1e3, bytes=head_bytes, flops=head_flops)
    contexts = [s.num_computed_tokens + 1 for st in steps for s in st["sched"].scheduled]
    return {
        "model": str(cfg.path), "dtype": _name(cfg.dtype), "kv_cache_dtype": _name(cfg.cache_dtype),
        "batch": n, "input_len": ns.input_len, "warmup": ns.warmup, "steps": ns.steps,
        "context_first": min(contexts), "context_reached": max(contexts), "threads": torch.get_num_threads(),
        "cpu": _cpu(), "bandwidth_bytes_per_s": bw, "gemm_peak_flops": peak, "gemm_peak_dtype": _name(gemm_dtype),
        "num_layers": cfg.num_layers, "linears": linears, "parts": parts,
    }  # fmt: skip


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _table(res: dict[str, Any]) -> str:
    parts, whole = res["parts"], res["parts"]["step"]["ms"]
    cpu = res["cpu"]
    head = (
        f"model {res['model']}, dtype {res['dtype']} (KV cache {res['kv_cache_dtype']}), batch {res['batch']}, "
        f"context {res['context_first']}->{res['context_reached']} tokens, threads {res['threads']}; "
        f"CPU {cpu['model_name']} ({', '.join(cpu['flags']) or 'none of ' + '/'.join(CPU_FLAGS)}); "
        f"copy bandwidth {res['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, measured GEMM peak "
        f"{res['gemm_peak_flops'] / 1e9:.0f} GFLOP/s ({res['gemm_peak_dtype']} torch.mm: a practical ceiling); "
        f"means of {res['steps']} steps"
    )
    rows: list[tuple[str, float, float | None]] = []
    for label, v in res["linears"].items():
        what = f"{label} x{v['layers']} ({v['in']}->{v['out']}, {v['format']}, timed alone)"
        rows.append((what, v["ms"], v["floor_ms"]))
    labels = dict(PHASES)

    def add(key: str, label: str, bold: bool = False) -> None:
        p = parts[key]
        rows.append((f"**{label}**" if bold else label, p["ms"], p.get("floor_ms")))

    add("linears", "linears total")
    add("attention_and_rest", "attention, norms, rotary, KV write (forward - linears)")
    add("forward", "forward", bold=True)
    add("logits", f"logits (lm_head alone {parts['logits']['lm_head_alone_ms']:.2f} ms)")
    add("sampling", labels["sampling"])
    for key in ("schedule", "inputs", "update", "frontend"):
        add(key, labels[key])
    add("other_python", "other Python")
    add("python_around_step", "Python around the step (step - forward, logits, sampling)", bold=True)
    add("step", "whole step", bold=True)
    lines = [head, "", "| part | ms / step | % of step | floor ms |", "| --- | ---: | ---: | ---: |"]
    for label, value, floor in rows:
        floor_s = "" if floor is None else f"{floor:.2f}"
        lines.append(f"| {label} | {value:.2f} | {100 * value / whole:.1f}% | {floor_s} |")
    return "\n".join(lines)
