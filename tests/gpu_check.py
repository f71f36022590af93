"""The GPU check: one script a GPU machine runs in a few minutes (issue 11).

    python tests/gpu_check.py                # on a CUDA machine: all three parts
    python tests/gpu_check.py --cpu          # smoke run of part 1 on CPU, under the interpreter

1. Kernel correctness on the device against the torch references (fp16 and bf16 there; fp32
   and fp16 under the interpreter): paged decode (ragged, GQA, split-KV), paged prefill with a
   prefix hit, RMSNorm and the fused residual add, rotary fused with the cache write.
2. Decode-attention bandwidth at long context as a fraction of the HBM peak (`--peak-gbs`,
   default 4800 for the H200).
3. End to end on the bundled model in bf16: output tokens/s over a batch and batch-1 latency per
   token, triollm (`LLM`) and HF transformers (`generate`) on the same GPU, and their ratio.

Prints one line per check and exits non-zero when a kernel is wrong.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

if "--cpu" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated: before any import

import torch

from triollm.kernels.attention import (
    allocate_kv_cache,
    paged_decode_attention,
    prefill_attention,
    write_kv,
)
from triollm.kernels.norm import rms_norm
from triollm.kernels.rotary import apply_rotary
from triollm.kernels.triton import KERNELS_ENV
from triollm.kernels.triton import attention as ta
from triollm.kernels.triton import norm as tn
from triollm.kernels.triton import rotary as tr


@contextmanager
def torch_path() -> Iterator[None]:
    """The dispatch points on their torch path (the references), whatever the device."""
    saved = os.environ.get(KERNELS_ENV)
    os.environ[KERNELS_ENV] = "torch"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(KERNELS_ENV, None)
        else:
            os.environ[KERNELS_ENV] = saved


TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 3e-2}  # of the largest |value|


def check(name: str, got: torch.Tensor, want: torch.Tensor, tol: float) -> bool:
    err = (got.float() - want.float()).abs().max().item()
    bound = tol * max(1.0, want.float().abs().max().item())
    ok = err <= bound
    print(f"{'ok  ' if ok else 'FAIL'} {name:48} max |diff| {err:.2e} (allowed {bound:.1e})")
    return ok


def correctness(device: str, dtypes: list[torch.dtype]) -> bool:
    ok = True
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    small = device == "cpu"
    bs, hd, kvh, group = 16, (32 if small else 128), 2, 3
    lens = [1, 17, 40] if small else [1, 17, 300, 2000]
    for dtype in dtypes:
        tol = TOLERANCE[dtype]
        blocks_per = [-(-n // bs) for n in lens]
        kv = allocate_kv_cache(1, sum(blocks_per) + 1, bs, kvh, hd, dtype, device)
        k_cache, v_cache = kv.k[0], kv.v[0]
        tables, start = [], 1
        for n in blocks_per:
            tables.append(list(range(start, start + n)))
            start += n
        for row, n in zip(tables, lens):  # fill each sequence's context
            slots = torch.tensor([row[i // bs] * bs + i % bs for i in range(n)], device=device)
            write_kv(k_cache, v_cache, rand(n, kvh, hd, dtype=dtype), rand(n, kvh, hd, dtype=dtype), slots)
        width = max(blocks_per)
        table_t = torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32, device=device)
        lens_t = torch.tensor(lens, dtype=torch.int32, device=device)
        q = rand(len(lens), kvh * group, hd, dtype=dtype)
        with torch_path():
            want = paged_decode_attention(q, k_cache, v_cache, table_t, lens_t, hd**-0.5, native=False)
        for splits in (1, 3):
            got = ta.paged_decode_attention(q, k_cache, v_cache, table_t, lens_t, hd**-0.5, num_splits=splits)
            ok &= check(f"paged_decode[{dtype}, splits={splits}]", got, want, tol)
        # prefill: the last sequence's final 9 tokens, after its cached context
        n_new, total = 9, lens[-1]
        ids = torch.tensor(tables[-1], device=device)
        qp = rand(n_new, kvh * group, hd, dtype=dtype)
        unused = qp[:, :kvh]  # with earlier context the torch path reads the new K/V from the cache
        with torch_path():
            want = prefill_attention(qp, unused, unused, k_cache, v_cache, ids, total - n_new, hd**-0.5)
        got = ta.paged_prefill_attention(qp, k_cache, v_cache, ids, total - n_new, hd**-0.5)
        ok &= check(f"paged_prefill[{dtype}, prefix {total - n_new}]", got, want, tol)
        # norms
        x, res, w = rand(5, 576, dtype=dtype), rand(5, 576, dtype=dtype), rand(576, dtype=dtype)
        with torch_path():
            want_norm, want_fused = rms_norm(x, w, 1e-5), rms_norm(res + x, w, 1e-5)
        ok &= check(f"rms_norm[{dtype}]", tn.rms_norm(x, w, 1e-5), want_norm, tol)
        normed, summed = tn.fused_add_rms_norm(x, res, w, 1e-5)
        ok &= check(f"fused_add_rms_norm[{dtype}]", normed, want_fused, tol)
        ok &= check(f"fused_add_rms_norm residual[{dtype}]", summed, res + x, 0.0)
        # rotary + cache write
        t = 6
        cos, sin = torch.randn(64, hd, generator=gen).to(device), torch.randn(64, hd, generator=gen).to(device)
        positions = torch.tensor([0, 5, 9, 33, 34, 63], device=device)
        qr, kr, vr = rand(t, kvh * group, hd, dtype=dtype), rand(t, kvh, hd, dtype=dtype), rand(t, kvh, hd, dtype=dtype)
        slots = torch.arange(t, device=device) + bs  # block 1 onwards
        q_rot, k_rot = tr.rotary_write_kv(qr, kr, vr, cos, sin, positions, k_cache, v_cache, slots)
        c, s = cos.index_select(0, positions), sin.index_select(0, positions)
        ok &= check(f"rotary_write_kv q[{dtype}]", q_rot, apply_rotary(qr.float(), c, s), tol)
        ok &= check(f"rotary_write_kv k[{dtype}]", k_rot, apply_rotary(kr.float(), c, s), tol)
        ok &= check(f"rotary_write_kv cache v[{dtype}]", v_cache[:, 1, :t].transpose(0, 1), vr, 0.0)
    return ok


def bandwidth(peak_gbs: float) -> None:
    device, dtype = "cuda", torch.bfloat16
    for batch, ctx in ((16, 8192), (64, 4096)):
        bs, hd, kvh, group = 16, 128, 8, 4
        nb = batch * ctx // bs
        kv = allocate_kv_cache(1, nb, bs, kvh, hd, dtype, device)
        tables = torch.arange(nb, dtype=torch.int32, device=device).view(batch, -1)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        q = torch.randn(batch, kvh * group, hd, device=device, dtype=dtype)
        for _ in range(3):
            ta.paged_decode_attention(q, kv.k[0], kv.v[0], tables, lens, hd**-0.5)
        torch.cuda.synchronize()
        reps = 20
        start = time.perf_counter()
        for _ in range(reps):
            ta.paged_decode_attention(q, kv.k[0], kv.v[0], tables, lens, hd**-0.5)
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / reps
        gbs = 2 * batch * ctx * kvh * hd * 2 / seconds / 1e9
        print(f"decode attention B={batch} ctx={ctx} bf16: {seconds * 1e3:.3f} ms, {gbs:.0f} GB/s = {gbs / peak_gbs:.0%} of peak")


def end_to_end() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from triollm import LLM, SamplingParams
    from triollm.engine.loading.model_files import resolve_model

    path = resolve_model(None, None)  # the bundled model, imported from its GGUF
    prompts = [f"Write a short story about the number {i}." for i in range(64)]
    tokens = 128
    with LLM(str(path), dtype="bfloat16", max_model_len=1024) as llm:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm-up (compiles, captures)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        ours_tps = len(prompts) * tokens / (time.perf_counter() - start)
        start = time.perf_counter()
        llm.generate(prompts[:1], params, use_tqdm=False)
        ours_ms = (time.perf_counter() - start) / tokens * 1e3
    hf = AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.bfloat16).cuda().eval()

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    batch = tokenizer(prompts, return_tensors="pt", padding=True).to("cuda")
    kwargs = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False}
    with torch.inference_mode():
        hf.generate(**tokenizer(prompts[:2], return_tensors="pt", padding=True).to("cuda"), **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(**batch, **kwargs)
        torch.cuda.synchronize()
        hf_tps = len(prompts) * tokens / (time.perf_counter() - start)
        one = tokenizer(prompts[:1], return_tensors="pt").to("cuda")
        start = time.perf_counter()
        hf.generate(**one, **kwargs)
        torch.cuda.synchronize()
        hf_ms = (time.perf_counter() - start) / tokens * 1e3
    print(f"end to end, bundled model bf16, {len(prompts)} x {tokens} tokens: triollm {ours_tps:.0f} tok/s, transformers {hf_tps:.0f} tok/s ({ours_tps / hf_tps:.2f}x)")
    print(f"batch 1: triollm {ours_ms:.2f} ms/token, transformers {hf_ms:.2f} ms/token ({hf_ms / ours_ms:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="part 1 only, on CPU under the Triton interpreter")
    parser.add_argument("--peak-gbs", type=float, default=4800.0, help="the GPU's HBM peak in GB/s (H200: 4800)")
    parser.add_argument("--skip-e2e", action="store_true")
    args = parser.parse_args()
    if args.cpu:
        return 0 if correctness("cpu", [torch.float32, torch.float16]) else 1
    if not torch.cuda.is_available():
        print("no CUDA device: run with --cpu for the interpreter smoke check", file=sys.stderr)
        return 2
    print(torch.cuda.get_device_name(), f"torch {torch.__version__}")
    ok = correctness("cuda", [torch.float16, torch.bfloat16])
    bandwidth(args.peak_gbs)
    if not args.skip_e2e:
        end_to_end()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
