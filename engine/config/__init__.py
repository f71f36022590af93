"""Configuration: one user-facing schema (`EngineArgs`) validated once into a frozen `EngineConfig`.

What lives where:

- `args.py`: `EngineArgs`, flat, with vLLM's keyword names, so scripts work unchanged; its
  fields, the normalisation of what needs no model (`__post_init__`) and the CLI
  (`add_cli_args` / `from_cli_args`, through `cli.py`). It holds no policy.
- `create.py`: `create_engine_config`, which calls one resolver per concern, in order: what
  can be refused without the model first (a Hub model may have to be downloaded), then the
  model and what follows its sizes.
- One module per concern, each with its frozen config, its choices and its resolver, which
  raises `ValueError` naming the field and the allowed values: `model.py` (checkpoint,
  tokenizer, dtype, runner), `quantization.py` (weight scheme and KV cache dtype),
  `speculative.py` (speculative decoding and the draft model), `lora.py`, `parallel.py`
  (tensor, data and pipeline parallel sizes), `actor.py` (the frontend's link to the engine
  core), `cache.py` (KV cache), `scheduler.py`, `limits.py` (per-request limits),
  `compilation.py` (CUDA graphs), `ignored.py` (vLLM arguments accepted and ignored, warned
  about once per process). `engine_config.py` gathers them into `EngineConfig`; `checks.py`
  holds the two checks they share.
- `engine/envs.py`: the environment variables, read when the config is created
  (`$TRIOLLM_MULTIPROCESS` into `ActorConfig.multiprocess`).

A resolver reads `EngineArgs` through a Protocol naming the fields it reads (`LoRAArgs`, ...)
and never imports `EngineArgs`: the concerns sit below the schema, so the package has no import
circle and each resolver can be called, and tested, alone. Rejected: the policies as methods of
`EngineArgs` (the one module every feature edited), and resolvers taking each field as a
keyword argument (every call site would restate the fields it passes).

Everything derived from the model directory lives in `ModelConfig`. Sizes the engine measures at
start-up (the number of KV blocks) are returned by the code that measures them, never written
back here. `EngineConfig` travels to an engine core elsewhere as is (`engine/config_codec.py`).
"""

from __future__ import annotations

from triollm.engine.config import ignored as ignored
from triollm.engine.config.actor import ActorConfig
from triollm.engine.config.args import EngineArgs
from triollm.engine.config.cache import BLOCK_SIZES as BLOCK_SIZES
from triollm.engine.config.cache import CacheConfig
from triollm.engine.config.cli import HUMAN_INT_FIELDS as HUMAN_INT_FIELDS
from triollm.engine.config.cli import human_readable_int as human_readable_int
from triollm.engine.config.compilation import CompilationConfig
from triollm.engine.config.engine_config import EngineConfig
from triollm.engine.config.ignored import IGNORED_ARGS as IGNORED_ARGS
from triollm.engine.config.limits import LimitsConfig
from triollm.engine.config.lora import LORA_DTYPES as LORA_DTYPES
from triollm.engine.config.lora import LORA_RANKS as LORA_RANKS
from triollm.engine.config.lora import LoRAConfig
from triollm.engine.config.model import DTYPES as DTYPES
from triollm.engine.config.model import LOAD_FORMATS as LOAD_FORMATS
from triollm.engine.config.model import RUNNERS as RUNNERS
from triollm.engine.config.model import TOKENIZER_MODES as TOKENIZER_MODES
from triollm.engine.config.parallel import DP_BACKENDS as DP_BACKENDS
from triollm.engine.config.quantization import KV_CACHE_DTYPES as KV_CACHE_DTYPES
from triollm.engine.config.quantization import QUANTIZATIONS as QUANTIZATIONS
from triollm.engine.config.scheduler import PREFILL_BUDGETS as PREFILL_BUDGETS
from triollm.engine.config.scheduler import SCHEDULING_POLICIES as SCHEDULING_POLICIES
from triollm.engine.config.scheduler import SchedulerConfig
from triollm.engine.config.speculative import MAX_SPECULATIVE_TOKENS as MAX_SPECULATIVE_TOKENS
from triollm.engine.config.speculative import (
    SPEC_DISABLE_BY_BATCH_SIZE as SPEC_DISABLE_BY_BATCH_SIZE,
)
from triollm.engine.config.speculative import SPECULATIVE_KEYS as SPECULATIVE_KEYS
from triollm.engine.config.speculative import SPECULATIVE_METHODS as SPECULATIVE_METHODS
from triollm.engine.config.speculative import SpeculativeConfig
from triollm.engine.envs import MULTIPROCESS_ENV as MULTIPROCESS_ENV
from triollm.engine.loading.model_config import ModelConfig

__all__ = [
    "ActorConfig",
    "CacheConfig",
    "CompilationConfig",
    "EngineArgs",
    "EngineConfig",
    "LimitsConfig",
    "LoRAConfig",
    "ModelConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
]

# The public name's home is this package, as before the split (tests/test_exports.py pins it;
# trio's `fixup_module_metadata` does the same). Only `EngineArgs`: the frozen configs keep their
# modules, where msgspec resolves their annotations (engine/config_codec.py).
EngineArgs.__module__ = __name__
