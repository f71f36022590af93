"""Configuration: one user-facing schema (`EngineArgs`) validated once into a frozen `EngineConfig`.

`EngineArgs` keeps vLLM's user-facing keyword names so scripts work unchanged, and it is the only
schema: `LLM(**kwargs)`, `EngineArgs(**kwargs)` and the CLI flags (generated from the fields by
`add_cli_args`, read back by `from_cli_args`) accept the same names with the same meaning.

- Normalisations happen once, in `__post_init__`: dtype aliases (`half`, `float`, a
  `torch.dtype`) become canonical names, an int or dict `compilation_config` becomes a
  `CompilationConfig`, the deprecated `swap_space` warns and is dropped, and values this engine
  cannot honour (`quantization`, a non-"auto" `kv_cache_dtype`, a `kv_transfer_config`, ...)
  raise `ValueError` naming the field and the allowed values.
- vLLM arguments that change nothing here (`trust_remote_code`, `cpu_offload_gb`, ...) are accepted so
  that scripts run; `create_engine_config()` logs one warning per such name per process when it
  is set to something other than its default (`EngineConfig.ignored_args` records them).
- Settings of the actor layer (transport, output chunking, the ZMQ address and the opt-in to
  plain tcp, `max_logprobs`) and the one environment override (`$TRIOLLM_MULTIPROCESS`) are read
  once into `ActorConfig`.

Everything derived from the model directory lives in `ModelConfig`. Sizes the engine measures at
start-up (the number of KV blocks) are returned by the code that measures them, never written
back here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from triollm.engine.distributed.sharding import check_tensor_parallel
from triollm.engine.loading.hub import is_hub_id, resolve_hub
from triollm.engine.loading.model_config import ModelConfig, check_generation_config
from triollm.engine.loading.model_files import resolve_model
from triollm.engine.loading.quant_checkpoints import ALIASES, METHODS

__all__ = [
    "ActorConfig",
    "CacheConfig",
    "CompilationConfig",
    "EngineArgs",
    "EngineConfig",
    "LimitsConfig",
    "ModelConfig",
    "SchedulerConfig",
]

log = logging.getLogger("triollm")

MULTIPROCESS_ENV = "TRIOLLM_MULTIPROCESS"


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None  # None: derive from available memory
    num_kv_blocks: int | None  # explicit override (tests force preemption with a few blocks)
    # CUDA: the fraction of the GPU's memory this engine may use (weights + KV cache), as vLLM.
    gpu_memory_utilization: float = 0.9


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int = 0  # > 0: a prompt takes at most this many tokens per step
    policy: str = "fcfs"  # "fcfs": arrival order, `priority` must be 0; "priority": by priority
    # "auto": beside running decodes a step takes only the prompt tokens that keep it near a
    # decode-only step's measured time (engine/scheduling/scheduler.py); "off": the whole budget.
    prefill_budget: str = "auto"
    max_loras: int = 0  # the most distinct LoRA adapters among running requests (0: LoRA off)


@dataclass(frozen=True)
class ActorConfig:
    """The frontend (`AsyncLLM`, `LLM`) and its link to the engine core."""

    multiprocess: bool  # the engine core in a child process (resolved: flag, else env, else True)
    output_chunk_size: int  # RequestOutputs built per chunk before yielding to the event loop
    zmq_address: str  # "ipc" or "tcp://HOST"
    # tcp without CURVE: unauthenticated and unencrypted (an explicit opt-in; no effect on ipc).
    zmq_insecure_tcp: bool
    max_logprobs: int  # the most logprobs a request may ask for (-1: no limit)
    # With work pending, no output from the engine core for this long means it is hung: the
    # engine is declared dead (EngineDeadError everywhere, /health 503). None: never.
    engine_output_timeout_s: float | None
    # Engine-core processes behind the frontend, requests balanced over them (data parallel).
    data_parallel_size: int = 1
    # External load balancing: this server is rank `data_parallel_rank` of `data_parallel_world`
    # servers and runs that one engine core (data_parallel_size is 1 then).
    data_parallel_rank: int = 0
    data_parallel_world: int = 1
    data_parallel_backend: str = "mp"  # "ray": the engine cores are Ray actors
    data_parallel_address: str | None = None  # Ray: the host the engine cores connect back to


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may ask of the server, and how much may wait for the scheduler. A request
    over a limit fails alone with a `ValueError` naming the field and the setting (HTTP 400); over
    a queue limit, with `EngineBusyError` (HTTP 429)."""

    max_num_queued_reqs: int | None  # requests admitted but not yet finished, beyond max_num_seqs
    max_num_queued_tokens: int | None  # prompt tokens of the requests waiting for the scheduler
    # What one request may hold in the engine: sequences x (prompt + token-list entries).
    max_request_tokens: int
    max_stop_strings: int  # `stop` entries per request
    max_stop_string_len: int  # characters per `stop` entry
    max_token_list_len: int  # entries of stop_token_ids, allowed_token_ids, bad_words, logit_bias
    max_prompts_per_request: int  # prompts in one /v1/completions request
    max_n: int  # `n` (and `best_of`)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (`enable_lora`): lora/ and docs/lora.md."""

    max_loras: int  # adapters in one batch: the slots of the stacked A/B buffers
    max_lora_rank: int  # the largest r an adapter may have (the slots' width)
    max_cpu_loras: int  # adapters kept read in memory (LRU), >= max_loras
    dtype: str  # the A/B buffers' dtype name (lora_dtype "auto": the model's; bfloat16 if quantized)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`speculative_config`, engine/speculative/, docs/speculative.md)."""

    method: str  # "ngram" (prompt lookup) or "draft_model" (a smaller model, or the same one cheaper)
    num_speculative_tokens: int  # drafts proposed per request per step
    prompt_lookup_min: int = 0  # ngram: the shortest and longest tail looked up
    prompt_lookup_max: int = 0
    draft: ModelConfig | None = None  # draft_model: the draft's resolved config
    # Speculation is off for a step once this many requests decode (None: never off).
    disable_by_batch_size: int | None = None


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str
    seed: int
    num_threads: int | None  # in all; with tensor parallelism each rank gets its share
    tokenizer: Path  # the tokenizer directory (the model's unless `tokenizer=` named another)
    actor: ActorConfig
    limits: LimitsConfig
    # vLLM arguments the user set that have no effect here (each warned about once).
    ignored_args: tuple[str, ...] = ()
    tensor_parallel_size: int = 1  # processes the model is sharded over (docs/scaling.md)
    # CUDA: the decode batch sizes replayed from captured graphs (engine/execution/cuda_graphs.py);
    # empty: every step runs eagerly (CPU, enforce_eager, use_cudagraph=False).
    cuda_graph_sizes: tuple[int, ...] = ()
    lora: LoRAConfig | None = None  # None: LoRA off (enable_lora=False)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding


