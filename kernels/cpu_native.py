"""Native CPU kernels (`kernels/csrc/*.cpp`), compiled on first use by torch's C++ extension
builder (g++ and ninja) and cached under torch's extensions directory.

They are built for the machine they run on (`-march=native`): the cache entry's name carries a
tag of the CPU model and its instruction-set flags, so a home directory shared by different
machines never loads a build for another CPU. The quantized linear has hand-written paths for
AMX (int8 tiles), AVX-512 VNNI and AVX2 in every build; `quant_isa` says which one runs here (the C++ side picks
the same by cpuid), and $TRIOLLM_CPU_ISA forces one. Where no compiler is found, or the build fails, the
torch path (the reference the kernels are tested against) runs instead, after one warning that
names the cause. `TRIOLLM_CPU_KERNELS=0` turns them off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import functools
import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from triollm.kernels.envs import CPU_KERNELS_ENV, ISA_ENV, cpu_kernels_enabled, forced_cpu_isa
from triollm.kernels.kv_quant import cache_scale

__all__ = [
    "CPU_KERNELS_ENV",
    "ISA_ENV",
    "QUANT_ISAS",
    "available",
    "has_native_bf16",
    "libc_function",
    "keep_freed_memory",
    "best_isa",
    "decode_attention_dot",
    "few_rows_matmul",
    "has_fast_quant",
    "quant_isa",
    "supported_isas",
    "paged_decode_attention",
    "paged_prefill_attention",
    "prefill_attention_supported",
    "rms_norm",
    "rotary_write_kv",
    "silu_and_mul",
]

log = logging.getLogger("triollm")

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in ("cpu_attention.cpp", "quant_linear.cpp", "decoder.cpp", "sampling.cpp", "small_matmul.cpp")
]
# -ffast-math lets the compiler vectorise exp (glibc's vector math); the kernel keeps its values
# finite for it (kernels/csrc/cpu_attention.cpp). -fopenmp: ATen's parallel_for is a header
# template over OpenMP pragmas, so without it the kernels ran on one thread whatever
# torch.get_num_threads() said; the libgomp.so.1 it links is the one torch has already loaded
# (same soname), so both share one thread pool and torch.set_num_threads() governs both.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-std=c++17"]
_LDFLAGS = ["-fopenmp"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


@functools.cache
def libc_function(name: str, argtypes: tuple[type, ...] | None = None) -> Callable[..., int] | None:
    """The C library's function `name` (glibc's `malloc_trim`, `madvise`), or None where there is
    no such library or function (musl, macOS): callers then go without."""
    path = ctypes.util.find_library("c")
    try:
        fn = getattr(ctypes.CDLL(path, use_errno=True), name) if path else None
    except (OSError, AttributeError):
        return None
    if fn is not None and argtypes is not None:
        fn.argtypes = argtypes
    return fn


# glibc's malloc, left to its own thresholds, gives a step's freed activations (megabytes each)
# back to the kernel and takes them again on the next step, each page faulted in and zeroed anew:
# 130-320 thousand minor faults in one 64-prompt prefill on the AMX Xeon, 7-10% of its time
# (docs/benchmarks-history.md, "A heap that keeps a step's memory"). With the mmap threshold at
# glibc's ceiling and the trim threshold above a step's working set, the heap keeps what a step
# freed for the next one. `M_TRIM_THRESHOLD`, `M_MMAP_THRESHOLD`: mallopt's parameter numbers.
MALLOC_MMAP_THRESHOLD, MALLOC_TRIM_THRESHOLD = 32 << 20, 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(device: torch.device | str) -> bool:
    """Where the model runs on `device` "cpu", set glibc's malloc to keep freed memory in the
    heap (above) for this process, once (the executor, the pooling core and tensor-parallel
    ranks call it as they start). Not where the user tuned glibc's malloc (`glibc.malloc.*` in
    GLIBC_TUNABLES: theirs stands), nor without glibc. Returns whether it took effect. Memory
    stays bounded: the heap holds at most a step's peak plus the trim threshold, and sleep
    mode's `malloc_trim` still returns it all."""
    return torch.device(device).type == "cpu" and _keep_freed_memory()


@functools.cache
def _keep_freed_memory() -> bool:
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    mallopt = libc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None:
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD)
    )


def has_native_bf16() -> bool:
    """Whether the CPU computes bf16 natively (AVX-512 BF16 or AMX): there bf16 matmuls through
    oneDNN run faster than fp32; elsewhere they are emulated, slower than fp32."""
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())


# The quantized linear's compiled paths (kernels/csrc/quant_linear.cpp), best first, with the
# CPU flags each needs. Every build holds all of them (each function compiled for its own
# instruction set); which one runs is chosen here, at run time, by what the CPU has.
QUANT_ISAS: dict[str, frozenset[str]] = {
    "amx": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"}),
    "avx512_vnni": frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}),
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "scalar": frozenset(),
}


