"""`PoolingEngineCore`: the engine core of a pooling model (an embedder, a classifier).

A pooling model needs no KV cache kept across steps, no scheduler of decode steps and no
sampler: each request is one forward pass over its whole prompt, through an encoder (bert.py,
modernbert.py) or a decoder's trunk (decoder_pooling.py, which holds a cache for the one pass).
So this core implements the `Core` protocol (engine/core_protocol.py; the actor layer drives it
as it drives `EngineCore`: `add_request`, `abort_requests`, `step`, `has_unfinished_requests`,
`statistics`, `check_integrity`, `close`) over a much simpler state: an insertion-ordered dict
of waiting requests, whoever sent them. Each `step()` takes the oldest waiting request and those
nearest it in length (length buckets around the oldest, so short prompts are not padded to a
long one's length) while the padded batch (requests x longest prompt) fits
`max_num_batched_tokens` and their number `max_num_seqs` (at least one request: every prompt
fits, max_model_len <= the budget is checked at configuration), encodes them in one pass, pools
and finishes every one of them with its result (`EngineCoreOutput.pooled`, float32 bytes): an
embedding, per-token vectors, a classifier's activated logits (all labels for "classify", the
one label for "score"), or a reward model's per-token rewards ("token_classify"). Requests are
never preempted or chunked.

`build_engine_core(config)` (engine/cores.py) builds this class when the model's runner is
"pooling", so the transports and the engine-core process never name it. Rejected: teaching the
generative scheduler about requests without KV blocks - every step of a generative model would
pay for the distinction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from triollm.engine import envs, request_rules
from triollm.engine.config import EngineConfig
from triollm.engine.core_protocol import EngineCoreStats
from triollm.engine.execution.models.bert import BertModel, load_bert
from triollm.engine.execution.models.decoder_pooling import DecoderPooler, load_decoder_pooler
from triollm.engine.execution.models.modernbert import ModernBertModel, load_modernbert
from triollm.engine.execution.pooler import activate, finish_embedding, pool
from triollm.engine.execution.profiler import Profiler
from triollm.engine.execution.sleep_mode import check_tags, run_rpc
from triollm.engine.pooling_outputs import pack_pooled
from triollm.engine.pooling_params import PoolingParams
from triollm.engine.request import EngineCoreOutput, EngineCoreRequest, FinishReason
from triollm.kernels import cpu_native

__all__ = ["PoolingEngineCore"]

log = logging.getLogger("triollm")


class PoolingEngineCore:
    def __init__(self, config: EngineConfig) -> None:
        """Load the encoder; `config` must be a pooling model's (runner "pooling")."""
        if config.model.runner_type != "pooling" or config.model.pooler is None:
            raise ValueError(
                f"runner: PoolingEngineCore runs a pooling model, and this model's runner is "
                f"{config.model.runner_type!r}; build its core with "
                "triollm.engine.cores.build_engine_core(config)"
            )
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        cpu_native.keep_freed_memory(config.device)  # a batch's activations not faulted in anew
        if config.seed is not None:
            torch.manual_seed(config.seed)
        self.num_blocks = 0  # no KV cache
        self.num_steps = 0
        self.pooler = config.model.pooler
        self.encoder = _load(config)
        self.waiting: dict[str, EngineCoreRequest] = {}  # insertion order: first come, first served
        self.profiler = Profiler(envs.torch_profiler_dir(), config.device)
        log.info(
            "pooling model %s (%s) on %s, max_model_len %d",
            config.model.path.name,
            f"{self.pooler.pooling_type} pooling{', normalised' if self.pooler.normalize else ''}"
            if self.pooler.num_labels is None
            else f"{self.pooler.num_labels} labels, {self.pooler.activation}",
            config.device,
            config.model.max_model_len,
        )

    def close(self) -> None:
        """Nothing to stop (one rank, no worker processes)."""

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError (and changes nothing) if it is invalid."""
        mc = self.config.model
        rid = request.request_id
        request_rules.check_new_request_id(rid, self.waiting)
        if request.pooling_params is None:
            raise ValueError(
                "pooling_params: this is a pooling model, which computes embeddings, not tokens; "
                "send PoolingParams (LLM.embed, AsyncLLM.encode, /v1/embeddings)"
            )
        ids = request.prompt_token_ids
        request_rules.check_prompt_tokens(ids, mc.max_model_len, mc.vocab_size, generate=False)
        self.waiting[rid] = request

    def abort_requests(self, request_ids: list[str] | str) -> None:
        """Drop the requests; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.waiting.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def reset_prefix_cache(self) -> bool:
        return True  # nothing is cached

    # ------------------------------------------------------------------ vLLM's worker calls

    def sleep(self, level: int = 1) -> None:
        raise ValueError("sleep: a pooling model's engine does not sleep (it holds no KV cache to free)")

    def wake_up(self, tags: list[str] | None = None) -> None:
        check_tags(tags)  # never asleep: nothing to restore

    def is_sleeping(self) -> bool:
        return False

    def reload_weights(self, weights_path: str | None = None) -> None:
        raise ValueError("reload_weights: not supported for pooling models; start a new engine")

    def get_model(self) -> torch.nn.Module:
        """vLLM's `worker.get_model()`: the encoder (the worker of `collective_rpc` is this core)."""
        return self.encoder

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> Any:
        return func(self.encoder)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        return [run_rpc(self, method, args, {} if kwargs is None else kwargs)]

    def start_profile(self) -> None:
        self.profiler.start()

    def stop_profile(self) -> None:
        self.profiler.stop()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[EngineCoreOutput]:
        """Encode the next batch of waiting requests; return their finished outputs."""
        batch = self._next_batch()
        if not batch:
            return []
        self.num_steps += 1
        device = self.config.device
        lengths = [len(r.prompt_token_ids) for r in batch]
        ids = torch.tensor([t for r in batch for t in r.prompt_token_ids], dtype=torch.long, device=device)
        types = None
        if any(r.token_type_ids is not None for r in batch):
            types = torch.tensor(
                [t for r in batch for t in (r.token_type_ids or [0] * len(r.prompt_token_ids))],
                dtype=torch.long,
                device=device,
            )
        with torch.inference_mode():
            hidden, mask = self.encoder(ids, lengths, types)
            if self.pooler.reward:
                rows = [self._rewards(hidden[i, :n], _params(req)) for i, (req, n) in enumerate(zip(batch, lengths))]
            elif self.pooler.num_labels is None:
                pooled = pool(hidden, mask, self.pooler.pooling_type)
                rows = [
                    self._embedding(hidden[i, :n], pooled[i], _params(req))
                    for i, (req, n) in enumerate(zip(batch, lengths))
                ]
            else:
                logits = self.encoder.classify(hidden, mask)
                rows = [self._classes(logits[i], _params(r)) for i, r in enumerate(batch)]
            return [
                EngineCoreOutput(req.request_id, [], finish_reason=FinishReason.STOP, pooled=pack_pooled(data))
                for req, data in zip(batch, rows)
            ]

    def _embedding(self, tokens: torch.Tensor, pooled: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        data = tokens if params.task == "token_embed" else pooled
        return finish_embedding(data, params.dimensions, normalize)

    def _rewards(self, tokens: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        return tokens.float() if params.use_activation is False else activate(tokens, self.pooler.activation)

    def _classes(self, logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
        probs = logits if params.use_activation is False else activate(logits, self.pooler.activation)
        return probs[0] if params.task == "score" else probs

    def _next_batch(self) -> list[EngineCoreRequest]:
        """The oldest waiting request, joined by those whose lengths are nearest its own (ties:
        the older first) while the padded batch fits the budget: one long prompt no longer pads
        a batch of short ones, and every request is at most as many steps away as there are
        requests older than it."""
        sched = self.config.scheduler
        if not self.waiting:
            return []
        oldest, *rest = self.waiting.values()
        anchor = len(oldest.prompt_token_ids)
        rest.sort(key=lambda r: abs(len(r.prompt_token_ids) - anchor))  # stable: older first on ties
        batch = [oldest]
        longest = anchor
        for req in rest:
            longest_if_added = max(longest, len(req.prompt_token_ids))
            if len(batch) >= sched.max_num_seqs or longest_if_added * (len(batch) + 1) > sched.max_num_batched_tokens:
                break
            batch.append(req)
            longest = longest_if_added
        for req in batch:
            del self.waiting[req.request_id]
        return batch

    def statistics(self) -> EngineCoreStats:
        return EngineCoreStats(num_waiting=len(self.waiting))  # no KV cache, nothing running

    def check_integrity(self) -> None:
        for rid, req in self.waiting.items():
            assert rid == req.request_id, f"waiting request filed under {rid!r} is {req.request_id!r}"
            assert req.pooling_params is not None, f"request {rid!r} has no pooling_params"


def _params(request: EngineCoreRequest) -> PoolingParams:
    assert request.pooling_params is not None  # checked at add_request
    return request.pooling_params


def _load(config: EngineConfig) -> BertModel | ModernBertModel | DecoderPooler:
    """The model's network: an encoder (BERT and XLM-R, or ModernBERT), or a decoder's trunk."""
    encoder = config.model.encoder
    if encoder is None:
        return load_decoder_pooler(config.model, config.device)
    if encoder.modernbert is not None:
        return load_modernbert(config.model, config.device)
    return load_bert(config.model, config.device)
