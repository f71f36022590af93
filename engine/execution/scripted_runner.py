"""A model runner that replays scripted tokens instead of running a model.

For measuring everything around the forward pass (scheduler, KV bookkeeping, the actor
pipeline, the wire) at full speed: `EngineArgs(load_format="scripted")`. The scheduler and block
manager run exactly as with a real model; only `execute` is replaced. Token i of a request is
`(prompt_len + i) % vocab_size`, skipping the EOS ids, so counts are exact and reproducible.
"""

from __future__ import annotations

from triollm.engine.execution.model_runner import RunnerOutput
from triollm.engine.scheduling.scheduler import ScheduledRequest

__all__ = ["ScriptedRunner"]


class ScriptedRunner:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        out = RunnerOutput({}, {}, {})
        for s in scheduled:
            if s.samples:
                req = s.request
                token = (req.num_prompt_tokens + req.num_output_tokens) % self.vocab_size
                while token in req.eos_token_ids:
                    token = (token + 1) % self.vocab_size
                out.sampled[req.request_id] = token
        return out
