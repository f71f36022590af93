"""`vllm.logprobs`, for scripts that import from there: the log-probability records of an output.

A re-export only; the definitions live in `triollm.engine.outputs`.
"""

from __future__ import annotations

from triollm.engine.outputs import Logprob, PromptLogprobs, SampleLogprobs

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]