def supported_isas(flags: set[str] | None = None) -> list[str]:
    """The quantized-kernel paths a CPU with these flags (default: this one's) can run, best first."""
    have = _cpu_flags() if flags is None else flags
    return [isa for isa, need in QUANT_ISAS.items() if need <= have]


def best_isa(flags: set[str] | None = None) -> str:
    """The fastest quantized-kernel path for these CPU flags (default: this CPU's)."""
    return supported_isas(flags)[0]


@functools.cache
def quant_isa() -> str:
    """The path the quantized linears take in this process: $TRIOLLM_CPU_ISA if set (one this
    CPU can run, else a ValueError naming those), else the best one for the CPU's flags."""
    forced = forced_cpu_isa()
    if not forced:
        return best_isa()
    if forced not in supported_isas():
        raise ValueError(
            f"{ISA_ENV}: {forced!r} is not a path this CPU can run; allowed here: {', '.join(supported_isas())}"
        )
    return forced


@functools.cache
def decode_attention_dot(quantized: bool = False) -> str:
    """The dot product the native decode kernel uses over a bf16 KV cache (or, `quantized`, an
    fp8 or int8 one) in this process: "bf16" (`vdpbf16ps`, where the CPU has AVX-512 BF16, and
    VBMI for a quantized cache, and $TRIOLLM_CPU_ISA forces no path: queries and probabilities
    meet the cache rounded to bf16) or "fp32" (K and V widened). The C++ side decides
    (kernels/csrc/cpu_attention.cpp, once per process: so it is cached here too); call only when
    `available()`."""
    return str(torch.ops.triollm_cpu.decode_attention_dot(quantized))


def has_fast_quant() -> bool:
    """Whether the quantized linears have a vector path here (AVX-512 VNNI, or AVX2 with FMA
    and F16C): there a quantized model decodes faster than the dense one."""
    return quant_isa() != "scalar"


def _machine_tag() -> str:
    """A short hash of the CPU model and flags (the build uses -march=native), of the torch
    installation built against and of where the sources are: two environments on one machine (a
    checkout and a CI clone, each with its own venv), or two checkouts sharing one venv (a soak run
    from a copy beside the working tree), would otherwise take turns rebuilding one cache entry,
    since torch rebuilds whenever the include or source paths in its build file change (each
    engine start then waits a minute for the build)."""
    seen: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "flags", "Features", "CPU part") and key not in seen:
                    seen[key] = value.strip()
    except OSError:
        pass
    seen["torch"] = f"{torch.__version__} {Path(torch.__file__).parent}"
    seen["sources"] = str(Path(__file__).resolve().parent)
    return hashlib.sha256(repr(sorted(seen.items())).encode()).hexdigest()[:12]


