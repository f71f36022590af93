"""The paged attention functions against plain dense attention."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.kernels import (
    allocate_kv_cache,
    cpu_native,
    paged_decode_attention,
    prefill_attention,
    write_kv,
)
from triollm.kernels.attention import plan_decode
from triollm.kernels.norm import rms_norm
from triollm.kernels.rotary import apply_rotary, rotary_cos_sin


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """q [n, H, d] at positions offset..offset+n-1; k, v [L, kvh, d] for positions 0..L-1."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / q.shape[-1] ** 0.5
    n, length = q.shape[0], k.shape[0]
    allowed = torch.arange(length)[None, :] <= (torch.arange(n)[:, None] + offset)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def fill(kc: torch.Tensor, vc: torch.Tensor, blocks: list[int], k: torch.Tensor, v: torch.Tensor, bs: int) -> None:
    slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(k.shape[0])])
    write_kv(kc, vc, k, v, slots)


NATIVE = [
    False,
    pytest.param(True, marks=pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")),
]


@pytest.mark.parametrize("native", NATIVE, ids=lambda n: "native" if n else "torch")
def test_paged_decode_matches_dense(native: bool) -> None:
    g = torch.Generator().manual_seed(0)
    bs, kvh, h, d = 4, 2, 6, 8
    cache = allocate_kv_cache(1, 16, bs, kvh, d, torch.float32, "cpu")
    kc, vc = cache.k[0], cache.v[0]
    lens = [1, 7, 13]
    tables = [[5], [2, 9], [0, 3, 11, 15]]
    ks = [torch.randn(n, kvh, d, generator=g) for n in lens]
    vs = [torch.randn(n, kvh, d, generator=g) for n in lens]
    for t, k, v in zip(tables, ks, vs):
        fill(kc, vc, t, k, v, bs)
    q = torch.randn(len(lens), h, d, generator=g)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out = paged_decode_attention(q, kc, vc, table, torch.tensor(lens), d**-0.5, native=native)
    for i, n in enumerate(lens):
        ref = dense_attention(q[i : i + 1], ks[i], vs[i], offset=n - 1)
        torch.testing.assert_close(out[i : i + 1], ref, rtol=1e-5, atol=1e-5)


def _decode_tolerance(dtype: torch.dtype, cache_dtype: torch.dtype, bs: int, d: int) -> float:
    """fp32 queries over an fp32 cache: the reference's bits up to summation order. Over a bf16
    cache on a CPU with AVX-512 BF16, block 16 with head_dim a multiple of 32 takes `vdpbf16ps`
    with the query and the probabilities rounded to bf16 (cpu_attention.cpp: the group instances
    at 64 and 128, the many-heads kernel at the others): bf16's tolerance."""
    bf16_dot = (
        cache_dtype == torch.bfloat16 and bs == 16 and d % 32 == 0 and cpu_native.decode_attention_dot() == "bf16"
    )
    return 1e-5 if dtype == torch.float32 and not bf16_dot else 2e-2


@pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")
@settings(max_examples=80, deadline=None)
@given(
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=9),
    kvh=st.sampled_from([1, 2, 3]),
    group=st.sampled_from([1, 2, 3, 4, 5, 6, 7, 8, 16]),  # 5, 16: no instance of their own
    bs=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, "fp32 over bf16"]),
    d=st.sampled_from([16, 64, 96, 128, 288]),  # 16 x 64, 16 x 128 have their own; others the many-heads one
    seed=st.integers(0, 2**16),
)
def test_native_decode_matches_the_torch_path(
    lens: list[int], kvh: int, group: int, bs: int, dtype: torch.dtype | str, d: int, seed: int
) -> None:
    """The native kernel against the torch reference: any lengths (block edges, one token),
    GQA groups, block sizes, scattered block tables, fp32/bf16/fp16 caches, and fp32 queries
    over a bf16 cache (kv_cache_dtype="bfloat16" under fp32 activations)."""
    g = torch.Generator().manual_seed(seed)
    cache_dtype = torch.bfloat16 if dtype == "fp32 over bf16" else dtype
    dtype = torch.float32 if dtype == "fp32 over bf16" else dtype
    assert isinstance(dtype, torch.dtype) and isinstance(cache_dtype, torch.dtype)
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 3
    kc = torch.randn(kvh, num_blocks, d, bs, generator=g).to(cache_dtype)  # K blocks transposed
    vc = torch.randn(kvh, num_blocks, bs, d, generator=g).to(cache_dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], 0
    for m in need:
        tables.append(perm[used : used + m])
        used += m
    q = torch.randn(len(lens), kvh * group, d, generator=g).to(dtype)
    plans = [plan_decode(tables, lens, bs, "cpu", native=n) for n in (True, False)]
    from triollm.kernels.attention import decode_attention

    native, ref = (decode_attention(q, kc, vc, p, d**-0.5) for p in plans)
    assert plans[0].native is not None and plans[1].native is None
    tol = _decode_tolerance(dtype, cache_dtype, bs, d)
    torch.testing.assert_close(native.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")
@settings(max_examples=40, deadline=None)
@given(
    t=st.integers(1, 9),
    heads=st.sampled_from([(4, 1), (6, 2), (9, 3)]),
    d=st.sampled_from([8, 64]),
    bs=st.sampled_from([1, 16]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, "fp32 over bf16"]),
    seed=st.integers(0, 2**16),
)
def test_native_rotary_and_cache_write_match_the_torch_path(
    t: int, heads: tuple[int, int], d: int, bs: int, dtype: torch.dtype | str, seed: int
) -> None:
    """Also fp32 activations written to a bf16 cache (kv_cache_dtype="bfloat16")."""
    from triollm.kernels.rotary import apply_rotary_signed, rotary_sign

    cache_dtype = torch.bfloat16 if dtype == "fp32 over bf16" else dtype
    dtype = torch.float32 if dtype == "fp32 over bf16" else dtype
    assert isinstance(dtype, torch.dtype) and isinstance(cache_dtype, torch.dtype)
    g = torch.Generator().manual_seed(seed)
    h, kvh = heads
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g).to(dtype)
    cos, sin = rotary_cos_sin(d, 64, 10000.0)
    pos = torch.randint(0, 64, (t,), generator=g)
    c, sn = cos[pos].to(dtype).unsqueeze(1), (sin[pos] * rotary_sign(d)).to(dtype).unsqueeze(1)
    slots = torch.randperm(16 * bs, generator=g)[:t]
    caches = [allocate_kv_cache(1, 16, bs, kvh, d, cache_dtype, "cpu") for _ in range(2)]
    # The torch path, as the model runs it.
    qk = apply_rotary_signed(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), c, sn)
    write_kv(caches[0].k[0], caches[0].v[0], qk[:, h:], qkv[:, (h + kvh) * d :].view(t, kvh, d), slots)
    q = cpu_native.rotary_write_kv(qkv, c, sn, caches[1].k[0], caches[1].v[0], slots, h, kvh)
    tol = {"rtol": 1e-5, "atol": 1e-5} if cache_dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(q.float(), qk[:, :h].float(), **tol)
    torch.testing.assert_close(caches[1].k[0].float(), caches[0].k[0].float(), **tol)
    assert caches[1].k[0].dtype == cache_dtype
    torch.testing.assert_close(caches[1].v[0], caches[0].v[0], rtol=0, atol=0)


@pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 64])
def test_native_silu_and_mul_matches_torch(rows: int, dtype: torch.dtype) -> None:
    x = (torch.randn(rows, 2 * 1536) * 4).to(dtype)
    gate, up = x.float().split(1536, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(cpu_native.silu_and_mul(x).float(), ref, **tol)


@pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")
def test_native_silu_and_mul_is_finite_for_large_gates() -> None:
    """Gates far below -88 (exp(-g) overflows: -ffast-math's refined reciprocal made 1 / inf a
    NaN) give silu -> -0, and far above +88 silu(g) = g, as torch."""
    gate = torch.tensor([[-1000.0, -200.0, -89.0, -88.0, -20.0, 0.0, 20.0, 89.0, 1000.0] * 32])
    x = torch.cat([gate, torch.full_like(gate, 3.0)], dim=1)
    got = cpu_native.silu_and_mul(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * 3.0, rtol=1e-6, atol=1e-6)


BF16_DOT = pytest.mark.skipif(
    not cpu_native.available() or cpu_native.decode_attention_dot() != "bf16",
    reason="the bf16 dot-product decode path needs AVX-512 BF16",
)


def _bf16_case(d: int, group: int, lens: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """fp32 queries over a bf16 cache, blocks of 16 in a scattered order; every cache position
    past a row's length in its last block holds NaN (a kernel that reads a value it should not
    returns NaN)."""
    g = torch.Generator().manual_seed(seed)
    kvh, bs = 2, 16
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 2
    kc = torch.randn(kvh, nb, d, bs, generator=g).to(torch.bfloat16)
    vc = torch.randn(kvh, nb, bs, d, generator=g).to(torch.bfloat16)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for n, m in zip(lens, need):
        tables.append(perm[used : used + m])
        used += m
        last, tail = tables[-1][-1], n - (m - 1) * bs
        kc[:, last, :, tail:] = float("nan")
        vc[:, last, tail:, :] = float("nan")
    q = torch.randn(len(lens), kvh * group, d, generator=g) * 2
    return (
        q,
        kc,
        vc,
        torch.tensor([t + [0] * (max(need) - len(t)) for t in tables], dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
    )


def _rounded_reference(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, round_q: bool = True
) -> torch.Tensor:
    """Dense attention in fp64 over the cache's values with the query rounded to bf16 (`round_q`):
    what the bf16 path computes, but for the probabilities' rounding."""
    b, h, d = q.shape
    kvh = kc.shape[0]
    out = torch.empty(b, h, d, dtype=torch.float64)
    qr = q.bfloat16().double() if round_q else q.double()
    for row in range(b):
        n = int(lens[row])
        blocks = tables[row, : -(-n // 16)].long()
        k = kc[:, blocks].double().permute(0, 1, 3, 2).reshape(kvh, -1, d)[:, :n]  # [kvh, n, d]
        v = vc[:, blocks].double().reshape(kvh, -1, d)[:, :n]
        qh = qr[row].view(kvh, h // kvh, d)
        probs = (qh @ k.transpose(1, 2) * d**-0.5).softmax(-1)
        out[row] = (probs @ v).reshape(h, d)
    return out


@BF16_DOT
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
def test_bf16_dot_decode_is_close_to_its_rounded_reference(d: int, group: int) -> None:
    """The `vdpbf16ps` path (fp32 queries over a bf16 cache): against fp64 attention with the
    query rounded as the kernel rounds it, the only error left is the probabilities' bf16
    rounding; odd and even lengths, one token, block edges, NaN past each row's end."""
    lens = [1, 2, 15, 16, 17, 33, 250]
    q, kc, vc, tables, lens_t = _bf16_case(d, group, lens, seed=group * d)
    out = cpu_native.paged_decode_attention(q, kc, vc, tables, lens_t, d**-0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _rounded_reference(q, kc, vc, tables, lens_t), rtol=0, atol=4e-3)


@BF16_DOT
def test_the_fp32_decode_path_over_a_bf16_cache_runs_where_a_path_is_forced(tmp_path: Path) -> None:
    """$TRIOLLM_CPU_ISA (any forced path) turns the bf16 dot products off: the fp32 path, which
    CPUs without AVX-512 BF16 run, is still tested on one that has it, to fp32's tolerance."""
    script = tmp_path / "fp32_path.py"
    script.write_text(
        "from triollm.kernels import cpu_native\n"
        "from tests.kernels.test_attention import _bf16_case, _rounded_reference\n"
        "assert cpu_native.decode_attention_dot() == 'fp32'\n"
        "q, kc, vc, tables, lens = _bf16_case(64, 3, [1, 17, 40, 250], seed=3)\n"
        "out = cpu_native.paged_decode_attention(q, kc, vc, tables, lens, 0.125)\n"
        "err = (out.double() - _rounded_reference(q, kc, vc, tables, lens, round_q=False)).abs().max()\n"
        "assert err < 1e-5, float(err)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "TRIOLLM_CPU_ISA": "scalar",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("group", range(1, 10))
def test_native_decode_instances_of_every_group_size(group: int, d: int, dtype: torch.dtype) -> None:
    """Block size 16 with head_dim 64/128 has an instance per GQA group size 1-4, 6-8 (5 and 9
    take the generic one): each against the torch path, lengths across block edges."""
    g = torch.Generator().manual_seed(group * d)
    lens, kvh, bs = [1, 15, 16, 17, 40], 2, 16
    need = [-(-n // bs) for n in lens]
    kc = torch.randn(kvh, sum(need) + 1, d, bs, generator=g).to(dtype)
    vc = torch.randn(kvh, sum(need) + 1, bs, d, generator=g).to(dtype)
    starts = [sum(need[:i]) + 1 for i in range(len(need))]
    tables = [list(range(s, s + m)) for s, m in zip(starts, need)]
    q = torch.randn(len(lens), kvh * group, d, generator=g).to(dtype)
    from triollm.kernels.attention import decode_attention

    native, ref = (
        decode_attention(q, kc, vc, plan_decode(tables, lens, bs, "cpu", native=n), d**-0.5) for n in (True, False)
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 576), (64, 576), (3, 5, 64)])
def test_native_rms_norm_matches_torch(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = (torch.randn(shape) * 3).to(dtype)
    w = (torch.rand(shape[-1]) + 0.5).to(dtype)
    ref = torch.nn.functional.rms_norm(x.float(), (shape[-1],), w.float(), 1e-5)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 2e-2}
    torch.testing.assert_close(cpu_native.rms_norm(x, w, 1e-5).float(), ref, **tol)


def test_decode_plan_falls_back_to_the_torch_path_without_native_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    plan = plan_decode([[1, 2], [3]], [20, 5], 16, "cpu")
    assert plan.native is None and plan.groups


def test_prefill_with_and_without_context_matches_dense() -> None:
    g = torch.Generator().manual_seed(1)
    bs, kvh, h, d = 4, 1, 4, 8
    cache = allocate_kv_cache(1, 8, bs, kvh, d, torch.float32, "cpu")
    kc, vc = cache.k[0], cache.v[0]
    blocks = [6, 1, 4]
    k = torch.randn(11, kvh, d, generator=g)
    v = torch.randn(11, kvh, d, generator=g)
    q = torch.randn(11, h, d, generator=g)
    fill(kc, vc, blocks, k, v, bs)
    full = prefill_attention(q, k, v, kc, vc, torch.tensor(blocks), 0, d**-0.5)
    torch.testing.assert_close(full, dense_attention(q, k, v, 0), rtol=1e-5, atol=1e-5)
    # The last 5 tokens as a chunk over 6 tokens of context read back from the cache.
    tail = prefill_attention(q[6:], k[6:], v[6:], kc, vc, torch.tensor(blocks), 6, d**-0.5)
    torch.testing.assert_close(tail, dense_attention(q[6:], k, v, 6), rtol=1e-5, atol=1e-5)


def test_rotary_preserves_norm_and_rms_norm() -> None:
    cos, sin = rotary_cos_sin(8, 32, 10000.0)
    x = torch.randn(5, 2, 8)
    pos = torch.tensor([0, 3, 7, 8, 31])
    y = apply_rotary(x, cos[pos], sin[pos])
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[0], x[0])  # position 0 is the identity
    w = torch.rand(8)
    z = rms_norm(x, w, 1e-6)
    torch.testing.assert_close(z, w * x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())


def test_without_a_compiler_the_native_kernels_are_off_with_one_warning(tmp_path: Path) -> None:
    """A failed build (here: no usable C++ compiler) means the torch path and a warning that
    names the cause and the switch, not an error."""
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from triollm.kernels import cpu_native\n"
        "assert cpu_native.available() is False\n"
        "from triollm.kernels.attention import plan_decode\n"
        "assert plan_decode([[0]], [1], 16, 'cpu').native is None\n"
    )
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    env.pop("TRIOLLM_CPU_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "native CPU kernels unavailable" in proc.stderr and "TRIOLLM_CPU_KERNELS=0" in proc.stderr


def test_a_stale_build_lock_is_removed_with_the_half_built_library(tmp_path: Path) -> None:
    """torch's build lock is a plain file: a build killed mid-way left it, and every later start
    waited on it forever (seen when a CI run was interrupted during its build). Holding our
    flock, a lock file found is stale: it goes, and the library, which may be truncated."""
    (tmp_path / "lock").touch()
    (tmp_path / "triollm_cpu_x.so").write_bytes(b"")
    with cpu_native._build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
        assert not (tmp_path / "triollm_cpu_x.so").exists()
    (tmp_path / "triollm_cpu_x.so").write_bytes(b"ELF")  # no lock: a finished build stays
    with cpu_native._build_lock(tmp_path):
        assert (tmp_path / "triollm_cpu_x.so").read_bytes() == b"ELF"


def test_two_checkouts_sharing_a_venv_build_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch rebuilds a cache entry whenever the source paths in its build file change: a soak run
    from a copy beside the working tree rebuilt the kernels at every engine start (a minute each,
    long enough for the watchdog) as the two took turns. The cache entry names the sources' place."""
    here = cpu_native._machine_tag()
    monkeypatch.setattr(cpu_native, "__file__", "/elsewhere/triollm/kernels/cpu_native.py")
    assert cpu_native._machine_tag() != here


def _long_rows(lens: list[int], d: int, group: int, cache_dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    kvh, bs = 2, 16
    need = [-(-n // bs) for n in lens]
    nb = sum(need) + 1
    kc = torch.randn(kvh, nb, d, bs, generator=g).to(cache_dtype)
    vc = torch.randn(kvh, nb, bs, d, generator=g).to(cache_dtype)
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for m in need:
        tables.append(perm[used : used + m])
        used += m
    q = torch.randn(len(lens), kvh * group, d, generator=g)
    return q, kc, vc, tables


@pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    ("window", "chunk", "sinks"), [(None, None, False), (700, None, True), (None, 600, False), (None, None, True)]
)
@pytest.mark.parametrize(("d", "group"), [(64, 3), (288, 16)], ids=["gqa", "many-heads"])
def test_native_decode_of_long_rows_in_parts(
    cache_dtype: torch.dtype, window: int | None, chunk: int | None, sinks: bool, d: int, group: int
) -> None:
    """Rows longer than one part (64 blocks) are attended part by part and merged by log-sum-exp:
    against the torch path with windows, chunks and sinks across part edges; the same bits alone
    as in a batch and on one thread as on two (the cut follows the row's own length only). Also
    for 16 query heads over 288-wide KV heads (a small DeepSeek's latent attention)."""
    lens = [1100, 513, 512, 40, 1, 2049]
    q, kc, vc, tables = _long_rows(lens, d, group, cache_dtype, seed=len(lens))
    sink = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(9)) if sinks else None
    kw = {"window": window, "chunk": chunk, "sinks": sink}
    from triollm.kernels.attention import decode_attention

    native, ref = (
        decode_attention(q, kc, vc, plan_decode(tables, lens, 16, "cpu", native=n), d**-0.5, **kw)
        for n in (True, False)
    )
    tol = _decode_tolerance(torch.float32, cache_dtype, 16, d)
    torch.testing.assert_close(native, ref, rtol=tol, atol=tol)
    for row in (0, 5):
        alone = decode_attention(
            q[row : row + 1], kc, vc, plan_decode([tables[row]], [lens[row]], 16, "cpu", native=True), d**-0.5, **kw
        )
        assert torch.equal(alone, native[row : row + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention(q, kc, vc, plan_decode(tables, lens, 16, "cpu", native=True), d**-0.5, **kw)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, native)


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0]


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this machine")
def test_a_cpu_cache_is_zeroed_and_asks_for_huge_pages() -> None:
    """A CPU cache layer's memory is advised for transparent huge pages before it is zeroed
    (decode attention reads 2 KB blocks scattered over it: with 4 KB pages most are TLB misses),
    so its mapping is eligible for them even where the kernel gives them only on request."""
    cache = allocate_kv_cache(2, 1024, 16, 4, 64, torch.bfloat16, "cpu")  # 8 MB a tensor
    huge = 2 << 20
    for t in cache.k + cache.v:
        assert not t.any()
        addr = -(-t.data_ptr() // huge) * huge  # the first whole huge page inside it
        eligible = None
        for (lo, hi), flag in _smaps_regions():
            if lo <= addr < hi:
                eligible = flag
        assert eligible == 1, (hex(addr), eligible)


def _smaps_regions() -> list[tuple[tuple[int, int], int | None]]:
    """(start, end) and THPeligible of each mapping of this process."""
    regions: list[tuple[tuple[int, int], int | None]] = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            regions.append(((lo, hi), None))
        elif head == "THPeligible:" and regions:
            regions[-1] = (regions[-1][0], int(line.split()[1]))
    return regions
