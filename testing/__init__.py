"""`triollm.testing`: what you need to test how your code starts, streams and shuts down around
an `AsyncLLM`, with no model and in virtual time (docs/testing.md has a worked example).

- Engine cores without a model, that fail on cue: `FakeCore(...)` (scripted tokens at a chosen
  cadence; raise, hang or stall at step n, refuse adds, SIGKILL the engine-core child), passed
  as `AsyncLLM(args, engine_core_factory=FakeCore(...).factory())`. A model directory with no
  weights for them: `write_model_dir(path)`, and `fake_engine_args(path, **overrides)`.
- Where the steps run: `steps_in_event_loop()` (in-process cores step in the event loop, so
  trio's `MockClock` drives the cadence); `replace_core_loop(loop)` for a loop of your own;
  `hold_hung_steps()` / `release_hung_steps()` for steps hung in a thread;
  `kill_core_process(llm)`; `mock_clock_patience()` around what waits on threads (an engine's
  start-up and teardown) under a MockClock.
- What the frontend sends the core: `InputRecorder` (use as `input_tap=`), `rewrite_adds(fn)`,
  `chain_taps(...)`.
- Leaks: `Snapshot`, `wait_for_no_leaks`, `check_no_leaks()`, `child_pids`,
  `wait_no_new_children`.
- An in-memory ASGI client for an app in front of the engine: `open_asgi_client(app)`.
- Hypothesis strategies for fault plans: `triollm.testing.strategies` (needs hypothesis).
- pytest fixtures: `pytest_plugins = ["triollm.testing.pytest_plugin"]` (needs pytest).

These are supported seams, used by triollm's own fault tests; none is a user setting of the
engine. The submodules `strategies` and `pytest_plugin` are imported on demand, so importing
`triollm.testing` needs neither hypothesis nor pytest.
"""

from __future__ import annotations

from triollm.testing.asgi import AppDidNotEnd, ASGIClient, ASGIResponse, open_asgi_client
from triollm.testing.clock import mock_clock_patience
from triollm.testing.cores import (
    CoreLoop,
    FakeCore,
    FakeEngineCore,
    build_fake_core,
    hold_hung_steps,
    kill_core_process,
    release_hung_steps,
    replace_core_loop,
    steps_in_event_loop,
)
from triollm.testing.leaks import (
    Snapshot,
    check_no_leaks,
    child_pids,
    run_in_own_thread,
    wait_for_no_leaks,
    wait_no_new_children,
)
from triollm.testing.model_dir import EOS_TOKEN_ID, VOCAB_SIZE, fake_engine_args, write_model_dir
from triollm.testing.taps import InputRecorder, InputTap, chain_taps, rewrite_adds, user_request_id

__all__ = [
    "EOS_TOKEN_ID",
    "VOCAB_SIZE",
    "ASGIClient",
    "ASGIResponse",
    "AppDidNotEnd",
    "CoreLoop",
    "FakeCore",
    "FakeEngineCore",
    "InputRecorder",
    "InputTap",
    "Snapshot",
    "build_fake_core",
    "chain_taps",
    "check_no_leaks",
    "child_pids",
    "run_in_own_thread",
    "fake_engine_args",
    "hold_hung_steps",
    "kill_core_process",
    "mock_clock_patience",
    "open_asgi_client",
    "release_hung_steps",
    "replace_core_loop",
    "rewrite_adds",
    "steps_in_event_loop",
    "user_request_id",
    "wait_for_no_leaks",
    "wait_no_new_children",
    "write_model_dir",
]