@dataclass(frozen=True)
class CompilationConfig:
    """How the model is compiled (GPU path: torch.compile and CUDA graphs). On CPU, eager
    execution measured faster, so level 0 is the default and the only level used there."""

    level: int = 0
    use_cudagraph: bool = True
    cudagraph_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.level not in (0, 1, 2, 3):
            raise ValueError(f"compilation_config.level: {self.level!r} is not one of 0, 1, 2, 3")

    @classmethod
    def coerce(cls, value: CompilationConfig | int | dict[str, Any] | None) -> CompilationConfig:
        """An int is the level; a dict must hold only this config's fields."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, dict)):
            raise ValueError(
                f"compilation_config: expected an int level, a dict or a CompilationConfig, got {type(value).__name__}"
            )
        if isinstance(value, int):
            return cls(level=value)
        known = {f.name for f in dataclasses.fields(cls)}
        for key in value:
            if key not in known:
                raise ValueError(
                    f"compilation_config: unknown key {key!r}; allowed keys: {', '.join(sorted(known))}"
                )
        kwargs = dict(value)
        if kwargs.get("cudagraph_capture_sizes") is not None:
            kwargs["cudagraph_capture_sizes"] = tuple(kwargs["cudagraph_capture_sizes"])
        return cls(**kwargs)


SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy
SPECULATIVE_METHODS = ("ngram", "draft_model")
SPECULATIVE_KEYS = (
    "method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "quantization",
    "disable_by_batch_size", "draft_tensor_parallel_size", "revision",
)  # fmt: skip
MAX_SPECULATIVE_TOKENS = 32
# Where speculation stops paying on a CPU: with 8 requests decoding, free text lost 17% of its
# throughput to rejected drafts while copying output gained 12% (docs/speculative.md).
SPEC_DISABLE_BY_BATCH_SIZE = 8
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")
PREFILL_BUDGETS = ("auto", "off")  # --scheduler-prefill-budget (triollm's)
RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner ("draft" has no meaning here)
# Weight-only quantization (kernels/quant.py): a .gguf model's blocks as shipped, float
# weights quantized at load, or a quantized checkpoint's own method (vLLM's spellings,
# engine/loading/quant_checkpoints.py; the *_marlin names are aliases here).
QUANTIZATIONS = ("gguf", "int8", "int4", "gptq", "gptq_marlin", "awq", "awq_marlin", "fp8", "compressed-tensors", "none")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32")
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's --dtype choices
_DTYPE_NAMES = {"half": "float16", "float": "float32"}
_TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
LOAD_FORMATS = ("auto", "safetensors", "gguf")
TOKENIZER_MODES = ("auto", "hf", "slow")
BLOCK_SIZES = (8, 16, 32, 64, 128)
DP_BACKENDS = ("mp", "ray")

# vLLM arguments that change nothing in this engine: set to a non-default value, each is logged
# once per process with the reason. (`_SOMETIMES_IGNORED` join them in some cases.)
IGNORED_ARGS: dict[str, str] = {
    "trust_remote_code": "no code from a checkpoint is ever run (Llama-family models are built in)",
    "skip_tokenizer_init": "the tokenizer is always loaded (outputs carry text)",
    "distributed_executor_backend": "tensor-parallel ranks are always processes the engine core starts (docs/scaling.md)",
    "disable_custom_all_reduce": "tensor-parallel all-reduces always go through gloo",
    "max_seq_len_to_capture": "CUDA graphs are captured per batch size and serve every context length",
    "cpu_offload_gb": "weights are not offloaded",
    "allowed_local_media_path": "prompts are text or token ids only",
    "data_parallel_rpc_port": "dense models need no data parallel coordinator (ranks never synchronise)",
    "renderer_num_workers": "prompts are tokenized in the request's own task (large ones in a "
    "worker thread); there is no renderer pool",
    "async_scheduling": "the engine core has one scheduler, which plans each step as the previous one ends",
    "disable_cascade_attn": "there is no cascade attention to disable",
    "enable_expert_parallel": "there is no expert-parallel mode (MoE weights follow tensor_parallel_size)",
    "limit_mm_per_prompt": "prompts are text or token ids only (no multimodal inputs)",
}
_SOMETIMES_IGNORED = {
    "gpu_memory_utilization": "it sizes the KV cache on CUDA only",
    "tokenizer_mode": "only fast tokenizers exist here: 'slow' loads the fast one (tokenizer.json)",
    # Hub options apply to a Hugging Face Hub repo id only (engine/loading/hub.py).
    "revision": "the model is a local directory or .gguf file, not a Hub repo id",
    "tokenizer_revision": "the tokenizer is not a Hub repo id (nor the model's, with tokenizer unset)",
    "download_dir": "neither model nor tokenizer is a Hub repo id (imported GGUF files are cached in cache_dir)",
    "hf_token": "neither model nor tokenizer is a Hub repo id",
}
_warned: set[str] = set()


def _arg(default: Any, help: str, *, choices: Sequence[Any] | None = None, nargs: str | None = None) -> Any:
    """A field with its CLI help (and choices): `add_cli_args` turns each field into a flag."""
    return field(default=default, metadata={"help": help, "choices": choices, "nargs": nargs})


@dataclass
class EngineArgs:
    """Every user-settable engine knob, with vLLM's names. `create_engine_config()` validates."""

    # --- model and tokenizer
    model: str | None = _arg(None, "a local Hugging Face directory, a .gguf file, or a Hugging Face Hub repo id (owner/name: the HF cache, else downloaded unless HF_HUB_OFFLINE is set) (default: the bundled SmolLM2-135M-Instruct)")
    served_model_name: str | list[str] | None = _arg(None, "names clients use in `model` (default: the model argument)", nargs="+")
    tokenizer: str | None = _arg(None, "a tokenizer directory, .gguf file or Hub repo id other than the model's")
    tokenizer_mode: str = _arg("auto", "fast tokenizers only: 'slow' loads the fast one", choices=TOKENIZER_MODES)
    skip_tokenizer_init: bool = _arg(False, "accepted, ignored")
    trust_remote_code: bool = _arg(False, "accepted, ignored (no checkpoint code runs)")
    revision: str | None = _arg(None, "a Hub model's branch, tag or commit hash (default: main)")
    tokenizer_revision: str | None = _arg(None, "a Hub tokenizer's branch, tag or commit hash (default: main; with tokenizer unset, the model repo's tokenizer at this revision)")
    download_dir: str | None = _arg(None, "the Hugging Face cache for Hub repo ids, read and downloaded into (default: huggingface_hub's, $HF_HUB_CACHE or $HF_HOME/hub); .gguf imports go to --cache-dir")
    hf_token: str | None = _arg(None, "the Hugging Face token for gated or private Hub repos (default: huggingface_hub's, $HF_TOKEN or the `hf auth login` one)")
    load_format: str = _arg("auto", "the weights' format (a .gguf model is imported once)", choices=LOAD_FORMATS)
    dtype: str | torch.dtype = _arg("auto", "weights and activations: auto (float32 on CPU), half, float16, bfloat16, float, float32", choices=DTYPES)
    kv_cache_dtype: str = _arg(
        "auto",
        "the KV cache's dtype: auto (the model's; bfloat16 under a quantized model's float32 activations, "
        "as llama.cpp keeps f16), bfloat16, or float32 (triollm's: the activations' float32)",
        choices=KV_CACHE_DTYPES,
    )
    quantization: str | None = _arg(
        None,
        "weight-only quantized linear layers on CPU: gguf (a .gguf model's blocks as shipped), int8, int4, "
        "gptq, awq, fp8, compressed-tensors (a checkpoint's quantization_config: its own codes; gptq_marlin and "
        "awq_marlin are aliases), or none (dense; a quantized checkpoint dequantized); default: the method of a "
        "checkpoint with a quantization_config; gguf for a .gguf model (the bundled one included) on a CPU whose "
        "quantized kernels have a vector path (AVX2+FMA+F16C or AVX-512 VNNI), with dtype auto; dense otherwise",
        choices=QUANTIZATIONS,
    )
    seed: int = _arg(0, "the engine's random seed")
    max_model_len: int | None = _arg(None, "context length, e.g. 4096, 4k (4000) or 4K (4096); -1 or auto: the model's (default: the model's)")
    max_logprobs: int = _arg(20, "the most logprobs a request may ask for (-1: no limit)")
    generation_config: str = _arg("auto", "sampling defaults: auto (the model's generation_config.json), vllm (none: vLLM's and OpenAI's defaults) or a folder holding a generation_config.json")
    override_generation_config: dict[str, Any] | None = _arg(None, 'a JSON object merged over those defaults, e.g. \'{"temperature": 0.5}\' (keys: temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)')
    # --- parallelism
    tensor_parallel_size: int = _arg(1, "processes the model is sharded over (CPU, gloo); must divide the attention heads")
    pipeline_parallel_size: int = _arg(1, "1 only")
    data_parallel_size: int = _arg(1, "engine-core processes, each a whole replica with its own KV cache and a share of the threads (the multiprocess transport)")
    data_parallel_rank: int | None = _arg(None, "external load balancing: this server runs data parallel rank k of data_parallel_size only (one server per rank, your balancer in front)")
    data_parallel_external_lb: bool = _arg(False, "one server per data parallel rank (set by data_parallel_rank)")
    data_parallel_backend: str = _arg("mp", "where the data parallel engine cores run: 'mp' (child processes of this server) or 'ray' (Ray actors, one placement group per rank; needs triollm[ray])", choices=DP_BACKENDS)
    data_parallel_address: str | None = _arg(None, "with the Ray backend: the address of this node the engine cores connect back to (default: Ray's address of this node)")
    data_parallel_rpc_port: int | None = _arg(None, "accepted, ignored (dense models need no data parallel coordinator)")
    distributed_executor_backend: str | None = _arg(None, "accepted, ignored")
    disable_custom_all_reduce: bool = _arg(False, "accepted, ignored")
    # --- KV cache
    block_size: int = _arg(16, "tokens per KV block", choices=BLOCK_SIZES)
    enable_prefix_caching: bool = _arg(True, "reuse the KV blocks of shared prompt prefixes")
    gpu_memory_utilization: float = _arg(0.9, "CUDA: the fraction of GPU memory for weights and KV cache")
    kv_cache_memory_bytes: int | None = _arg(None, "the KV cache size (default: from free memory)")
    num_gpu_blocks_override: int | None = _arg(None, "the number of KV blocks (overrides the sizing)")
    swap_space: float | None = _arg(None, "deprecated and ignored (preempted requests are recomputed)")
    cpu_offload_gb: float = _arg(0, "accepted, ignored")
    disable_cascade_attn: bool = _arg(False, "accepted, ignored (no cascade attention)")
    # --- scheduling
    max_num_seqs: int = _arg(128, "the most requests in one batch")
    max_num_batched_tokens: int | None = _arg(None, "tokens per step (default: 2048, or max_model_len without chunked prefill)")
    enable_chunked_prefill: bool = _arg(True, "split long prompts across steps")
    long_prefill_token_threshold: int = _arg(0, "with chunked prefill, the most prompt tokens one request takes per step (0: no limit); smaller values keep running decodes' step time steady")
    async_scheduling: bool = _arg(False, "accepted, ignored (one scheduler in the engine core)")
    enable_expert_parallel: bool = _arg(False, "accepted, ignored (no expert-parallel mode)")
    limit_mm_per_prompt: dict[str, Any] | None = _arg(None, "accepted, ignored (text only)")
    scheduler_prefill_budget: str = _arg("auto", "with chunked prefill: auto (while requests decode, a step takes only the prompt tokens that keep it within ~1.5x a decode-only step's measured time, at least 32 per step; the whole max_num_batched_tokens when nothing decodes) or off (prompts take the whole budget: higher p99 inter-token latency, lower time to first token)", choices=PREFILL_BUDGETS)
    scheduling_policy: str = _arg("fcfs", "fcfs (first come, first served; a request's priority must be 0) or priority (a lower priority value is scheduled first, ties by arrival)", choices=SCHEDULING_POLICIES)
    # --- execution
    enable_lora: bool = _arg(False, "serve LoRA adapters (PEFT checkpoints) on the base model: lora_request= per request, --lora-modules on the server")
    max_loras: int = _arg(1, "the most distinct LoRA adapters in one batch")
    max_lora_rank: int = _arg(16, "the largest LoRA rank r an adapter may have", choices=LORA_RANKS)
    max_cpu_loras: int | None = _arg(None, "LoRA adapters kept loaded in memory, least recently used dropped first (default: max_loras); at least max_loras")
    lora_dtype: str = _arg("auto", "the LoRA weights' dtype (auto: the model's; bfloat16 over quantized weights)", choices=LORA_DTYPES)
    # --- speculative decoding
    speculative_config: dict[str, Any] | None = _arg(
        None,
        'speculative decoding, vLLM\'s keys as a JSON object: {"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_min": 2, "prompt_lookup_max": 4} (prompt lookup), {"model": PATH, "num_speculative_tokens": 4} '
        '(a draft model with the same tokenizer), or {"method": "draft_model", "quantization": "gguf"|"int4"|"int8", '
        '"num_speculative_tokens": 4} with no model (a self-draft: this checkpoint under a cheaper quantization); '
        f'optional "disable_by_batch_size": N (no speculation while N or more requests decode; default {SPEC_DISABLE_BY_BATCH_SIZE}, null: never off)',
    )
    runner: str = _arg("auto", "auto (from the architecture: *ForCausalLM generate, encoder-only models such as BertModel are pooled into embeddings), generate or pooling", choices=RUNNERS)
    device: str = _arg("auto", "auto (cuda if available), cpu or cuda", choices=("auto", "cpu", "cuda"))
    num_threads: int | None = _arg(None, "torch threads in the engine core (default: every core for the offline LLM; for AsyncLLM and the server every core up to 4, one fewer above)")
    enforce_eager: bool = _arg(False, "CUDA: run every step eagerly (otherwise decode steps replay CUDA graphs captured per batch size)")
    max_seq_len_to_capture: int = _arg(8192, "accepted, ignored (graphs are captured per batch size, for every length)")
    compilation_config: CompilationConfig | int | dict[str, Any] | None = _arg(None, "an int level or a JSON object")
    disable_log_stats: bool = _arg(False, "accepted (no periodic stats are logged)")
    allowed_local_media_path: str = _arg("", "accepted, ignored (text only)")
    renderer_num_workers: int = _arg(1, "accepted, ignored (no renderer pool)")
    kv_transfer_config: dict[str, Any] | None = _arg(None, "not supported (no KV transfer)")
    cache_dir: str | None = _arg(None, "where imported .gguf models are cached (default: $TRIOLLM_CACHE_DIR, else ~/.cache/triollm)")
    # --- the actor layer (AsyncLLM / LLM)
    multiprocess: bool | None = _arg(None, f"the engine core in a child process (default: ${MULTIPROCESS_ENV}, else true)")
    output_chunk_size: int = _arg(128, "RequestOutputs built per chunk before yielding to the event loop")
    zmq_address: str = _arg("ipc", "'ipc' (a socket file in a private temp dir) or 'tcp://HOST' (ports chosen freely; CURVE-encrypted, and only the engine's own child may connect)")
    zmq_insecure_tcp: bool = _arg(False, "explicit opt-in to PLAIN tcp for a tcp:// zmq_address: no CURVE, so the engine core's link is unauthenticated and unencrypted (anyone who reaches its ports can send it requests and read its outputs); needed only where libzmq lacks CURVE; no effect on ipc")
    engine_output_timeout_s: float | None = _arg(60.0, "with work pending, seconds without any output from the engine core before it is declared dead (hung)")
    # --- request limits and backpressure (a request over a limit fails alone: HTTP 400 / 429)
    max_num_queued_reqs: int | None = _arg(4096, "the most unfinished sequences (an n > 1 request counts n) beyond max_num_seqs; more are refused (HTTP 429); offline LLM batches wait instead (None: no limit)")
    max_num_queued_tokens: int | None = _arg(1 << 20, "the most prompt tokens (counted once per sequence) waiting for the scheduler; more are refused (HTTP 429); offline LLM batches wait instead (None: no limit)")
    max_request_tokens: int = _arg(1 << 20, "the most tokens one request may hold: its sequences (n) x (prompt tokens + stop_token_ids, allowed_token_ids, logit_bias and bad_words entries); more is refused (HTTP 400)")
    max_stop_strings: int = _arg(64, "the most `stop` strings per request")
    max_stop_string_len: int = _arg(1024, "the longest `stop` string, in characters")
    max_token_list_len: int = _arg(8192, "the most entries in stop_token_ids, allowed_token_ids, bad_words or logit_bias")
    max_prompts_per_request: int = _arg(1024, "the most prompts in one /v1/completions request")
    max_n: int = _arg(128, "the largest `n` (parallel samples per request)")

    def __post_init__(self) -> None:
        # Normalised once, here: every way of building EngineArgs sees the same values.
        self.compilation_config = CompilationConfig.coerce(self.compilation_config)
        if self.max_model_len == -1:  # vLLM's "auto" (`--max-model-len auto`): the model's own
            self.max_model_len = None
        check_generation_config(self.generation_config, self.override_generation_config)
        self.dtype = _canonical_dtype(self.dtype)
        if self.swap_space is not None:
            self.swap_space = None
            warnings.warn(
                "swap_space is deprecated and ignored (preempted requests are recomputed)",
                DeprecationWarning,
                stacklevel=3,
            )
        if self.kv_transfer_config is not None:
            raise ValueError(
                "Invalid 'kv_transfer_config' provided: triollm has no KV transfer "
                "(disaggregated prefill, KV connectors); remove kv_transfer_config"
            )
        _one_of("runner", self.runner, RUNNERS)
        _one_of("load_format", self.load_format, LOAD_FORMATS)
        _one_of("tokenizer_mode", self.tokenizer_mode, TOKENIZER_MODES, "only fast tokenizers (tokenizer.json) are supported")
        _one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES, "no fp8 KV cache")
        if self.quantization is not None:
            _one_of(
                "quantization", self.quantization, QUANTIZATIONS,
                "weight-only CPU kernels: gguf keeps a .gguf model's blocks as shipped; gptq, awq, fp8 and "
                "compressed-tensors read a checkpoint's quantization_config",
            )  # fmt: skip
        _positive("data_parallel_size", self.data_parallel_size)
        _positive("tensor_parallel_size", self.tensor_parallel_size)
        self._check_data_parallel()
        if self.pipeline_parallel_size != 1:
            raise ValueError(f"pipeline_parallel_size: {self.pipeline_parallel_size} is not supported (1 only)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )

    def _check_data_parallel(self) -> None:
        _one_of("data_parallel_backend", self.data_parallel_backend, DP_BACKENDS)
        rank, size = self.data_parallel_rank, self.data_parallel_size
        if rank is not None:
            if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(
                    f"data_parallel_rank: {rank!r} is not a rank of data_parallel_size={size}; "
                    f"allowed: 0 to {size - 1}"
                )
            self.data_parallel_external_lb = True  # as vLLM: a rank given means one server per rank
        elif self.data_parallel_external_lb:
            raise ValueError(
                "data_parallel_external_lb: one server per rank needs this server's rank; "
                f"set data_parallel_rank (0 to {size - 1})"
            )
        if self.data_parallel_external_lb and self.data_parallel_backend != "mp":
            raise ValueError(
                f"data_parallel_backend: {self.data_parallel_backend!r} places every rank from one "
                "server; with external load balancing (data_parallel_rank) each server runs its own "
                "rank: allowed: 'mp'"
            )

    def create_engine_config(self) -> EngineConfig:
        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        _one_of("device", device, ("auto", "cpu", "cuda"))
        _positive("max_num_seqs", self.max_num_seqs)
        _one_of("block_size", self.block_size, BLOCK_SIZES)
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if not isinstance(self.long_prefill_token_threshold, int) or self.long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold: must be a non-negative integer (0: no limit), "
                f"got {self.long_prefill_token_threshold!r}"
            )
        _one_of("scheduler_prefill_budget", self.scheduler_prefill_budget, PREFILL_BUDGETS)
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy: must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        if self.num_gpu_blocks_override is not None:
            _positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        _positive("output_chunk_size", self.output_chunk_size)
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        for name in ("max_stop_strings", "max_stop_string_len", "max_token_list_len", "max_prompts_per_request", "max_n", "max_request_tokens"):
            _positive(name, getattr(self, name))
        multiprocess = _multiprocess(self.multiprocess)
        # External load balancing: this server runs one rank, alone (its share of the threads).
        local_ranks = 1 if self.data_parallel_external_lb else self.data_parallel_size
        if (local_ranks > 1 or self.data_parallel_backend == "ray") and not multiprocess:
            what = f"data_parallel_size: {self.data_parallel_size}" if local_ranks > 1 else "data_parallel_backend: 'ray'"
            raise ValueError(
                f"{what} needs an engine-core process per rank, but multiprocess is off "
                "(multiprocess=False or $TRIOLLM_MULTIPROCESS=0); allowed with it off: "
                "data_parallel_size=1 and data_parallel_backend='mp'"
            )
        if self.data_parallel_address is not None and self.data_parallel_backend != "ray":
            raise ValueError(
                "data_parallel_address: only the Ray backend connects engine cores back over the "
                "network; allowed with data_parallel_backend='mp': None"
            )
        timeout = self.engine_output_timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0):
            raise ValueError(f"engine_output_timeout_s: must be a positive number of seconds or None, got {timeout!r}")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs: must be an integer >= -1, got {self.max_logprobs!r}")
        if self.zmq_address != "ipc" and not self.zmq_address.startswith("tcp://"):
            raise ValueError(f"zmq_address: {self.zmq_address!r} is not 'ipc' or 'tcp://HOST'")
        if not isinstance(self.zmq_insecure_tcp, bool):  # "0" would be truthy: no guessing
            raise ValueError(f"zmq_insecure_tcp: must be True or False, got {self.zmq_insecure_tcp!r}")
        cache_dir = Path(self.cache_dir) if self.cache_dir else None
        if self.load_format == "gguf" and not (self.model or "").lower().endswith(".gguf"):
            raise ValueError(f"load_format: 'gguf' needs a .gguf model file, got model={self.model!r}")
        path = resolve_model(self.model, cache_dir, revision=self.revision, download_dir=self.download_dir, token=self.hf_token)
        model = ModelConfig.from_pretrained(
            path, str(self.dtype), self.max_model_len, device, self.runner,
            generation_config=self.generation_config,
            override_generation_config=self.override_generation_config,
        )
        quantization = self._quantization(model, device)
        if quantization is not None:
            self._check_quantization(quantization, model, device)
            model = dataclasses.replace(model, quantization=quantization)
        model = dataclasses.replace(model, kv_cache_dtype=self._kv_cache_dtype(model, device))
        if model.runner_type == "pooling":
            _check_pooling(self, model)
        if self.tensor_parallel_size > 1:
            if device != "cpu":
                raise ValueError(f"tensor_parallel_size: {self.tensor_parallel_size} runs on device='cpu' only (gloo)")
            check_tensor_parallel(self.tensor_parallel_size, model.num_heads, model.num_kv_heads, model.intermediate_size)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, model.max_model_len)
        _positive("max_num_batched_tokens", budget)
        if not self.enable_chunked_prefill and budget < model.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens: {budget} is smaller than max_model_len "
                f"({model.max_model_len}) with chunked prefill disabled; raise it or enable chunked prefill"
            )
        ignored = self._ignored_args(device)
        _warn_ignored(self, ignored)
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_kv_blocks=self.num_gpu_blocks_override,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                prefill_budget=self.scheduler_prefill_budget,
                max_loras=self.max_loras if self.enable_lora else 0,
            ),
            device=device,
            seed=self.seed,
            num_threads=self.num_threads,
            tokenizer=self._resolve_tokenizer(path, cache_dir),
            actor=ActorConfig(
                multiprocess=multiprocess,
                output_chunk_size=self.output_chunk_size,
                zmq_address=self.zmq_address,
                zmq_insecure_tcp=self.zmq_insecure_tcp,
                max_logprobs=self.max_logprobs,
                engine_output_timeout_s=None if timeout is None else float(timeout),
                data_parallel_size=local_ranks,
                data_parallel_rank=self.data_parallel_rank or 0,
                data_parallel_world=self.data_parallel_size,
                data_parallel_backend=self.data_parallel_backend,
                data_parallel_address=self.data_parallel_address,
            ),
            limits=LimitsConfig(
                max_num_queued_reqs=self.max_num_queued_reqs,
                max_num_queued_tokens=self.max_num_queued_tokens,
                max_request_tokens=self.max_request_tokens,
                max_stop_strings=self.max_stop_strings,
                max_stop_string_len=self.max_stop_string_len,
                max_token_list_len=self.max_token_list_len,
                max_prompts_per_request=self.max_prompts_per_request,
                max_n=self.max_n,
            ),
            ignored_args=ignored,
            tensor_parallel_size=self.tensor_parallel_size,
            cuda_graph_sizes=self._cuda_graph_sizes(device),
            lora=self._lora(model),
            speculative=self._speculative(model, device, cache_dir),
        )

    def _lora(self, model: ModelConfig) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        if model.runner_type == "pooling":
            raise ValueError("enable_lora: LoRA adapters apply to generating models; this one is a pooling model")
        _positive("max_loras", self.max_loras)
        _one_of("max_lora_rank", self.max_lora_rank, LORA_RANKS)
        _one_of("lora_dtype", self.lora_dtype, LORA_DTYPES)
        cpu = self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
        if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras: must be an integer >= max_loras ({self.max_loras}), got {self.max_cpu_loras!r}")
        dtype = self.lora_dtype
        if dtype == "auto":
            # The model's, except over quantized weights: there the base is approximate already,
            # and bf16 slots halve the adapter bytes each decode step reads (docs/lora.md).
            dtype = "bfloat16" if model.quantization is not None else str(model.dtype).removeprefix("torch.")
        return LoRAConfig(self.max_loras, self.max_lora_rank, cpu, dtype)

    def _speculative(self, model: ModelConfig, device: str, cache_dir: Path | None) -> SpeculativeConfig | None:
        """`speculative_config` checked and resolved (the draft model's config loaded); every
        error is a ValueError naming the key and what it allows."""
        spec = self.speculative_config
        if spec is None:
            return None
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config: expected a JSON object (a dict), got {type(spec).__name__}")
        unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; allowed: {', '.join(SPECULATIVE_KEYS)}")
        if model.runner_type != "generate":
            raise ValueError("speculative_config: speculative decoding applies to generative models; this one is a pooling model")
        method = spec.get("method")
        if method in ("[ngram]", None) and spec.get("model") in ("ngram", "[ngram]"):
            method = "ngram"  # vLLM's older spelling: model "[ngram]"
        elif method is None:
            method = "draft_model" if "model" in spec or "quantization" in spec else None
        if method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method: {method!r} is not supported; allowed: {', '.join(SPECULATIVE_METHODS)} "
                "(EAGLE, Medusa and MTP heads are not implemented)"
            )
        k = spec.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
            raise ValueError(f"speculative_config.num_speculative_tokens: must be a positive integer, got {k!r}")
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens: {k} is more than {MAX_SPECULATIVE_TOKENS}")
        # vLLM's key; unset, speculation stops at SPEC_DISABLE_BY_BATCH_SIZE decoding requests
        # (measured: docs/speculative.md); an explicit None speculates at every batch size.
        disable = spec.get("disable_by_batch_size", SPEC_DISABLE_BY_BATCH_SIZE)
        if disable is not None:
            _positive("speculative_config.disable_by_batch_size", disable)
        tp = spec.get("draft_tensor_parallel_size", 1)
        if tp != 1:
            raise ValueError(f"speculative_config.draft_tensor_parallel_size: {tp!r} is not supported; allowed: 1")
        if method == "ngram":
            for key in ("model", "quantization"):
                if spec.get(key) is not None and spec.get(key) not in ("ngram", "[ngram]"):
                    raise ValueError(f"speculative_config.{key}: the ngram method uses no draft model; remove {key}")
            lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo = hi = 5  # vLLM's defaults
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            assert lo is not None and hi is not None
            _positive("speculative_config.prompt_lookup_min", lo)
            _positive("speculative_config.prompt_lookup_max", hi)
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min: {lo} is more than prompt_lookup_max ({hi})")
            return SpeculativeConfig("ngram", k, lo, hi, disable_by_batch_size=disable)
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if spec.get(key) is not None:
                raise ValueError(f"speculative_config.{key}: applies to the ngram method only; remove {key}")
        return SpeculativeConfig("draft_model", k, draft=self._draft_model(spec, model, device, cache_dir), disable_by_batch_size=disable)

    def _draft_model(self, spec: dict[str, Any], target: ModelConfig, device: str, cache_dir: Path | None) -> ModelConfig:
        """The draft's config: `model` (another checkpoint with the target's vocabulary) or, with
        no model, the target's own checkpoint (a self-draft) under `quantization`."""
        if self.tensor_parallel_size > 1:
            raise ValueError("speculative_config: a draft model runs with tensor_parallel_size=1 only; use the ngram method")
        quant = spec.get("quantization")
        if quant is not None:
            _one_of("speculative_config.quantization", quant, QUANTIZATIONS)
        own = spec.get("model") in (None, self.model)
        if own and quant is None:
            raise ValueError(
                "speculative_config.quantization: a self-draft (no draft model given) is this checkpoint under a "
                "cheaper quantization; allowed: gguf (a .gguf model's blocks), int4, int8"
            )
        draft_args = dataclasses.replace(
            self, model=self.model if own else spec["model"], quantization=quant, speculative_config=None,
            revision=spec.get("revision", self.revision if own else None),
        )
        path = resolve_model(draft_args.model, cache_dir, revision=draft_args.revision, download_dir=self.download_dir, token=self.hf_token)
        draft = ModelConfig.from_pretrained(path, str(self.dtype), target.max_model_len, device, "generate")
        scheme = draft_args._quantization(draft, device)
        if scheme is not None:
            draft_args._check_quantization(scheme, draft, device)
            draft = dataclasses.replace(draft, quantization=scheme)
        if own and scheme == target.quantization:
            raise ValueError(
                f"speculative_config.quantization: {quant!r} is the target's own scheme, so the draft would be the "
                "target itself; choose a cheaper one (gguf, int4, int8) than the target's"
            )
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary ({draft.vocab_size} tokens, {path}) is not the "
                f"target's ({target.vocab_size}); a draft model must share the target's tokenizer"
            )
        if draft.max_model_len < target.max_model_len:
            raise ValueError(
                f"speculative_config.model: the draft holds {draft.max_model_len} positions, fewer than the target's "
                f"max_model_len ({target.max_model_len}); lower max_model_len"
            )
        return dataclasses.replace(draft, kv_cache_dtype=draft_args._kv_cache_dtype(draft, device))

    def _quantization(self, model: ModelConfig, device: str) -> str | None:
        """The scheme to run: the one asked for ("none": dense), or by default a .gguf model's
        blocks as shipped where that is the fast path (docs/benchmarks.md, issue 13): on a CPU
        with a vector path for the quantized kernels (AVX2 or AVX-512 VNNI) and the
        native kernels, one rank, dtype auto, a generative model."""
        from triollm.engine.loading.model_config import QUANTIZED_FILE
        from triollm.kernels import cpu_native

        if self.quantization is not None:
            return None if self.quantization == "none" else ALIASES.get(self.quantization, self.quantization)
        if model.checkpoint_quant is not None:  # a quantized checkpoint runs by its own method, as in vLLM
            return model.checkpoint_quant.method
        gguf = self.model is None or self.model.lower().endswith(".gguf")
        fast = (
            gguf
            and device == "cpu"
            and str(self.dtype) == "auto"
            and self.tensor_parallel_size == 1
            and model.runner_type == "generate"
            and (model.path / QUANTIZED_FILE).is_file()
            and cpu_native.has_fast_quant()
            and os.environ.get(cpu_native.CPU_KERNELS_ENV, "1") != "0"
        )
        return "gguf" if fast else None

    def _kv_cache_dtype(self, model: ModelConfig, device: str) -> torch.dtype | None:
        """The KV cache's dtype where it is not the activations' (ModelConfig.kv_cache_dtype).
        By default a quantized model's fp32 activations get a bf16 cache: at 64 requests the
        decode attention reads more bytes of KV cache than of weights, and bf16 halves them
        (docs/benchmarks.md, issue 13); batch-1 tokens barely read it. Elsewhere the cache has
        the activations' dtype, as in vLLM."""
        want = {"auto": None, "bfloat16": torch.bfloat16, "float32": torch.float32}[self.kv_cache_dtype]
        if want is None:
            want = torch.bfloat16 if model.quantization is not None and model.dtype == torch.float32 else model.dtype
        if want == model.dtype:
            return None
        if not (want == torch.bfloat16 and model.dtype == torch.float32 and device == "cpu"):
            raise ValueError(
                f"kv_cache_dtype: {self.kv_cache_dtype!r} under {str(model.dtype).removeprefix('torch.')} activations "
                f"on {device!r} is not supported; allowed: auto, or bfloat16 under float32 activations on the CPU"
            )
        return want

    def _check_quantization(self, quantization: str, model: ModelConfig, device: str) -> None:
        from triollm.engine.loading.model_config import QUANTIZED_FILE

        if device != "cpu":
            raise ValueError(f"quantization: {quantization!r} runs on the CPU only (device {device!r}); use quantization='none'")
        if model.runner_type != "generate":
            raise ValueError(f"quantization: {quantization!r} applies to generative models; use quantization='none'")
        if self.tensor_parallel_size > 1:
            raise ValueError(f"quantization: {quantization!r} does not shard yet; use tensor_parallel_size=1 or quantization='none'")
        if quantization in METHODS:
            theirs = None if model.checkpoint_quant is None else model.checkpoint_quant.method
            if theirs is None:
                raise ValueError(
                    f"quantization: {quantization!r} reads a checkpoint's quantization_config, and {model.path} has none; "
                    "use int8 or int4 to quantize float weights"
                )
            if quantization != theirs:
                raise ValueError(
                    f"quantization: {quantization!r} does not match the checkpoint's quantization_config.quant_method "
                    f"{theirs!r}; use {theirs} (or none: dequantized to dense)"
                )
        if quantization == "gguf" and not (model.path / QUANTIZED_FILE).is_file():
            raise ValueError(
                f"quantization: 'gguf' keeps a .gguf model's blocks as shipped, and {model.path} is no .gguf import "
                "(or one without tensors in a kept block type: Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K); use int8 or int4 to quantize float weights"
            )

    def _cuda_graph_sizes(self, device: str) -> tuple[int, ...]:
        cc = self.compilation_config
        assert isinstance(cc, CompilationConfig)  # coerced in __post_init__
        if device != "cuda" or self.enforce_eager or not cc.use_cudagraph or self.tensor_parallel_size > 1:
            return ()
        if cc.cudagraph_capture_sizes:
            for size in cc.cudagraph_capture_sizes:
                _positive("compilation_config.cudagraph_capture_sizes", size)
            return tuple(sorted(set(cc.cudagraph_capture_sizes)))
        from triollm.engine.execution.cuda_graphs import default_capture_sizes

        return default_capture_sizes(self.max_num_seqs)

    def _ignored_args(self, device: str) -> tuple[str, ...]:
        """The fields set to a non-default value that have no effect on `device`."""
        defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
        names = [name for name in IGNORED_ARGS if getattr(self, name) != defaults[name]]
        if device != "cuda" and self.gpu_memory_utilization != defaults["gpu_memory_utilization"]:
            names.append("gpu_memory_utilization")
        if self.tokenizer_mode == "slow":
            names.append("tokenizer_mode")
        hub_model, hub_tokenizer = is_hub_id(self.model), is_hub_id(self.tokenizer)
        hub_used = {
            "revision": hub_model,
            "tokenizer_revision": hub_tokenizer or (hub_model and not self.tokenizer),
            "download_dir": hub_model or hub_tokenizer,
            "hf_token": hub_model or hub_tokenizer,
        }
        names += [name for name, used in hub_used.items() if not used and getattr(self, name) is not None]
        return tuple(names)

    def _resolve_tokenizer(self, model_path: Path, cache_dir: Path | None) -> Path:
        """The tokenizer directory: the model's, or `tokenizer` (a directory, .gguf file or Hub id)."""
        repo = self.tokenizer or (self.model if self.tokenizer_revision is not None else None)
        if repo is not None and is_hub_id(repo):
            return resolve_hub(
                repo, "tokenizer", revision=self.tokenizer_revision, download_dir=self.download_dir,
                token=self.hf_token, files="tokenizer",
            )
        return _local_tokenizer(self.tokenizer, cache_dir) if self.tokenizer else model_path

    # ------------------------------------------------------------------ the CLI

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def add_cli_args(
        cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, skip: Sequence[str] = ()
    ) -> argparse.ArgumentParser | argparse._ArgumentGroup:
        """One flag per field (`--max-model-len` for `max_model_len`): the CLI shares the schema.

        Takes a parser (the flags go into an "engine" group) or, as vLLM's examples pass it,
        an argument group; returns what it was given."""
        group = parser.add_argument_group("engine") if isinstance(parser, argparse.ArgumentParser) else parser
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            meta = f.metadata
            help = f"{meta.get('help', '')} (default: %(default)s)".lstrip()
            type_name = str(f.type).split("|")[0].strip()
            if type_name == "bool":
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help)
                continue
            kind = human_readable_int if f.name in HUMAN_INT_FIELDS else _CLI_TYPES.get(type_name, _json_value)
            if f.name == "max_model_len":
                kind = _human_int_or_auto
            options: dict[str, Any] = {"type": kind, "default": f.default, "help": help}
            if meta.get("choices") is not None:
                options["choices"] = meta["choices"]
            if meta.get("nargs") is not None:
                options["nargs"] = meta["nargs"]
            short = _SHORT_FLAGS.get(f.name)  # vLLM's
            group.add_argument(flag, *([short] if short else []), **options)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = set(cls.field_names())
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def _check_pooling(args: EngineArgs, model: ModelConfig) -> None:
    """A pooling model runs whole prompts on one rank, one step each (engine/pooling_core.py)."""
    if args.tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size: {args.tensor_parallel_size} is not supported for pooling models (allowed: 1)")
    budget = args.max_num_batched_tokens
    if budget is not None and budget < model.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens: {budget} is smaller than max_model_len ({model.max_model_len}); "
            "a pooling model encodes each prompt whole in one step"
        )


