"""The GPU check: one command that a bare GPU machine runs in minutes and that answers
everything about the CUDA path in one go (issue 28).

    python3 tests/gpu_check.py --out DIR [--model-dir build/gpu-bundle/model] [--parts a,b]
    python3 tests/gpu_check.py --cpu --out DIR --model-dir DIR   # the same, under the interpreter

Needs the machine's own torch and Triton and nothing else for the kernel parts; the end-to-end
parts import the engine, whose pure-Python and small wheels come in `make gpu-bundle`'s folder
(installed with `pip --no-index --target`; docs/benchmarks.md, "GPU: expected", has the one
command). A checkout is enough: when `triollm` is not installed, the package is put on the path
through a link to the repository root.

Parts (each in its own process, with a time limit: a crash or a hang stops only that part):
- env: GPU, driver, clocks, torch/Triton/CUDA versions, which optional packages import.
- kernels: every Triton kernel against its torch reference (in fp32, NaN replaced by zeros) in
  fp16, bf16 and fp32 on realistic shapes: random KV in scattered blocks, ragged lengths,
  unused blocks and the outputs filled with NaN, split-KV, window and soft-cap, varlen prefill.
- copy: the measured copy ceiling (device-to-device, bytes read + written, CUDA-event median).
- decode_bw: paged decode attention's bandwidth against that ceiling and the HBM peak.
- sweep: decode tile size x warps x pipeline stages; the fastest correct configuration.
- prefill: prefill attention throughput, one varlen launch against one launch per sequence.
- e2e_graphs, e2e_eager, e2e_hf: a SmolLM2-shaped model with seeded random weights (the
  bundled model's config and tokenizer): batch-1 ms/token and 64-request output tok/s, triollm
  with CUDA graphs on and off, and transformers on the same weights ("skipped: no
  transformers" without it).

Output: a summary table on stdout (parts, then the predictions of docs/benchmarks.md against
what was measured) and one JSON file, DIR/gpu_check.json, rewritten after every part.
`--parts` reruns some parts and merges them into the JSON already in DIR. Exit status 1 when a
part failed, crashed or ran out of time (a missed prediction is reported, not a failure).

`--cpu` runs the same runner, parts, JSON and summary on CPU under the Triton interpreter with
small shapes (tests/test_gpu_check.py runs it in `make test`); its timings mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT_FILE = "gpu_check.json"
PEAK_GBS = 4800.0  # the H200's HBM3e, by its datasheet
DEFAULT_MODEL_DIR = ROOT / "build" / "gpu-bundle" / "model"
FAULTS = ("crash", "hang", "error", "fail")  # --fault PART:KIND, for the runner's own tests


class Skipped(Exception):
    """A part that cannot run here (the reason is its note)."""


# ----------------------------------------------------------------------------- the runner


@dataclass(frozen=True)
class Part:
    name: str
    run: Callable[[Ctx], None]
    gpu_limit_s: float
    cpu_limit_s: float
    kernels_env: bool = True  # --cpu: the part calls the Triton kernels (TRIOLLM_KERNELS=triton)
    log_failures: tuple[tuple[str, str], ...] = ()  # (text in the part's log, the failed check)


@dataclass
class Ctx:
    """What a part sees: the mode, the folders, and its result being built."""

    cpu: bool
    out: Path
    model_dir: Path | None
    peak_gbs: float
    checks: list[dict[str, Any]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    headline: str = ""

    @property
    def device(self) -> str:
        return "cpu" if self.cpu else "cuda"

    def check(self, name: str, ok: bool, **detail: Any) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), **detail})
        print(f"{'ok  ' if ok else 'FAIL'} {name} {json.dumps(detail)}", flush=True)
        return ok

    def result(self, status: str, seconds: float) -> dict[str, Any]:
        return {
            "status": status,
            "seconds": round(seconds, 2),
            "headline": self.headline,
            "checks": self.checks,
            "metrics": self.metrics,
            "notes": self.notes,
        }


def _bootstrap_package() -> None:
    """`import triollm` from a bare checkout: the repository root is the package, so a folder
    holding a `triollm` link to it goes on `sys.path` and `PYTHONPATH` (the parts inherit it)."""
    if importlib.util.find_spec("triollm") is not None:
        return
    folder = Path(tempfile.gettempdir()) / f"gpu-check-path-{os.getuid()}"
    folder.mkdir(exist_ok=True)
    link = folder / "triollm"
    if link.is_symlink() and link.resolve() != ROOT:
        link.unlink()
    if not link.exists():
        link.symlink_to(ROOT, target_is_directory=True)
    sys.path.insert(0, str(folder))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))


def _part_env(part: Part, cpu: bool) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRIOLLM_KERNELS", None)
    env.pop("TRITON_INTERPRET", None)
    if cpu:
        env["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before any import
        if part.kernels_env:
            env["TRIOLLM_KERNELS"] = "triton"  # and the cache layout the GPU gets
    return env


def run_part_process(part: Part, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """Run one part in a child process (its own session, so a timeout kills all of it)."""
    folder = args.out / "parts"
    folder.mkdir(parents=True, exist_ok=True)
    result_path, log_path = folder / f"{part.name}.json", folder / f"{part.name}.log"
    result_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run-part", part.name, "--out", str(args.out)]
    cmd += ["--peak-gbs", str(args.peak_gbs)]
    if args.model_dir is not None:
        cmd += ["--model-dir", str(args.model_dir)]
    if args.cpu:
        cmd.append("--cpu")
    for fault in args.fault:
        cmd += ["--fault", fault]
    start = time.perf_counter()
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=_part_env(part, args.cpu), start_new_session=True
        )
        try:
            rc: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    seconds = time.perf_counter() - start
    log_text = log_path.read_text(errors="replace")
    tail = log_text[-2000:]
    if rc is None:
        result: dict[str, Any] = {
            "status": "timeout",
            "seconds": round(seconds, 2),
            "headline": f"killed after {timeout:.0f} s",
            "log_tail": tail,
        }
    elif not result_path.exists():
        result = {
            "status": "crashed",
            "seconds": round(seconds, 2),
            "headline": f"exit status {rc}, no result",
            "log_tail": tail,
        }
    else:
        result = json.loads(result_path.read_text())
        result["seconds"] = round(seconds, 2)
        if result["status"] == "error":
            result["log_tail"] = tail
    for text, check in part.log_failures:
        if text in log_text and result.get("status") == "ok":
            result["checks"].append({"name": check, "ok": False, "log": text})
            result["status"] = "fail"
    return result


def run_part_here(name: str, args: argparse.Namespace) -> int:
    """The child's side: run the part, write its result file."""
    ctx = Ctx(args.cpu, args.out, args.model_dir, args.peak_gbs)
    start = time.perf_counter()
    fault = dict(f.split(":", 1) for f in args.fault).get(name)
    try:
        if fault == "crash":
            os.abort()
        if fault == "hang":
            time.sleep(3600)
        if fault == "error":
            raise RuntimeError("injected error (--fault)")
        if fault == "fail":
            ctx.check("injected failure (--fault)", False)
        PARTS[name].run(ctx)
        status = "ok" if all(c["ok"] for c in ctx.checks) else "fail"
    except Skipped as e:
        status = "skipped"
        ctx.headline = f"skipped: {e}"
    except Exception:  # noqa: BLE001 - the part's failure is its result
        traceback.print_exc()
        status = "error"
        ctx.headline = traceback.format_exc(limit=1).strip().splitlines()[-1][:200]
    result = ctx.result(status, time.perf_counter() - start)
    path = args.out / "parts" / f"{name}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str))
    os.replace(tmp, path)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.run_part:
        _bootstrap_package()
        return run_part_here(args.run_part, args)
    _bootstrap_package()
    args.out.mkdir(parents=True, exist_ok=True)
    wanted = list(PARTS) if args.parts is None else args.parts
    report_path = args.out / RESULT_FILE
    report: dict[str, Any] = {"mode": "cpu" if args.cpu else "gpu", "parts": {}}
    if args.parts is not None and report_path.exists():
        previous = json.loads(report_path.read_text())
        if previous.get("mode") == report["mode"]:
            report = previous  # a rerun of some parts: merged into the earlier run's report
    report["peak_gbs"] = args.peak_gbs
    deadline = time.monotonic() + (args.budget or (300 if args.cpu else 480))
    for name in wanted:
        part = PARTS[name]
        left = deadline - time.monotonic()
        env_result = report["parts"].get("env", {})
        if name != "env" and not args.cpu and env_result.get("status") not in (None, "ok"):
            result = {"status": "skipped", "seconds": 0, "headline": "skipped: the env part failed (no usable GPU?)"}
        elif left < 5:
            result = {"status": "skipped", "seconds": 0, "headline": "skipped: out of time (--budget)"}
        else:
            limit = args.part_timeout or (part.cpu_limit_s if args.cpu else part.gpu_limit_s)
            print(f"== {name} (limit {min(limit, left):.0f} s)", flush=True)
            result = run_part_process(part, args, min(limit, left))
        report["parts"][name] = result
        report["predictions"] = predictions(report)
        report["agreement"] = agreement(report)
        print(
            f"== {name}: {result['status']} in {result.get('seconds', 0):.1f} s: {result.get('headline', '')}",
            flush=True,
        )
        report_path.write_text(json.dumps(report, indent=1, default=str))
    print(summary(report, report_path))
    failed = [n for n in wanted if report["parts"][n]["status"] not in ("ok", "skipped")]
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="on CPU under the Triton interpreter, small shapes")
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and the parts' logs")
    parser.add_argument("--parts", type=_part_names, help=f"comma-separated, of: {','.join(PARTS)} (default: all)")
    parser.add_argument(
        "--model-dir", type=Path, default=DEFAULT_MODEL_DIR if DEFAULT_MODEL_DIR.is_dir() else None,
        help=(
            "config.json + tokenizer of the model to shape the e2e parts' random weights on (default: make "
            "gpu-bundle's)"
        ),
    )  # fmt: skip
    parser.add_argument("--peak-gbs", type=float, default=PEAK_GBS, help="the HBM peak in GB/s (H200: 4800)")
    parser.add_argument(
        "--budget", type=float, help="seconds for the whole run; parts past it are skipped (default 480, --cpu 300)"
    )
    parser.add_argument("--part-timeout", type=float, help="one time limit for every part (default: each part's own)")
    parser.add_argument("--fault", action="append", default=[], type=_fault, help=argparse.SUPPRESS)
    parser.add_argument("--run-part", choices=list(PARTS), help=argparse.SUPPRESS)
    return parser


