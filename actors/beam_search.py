"""Beam search driven through `AsyncLLM`: each round's beams run as concurrent requests.

The search itself (which beams live, how they extend, the final ranking) is `BeamSearch` in
engine/beam_search.py, independent of how it is driven; this drives it over `add_request`.
Round r of request R runs its beams as requests "{R}-beam{r}-{k}" (read in order, run together
in the engine); leaving early closes their streams, which aborts them. A beam the engine failed
(an adapter broken after it was loaded) fails the whole search with `EngineGenerateError`.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import TYPE_CHECKING, Protocol

from triollm.actors.errors import EngineGenerateError
from triollm.engine.beam_search import BeamSearch, BeamSearchParams, prompt_token_ids
from triollm.engine.inputs import PromptType
from triollm.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from triollm.actors.request_stream import RequestStream
    from triollm.engine.config import ModelConfig
    from triollm.engine.processing.tokenizer import Tokenizer
    from triollm.engine.sampling_params import SamplingParams
    from triollm.lora.request import LoRARequest

__all__ = ["BeamEngine", "run_beam_search"]


class BeamEngine(Protocol):
    """What beam search needs of the engine: `AsyncLLM` is one (named here, not imported, so
    that this module stays below the class that uses it)."""

    def get_tokenizer(self) -> Tokenizer: ...

    def get_model_config(self) -> ModelConfig: ...

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        wait_for_room: bool = ...,
        lora_request: LoRARequest | None = ...,
    ) -> RequestStream: ...


async def run_beam_search(
    llm: BeamEngine,
    prompt: PromptType,
    request_id: str,
    params: BeamSearchParams,
    lora_request: LoRARequest | None = None,
) -> RequestOutput:
    """The finished output of a beam search: the `params.beam_width` best sequences, best first;
    every beam's request runs under the adapter `lora_request` (None: the base model)."""
    tokenizer = llm.get_tokenizer()
    ids = prompt_token_ids(prompt, tokenizer)
    text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
    search = BeamSearch([ids], params, tokenizer.eos_token_id, llm.get_model_config().max_model_len)
    step = search.step_params()
    for round_ in range(params.max_tokens):
        beams = search.live([0])
        if not beams or search.aborted:
            break
        results: list[RequestOutput] = []
        with ExitStack() as streams:
            added = [
                streams.enter_context(
                    await llm.add_request(
                        f"{request_id}-beam{round_}-{k}",
                        {"prompt_token_ids": beam.tokens},
                        step.clone(),
                        wait_for_room=True,
                        lora_request=lora_request,
                    )
                )
                for k, (_, beam) in enumerate(beams)
            ]
            for stream in added:
                results.extend([out async for out in stream if out.finished])
        _raise_if_failed(results)
        search.advance([0], beams, results)
    (result,) = search.results(lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True))
    return search.request_output(request_id, text if isinstance(text, str) else None, 0, result)


def _raise_if_failed(results: list[RequestOutput]) -> None:
    """A beam the engine failed (its adapter no longer reads: the frontend ends it "abort" with the
    error text as its stop_reason) fails the search with that error, as a plain request fails:
    not a search that ends "abort" with what the earlier rounds made."""
    for output in results:
        for c in output.outputs:
            if c.finish_reason == "abort" and isinstance(c.stop_reason, str):
                raise EngineGenerateError(c.stop_reason)
