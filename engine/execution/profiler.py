"""`Profiler`: vLLM's `start_profile()` / `stop_profile()`, a torch profiler trace of the steps
run in between, written into `VLLM_TORCH_PROFILER_DIR` (engine/envs.py).

As in vLLM, the trace is torch's TensorBoard format (`*.pt.trace.json.gz`, which Perfetto and
chrome://tracing open too), CPU activity always and CUDA's when the engine runs there, with
shapes and stacks recorded. The folder is read when the engine core is built; without it,
`start()` is a ValueError naming the variable.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

from triollm.engine.envs import TORCH_PROFILER_DIR_ENV

__all__ = ["Profiler"]

log = logging.getLogger("triollm")


class Profiler:
    def __init__(self, folder: Path | None, device: str) -> None:
        self.folder = folder
        self.device = device
        self._running: profile | None = None

    @property
    def running(self) -> bool:
        return self._running is not None

    def start(self) -> None:
        """Start recording (a second start while recording is a ValueError)."""
        if self.folder is None:
            raise ValueError(f"{TORCH_PROFILER_DIR_ENV}: not set; set it to a folder for the traces to profile")
        if self._running is not None:
            raise ValueError("start_profile: the profiler is already running; call stop_profile() first")
        activities = [ProfilerActivity.CPU]
        if torch.device(self.device).type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self.folder.mkdir(parents=True, exist_ok=True)
        worker = f"engine-core-{os.getpid()}"
        handler = tensorboard_trace_handler(str(self.folder), worker_name=worker, use_gzip=True)
        self._running = profile(activities=activities, record_shapes=True, with_stack=True, on_trace_ready=handler)
        self._running.start()
        log.info("torch profiler started; the trace goes to %s", self.folder)

    def stop(self) -> None:
        """Stop recording and write the trace (a stop without a start is a ValueError)."""
        if self._running is None:
            raise ValueError("stop_profile: the profiler is not running; call start_profile() first")
        running, self._running = self._running, None
        running.stop()
        log.info("torch profiler trace written to %s", self.folder)