def _canonical_dtype(value: object) -> str:
    """vLLM's dtype spellings (and a `torch.dtype`) -> auto, float16, bfloat16 or float32."""
    if isinstance(value, torch.dtype):
        if value not in _TORCH_DTYPES:
            raise ValueError(f"dtype: {value} is not one of torch.float16, torch.bfloat16, torch.float32")
        return _TORCH_DTYPES[value]
    if not isinstance(value, str) or value.lower() not in DTYPES:
        raise ValueError(f"dtype: {value!r} is not one of {', '.join(DTYPES)} (or a torch.dtype)")
    name = value.lower()
    return _DTYPE_NAMES.get(name, name)


def _local_tokenizer(tokenizer: str, cache_dir: Path | None) -> Path:
    path = Path(tokenizer).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return resolve_model(str(path), cache_dir)  # its tokenizer is rebuilt on import
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"tokenizer: {tokenizer} is not a directory holding tokenizer.json, a .gguf file or a Hub repo id; "
            "only fast tokenizers are supported"
        )
    return path


def _multiprocess(value: bool | None) -> bool:
    """The flag, else $TRIOLLM_MULTIPROCESS (0/1), else True."""
    if value is not None:
        return value
    env = os.environ.get(MULTIPROCESS_ENV, "")
    if env == "":
        return True
    if env not in ("0", "1"):
        raise ValueError(f"{MULTIPROCESS_ENV}: {env!r} is not 0 or 1")
    return env == "1"