def _part_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown part(s) {unknown or text!r}; allowed: {', '.join(PARTS)}")
    return names


def _fault(text: str) -> str:
    part, _, kind = text.partition(":")
    if part not in PARTS or kind not in FAULTS:
        raise argparse.ArgumentTypeError(
            f"--fault PART:KIND, PART one of {', '.join(PARTS)}, KIND one of {', '.join(FAULTS)}"
        )
    return text


# ----------------------------------------------------------------------------- the report


def _metric(report: dict[str, Any], part: str, name: str) -> Any:
    return report["parts"].get(part, {}).get("metrics", {}).get(name)


def predictions(report: dict[str, Any]) -> list[dict[str, Any]]:
    """docs/benchmarks.md's predictions ("GPU: expected") against the figures measured."""
    frac = _metric(report, "decode_bw", "headline_frac_peak")
    b1 = _metric(report, "e2e_graphs", "b1_ms_per_token")
    tps = _metric(report, "e2e_graphs", "batch_tok_s")
    hf_tps = _metric(report, "e2e_hf", "batch_tok_s")
    ratio = tps / hf_tps if tps and hf_tps else None
    rows = [
        ("decode attention >= 50% of HBM peak", frac, lambda v: v >= 0.5, lambda v: f"{v:.0%}"),
        ("batch-1 decode <= 2.5 ms/token, graphs", b1, lambda v: v <= 2.5, lambda v: f"{v:.2f} ms"),
        ("64 requests >= 20k output tok/s", tps, lambda v: v >= 20000, lambda v: f"{v:.0f} tok/s"),
        (">= 2x transformers (64 requests)", ratio, lambda v: v >= 2.0, lambda v: f"{v:.2f}x"),
    ]
    out = []
    for text, value, met, fmt in rows:
        if value is None:
            verdict, shown = "not measured", "-"
        else:
            verdict = "n/a (cpu)" if report["mode"] == "cpu" else ("met" if met(value) else "MISSED")
            shown = fmt(value)
        out.append({"prediction": text, "measured": shown, "value": value, "verdict": verdict})
    return out


