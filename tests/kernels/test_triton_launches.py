"""What the Triton kernels would compile on the H200, read without one (issue 28): launches
recorded from the real wrappers (`kernels/triton/launches.py`) and compiled for sm_90 as the
JIT would compile them.

- K is loaded in 16-byte vectors from the cache `allocate_kv_cache` gives the Triton path (head
  dim innermost), not one 2-byte element at a time as from the contiguous transposed blocks.
- An fp32 cache's attention runs its dots in fp32, not tf32.
- Arguments that change every step (a prefill's token and context counts, the block tables'
  width, the token count of norm and rotary) bind to the variant already compiled.

The probe runs once, in a subprocess without TRITON_INTERPRET (this process has it set, and
its kernels are interpreter objects): `python tests/kernels/test_triton_launches.py` prints
its findings as JSON.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

TWO_BYTE_LOAD = re.compile(r"ld\.global(?:\.\w+)*\.[bu]16\b")
ASYNC_COPY = re.compile(r"cp\.async\.\w+\.shared\.global \[[^]]+\], \[[^]]+\], (0x[0-9a-f]+|\d+)")


def _ptx_facts(ptx: str) -> dict[str, Any]:
    return {
        "two_byte_loads": len(TWO_BYTE_LOAD.findall(ptx)),
        "async_copy_bytes": sorted({int(n, 0) for n in ASYNC_COPY.findall(ptx)}),
        "tf32": "tf32" in ptx,
        "mma": sorted(set(re.findall(r"\b(w?g?mma[\w.]*)", ptx))),
    }


def probe() -> dict[str, Any]:
    """Record launches of every kernel over two different steps, compile some; see the module
    docstring. Runs without TRITON_INTERPRET."""
    import torch

    from triollm.kernels.attention import allocate_kv_cache
    from triollm.kernels.triton import attention as ta
    from triollm.kernels.triton import norm as tn
    from triollm.kernels.triton import rotary as tr
    from triollm.kernels.triton.launches import compile_launch, record_launches, specialization

    kvh, group, hd, bs, nb = 3, 3, 64, 16, 64
    found: dict[str, Any] = {"steps": {}, "ptx": {}}

    def caches(dtype: torch.dtype, gpu: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
        kv = allocate_kv_cache(1, nb, bs, kvh, hd, dtype, "cpu", k_head_dim_last=gpu)
        return kv.k[0], kv.v[0]

    def step(tokens: int, width: int, context: int, dtype: torch.dtype, gpu: bool | None) -> list[Any]:
        """One step's launches: decode of `tokens` rows over tables `width` wide, a prefill of
        `tokens` new tokens after `context`, a varlen prefill, norm and rotary over `tokens`."""
        k, v = caches(dtype, gpu)
        qkv = torch.zeros(tokens, (kvh * group + 2 * kvh) * hd, dtype=dtype)
        q = qkv[:, : kvh * group * hd].view(tokens, kvh * group, hd)
        kn = qkv[:, kvh * group * hd : (kvh * group + kvh) * hd].view(tokens, kvh, hd)
        vn = qkv[:, (kvh * group + kvh) * hd :].view(tokens, kvh, hd)
        tables = torch.zeros(tokens, width, dtype=torch.int32)
        lens = torch.full((tokens,), width * bs, dtype=torch.int32)
        starts = torch.arange(tokens + 1, dtype=torch.int32)
        with record_launches() as launches:
            ta.paged_decode_attention(q, k, v, tables, lens, 0.125, num_splits=1)
            ta.paged_prefill_attention(q, k, v, tables[0], context, 0.125)
            ta.paged_prefill_attention_varlen(q, k, v, tables, starts, lens, 1, 0.125)
            hidden = torch.zeros(tokens, 576, dtype=dtype)
            tn.rms_norm(hidden, torch.ones(576, dtype=dtype), 1e-5)
            tn.fused_add_rms_norm(hidden, hidden.clone(), torch.ones(576, dtype=dtype), 1e-5)
            table = torch.zeros(512, hd, dtype=torch.float32)
            positions = torch.zeros(tokens, dtype=torch.long)
            tr.rotary_write_kv(q, kn, vn, table, table, positions, k, v, positions)
        return launches

    # Two steps as unlike as the engine makes them: 1 vs 7 tokens, tables 1 vs 9 blocks wide, a
    # context of 0 vs 37 (1, multiples of 16 and others: each its own variant if specialised).
    # Constexprs are compared apart: the prefill's BLOCK_M is a bucket by design (16, 32 or 64
    # query rows), a bounded set of variants the first steps compile.
    for a, b in zip(step(1, 1, 0, torch.float16, None), step(7, 9, 37, torch.float16, None)):
        pairs = list(zip(a.kernel.arg_names, specialization(a), specialization(b)))
        found["steps"].setdefault(a.name, []).append(
            {
                "args": [n for n, x, y in pairs if x != y and "constexpr" not in (x[0], y[0])],
                "constexprs": [n for n, x, y in pairs if x != y and "constexpr" in (x[0], y[0])],
            }
        )

    for dtype, gpu in ((torch.float16, None), (torch.float16, False), (torch.float32, None)):
        for launch in step(4, 7, 21, dtype, gpu)[:3]:
            key = f"{launch.name}[{str(dtype).removeprefix('torch.')}, {'cpu-layout' if gpu is False else 'default'}]"
            found["ptx"].setdefault(key, []).append(_ptx_facts(compile_launch(launch).asm["ptx"]))
    return found


@pytest.fixture(scope="module")
def facts() -> dict[str, Any]:
    pytest.importorskip("triton", reason="triton is not installed")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRIOLLM_KERNELS")}
    env["TRIOLLM_KERNELS"] = "triton"  # allocate_kv_cache's default layout is the Triton path's
    proc = subprocess.run(
        [sys.executable, str(Path(__file__))], capture_output=True, text=True, env=env, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_two_different_steps_run_the_same_compiled_variants(facts: dict[str, Any]) -> None:
    steps = facts["steps"]
    assert set(steps) == {
        "_paged_decode_kernel",
        "_paged_prefill_kernel",
        "_rms_norm_kernel",
        "_fused_add_rms_norm_kernel",
        "_rotary_write_kv_kernel",
    }
    assert len(steps["_paged_prefill_kernel"]) == 2  # the single-sequence and the varlen launch
    assert all(d["args"] == [] for launches in steps.values() for d in launches), steps
    constexprs = {name: [d["constexprs"] for d in launches] for name, launches in steps.items()}
    assert constexprs["_paged_prefill_kernel"] == [["BLOCK_M"], []], constexprs  # varlen: max_tokens 1
    assert all(c == [[]] for name, c in constexprs.items() if name != "_paged_prefill_kernel")


def test_k_is_loaded_in_16_byte_vectors_from_the_gpu_layout(facts: dict[str, Any]) -> None:
    for kernel in ("_paged_decode_kernel", "_paged_prefill_kernel"):
        for f in facts["ptx"][f"{kernel}[float16, default]"]:
            assert f["two_byte_loads"] == 0 and f["async_copy_bytes"] == [16], (kernel, f)
        # The contiguous transposed blocks (the CPU kernel's layout): K element by element.
        for f in facts["ptx"][f"{kernel}[float16, cpu-layout]"]:
            assert f["two_byte_loads"] >= 8, (kernel, f)
    decode = facts["ptx"]["_paged_decode_kernel[float16, default]"][0]
    assert any(m.startswith("mma.sync") or m.startswith("wgmma") for m in decode["mma"]), decode


def test_an_fp32_cache_is_not_computed_in_tf32(facts: dict[str, Any]) -> None:
    for kernel in ("_paged_decode_kernel", "_paged_prefill_kernel"):
        for f in facts["ptx"][f"{kernel}[float32, default]"]:
            assert not f["tf32"], (kernel, f)
        assert not any(f["tf32"] for f in facts["ptx"][f"{kernel}[float16, default]"])


if __name__ == "__main__":
    print(json.dumps(probe()))
