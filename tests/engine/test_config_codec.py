"""The resolved `EngineConfig` survives the wire to an engine core elsewhere, field for field."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import msgspec
import pytest
import torch

from triollm.engine.config import EngineArgs, EngineConfig
from triollm.engine.config_codec import decode_config, encode_config


def _round_trip(config: EngineConfig) -> EngineConfig:
    back = decode_config(encode_config(config))
    assert back == config
    assert type(back.model.dtype) is torch.dtype and isinstance(back.model.path, Path)
    return back


def test_the_bundled_models_config_round_trips() -> None:
    """The default model (the bundled GGUF: quantized on a VNNI CPU, dense elsewhere)."""
    config = EngineArgs().create_engine_config()
    back = _round_trip(config)
    assert back.model.quantization == config.model.quantization
    assert back.model.cache_dtype == config.model.cache_dtype
    assert back.tokenizer == config.tokenizer and back.model.eos_token_ids == config.model.eos_token_ids


def test_a_tiny_checkpoints_config_round_trips(tiny_model_dir: Path) -> None:
    args = EngineArgs(
        model=str(tiny_model_dir),
        max_model_len=128,
        quantization="int8",
        kv_cache_dtype="bfloat16",
        num_threads=3,
        trust_remote_code=True,  # recorded in ignored_args
        engine_output_timeout_s=math.inf,  # JSON has no inf: MessagePack keeps it
        max_num_queued_tokens=4096,
    )
    config = args.create_engine_config()
    assert config.ignored_args == ("trust_remote_code",)
    back = _round_trip(config)
    assert back.model.kv_cache_dtype is torch.bfloat16 and back.actor.engine_output_timeout_s == math.inf
    # What a parent changes before sending (multiprocess off, a rank's fields) travels too.
    child = dataclasses.replace(
        config,
        num_threads=1,
        actor=dataclasses.replace(config.actor, multiprocess=False, data_parallel_rank=1, data_parallel_world=2),
    )
    _round_trip(child)


def test_a_pooling_models_config_round_trips(minilm_dir: Path) -> None:
    config = EngineArgs(model=str(minilm_dir)).create_engine_config()
    assert config.model.runner_type == "pooling" and config.model.encoder is not None
    back = _round_trip(config)
    assert back.model.pooler == config.model.pooler and back.model.encoder == config.model.encoder


def test_a_config_that_does_not_fit_is_refused_naming_the_field(tiny_model_dir: Path) -> None:
    config = EngineArgs(model=str(tiny_model_dir), max_model_len=64).create_engine_config()
    raw = msgspec.msgpack.decode(encode_config(config))
    raw["model"]["dtype"] = "not_a_dtype"
    with pytest.raises(ValueError, match=r"engine config: .*not a torch dtype name.*\$\.model\.dtype"):
        decode_config(msgspec.msgpack.encode(raw))
    raw["model"]["dtype"] = "float32"
    raw["cache"]["block_size"] = "16"
    with pytest.raises(ValueError, match=r"\$\.cache\.block_size"):
        decode_config(msgspec.msgpack.encode(raw))