def agreement(report: dict[str, Any]) -> dict[str, str]:
    """How many of the first greedy tokens (8 requests x 8 tokens) the e2e parts share: the same
    weights and prompts, so graphs on and off should agree, and transformers nearly (random
    weights make near-ties, where bf16 rounding may pick another token)."""
    first = {n: _metric(report, n, "first_tokens") for n in ("e2e_graphs", "e2e_eager", "e2e_hf")}
    out = {}
    for a, b in (("e2e_graphs", "e2e_eager"), ("e2e_graphs", "e2e_hf")):
        if first[a] and first[b]:
            pairs = [(x, y) for ra, rb in zip(first[a], first[b]) for x, y in zip(ra, rb)]
            out[f"{a} vs {b}"] = f"{sum(x == y for x, y in pairs)}/{len(pairs)} tokens equal"
    return out


def summary(report: dict[str, Any], path: Path) -> str:
    env = report["parts"].get("env", {}).get("metrics", {})
    lines = [
        "",
        f"GPU check ({report['mode']}: {env.get('device', '?')}, torch {env.get('torch', '?')}, triton "
        f"{env.get('triton', '?')}) -> {path}",
        f"{'part':<12}{'status':<10}{'time':>8}  figures",
    ]
    for name, r in report["parts"].items():
        lines.append(f"{name:<12}{r['status']:<10}{r.get('seconds', 0):>7.1f}s  {r.get('headline', '')}")
    for name, r in report["parts"].items():
        for c in r.get("checks", []):
            if not c["ok"]:
                detail = {k: v for k, v in c.items() if k not in ("name", "ok")}
                lines.append(f"  FAIL {name}: {c['name']} {json.dumps(detail, default=str)}")
        if r["status"] in ("crashed", "error", "timeout"):
            last = [line for line in r.get("log_tail", "").splitlines() if line.strip()][-3:]
            lines += [f"  {name}: {line}" for line in last]
    for pair, text in report.get("agreement", {}).items():
        lines.append(f"greedy tokens, {pair}: {text}")
    lines.append("")
    lines.append(f"{'prediction':<42}{'measured':>14}  verdict")
    for p in report.get("predictions", []):
        lines.append(f"{p['prediction']:<42}{p['measured']:>14}  {p['verdict']}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- measuring


def median_ms(ctx: Ctx, fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """The median time of `fn` in ms: CUDA events around each call on the GPU (warm-up first),
    the host clock on CPU."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    if ctx.device == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        torch.cuda.synchronize()
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def rel_error(got: Any, want: Any) -> float:
    """‖got - want‖ / ‖want‖ in fp64; NaN anywhere in `got` is infinite error."""
    got, want = got.double(), want.double()
    if not bool(got.isfinite().all()):
        return math.inf
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@contextmanager
def torch_path() -> Iterator[None]:
    """The dispatch points on their torch path (the references), whatever the device."""
    saved = os.environ.get("TRIOLLM_KERNELS")
    os.environ["TRIOLLM_KERNELS"] = "torch"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRIOLLM_KERNELS", None)
        else:
            os.environ["TRIOLLM_KERNELS"] = saved


# Relative (Frobenius) error allowed against the fp32 reference: fp32 is computed in fp32 (tf32
# would be ~5e-4), fp16/bf16 round the inputs and the probabilities.
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}


@dataclass
class Shape:
    name: str
    kv_heads: int
    group: int
    head_dim: int
    block_size: int = 16


SMOLLM2 = Shape("smollm2", 3, 3, 64)  # 9 query heads, 3 KV heads, head_dim 64
LLAMA8B = Shape("llama8b", 8, 4, 128)  # 32 query heads, 8 KV heads, head_dim 128
TINY = Shape("tiny", 1, 3, 16)


class Paged:
    """A one-layer paged cache (the layout `allocate_kv_cache` gives the Triton kernels) filled
    with NaN, holding random K/V for sequences of `lens` tokens in shuffled blocks; `ref_k` and
    `ref_v` are its fp32 copies with NaN as 0 (the torch reference multiplies masked slots by
    zero probabilities, so it needs them finite)."""

    def __init__(self, ctx: Ctx, shape: Shape, lens: list[int], dtype: Any, seed: int = 0, poison: bool = True) -> None:
        import torch

        from triollm.kernels.attention import allocate_kv_cache, write_kv

        gen = torch.Generator().manual_seed(seed)
        bs, kvh, hd = shape.block_size, shape.kv_heads, shape.head_dim
        need = [-(-n // bs) for n in lens]
        num_blocks = (2 if poison else 1) * sum(need) + 2
        kv = allocate_kv_cache(1, num_blocks, bs, kvh, hd, dtype, ctx.device)
        self.k, self.v = kv.k[0], kv.v[0]
        if poison:
            self.k.fill_(float("nan"))
            self.v.fill_(float("nan"))
        free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: padding
        self.tables = [[free.pop() for _ in range(m)] for m in need]
        self.keys = [torch.randn(n, kvh, hd, generator=gen).to(ctx.device, dtype) for n in lens]
        self.values = [torch.randn(n, kvh, hd, generator=gen).to(ctx.device, dtype) for n in lens]
        for table, k, v in zip(self.tables, self.keys, self.values):
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(len(k))], device=ctx.device)
            write_kv(self.k, self.v, k, v, slots)
        self.ref_k, self.ref_v = self.k.float().nan_to_num(0.0), self.v.float().nan_to_num(0.0)
        self.lens, self.shape, self.device = lens, shape, ctx.device

    def table_tensor(self, extra: int = 0) -> Any:
        """`[B, widest + extra]` int32, rows padded with block 0 (NaN)."""
        import torch

        width = max(map(len, self.tables)) + extra
        rows = [t + [0] * (width - len(t)) for t in self.tables]
        return torch.tensor(rows, dtype=torch.int32, device=self.device)


# ----------------------------------------------------------------------------- the parts


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a finder that refuses it
        return False


def part_env(ctx: Ctx) -> None:
    import platform

    import torch

    m = ctx.metrics
    m["python"] = platform.python_version()
    m["torch"] = torch.__version__
    m["cuda_runtime"] = torch.version.cuda
    try:
        import triton

        m["triton"] = triton.__version__
    except ImportError:
        m["triton"] = None
    ctx.check("triton imports", m["triton"] is not None)
    m["packages"] = {
        name: _importable(name)
        for name in ("msgspec", "zmq", "trio", "gguf", "transformers", "safetensors", "tokenizers")
    }
    if ctx.cpu:
        m["device"] = f"cpu ({os.cpu_count()} cores, interpreter)"
        ctx.check("interpreter on", os.environ.get("TRITON_INTERPRET") == "1")
        ctx.headline = m["device"]
        return
    ok = ctx.check("cuda available", torch.cuda.is_available())
    if not ok:
        return
    props = torch.cuda.get_device_properties(0)
    m["device"] = props.name
    m["capability"] = f"{props.major}.{props.minor}"
    m["sms"] = props.multi_processor_count
    m["memory_gib"] = round(props.total_memory / 2**30, 1)
    m["l2_mib"] = round(getattr(props, "L2_cache_size", 0) / 2**20, 1)
    smi = shutil.which("nvidia-smi")
    fields = "driver_version,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.draw,power.limit,temperature.gpu"
    try:  # read only: the card's settings are left as they are
        q = subprocess.run(
            [smi or "nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
        m["nvidia_smi"] = dict(zip(fields.split(","), (v.strip() for v in q.stdout.strip().split(","))))
    except (OSError, subprocess.SubprocessError) as e:
        ctx.notes.append(f"nvidia-smi: {type(e).__name__}: {e}")
    drv = m.get("nvidia_smi", {})
    ctx.headline = (
        f"{props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs, driver "
        f"{drv.get('driver_version', '?')}, SM {drv.get('clocks.sm', '?')}"
    )


class Compare:
    """Checks results against their fp32 references, keeping the worst error per dtype."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx, self.worst = ctx, {}

    def __call__(self, name: str, got: Any, want: Any, dtype: Any) -> None:
        key = str(dtype).removeprefix("torch.")
        err = rel_error(got, want)
        self.worst[key] = max(self.worst.get(key, 0.0), err)
        self.ctx.check(name, err <= TOLERANCE[key], rel_error=err, allowed=TOLERANCE[key])


def part_kernels(ctx: Ctx) -> None:
    import torch

    compare = Compare(ctx)
    # fp32 on one shape only: it is there to show the dots are not tf32 (each variant compiles).
    if ctx.cpu:
        dtypes, cases = [torch.float32, torch.float16], [(TINY, [torch.float32, torch.float16])]
        lens, chunks, hiddens = [1, 17, 40], [(0, 20), (23, 9), (40, 1)], [64]
    else:
        dtypes = [torch.float16, torch.bfloat16, torch.float32]
        cases = [(SMOLLM2, dtypes), (LLAMA8B, dtypes[:2])]
        lens, chunks, hiddens = [1, 17, 300, 2000, 4097], [(0, 130), (300, 77), (2000, 1), (17, 64)], [576, 4096]
    gen = torch.Generator().manual_seed(0)
    for shape, shape_dtypes in cases:
        for dtype in shape_dtypes:
            tag = f"{shape.name} {str(dtype).removeprefix('torch.')}"
            _check_decode(ctx, compare, gen, shape, dtype, lens, tag)
            _check_prefill(ctx, compare, gen, shape, dtype, chunks, tag)
            _check_rotary(ctx, compare, gen, shape, dtype, tag)
    for dtype in dtypes:
        for hidden in hiddens:
            _check_norms(ctx, compare, gen, hidden, dtype)
    ctx.metrics["worst_rel_error"] = compare.worst
    passed = sum(c["ok"] for c in ctx.checks)
    ctx.headline = f"{passed}/{len(ctx.checks)} checks; worst rel. error " + ", ".join(
        f"{k} {v:.1e}" for k, v in compare.worst.items()
    )


def _rand(ctx: Ctx, gen: Any, *size: int, dtype: Any) -> Any:
    import torch

    return torch.randn(*size, generator=gen).to(ctx.device, dtype)


def _check_decode(ctx: Ctx, compare: Compare, gen: Any, shape: Shape, dtype: Any, lens: list[int], tag: str) -> None:
    """Paged decode with one split, the default splits and four; windowed + soft-capped with the
    default; attention sinks + chunks (gpt-oss, Llama 4) with one split and four."""
    import torch

    from triollm.kernels.attention import paged_decode_attention
    from triollm.kernels.triton import attention as ta

    cache = Paged(ctx, shape, lens, dtype, seed=len(ctx.checks))
    tables = cache.table_tensor(extra=1)  # a spare column of padding (block 0, NaN)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=ctx.device)
    q = _rand(ctx, gen, len(lens), shape.kv_heads * shape.group, shape.head_dim, dtype=dtype)
    scale = shape.head_dim**-0.5
    sinks = 2 * torch.randn(shape.kv_heads * shape.group, generator=gen).to(ctx.device)
    cases: list[tuple[dict[str, Any], tuple[int | None, ...], str]] = [
        ({}, (1, None, 4), ""),
        ({"window": 100, "softcap": 30.0}, (None,), "window+softcap "),
        ({"sinks": sinks, "chunk": max(lens) // 3 + 1}, (1, 4), "sinks+chunk "),  # chunks cross the rows
    ]
    for extra, split_counts, label in cases:
        with torch_path():
            want = paged_decode_attention(
                q.float(), cache.ref_k, cache.ref_v, tables, lens_t, scale, native=False, **extra
            )  # type: ignore[arg-type]
        for splits in split_counts:
            out = torch.full_like(q, float("nan"))
            ta.paged_decode_attention(q, cache.k, cache.v, tables, lens_t, scale, num_splits=splits, out=out, **extra)  # type: ignore[arg-type]
            compare(f"decode[{tag}, {label}splits={splits or 'auto'}]", out, want, dtype)


def _check_prefill(
    ctx: Ctx, compare: Compare, gen: Any, shape: Shape, dtype: Any, chunks: list[tuple[int, int]], tag: str
) -> None:
    """One sequence's new tokens after a prefix, then every chunk of a step in one varlen launch."""
    import torch

    from triollm.kernels.attention import prefill_attention
    from triollm.kernels.triton import attention as ta

    cache = Paged(ctx, shape, [c + n for c, n in chunks], dtype, seed=len(ctx.checks) + 1)
    heads, hd, scale = shape.kv_heads * shape.group, shape.head_dim, shape.head_dim**-0.5
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = _rand(ctx, gen, starts[-1], heads, hd, dtype=dtype)
    ids = [torch.tensor(t, device=ctx.device) for t in cache.tables]
    wants = []
    for i, (c, _) in enumerate(chunks):
        k_new, v_new = cache.keys[i][c:].float(), cache.values[i][c:].float()
        with torch_path():
            wants.append(
                prefill_attention(
                    q[starts[i] : starts[i + 1]].float(), k_new, v_new, cache.ref_k, cache.ref_v, ids[i], c, scale
                )
            )
    c, n = chunks[1]
    one = torch.full((n, heads, hd), float("nan"), dtype=dtype, device=ctx.device)
    ta.paged_prefill_attention(q[starts[1] : starts[2]], cache.k, cache.v, ids[1], c, scale, out=one)
    compare(f"prefill[{tag}, {n} after {c}]", one, wants[1], dtype)
    out = torch.full_like(q, float("nan"))
    starts_t = torch.tensor(starts, dtype=torch.int32, device=ctx.device)
    contexts = torch.tensor([c for c, _ in chunks], dtype=torch.int32, device=ctx.device)
    longest = max(n for _, n in chunks)
    ta.paged_prefill_attention_varlen(
        q, cache.k, cache.v, cache.table_tensor(extra=1), starts_t, contexts, longest, scale, out=out
    )
    compare(f"prefill_varlen[{tag}, {len(chunks)} chunks]", out, torch.cat(wants), dtype)
    # Attention sinks and chunks (gpt-oss, Llama 4) in the same varlen launch.
    sinks, chunk = 2 * torch.randn(heads, generator=gen).to(ctx.device), max(c + n for c, n in chunks) // 3 + 1
    wants = []
    for i, (c, _) in enumerate(chunks):
        k_new, v_new = cache.keys[i][c:].float(), cache.values[i][c:].float()
        with torch_path():
            wants.append(
                prefill_attention(
                    q[starts[i] : starts[i + 1]].float(), k_new, v_new, cache.ref_k, cache.ref_v, ids[i], c, scale,
                    sinks=sinks, chunk=chunk,
                )
            )  # fmt: skip
    out = torch.full_like(q, float("nan"))
    ta.paged_prefill_attention_varlen(
        q, cache.k, cache.v, cache.table_tensor(extra=1), starts_t, contexts, longest, scale, sinks=sinks, chunk=chunk,
        out=out,
    )  # fmt: skip
    compare(f"prefill_varlen[{tag}, {len(chunks)} chunks, sinks+chunk]", out, torch.cat(wants), dtype)


def _check_rotary(ctx: Ctx, compare: Compare, gen: Any, shape: Shape, dtype: Any, tag: str) -> None:
    """Rotary fused with the cache write, into a NaN cache at scattered slots."""
    import torch

    from triollm.kernels.attention import k_blocks
    from triollm.kernels.rotary import apply_rotary
    from triollm.kernels.triton import rotary as tr

    t, hd, bs = 7, shape.head_dim, shape.block_size
    cos, sin = _rand(ctx, gen, 4096, hd, dtype=torch.float32), _rand(ctx, gen, 4096, hd, dtype=torch.float32)
    positions = torch.tensor([0, 5, 9, 33, 34, 1000, 4095], device=ctx.device)
    q = _rand(ctx, gen, t, shape.kv_heads * shape.group, hd, dtype=dtype)
    k, v = _rand(ctx, gen, t, shape.kv_heads, hd, dtype=dtype), _rand(ctx, gen, t, shape.kv_heads, hd, dtype=dtype)
    cache = Paged(ctx, shape, [4 * bs], dtype, seed=1)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    slots = (torch.randperm((cache.k.shape[1] - 1) * bs, generator=gen)[:t] + bs).to(ctx.device)
    q_rot, k_rot = tr.rotary_write_kv(q, k, v, cos, sin, positions, cache.k, cache.v, slots)
    c, s = cos.index_select(0, positions), sin.index_select(0, positions)
    compare(f"rotary_write_kv q[{tag}]", q_rot, apply_rotary(q.float(), c, s), dtype)
    compare(f"rotary_write_kv k[{tag}]", k_rot, apply_rotary(k.float(), c, s), dtype)
    blocks, offsets = slots // bs, slots % bs
    cached_k = k_blocks(cache.k)[:, blocks, offsets].transpose(0, 1)
    cached_v = cache.v[:, blocks, offsets].transpose(0, 1)
    written = int((~cache.v.isnan()).sum())
    ok = torch.equal(cached_k, k_rot.to(dtype)) and torch.equal(cached_v, v) and written == v.numel()
    ctx.check(f"rotary_write_kv cache[{tag}]", ok, v_elements_written=written, expected=v.numel())


def _check_norms(ctx: Ctx, compare: Compare, gen: Any, hidden: int, dtype: Any) -> None:
    import torch

    from triollm.kernels.norm import rms_norm
    from triollm.kernels.triton import norm as tn

    tag = f"{hidden}, {str(dtype).removeprefix('torch.')}"
    x, res, w = (
        _rand(ctx, gen, 37, hidden, dtype=dtype),
        _rand(ctx, gen, 37, hidden, dtype=dtype),
        _rand(ctx, gen, hidden, dtype=dtype),
    )
    with torch_path():
        want_norm, want_fused = rms_norm(x.float(), w.float(), 1e-5), rms_norm((res + x).float(), w.float(), 1e-5)
    out = torch.full_like(x, float("nan"))
    tn.rms_norm(x, w, 1e-5, out=out)
    compare(f"rms_norm[{tag}]", out, want_norm, dtype)
    normed, summed = tn.fused_add_rms_norm(x, res, w, 1e-5)
    compare(f"fused_add_rms_norm[{tag}]", normed, want_fused, dtype)
    ctx.check(f"fused_add_rms_norm residual[{tag}]", torch.equal(summed, res + x))


def _copy_gbs(ctx: Ctx) -> float:
    import torch

    n = (1 << 22) if ctx.cpu else (1 << 30)  # bytes each way; 1 GiB is ~18x the H200's L2
    src = torch.randn(n // 4, device=ctx.device)
    dst = torch.empty_like(src)
    ms = median_ms(ctx, lambda: dst.copy_(src), reps=3 if ctx.cpu else 20)
    return 2 * n / ms / 1e6


def _ceiling(ctx: Ctx) -> float:
    """The copy part's measurement if it ran, else a fresh one."""
    path = ctx.out / "parts" / "copy.json"
    if path.exists():
        value = json.loads(path.read_text()).get("metrics", {}).get("copy_gbs")
        if value:
            return float(value)
    return _copy_gbs(ctx)


def part_copy(ctx: Ctx) -> None:
    gbs = _copy_gbs(ctx)
    ctx.metrics["copy_gbs"] = gbs
    ctx.metrics["copy_frac_peak"] = gbs / ctx.peak_gbs
    ctx.headline = (
        f"device copy {gbs:.0f} GB/s (read + write) = {gbs / ctx.peak_gbs:.0%} of the {ctx.peak_gbs:.0f} GB/s peak"
    )


def _decode_setup(ctx: Ctx, shape: Shape, batch: int, context: int, dtype: Any) -> tuple[Any, ...]:
    """A decode batch of `batch` rows of `context` tokens in scattered blocks, random KV."""
    import torch

    from triollm.kernels.attention import allocate_kv_cache

    bs = shape.block_size
    per = -(-context // bs)
    kv = allocate_kv_cache(1, batch * per, bs, shape.kv_heads, shape.head_dim, dtype, ctx.device)
    k, v = kv.k[0].normal_(), kv.v[0].normal_()
    gen = torch.Generator().manual_seed(batch + context)
    tables = torch.randperm(batch * per, generator=gen).view(batch, per).to(ctx.device, torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=ctx.device)
    q = torch.randn(batch, shape.kv_heads * shape.group, shape.head_dim, generator=gen).to(ctx.device, dtype)
    nbytes = (
        2 * batch * context * shape.kv_heads * shape.head_dim * k.element_size()
        + 2 * q.numel() * q.element_size()
        + tables.numel() * 4
    )
    return q, k, v, tables, lens, nbytes


def _decode_cases(ctx: Ctx) -> list[tuple[str, Shape, int, int]]:
    if ctx.cpu:
        return [("tiny B2 ctx64", TINY, 2, 64)]
    return [
        ("llama8b B64 ctx4096", LLAMA8B, 64, 4096),  # the headline: 1.1 GB of KV a step
        ("llama8b B16 ctx8192", LLAMA8B, 16, 8192),  # few programs: split-KV
        ("smollm2 B256 ctx2048", SMOLLM2, 256, 2048),  # the e2e model's shapes, 0.4 GB of KV
    ]


def part_decode_bw(ctx: Ctx) -> None:
    import torch

    ceiling = _ceiling(ctx)
    dtype = torch.float16 if ctx.cpu else torch.bfloat16
    rows = {}
    for i, (name, shape, batch, context) in enumerate(_decode_cases(ctx)):
        rows[name] = row = _bandwidth(ctx, name, shape, batch, context, dtype, ceiling)
        if i == 0:
            ctx.metrics["headline_frac_peak"] = row["frac_peak"]
            ctx.metrics["headline_gbs"] = row["gbs"]
            ctx.headline = (
                f"{name} {str(dtype).removeprefix('torch.')}: {row['ms']:.3f} ms, {row['gbs']:.0f} GB/s = "
                f"{row['frac_peak']:.0%} of peak, {row['frac_copy']:.0%} of copy"
            )
    ctx.metrics["cases"] = rows
    ctx.metrics["copy_gbs"] = ceiling


def _bandwidth(
    ctx: Ctx, name: str, shape: Shape, batch: int, context: int, dtype: Any, ceiling: float
) -> dict[str, Any]:
    import torch

    from triollm.kernels.triton import attention as ta

    q, k, v, tables, lens, nbytes = _decode_setup(ctx, shape, batch, context, dtype)
    scale = shape.head_dim**-0.5
    out = torch.empty_like(q)
    ms = median_ms(
        ctx, lambda: ta.paged_decode_attention(q, k, v, tables, lens, scale, out=out), reps=3 if ctx.cpu else 30
    )
    gbs = nbytes / ms / 1e6
    splits = ta.choose_num_splits(batch, shape.kv_heads, -(-context // ta.DECODE_TILE_N), ta._num_sms(q.device))
    ctx.check(f"decode output finite [{name}]", bool(out.isfinite().all()))
    return {
        "ms": ms,
        "gbs": gbs,
        "frac_copy": gbs / ceiling,
        "frac_peak": gbs / ctx.peak_gbs,
        "splits": splits,
        "bytes": nbytes,
    }


def part_sweep(ctx: Ctx) -> None:
    import torch

    dtype = torch.float16 if ctx.cpu else torch.bfloat16
    if ctx.cpu:
        cases = [("tiny B2 ctx64", TINY, 2, 64)]
        configs = [(16, 4, 2), (32, 2, 1)]
    else:
        cases = [("llama8b B64 ctx4096", LLAMA8B, 64, 4096), ("smollm2 B256 ctx2048", SMOLLM2, 256, 2048)]
        configs = [(t, w, s) for t in (16, 32, 64, 128) for w in (4, 8) for s in (2, 3)] + [(16, 2, 2), (32, 2, 2)]
    best = {
        name: _sweep_case(ctx, name, shape, batch, context, dtype, configs) for name, shape, batch, context in cases
    }
    ctx.metrics["sweep"] = best
    first = best[cases[0][0]]
    if first["best"] is not None:
        b, d = first["best"], first["default"]
        gain = f", {d['ms'] / b['ms']:.2f}x the default" if d else ""
        ctx.headline = (
            f"{cases[0][0]}: best tile {b['tile_n']}, {b['num_warps']} warps, {b['num_stages']} stages: {b['gbs']:.0f} "
            f"GB/s{gain}"
        )


def _sweep_case(
    ctx: Ctx, name: str, shape: Shape, batch: int, context: int, dtype: Any, configs: list[tuple[int, int, int]]
) -> dict[str, Any]:
    """Every (tile_n, num_warps, num_stages) timed, checked against the default's output."""
    import torch

    from triollm.kernels.triton import attention as ta

    q, k, v, tables, lens, nbytes = _decode_setup(ctx, shape, batch, context, dtype)
    scale = shape.head_dim**-0.5
    want = ta.paged_decode_attention(q, k, v, tables, lens, scale)
    results: list[dict[str, Any]] = []
    for tile_n, warps, stages in configs:
        config = {"tile_n": tile_n, "num_warps": warps, "num_stages": stages}
        out = torch.full_like(q, float("nan"))
        call = _decode_call(q, k, v, tables, lens, scale, out, config)
        try:
            ms = median_ms(ctx, call, reps=2 if ctx.cpu else 20)
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile is a result too
            results.append(config | {"error": f"{type(e).__name__}: {e}"[:200]})
            continue
        results.append(config | {"ms": ms, "gbs": nbytes / ms / 1e6, "rel_error": rel_error(out, want)})
    timed = [r for r in results if "ms" in r]
    good = [r for r in timed if r["rel_error"] <= TOLERANCE[str(dtype).removeprefix("torch.")]]
    ctx.check(
        f"every timed configuration is correct [{name}]",
        len(good) == len(timed),
        wrong=[r for r in timed if r not in good],
    )
    default = (ta.DECODE_TILE_N, ta.DECODE_NUM_WARPS, ta.DECODE_NUM_STAGES)
    return {
        "best": min(good, key=lambda r: r["ms"]) if good else None,
        "default": next((r for r in good if (r["tile_n"], r["num_warps"], r["num_stages"]) == default), None),
        "all": results,
    }


def _decode_call(
    q: Any, k: Any, v: Any, tables: Any, lens: Any, scale: float, out: Any, config: dict[str, int]
) -> Callable[[], Any]:
    from triollm.kernels.triton import attention as ta

    return lambda: ta.paged_decode_attention(q, k, v, tables, lens, scale, out=out, **config)


def part_prefill(ctx: Ctx) -> None:
    import torch

    dtype = torch.float16 if ctx.cpu else torch.bfloat16
    if ctx.cpu:
        cases = [("tiny 3x16 fresh", TINY, [(0, 16)] * 3)]
    else:
        cases = [
            ("smollm2 16x512 fresh", SMOLLM2, [(0, 512)] * 16),
            ("llama8b 8x1024 fresh", LLAMA8B, [(0, 1024)] * 8),
            ("llama8b 32x128 after 1024", LLAMA8B, [(1024, 128)] * 32),
        ]
    rows = {name: _prefill_case(ctx, name, shape, chunks, dtype) for name, shape, chunks in cases}
    ctx.metrics["cases"] = rows
    name, r = next(iter(rows.items()))
    ctx.headline = (
        f"{name}: varlen {r['varlen_tflops']:.1f} TFLOP/s ({r['varlen_ms']:.3f} ms), "
        f"per-sequence {r['loop_tflops']:.1f} ({r['loop_ms']:.3f} ms)"
    )


def _prefill_case(ctx: Ctx, name: str, shape: Shape, chunks: list[tuple[int, int]], dtype: Any) -> dict[str, Any]:
    """One varlen launch against one launch per sequence, on the same chunks."""
    import torch

    from triollm.kernels.triton import attention as ta

    cache = Paged(ctx, shape, [c + n for c, n in chunks], dtype, poison=False)
    heads, hd = shape.kv_heads * shape.group, shape.head_dim
    starts = [0]
    for _, n in chunks:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, hd, device=ctx.device, dtype=dtype)
    tables = cache.table_tensor()
    starts_t = torch.tensor(starts, dtype=torch.int32, device=ctx.device)
    contexts = torch.tensor([c for c, _ in chunks], dtype=torch.int32, device=ctx.device)
    ids = [torch.tensor(t, device=ctx.device) for t in cache.tables]
    varlen_out, loop_out = torch.empty_like(q), torch.empty_like(q)
    scale, longest = hd**-0.5, max(n for _, n in chunks)
    pieces = [(q[a:b], ids[j], c, loop_out[a:b]) for j, ((c, _), a, b) in enumerate(zip(chunks, starts, starts[1:]))]

    def varlen() -> None:
        ta.paged_prefill_attention_varlen(
            q, cache.k, cache.v, tables, starts_t, contexts, longest, scale, out=varlen_out
        )

    def loop() -> None:
        for qs, block_ids, c, out in pieces:
            ta.paged_prefill_attention(qs, cache.k, cache.v, block_ids, c, scale, out=out)

    reps = 2 if ctx.cpu else 20
    ms_varlen, ms_loop = median_ms(ctx, varlen, reps), median_ms(ctx, loop, reps)
    flops = 4 * sum(n * c + n * (n + 1) / 2 for c, n in chunks) * heads * hd  # causal: QK^T and PV
    err = rel_error(varlen_out, loop_out)
    ctx.check(f"varlen = per-sequence [{name}]", err <= 1e-3, rel_error=err)
    return {
        "varlen_ms": ms_varlen, "loop_ms": ms_loop, "tokens": starts[-1],
        "varlen_tflops": flops / ms_varlen / 1e9, "loop_tflops": flops / ms_loop / 1e9,
        "varlen_tok_s": starts[-1] / ms_varlen * 1e3,
    }  # fmt: skip


# --- end to end


TINY_MODEL = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")


def random_llama_weights(config: dict[str, Any], seed: int, dtype: Any) -> dict[str, Any]:
    """HF Llama-named weights, normal(0, 0.02) as transformers initialises them, norms 1."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = config.get("head_dim") or h // config["num_attention_heads"]
    q_out, kv_out = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd

    def w(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * 0.02).to(dtype)

    weights = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": torch.ones(h, dtype=dtype)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": w(q_out, h), p + "self_attn.k_proj.weight": w(kv_out, h),
            p + "self_attn.v_proj.weight": w(kv_out, h), p + "self_attn.o_proj.weight": w(h, q_out),
            p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
            p + "mlp.down_proj.weight": w(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=dtype),
        }  # fmt: skip
    if not config.get("tie_word_embeddings", False):
        weights["lm_head.weight"] = w(vocab, h)
    return weights


def ensure_model(ctx: Ctx) -> tuple[Path, dict[str, Any]]:
    """DIR/model: the `--model-dir` config (made tiny with --cpu) and tokenizer, and seeded random
    weights (bf16; fp32 with --cpu). Built by the first e2e part, reused by the others."""
    import torch
    from safetensors.torch import save_file

    target = ctx.out / "model"
    if (target / "model.safetensors").exists():
        return target, json.loads((target / "config.json").read_text())
    if ctx.model_dir is None or not (ctx.model_dir / "config.json").exists():
        raise Skipped(
            f"no model config: pass --model-dir (make gpu-bundle writes {DEFAULT_MODEL_DIR.relative_to(ROOT)})"
        )
    config = json.loads((ctx.model_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise Skipped(f"--model-dir: model_type {config.get('model_type')!r}, allowed: 'llama' (SmolLM2)")
    if ctx.cpu:
        config |= TINY_MODEL
    dtype = torch.float32 if ctx.cpu else torch.bfloat16
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=ctx.out))
    for name in TOKENIZER_FILES:
        if (ctx.model_dir / name).exists():
            shutil.copy(ctx.model_dir / name, tmp / name)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    save_file(
        random_llama_weights(config, seed=0, dtype=dtype), str(tmp / "model.safetensors"), metadata={"format": "pt"}
    )
    try:
        os.replace(tmp, target)
    except OSError:  # another part built it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return target, config


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]  # token ids, all of one length (transformers needs no padding)
    output_tokens: int


def workload(ctx: Ctx, config: dict[str, Any]) -> Workload:
    import torch

    n, length, out = (4, 8, 4) if ctx.cpu else (64, 128, 128)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(16, config["vocab_size"], (n, length), generator=gen)
    return Workload(ids.tolist(), out)


def _e2e_metrics(
    ctx: Ctx,
    label: str,
    requests: int,
    batch_s: float,
    n_tokens: int,
    one_ms: list[float],
    full_ms: list[float],
    tokens: int,
    first: list[list[int]],
) -> None:
    """Batch-1 ms/token is the decode time alone: a 1 + N token generation less a 1 token one."""
    b1 = (statistics.median(full_ms) - statistics.median(one_ms)) / tokens
    m = ctx.metrics
    m["batch_tok_s"] = n_tokens / batch_s
    m["batch_s"] = batch_s
    m["b1_ms_per_token"] = b1
    m["first_tokens"] = first
    ctx.headline = f"{label}: batch 1 {b1:.2f} ms/token, {requests} requests {n_tokens / batch_s:.0f} output tok/s"


def _triollm(ctx: Ctx, graphs: bool) -> None:
    from triollm import LLM, SamplingParams

    path, config = ensure_model(ctx)
    work = workload(ctx, config)
    n = len(work.prompts)
    kwargs: dict[str, Any] = {
        "dtype": "float32" if ctx.cpu else "bfloat16",
        "device": ctx.device,
        "max_model_len": 512,
        "max_num_seqs": n,
        "seed": 0,
    }
    if ctx.cpu:
        kwargs |= {"multiprocess": False, "kv_cache_memory_bytes": 64 << 20}
    else:
        kwargs |= {
            "kv_cache_memory_bytes": 8 << 30,
            "compilation_config": {"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64]},
        }
    kwargs["enforce_eager"] = not graphs
    prompts = [{"prompt_token_ids": ids} for ids in work.prompts]
    with LLM(str(path), **kwargs) as llm:

        def generate(batch: list[Any], tokens: int) -> list[Any]:
            return llm.generate(
                batch, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False
            )

        generate(prompts, 2)  # warm-up: the prefill and decode kernels of these shapes compile
        generate(prompts[:1], 4)
        start = time.perf_counter()
        outs = generate(prompts, work.output_tokens)
        batch_s = time.perf_counter() - start
        n_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        ctx.check("every request gave its tokens", n_tokens == n * work.output_tokens, tokens=n_tokens)
        one, full = [], []
        for _ in range(3):
            t0 = time.perf_counter()
            generate(prompts[:1], 1)
            one.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            generate(prompts[:1], 1 + work.output_tokens)
            full.append((time.perf_counter() - t0) * 1e3)
    first = [list(o.outputs[0].token_ids[:8]) for o in outs[:8]]
    _e2e_metrics(
        ctx, f"triollm, graphs {'on' if graphs else 'off'}", n, batch_s, n_tokens, one, full, work.output_tokens, first
    )


def part_e2e_graphs(ctx: Ctx) -> None:
    _triollm(ctx, graphs=True)


def part_e2e_eager(ctx: Ctx) -> None:
    _triollm(ctx, graphs=False)


def part_e2e_hf(ctx: Ctx) -> None:
    import torch

    if not _importable("transformers"):
        raise Skipped("no transformers")
    from transformers import AutoModelForCausalLM

    path, config = ensure_model(ctx)
    work = workload(ctx, config)
    dtype = torch.float32 if ctx.cpu else torch.bfloat16
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except TypeError:  # transformers < 4.56 names it torch_dtype
        model = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=dtype)
    model = model.to(ctx.device).eval()
    ids = torch.tensor(work.prompts, device=ctx.device)
    pad = config.get("pad_token_id") or config.get("eos_token_id") or 0

    def generate(batch: Any, tokens: int) -> Any:
        with torch.inference_mode():
            out = model.generate(
                batch,
                attention_mask=torch.ones_like(batch),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        if ctx.device == "cuda":
            torch.cuda.synchronize()
        return out

    generate(ids[:4], 2)
    start = time.perf_counter()
    out = generate(ids, work.output_tokens)
    batch_s = time.perf_counter() - start
    new = out[:, ids.shape[1] :]
    n_tokens = int(new.numel())
    ctx.check("every request gave its tokens", n_tokens == len(work.prompts) * work.output_tokens, tokens=n_tokens)
    one, full = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        generate(ids[:1], 1)
        one.append((time.perf_counter() - t0) * 1e3)
        t0 = time.perf_counter()
        generate(ids[:1], 1 + work.output_tokens)
        full.append((time.perf_counter() - t0) * 1e3)
    import transformers

    ctx.metrics["transformers"] = transformers.__version__
    _e2e_metrics(
        ctx,
        f"transformers {transformers.__version__}",
        len(work.prompts),
        batch_s,
        n_tokens,
        one,
        full,
        work.output_tokens,
        new[:8, :8].tolist(),
    )


_GRAPHS_OFF = (("CUDA graphs are off", "CUDA graphs captured"),)

PARTS: dict[str, Part] = {
    p.name: p
    for p in (
        Part("env", part_env, 60, 60, kernels_env=False),
        Part("kernels", part_kernels, 180, 120),
        Part("copy", part_copy, 30, 60),
        Part("decode_bw", part_decode_bw, 60, 60),
        Part("sweep", part_sweep, 120, 60),
        Part("prefill", part_prefill, 60, 60),
        Part("e2e_graphs", part_e2e_graphs, 150, 90, kernels_env=False, log_failures=_GRAPHS_OFF),
        Part("e2e_eager", part_e2e_eager, 120, 90, kernels_env=False),
        Part("e2e_hf", part_e2e_hf, 120, 90, kernels_env=False),
    )
}


if __name__ == "__main__":
    sys.exit(main())