def _warn_ignored(args: EngineArgs, names: Sequence[str]) -> None:
    for name in names:
        if name in _warned:
            continue
        _warned.add(name)
        reason = IGNORED_ARGS.get(name) or _SOMETIMES_IGNORED[name]
        log.warning("%s=%r has no effect in triollm and is ignored: %s", name, getattr(args, name), reason)


def _json_value(text: str) -> object:
    """A flag holding a structured value: an int, or a JSON object (e.g. compilation config)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected an int or a JSON object, got {text!r}") from exc


_CLI_TYPES = {"int": int, "float": float, "str": str}

# Token and byte counts whose flags take vLLM's human-readable sizes (`human_readable_int`): vLLM
# applies it to these three; the last two are triollm's own token counts.
HUMAN_INT_FIELDS = (
    "max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes",
    "max_num_queued_tokens", "max_request_tokens",
)
_DECIMAL_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY_SUFFIXES = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT])")


def human_readable_int(text: str) -> int:
    """vLLM's sizes: `4096`, `4k` (4000), `4K` (4096), `1.5k` (1500), `1M` (1048576); lowercase
    suffixes k/m/g/t are decimal and may carry a fraction, uppercase K/M/G/T are binary (whole
    numbers only)."""
    value = text.strip()
    match = _HUMAN_INT.fullmatch(value)
    if match is None:
        try:
            return int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an integer or a size such as 4096, 4k (4000), 1.5k or 4K (4096)"
            ) from None
    number, suffix = match.groups()
    if suffix in _DECIMAL_SUFFIXES:
        return int(float(number) * _DECIMAL_SUFFIXES[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"{text!r}: decimals are not allowed with the binary suffix {suffix} "
            f"(did you mean {number}{suffix.lower()}?)"
        )
    return int(number) * _BINARY_SUFFIXES[suffix]


def _human_int_or_auto(text: str) -> int:
    """`--max-model-len`: a size, or -1 / auto (the model's own length), as vLLM."""
    return -1 if text.strip().lower() in ("auto", "-1") else human_readable_int(text)


def _one_of(name: str, value: object, allowed: Sequence[object], hint: str = "") -> None:
    if value not in allowed:
        listed = ", ".join(str(a) for a in allowed)
        raise ValueError(f"{name}: {value!r} is not supported; allowed: {listed}" + (f" ({hint})" if hint else ""))


_SHORT_FLAGS = {  # vLLM's
    "tensor_parallel_size": "-tp",
    "data_parallel_size": "-dp",
    "data_parallel_rank": "-dpn",
    "data_parallel_backend": "-dpb",
    "data_parallel_address": "-dpa",
    "data_parallel_rpc_port": "-dpp",
}


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
