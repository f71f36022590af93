"""`EngineArgs`: every user-settable engine knob, flat, with vLLM's names.

`LLM(**kwargs)`, `EngineArgs(**kwargs)` and the CLI flags (one per field: `cli.py`) accept the
same names with the same meaning. `__post_init__` normalises once, so every way of building
`EngineArgs` sees the same values (dtype aliases, an int or dict `compilation_config`,
`max_model_len=-1`, the deprecated `swap_space`), and refuses what needs no model to refuse;
`create_engine_config()` resolves the rest (`create.py`) into the frozen `EngineConfig`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from triollm.engine.config import create
from triollm.engine.config.cache import BLOCK_SIZES, check_gpu_memory_utilization
from triollm.engine.config.checks import one_of
from triollm.engine.config.cli import add_flags, arg
from triollm.engine.config.compilation import CompilationConfig, cuda_graph_sizes
from triollm.engine.config.engine_config import EngineConfig
from triollm.engine.config.ignored import ignored_args
from triollm.engine.config.lora import LORA_DTYPES, LORA_RANKS
from triollm.engine.config.model import (
    CONVERTS,
    DEVICES,
    DTYPES,
    LOAD_FORMATS,
    MODEL_IMPLS,
    RUNNERS,
    TOKENIZER_MODES,
    canonical_dtype,
    check_hf_overrides,
)
from triollm.engine.config.parallel import DP_BACKENDS, check_parallel
from triollm.engine.config.quantization import KV_CACHE_DTYPES, QUANTIZATIONS
from triollm.engine.config.scheduler import PREFILL_BUDGETS, SCHEDULING_POLICIES
from triollm.engine.config.speculative import SPEC_DISABLE_BY_BATCH_SIZE
from triollm.engine.envs import MULTIPROCESS_ENV
from triollm.engine.loading.model_config import check_generation_config

__all__ = ["EngineArgs"]

_SPECULATIVE_HELP = (
    'speculative decoding, vLLM\'s keys as a JSON object: {"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4} (prompt '
    'lookup), {"model": PATH, "num_speculative_tokens": 4} (a draft model with the same '
    'tokenizer), or {"method": "draft_model", "quantization": "gguf"|"int4"|"int8", '
    '"num_speculative_tokens": 4} with no model (a self-draft: this checkpoint under a cheaper '
    'quantization); optional "disable_by_batch_size": N (no speculation while N or more requests '
    f"decode; default {SPEC_DISABLE_BY_BATCH_SIZE}, null: never off)"
)
_QUANTIZATION_HINT = (
    "weight-only CPU kernels: gguf keeps a .gguf model's blocks as shipped; gptq, awq, fp8 and "
    "compressed-tensors read a checkpoint's quantization_config"
)


@dataclass
class EngineArgs:
    """Every user-settable engine knob, with vLLM's names. `create_engine_config()` validates."""

    # --- model and tokenizer
    model: str | None = arg(
        None, "a local Hugging Face directory, a .gguf file, or a Hugging Face Hub repo id "
        "(owner/name: the HF cache, else downloaded unless HF_HUB_OFFLINE is set) (default: the "
        "bundled SmolLM2-135M-Instruct)")
    served_model_name: str | list[str] | None = arg(
        None, "names clients use in `model` (default: the model argument)", nargs="+")
    tokenizer: str | None = arg(
        None, "a tokenizer directory, .gguf file or Hub repo id other than the model's")
    tokenizer_mode: str = arg(
        "auto", "fast tokenizers only: 'slow' loads the fast one", choices=TOKENIZER_MODES)
    skip_tokenizer_init: bool = arg(False, "accepted, ignored")
    trust_remote_code: bool = arg(False, "accepted, ignored (no checkpoint code runs)")
    revision: str | None = arg(None, "a Hub model's branch, tag or commit hash (default: main)")
    tokenizer_revision: str | None = arg(
        None, "a Hub tokenizer's branch, tag or commit hash (default: main; with tokenizer unset, "
        "the model repo's tokenizer at this revision)")
    download_dir: str | None = arg(
        None, "the Hugging Face cache for Hub repo ids, read and downloaded into (default: "
        "huggingface_hub's, $HF_HUB_CACHE or $HF_HOME/hub); .gguf imports go to --cache-dir")
    hf_token: str | None = arg(
        None, "the Hugging Face token for gated or private Hub repos (default: huggingface_hub's, "
        "$HF_TOKEN or the `hf auth login` one)")
    load_format: str = arg(
        "auto", "the weights' format (a .gguf model is imported once)", choices=LOAD_FORMATS)
    dtype: str | torch.dtype = arg(
        "auto", "weights and activations: auto (float32 on CPU), half, float16, bfloat16, float, "
        "float32", choices=DTYPES)
    kv_cache_dtype: str = arg(
        "auto", "the KV cache's dtype: auto (the model's; bfloat16 under a quantized model's "
        "float32 activations, as llama.cpp keeps f16), bfloat16, float32 (triollm's: the "
        "activations' float32), fp8 (= fp8_e4m3) or fp8_e5m2 (vLLM's: one scale per layer for K "
        "and for V), int8 (llama.cpp's q8_0, also accepted: int8 codes with a scale per token and "
        "kv head); fp8 and int8 hold twice bfloat16's tokens in the same memory",
        choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = arg(
        False, "fp8 KV cache: each layer's K and V scales from the first prompt the engine runs "
        "(vLLM's: |K| max / 200, |V| max / 100) instead of 1.0; ignored for other cache dtypes")
    quantization: str | None = arg(
        None, "weight-only quantized linear layers on CPU: gguf (a .gguf model's blocks as "
        "shipped), int8, int4, gptq, awq, fp8, compressed-tensors (a checkpoint's "
        "quantization_config: its own codes; gptq_marlin and awq_marlin are aliases), or none "
        "(dense; a quantized checkpoint dequantized); default: the method of a checkpoint with a "
        "quantization_config; gguf for a .gguf model (the bundled one included) on a CPU whose "
        "quantized kernels have a vector path (AVX2+FMA+F16C or AVX-512 VNNI), with dtype auto; "
        "dense otherwise", choices=QUANTIZATIONS)
    seed: int = arg(0, "the engine's random seed")
    max_model_len: int | None = arg(
        None, "context length, e.g. 4096, 4k (4000) or 4K (4096); -1 or auto: the model's "
        "(default: the model's)")
    max_logprobs: int = arg(20, "the most logprobs a request may ask for (-1: no limit)")
    generation_config: str = arg(
        "auto", "sampling defaults: auto (the model's generation_config.json), vllm (none: vLLM's "
        "and OpenAI's defaults) or a folder holding a generation_config.json")
    override_generation_config: dict[str, Any] | None = arg(
        None, 'a JSON object merged over those defaults, e.g. \'{"temperature": 0.5}\' (keys: '
        "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens)")
    hf_overrides: dict[str, Any] | None = arg(
        None, 'a JSON object merged into the checkpoint\'s config.json before it is read and '
        'checked, e.g. \'{"max_position_embeddings": 8192}\' (a nested object merges into the '
        "object of that key)")
    # --- parallelism
    tensor_parallel_size: int = arg(
        1, "processes the model is sharded over (CPU, gloo); must divide the attention heads")
    pipeline_parallel_size: int = arg(1, "1 only")
    data_parallel_size: int = arg(
        1, "engine-core processes, each a whole replica with its own KV cache and a share of the "
        "threads (the multiprocess transport)")
    data_parallel_rank: int | None = arg(
        None, "external load balancing: this server runs data parallel rank k of "
        "data_parallel_size only (one server per rank, your balancer in front)")
    data_parallel_external_lb: bool = arg(
        False, "one server per data parallel rank (set by data_parallel_rank)")
    data_parallel_backend: str = arg(
        "mp", "where the data parallel engine cores run: 'mp' (child processes of this server) or "
        "'ray' (Ray actors, one placement group per rank; needs triollm[ray])", choices=DP_BACKENDS)
    data_parallel_address: str | None = arg(
        None, "with the Ray backend: the address of this node the engine cores connect back to "
        "(default: Ray's address of this node)")
    data_parallel_rpc_port: int | None = arg(
        None, "accepted, ignored (dense models need no data parallel coordinator)")
    distributed_executor_backend: str | None = arg(None, "accepted, ignored")
    disable_custom_all_reduce: bool = arg(False, "accepted, ignored")
    # --- KV cache
    block_size: int = arg(16, "tokens per KV block", choices=BLOCK_SIZES)
    enable_prefix_caching: bool = arg(True, "reuse the KV blocks of shared prompt prefixes")
    gpu_memory_utilization: float = arg(
        0.9, "CUDA: the fraction of GPU memory for weights and KV cache")
    kv_cache_memory_bytes: int | None = arg(None, "the KV cache size (default: from free memory)")
    num_gpu_blocks_override: int | None = arg(
        None, "the number of KV blocks (overrides the sizing)")
    swap_space: float | None = arg(
        None, "deprecated and ignored (preempted requests are recomputed)")
    cpu_offload_gb: float = arg(0, "accepted, ignored")
    disable_cascade_attn: bool = arg(False, "accepted, ignored (no cascade attention)")
    # --- scheduling
    max_num_seqs: int = arg(128, "the most requests in one batch")
    max_num_batched_tokens: int | None = arg(
        None, "tokens per step (default: 2048, or max_model_len without chunked prefill)")
    enable_chunked_prefill: bool = arg(True, "split long prompts across steps")
    long_prefill_token_threshold: int = arg(
        0, "with chunked prefill, the most prompt tokens one request takes per step (0: no limit); "
        "smaller values keep running decodes' step time steady")
    async_scheduling: bool = arg(False, "accepted, ignored (one scheduler in the engine core)")
    enable_expert_parallel: bool = arg(False, "accepted, ignored (no expert-parallel mode)")
    limit_mm_per_prompt: dict[str, Any] | None = arg(
        None, 'images per prompt of a vision-language model, {"image": N} (default 8)')
    scheduler_prefill_budget: str = arg(
        "auto", "with chunked prefill: auto (while requests decode, a step takes only the prompt "
        "tokens that keep it within ~1.5x a decode-only step's measured time, at least 32 per "
        "step; decoding or not, no more than fit in ~4 s at the measured prefill pace, so a long "
        "prompt's step never grows with it) or off (prompts take the whole budget: higher p99 "
        "inter-token latency, lower time to first token)",
        choices=PREFILL_BUDGETS)
    scheduling_policy: str = arg(
        "fcfs", "fcfs (first come, first served; a request's priority must be 0) or priority (a "
        "lower priority value is scheduled first, ties by arrival)", choices=SCHEDULING_POLICIES)
    # --- execution
    enable_lora: bool = arg(
        False, "serve LoRA adapters (PEFT checkpoints) on the base model: lora_request= per "
        "request, --lora-modules on the server")
    max_loras: int = arg(1, "the most distinct LoRA adapters in one batch")
    max_lora_rank: int = arg(16, "the largest LoRA rank r an adapter may have", choices=LORA_RANKS)
    max_cpu_loras: int | None = arg(
        None, "LoRA adapters kept loaded in memory, least recently used dropped first (default: "
        "max_loras); at least max_loras")
    lora_dtype: str = arg(
        "auto", "the LoRA weights' dtype (auto: the model's; bfloat16 over quantized weights)",
        choices=LORA_DTYPES)
    # --- speculative decoding
    speculative_config: dict[str, Any] | None = arg(None, _SPECULATIVE_HELP)
    runner: str = arg(
        "auto", "auto (from the architecture: *ForCausalLM generate, encoder-only models such as "
        "BertModel are pooled into embeddings), generate or pooling", choices=RUNNERS)
    convert: str = arg(
        "auto", "serve a generative *ForCausalLM model as a pooling model: auto (embed on --runner pooling), "
        "none, embed (last token, normalised), classify (score head at the last token) or reward "
        "(per-token rewards)", choices=CONVERTS)
    model_impl: str = arg(
        "auto", "whose modeling code runs the model: auto (triollm's native class where there is one, "
        "else transformers' own through the Transformers backend), triollm or transformers (vllm: "
        "vLLM's name for triollm's own)", choices=(*MODEL_IMPLS, "vllm"))
    device: str = arg("auto", "auto (cuda if available), cpu or cuda", choices=DEVICES)
    num_threads: int | None = arg(
        None, "torch threads in the engine core (default: every core for the offline LLM; for "
        "AsyncLLM and the server every core up to 4, one fewer above)")
    enforce_eager: bool = arg(
        False, "CUDA: run every step eagerly (otherwise decode steps replay CUDA graphs captured "
        "per batch size)")
    max_seq_len_to_capture: int = arg(
        8192, "accepted, ignored (graphs are captured per batch size, for every length)")
    compilation_config: CompilationConfig | int | dict[str, Any] | None = arg(
        None, "an int level or a JSON object")
    disable_log_stats: bool = arg(False, "no periodic stats line while serving")
    allowed_local_media_path: str = arg("", "the folder whose files chat image_url parts may name (file://)")
    renderer_num_workers: int = arg(1, "accepted, ignored (no renderer pool)")
    kv_transfer_config: dict[str, Any] | None = arg(None, "not supported (no KV transfer)")
    cache_dir: str | None = arg(
        None, "where imported .gguf models are cached (default: $TRIOLLM_CACHE_DIR, else "
        "~/.cache/triollm)")
    # --- the actor layer (AsyncLLM / LLM)
    multiprocess: bool | None = arg(
        None, f"the engine core in a child process (default: ${MULTIPROCESS_ENV}, else true)")
    output_chunk_size: int = arg(
        128, "RequestOutputs built per chunk before yielding to the event loop")
    zmq_address: str = arg(
        "ipc", "'ipc' (a socket file in a private temp dir) or 'tcp://HOST' (ports chosen freely; "
        "CURVE-encrypted, and only the engine's own child may connect)")
    zmq_insecure_tcp: bool = arg(
        False, "explicit opt-in to PLAIN tcp for a tcp:// zmq_address: no CURVE, so the engine "
        "core's link is unauthenticated and unencrypted (anyone who reaches its ports can send it "
        "requests and read its outputs); needed only where libzmq lacks CURVE; no effect on ipc")
    engine_output_timeout_s: float | None = arg(
        60.0, "with work pending, seconds without any output from the engine core before it is "
        "declared dead (hung)")
    # --- request limits and backpressure (a request over a limit fails alone: HTTP 400 / 429)
    max_num_queued_reqs: int | None = arg(
        4096, "the most unfinished sequences (an n > 1 request counts n) beyond max_num_seqs; more "
        "are refused (HTTP 429); offline LLM batches wait instead (None: no limit)")
    max_num_queued_tokens: int | None = arg(
        1 << 20, "the most prompt tokens (counted once per sequence) waiting for the scheduler; "
        "more are refused (HTTP 429); offline LLM batches wait instead (None: no limit)")
    max_request_tokens: int = arg(
        1 << 20, "the most tokens one request may hold: its sequences (n) x (prompt tokens + "
        "stop_token_ids, allowed_token_ids, logit_bias and bad_words entries); more is refused "
        "(HTTP 400)")
    max_stop_strings: int = arg(64, "the most `stop` strings per request")
    max_stop_string_len: int = arg(1024, "the longest `stop` string, in characters")
    max_token_list_len: int = arg(
        8192, "the most entries in stop_token_ids, allowed_token_ids, bad_words or logit_bias")
    max_prompts_per_request: int = arg(1024, "the most prompts in one /v1/completions request")
    max_n: int = arg(128, "the largest `n` (parallel samples per request)")

    def __post_init__(self) -> None:
        # Normalised once, here: every way of building EngineArgs sees the same values.
        for name in ("model", "tokenizer", "download_dir"):  # a pathlib.Path works as its string
            value = getattr(self, name, None)
            if isinstance(value, os.PathLike):
                setattr(self, name, os.fspath(value))
        self.compilation_config = CompilationConfig.coerce(self.compilation_config)
        if self.max_model_len == -1:  # vLLM's "auto" (`--max-model-len auto`): the model's own
            self.max_model_len = None
        check_generation_config(self.generation_config, self.override_generation_config)
        check_hf_overrides(self.hf_overrides)
        self.dtype = canonical_dtype(self.dtype)
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
        one_of("runner", self.runner, RUNNERS)
        one_of("convert", self.convert, CONVERTS)
        if self.model_impl == "vllm":  # vLLM's spelling of "the engine's own classes"
            self.model_impl = "triollm"
        one_of("model_impl", self.model_impl, MODEL_IMPLS)
        one_of("load_format", self.load_format, LOAD_FORMATS)
        one_of(
            "tokenizer_mode", self.tokenizer_mode, TOKENIZER_MODES,
            "only fast tokenizers (tokenizer.json) are supported",
        )  # fmt: skip
        one_of("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES)
        if self.quantization is not None:
            one_of("quantization", self.quantization, QUANTIZATIONS, _QUANTIZATION_HINT)
        self.data_parallel_external_lb = check_parallel(self)
        check_gpu_memory_utilization(self.gpu_memory_utilization)

    def create_engine_config(self) -> EngineConfig:
        """Validate once and resolve: the frozen config the engine runs with (`create.py`)."""
        return create.create_engine_config(self, _defaults())

    # Two resolvers on their own, for a device other than this machine's (tests ask for CUDA's).

    def _cuda_graph_sizes(self, device: str) -> tuple[int, ...]:
        return cuda_graph_sizes(self, device)

    def _ignored_args(self, device: str) -> tuple[str, ...]:
        return ignored_args(self, _defaults(), device)

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
        if isinstance(parser, argparse.ArgumentParser):
            add_flags(dataclasses.fields(cls), parser.add_argument_group("engine"), skip)
        else:
            add_flags(dataclasses.fields(cls), parser, skip)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = set(cls.field_names())
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def _defaults() -> dict[str, object]:
    """Each field's default, by name (which ignored vLLM arguments were set)."""
    return {f.name: f.default for f in dataclasses.fields(EngineArgs)}