@functools.cache
def available() -> bool:
    """Build (or load the cached build of) the native kernels once per process."""
    if not cpu_kernels_enabled():
        return False
    try:
        from torch.utils import cpp_extension

        name = f"triollm_cpu_{_machine_tag()}"
        with _build_lock(Path(cpp_extension._get_build_directory(name, verbose=False))):
            cpp_extension.load(
                name=name,
                sources=[str(s) for s in _SOURCES],
                extra_cflags=_CFLAGS,
                extra_ldflags=_LDFLAGS,
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - any build failure means the torch path
        log.warning(
            "native CPU kernels unavailable, using the torch path (%s: %s); set %s=0 to skip the build",
            type(exc).__name__,
            str(exc).strip().splitlines()[-1] if str(exc).strip() else "",
            CPU_KERNELS_ENV,
        )
        return False
    return True


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold an flock on the build directory while torch builds or loads there.

    torch's own build lock is a plain file that its builder deletes when done: a build killed
    mid-way (Ctrl-C, a test's timeout) leaves it behind, and every later start waits on it
    forever. An flock is released by the kernel when its holder dies, and every build here
    holds this one around torch's: whoever holds it and still finds torch's lock file knows it
    is stale. Then the lock goes, and the library with it (it may be half written: the link is
    the build's last step, and ninja would take a truncated file for a finished one).
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "triollm.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("removing a stale build lock left by an interrupted build: %s", stale)
            stale.unlink()
            for library in build_dir.glob("*.so"):
                library.unlink()
        yield


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """See kernels/csrc/cpu_attention.cpp (`window`, `softcap`, `sinks`, `chunk`: as
    `attention.decode_attention` takes them; None is 0 there, sinks go as fp32; a quantized
    cache's scales come with its tensors, `kv_quant.cache_scale`). Call only when `available()`."""
    sinks32 = None if sinks is None else sinks.detach().float().contiguous()
    return torch.ops.triollm_cpu.paged_decode_attention(
        q, k_cache, v_cache, block_tables, context_lens, scale, window or 0, softcap or 0.0,
        cache_scale(k_cache), cache_scale(v_cache), sinks32, chunk or 0,
    )  # fmt: skip


# Query heads per kv head that the native prefill kernel has instances for (as decode's groups).
_PREFILL_GROUPS = (1, 2, 3, 4, 6, 7, 8)


def prefill_attention_supported(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether `paged_prefill_attention` takes this layer's causal prefill (no window, sink,
    chunk or soft-cap: the caller checks those): a bf16, fp8 or int8 cache under float32 queries
    (or bf16 over bf16), block size 16, head_dim 64 or 128, a group size decode has an instance
    for, and the CPU's bf16 dot products (`decode_attention_dot`). Call only when `available()`."""
    kt = k_cache.dtype
    quantized = kt in (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
    dtypes = (q.dtype == torch.float32 and (kt == torch.bfloat16 or quantized)) or (
        q.dtype == torch.bfloat16 and kt == torch.bfloat16
    )
    _, _, hd, bs = k_cache.shape
    heads, kv_heads = q.shape[1], k_cache.shape[0]
    return (
        dtypes and q.device.type == "cpu" and bs == 16 and hd in (64, 128) and heads % kv_heads == 0
        and heads // kv_heads in _PREFILL_GROUPS and decode_attention_dot(quantized) == "bf16"
    )  # fmt: skip


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a step's prefill chunks, each row's arithmetic exactly the native decode
    kernel's (kernels/csrc/cpu_attention.cpp, `prefill_tile_bf16`): q `[P, H, hd]`, chunk c's rows
    `[query_starts[c], query_starts[c + 1])` after `context_lens[c]` earlier tokens, block_tables
    `[N, M]`; all int32. Where `prefill_attention_supported` only."""
    return torch.ops.triollm_cpu.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, query_starts, context_lens, scale, cache_scale(k_cache),
        cache_scale(v_cache),
    )  # fmt: skip


def rotary_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """Rotate Q and K of the fused projection `qkv` `[T, (H + 2 KVH) * hd]`, write K and V to
    the cache at `slot_mapping`, return the rotated Q `[T, H, hd]` (the torch path:
    `apply_rotary_signed` + `write_kv`). Call only when `available()`."""
    return torch.ops.triollm_cpu.rotary_write_kv(
        qkv, cos, signed_sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
        cache_scale(k_cache), cache_scale(v_cache),
    )  # fmt: skip


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU of the fused gate/up projection: `silu(x[:, :I]) * x[:, I:]` for x `[T, 2I]`,
    in fp32 whatever x's dtype. Call only when `available()`."""
    return torch.ops.triollm_cpu.silu_and_mul(x)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [B, V] (float32, up to scale) the first token whose running sum passes
    u * the row's total (`u` [B] float64 in [0, 1)), summed in double; never a token of
    probability 0 (kernels/csrc/sampling.cpp). Call only when `available()`."""
    return torch.ops.triollm_cpu.sample_inverse_cdf(probs, u)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` for `logits` [B, V] float32, long [B]: torch's answer (the first
    largest, a NaN the largest), vectorised (kernels/csrc/sampling.cpp). Call only when
    `available()`."""
    return torch.ops.triollm_cpu.greedy_argmax(logits)


# The most rows `few_rows_matmul` takes (decode's tokens, or a few).
FEW_ROWS = 4


def few_rows_matmul(x: torch.Tensor, w: torch.Tensor, *, w_is_kn: bool = False) -> torch.Tensor:
    """`x @ w.transpose(-1, -2)` (w `[B, N, K]`, a linear's weights) or, `w_is_kn`, `x @ w` (w
    `[B, K, N]`) for x `[B, M, K]` with M <= FEW_ROWS: the weights (fp32 or bf16, each matrix's
    rows contiguous, any batch stride: a view into stacked or fused weights is read in place)
    streamed once in fp32 arithmetic (kernels/csrc/small_matmul.cpp); the result in x's dtype.
    Call only when `available()`."""
    op = torch.ops.triollm_cpu.dense_vecmat if w_is_kn else torch.ops.triollm_cpu.dense_matvec
    return op(x, w)  # type: ignore[no-any-return]


def blocked_matvec(
    x: torch.Tensor, w: torch.Tensor, n: int, kp: int, bias: torch.Tensor | None, fp32_out: bool = False
) -> torch.Tensor:
    """`x @ W.T (+ bias)` for x `[M, K]`, M <= FEW_ROWS, with W `[n, K]` held in oneDNN's packed
    layout (`w` the buffer, 1-D, x's dtype: fp32 or bf16; `kp` its padded K; the layout in
    kernels/csrc/small_matmul.cpp). In x's dtype, or fp32 where `fp32_out`. Call only when
    `available()`."""
    return torch.ops.triollm_cpu.blocked_matvec(x, w, n, kp, bias, fp32_out)  # type: ignore[no-any-return]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, one pass, fp32 math. Call only when `available()`."""
    return torch.ops.triollm_cpu.rms_norm(x, weight, eps)
