"""The triollm.testing plugin's fixtures, as a user's `pytest_plugins` would load them (a
`pytest_plugins` line is only allowed in the top-level conftest, so they are imported here)."""

from __future__ import annotations

from triollm.testing.pytest_plugin import (  # noqa: F401 - fixtures, found by pytest by name
    _triollm_hung_steps,
    anyio_backend,
    fake_args,
    fake_core_loop,
    fake_model_dir,
    inline_steps,
    input_recorder,
    no_leaks,
    triollm_warm_up,
)
