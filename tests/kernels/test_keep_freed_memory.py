"""`cpu_native.keep_freed_memory`: glibc's malloc set to keep a step's freed activations in the
heap, so that the next step's tensors are not faulted in and zeroed anew. Each case runs the
bundled model in its own interpreter: the setting is process-wide and cannot be undone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from triollm.kernels import cpu_native

pytestmark = pytest.mark.skipif(cpu_native.libc_function("mallopt") is None, reason="no glibc mallopt here")

# Two prefill waves (16 prompts of 200 tokens, 1,024-token steps) after a warm-up wave: the
# process's minor page faults over them. The prefill budget is off, so that every step's shapes
# are the same whatever else runs on the machine (with `auto` the chunks follow the measured step
# times, and new shapes on a loaded machine fault in new memory). Where glibc's own thresholds hand a step's freed
# tensors back to the kernel they are faulted in again on every step (on the AMX Xeon: about
# 30,000 faults a wave; with the heap keeping them, a few hundred).
SCRIPT = """
import random, resource
from triollm.engine.config import EngineArgs
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.sync_engine import SyncEngine
from triollm.kernels import cpu_native
engine = SyncEngine.from_engine_args(EngineArgs(
    enable_prefix_caching=False, seed=0, max_num_batched_tokens=1024, scheduler_prefill_budget="off"
))
rng = random.Random(0)
def wave():
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(200)]} for _ in range(16)]
    engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0))
wave()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
wave()
wave()
print(cpu_native.keep_freed_memory("cpu"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults)
"""


def _faults(env: dict[str, str]) -> tuple[bool, int]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env={**os.environ, **env}, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    kept, faults = out.stdout.split()[-2:]
    return kept == "True", int(faults)


def test_a_step_s_freed_tensors_are_not_faulted_in_again() -> None:
    kept, faults = _faults({})
    assert kept
    # The user's malloc tunables stand (a harmless one here): glibc's own thresholds then.
    mine, default_faults = _faults({"GLIBC_TUNABLES": "glibc.malloc.check=0"})
    assert not mine
    # ~50 kept against 78k-483k with glibc's thresholds on a quiet Zen 4; a loaded machine has put
    # ~3,100 on both (a CI run beside another worker): no signal then, and no failure either.
    assert faults <= max(5000, default_faults // 4), (faults, default_faults)


def test_only_a_cpu_engine_changes_the_allocator() -> None:
    """A GPU (or meta) engine's host process keeps glibc's own thresholds: answered before any
    mallopt call, so this process's allocator is left as it was."""
    assert not cpu_native.keep_freed_memory("cuda")
    assert not cpu_native.keep_freed_memory(torch.device("meta"))
